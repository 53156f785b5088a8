"""Throughput of drift's element casts, side by side with torch baselines in one process.

For every element format of at most 16 bits in ``driftcli.FORMATS`` this times
``driftcli.round_to_format(x, fmt, rounding="rne", overflow="saturate")`` on two
float32 inputs, a standard-normal one and a heavy-tailed one, and reports
millions of elements per second (Me/s) together with two ratios measured in
the same process, on the same input, interleaved round by round with the cast:

* ``x.clone()``, the cost of reading and writing the tensor once;
* ``x.to(torch.float8_e4m3fn).float()``, torch's native FP8 round trip.

A ratio is drift's throughput divided by the baseline's (higher is better;
1.0 means as fast as the baseline). Each figure is the median of ``--repeat``
timed calls after one untimed warm-up call; for the compiled path the warm-up
call is where ``torch.compile`` does its work, and its seconds are printed in
their own column, never mixed into the throughput.

Run ``python benchmarks/bench_casts.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import driftcli
from driftcli import rounding

ROOT = Path(__file__).resolve().parent.parent
MAX_BITS = 16
TARGET_BITS = 8
TARGET_RATIO = 0.5
PATHS = {"never": "eager", "always": "compiled", "auto": "auto"}


@dataclass
class Row:
    """One measured (input, format, path) cell with its interleaved baselines."""

    input: str
    format: str
    bits: int
    path: str
    warmup_s: float
    cast_s: float
    clone_s: float
    native_s: float
    n: int
    identical_to_eager: bool | None

    @property
    def cast_meps(self) -> float:
        """Drift's cast throughput in millions of elements per second."""
        return self.n / self.cast_s / 1e6

    @property
    def clone_meps(self) -> float:
        """``x.clone()`` throughput in millions of elements per second."""
        return self.n / self.clone_s / 1e6

    @property
    def native_meps(self) -> float:
        """Native e4m3 round-trip throughput in millions of elements per second."""
        return self.n / self.native_s / 1e6

    @property
    def vs_clone(self) -> float:
        """Drift's throughput as a fraction of ``x.clone()``'s."""
        return self.clone_s / self.cast_s

    @property
    def vs_native(self) -> float:
        """Drift's throughput as a fraction of the native e4m3 round trip's."""
        return self.native_s / self.cast_s


# --- machine and inputs ---------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    """Short commit of the checkout, ``+dirty`` when tracked files differ, or ``none``."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "none"
    return head + ("+dirty" if dirty.strip() else "") if head else "none"


def machine() -> dict[str, str | int]:
    """What the figures were measured on."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "loadavg": " ".join(f"{v:.2f}" for v in os.getloadavg()),
    }


def make_inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    """The two float32 inputs: standard normal, and normal * exp(3 * normal) (heavy-tailed)."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen, dtype=torch.float32)
    z1 = torch.randn(n, generator=gen, dtype=torch.float64)
    z2 = torch.randn(n, generator=gen, dtype=torch.float64)
    big = torch.finfo(torch.float32).max
    heavy = (z1 * torch.exp(3.0 * z2)).clamp(-big, big).to(torch.float32)
    return {"normal": normal, "heavy": heavy}


def element_formats(names: Sequence[str] | None) -> list[driftcli.Format]:
    """The formats to measure: those named, or every registered format of <= 16 bits."""
    if names:
        return [driftcli.get_format(name) for name in names]
    return [f for f in (driftcli.FORMATS[name] for name in driftcli.FORMATS) if f.bits <= MAX_BITS]


# --- timing ---------------------------------------------------------------------------------


def once(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (its result is dropped before returning)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(x: torch.Tensor, fmt: driftcli.Format,
            repeat: int) -> tuple[float, float, float, float]:
    """(warm-up s, cast s, clone s, native s): medians of ``repeat`` interleaved rounds.

    One untimed-for-throughput warm-up call of each callable comes first; the
    cast's warm-up seconds are returned, as that is where compilation happens.
    """
    def cast() -> torch.Tensor:
        return driftcli.round_to_format(x, fmt, rounding="rne", overflow="saturate")

    def clone() -> torch.Tensor:
        return x.clone()

    def native() -> torch.Tensor:
        return x.to(torch.float8_e4m3fn).float()

    warmup = once(cast)
    once(clone)
    once(native)
    times: dict[str, list[float]] = {"cast": [], "clone": [], "native": []}
    for _ in range(repeat):
        times["clone"].append(once(clone))
        times["cast"].append(once(cast))
        times["native"].append(once(native))
    return (warmup, statistics.median(times["cast"]), statistics.median(times["clone"]),
            statistics.median(times["native"]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two float tensors (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    idtype = {torch.float32: torch.int32, torch.float64: torch.int64,
              torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.view(idtype), b.view(idtype))


def run(inputs: dict[str, torch.Tensor], formats: list[driftcli.Format], modes: list[str],
        repeat: int, check: bool, progress: Callable[[Row], None]) -> list[Row]:
    """Measure every (path, input, format) and return the rows in that order."""
    rows: list[Row] = []
    for mode in modes:
        for input_name, x in inputs.items():
            for fmt in formats:
                rounding.set_compile(mode)
                warmup, cast_s, clone_s, native_s = measure(x, fmt, repeat)
                identical: bool | None = None
                if check and mode != "never":
                    got = driftcli.round_to_format(x, fmt, rounding="rne", overflow="saturate")
                    rounding.set_compile("never")
                    ref = driftcli.round_to_format(x, fmt, rounding="rne", overflow="saturate")
                    identical = same_bits(got, ref)
                    del got, ref
                path = PATHS[mode]
                if mode != "never" and getattr(rounding, "_broken", False):
                    path += " (fell back to eager)"
                row = Row(input_name, fmt.name, fmt.bits, path, warmup, cast_s, clone_s,
                          native_s, x.numel(), identical)
                rows.append(row)
                progress(row)
    return rows


# --- output ---------------------------------------------------------------------------------

COLUMNS = ("input", "format", "bits", "path", "warm-up s", "Me/s", "clone Me/s", "e4m3 Me/s",
           "x clone", "x e4m3", "= eager")


def cells(row: Row) -> tuple[str, ...]:
    """The printed cells of one row, in COLUMNS order."""
    check = {None: "-", True: "yes", False: "NO"}[row.identical_to_eager]
    return (row.input, row.format, str(row.bits), row.path, f"{row.warmup_s:.2f}",
            f"{row.cast_meps:.0f}", f"{row.clone_meps:.0f}", f"{row.native_meps:.0f}",
            f"{row.vs_clone:.2f}", f"{row.vs_native:.2f}", check)


def table(rows: list[Row]) -> str:
    """An aligned Markdown table of the rows (readable as plain text too)."""
    body = [cells(r) for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(COLUMNS)]
    left = {0, 1, 3}

    def line(values: Sequence[str]) -> str:
        padded = (v.ljust(w) if i in left else v.rjust(w)
                  for i, (v, w) in enumerate(zip(values, widths, strict=True)))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i not in left else ("-" * (w + 2))
                          for i, w in enumerate(widths)) + "|"
    return "\n".join([line(COLUMNS), rule, *(line(b) for b in body)])


def verdict(rows: list[Row]) -> list[str]:
    """Whether the compiled path meets the targets for every cast to <= 8 bits."""
    lines = []
    targeted = [r for r in rows if r.path.startswith("compiled") and r.bits <= TARGET_BITS]
    for label, attr in (("clone()", "vs_clone"), ("native e4m3 round trip", "vs_native")):
        if not targeted:
            lines.append(f"target >= {TARGET_RATIO}x {label}: not measured (no compiled rows)")
            continue
        worst = min(targeted, key=lambda r: getattr(r, attr))
        misses = [r for r in targeted if getattr(r, attr) < TARGET_RATIO]
        state = "met" if not misses else f"MISSED in {len(misses)} of {len(targeted)} rows"
        lines.append(f"target >= {TARGET_RATIO}x {label} (compiled, <= {TARGET_BITS} bits): "
                     f"{state}; worst {getattr(worst, attr):.2f}x ({worst.format}, {worst.input})")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n", type=int, default=1 << 24, help="elements per input tensor")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per figure (median taken)")
    p.add_argument("--formats", nargs="+", metavar="FMT",
                   help="formats to measure (default: every registered format of <= 16 bits)")
    p.add_argument("--compile", choices=("auto", "always", "never"), default=None,
                   help="drift's compile mode to measure (default: both never and always)")
    p.add_argument("--inputs", nargs="+", choices=("normal", "heavy"), default=["normal", "heavy"],
                   help="which inputs to measure")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--cold-cache", action="store_true",
                   help="compile into a fresh, empty inductor cache (honest first-compile times)")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing compiled results bit for bit with eager ones")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the header, the table and the verdict."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.cold_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="drift-bench-inductor-")
    modes = [args.compile] if args.compile else ["never", "always"]
    formats = element_formats(args.formats)
    info = machine()
    print(f"machine: {info['platform']}; {info['cpu']}; {info['cores']} cores; "
          f"torch {info['torch']} ({info['threads']} threads); python {info['python']}")
    print(f"commit:  {info['commit']}; load average at start {info['loadavg']}")
    given = sys.argv[1:] if argv is None else list(argv)
    print(f"command: python benchmarks/bench_casts.py {' '.join(given)}".rstrip())
    print(f"n = {args.n}, repeat = {args.repeat}, paths = {', '.join(PATHS[m] for m in modes)}, "
          f"inductor cache = {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'drift default')}")
    print("ratios: drift Me/s / baseline Me/s, baselines timed interleaved on the same input")
    sys.stdout.flush()

    all_inputs = make_inputs(args.n, args.seed)
    inputs = {k: all_inputs[k] for k in args.inputs}
    del all_inputs

    def progress(row: Row) -> None:
        print("  " + "  ".join(cells(row)), file=sys.stderr, flush=True)

    rows = run(inputs, formats, modes, args.repeat, not args.no_check, progress)
    print()
    print(table(rows))
    print()
    for line in verdict(rows):
        print(line)
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        payload = {"machine": info, "n": args.n, "repeat": args.repeat,
                   "rows": [asdict(r) | {"cast_meps": r.cast_meps, "clone_meps": r.clone_meps,
                                         "native_meps": r.native_meps, "vs_clone": r.vs_clone,
                                         "vs_native": r.vs_native} for r in rows]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
