"""``drift block-stats`` against ``drift clip-rate`` on the same checkpoint and casts: the
scan's speed rule for block statistics is at most 2x clip-rate's time (issue 28).

Builds (once, seeded) bench_scan's transformer-shaped float32 checkpoint at a size given by
``--scale`` (1.0: bench_scan's 0.55 GB), then times the library calls behind both commands,
interleaved round by round after an untimed warm-up of each: ``clip-rate`` (one direction,
the rows) and ``block-stats`` (every direction: rows and columns, so twice the groups), each
under ``fp8_e4m3``, ``mxfp8_e4m3`` and ``nvfp4`` together, and with ``--per-cast`` under each
of them (and ``mxfp4_e2m1``) alone. Prints the best times and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from driftcli.measures import MEASURES
from driftcli.measures.block_stats import block_stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import machine
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


def side_by_side(path: Path, casts: tuple[str, ...], repeat: int) -> tuple[float, float]:
    """Best seconds of clip-rate and of block-stats over ``repeat`` interleaved rounds (each
    warmed up once, untimed): the best of a few is the least disturbed by the other jobs of a
    shared machine."""
    clip = MEASURES["clip-rate"]
    calls = {"clip-rate": lambda: clip.run([path], list(casts)),
             "block-stats": lambda: block_stats([path], casts)}
    for fn in calls.values():
        fn()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeat):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best["clip-rate"], best["block-stats"]


def main() -> None:
    """Build the checkpoint and print both calls' best times and their ratio, for the casts
    together and (``--per-cast``) for each one alone."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scale", type=float, default=0.5, help="Size against bench_scan's.")
    ap.add_argument("--repeat", type=int, default=3, help="Timed rounds (best of them).")
    ap.add_argument("--per-cast", action="store_true",
                    help="Also time each cast alone (and mxfp4_e2m1).")
    args = ap.parse_args()
    rows = [("all", CASTS)]
    if args.per_cast:
        rows += [(c, (c,)) for c in (*CASTS, "mxfp4_e2m1")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.safetensors"
        size = build(path, args.scale)
        got = [(label, *side_by_side(path, casts, args.repeat)) for label, casts in rows]
    print(machine())
    print(f"checkpoint {size / 1e6:.0f} MB; best of {args.repeat}; target at most 2x")
    for label, clip_s, block_s in got:
        print(f"{label:12s} clip-rate {clip_s:6.2f} s  block-stats {block_s:6.2f} s  "
              f"{block_s / clip_s:.2f}x")


if __name__ == "__main__":
    main()
