"""Where independent work units run: in this process, in local processes, or on a Ray cluster.

Every command that does independent work (a scan's tensors, a probe's checkpoints, a
grad-cosine's policies, verify-formats' cells) hands :func:`run` a list of units and a function
of one unit. Results come back **in the order of the units**, whatever order they finished
in, and the caller merges them in that order: the serial engine runs the same units through
the same merge, so every engine writes the same table, integer counts and float64 sums bit for
bit (on one machine; across machines of different CPUs, torch's float kernels may differ, see
docs/scale-out.md).

The work function and the units must pickle (module-level functions, frozen dataclasses):
units travel to worker processes and cluster nodes. Ray is an optional extra, imported only
when the Ray engine is asked for.

A finished unit can be kept in a :class:`Manifest`: a run interrupted on the driver resumes
from it, redoing only the units it does not hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import socket
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from driftcli.errors import DriftError
from driftcli.modes import Engine
from driftcli.progress import Progress

U = TypeVar("U")
R = TypeVar("R")

RAY_EXTRA = "driftcli[ray]"
"""The optional extra that installs Ray."""
RETRIES = 3
"""Times a unit whose worker died is run again (a unit that raises for its input is not
retried: it fails the same way everywhere)."""


class EngineError(DriftError):
    """An engine that cannot run here (Ray not installed, a cluster not reachable)."""


@dataclass(frozen=True)
class Execution:
    """How a command's units run: the engine, its workers, and for Ray the cluster."""

    engine: Engine = Engine.SERIAL
    workers: int | None = None
    """Worker processes (processes) or concurrent tasks (Ray); None: one per CPU."""
    ray_address: str | None = None
    """``auto`` (a running cluster), an address, or None for a local cluster for the run."""
    resume: Path | None = None
    """Keep finished units under this folder, and take those already there."""
    threads: int | None = None
    """Torch threads of every unit; None: this process's. A unit's float64 sums are torch
    reductions whose order depends on the thread count, so the same count on every worker is
    what makes their results the serial run's, bit for bit."""

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise EngineError(f"--workers must be at least 1, not {self.workers}")

    def describe(self) -> dict[str, Any]:
        """What provenance records of the run."""
        out: dict[str, Any] = {"engine": self.engine.value, "workers": self.n_workers()}
        if self.engine is Engine.RAY:
            ray = _ray()
            out |= {"ray_version": ray.__version__, "ray_nodes": len(ray.nodes())}
        return out

    def n_workers(self) -> int:
        """Workers this execution uses (1 for the serial engine)."""
        if self.engine is Engine.SERIAL:
            return 1
        return self.workers or os.cpu_count() or 1


WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Environment of worker processes: OpenMP threads that sleep when idle. Spinning ones of
several workers on the same cores slow every unit a hundredfold."""


@dataclass(frozen=True)
class _Threaded:
    """A work function run with a fixed torch thread count (it pickles with its function)."""

    work: Callable[[Any], Any]
    threads: int
    cwd: str
    """The driver's working folder: relative input paths mean there what they mean to it."""

    def __call__(self, unit: Any) -> Any:
        import torch

        from driftcli.memory import bound_memory

        torch.set_num_threads(self.threads)
        bound_memory()  # a worker's long scan stays near its slices, as the command's does
        if os.path.isdir(self.cwd):  # (a node without that folder has absolute paths only)
            os.chdir(self.cwd)
        return self.work(unit)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise EngineError(f"--engine ray needs Ray: pip install '{RAY_EXTRA}'") from None
    return ray


def start(execution: Execution) -> None:
    """Connect to (or start) the Ray cluster the execution names, once per process; a no-op
    for the other engines."""
    if execution.engine is not Engine.RAY:
        return
    ray = _ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "configure_logging": False}
        if execution.ray_address is None:
            kwargs["num_cpus"] = execution.n_workers()
        _reachable(execution.ray_address)
        said = io.StringIO()
        try:
            # Ray's own notices (token authentication is on, ...) would be the only lines on a
            # drift command's stderr not in its one-line style; a failure still says why
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                ray.init(address=execution.ray_address, **kwargs)
        except ConnectionError as err:
            raise EngineError(f"--ray-address {execution.ray_address}: {err}; start a cluster "
                              "(ray start --head) or leave --ray-address out for a local "
                              "one") from None


def _reachable(address: str | None) -> None:
    """Raise at once for a cluster address nothing listens on: Ray itself retries such an
    address for minutes, printing a line every few seconds."""
    if address is None or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
            pass
    except (OSError, ValueError) as err:
        raise EngineError(f"--ray-address {address}: no Ray cluster answers there ({err}); "
                          "give the head node's host:port, 'auto' for the cluster this "
                          "machine runs, or leave it out for a local one") from None


def stamp(*paths: str | Path | None) -> str:
    """What tells files apart from rewritten ones: each path resolved, with its size and
    modification time (a folder: its files'). Part of every unit's :meth:`key`, so a run
    resumed after its input changed does not take the old results."""
    parts = []
    for given in paths:
        if given is None:
            continue
        path = Path(given).resolve()
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        parts += [f"{p}:{(st := p.stat()).st_size}:{st.st_mtime_ns}" if p.exists()
                  else f"{p}:missing" for p in files]
    return "|".join(parts)


class Manifest:
    """Finished units of one run, one file each, under ``folder``: what ``--resume`` takes
    instead of running them again. A unit is found by its key (see :func:`run`): a text that
    names everything its result depends on, the stamps of its input files included, so a
    unit that changed (other casts, a rewritten file) is not taken for the old one."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: str) -> Path:
        return self.folder / hashlib.sha256(key.encode()).hexdigest()

    def get(self, key: str) -> tuple[bool, Any]:
        """``(True, result)`` for a unit kept here under ``key``, else ``(False, None)``."""
        path = self._path(key)
        if not path.is_file():
            return False, None
        return True, pickle.loads(path.read_bytes())

    def put(self, key: str, result: object) -> None:
        """Keep a finished unit's result (written atomically: an interrupted write is not
        taken for a result)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.folder, delete=False) as fh:
            fh.write(pickle.dumps(result))
        os.replace(fh.name, self._path(key))

    def clear(self) -> None:
        """Forget the run (its table is written)."""
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                path.unlink()
            self.folder.rmdir()


def unit_key(unit: Any) -> str:
    """A unit's key for the manifest: its ``key()`` (every unit type of drift has one)."""
    return str(unit.key())


def run(units: Sequence[U], work: Callable[[U], R], execution: Execution | None = None, *,
        progress: Progress | None = None, label: Callable[[U], str] = str,
        size: Callable[[U], int] | None = None,
        on_result: Callable[[U, R], None] | None = None,
        key: Callable[[U], str] = unit_key) -> list[R]:
    """``[work(u) for u in units]`` on ``execution``'s engine, in the order of ``units``.

    ``progress`` is told, as units finish, the units (or, with ``size``, the sizes) done, in
    all, and the finished unit's ``label``; ``on_result`` sees each unit's result as it comes
    (before ``progress``: a bar can count the failed ones). With ``execution.resume``, each
    unit's ``key`` (taken before any unit runs) names its kept result.
    """
    execution = execution or Execution()
    weight = size or (lambda u: 1)
    total = sum(weight(u) for u in units)
    manifest = Manifest(execution.resume) if execution.resume is not None else None
    keys = [key(u) for u in units] if manifest is not None else []
    results: dict[int, R] = {}
    todo: list[int] = []
    for i in range(len(units)):
        kept, result = manifest.get(keys[i]) if manifest is not None else (False, None)
        if kept:
            results[i] = result
        else:
            todo.append(i)
    done = sum(weight(units[i]) for i in results)

    def finished(i: int, result: R) -> None:
        nonlocal done
        results[i] = result
        if manifest is not None:
            manifest.put(keys[i], result)
        done += weight(units[i])
        if on_result is not None:
            on_result(units[i], result)
        if progress is not None:
            progress(done, total, label(units[i]))

    if execution.engine is Engine.SERIAL:
        for i in todo:
            finished(i, work(units[i]))
        return [results[i] for i in range(len(units))]
    import torch

    threaded = _Threaded(work, execution.threads or torch.get_num_threads(), os.getcwd())
    if execution.engine is Engine.PROCESSES:
        _run_processes(units, todo, threaded, execution, finished)
    else:
        _run_ray(units, todo, threaded, execution, finished)
    return [results[i] for i in range(len(units))]


def _apply(work: Callable[[U], R], unit: U) -> R:
    """``work(unit)``: what a Ray task runs (Ray takes functions, not callable objects)."""
    return work(unit)


def _run_processes(units: Sequence[U], todo: list[int], work: Callable[[U], R],
                   execution: Execution, finished: Callable[[int, R], None]) -> None:
    import multiprocessing
    from concurrent.futures import as_completed

    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)  # what the spawned workers start with
    try:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=execution.n_workers(), mp_context=context) as pool:
            futures = {pool.submit(work, units[i]): i for i in todo}
            try:
                for future in as_completed(futures):
                    finished(futures[future], future.result())
            except BaseException as err:
                # stop at the first failure: the units still queued would run for nothing
                pool.shutdown(wait=False, cancel_futures=True)
                if not isinstance(err, BrokenProcessPool):
                    raise

                kept = ("the finished units are kept: run again with --resume, or "
                        if execution.resume is not None else "run again, or ")
                raise EngineError(f"a worker process died (killed, or out of memory); {kept}"
                                  "use --engine ray, which runs a dead worker's unit "
                                  "again") from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_ray(units: Sequence[U], todo: list[int], work: Callable[[U], R], execution: Execution,
             finished: Callable[[int, R], None]) -> None:
    ray = _ray()
    start(execution)
    # a worker that dies is retried; an exception the work raises is the unit's own answer
    remote = ray.remote(max_retries=RETRIES, retry_exceptions=False,
                        runtime_env={"env_vars": WORKER_ENV})(_apply)
    limit = 2 * execution.n_workers()  # one waiting per worker hides the round trip
    pending: dict[Any, int] = {}
    queue = list(todo)
    while queue or pending:
        while queue and len(pending) < limit:
            i = queue.pop(0)
            pending[remote.remote(work, units[i])] = i
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            i = pending.pop(ref)
            try:
                finished(i, ray.get(ref))
            except ray.exceptions.RayTaskError as err:
                # the unit's own exception (a DriftError is its one line), not Ray's wrapping
                raise (err.cause if isinstance(err.cause, BaseException) else err) from None
            except ray.exceptions.RayError as err:
                kept = "the finished units are kept: run again with --resume" \
                    if execution.resume is not None else "run again"
                raise EngineError(f"a Ray worker died {RETRIES + 1} times under one unit "
                                  f"({type(err).__name__}); {kept}") from None
