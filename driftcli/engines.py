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
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import re
import socket
import stat
import sys
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, TypeVar, cast

from driftcli.choices import Engine
from driftcli.errors import DriftError
from driftcli.progress import Progress

U = TypeVar("U")
R = TypeVar("R")

RAY_PACKAGE = "ray"
"""The package drift's optional extra ``ray`` installs (pyproject.toml): what an error says
to install, whatever way drift itself was installed."""
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
        if self.resume is not None:
            out["resumed_units"] = units_taken(self.resume)
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
        raise EngineError("--engine ray needs Ray (drift's optional extra ray): "
                          f"pip install {RAY_PACKAGE}") from None
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


_STAMPED: dict[str, Path] = {}
"""Each file stamp :func:`stamp` gave in this process → its file: how a manifest finds, in a
unit's key, the inputs whose sha256 it records beside the unit."""
_FAST_HASH: set[Path] = set()
"""Units folders of runs that asked for ``--fast-hash``: their units record their inputs'
size, mtime and ctime instead of a sha256 (reading a huge input twice is what the user
declined)."""


def stamp(*paths: str | Path | None) -> str:
    """What tells files apart from rewritten ones: each path resolved, with its size and
    modification time (a folder: its files'). Part of every unit's :meth:`key`, so a run
    resumed after its input changed does not take the old results; a kept unit also records
    the sha256 of every file its key stamps (:class:`Manifest`), which catches a rewrite that
    kept the size and mtime."""
    parts = []
    for given in paths:
        if given is None:
            continue
        path = Path(given).resolve()
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        for p in files:
            if p.exists():
                st = p.stat()
                part = f"{p}:{st.st_size}:{st.st_mtime_ns}"
                _STAMPED[part] = p
            else:
                part = f"{p}:missing"
            parts.append(part)
    return "|".join(parts)


def _inputs_of(key: str) -> list[Path]:
    """The files whose stamps ``key`` holds (see :func:`stamp`), in key order."""
    return list(dict.fromkeys(p for part in key.split("|") if (p := _STAMPED.get(part))))


UNIT_FORMAT = "drift-unit/1"
"""The first line of every kept unit file names this format."""
MAX_UNIT_BYTES = 256 << 20
"""A kept unit file larger than this is not read (it is taken for damaged and run again): a
scan's unit is a few kB, a verify-formats check's at most a few MB."""


class UnitsError(DriftError):
    """A units folder drift will not use (a symlink: clearing it would delete elsewhere)."""


class UnitNotice(UserWarning):
    """A kept unit that was not taken (damaged, foreign, stale) and runs again; the CLI
    prints it as one ``warning:`` line."""


class _Damaged(ValueError):
    """Why a kept unit file is not taken."""


def _encode(value: Any) -> Any:
    """A result as JSON values, every type named (see :func:`_decode`): JSON runs no code when
    read, as a pickle would."""
    import enum

    if isinstance(value, enum.Enum):  # first: a StrEnum member is a str too
        return {"$e": _type_name(type(value)), "n": value.name}
    if value is None or type(value) in (bool, str, int):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"$f": repr(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"$c": _type_name(type(value)),
                "f": {f.name: _encode(getattr(value, f.name))
                      for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        return {"$t": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"$d": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, Path):
        return {"$p": str(value)}
    import numpy as np

    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return {"$n": value.dtype.str, "v": _encode(value.item())}
    if isinstance(value, str):  # a subclass
        return str(value)
    if isinstance(value, int | float):  # a subclass (an IntEnum is handled above)
        return _encode(int(value) if isinstance(value, int) else float(value))
    raise TypeError(f"a unit's result holds a {type(value).__name__}, which a kept unit "
                    "cannot record")


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _known_type(name: Any) -> type:
    """A drift dataclass or enum by its recorded name: only one of drift's own modules that is
    imported already (the run that asks for its units built them), never an import."""
    import enum

    if not isinstance(name, str) or ":" not in name:
        raise _Damaged(f"a type named {name!r}")
    module_name, qualname = name.split(":", 1)
    module = sys.modules.get(module_name)
    if module is None or not (module_name == "driftcli" or module_name.startswith("driftcli.")):
        raise _Damaged(f"a type {name!r} that is not one of drift's loaded types")
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not (isinstance(found, type) and found.__module__ == module_name
            and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))):
        raise _Damaged(f"a type {name!r} that is not one of drift's result types")
    return found


def _decode(value: Any) -> Any:
    """:func:`_encode` undone. A dataclass is rebuilt field by field, without calling any of
    its methods, and only one of drift's own loaded types is rebuilt (see :func:`_known_type`)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise _Damaged("a value of no known form")
    if "$t" in value and isinstance(value["$t"], list):
        return tuple(_decode(v) for v in value["$t"])
    if "$f" in value and value["$f"] in ("inf", "-inf", "nan"):
        return float(value["$f"])
    if "$d" in value and isinstance(value["$d"], list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in value["$d"]):
            raise _Damaged("a mapping of no known form")
        return {_decode(k): _decode(v) for k, v in value["$d"]}
    if "$p" in value and isinstance(value["$p"], str):
        return Path(value["$p"])
    if "$n" in value and value["$n"] in _NUMPY_SCALARS:
        import numpy as np

        return np.dtype(value["$n"]).type(_decode(value.get("v")))
    if "$e" in value:
        import enum

        cls = _known_type(value["$e"])
        try:
            if not issubclass(cls, enum.Enum):
                raise TypeError(cls)
            return cls[str(value.get("n"))]
        except (KeyError, TypeError):
            raise _Damaged(f"no member {value.get('n')!r} of {value['$e']}") from None
    if "$c" in value and isinstance(value.get("f"), dict):
        cls = _known_type(value["$c"])
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(value["f"]) != fields:
            raise _Damaged(f"fields {sorted(value['f'])} where {value['$c']} has "
                           f"{sorted(fields)}")
        hints = _hints(cls)
        made: Any = object.__new__(cls)
        for name, v in value["f"].items():
            field = _decode(v)
            if name in hints and not _fits(field, hints[name]):
                hint = hints[name]
                raise _Damaged(f"{value['$c']}.{name} is {_shown(field)}, not "
                               f"{getattr(hint, '__name__', hint)}")
            object.__setattr__(made, name, field)
        return made
    raise _Damaged("a value of no known form")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The field types of one of drift's dataclasses; empty where they cannot be resolved
    (a name only imported for type checking): such fields are taken as they come."""
    import typing

    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError, AttributeError):
        return {}


def _fits(value: Any, hint: Any) -> bool:
    """Whether a decoded value is of the declared type ``hint``: the plain types, ``X |
    None``, tuples, lists and dicts of them, drift's dataclasses and enums; a hint of any
    other kind (a tensor, a callable) is not checked."""
    import enum
    import numbers
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin is typing.Union or isinstance(hint, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return not args or (len(args) == len(value)
                            and all(_fits(v, a) for v, a in zip(value, args, strict=True)))
    if origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict) and (not args or all(
            _fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items()))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint in (str, Path) or (isinstance(hint, type) and (
            dataclasses.is_dataclass(hint) or issubclass(hint, enum.Enum))):
        return isinstance(value, hint)
    return True


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


_NUMPY_SCALARS = {f"{e}{k}{n}" for e in "<>|" for k, n in
                  (("b", 1), ("i", 1), ("i", 2), ("i", 4), ("i", 8), ("u", 1), ("u", 2),
                   ("u", 4), ("u", 8), ("f", 2), ("f", 4), ("f", 8))}


def _fingerprint(path: Path, fast: bool, wait: bool = True) -> str | None:
    """What a kept unit records of an input file: its sha256 (or, for a ``--fast-hash`` run,
    its size, mtime and ctime); None without ``wait`` while another thread is hashing it."""
    from driftcli.io.tables import sha256_of

    if fast:
        st = path.stat()
        return f"size {st.st_size} mtime {st.st_mtime_ns} ctime {st.st_ctime_ns}"
    return sha256_of(path, wait=wait)


_TAKEN: dict[Path, int] = {}
"""Units each units folder gave back to a run (``--resume``) in this process, for the
table's provenance (:meth:`Execution.describe`)."""


def units_taken(folder: Path | None) -> int:
    """How many kept units runs of this process took from ``folder`` since it was last
    cleared (see :func:`reset_taken`)."""
    return 0 if folder is None else _TAKEN.get(Path(os.path.abspath(folder)), 0)


def reset_taken(folder: Path) -> None:
    """Start counting the units taken from ``folder`` anew (a command's run starts)."""
    _TAKEN.pop(Path(os.path.abspath(folder)), None)


def fast_hash_units(folder: Path, fast: bool = True) -> None:
    """Have the units kept in ``folder`` record their inputs by size, mtime and ctime instead
    of sha256 (a ``--fast-hash`` run)."""
    (_FAST_HASH.add if fast else _FAST_HASH.discard)(Path(os.path.abspath(folder)))


_UNIT_NAME = re.compile(r"[0-9a-f]{64}")


class Manifest:
    """Finished units of one run, one file each, under ``folder``: what ``--resume`` takes
    instead of running them again. A unit is found by its key (see :func:`run`): a text that
    names everything its result depends on, the stamps of its input files included, so a
    unit that changed (other casts, a rewritten file) is not taken for the old one.

    A unit file is JSON, never a pickle (reading it runs no code): a first line naming
    :data:`UNIT_FORMAT` and the sha256 of the rest, then the key, the sha256 of every input
    file the key stamps, and the result with every type named (only drift's own result types
    are rebuilt). A unit whose checksum, key, inputs or types do not hold, a file that is not a
    regular file (a link, a folder, a FIFO), one that is empty, truncated or garbage, is not
    taken: the unit runs again, and one :class:`UnitNotice` per manifest says so. Nothing is
    ever followed through a symlink: a symlinked units folder is refused, naming it
    (:class:`UnitsError`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._abs = Path(os.path.abspath(folder))
        self._noticed = False
        self._unkept = False
        self._pending: list[tuple[str, object]] = []
        _refuse_link(folder)

    def _path(self, key: str) -> Path:
        # a key holds file names as given: a non-UTF-8 byte is a lone surrogate in them
        return self.folder / hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()

    def _notice(self, message: str) -> None:
        if not self._noticed:
            self._noticed = True
            warnings.warn(message, UnitNotice, stacklevel=3)

    def get(self, key: str,
            check: Callable[[Any], str | None] | None = None) -> tuple[bool, Any]:
        """``(True, result)`` for a unit kept here under ``key``, else ``(False, None)``; a
        kept unit that does not hold (see the class) is ``(False, None)`` with a notice. A
        kept file is data anyone could have written: its values are of the types their
        fields declare (see :func:`_decode`), and ``check`` (the unit's ``check_kept``) says
        why they cannot be the unit's (a count past the tensor's elements, a rate above 1),
        or None when they can; one that cannot runs again, with the notice."""
        self._keep_pending()
        path = self._path(key)
        if not os.path.lexists(path) or not os.path.isdir(self.folder):
            return False, None
        try:
            result = self._read(path, key)
            try:
                why_not = check(result) if check is not None else None
            except (TypeError, ValueError, AttributeError, ArithmeticError) as err:
                why_not = f"{type(err).__name__}: {err}"  # a value of a shape none expected
            if why_not is not None:
                raise _Damaged(f"its result cannot be the unit's: {why_not}")
        except _Damaged as why:
            self._notice(f"kept unit {path} is not taken ({why}); it and any other such unit "
                         "run again")
            return False, None
        _TAKEN[self._abs] = _TAKEN.get(self._abs, 0) + 1
        return True, result

    def _read(self, path: Path, key: str) -> Any:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except OSError as err:
            raise _Damaged("a symlink" if os.path.islink(path) else
                           err.strerror or str(err)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise _Damaged("not a regular file")
        with os.fdopen(fd, "rb") as fh:
            if st.st_size > MAX_UNIT_BYTES:
                raise _Damaged(f"{st.st_size:,} bytes, over the {MAX_UNIT_BYTES:,} a unit "
                               "may have")
            try:
                data = fh.read(MAX_UNIT_BYTES + 1)
            except OSError as err:
                raise _Damaged(err.strerror or str(err)) from None
        head, newline, body = data.partition(b"\n")
        try:
            header = json.loads(head)
        except ValueError:
            header = None
        if not newline or not isinstance(header, dict) or header.get("format") != UNIT_FORMAT:
            raise _Damaged("empty" if not data else f"not a {UNIT_FORMAT} file")
        if header.get("sha256") != hashlib.sha256(body).hexdigest():
            raise _Damaged("its checksum does not match its content: truncated or edited")
        try:
            unit = json.loads(body)
        except (ValueError, RecursionError):
            raise _Damaged("its content is not JSON") from None
        if not isinstance(unit, dict) or unit.get("key") != key:
            raise _Damaged("it was kept for another unit")
        inputs = unit.get("inputs")
        if not isinstance(inputs, list):
            raise _Damaged("no inputs recorded")
        fast = self._abs in _FAST_HASH
        for item in inputs:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise _Damaged("its inputs are of no known form")
            try:
                now = _fingerprint(Path(item[0]), fast)
            except OSError:
                now = None
            if now != item[1]:
                raise _Damaged(f"its input {item[0]} changed since (another sha256)")
        try:
            return _decode(unit.get("result"))
        except RecursionError:
            raise _Damaged("its result is nested too deep") from None

    def put(self, key: str, result: object) -> None:
        """Keep a finished unit's result (written atomically: an interrupted write is not
        taken for a result). A unit whose input provenance is still hashing on another thread
        is kept with the next unit after the hash is done (the scan does not wait for it). A
        unit that cannot be kept (a full disk, a folder in the way) only costs a rerun if the
        run is resumed: one notice, and the run goes on."""
        self._pending.append((key, result))
        self._keep_pending()

    def flush(self) -> None:
        """Keep the units still waiting for their inputs' sha256, waiting for it."""
        self._keep_pending(wait=True)

    def __del__(self) -> None:
        # what can be kept without waiting is kept (a scan that ends, or is interrupted,
        # while provenance still hashes its input); never an error on the way out
        with contextlib.suppress(Exception):
            self._keep_pending()

    def _keep_pending(self, wait: bool = False) -> None:
        waiting = []
        for key, result in self._pending:
            if not self._keep(key, result, wait):
                waiting.append((key, result))
        self._pending = waiting

    def _keep(self, key: str, result: object, wait: bool = False) -> bool:
        """Write one unit; False while an input's sha256 is being worked out elsewhere."""
        from driftcli.io.tables import atomic_write

        fast = self._abs in _FAST_HASH
        try:
            inputs = [[str(p), _fingerprint(p, fast, wait)] for p in _inputs_of(key)]
        except OSError:
            return True  # an input gone meanwhile: a unit that could never be checked again
        if any(digest is None for _, digest in inputs):
            return False
        body = json.dumps({"key": key, "inputs": inputs, "result": _encode(result)},
                          separators=(",", ":"), allow_nan=False).encode()
        header = json.dumps({"format": UNIT_FORMAT,
                             "sha256": hashlib.sha256(body).hexdigest()}).encode()
        try:
            _refuse_link(self.folder)
            if os.path.lexists(self.folder) and not os.path.isdir(self.folder):
                os.unlink(self.folder)  # a file where the units go (not a link: refused)
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(self._path(key), partial(_write_all, header + b"\n" + body),
                         durable=False)
        except (OSError, DriftError, TypeError) as err:
            if isinstance(err, UnitsError):
                raise
            if not self._unkept:
                self._unkept = True
                warnings.warn(f"finished units cannot be kept in {self.folder} ({err}); the "
                              "run goes on, but --resume would run them again", UnitNotice,
                              stacklevel=4)
        return True

    def clear(self) -> None:
        """Forget the run (its table is written): remove the unit files, never following a
        link; anything else found in the folder (a subfolder) is left, and the folder too."""
        clear_units(self.folder)


def _write_all(data: bytes, fh: IO[bytes]) -> None:
    fh.write(data)


def _refuse_link(folder: Path) -> None:
    if os.path.islink(folder):
        raise UnitsError(f"the units folder {folder} is a symlink; drift never follows a link "
                         "in an output folder (clearing it would remove files elsewhere): "
                         "remove the link")


def clear_units(folder: Path) -> None:
    """Remove the kept units in ``folder`` (see :meth:`Manifest.clear`). A regular file where
    the folder should be is removed; a symlink is refused (:class:`UnitsError`)."""
    _refuse_link(folder)
    if not os.path.lexists(folder):
        return
    if not os.path.isdir(folder):
        os.unlink(folder)
        return
    with os.scandir(folder) as entries:
        for entry in entries:
            unit = _UNIT_NAME.fullmatch(entry.name) or (
                entry.name.startswith(".") and entry.name.endswith(".tmp"))
            if unit and not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)  # a link itself, never what it points to
    with contextlib.suppress(OSError):
        os.rmdir(folder)  # only when empty: whatever else is there stays


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
        kept, result = (manifest.get(keys[i], getattr(units[i], "check_kept", None))
                        if manifest is not None else (False, None))
        if kept:
            results[i] = cast(R, result)
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
    else:
        import torch

        threaded = _Threaded(work, execution.threads or torch.get_num_threads(), os.getcwd())
        if execution.engine is Engine.PROCESSES:
            _run_processes(units, todo, threaded, execution, finished)
        else:
            _run_ray(units, todo, threaded, execution, finished)
    if manifest is not None:
        manifest.flush()
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
        with ProcessPoolExecutor(max_workers=execution.n_workers(), mp_context=context,
                                 initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
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


PR_SET_PDEATHSIG = 1
"""``prctl``'s option (``<linux/prctl.h>``): the signal a process gets when its parent dies."""
PARENT_POLL_S = 0.5
"""Seconds between a worker's checks that the drift process that started it still lives
(where the system cannot tell it at once)."""


def die_with_parent(parent: int) -> None:
    """A worker's first act (the process pool's initializer): end with the drift process that
    started it, however that ends. A parent killed with SIGKILL runs no cleanup, and its idle
    workers (hundreds of MB each) would wait for work forever; once they are gone, the
    resource tracker sees its last reader close and ends too. On Linux the kernel sends the
    worker SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``); everywhere, a daemon
    thread polls ``os.getppid()`` every :data:`PARENT_POLL_S` seconds and ends the worker
    when it changes (the worker is handed to another process when its parent dies)."""
    import signal
    import threading

    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0,
                                                     0)
    if os.getppid() != parent:  # it died before the prctl was made
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), name="drift-parent",
                     daemon=True).start()


def _watch_parent(parent: int) -> None:
    import time

    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


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
