"""Simulated matmuls against ``torch.matmul`` in float32, side by side in one process.

``driftcli.arith.matmul`` on ``--size`` cubed (default 1024 x 1024 x 1024) standard-normal
float32 operands (seed 0), both cast with ``mxfp8_e4m3`` along K, under five specs:

* ``native`` with a float32 accumulator: the casts, then ``torch.matmul`` of the dequantized
  operands (the fast path). Its own baseline is the same work done by hand
  (``quantize`` both operands, ``torch.matmul``); target: at most 3x that.
* ``sequential`` with a float32 and with a bfloat16 accumulator, and ``chunked:128`` with an
  ``e8m13`` accumulator (promotion into float32 every 128 products): every addition rounded
  exactly in the accumulator; target: at most 100x ``torch.matmul`` at K = 1024.
* ``blockfma`` with H100's FP8 unit (``tc=h100_e4m3_f32``: operands cast to E4M3 unscaled, groups
  of 32 products, 13 kept bits, an e8m13 result): target at most 60x ``torch.matmul``.

Every row is timed interleaved, round by round, with ``torch.matmul(a, b)`` on the float32
inputs, and with a memory-traffic floor for the custom orders: the accumulator passes the torch
back-end's step function makes (one read and one write of the accumulator per
``STEPS_PER_CALL`` additions; for ``chunked`` the chunk sums as well, then one pass per chunk
into the master sum), each timed as ``out.copy_(acc)`` of an accumulator-sized float32 tensor.
The numba back-end (:mod:`driftcli.kernels.accumcode`) makes no such passes: it keeps a tile
of accumulators in cache for all K steps, so on it the floor is a yardstick, not a bound.
Figures are medians of ``--repeat`` rounds after one untimed warm-up call, whose seconds are
printed apart. drift runs on one back-end of its kernel seam (``--path``: ``numba``, the CPU
default, or ``torch``, the eager reference); the custom orders' results on the numba back-end
are compared bit for bit with the torch back-end's on the first ``--check-rows`` rows of C, and
native with the hand-made baseline.

Run ``python benchmarks/bench_matmul.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import driftcli
from driftcli.arith.matmul import MatmulSpec, matmul, matmul_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import PATHS, interleaved, machine, path_run, same_bits, set_malloc, set_path

simulated = importlib.import_module("driftcli.arith.matmul")

CAST = "mxfp8_e4m3"
SPECS = {
    "float32 native": matmul_spec(lhs=CAST, rhs=CAST, order="native"),
    "float32 sequential": matmul_spec(lhs=CAST, rhs=CAST, order="sequential"),
    "bfloat16 sequential": matmul_spec(lhs=CAST, rhs=CAST, accumulator="bfloat16",
                                       order="sequential"),
    "e8m13 chunked:128": matmul_spec(lhs=CAST, rhs=CAST, accumulator="e8m13",
                                     order="chunked:128"),
    "h100 fp8 blockfma": matmul_spec(tc="h100_e4m3_f32"),
}
NATIVE_TARGET = 3.0
CUSTOM_TARGET = 100.0
BLOCKFMA_TARGET = 60.0


def passes(spec: MatmulSpec, k: int) -> int:
    """Accumulator-sized (M x N) read-and-write passes the step function makes."""
    step = simulated.STEPS_PER_CALL
    if spec.order.value == "sequential":
        return math.ceil(k / step)
    chunks = math.ceil(k / spec.chunk)
    return math.ceil(min(spec.chunk, k) / step) * chunks + chunks


def main(argv: list[str] | None = None) -> int:
    """Measure, print a table and the verdict, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="M = N = K (default 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--specs", nargs="*", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    parser.add_argument("--path", choices=PATHS, default="numba",
                        help="drift's back-end to time (default numba)")
    parser.add_argument("--check-rows", type=int, default=16,
                        help="rows of C compared bit for bit with the torch back-end "
                             "(default 16; numba path only)")
    parser.add_argument("--malloc", choices=("fresh", "reuse", "as-is"), default="reuse")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n = args.size
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    malloc = set_malloc(args.malloc, n * n * 4)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"{info['threads']} threads, commit {info['commit']}; load average {info['loadavg']}; "
          f"malloc {malloc}; drift on {path_run(args.path)}")
    print(f"operands: {n} x {n} @ {n} x {n} float32 standard normal, both cast {CAST} along K; "
          f"{simulated.STEPS_PER_CALL} accumulator steps per pass over the accumulator")
    header = (f"{'spec':20s} {'drift s':>8s} {'matmul s':>9s} {'x matmul':>9s} "
              f"{'base s':>8s} {'x base':>7s} {'warm-up s':>10s} {'bit-equal':>9s}")
    print(header)
    print("-" * len(header))
    acc = torch.randn(n, n)
    copy_out = torch.empty_like(acc)
    rows = []
    set_path(args.path)
    for name in args.specs:
        spec = SPECS[name]
        calls: dict[str, Callable[[], object]] = {
            "cast": lambda spec=spec: matmul(a, b, spec),
            "matmul": lambda: torch.matmul(a, b),
        }
        if spec.order.value == "native":
            calls["base"] = lambda: torch.matmul(driftcli.quantize(a, CAST, axis=-1),
                                                 driftcli.quantize(b, CAST, axis=-2))
        elif spec.order.value != "blockfma":
            calls["copy"] = lambda: copy_out.copy_(acc)
        m = interleaved(calls, args.repeat)
        got = matmul(a, b, spec)
        equal: bool | None = None
        if spec.order.value == "native":
            base_s = m["base"]
            equal = same_bits(got, calls["base"]())  # type: ignore[arg-type]
        else:
            # blockfma has no traffic floor: the unit reads every product once
            base_s = math.nan if spec.order.value == "blockfma" else passes(spec, n) * m["copy"]
            if args.path == "numba":
                set_path("torch")
                rows_a = a[: args.check_rows]
                equal = same_bits(got[: args.check_rows], matmul(rows_a, b, spec))
                set_path("numba")
        row = {"spec": name, "canonical": str(spec), "drift_s": m["cast"],
               "matmul_s": m["matmul"], "vs_matmul": m["cast"] / m["matmul"],
               "base_s": base_s, "vs_base": m["cast"] / base_s, "warmup_s": m["warmup"],
               "bit_equal": equal, "path": path_run(args.path)}
        rows.append(row)
        print(f"{name:20s} {m['cast']:8.3f} {m['matmul']:9.4f} {row['vs_matmul']:9.1f} "
              f"{base_s:8.4f} {row['vs_base']:7.1f} {m['warmup']:10.2f} "
              f"{'-' if equal is None else str(equal):>9s}", flush=True)
    print("base: native -> casts + torch.matmul by hand; custom orders -> the traffic floor "
          "(accumulator passes x copy_ of the accumulator)")
    for row in rows:
        native = row["spec"].endswith("native")
        target, against = (NATIVE_TARGET, "vs_base") if native else (
            BLOCKFMA_TARGET if "blockfma" in row["spec"] else CUSTOM_TARGET, "vs_matmul")
        state = "met" if row[against] <= target else "MISSED"
        print(f"target <= {target:g}x {'casts + matmul' if native else 'torch.matmul'} "
              f"({row['spec']}): {state}, {row[against]:.1f}x")
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "size": n, "malloc": malloc,
                                         "path": args.path, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
