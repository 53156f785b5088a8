#!/usr/bin/env bash
# Reproduces every number in docs/findings.md with drift's own commands and fixed seeds.
#
#   bash examples/findings.sh [OUT]        # OUT defaults to findings-out
#
# CPU only, one torch thread per process, at most two drift processes at a time. It prints the
# key numbers at the end and writes them to OUT/summary.json. Shakespeare (the default text) is
# fetched once and cached by drift itself.
set -euo pipefail

OUT=${1:-findings-out}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -x "$here/../.venv/bin/drift" ]; then
    PATH="$here/../.venv/bin:$PATH"
fi
PY=$(dirname "$(command -v drift)")/python
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
SECONDS=0
log() { printf '[%4ds] %s\n' "$SECONDS" "$*" >&2; }

# Forward-only policies: the forward matmuls cast as the preset does, dgrad and wgrad left plain.
cat > "$OUT/fwd_mxfp4.toml" <<'EOF'
name = "mxfp4_e2m1-forward-only"
preset = "mxfp4_e2m1"
dgrad = "plain"
wgrad = "plain"
EOF
cat > "$OUT/dy_mxfp4.toml" <<'EOF'
# mxfp4_e2m1 everywhere except the backward's high-precision operand: dgrad casts dY but not W,
# wgrad casts dY but not X (one backward operand cast instead of two)
name = "mxfp4_e2m1-backward-dy-only"
preset = "mxfp4_e2m1"
[dgrad]
rhs = "none"
[wgrad]
lhs = "none"
EOF
cat > "$OUT/wx_mxfp4.toml" <<'EOF'
# the complement: the backward casts W (dgrad) and X (wgrad) but leaves dY uncast
name = "mxfp4_e2m1-backward-no-dy"
preset = "mxfp4_e2m1"
[dgrad]
lhs = "none"
[wgrad]
rhs = "none"
EOF
cat > "$OUT/fwd_mxfp8.toml" <<'EOF'
name = "mxfp8_e4m3-forward-only"
preset = "mxfp8_e4m3"
dgrad = "plain"
wgrad = "plain"
EOF

# ---------------------------------------------------------------- (a), (b), (d): the tanh MLP
log "tanh MLP, exact, 300 steps"
drift train --model mlp --steps 300 --seed 0 --checkpoint-every 100 --measure-cast mxfp8_e4m3 --threads 1 --out "$OUT/mlp" --overwrite -q
drift dump "$OUT/mlp/step-000300.safetensors" --batch 64 --seed 0 --threads 1 --out "$OUT/mlp/dump.safetensors" -q
drift clip-rate "$OUT/mlp/dump.safetensors" -c mxfp8_e4m3 -c mxfp8_e4m3_floor+1 --out "$OUT/mlp/clip" -q
drift error-bias "$OUT/mlp/dump.safetensors" -c fp8_e4m3 -c mxfp8_e4m3 -c mxfp8_e4m3_floor+1 --out "$OUT/mlp/eb" -q
log "probe of the MLP's checkpoints"
drift probe "$OUT/mlp" -p exact -p fp8_e4m3 -p mxfp8_e4m3 -p mxfp8_e4m3_floor+1 -p nvfp4 -p nvfp4:sr -p mxfp4_e2m1:sr --draws 32 --seed 0 --threads 1 -q

# ---------------------------------------------------------------- (a), (b): the transformer, tanh MLP
log "transformer (tanh MLP), exact, 300 steps"
drift train --model transformer --activation tanh --layers 2 --d-model 64 --context 32 --batch 16 --steps 300 --seed 0 --checkpoint-every 100 --measure-cast mxfp8_e4m3 --log-every 50 --threads 1 --out "$OUT/tf" --overwrite -q
drift dump "$OUT/tf/step-000300.safetensors" --batch 16 --seed 0 --threads 1 --out "$OUT/tf/dump.safetensors" -q
drift clip-rate "$OUT/tf/dump.safetensors" -c mxfp8_e4m3 -c mxfp8_e4m3_floor+1 --out "$OUT/tf/clip" -q
drift error-bias "$OUT/tf/dump.safetensors" -c fp8_e4m3 -c mxfp8_e4m3 -c mxfp8_e4m3_floor+1 --out "$OUT/tf/eb" -q
log "probe of the transformer's checkpoints"
drift probe "$OUT/tf" -p exact -p fp8_e4m3 -p mxfp8_e4m3 -p mxfp8_e4m3_floor+1 --threads 1 -q

# ---------------------------------------------------------------- (c): recast against forward-only
# Learning rate 0.03 (10x the default), divergence = loss above 2x its running minimum.
for seed in 0 1 2; do
    log "(c) seed $seed: mxfp4_e2m1 recast / forward-only"
    drift train --model mlp --policy mxfp4_e2m1 --lr 0.03 --diverge-factor 2 --steps 300 --seed $seed --log-every 50 --eval-every 100 --threads 1 --out "$OUT/c/mxfp4-recast-s$seed" --overwrite -q &
    pid=$!
    drift train --model mlp --policy "$OUT/fwd_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 300 --seed $seed --log-every 50 --eval-every 100 --threads 1 --out "$OUT/c/mxfp4-fwd-s$seed" --overwrite -q
    wait $pid
    log "(c) seed $seed: mxfp8_e4m3 recast / forward-only"
    drift train --model mlp --policy mxfp8_e4m3 --lr 0.03 --diverge-factor 2 --steps 300 --seed $seed --log-every 50 --eval-every 100 --threads 1 --out "$OUT/c/mxfp8-recast-s$seed" --overwrite -q &
    pid=$!
    drift train --model mlp --policy "$OUT/fwd_mxfp8.toml" --lr 0.03 --diverge-factor 2 --steps 300 --seed $seed --log-every 50 --eval-every 100 --threads 1 --out "$OUT/c/mxfp8-fwd-s$seed" --overwrite -q
    wait $pid
    log "(c) seed $seed: mxfp4_e2m1 with dY as the only cast backward operand / exact"
    drift train --model mlp --policy "$OUT/dy_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 300 --seed $seed --log-every 50 --eval-every 100 --threads 1 --out "$OUT/c/mxfp4-dyonly-s$seed" --overwrite -q &
    pid=$!
    drift train --model mlp --policy exact --lr 0.03 --diverge-factor 2 --steps 300 --seed $seed --log-every 0 --eval-every 100 --threads 1 --out "$OUT/c/exact-s$seed" --overwrite -q
    wait $pid
done
# the complement of the dY-only arm, two seeds at a time
drift train --model mlp --policy "$OUT/wx_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 300 --seed 0 --log-every 50 --eval-every 100 --threads 1 --out "$OUT/c/mxfp4-nody-s0" --overwrite -q &
pid=$!
drift train --model mlp --policy "$OUT/wx_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 300 --seed 1 --log-every 50 --eval-every 100 --threads 1 --out "$OUT/c/mxfp4-nody-s1" --overwrite -q
wait $pid
drift train --model mlp --policy "$OUT/wx_mxfp4.toml" --lr 0.03 --diverge-factor 2 --steps 300 --seed 2 --log-every 50 --eval-every 100 --threads 1 --out "$OUT/c/mxfp4-nody-s2" --overwrite -q

# ---------------------------------------------------------------- (d): SR against RNE over a run
for seed in 0 1 2; do
    log "(d) seed $seed: nvfp4 rne / sr"
    drift train --model mlp --policy nvfp4 --steps 300 --seed $seed --log-every 50 --eval-every 100 --threads 1 --out "$OUT/d/nvfp4-rne-s$seed" --overwrite -q &
    pid=$!
    drift train --model mlp --policy nvfp4:sr --steps 300 --seed $seed --log-every 50 --eval-every 100 --threads 1 --out "$OUT/d/nvfp4-sr-s$seed" --overwrite -q
    wait $pid
done
drift train --model mlp --steps 300 --seed 1 --log-every 0 --eval-every 100 --threads 1 --out "$OUT/d/exact-s1" --overwrite -q &
pid=$!
drift train --model mlp --steps 300 --seed 2 --log-every 0 --eval-every 100 --threads 1 --out "$OUT/d/exact-s2" --overwrite -q
wait $pid

log "summary"
"$PY" - "$OUT" "$SECONDS" <<'EOF'
import json, sys
from pathlib import Path
import pandas as pd

out = Path(sys.argv[1]); seconds = int(sys.argv[2])
S = {"seconds_before_summary": seconds}
star = lambda d: d[d.tensor == "*"]

def cast_name(spec):
    if ":tensor:" in spec: return "fp8_e4m3"
    if ":floor+1:" in spec: return "mxfp8_e4m3_floor+1"
    if ":floor:" in spec: return "mxfp8_e4m3"
    return spec

def tanh_clip(model, pattern):
    d = pd.read_parquet(out / model / "clip" / "clip-rate.parquet")
    d = d[d.tensor != "*"].copy(); d["c"] = d.cast.map(cast_name)
    t = d[d.tensor.str.fullmatch(pattern)]
    res = {}
    for c, g in t.groupby("c"):
        res[c] = {"pooled": round(g.clipped.sum() / g.n_finite.sum(), 4),
                  "per_tensor": {r.tensor: round(r.clip_rate, 4) for r in g.itertuples()}}
    other = d[(d.c == "mxfp8_e4m3") & ~d.tensor.str.fullmatch(pattern)]
    res["mxfp8_e4m3_other_operands_max"] = round(other.clip_rate.max(), 4)
    if model == "tf":
        p = other[other.tensor.str.endswith("attn/1/lhs")]
        res["mxfp8_e4m3_softmax_p"] = {r.tensor: round(r.clip_rate, 4) for r in p.itertuples()}
    return res

S["a_mlp"] = tanh_clip("mlp", r"(hidden\.1|head)/activation")
S["a_tf"] = tanh_clip("tf", r"blocks\.\d+\.mlp\.out/activation")

def eb(model):
    d = pd.read_parquet(out / model / "eb" / "error-bias.parquet"); d["c"] = d.cast.map(cast_name)
    res = {"all": {r.c: {"rel_error": round(r.rel_error, 4), "bias": round(r.bias, 5),
                         "alignment": round(r.alignment, 3)} for r in star(d).itertuples()}}
    for role, g in d[d.tensor != "*"].groupby("role"):
        res[role] = {}
        for c, h in g.groupby("c"):
            # norm-weighted over the role's tensors: mean of rel_error and bias weighted by ||x||^2
            res[role][c] = {"rel_error_median": round(h.rel_error.median(), 4),
                            "bias_median": round(h.bias.median(), 5)}
    return res

def probe(model):
    p = pd.read_parquet(out / model / "probe.parquet"); p = p[p.parameter == "*"]
    cols = ["cosine", "retention", "rel_error", "expected_cosine", "expected_retention",
            "expected_rel_error", "loss", "loss_exact", "freeze_share"]
    res = {}
    for r in p.itertuples():
        res.setdefault(r.policy, {})[int(r.step)] = {
            c: (None if pd.isna(getattr(r, c)) else round(float(getattr(r, c)), 4)) for c in cols}
    return res

S["b_mlp_error_bias"] = eb("mlp"); S["b_tf_error_bias"] = eb("tf")
S["b_mlp_probe"] = probe("mlp"); S["b_tf_probe"] = probe("tf")

def runs(folder):
    res = {}
    for rj in sorted((out / folder).glob("*/run.json")):
        j = json.loads(rj.read_text())
        t = pd.read_parquet(rj.parent / "train.parquet")
        res[rj.parent.name] = {"diverged_at": j["diverged_at"], "steps_done": j["steps_done"],
                               "final_loss": round(j["final_loss"], 4),
                               "final_val_loss": None if j["final_val_loss"] is None else round(j["final_val_loss"], 4),
                               "min_loss": round(float(t.loss.min()), 4),
                               "max_loss_after_100": round(float(t.loss[t.step > 100].max()), 4),
                               "last20_mean_loss": round(float(t.loss.iloc[-20:].mean()), 4),
                               "seconds_per_step": j["seconds_per_step"]}
        for col in ("clip_rate_gradient", "underflow_rate_gradient", "clip_rate_activation"):
            x = t[col].dropna() if col in t else pd.Series(dtype=float)
            res[rj.parent.name][f"mean_{col}"] = None if x.empty else round(float(x.mean()), 4)
    return res

S["c"] = runs("c"); S["d"] = runs("d")
for name in ("mlp", "tf"):
    j = json.loads((out / name / "run.json").read_text())
    S[f"{name}_run"] = {"final_loss": round(j["final_loss"], 4), "final_val_loss": round(j["final_val_loss"], 4),
                        "parameters": j["parameters"], "seconds_per_step": j["seconds_per_step"]}
(out / "summary.json").write_text(json.dumps(S, indent=1))

print("== (a) tanh activations clipped (pooled over the tanh outputs of the dump)")
for m in ("a_mlp", "a_tf"):
    print(f"  {m}: " + ", ".join(f"{c} {v['pooled']:.4f}" for c, v in S[m].items() if isinstance(v, dict) and "pooled" in v),
          "| per tensor (mxfp8_e4m3):", S[m]["mxfp8_e4m3"]["per_tensor"])
print("  transformer softmax p (attn/1/lhs) under mxfp8_e4m3:", S["a_tf"]["mxfp8_e4m3_softmax_p"])
print("== (b) operand error and bias, all tensors of the dump")
for m in ("b_mlp_error_bias", "b_tf_error_bias"):
    for c, v in S[m]["all"].items():
        print(f"  {m[2:5]} {c:20s} rel_error {v['rel_error']:.4f} bias {v['bias']:+.5f} alignment {v['alignment']:+.3f}")
print("== (b) gradient retention (probe, all parameters)")
for m in ("b_mlp_probe", "b_tf_probe"):
    for pol, steps in S[m].items():
        print(f"  {m[2:5]} {pol:20s} " + "  ".join(
            f"s{s}: cos {v['cosine']:.4f} ret {v['retention']:.4f} err {v['rel_error']:.4f}" for s, v in steps.items()))
print("== (d) SR per step (probe of the exact MLP): per-draw vs expected gradient")
for pol in ("nvfp4", "nvfp4:sr", "mxfp4_e2m1:sr"):
    for s, v in S["b_mlp_probe"][pol].items():
        print(f"  {pol:14s} s{s}: cos {v['cosine']:.4f} ret {v['retention']:.4f} err {v['rel_error']:.4f}"
              f" | E cos {v['expected_cosine']} E ret {v['expected_retention']} E err {v['expected_rel_error']}")
for k in ("c", "d"):
    print(f"== ({k}) runs")
    for n, v in S[k].items():
        print(f"  {n:22s} diverged_at {str(v['diverged_at']):5s} steps {v['steps_done']:3d} final {v['final_loss']:.4f}"
              f" val {v['final_val_loss']} min {v['min_loss']:.4f} max>100 {v['max_loss_after_100']:.4f} last20 {v['last20_mean_loss']:.4f}"
              f" | dY clip {v['mean_clip_rate_gradient']} dY underflow {v['mean_underflow_rate_gradient']}")
print(f"== total {seconds} s before the summary")
EOF
log "done: $OUT/summary.json"
