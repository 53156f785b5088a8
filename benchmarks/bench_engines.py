"""drift's execution engines against the serial run, side by side in one process.

Builds (once, seeded, into a temp folder) four float32 safetensors checkpoints of about 500 MB
each, shaped like a small transformer (heavy-tailed values, as in ``bench_scan.py``), then
times ``clip-rate``'s library call on all four with the casts ``fp8_e4m3``, ``mxfp8_e4m3`` and
``nvfp4`` (``MEASURES["clip-rate"].rows(scan(..., execution=...))``) on three engines,
interleaved round by round after a first call of each (timed apart: start-up, compilation):

- ``serial``: this process, one tensor after another;
- ``ray``: a local Ray cluster of 2 workers, started once for the whole benchmark (its
  workers stay up from one call to the next, as on a cluster);
- ``processes``: 2 local worker processes, a new pool every call (what the engine does).

Every engine's rows are checked equal to the serial rows (their ``repr``: bit for bit).

The per-unit overhead is timed on tiny units: two checkpoints of 200 and 1,000 tensors of
64 elements, each engine with **one** worker, so that nothing runs in parallel; the slope of
the wall time between the two sizes is the cost of one unit, and an engine's slope less the
serial slope is what it adds per unit (the intercept is its fixed cost: a pool's start-up).

Peak memory per worker is each worker process's ``VmHWM`` (``/proc/PID/status``; psutil is
not needed), sampled every 100 ms while the engines run, for every descendant of this process
that is a worker (a Ray worker's process title starts ``ray::``, Ray's agents left out; a
process pool's command line names ``spawn_main``). It is set against the serial bound, the
largest tensor times 3 plus 300 MB (what ``bench_scan.py`` holds the serial command to), and
against the serial command's own peak on one checkpoint, run in a child process.

When :func:`driftcli.runs.probe.probe` takes an ``execution``, a probe sweep follows: a
small MLP trained here on made-up text with a checkpoint every few steps, probed under three
policies, serial against Ray and processes (2 workers each), its rows checked equal.

On a 2-core machine two workers cannot be more than twice as fast as one, and the driver,
the Ray daemons and the workers share the same two cores: the speed-up is bounded by that.

Run ``python benchmarks/bench_engines.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file

from driftcli.choices import Engine
from driftcli.engines import Execution
from driftcli.measures import MEASURES
from driftcli.measures.scan import scan
from driftcli.memory import bound_memory, use_huge_pages
from driftcli.runs.probe import probe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import machine
from bench_scan import CASTS, child
from bench_scan import shapes as transformer_shapes

K = TypeVar("K")
CHECKPOINTS = 4
D, FF, VOCAB, LAYERS = 2048, 5504, 12288, 2
TINY = (200, 1000)
"""Tensors of the two tiny checkpoints the per-unit cost is the slope between."""
TINY_NUMEL = 64
WORKERS = 2
PROBE_POLICIES = ("exact", "mxfp8_e4m3", "nvfp4")
WORDS = ("the king and queen of a far country went walking by the sea at night and spoke of "
         "all the ships that sailed away")
"""The made-up text the probed run trains on is these words, drawn at random."""


def shapes() -> dict[str, tuple[int, ...]]:
    """20 tensors, 505 MB of float32: the embedding is the largest (101 MB)."""
    return transformer_shapes(D, FF, VOCAB, LAYERS, head_bias=False)


def build(path: Path, tensors: dict[str, tuple[int, ...]], seed: int) -> None:
    """Seeded heavy-tailed values: normal * exp(normal), scaled per tensor."""
    gen = torch.Generator().manual_seed(seed)
    made = {}
    for i, (name, shape) in enumerate(tensors.items()):
        x = torch.randn(shape, generator=gen)
        x *= torch.exp(torch.randn(shape, generator=gen))
        made[name] = x * 2.0 ** (-(i % 7) - 4)
    save_file(made, str(path))


def checkpoints(folder: Path) -> tuple[list[Path], list[Path]]:
    """The four large checkpoints and the two tiny ones, built if missing."""
    folder.mkdir(parents=True, exist_ok=True)
    large = [folder / f"ckpt-{i}.safetensors" for i in range(CHECKPOINTS)]
    tiny = [folder / f"tiny-{n}.safetensors" for n in TINY]
    for i, path in enumerate(large):
        if not path.exists():
            print(f"building {path} …", flush=True)
            build(path, shapes(), seed=i)
    for n, path in zip(TINY, tiny, strict=True):
        if not path.exists():
            build(path, {f"t{j:05d}": (TINY_NUMEL,) for j in range(n)}, seed=n)
    return large, tiny


class Peaks:
    """The largest ``VmHWM`` seen of every worker process below this one, by engine, sampled
    by a thread (a worker's own high-water mark: nothing of the driver's is counted)."""

    def __init__(self, every: float = 0.1) -> None:
        self.every = every
        self.peak: dict[str, dict[int, int]] = {"ray": {}, "processes": {}}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.every):
            parents: dict[int, int] = {}
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    try:
                        stat = Path(entry.path, "stat").read_text()
                    except OSError:  # it ended meanwhile
                        continue
                    parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            for pid in parents:
                up = pid
                while up in parents and up != me:
                    up = parents[up]
                if up == me and pid != me:
                    self._sample(pid)

    def _sample(self, pid: int) -> None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        # Ray's own agents (ray::DashboardAgent, ray::RuntimeEnvAgent) are no workers
        kind = ("ray" if cmdline.startswith("ray::") and "Agent" not in cmdline else
                "processes" if "spawn_main" in cmdline else None)
        hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines()
                    if line.startswith("VmHWM")), 0)
        if kind is not None:
            self.peak[kind][pid] = max(self.peak[kind].get(pid, 0), hwm)


def clip_rate(paths: Sequence[Path], execution: Execution) -> list[Any]:
    """clip-rate's rows of ``paths`` on ``execution``: the library call behind the command."""
    m = MEASURES["clip-rate"]
    return m.rows(scan(list(paths), list(CASTS), rounded=m.rounded, execution=execution))


def medians(calls: dict[K, Callable[[], Any]], repeat: int) -> tuple[
        dict[K, float], dict[K, float], dict[K, Any]]:
    """Each call's median wall seconds over ``repeat`` rounds, every call once a round, one
    after the other (slow drifts of the machine hit all alike); before them, the seconds and
    the result of each one's first call (start-up and compilation fall in it)."""
    first: dict[K, float] = {}
    results: dict[K, Any] = {}
    for name, fn in calls.items():
        start = time.perf_counter()
        results[name] = fn()
        first[name] = time.perf_counter() - start
    times: dict[K, list[float]] = {name: [] for name in calls}
    for _ in range(repeat):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}, first, results


def compare(title: str, calls: dict[str, Callable[[], list[Any]]], repeat: int,
            size: int | None = None) -> None:
    """Time ``calls`` (the first is the serial one) and print each one's median, speed-up
    over serial and first call, and whether its rows are the serial rows bit for bit."""
    t, first, rows = medians(calls, repeat)
    serial = next(iter(calls))
    print(f"{title}, median of {repeat}:")
    for name in calls:
        speed = "" if size is None else f"  {size / t[name] / 1e9:5.2f} GB/s"
        same = "" if name == serial else (
            f"  rows == serial: {same_rows(rows[name], rows[serial])}")
        print(f"  {name:9} {t[name]:6.2f} s{speed}  speed-up {t[serial] / t[name]:.2f}x  "
              f"(first call {first[name]:.1f} s){same}", flush=True)


def engines(workers: int) -> dict[str, Execution]:
    """The three executions compared."""
    return {"serial": Execution(), "ray": Execution(Engine.RAY, workers),
            "processes": Execution(Engine.PROCESSES, workers)}


def same_rows(a: list[Any], b: list[Any]) -> bool:
    """Rows equal bit for bit (``repr`` of a float is exact, and NaN equals NaN in it)."""
    return [repr(r) for r in a] == [repr(r) for r in b]


def scan_figures(large: list[Path], repeat: int) -> None:
    """The four checkpoints on every engine: speed-up and equality."""
    size = sum(p.stat().st_size for p in large)
    compare(f"clip-rate {'+'.join(CASTS)} on {CHECKPOINTS} checkpoints ({size / 1e9:.2f} GB)",
            {n: (lambda ex=ex: clip_rate(large, ex)) for n, ex in engines(WORKERS).items()},
            repeat, size)


def overhead_figures(tiny: list[Path], repeat: int) -> None:
    """The cost of one unit on each engine, from the slope between the tiny checkpoints."""
    runs = engines(1)
    t, _, _ = medians({(name, n): (lambda ex=ex, p=p: clip_rate([p], ex))
                       for name, ex in runs.items() for n, p in zip(TINY, tiny, strict=True)},
                      repeat)
    units = TINY[1] - TINY[0]
    serial = (t["serial", TINY[1]] - t["serial", TINY[0]]) / units
    print(f"per unit ({TINY[0]} and {TINY[1]} tensors of {TINY_NUMEL} elements, one worker, "
          f"median of {repeat}):")
    for name in runs:
        slope = (t[name, TINY[1]] - t[name, TINY[0]]) / units
        fixed = t[name, TINY[0]] - slope * TINY[0]
        extra = "" if name == "serial" else f", {1e3 * (slope - serial):.2f} ms more than serial"
        print(f"  {name:9} {1e3 * slope:.2f} ms a unit{extra}; fixed {fixed:.2f} s "
              f"({t[name, TINY[0]]:.2f} s and {t[name, TINY[1]]:.2f} s)", flush=True)


def probe_figures(folder: Path, repeat: int) -> None:
    """A probe sweep over a run's checkpoints on every engine."""
    from driftcli.models import MLPConfig
    from driftcli.runs import TrainConfig, train

    run = folder / "run"
    if not run.is_dir():
        rng = random.Random(0)
        words = WORDS.split()
        text = folder / "text.txt"
        text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(8))
                                  for _ in range(2000)) + "\n")
        train(TrainConfig(MLPConfig(context=32, hidden=256, layers=2), steps=12, batch=16,
                          checkpoint_every=3, eval_every=0, log_every=0), run, text)
    n = len(list(run.glob("step-*.safetensors")))

    def sweep(ex: Execution) -> list[Any]:
        return probe(run, list(PROBE_POLICIES), draws=2, windows=8, execution=ex)

    compare(f"probe sweep: {n} checkpoints x {len(PROBE_POLICIES)} policies "
            f"({', '.join(PROBE_POLICIES)})",
            {name: (lambda ex=ex: sweep(ex)) for name, ex in engines(WORKERS).items()}, repeat)


def figures(large: list[Path], tiny: list[Path], args: argparse.Namespace) -> None:
    """Every figure, in order: the scans (watching the workers' memory), the per-unit cost,
    the serial command's peak and the probe sweep."""
    largest = max(torch.Size(s).numel() * 4 for s in shapes().values())
    with Peaks() as peaks:
        scan_figures(large, args.repeat)
        overhead_figures(tiny, args.repeat)
    bound = 3 * largest + 300e6
    _, serial_peak = child(large[0], fast_hash=True)
    print(f"peak RSS per worker (VmHWM; serial bound 3 x largest tensor {largest / 1e6:.0f} MB"
          f" + 300 MB = {bound / 1e6:.0f} MB; the serial command on one checkpoint: "
          f"{serial_peak / 1e6:.0f} MB):")
    for kind, per_pid in peaks.peak.items():
        if per_pid:
            top = max(per_pid.values())
            print(f"  {kind:9} {len(per_pid)} worker processes, largest {top / 1e6:.0f} MB = "
                  f"{top / bound:.2f}x the bound, {top / serial_peak:.2f}x the serial command; "
                  f"median {statistics.median(per_pid.values()) / 1e6:.0f} MB")
    if args.no_probe:
        print("probe sweep: left out (--no-probe)")
    elif "execution" not in inspect.signature(probe).parameters:
        print("probe sweep: left out (driftcli.runs.probe.probe takes no execution yet)")
    else:
        probe_figures(args.folder, max(1, args.repeat - 1))


def main(argv: list[str] | None = None) -> int:
    """Build the checkpoints if needed, time every engine, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) /
                        "drift-bench-engines", help="where the checkpoints are built or reused")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-probe", action="store_true", help="leave the probe sweep out")
    args = parser.parse_args(argv)
    huge = use_huge_pages()  # as the drift command does, before the first tensor
    bound_memory()
    large, tiny = checkpoints(args.folder)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"{info['threads']} threads, commit {info['commit']}, load {info['loadavg']}, "
          f"huge pages {'on' if huge else 'off'}", flush=True)
    import ray

    print(f"ray {ray.__version__}, {WORKERS} workers", flush=True)
    try:
        figures(large, tiny, args)
    finally:
        ray.shutdown()  # the local cluster's daemons end with it
    print(f"load at the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
