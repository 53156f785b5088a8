"""drift's checkpoint scan side by side with a plain read and with the torch + torchao script a
user would write instead, in one run.

Builds (once, seeded) a ~0.55 GB float32 safetensors checkpoint shaped like a small transformer
(an embedding, four layers of attention and MLP matrices, norm vectors; 39 tensors,
heavy-tailed values so that casts clip and underflow; ``--scale`` multiplies its dimensions,
kept multiples of 64), then:

1. **library calls, in this process**, interleaved round by round after one untimed warm-up,
   one table per torch thread count (``--threads``, default 1 and 2):
   ``copy`` (the file read into memory in 16 MiB pieces and summed: the plain read the targets
   are measured against), ``read`` (every tensor through ``safetensors.safe_open``, mapped),
   ``import torch`` (a fresh process that only imports torch: every command's floor),
   drift's ``clip-rate``, ``underflow-rate`` and ``error-bias`` with the casts ``fp8_e4m3``,
   ``mxfp8_e4m3`` and ``nvfp4`` (the library call behind each command), ``clip-rate in
   series`` (clip-rate with each slice read on the scan's thread before its pass, as before the
   read ahead: ``measures.scan.READ_AHEAD_BYTES`` None), ``block-stats`` on the same casts (its
   time against clip-rate's: target at most 1.5x), and ``script``: the
   torch + torchao code a user would write for the same clip counts (``safe_open``, torch's
   native float8 cast per tensor, torchao's ``to_mx`` and ``NVFP4Tensor``; left out, and
   said so, where torchao is not installed). Each row is one entry of a dict of calls: a new
   one (drift's in-memory ``measure``) is one more entry; before them, the per-slice work of
   the three casts (:func:`per_slice`: the fused clip pass, the fused rounded pass and the
   per-cast rounded counts it replaced) on one thread;
2. **fresh processes**, as a user runs them, on every instruction set this machine offers
   torch (``ATEN_CPU_CAPABILITY``: the default, ``avx2``) and with no C++ compiler on
   ``PATH``: ``import torch`` alone, each command (``drift clip-rate FILE -c ... --quiet
   --fast-hash``), and the user's script; with each command's peak resident memory against
   the largest tensor.

Run ``python benchmarks/bench_scan.py --help`` for the options; figures go in
``docs/performance.md#checkpoint-scan-benchmarksbench_scanpy``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from driftcli.measures import MEASURES
from driftcli.measures import scan as scan_module
from driftcli.measures.block_stats import block_stats
from driftcli.memory import use_huge_pages

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import interleaved, machine

CASTS = ("fp8_e4m3", "mxfp8_e4m3", "nvfp4")
COMMANDS = ("clip-rate", "underflow-rate", "error-bias")
SERIES = "clip-rate in series"
"""clip-rate with every read on the scan's thread, before the pass over it (no read ahead)."""
TARGETS = {"clip-rate": 1.0, "underflow-rate": 0.3, "error-bias": 0.3}
"""Each command's library scan speed against the copying read's (issue 41)."""
BLOCK_STATS = "block-stats"
BLOCK_STATS_TARGET = 1.5
"""block-stats' time at most this many times clip-rate's on the same casts (issue 41)."""
D, FF, VOCAB, LAYERS = 1536, 4096, 16384, 4


def shapes(d: int = D, ff: int = FF, vocab: int = VOCAB, layers: int = LAYERS,
           head_bias: bool = True) -> dict[str, tuple[int, ...]]:
    """A small transformer's tensors: by default 39 tensors, 0.55 GB of float32, the
    embedding the largest (101 MB)."""
    out: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {p + n: (d, d) for n in ("q.weight", "k.weight", "v.weight", "o.weight")}
        out |= {p + "up.weight": (ff, d), p + "gate.weight": (ff, d), p + "down.weight": (d, ff)}
        out |= {p + "norm1.weight": (d,), p + "norm2.weight": (d,)}
    out["norm.weight"] = (d,)
    if head_bias:
        out["lm_head.bias"] = (vocab,)
    return out


def build(path: Path, seed: int = 0, dims: tuple[int, int, int] = (D, FF, VOCAB)) -> None:
    """Seeded heavy-tailed values: normal * exp(normal), scaled per tensor; ``dims`` the
    first three of :func:`shapes`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (name, shape) in enumerate(shapes(*dims).items()):
        x = torch.randn(shape, generator=gen)
        x *= torch.exp(torch.randn(shape, generator=gen))
        tensors[name] = x * 2.0 ** (-(i % 7) - 4)
    save_file(tensors, str(path))


def plain_read(path: Path) -> float:
    """Read every tensor through safetensors and sum it: what any scan must at least do.
    (safetensors maps the file and hands out tensors over the mapping: no copy.)"""
    total = 0.0
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            total += float(f.get_tensor(name).sum())
    return total


def copy_read(path: Path) -> float:
    """The file read into memory in 16 MiB pieces and summed: a read that copies, as
    drift's readers do (they never keep the file mapped). One thread: waking a second after
    every read made this read bimodal from one process to the next."""
    total = 0.0
    buf = bytearray(16 << 20)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with path.open("rb") as fh:
            fh.seek(8 + int.from_bytes(fh.read(8), "little"))
            while n := fh.readinto(buf):
                total += float(torch.frombuffer(buf, dtype=torch.float32, count=n // 4).sum())
    finally:
        torch.set_num_threads(threads)
    return total


SCRIPT = r"""
import logging, sys, torch
from safetensors import safe_open
for name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(name).setLevel(logging.ERROR)
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

def clip_counts(path):
    # what a user writes for "how much clips under fp8_e4m3, mxfp8_e4m3 and nvfp4"
    counts = {"fp8_e4m3": 0, "mxfp8_e4m3": 0, "nvfp4": 0, "elements": 0}
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            x = f.get_tensor(name).float()
            counts["elements"] += x.numel()
            amax = x.abs().max()
            scale = (amax / 448).clamp(min=1e-12)
            y = x / scale
            counts["fp8_e4m3"] += int((y.abs() > 448).sum())
            y.to(torch.float8_e4m3fn)                      # the cast itself
            if x.shape[-1] % 32 == 0:
                s, data = to_mx(x, torch.float8_e4m3fn, 32)
                blocks = x.reshape(-1, 32).abs()
                k = s.view(torch.uint8).reshape(-1, 1).to(torch.int32) - 127
                limit = 448 * k.float().exp2()
                counts["mxfp8_e4m3"] += int((blocks > limit).sum())
            if x.shape[-1] % 16 == 0:
                x2 = x.reshape(-1, x.shape[-1])  # to_nvfp4 takes 2-D or 3-D tensors
                t = NVFP4Tensor.to_nvfp4(x2, per_tensor_scale=per_tensor_amax_to_scale(amax))
                block = t.scale.float().reshape(-1, 1) * t.per_tensor_scale.float()
                counts["nvfp4"] += int((x.reshape(-1, 16).abs() > 6 * block).sum())
    return counts

if __name__ == "__main__":
    print(clip_counts(sys.argv[1]))
"""
"""The script a user would write instead (torch + torchao), run as it is in a fresh process and
imported for the in-process round."""

PEAK = """
import atexit, runpy, sys
def peak():
    status = open("/proc/self/status").read()
    print(next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM")),
          file=sys.stderr, flush=True)
atexit.register(peak)  # drift's console script runs the exit handlers, then os._exit
sys.argv = sys.argv[1:]
runpy.run_module("driftcli", run_name="__main__")
"""
# VmHWM, not getrusage: Linux carries the pre-exec high-water mark of the forked copy of
# this (large) process into the child's ru_maxrss


def _script_module(folder: Path) -> Path:
    path = folder / "user_script.py"
    path.write_text(SCRIPT)
    return path


def fresh(cmd: list[str], env: dict[str, str]) -> tuple[float, int | None]:
    """Wall seconds of ``cmd`` in a fresh process, and its peak RSS when it reports one."""
    start = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    last = done.stderr.strip().splitlines()[-1:] if done.stderr.strip() else []
    peak = int(last[0]) * 1024 if last and last[0].isdigit() else None
    return wall, peak


def child(path: Path, fast_hash: bool) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of ``drift clip-rate`` with the three casts in a fresh
    process (``bench_engines.py`` holds its engines to this serial peak)."""
    cmd = [sys.executable, "-c", PEAK, "drift", "clip-rate", str(path), "--quiet",
           "--out", tempfile.mkdtemp(), *(a for c in CASTS for a in ("-c", c))]
    wall, peak = fresh([*cmd, "--fast-hash"] if fast_hash else cmd, dict(os.environ))
    if peak is None:
        raise RuntimeError(f"no peak memory reported by {' '.join(cmd)}")
    return wall, peak


def settings() -> dict[str, dict[str, str]]:
    """The environments of the fresh-process rounds: the default instruction set, AVX2 where
    the default is wider, and no C++ compiler on PATH."""
    base = dict(os.environ)
    out = {"default": base}
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "DEFAULT"):
        out["avx2"] = {**base, "ATEN_CPU_CAPABILITY": "avx2"}
    bin_dir = os.path.dirname(sys.executable)
    no_cc = {k: v for k, v in base.items() if k != "CXX"}
    no_cc["PATH"] = bin_dir
    if shutil.which("c++", path=bin_dir) is None:
        out["no compiler"] = no_cc
    return out


def in_memory(path: Path, repeat: int) -> None:
    """``drift.measure`` on the checkpoint's tensors already in memory beside the library scan
    of the file, interleaved (target: at most 1.2x its time), and its fixed cost per call on a
    4096-element tensor with the three casts (target: at most 2 ms; medians of 200 calls)."""
    from functools import partial

    from safetensors.torch import load_file

    import driftcli as drift

    state = load_file(str(path))  # already in memory: the read is not timed
    calls: dict[str, Callable[[], object]] = {"cast": lambda: None}
    for name in COMMANDS:
        calls[f"{name} file"] = partial(MEASURES[name].run, [path], list(CASTS))
        calls[f"{name} memory"] = partial(drift.measure, state, list(CASTS), name)
    t = interleaved(calls, repeat)
    print(f"\nin memory (drift.measure on the same tensors), medians of {repeat}:")
    for name in COMMANDS:
        ratio = t[f"{name} memory"] / t[f"{name} file"]
        print(f"  {name:<15s} file {t[f'{name} file']:6.2f} s  memory {t[f'{name} memory']:6.2f} s"
              f"  {ratio:5.2f}x the scan (target 1.2x: {'met' if ratio <= 1.2 else 'MISSED'})")
    small = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    for name in COMMANDS:
        drift.measure(small, list(CASTS), name)
        per_call = []
        for _ in range(200):
            start = time.perf_counter()
            drift.measure(small, list(CASTS), name)
            per_call.append(time.perf_counter() - start)
        cost = statistics.median(per_call) * 1e3
        print(f"  {name:<15s} a 4096-element tensor: {cost:.2f} ms a call (target 2 ms: "
              f"{'met' if cost <= 2 else 'MISSED'})")


def per_slice(repeat: int) -> None:
    """The scan's per-slice work for the three casts, side by side on one thread (CPU time of
    the calling thread, best of ``repeat``): the fused clip pass, the fused rounded pass
    (underflow-rate's and error-bias's counts and sums) and the per-cast rounded counts the
    fused one replaced (``cast_stats(rounded=True)`` per cast, still the path of the casts
    the pass does not take), on a heavy-tailed slice of 2^22 elements and on the monitor's
    operand sizes."""
    from driftcli.measures.stats import cast_stats, clip_stats, fused_stats
    from driftcli.records.castspec import parse_cast

    casts = [parse_cast(c) for c in CASTS]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(f"\nper slice, the three casts, one thread, CPU ms, best of {repeat}:")
        print(f"  {'elements':>9s} {'clip pass':>10s} {'rounded pass':>13s} {'Me/s':>6s} "
              f"{'per cast (before)':>18s} {'Me/s':>6s} {'x':>5s}")
        for n in (1 << 22, 1 << 18, 1 << 16):
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(n // 4096, 4096, generator=gen)
            x *= torch.exp(torch.randn(x.shape, generator=gen))
            calls = {"clip": lambda x=x: clip_stats(x, casts),
                     "fused": lambda x=x: fused_stats(x, casts, rounded=True),
                     "each": lambda x=x: [cast_stats(x, c, want_values=False) for c in casts]}
            best = {}
            for name, call in calls.items():
                call()  # compiled, warm
                times = []
                for _ in range(repeat):
                    start = time.thread_time()
                    call()
                    times.append(time.thread_time() - start)
                best[name] = min(times) * 1e3
            print(f"  {n:9d} {best['clip']:10.2f} {best['fused']:13.2f} "
                  f"{n / best['fused'] / 1e3:6.0f} {best['each']:18.2f} "
                  f"{n / best['each'] / 1e3:6.0f} {best['each'] / best['fused']:5.1f}")
    finally:
        torch.set_num_threads(threads)


def threads_split(calls: dict[str, Callable[[], object]], repeat: int) -> None:
    """clip-rate read ahead and in series, interleaved: medians of the wall seconds, of the CPU
    seconds of the scan's own thread (the pass, and in series the read) and of the whole
    process (the reader thread too). On a machine whose other core is busy (a shared one) the
    read ahead cannot shorten the wall time; the scan thread's CPU time is what it takes off
    the scan's path, and the process's what it costs."""
    names = ("clip-rate", SERIES)
    got: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for _ in range(repeat):
        for name in names:
            wall, own, every = time.perf_counter(), time.thread_time(), time.process_time()
            calls["cast" if name == "clip-rate" else name]()
            got[name].append((time.perf_counter() - wall, time.thread_time() - own,
                              time.process_time() - every))
    print(f"  clip-rate's time, medians of {repeat}: wall / the scan thread's CPU / the "
          "process's CPU (s)")
    for name in names:
        wall, own, every = (statistics.median(r[k] for r in got[name]) for k in range(3))
        print(f"    {name:<19s} {wall:6.3f} {own:6.3f} {every:6.3f}")


def _library_round(calls: dict[str, Callable[[], object]], repeat: int, size: int,
                   n_threads: int) -> None:
    """Every call, interleaved round by round, on ``n_threads`` torch threads; one table.
    (``import torch`` is a fresh process each time: the floor of any command's start.)"""
    t = interleaved(calls, repeat)
    t["clip-rate"] = t["cast"]
    names = ("copy", "read", "import torch", COMMANDS[0], SERIES, *COMMANDS[1:], BLOCK_STATS,
             *(("script",) if "script" in t else ()))
    print(f"\nlibrary calls, one process, {n_threads} thread{'s' * (n_threads > 1)}, medians "
          f"of {repeat} (warm-up {t['warmup']:.1f} s):")
    print(f"  {'what':<19s} {'s':>7s} {'GB/s':>6s} {'Me/s':>7s} {'x copy':>7s} {'target':>9s} "
          f"{'x script':>9s}")
    for name in names:
        ratio = t["copy"] / t[name]
        target = TARGETS.get(name)
        mark = "" if target is None else f"{target:.1f} {'met' if ratio >= target else 'MISSED'}"
        speed = "" if name == "import torch" else f"{size / t[name] / 1e9:6.2f}"
        elems = "" if name == "import torch" else f"{size / 4 / t[name] / 1e6:7.0f}"
        versus = f"{t['script'] / t[name]:9.2f}" if "script" in t else ""
        print(f"  {name:<19s} {t[name]:7.2f} {speed:>6s} {elems:>7s} {ratio:7.3f} {mark:>9s} "
              f"{versus}")
    over = t[BLOCK_STATS] / t["clip-rate"]
    print(f"  block-stats / clip-rate: {over:.2f}x (target at most {BLOCK_STATS_TARGET:.1f}x: "
          f"{'met' if over <= BLOCK_STATS_TARGET else 'MISSED'})")


def main(argv: list[str] | None = None) -> int:
    """Build the checkpoint if needed, time everything side by side, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=None,
                        help="checkpoint to build or reuse (default: one per --scale in the "
                             "temporary folder)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fresh-repeat", type=int, default=3,
                        help="fresh processes per command and setting (the median is shown; "
                             "0 skips them)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="torch thread counts of the library rounds, one table each")
    parser.add_argument("--slice-repeat", type=int, default=7,
                        help="rounds of the per-slice table (0 skips it)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="the checkpoint's dimensions times this (0.5: a quarter the size)")
    args = parser.parse_args(argv)
    if args.file is None:
        args.file = Path(tempfile.gettempdir()) / f"drift-bench-scan-{args.scale:g}.safetensors"
    # multiples of 64: every block of the casts stays along the last axis
    dims = (int(D * args.scale) // 64 * 64, int(FF * args.scale) // 64 * 64,
            int(VOCAB * args.scale) // 64 * 64)
    huge = use_huge_pages()  # as the drift command does, before the first tensor
    if not args.file.exists():
        print(f"building {args.file} …", flush=True)
        build(args.file, dims=dims)
    size = args.file.stat().st_size
    largest = max(torch.Size(s).numel() * 4 for s in shapes(*dims).values())
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"{info['threads']} threads, commit {info['commit']}, "
          f"huge pages {'on' if huge else 'off'}, load {info['loadavg']}")
    print(f"checkpoint: {args.file} ({size / 1e9:.3f} GB, {len(shapes(*dims))} tensors, "
          f"largest {largest / 1e6:.0f} MB)")
    work = Path(tempfile.mkdtemp())
    script = _script_module(work)
    tiny = work / "tiny.safetensors"  # a command's fixed start: one 256 x 256 tensor
    save_file({"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(1))}, str(tiny))
    sys.path.insert(0, str(work))
    have_torchao = importlib.util.find_spec("torchao") is not None
    def command(name: str) -> Callable[[], object]:
        return lambda: MEASURES[name].run([args.file], list(CASTS))

    def in_series() -> object:
        ahead = scan_module.READ_AHEAD_BYTES
        scan_module.READ_AHEAD_BYTES = None
        try:
            return MEASURES["clip-rate"].run([args.file], list(CASTS))
        finally:
            scan_module.READ_AHEAD_BYTES = ahead

    calls: dict[str, Callable[[], object]] = {
        "cast": command("clip-rate"), "copy": lambda: copy_read(args.file),
        "read": lambda: plain_read(args.file),
        "import torch": lambda: fresh([sys.executable, "-c", "import torch"], dict(os.environ)),
        SERIES: in_series, **{name: command(name) for name in COMMANDS[1:]},
        BLOCK_STATS: lambda: block_stats([args.file], list(CASTS))}
    if have_torchao:
        import user_script  # type: ignore[import-not-found]

        calls["script"] = lambda: user_script.clip_counts(str(args.file))
    else:
        print("torchao is not installed: the user's script (torch + torchao) is left out")
    if args.slice_repeat:
        per_slice(args.slice_repeat)
    threads = torch.get_num_threads()
    for n_threads in args.threads:
        torch.set_num_threads(n_threads)
        try:
            _library_round(calls, args.repeat, size, n_threads)
            threads_split(calls, max(args.repeat, 5))
        finally:
            torch.set_num_threads(threads)
    in_memory(args.file, args.repeat)
    for setting, env in settings().items() if args.fresh_repeat else ():
        rounds: dict[str, list[float]] = {}
        peaks: dict[str, int] = {}
        for _ in range(args.fresh_repeat):
            rounds.setdefault("import torch", []).append(
                fresh([sys.executable, "-c", "import torch"], env)[0])
            rounds.setdefault("start", []).append(
                fresh([sys.executable, "-c", PEAK, "drift", "clip-rate", str(tiny), "--quiet",
                       "--out", tempfile.mkdtemp(), *(a for c in CASTS for a in ("-c", c))],
                      env)[0])
            for name in COMMANDS:
                wall, peak = fresh([sys.executable, "-c", PEAK, "drift", name, str(args.file),
                                    "--quiet", "--fast-hash", "--out", tempfile.mkdtemp(),
                                    *(a for c in CASTS for a in ("-c", c))], env)
                rounds.setdefault(name, []).append(wall)
                peaks[name] = max(peaks.get(name, 0), peak or 0)
            if have_torchao:
                rounds.setdefault("script", []).append(
                    fresh([sys.executable, str(script), str(args.file)], env)[0])
        med = {k: statistics.median(v) for k, v in rounds.items()}
        bound = 3 * largest + 300e6
        print(f"\nfresh processes, {setting}, medians of {args.fresh_repeat}:")
        start = med["start"] - med["import torch"]
        script_s = f"{med['script']:.2f} s" if "script" in med else "absent (no torchao)"
        print(f"  import torch: {med['import torch']:.2f} s; user script (torch + torchao): "
              f"{script_s}; a command's fixed start (a 256 x 256 file): "
              f"{start:+.2f} s over import torch (target 1 s: {'met' if start <= 1 else 'MISSED'})")
        for name in COMMANDS:
            versus = f"{med['script'] / med[name]:5.2f}x the script (target 3x)" \
                if "script" in med else ""
            print(f"  drift {name:<15s} {med[name]:6.2f} s  {versus}  "
                  f"peak {peaks[name] / 1e6:5.0f} MB "
                  f"({'within' if peaks[name] <= bound else 'OVER'} 3x largest + 300 MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
