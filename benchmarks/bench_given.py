"""The scan's per-slice work for the casts the fused pass takes through its given-scales step
(:mod:`driftcli.casts.given`: implementation presets, four over six, micro-exponents, a
transform), side by side with the per-cast path they took before (``cast_stats`` per cast:
the cast's block steps and element masks); and the three casts of ``bench_scan.py`` in the
same table, whose pass the step leaves as it was (run it under another tree's ``PYTHONPATH``
for their before).

One thread, CPU time of the calling thread, best of ``--repeat``, on a heavy-tailed float32
slice of 2^22 elements (1,024 x 4,096). Usage::

    python benchmarks/bench_given.py [--repeat 5] [--rows 1024]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

THREE = ["fp8_e4m3", "mxfp8_e4m3", "nvfp4"]
GIVEN = ["te/nvfp4", "torchao/mxfp8", "deepseek/v3", "te/nvfp4_4over6", "hifloat4", "mx6",
         "te/nvfp4_rht"]


def best(call: Callable[[], object], repeat: int) -> float:
    """The least CPU time of ``repeat`` calls of ``call`` (after one to compile and warm), ms."""
    call()
    times = []
    for _ in range(repeat):
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    from driftcli.measures.stats import cast_stats, fused_stats

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, default=1024, help="rows of 4,096 elements")
    parser.add_argument("--three-only", action="store_true",
                        help="only the three casts (for another tree's before)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, 4096, generator=gen)
    x *= torch.exp(torch.randn(x.shape, generator=gen))
    n = x.numel()
    print(f"per slice of {n} elements, one thread, CPU ms, best of {args.repeat}")
    print(f"  {'casts':<18s} {'clip pass':>10s} {'rounded pass':>13s} {'Me/s':>6s} "
          f"{'before: per cast, clip':>23s} {'rounded':>8s} {'x clip':>7s} {'x rounded':>9s}")
    rows: list[tuple[str, list[str]]] = [("the three", THREE)]
    if not args.three_only:
        rows += [(c, [c]) for c in GIVEN] + [("the seven", GIVEN)]
    for name, casts in rows:
        def pass_of(casts: list[str] = casts, rounded: bool = False) -> object:
            return fused_stats(x, casts, rounded=rounded)

        def per_cast(casts: list[str] = casts, rounded: bool = False) -> object:
            return [cast_stats(x, c, want_values=False, rounded=rounded) for c in casts]

        clip = best(pass_of, args.repeat)
        rounded = best(lambda: pass_of(rounded=True), args.repeat)
        line = f"  {name:<18s} {clip:10.1f} {rounded:13.1f} {n / rounded / 1e3:6.0f}"
        if name != "the three" and not args.three_only:
            slow = max(1, args.repeat // 2)
            old_clip = best(per_cast, slow)
            old = best(lambda: per_cast(rounded=True), slow)
            line += f" {old_clip:23.1f} {old:8.1f} {old_clip / clip:7.1f} {old / rounded:9.1f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
