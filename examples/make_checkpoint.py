"""Write a small seeded checkpoint shaped like a model's tensors, for `make demo` and the docs.

    python examples/make_checkpoint.py drift-out/example.safetensors

Weights with a few outlier channels, a bfloat16 copy, norm gains near 1, tanh activations
that pile up just under 1.0 (where the OCP MX floor rule clips), gradients small enough to
flush to zero in a bare FP8 cast, and an integer tensor (skipped by every measurement).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    d, ff, vocab = 128, 512, 512
    out = {"embed.weight": 0.02 * torch.randn(vocab, d, generator=g)}
    for i in range(2):
        up = torch.randn(ff, d, generator=g) / d**0.5
        up[:, :4] *= 30.0  # a few outlier input channels, as trained MLPs grow
        out |= {
            f"layers.{i}.attn.qkv.weight": torch.randn(3 * d, d, generator=g) / d**0.5,
            f"layers.{i}.mlp.up.weight": up,
            f"layers.{i}.mlp.down.weight": torch.randn(d, ff, generator=g) / ff**0.5,
            f"layers.{i}.norm.weight": 1.0 + 0.1 * torch.randn(d, generator=g),
        }
    out["lm_head.weight"] = out["embed.weight"].to(torch.bfloat16)
    out["activations.tanh"] = torch.tanh(3.0 * torch.randn(256, ff, generator=g))
    n = torch.randn(256, d, generator=g)
    out["gradients.layers.1"] = 1e-5 * n * torch.exp(2.0 * torch.randn(256, d, generator=g))
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
