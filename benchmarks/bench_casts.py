"""Throughput of drift's element casts, side by side with torch baselines in one process.

For every element format of at most 16 bits in ``driftcli.FORMATS`` this times
``driftcli.round_to_format(x, fmt, rounding="rne", overflow="saturate")`` on two
float32 inputs, a standard-normal one and a heavy-tailed one, and reports
millions of elements per second (Me/s) together with two ratios measured in
the same process, on the same input, interleaved round by round with the cast:

* ``x.clone()``, the cost of reading and writing the tensor once;
* ``x.to(torch.float8_e4m3fn).float()``, torch's native FP8 round trip;

and, for context, the throughput of ``out.copy_(x)`` into a preallocated
tensor (memory bandwidth without allocation). A ratio is drift's throughput
divided by the baseline's (higher is better; 1.0 means as fast as the
baseline). Each figure is the median of ``--repeat`` timed calls after one
untimed warm-up call, whose seconds are printed in their own column.

Each row runs on one of drift's two back-ends (:data:`PATHS`): ``torch``, the
eager reference, or ``numba``, the CPU default; the numba rows are checked bit
for bit against the torch rows' results.

Besides the code, the allocator decides these figures: whether large results
land on fresh pages or on recycled memory (``--malloc``, see
:func:`set_malloc`); it is pinned and printed.

Run ``python benchmarks/bench_casts.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import driftcli
from driftcli import kernels

PATHS = ("torch", "numba")
"""drift's back-ends: ``torch``, the eager reference (``DRIFT_JIT=never``), and ``numba``, the
CPU default (see :mod:`driftcli.kernels`)."""


def set_path(path: str) -> None:
    """Put drift on ``path`` (one of :data:`PATHS`)."""
    kernels.set_jit("never" if path == "torch" else "auto")


def path_run(path: str) -> str:
    """The back-end that runs when ``path`` was asked for: ``path`` itself, or ``torch (why)``
    where numba was asked for and is not at hand."""
    why = kernels.jit_unavailable()
    return path if path == "torch" or why is None else f"torch ({why})"


FIRST_CALL = """
import sys, time
import torch
import driftcli
x = torch.randn(int(sys.argv[2]), generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter(); driftcli.round_to_format(x, sys.argv[1]); t1 = time.perf_counter()
driftcli.round_to_format(x, sys.argv[1]); t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def first_call(fmt: str, n: int) -> float:
    """Seconds the first cast in a fresh process takes beyond the second one (the numba
    path, after any on-disk cache of a previous run)."""
    out = subprocess.run([sys.executable, "-c", FIRST_CALL, fmt, str(n)], capture_output=True,
                         text=True, check=True).stdout.split()
    return float(out[0]) - float(out[1])

ROOT = Path(__file__).resolve().parent.parent
MAX_BITS = 16
TARGET_BITS = 8
TARGET_RATIOS = {"vs_native": 2.0}
"""The numba path's targets (issue 20): element casts at least twice torch's native e4m3
round trip."""


@dataclass
class Row:
    """One measured (input, format, path) cell with its interleaved baselines."""

    input: str
    format: str
    bits: int
    mode: str
    """drift's path asked for: one of :data:`PATHS`."""
    path: str
    """What ran (see :func:`path_run`)."""
    warmup_s: float
    cast_s: float
    clone_s: float
    native_s: float
    copy_s: float
    ml_dtypes_s: float
    n: int
    identical_to_torch: bool | None
    first_call_extra_s: float | None = None
    """The first call in a fresh process minus a later one (the numba path only)."""

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
    def copy_meps(self) -> float:
        """Throughput of a copy into a preallocated tensor (no allocation) in Me/s."""
        return self.n / self.copy_s / 1e6

    @property
    def vs_ml_dtypes(self) -> float:
        """Drift's throughput as a multiple of ml_dtypes' e4m3 round trip's (NaN without it)."""
        return self.ml_dtypes_s / self.cast_s

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
    """Short commit, ``+dirty`` if tracked files outside benchmarks/ and docs/ differ, or none."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!benchmarks", ":!docs"],
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


# --- allocator -------------------------------------------------------------------------------

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def set_malloc(regime: str, nbytes: int) -> str:
    """Pin glibc's allocator so that every figure sees the same memory; say what was done.

    ``nbytes`` is the size of one float32 result. A 2**24-element result is
    64 MiB; whether such a buffer arrives as fresh pages (each faulted in and
    zeroed by the kernel on first write, which costs more than the copy
    itself) or as memory the process already touched depends, under glibc's
    defaults, on how the heap happens to be fragmented, so ``x.clone()`` alone
    can swing by 5x within one process.

    ``fresh`` maps every allocation of 4 MiB or more (or of a result's size,
    if smaller) anew, as glibc does by default for a clean process's tensors
    over 32 MiB, and keeps smaller blocks, such as the 1 MiB temporaries of
    drift's chunked eager kernel, in a heap that is never trimmed. ``reuse``
    never maps nor returns memory, so every buffer is recycled, as in a
    steady-state loop with a caching allocator. ``as-is`` leaves glibc alone.
    """
    if regime == "as-is":
        return "as-is (glibc defaults)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return f"as-is ({regime} needs glibc's mallopt, unavailable here)"
    # a fixed mmap threshold also fixes the trim threshold (128 KiB): keep the heap instead
    ok = mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    if regime == "fresh":
        threshold = max(1 << 17, min(4 << 20, nbytes))
        ok = ok and mallopt(_M_MMAP_THRESHOLD, threshold)
        return f"fresh (allocations >= {threshold >> 10} KiB mapped anew)" if ok else (
            "as-is (mallopt refused fresh)")
    ok = ok and mallopt(_M_MMAP_MAX, 0)
    return "reuse (no mapping, heap never trimmed)" if ok else "as-is (mallopt refused reuse)"


# --- timing ---------------------------------------------------------------------------------


CLOCK: Callable[[], float] = time.perf_counter
"""What :func:`once` reads: wall seconds, or ``time.thread_time`` (the calling thread's CPU
seconds: with one thread, every kernel runs on it, and a busy machine's waits do not count)."""


def once(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes by :data:`CLOCK` (its result is dropped before
    returning)."""
    start = CLOCK()
    fn()
    return CLOCK() - start


def measure(x: torch.Tensor, fmt: driftcli.Format, repeat: int) -> dict[str, float]:
    """Warm-up seconds of the cast, and medians of ``repeat`` interleaved rounds of each callable.

    Each round times ``x.clone()``, the cast, the native e4m3 round trip and a
    copy into a preallocated tensor, one after the other, so slow drifts of the
    machine's state hit all four alike. One warm-up call of each comes first;
    the cast's is returned.
    """
    out = torch.empty_like(x)
    calls: dict[str, Callable[[], object]] = {
        "clone": x.clone,
        "cast": lambda: driftcli.round_to_format(x, fmt, rounding="rne", overflow="saturate"),
        "native": lambda: x.to(torch.float8_e4m3fn).float(),
        "copy": lambda: out.copy_(x),
    }
    try:
        import ml_dtypes

        array = x.numpy()
        calls["ml_dtypes"] = lambda: array.astype(ml_dtypes.float8_e4m3fn).astype("float32")
    except ImportError:  # a peer from the dev extras
        pass
    return interleaved(calls, repeat)


def interleaved(calls: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Warm-up seconds of ``calls["cast"]`` and each call's median over ``repeat`` rounds.

    One untimed warm-up of every call first (the cast's is returned as
    ``warmup``); then each round times every call once, one after the other,
    so slow drifts of the machine hit all of them alike.
    """
    result = {"warmup": once(calls["cast"])}
    for name, fn in calls.items():
        if name != "cast":
            once(fn)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeat):
        for name, fn in calls.items():
            times[name].append(once(fn))
    result.update({name: statistics.median(ts) for name, ts in times.items()})
    return result


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two float tensors (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    idtype = {torch.float32: torch.int32, torch.float64: torch.int64,
              torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.view(idtype), b.view(idtype))


def run(inputs: dict[str, torch.Tensor], formats: list[driftcli.Format], modes: list[str],
        repeat: int, *, check: bool, first: bool, progress: Callable[[Row], None]) -> list[Row]:
    """Measure every (path, format, input) and return the rows; with ``check``, a numba
    row's result is compared bit for bit with the torch path's on the same input."""
    rows: list[Row] = []
    for mode in modes:
        for fmt in formats:
            for input_name, x in inputs.items():
                set_path(mode)
                t = measure(x, fmt, repeat)
                path = path_run(mode)
                identical: bool | None = None
                if check and mode != "torch":
                    got = driftcli.round_to_format(x, fmt, rounding="rne", overflow="saturate")
                    set_path("torch")
                    ref = driftcli.round_to_format(x, fmt, rounding="rne", overflow="saturate")
                    identical = same_bits(got, ref)
                    del got, ref
                extra = first_call(fmt.name, x.numel()) if first and mode == "numba" and (
                    input_name == next(iter(inputs))) else None
                row = Row(input_name, fmt.name, fmt.bits, mode, path, t["warmup"], t["cast"],
                          t["clone"], t["native"], t["copy"], t.get("ml_dtypes", float("nan")),
                          x.numel(), identical, extra)
                rows.append(row)
                progress(row)
    return rows


# --- output ---------------------------------------------------------------------------------

COLUMNS = ("input", "format", "bits", "path", "warm-up s", "1st call +s", "Me/s", "clone Me/s",
           "e4m3 Me/s", "ml_dtypes Me/s", "copy_ Me/s", "x clone", "x e4m3", "x ml_dtypes",
           "= torch")


def cells(row: Row) -> tuple[str, ...]:
    """The printed cells of one row, in COLUMNS order."""
    check = {None: "-", True: "yes", False: "NO"}[row.identical_to_torch]
    first = "-" if row.first_call_extra_s is None else f"{row.first_call_extra_s:.2f}"
    return (row.input, row.format, str(row.bits), row.path, f"{row.warmup_s:.2f}", first,
            f"{row.cast_meps:.0f}", f"{row.clone_meps:.0f}", f"{row.native_meps:.0f}",
            f"{row.n / row.ml_dtypes_s / 1e6:.0f}", f"{row.copy_meps:.0f}",
            f"{row.vs_clone:.2f}", f"{row.vs_native:.2f}", f"{row.vs_ml_dtypes:.2f}", check)


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
    """Whether the numba path meets the targets for every cast to <= 8 bits."""
    lines = []
    targeted = [r for r in rows if r.mode == "numba" and r.bits <= TARGET_BITS]
    for label, attr in (("native e4m3 round trip", "vs_native"),):
        if not targeted:
            lines.append(f"target {label}: not measured (no numba-path rows)")
            continue
        worst = min(targeted, key=lambda r: getattr(r, attr))
        goal = TARGET_RATIOS[attr]
        misses = [r for r in targeted if getattr(r, attr) < goal]
        state = "met" if not misses else f"MISSED in {len(misses)} of {len(targeted)} rows"
        lines.append(f"target >= {goal}x {label} (numba path, <= {TARGET_BITS} bits): "
                     f"{state}; worst {getattr(worst, attr):.2f}x ({worst.format}, {worst.input})")
    firsts = [r.first_call_extra_s for r in targeted if r.first_call_extra_s is not None]
    if firsts:
        lines.append(f"first call in a fresh process, beyond a later one: at most "
                     f"{max(firsts):.2f} s (target <= 1 s)")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1 << 24,
                   help="elements per input tensor (default: 2**24)")
    p.add_argument("--repeat", type=int, default=5,
                   help="timed calls per figure, median taken (default: 5)")
    p.add_argument("--formats", nargs="+", metavar="FMT",
                   help="formats to measure (default: every registered format of <= 16 bits)")
    p.add_argument("--path", choices=PATHS, action="append", default=None,
                   help="drift's back-end to measure, repeatable (default: torch and numba)")
    p.add_argument("--no-first-call", action="store_true",
                   help="skip the fresh-process first-call column (a process per format)")
    p.add_argument("--inputs", nargs="+", choices=("normal", "heavy"), default=["normal", "heavy"],
                   help="which inputs to measure (default: both)")
    p.add_argument("--malloc", choices=("fresh", "reuse", "as-is"), default="fresh",
                   help="allocator regime: fresh pages for every large tensor (default), "
                        "recycled memory, or glibc's defaults (see set_malloc)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing numba's results bit for bit with torch's")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the header, the table and the verdict."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    malloc = set_malloc(args.malloc, 4 * args.n)
    modes = args.path or list(PATHS)
    formats = element_formats(args.formats)
    info = machine()
    print(f"machine: {info['platform']}; {info['cpu']}; {info['cores']} cores; "
          f"torch {info['torch']} ({info['threads']} threads); python {info['python']}")
    print(f"commit:  {info['commit']}; load average at start {info['loadavg']}")
    given = sys.argv[1:] if argv is None else list(argv)
    print(f"command: python benchmarks/bench_casts.py {' '.join(given)}".rstrip())
    print(f"n = {args.n}, repeat = {args.repeat}, paths = {', '.join(modes)}, "
          f"malloc = {malloc}, numba {kernels.jit_unavailable() or 'at hand'}")
    print("ratios: drift Me/s / baseline Me/s, baselines timed interleaved on the same input")
    sys.stdout.flush()

    all_inputs = make_inputs(args.n, args.seed)
    inputs = {k: all_inputs[k] for k in args.inputs}
    del all_inputs

    def progress(row: Row) -> None:
        print("  " + "  ".join(cells(row)), file=sys.stderr, flush=True)

    rows = run(inputs, formats, modes, args.repeat, check=not args.no_check,
               first=not args.no_first_call, progress=progress)
    print()
    print(table(rows))
    print()
    for line in verdict(rows):
        print(line)
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        derived = ("cast_meps", "clone_meps", "native_meps", "copy_meps", "vs_clone", "vs_native",
                   "vs_ml_dtypes")
        payload = {"machine": info, "n": args.n, "repeat": args.repeat, "malloc": malloc,
                   "command": given,
                   "verdict": verdict(rows),
                   "rows": [asdict(r) | {k: getattr(r, k) for k in derived} for r in rows]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
