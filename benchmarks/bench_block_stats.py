"""``drift block-stats`` against ``drift clip-rate`` on the same checkpoint and casts: the
scan's speed rule for block statistics is at most 2x clip-rate's time (issue 28).

Builds (once, seeded) bench_scan's transformer-shaped float32 checkpoint at a size given by
``--scale`` (1.0: bench_scan's 0.55 GB), then times the library calls behind both commands,
interleaved round by round after an untimed warm-up of each: ``clip-rate`` (one direction,
the rows) and ``block-stats`` (every direction: rows and columns, so twice the groups), each
under ``fp8_e4m3``, ``mxfp8_e4m3`` and ``nvfp4``. Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from driftcli.measures import MEASURES
from driftcli.measures.block_stats import block_stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import interleaved, machine
from bench_scan import CASTS, shapes


def build(path: Path, scale: float, seed: int = 0) -> int:
    """bench_scan's tensors with every dimension times ``scale`` (heavy-tailed values)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes(int(1536 * scale) // 32 * 32, int(4096 * scale) // 32 * 32,
                              int(16384 * scale) // 32 * 32).items():
        x = torch.randn(shape, generator=gen)
        tensors[name] = x * torch.exp(torch.randn(shape, generator=gen))
    save_file(tensors, str(path))
    return sum(t.numel() * 4 for t in tensors.values())


def main() -> None:
    """Build the checkpoint and print both calls' medians and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scale", type=float, default=0.5, help="Size against bench_scan's.")
    ap.add_argument("--repeat", type=int, default=3, help="Timed rounds.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.safetensors"
        size = build(path, args.scale)
        clip = MEASURES["clip-rate"]
        got = interleaved({"cast": lambda: clip.run([path], CASTS),
                           "block-stats": lambda: block_stats([path], CASTS)}, args.repeat)
    print(machine())
    print(f"checkpoint {size / 1e6:.0f} MB, casts {', '.join(CASTS)}")
    print(f"clip-rate   {got['cast']:.2f} s")
    print(f"block-stats {got['block-stats']:.2f} s ({got['block-stats'] / got['cast']:.2f}x "
          "clip-rate; target at most 2x)")


if __name__ == "__main__":
    main()
