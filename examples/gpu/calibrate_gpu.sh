#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: infer the accumulation model of its bf16, fp16 and FP8
# matmuls (torch.matmul, and torch._scaled_mm with unit scales for FP8), print each inferred
# spec with the share of random matmuls it reproduces bit for bit, and write
# drift-out/gpu/calibrate.parquet. CI never runs this; docs/tensor-cores.md records its output
# where a GPU was at hand.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
"$BIN/python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__)"
"$BIN/drift" calibrate \
    -b torch:cuda:bfloat16 -b torch:cuda:float16 \
    -b torch:cuda:float8_e4m3fn -b torch:cuda:float8_e5m2 \
    --out drift-out/gpu "$@"
