"""Throughput of drift's scaled casts, side by side with torch baselines in one process.

Times ``driftcli.quantize(x, spec)`` (and with ``return_info=True``) for the
casts ``fp8_e4m3``, ``mxfp8_e4m3``, ``mxfp4_e2m1`` and ``nvfp4`` on 2**24
standard-normal float32 values shaped (4096, 4096), eager and compiled, and
prints Me/s with two ratios measured in the same process, interleaved round by
round: against ``x.clone()`` and against torch's native round trip
``x.to(torch.float8_e4m3fn).float()``. Compiled results are checked bit for
bit against eager ones. Each figure is the median of ``--repeat`` rounds after
one untimed warm-up (where compilation happens; its seconds are printed apart).

Run ``python benchmarks/bench_scaled_casts.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import driftcli
from driftcli import compiling

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import interleaved, machine, same_bits, set_malloc

SPECS = ("fp8_e4m3", "mxfp8_e4m3", "mxfp4_e2m1", "nvfp4")
TARGET = 0.25  # MX and NVFP4 fake-quant, compiled, against clone()


def measure(x: torch.Tensor, spec: str, info: bool, repeat: int) -> dict[str, float]:
    """Warm-up seconds of the cast and medians of interleaved rounds of cast, clone, native."""
    calls: dict[str, Callable[[], object]] = {
        "cast": lambda: driftcli.quantize(x, spec, return_info=info),
        "clone": x.clone,
        "native": lambda: x.to(torch.float8_e4m3fn).float(),
    }
    return interleaved(calls, repeat)


def main(argv: list[str] | None = None) -> int:
    """Measure, print a table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24, help="elements (a square if it is one)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--specs", nargs="*", default=list(SPECS))
    parser.add_argument("--malloc", choices=("fresh", "reuse", "as-is"), default="fresh")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    side = int(args.n**0.5)
    shape = (side, args.n // side)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    malloc = set_malloc(args.malloc, x.numel() * 4)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"{info['threads']} threads, commit {info['commit']}; malloc {malloc}")
    print(f"input: {shape[0]} x {shape[1]} float32 standard normal ({x.numel():,} elements)")
    header = (f"{'cast':12s} {'info':5s} {'path':9s} {'Me/s':>8s} {'x clone':>8s} "
              f"{'x native':>9s} {'warm-up s':>10s} {'bit-equal':>9s}")
    print(header)
    print("-" * len(header))
    rows = []
    for spec in args.specs:
        for with_info in (False, True):
            eager_out = None
            for mode in ("never", "always"):
                compiling.set_compile(mode)
                m = measure(x, spec, with_info, args.repeat)
                out = driftcli.quantize(x, spec, return_info=with_info)
                values = out.values if with_info else out  # type: ignore[union-attr]
                if mode == "never":
                    eager_out, equal = values, None
                else:
                    equal = same_bits(eager_out, values)  # type: ignore[arg-type]
                path = "eager" if mode == "never" else (
                    "compiled" if not compiling.fell_back() else "fallback")
                row = {"spec": spec, "info": with_info, "path": path,
                       "meps": x.numel() / m["cast"] / 1e6, "vs_clone": m["clone"] / m["cast"],
                       "vs_native": m["native"] / m["cast"], "warmup_s": m["warmup"],
                       "bit_equal": equal}
                rows.append(row)
                print(f"{spec:12s} {with_info!s:5s} {path:9s} {row['meps']:8.1f} "
                      f"{row['vs_clone']:8.3f} {row['vs_native']:9.3f} {m['warmup']:10.2f} "
                      f"{'' if equal is None else str(equal):>9s}", flush=True)
    compiling.set_compile("auto")
    targeted = [r for r in rows if r["path"] == "compiled" and not r["info"]
                and r["spec"] != "fp8_e4m3"]
    if targeted:
        worst = min(targeted, key=lambda r: r["vs_clone"])
        verdict = "met" if worst["vs_clone"] >= TARGET else "missed"
        print(f"target >= {TARGET}x clone() for MX and NVFP4, compiled, values only: {verdict}; "
              f"worst {worst['vs_clone']:.3f}x ({worst['spec']})")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "malloc": malloc, "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
