#!/usr/bin/env bash
# Reproduces every number in docs/findings.md with drift's own commands and fixed seeds.
#
#   examples/findings.sh [--out DIR] [PART ...]     # DIR defaults to findings-out
#
# PART: a b c d claim1 ... claim7, or all (the default); or, not in all, rht, rht-tf, formats
# (rht and formats read ../shared/data/models/stories260K-hf: run from the repository's root),
# health, predict and advise (each its own runs, into DIR/PART). A part runs alone and trains
# what it needs; a run already in DIR from the same command is kept, so parts share their runs.
# CPU only, one torch thread a process, at most FINDINGS_JOBS (default 2) at a time. At the end it
# prints each part's key numbers, writes DIR/summary.json and draws DIR/plots/*.png.
set -euo pipefail

OUT=findings-out
PARTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        a|b|c|d|claim[1-7]|rht|rht-tf|formats|health|predict|advise|all) PARTS+=("$1"); shift ;;
        *) echo "findings.sh: unknown part '$1' (a b c d claim1..claim7 rht rht-tf formats health predict advise all)" >&2; exit 2 ;;
    esac
done
[ ${#PARTS[@]} -gt 0 ] || PARTS=(all)
if [ "${PARTS[*]}" = all ]; then
    PARTS=(a b claim1 claim2 claim3 claim4 claim5 claim6 claim7 c d)
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -x "$here/../.venv/bin/drift" ]; then
    PATH="$here/../.venv/bin:$PATH"
fi
PY=$(dirname "$(command -v drift)")/python
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS=1
JOBS=${FINDINGS_JOBS:-2}
mkdir -p "$OUT"
SECONDS=0
log() { printf '[%4ds] %s\n' "$SECONDS" "$*" >&2; }

# once CMD...: run a drift train / probe command unless its folder already holds the result of
# this very command (a stamp next to it), so parts that share a run train it once; a new
# training run drops the stamps of what was made from the old one.
once() {
    local target="" stamp prev="" arg
    for arg in "$@"; do
        if [ "$prev" = --out ] && [ "$2" = train ]; then target=$arg; fi
        prev=$arg
    done
    if [ "$2" = probe ]; then target=$3; fi
    stamp="$target/.findings-$2.cmd"
    if [ -n "$target" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$*" ]; then
        return 0
    fi
    if [ "$2" = train ] && [ -d "$target" ]; then rm -f "$target"/.findings-*.cmd; fi
    "$@"
    [ -z "$target" ] || printf '%s' "$*" > "$stamp"
}
# bg CMD...: once CMD in the background, at most $JOBS at a time; join: wait for them all and
# stop at the first that failed
PIDS=()
bg() {
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.2; done
    once "$@" &
    PIDS+=($!)
}
join() {
    local pid failed=0
    for pid in "${PIDS[@]}"; do wait "$pid" || failed=1; done
    PIDS=()
    if [ $failed -ne 0 ]; then log "a drift command failed"; exit 1; fi
}
# fresh FILE FROM: FILE exists and is newer than FROM (a dump of that checkpoint is made)
fresh() { [ -f "$1" ] && [ "$1" -nt "$2" ]; }

mkdir -p "$OUT/policies"
# Forward-only: the forward matmuls cast as the preset does, dgrad and wgrad left plain.
cat > "$OUT/policies/fwd_mxfp4.toml" <<'EOF'
name = "mxfp4_e2m1-forward-only"
preset = "mxfp4_e2m1"
dgrad = "plain"
wgrad = "plain"
EOF
cat > "$OUT/policies/fwd_mxfp8.toml" <<'EOF'
name = "mxfp8_e4m3-forward-only"
preset = "mxfp8_e4m3"
dgrad = "plain"
wgrad = "plain"
EOF
cat > "$OUT/policies/dy_mxfp4.toml" <<'EOF'
# mxfp4_e2m1 everywhere except the backward's high-precision operand: dgrad casts dY but not W,
# wgrad casts dY but not X (one backward operand cast instead of two)
name = "mxfp4_e2m1-backward-dy-only"
preset = "mxfp4_e2m1"
[dgrad]
rhs = "none"
[wgrad]
lhs = "none"
EOF
cat > "$OUT/policies/wx_mxfp4.toml" <<'EOF'
# the complement: the backward casts W (dgrad) and X (wgrad) but leaves dY uncast
name = "mxfp4_e2m1-backward-no-dy"
preset = "mxfp4_e2m1"
[dgrad]
lhs = "none"
[wgrad]
rhs = "none"
EOF
# The seed study's first GPU check: forward cast, backward uncast, its result cast afterwards
# (a wrong method, kept for comparison; docs/arithmetic.md#casting-results-is-not-casting-operands)
cat > "$OUT/policies/result_mxfp8.toml" <<'EOF'
name = "mxfp8_e4m3-result-cast"
preset = "mxfp8_e4m3"
backward_cast = "result"
EOF
cat > "$OUT/policies/result_mxfp4.toml" <<'EOF'
name = "mxfp4_e2m1-result-cast"
preset = "mxfp4_e2m1"
backward_cast = "result"
EOF
# Every matmul cast as mxfp8_e4m3 except attention's two (q·kᵀ, P·v), kept in float32
cat > "$OUT/policies/keep_attention_mxfp8.toml" <<'EOF'
name = "mxfp8_e4m3-keep-attention"
preset = "mxfp8_e4m3"
keep_matmuls = ["attention"]
EOF

# ---------------------------------------------------------------- the exact runs (a, b, d, claims 1, 5, 7)
# 1000 steps at the default rate (AdamW, 3e-3), checkpoints every 250 steps, seeds 0, 1, 2
exact_runs() {
    log "exact runs: tanh MLP and transformer, 1000 steps, seeds 0-2"
    for seed in 0 1 2; do
        bg drift train --model mlp --steps 1000 --seed $seed --checkpoint-every 250 --log-every 50 --eval-every 250 --measure-cast mxfp8_e4m3 --threads 1 --out "$OUT/mlp-exact-s$seed" --overwrite -q
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --steps 1000 --seed $seed --checkpoint-every 250 --log-every 50 --eval-every 250 --measure-cast mxfp8_e4m3 --threads 1 --out "$OUT/tf-exact-s$seed" --overwrite -q
    done
    join
}

# every probe of the exact runs in one call per run (a probe writes RUN/probe.parquet)
exact_probes() {
    exact_runs
    log "probes of the exact runs' checkpoints"
    for seed in 0 1 2; do
        bg drift probe "$OUT/mlp-exact-s$seed" -p exact -p fp8_e4m3 -p mxfp8_e4m3 -p mxfp8_e4m3_floor+1 -p nvfp4 -p mxfp4_e2m1 -p mxfp4_e2m1_ceil -p nvfp4:sr --draws 16 --seed 0 --threads 1 -q --overwrite
        bg drift probe "$OUT/tf-exact-s$seed" -p exact -p fp8_e4m3 -p mxfp8_e4m3 -p mxfp8_e4m3_floor+1 -p nvfp4 -p mxfp4_e2m1 -p mxfp4_e2m1_ceil --threads 1 -q --overwrite
    done
    join
}

# one batch through the step-1000 weights with every matmul operand recorded
exact_dumps() {
    exact_runs
    mkdir -p "$OUT/a"
    for seed in 0 1 2; do
        fresh "$OUT/a/mlp-s$seed.safetensors" "$OUT/mlp-exact-s$seed/step-001000.safetensors" ||
            drift dump "$OUT/mlp-exact-s$seed/step-001000.safetensors" --batch 64 --seed 0 --threads 1 --out "$OUT/a/mlp-s$seed.safetensors" -q
        fresh "$OUT/a/tf-s$seed.safetensors" "$OUT/tf-exact-s$seed/step-001000.safetensors" ||
            drift dump "$OUT/tf-exact-s$seed/step-001000.safetensors" --batch 16 --seed 0 --threads 1 --out "$OUT/a/tf-s$seed.safetensors" -q
    done
}

part_a() {
    exact_dumps
    log "(a) clip rates of the step-1000 operands"
    for seed in 0 1 2; do
        drift clip-rate "$OUT/a/mlp-s$seed.safetensors" -c mxfp8_e4m3 -c mxfp8_e4m3_floor+1 --out "$OUT/a/clip-mlp-s$seed" -q --overwrite
        drift clip-rate "$OUT/a/tf-s$seed.safetensors" -c mxfp8_e4m3 -c mxfp8_e4m3_floor+1 --out "$OUT/a/clip-tf-s$seed" -q --overwrite
    done
}

part_b() {
    exact_dumps
    log "(b) operand error and bias"
    for seed in 0 1 2; do
        drift error-bias "$OUT/a/mlp-s$seed.safetensors" -c fp8_e4m3 -c mxfp8_e4m3 -c mxfp8_e4m3_floor+1 --out "$OUT/b/eb-mlp-s$seed" -q --overwrite
        drift error-bias "$OUT/a/tf-s$seed.safetensors" -c fp8_e4m3 -c mxfp8_e4m3 -c mxfp8_e4m3_floor+1 --out "$OUT/b/eb-tf-s$seed" -q --overwrite
    done
    exact_probes
}

claim1() {
    exact_probes
}

# ---------------------------------------------------------------- MXFP8 at lr 0.01 (claims 2, 3, 4, 6)
# divergence: a step's loss above 2x the lowest loss so far (docs/findings.md#the-divergence-rule)
claim2() {
    log "claim 2: MXFP8 casting both backward operands, MLP and transformer, lr 0.01"
    for seed in 0 1 2; do
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy mxfp8_e4m3 --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 250 --log-every 50 --eval-every 250 --threads 1 --out "$OUT/lr01/tf-mxfp8-s$seed" --overwrite -q
        bg drift train --model mlp --policy mxfp8_e4m3 --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 250 --log-every 50 --eval-every 250 --threads 1 --out "$OUT/lr01/mlp-mxfp8-s$seed" --overwrite -q
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy exact --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --measure-cast mxfp8_e4m3 --threads 1 --out "$OUT/lr01/tf-exact-s$seed" --overwrite -q
        bg drift train --model mlp --policy exact --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --log-every 0 --eval-every 250 --threads 1 --out "$OUT/lr01/mlp-exact-s$seed" --overwrite -q
    done
    join
}

claim3() {
    claim2
    log "claim 3: the backward's result cast instead of its operands"
    for seed in 0 1 2; do
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy "$OUT/policies/result_mxfp8.toml" --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/lr01/tf-result-s$seed" --overwrite -q
        bg drift train --model mlp --policy "$OUT/policies/result_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp4-result-s$seed" --overwrite -q
        bg drift train --model mlp --policy mxfp4_e2m1 --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp4-recast-s$seed" --overwrite -q
    done
    join
}

claim4() {
    claim2
    log "claim 4: one more binade of scale headroom (floor+1)"
    for seed in 0 1 2; do
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy mxfp8_e4m3_floor+1 --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/lr01/tf-floor1-s$seed" --overwrite -q
        bg drift train --model mlp --policy mxfp8_e4m3 --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp8-recast-s$seed" --overwrite -q
        bg drift train --model mlp --policy mxfp8_e4m3_floor+1 --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp8-floor1-s$seed" --overwrite -q
    done
    join
}

claim5() {
    exact_runs
    claim2
    log "claim 5: softmax probabilities against tanh outputs, per layer and checkpoint"
    mkdir -p "$OUT/claim5"
    for seed in 0 1 2; do
        for step in 000250 000500 000750 001000; do
            fresh "$OUT/claim5/tf-s$seed-$step.safetensors" "$OUT/tf-exact-s$seed/step-$step.safetensors" ||
                drift dump "$OUT/tf-exact-s$seed/step-$step.safetensors" --batch 16 --seed 0 --threads 1 --out "$OUT/claim5/tf-s$seed-$step.safetensors" -q
            fresh "$OUT/claim5/mlp-s$seed-$step.safetensors" "$OUT/mlp-exact-s$seed/step-$step.safetensors" ||
                drift dump "$OUT/mlp-exact-s$seed/step-$step.safetensors" --batch 64 --seed 0 --threads 1 --out "$OUT/claim5/mlp-s$seed-$step.safetensors" -q
        done
    done
    # one table per model, a row per tensor of every dump (its source names seed and step)
    drift clip-rate "$OUT"/claim5/tf-s*.safetensors -c mxfp8_e4m3 --out "$OUT/claim5/clip-tf" -q --overwrite
    drift clip-rate "$OUT"/claim5/mlp-s*.safetensors -c mxfp8_e4m3 --out "$OUT/claim5/clip-mlp" -q --overwrite
}

claim6() {
    claim2
    log "claim 6: the attention matmuls kept in float32"
    for seed in 0 1 2; do
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy "$OUT/policies/keep_attention_mxfp8.toml" --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/lr01/tf-keepattn-s$seed" --overwrite -q
    done
    join
}

claim7() {
    exact_probes
    log "claim 7: MXFP4 with the scale rounded down (floor) or up (ceil)"
    for seed in 0 1 2; do
        bg drift train --model mlp --policy mxfp4_e2m1 --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 250 --log-every 50 --eval-every 250 --threads 1 --out "$OUT/claim7/mlp-floor-s$seed" --overwrite -q
        bg drift train --model mlp --policy mxfp4_e2m1_ceil --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 250 --log-every 50 --eval-every 250 --threads 1 --out "$OUT/claim7/mlp-ceil-s$seed" --overwrite -q
    done
    join
    for seed in 0 1 2; do
        bg drift probe "$OUT/claim7/mlp-floor-s$seed" -p exact -p mxfp4_e2m1 -p mxfp4_e2m1_ceil --threads 1 -q --overwrite
        bg drift probe "$OUT/claim7/mlp-ceil-s$seed" -p exact -p mxfp4_e2m1 -p mxfp4_e2m1_ceil --threads 1 -q --overwrite
    done
    join
}

# ---------------------------------------------------------------- (c): which backward operand (lr 0.03)
part_c() {
    log "(c) recast against forward-only and one-operand backwards, MLP, lr 0.03"
    for seed in 0 1 2; do
        bg drift train --model mlp --policy mxfp4_e2m1 --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp4-recast-s$seed" --overwrite -q
        bg drift train --model mlp --policy "$OUT/policies/fwd_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp4-fwd-s$seed" --overwrite -q
        bg drift train --model mlp --policy "$OUT/policies/dy_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp4-dyonly-s$seed" --overwrite -q
        bg drift train --model mlp --policy "$OUT/policies/wx_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp4-nody-s$seed" --overwrite -q
        bg drift train --model mlp --policy exact --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 0 --eval-every 250 --threads 1 --out "$OUT/c/exact-s$seed" --overwrite -q
        bg drift train --model mlp --policy mxfp8_e4m3 --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp8-recast-s$seed" --overwrite -q
        bg drift train --model mlp --policy "$OUT/policies/fwd_mxfp8.toml" --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/c/mxfp8-fwd-s$seed" --overwrite -q
    done
    join
}

# ---------------------------------------------------------------- (d): SR against RNE over a run
part_d() {
    exact_probes
    log "(d) nvfp4 with round-to-nearest and with stochastic rounding, MLP, 1000 steps"
    for seed in 0 1 2; do
        bg drift train --model mlp --policy nvfp4 --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/d/nvfp4-rne-s$seed" --overwrite -q
        bg drift train --model mlp --policy nvfp4:sr --steps 1000 --seed $seed --log-every 50 --eval-every 250 --threads 1 --out "$OUT/d/nvfp4-sr-s$seed" --overwrite -q
    done
    join
}

# ---------------------------------------------------------------- rht: the Hadamard transform and 4/6
# stories260K, one step's operands (4 windows of 16 tokens), the wgrad's X and dY blocked along
# the tokens; grad-cosine of te/nvfp4_recipe (and the recipe without its RHT) on 4 batches.
# Not a part of all; its numbers go to $OUT/rht/summary.json (examples/findings_rht.py).
part_rht() {
    log "rht: RHT and 4/6 on stories260K's wgrad operands, grad-cosine on 4 batches"
    mkdir -p "$OUT/rht"
    cat > "$OUT/rht/story.txt" <<'EOF'
Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball under a tree. She wanted to play with it, but her friend Tom said, "That is my ball!" Lily was sad. Tom saw that she was sad and said, "We can play together." They played all day and had lots of fun.
EOF
    printf '%s\n' "Once upon a time, there was a little girl named Lily. She loved to play outside in the park." > "$OUT/rht/b0.txt"
    printf '%s\n' "One day, she saw a big, red ball under a tree. She wanted to play with it, but it was too high." > "$OUT/rht/b1.txt"
    printf '%s\n' "Tom saw that she was sad and said, \"We can play together.\" They played all day and had lots of fun." > "$OUT/rht/b2.txt"
    printf '%s\n' "The sun was shining and the birds were singing. Ben and his mom went to the store to buy some milk." > "$OUT/rht/b3.txt"
    # te/nvfp4_recipe with its wgrad casts as they are but without the transform
    cat > "$OUT/policies/te_nvfp4_recipe_no_rht.toml" <<'EOF'
name = "te-nvfp4-recipe-no-rht"
preset = "te/nvfp4_recipe"
[wgrad]
lhs = "te/nvfp4"
rhs = "te/nvfp4:sr"
EOF
    drift dump ../shared/data/models/stories260K-hf --text "$OUT/rht/story.txt" --batch 4 --context 16 --out "$OUT/rht/dump.safetensors" -q
    for cmd in clip-rate underflow-rate error-bias; do
        drift $cmd "$OUT/rht/dump.safetensors" -c te/nvfp4 -c te/nvfp4_rht -c te/nvfp4_4over6 -c te/nvfp4_4over6_mse --include '*/activation' --include '*/gradient' --exclude '*self_attn/*' --axis -2 --out "$OUT/rht/scan" --overwrite -q
    done
    for b in 0 1 2 3; do
        bg drift grad-cosine ../shared/data/models/stories260K-hf -p nvfp4 -p te/nvfp4 -p te/nvfp4_recipe -p "$OUT/policies/te_nvfp4_recipe_no_rht.toml" --text "$OUT/rht/b$b.txt" --tokens 16 --draws 4 --out "$OUT/rht/gc-b$b" --overwrite -q
    done
    join
    "$PY" "$here/findings_rht.py" "$OUT"
}

# ---------------------------------------------------------------- health: does drift health predict?
# The runs of claims 2 and 4 (transformer, lr 0.01: mxfp8_e4m3 diverges, floor+1 does not) and of
# (c) (MLP, lr 0.03: mxfp4_e2m1 casting both backward operands diverges, forward-only does not),
# seeds 0-2, as there but a checkpoint every 25 steps and no operand logging; drift health on
# each under the policy's own cast. Not a part of all; the numbers go to $OUT/health/summary.json
# and the figure to $OUT/health/health.png (examples/findings_health.py).
part_health() {
    log "health: the diverging and the surviving runs, a checkpoint every 25 steps"
    local H="$OUT/health"
    mkdir -p "$H"
    for seed in 0 1 2; do
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy mxfp8_e4m3 --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 25 --log-every 0 --eval-every 250 --threads 1 --out "$H/tf-mxfp8-s$seed" --overwrite -q
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy mxfp8_e4m3_floor+1 --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 25 --log-every 0 --eval-every 250 --threads 1 --out "$H/tf-floor1-s$seed" --overwrite -q
        bg drift train --model mlp --policy mxfp4_e2m1 --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 25 --log-every 0 --eval-every 250 --threads 1 --out "$H/mlp-recast-s$seed" --overwrite -q
        bg drift train --model mlp --policy "$OUT/policies/fwd_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 25 --log-every 0 --eval-every 250 --threads 1 --out "$H/mlp-fwd-s$seed" --overwrite -q
    done
    join
    for seed in 0 1 2; do
        for run in tf-mxfp8 tf-floor1; do
            bg drift health "$H/$run-s$seed" -c mxfp8_e4m3 --grad-cast mxfp8_e4m3 --state-layout torchao-8bit --window 8 --threads 1 --overwrite -q
        done
        for run in mlp-recast mlp-fwd; do
            bg drift health "$H/$run-s$seed" -c mxfp4_e2m1 --grad-cast mxfp4_e2m1 --state-layout torchao-8bit --window 8 --threads 1 --overwrite -q
        done
    done
    join
    "$PY" "$here/findings_health.py" "$H"
}

# ---------------------------------------------------------------- predict: the early-warning study
# Two groups of 16 runs that share their cast and differ only in learning rate and seed, so
# that some diverge and some do not: the findings' transformer under mxfp8_e4m3 at lr 0.004,
# 0.0055, 0.007 and 0.01, and the tanh MLP under mxfp4_e2m1 (both backward operands cast) at
# lr 0.005, 0.01, 0.02 and 0.03; seeds 0-3, 1,000 steps, operands logged every 5 steps.
# Seeds 0 and 1 fit each signal's rule, seeds 2 and 3 judge it. Not a part of all; the tables
# go to $OUT/predict/summary.json and signals.parquet (examples/findings_predict.py,
# driftcli.runs.predict).
part_predict() {
    log "predict: 32 runs near the divergence edge, operands logged every 5 steps"
    local P="$OUT/predict"
    mkdir -p "$P"
    for seed in 0 1 2 3; do
        for lr in 0.004 0.0055 0.007 0.01; do
            bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy mxfp8_e4m3 --lr $lr --diverge-factor 2 --steps 1000 --seed $seed --log-every 5 --eval-every 250 --threads 1 --out "$OUT/predict/tf-lr$lr-s$seed" --overwrite -q
        done
        for lr in 0.005 0.01 0.02 0.03; do
            bg drift train --model mlp --policy mxfp4_e2m1 --lr $lr --diverge-factor 2 --steps 1000 --seed $seed --log-every 5 --eval-every 250 --threads 1 --out "$OUT/predict/mlp-lr$lr-s$seed" --overwrite -q
        done
    done
    join
    "$PY" "$here/findings_predict.py" "$P"
}

# ---------------------------------------------------------------- rht-tf: the same on the study's transformer
# The findings' transformer (2 blocks, d_model 64, tanh MLP, context 32) trained 100 steps, seed
# 0; one step's operands (4 windows of 32 bytes), the wgrad's X and dY of its 9 linear maps
# blocked along the tokens; grad-cosine of the recipe on 4 windows of the story. Not a part of
# all; tests/test_findings_rht_transformer.py re-runs it and holds the doc's numbers.
part_rht_tf() {
    log "rht-tf: RHT and 4/6 on the findings' transformer"
    mkdir -p "$OUT/rht-tf" "$OUT/policies"
    cat > "$OUT/rht-tf/story.txt" <<'EOF'
Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball under a tree. She wanted to play with it, but her friend Tom said, "That is my ball!" Lily was sad. Tom saw that she was sad and said, "We can play together." They played all day and had lots of fun.
EOF
    cat > "$OUT/policies/te_nvfp4_recipe_no_rht.toml" <<'EOF'
name = "te-nvfp4-recipe-no-rht"
preset = "te/nvfp4_recipe"
[wgrad]
lhs = "te/nvfp4"
rhs = "te/nvfp4:sr"
EOF
    drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --steps 100 --seed 0 --checkpoint-every 100 --threads 1 --out "$OUT/rht-tf/run" --overwrite -q
    drift dump "$OUT/rht-tf/run/step-000100.safetensors" --batch 4 --context 32 --out "$OUT/rht-tf/dump.safetensors" -q
    for cmd in clip-rate underflow-rate error-bias; do
        drift $cmd "$OUT/rht-tf/dump.safetensors" -c te/nvfp4 -c te/nvfp4_rht -c te/nvfp4_4over6 -c te/nvfp4_4over6_mse --include '*/activation' --include '*/gradient' --exclude '*attn/*' --axis -2 --out "$OUT/rht-tf/scan" --overwrite -q
    done
    drift grad-cosine "$OUT/rht-tf/run/step-000100.safetensors" -p nvfp4 -p te/nvfp4 -p te/nvfp4_recipe -p "$OUT/policies/te_nvfp4_recipe_no_rht.toml" --text "$OUT/rht-tf/story.txt" --tokens 32 --windows 4 --draws 4 --out "$OUT/rht-tf/gc" --overwrite -q
}


# ---------------------------------------------------------------- formats: the formats after OCP
# error-bias and clip-rate of the 8- and 4-bit casts on stories260K's 47 weight tensors, run in
# DIR/formats beside a link to the shared checkpoint (so the commands read as the page quotes
# them). Not a part of all; tests/test_findings_formats.py re-runs the scans and holds the table.
part_formats() {
    log "formats: HiFloat8, HiFloat4 and P3109 against E4M3, MXFP4 and NVFP4 on stories260K"
    mkdir -p "$OUT/formats"
    ln -sfn "$(pwd)/../shared/data/models/stories260K-hf" "$OUT/formats/stories260K-hf"
    (
        cd "$OUT/formats"
        drift error-bias stories260K-hf/model.safetensors -c fp8_e4m3 -c hifloat8 -c hifloat8:tensor -c binary8p4se:tensor -c mxfp4_e2m1 -c nvfp4 -c binary4p2sf:block32 -c hifloat4 --out scan --overwrite -q
        drift clip-rate stories260K-hf/model.safetensors -c fp8_e4m3 -c hifloat8 -c hifloat8:tensor -c binary8p4se:tensor -c mxfp4_e2m1 -c nvfp4 -c binary4p2sf:block32 -c hifloat4 --out scan --overwrite -q
    )
}

# ---------------------------------------------------------------- advise: the advisor against the world
# Claims 2 and 4's transformer at lr 0.01 under mxfp8_e4m3 (diverges at every seed), seeds 0-2,
# no operand logging; drift advise at step 100 of seed 0's run (the first 2,048 bytes of the
# corpus, 4 batches of 16 windows of 32 bytes), budget 0.15 of the matmul work kept in bf16;
# the same budget given to the last layers and to random draws (seeds 1, 3 and 4: seed 2
# draws the same layers as seed 1; and seed 6, the first draw to keep an MLP map, added after
# the others had run); each policy trained at
# seeds 0-2. Not a part of all; the numbers go to $OUT/advise/summary.json
# (examples/findings_advise.py).
part_advise() {
    log "advise: the advised hybrid against the last layers and random draws, 18 runs"
    local A="$OUT/advise" corpus
    mkdir -p "$A"
    corpus=$("$PY" -c 'from driftcli.text import default_corpus; print(default_corpus())')
    for seed in 0 1 2; do
        bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy mxfp8_e4m3 --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --checkpoint-every 100 --log-every 0 --eval-every 250 --threads 1 --out "$A/mxfp8-s$seed" --overwrite -q
    done
    join
    drift advise "$A/mxfp8-s0/step-000100.safetensors" -c mxfp8_e4m3 --budget 0.15 --text "$corpus" --tokens 32 --windows 16 --batches 4 --out "$A/advised" --overwrite -q
    drift advise "$A/mxfp8-s0/step-000100.safetensors" -c mxfp8_e4m3 --budget 0.15 --text "$corpus" --tokens 32 --windows 16 --batches 1 --choose last --out "$A/last" --overwrite -q
    for draw in 1 3 4 6; do
        drift advise "$A/mxfp8-s0/step-000100.safetensors" -c mxfp8_e4m3 --budget 0.15 --text "$corpus" --tokens 32 --windows 16 --batches 1 --choose random --choose-seed $draw --out "$A/random-$draw" --overwrite -q
    done
    for choice in advised random-1 random-3 random-4 last random-6; do
        for seed in 0 1 2; do
            bg drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --policy "$A/$choice/advise.toml" --lr 0.01 --diverge-factor 2 --steps 1000 --seed $seed --log-every 0 --eval-every 250 --threads 1 --out "$A/$choice-s$seed" --overwrite -q
        done
    done
    join
    "$PY" "$here/findings_advise.py" "$A"
}

for part in "${PARTS[@]}"; do
    case "$part" in
        a) part_a ;; b) part_b ;; c) part_c ;; d) part_d ;;
        claim1) claim1 ;; claim2) claim2 ;; claim3) claim3 ;; claim4) claim4 ;;
        claim5) claim5 ;; claim6) claim6 ;; claim7) claim7 ;; rht) part_rht ;;
        health) part_health ;;
        predict) part_predict ;;
        advise) part_advise ;;
        rht-tf) part_rht_tf ;;
        formats) part_formats ;;
    esac
done
join

log "summary"
STUDY_PARTS=()
for part in "${PARTS[@]}"; do
    case "$part" in rht|rht-tf|formats|health|predict) ;; *) STUDY_PARTS+=("$part") ;; esac
done
[ ${#STUDY_PARTS[@]} -eq 0 ] || "$PY" "$here/findings_summary.py" "$OUT" "$SECONDS" "${STUDY_PARTS[@]}"
log "done: $OUT/summary.json, $OUT/plots/"
