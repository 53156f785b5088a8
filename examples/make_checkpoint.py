"""Write a small seeded checkpoint shaped like a model's tensors, for `make demo` and the docs.

    python examples/make_checkpoint.py drift-out/example.safetensors

Weights with a few outlier channels, a bfloat16 copy, norm gains near 1, tanh activations
that pile up just under 1.0 (where the OCP MX floor rule clips), gradients small enough to
flush to zero in a bare FP8 cast, and an integer tensor (skipped by every measurement).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, the same for the same seed on every CPU: drawn and computed
    by numpy in float64, then rounded once to float32 (torch.randn and torch.tanh choose
    their code by instruction set, and their last bits differ from one CPU to the next,
    which moved the docs' figures)."""
    rng = np.random.default_rng(seed)

    def randn(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape)

    def f32(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(x, dtype=np.float32))

    d, ff, vocab = 128, 512, 512
    out = {"embed.weight": f32(0.02 * randn(vocab, d))}
    for i in range(2):
        up = randn(ff, d) / d**0.5
        up[:, :4] *= 30.0  # a few outlier input channels, as trained MLPs grow
        out |= {
            f"layers.{i}.attn.qkv.weight": f32(randn(3 * d, d) / d**0.5),
            f"layers.{i}.mlp.up.weight": f32(up),
            f"layers.{i}.mlp.down.weight": f32(randn(d, ff) / ff**0.5),
            f"layers.{i}.norm.weight": f32(1.0 + 0.1 * randn(d)),
        }
    out["lm_head.weight"] = out["embed.weight"].to(torch.bfloat16)
    out["activations.tanh"] = f32(np.tanh(3.0 * randn(256, ff)))
    n = randn(256, d)
    out["gradients.layers.1"] = f32(1e-5 * n * np.exp(2.0 * randn(256, d)))
    out["position_ids"] = torch.arange(256)
    return out


def main(argv: list[str]) -> int:
    """Write the checkpoint to the path given."""
    if len(argv) != 1:
        print("usage: make_checkpoint.py OUT.safetensors", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    data = tensors()
    save_file(data, str(path))
    print(f"wrote {path}: {len(data)} tensors, {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
