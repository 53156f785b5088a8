#!/usr/bin/env bash
# drift in any CI: measure a checkpoint, report with thresholds, keep the HTML page.
#
#   CHECKPOINT=model.safetensors bash drift.sh      # your checkpoint
#   bash drift.sh                                   # a small made-up checkpoint, for a try
#
# Optional: BASELINE=DIR (tables of an earlier run) fails on regressions beyond 10%;
# DRIFT_OUT=DIR (default drift-out) is where the tables go. Exit status: 0 all thresholds
# hold, 1 a threshold or regression broke (the report says which rows), 2 bad input.
# Keep report.html (one self-contained page, plots embedded) as the job's artifact.
set -euo pipefail

OUT=${DRIFT_OUT:-drift-out}
CASTS=(--cast mxfp8_e4m3 --cast fp8_e4m3)

if [ -z "${CHECKPOINT:-}" ]; then
    CHECKPOINT=demo.safetensors
    python - <<'PY'
import torch
from safetensors.torch import save_file

g = torch.Generator().manual_seed(0)
save_file({
    "embed.weight": torch.randn(512, 64, generator=g) * 0.02,
    "layers.0.weight": torch.randn(256, 64, generator=g) * 0.05,
    "layers.0.bias": torch.randn(256, generator=g) * 1e-3,
    "layers.1.weight": torch.randn(64, 256, generator=g) * 0.05,
    "head.weight": torch.randn(64, 64, generator=g) * 0.02,
}, "demo.safetensors")
PY
fi

# --overwrite: a workspace that outlives a job (a self-hosted runner, a rerun) holds the
# last run's tables, which drift otherwise keeps and refuses to replace
drift clip-rate "$CHECKPOINT" "${CASTS[@]}" --out "$OUT" --quiet --overwrite
drift underflow-rate "$CHECKPOINT" "${CASTS[@]}" --out "$OUT" --quiet --overwrite
drift error-bias "$CHECKPOINT" "${CASTS[@]}" --out "$OUT" --quiet --overwrite

REGRESSION=()
if [ -n "${BASELINE:-}" ]; then
    REGRESSION=(--baseline "$BASELINE" --fail-on-regression 10)
fi

# the Markdown goes to the job summary where there is one (GitHub), else to a file
drift report "$OUT" \
    --markdown "${GITHUB_STEP_SUMMARY:-drift-summary.md}" \
    --html report.html \
    --json report.json \
    --fail-on 'clip-rate:clip_rate > 0.02 and tensor == "*"' \
    --fail-on 'underflow-rate:underflow_rate > 0.05 and tensor == "*"' \
    --fail-on 'error-bias:rel_error > 0.1 and tensor == "*"' \
    "${REGRESSION[@]}"
