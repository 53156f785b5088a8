"""Throughput of drift's scaled casts, side by side with torch and torchao in one process.

Times ``driftcli.quantize(x, spec)`` (and with ``return_info=True``) for the casts
``fp8_e4m3``, ``mxfp8_e4m3``, ``mxfp4_e2m1`` and ``nvfp4`` on 2**24 standard-normal float32
values shaped (4096, 4096), on drift's two back-ends, ``torch`` (the eager reference,
``DRIFT_JIT=never``) and ``numba`` (the CPU default); and prints Me/s with
ratios measured in the same process, interleaved round by round: against ``x.clone()``,
torch's native round trip ``x.to(torch.float8_e4m3fn).float()``, and torchao's CPU path for
the same recipe (``to_mx`` + ``to_dtype``; ``NVFP4Tensor.to_nvfp4`` + ``dequantize`` with the
per-tensor scale). numba's results are checked bit for bit against torch's.
Each figure is the median of ``--repeat`` rounds after one untimed warm-up (its seconds are
printed apart); "1st call +s" is the first call in a fresh process beyond a later one.

With ``--implementations`` it times instead every implementation preset (``torchao/…``,
``te/…``, ``deepseek/…``, docs/recipes.md) against drift's exact cast of the same recipe,
interleaved in the same process on the numba path, values only, and checks each against
:data:`IMPLEMENTATION_TARGET`. ``--clock cpu`` times by the thread's CPU seconds instead of the
wall clock (with ``--threads 1`` every kernel runs on the calling thread): on a shared, busy
machine the ratios then move less from run to run.

Run ``python benchmarks/bench_scaled_casts.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import driftcli
from driftcli import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_casts
from bench_casts import PATHS, interleaved, machine, same_bits, set_malloc, set_path

SPECS = ("fp8_e4m3", "mxfp8_e4m3", "mxfp4_e2m1", "nvfp4")
TARGET = 3.0
"""The numba path against torchao's CPU path for MX and NVFP4 casts (issue 20)."""
IMPLEMENTATION_TARGET = 0.8
"""An implementation preset against drift's exact cast of the same recipe (issue 15)."""
BLOCK_FORMATS = ("hifloat4", "mx6", "mx9")
"""The block formats after OCP (multi-level scales, issue 29), timed by ``--block-formats``."""
BLOCK_TARGET = 0.8
"""A block format after OCP against drift's MXFP4 (``mxfp4_e2m1``), numba path (issue 29)."""

FIRST_CALL = """
import sys, time
import torch
import driftcli
x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter(); driftcli.quantize(x, sys.argv[1]); t1 = time.perf_counter()
driftcli.quantize(x, sys.argv[1]); t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def torchao_call(x: torch.Tensor, spec: str) -> Callable[[], object] | None:
    """torchao's CPU fake-quant of the same recipe, or None (no torchao, no such recipe)."""
    for name in ("torchao", "torch.utils._pytree"):  # its notices of CUDA-only extensions
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            per_tensor_amax_to_scale,
        )
    except ImportError:
        return None
    elements = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp4_e2m1": torch.float4_e2m1fn_x2}
    if spec in elements:
        elem = elements[spec]

        def mx() -> object:
            scale, data = to_mx(x, elem, 32)
            return to_dtype(data, scale, elem, 32, torch.float32)

        return mx
    if spec == "nvfp4":
        def nvfp4() -> object:
            scale = per_tensor_amax_to_scale(x.abs().max())
            return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)

        return nvfp4
    return None


def measure(x: torch.Tensor, spec: str, info: bool, repeat: int) -> dict[str, float]:
    """Warm-up seconds of the cast and medians of interleaved rounds of the cast and the
    baselines."""
    calls: dict[str, Callable[[], object]] = {
        "cast": lambda: driftcli.quantize(x, spec, return_info=info),
        "clone": x.clone,
        "native": lambda: x.to(torch.float8_e4m3fn).float(),
    }
    peer = torchao_call(x, spec)
    if peer is not None:
        calls["torchao"] = peer
    return interleaved(calls, repeat)


def first_call(spec: str) -> float:
    """Seconds the first cast in a fresh process takes beyond a later one (numba path)."""
    out = subprocess.run([sys.executable, "-c", FIRST_CALL, spec], capture_output=True,
                         text=True, check=True).stdout.split()
    return float(out[0]) - float(out[1])


def implementation_rows(x: torch.Tensor, repeat: int, names: list[str]) -> list[dict]:
    """Each implementation preset and its exact twin, interleaved: Me/s of both, the ratio."""
    from driftcli.records.recipes import IMPLEMENTATION_PRESETS

    set_path("numba")
    print(f"{'preset':28s} {'Me/s':>8s} {'exact Me/s':>11s} {'ratio':>6s}  exact cast")
    rows = []
    for name in names or list(IMPLEMENTATION_PRESETS):
        exact = IMPLEMENTATION_PRESETS[name].exact
        m = interleaved({"cast": lambda n=name: driftcli.quantize(x, n),
                         "exact": lambda e=exact: driftcli.quantize(x, e)}, repeat)
        row = {"preset": name, "exact": exact, "meps": x.numel() / m["cast"] / 1e6,
               "exact_meps": x.numel() / m["exact"] / 1e6, "ratio": m["exact"] / m["cast"]}
        rows.append(row)
        print(f"{name:28s} {row['meps']:8.1f} {row['exact_meps']:11.1f} {row['ratio']:6.2f}  "
              f"{exact}", flush=True)
    worst = min(rows, key=lambda r: r["ratio"])
    verdict = "met" if worst["ratio"] >= IMPLEMENTATION_TARGET else "missed"
    print(f"target >= {IMPLEMENTATION_TARGET}x drift's exact cast of the same recipe: {verdict}; "
          f"worst {worst['ratio']:.2f}x ({worst['preset']})")
    return rows


def block_format_rows(x: torch.Tensor, repeat: int, names: list[str]) -> list[dict]:
    """Each block format after OCP and drift's MXFP4, interleaved on the numba path, values
    only: Me/s of both and the ratio; each format's values checked against the torch path."""
    rows = []
    print(f"{'cast':12s} {'Me/s':>8s} {'mxfp4 Me/s':>11s} {'ratio':>6s} {'= torch':>8s}")
    for name in names or list(BLOCK_FORMATS):
        set_path("torch")
        reference = driftcli.quantize(x, name)
        set_path("numba")
        m = interleaved({"cast": lambda n=name: driftcli.quantize(x, n),
                         "mxfp4": lambda: driftcli.quantize(x, "mxfp4_e2m1")}, repeat)
        equal = same_bits(reference, driftcli.quantize(x, name))  # type: ignore[arg-type]
        row = {"spec": name, "meps": x.numel() / m["cast"] / 1e6,
               "mxfp4_meps": x.numel() / m["mxfp4"] / 1e6, "ratio": m["mxfp4"] / m["cast"],
               "bit_equal": equal}
        rows.append(row)
        print(f"{name:12s} {row['meps']:8.1f} {row['mxfp4_meps']:11.1f} {row['ratio']:6.2f} "
              f"{equal!s:>8s}", flush=True)
    worst = min(rows, key=lambda r: r["ratio"])
    verdict = "met" if worst["ratio"] >= BLOCK_TARGET else "missed"
    print(f"target >= {BLOCK_TARGET}x drift's MXFP4, numba path, values only: {verdict}; "
          f"worst {worst['ratio']:.2f}x ({worst['spec']})")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measure, print a table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24, help="elements (a square if it is one)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--specs", nargs="*", default=list(SPECS))
    parser.add_argument("--malloc", choices=("fresh", "reuse", "as-is"), default="fresh")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time by the wall clock or the thread's CPU seconds (with "
                             "--threads 1)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--implementations", nargs="*", metavar="PRESET",
                        help="time implementation presets (all, or those named) against "
                             "drift's exact casts instead")
    parser.add_argument("--block-formats", nargs="*", metavar="CAST",
                        help="time the block formats after OCP (all, or those named) against "
                             "drift's MXFP4 instead")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            parser.error("--clock cpu counts the calling thread only: add --threads 1")
        bench_casts.CLOCK = time.thread_time
    side = int(args.n**0.5)
    shape = (side, args.n // side)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    malloc = set_malloc(args.malloc, x.numel() * 4)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"{info['threads']} threads, commit {info['commit']}; malloc {malloc}; "
          f"clock {args.clock}; "
          f"numba {kernels.jit_unavailable() or 'at hand'}")
    print(f"input: {shape[0]} x {shape[1]} float32 standard normal ({x.numel():,} elements)")
    if args.block_formats is not None:
        rows = block_format_rows(x, args.repeat, args.block_formats)
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "malloc": malloc,
                                             "block_formats": rows}, indent=2))
        return 0
    if args.implementations is not None:
        rows = implementation_rows(x, args.repeat, args.implementations)
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "malloc": malloc,
                                             "implementations": rows}, indent=2))
        return 0
    header = (f"{'cast':12s} {'info':5s} {'path':9s} {'Me/s':>8s} {'x clone':>8s} "
              f"{'x native':>9s} {'x torchao':>10s} {'warm-up s':>10s} {'1st call +s':>12s} "
              f"{'= torch':>8s}")
    print(header)
    print("-" * len(header))
    rows = []
    for spec in args.specs:
        for with_info in (False, True):
            reference = None
            for path in PATHS:
                set_path(path)
                m = measure(x, spec, with_info, args.repeat)
                out = driftcli.quantize(x, spec, return_info=with_info)
                values = out.values if with_info else out  # type: ignore[union-attr]
                equal = None if reference is None else same_bits(reference, values)
                reference = values if reference is None else reference
                first = first_call(spec) if path == "numba" and not with_info else None
                row = {"spec": spec, "info": with_info, "path": path,
                       "meps": x.numel() / m["cast"] / 1e6, "vs_clone": m["clone"] / m["cast"],
                       "vs_native": m["native"] / m["cast"],
                       "vs_torchao": m["torchao"] / m["cast"] if "torchao" in m else None,
                       "torchao_meps": x.numel() / m["torchao"] / 1e6 if "torchao" in m else None,
                       "warmup_s": m["warmup"], "first_call_extra_s": first, "bit_equal": equal}
                rows.append(row)
                vs_peer = "-" if row["vs_torchao"] is None else f"{row['vs_torchao']:.2f}"
                print(f"{spec:12s} {with_info!s:5s} {path:9s} {row['meps']:8.1f} "
                      f"{row['vs_clone']:8.3f} {row['vs_native']:9.3f} {vs_peer:>10s} "
                      f"{m['warmup']:10.2f} {'-' if first is None else f'{first:.2f}':>12s} "
                      f"{'' if equal is None else str(equal):>8s}", flush=True)
    set_path("numba")
    peers = {r["spec"]: r["torchao_meps"] for r in rows if r["torchao_meps"] is not None}
    print("torchao's CPU path, Me/s: " + ", ".join(f"{k} {v:.1f}" for k, v in peers.items()))
    targeted = [r for r in rows if r["path"] == "numba" and not r["info"]
                and r["vs_torchao"] is not None]
    if targeted:
        worst = min(targeted, key=lambda r: r["vs_torchao"])
        verdict = "met" if worst["vs_torchao"] >= TARGET else "missed"
        print(f"target >= {TARGET}x torchao for MX and NVFP4, numba path, values only: "
              f"{verdict}; worst {worst['vs_torchao']:.2f}x ({worst['spec']})")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "malloc": malloc, "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
