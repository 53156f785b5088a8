"""What each rounding mode and overflow policy does to a few values, in FP8 E4M3.

Run: python examples/rounding_modes.py
"""

from __future__ import annotations

import torch

import driftcli as drift

# 17 is a tie between 16 and 18 in E4M3; 464 a tie between 448 and the absent 480;
# 1000 overflows; -1e-4 underflows to -0
x = torch.tensor([17.0, 464.0, 1000.0, -1e-4, float("inf")])
print("input      ", x.tolist())
for mode in ("rne", "rna", "rtz", "rup", "rdown"):
    for overflow in ("saturate", "ieee"):
        q = drift.round_to_format(x, "float8_e4m3fn", rounding=mode, overflow=overflow)
        print(f"{mode:5s} {overflow:8s}", q.tolist())

# stochastic rounding: explicit random bits make it reproducible; the mean converges on x
y = torch.full((100_000,), 1.0 + 1 / 32)  # a quarter of the way from 1 to 1.125
q = drift.stochastic_round(y, "float8_e4m3fn", seed=0)
print(f"sr: share rounded up {float((q > 1).double().mean()):.4f} (expected 0.25), "
      f"mean {float(q.double().mean()):.6f} (x = {1 + 1 / 32})")
