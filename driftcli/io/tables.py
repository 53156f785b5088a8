"""Parquet tables: typed rows, documented columns, provenance, atomic writes.

Each measurement declares one row type: a frozen dataclass whose fields are the
columns (their ``doc`` metadata goes into the Arrow schema), plus what a report
needs to know (table name, key columns, headline column, direction). Files are
written under a temporary name and renamed, so an interrupted run never leaves
a truncated table, and every file carries provenance in its Parquet key-value
metadata under the key ``drift``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import errno
import hashlib
import json
import os
import platform
import stat as stat_mod
import subprocess
import sys
import tempfile
import threading
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from driftcli.errors import DriftError
from driftcli.io.outputs import OutputError

PROVENANCE_KEY = b"drift"
TABLE_KEY = b"drift.table"


class Row(Protocol):
    """What every row type declares next to its fields."""

    TABLE: ClassVar[str]
    """File stem and measurement name, e.g. ``verify-formats``."""
    KEYS: ClassVar[tuple[str, ...]]
    """Columns that identify a row across runs (for baselines)."""
    HEADLINE: ClassVar[str]
    """The column a report summarizes first."""
    HIGHER_IS_WORSE: ClassVar[bool]
    """Direction of the headline."""
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    """A row type is a dataclass; it is called with its columns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...


def column(doc: str, **kwargs: Any) -> Any:
    """A dataclass field carrying its column documentation."""
    return dataclasses.field(metadata={"doc": doc}, **kwargs)


_ARROW = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}


def _arrow_type(hint: Any) -> tuple[pa.DataType, bool]:
    """Arrow type of a field annotation and whether it is nullable (``X | None``)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return _ARROW[inner[0]], True
    return _ARROW[hint], False


def schema_of(row_type: type[Row]) -> pa.Schema:
    """The Arrow schema of a row type, field docs and table facts in the metadata."""
    hints = typing.get_type_hints(row_type)
    fields = []
    for f in dataclasses.fields(row_type):
        arrow, nullable = _arrow_type(hints[f.name])
        fields.append(pa.field(f.name, arrow, nullable=nullable,
                               metadata={"doc": f.metadata.get("doc", "")}))
    meta = {
        TABLE_KEY: row_type.TABLE.encode(),
        b"drift.keys": json.dumps(list(row_type.KEYS)).encode(),
        b"drift.headline": row_type.HEADLINE.encode(),
        b"drift.higher_is_worse": json.dumps(row_type.HIGHER_IS_WORSE).encode(),
    }
    return pa.schema(fields, metadata=meta)


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


_DIGESTS: dict[tuple[Any, ...], str] = {}
_DIGESTING: dict[tuple[Any, ...], threading.Lock] = {}
_DIGESTS_LOCK = threading.Lock()


HASH_CHUNK = 1 << 20
"""Bytes hashed per read: between two reads, a stop asked for (Ctrl-C) is seen."""


class HashStopped(Exception):
    """Hashing stopped part way because it was asked to (see :func:`sha256_of`)."""


@typing.overload
def sha256_of(path: Path) -> str: ...
@typing.overload
def sha256_of(path: Path, *, wait: bool, stop: threading.Event | None = None) -> str | None: ...


def sha256_of(path: Path, *, wait: bool = True,
              stop: threading.Event | None = None) -> str | None:
    """The sha256 of a file's bytes (streamed), worked out once per process and file version:
    provenance and the kept units of ``--resume`` (see :mod:`driftcli.engines`) ask for the
    same inputs' digests, often at the same time from two threads, and the second waits for
    the first instead of reading the file again (or, with ``wait=False``, gets None while
    another thread is at it). A version is the file's device, inode, size, mtime and ctime
    (a rewrite that restores size and mtime still changes ctime).

    Exactly the ``st_size`` bytes the opened file's stat gives are read, never more: a file
    that streams past its size (``/proc/self/pagemap``: size 0, about 256 GB of reads) is
    hashed as its stat describes it, and a file that is not a regular one when opened (a FIFO
    put in its place) is an ``OSError``, never a read that blocks. With ``stop`` set, the
    hashing raises :class:`HashStopped` at its next read (Ctrl-C on the thread waiting)."""
    st = path.stat()
    version = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
               st.st_ctime_ns)
    with _DIGESTS_LOCK:
        if version in _DIGESTS:
            return _DIGESTS[version]
        busy = _DIGESTING.setdefault(version, threading.Lock())
    if not busy.acquire(blocking=wait):
        return None
    try:
        if version not in _DIGESTS:  # (another thread may have finished it meanwhile)
            digest = _hash_regular(path, stop)
            with _DIGESTS_LOCK:
                _DIGESTS[version] = digest
        return _DIGESTS[version]
    finally:
        busy.release()


def _hash_regular(path: Path, stop: threading.Event | None) -> str:
    """The sha256 of the ``st_size`` bytes of the regular file at ``path`` (see
    :func:`sha256_of`)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    digest = hashlib.sha256()
    with os.fdopen(os.open(path, flags), "rb", buffering=0) as fh:
        st = os.fstat(fh.fileno())
        if not stat_mod.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file when opened for hashing", str(path))
        left = st.st_size
        while left > 0:
            if stop is not None and stop.is_set():
                raise HashStopped(str(path))
            chunk = fh.read(min(HASH_CHUNK, left))
            if not chunk:  # shortened since its stat: what is there
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def file_identity(path: Path, fast_hash: bool = False,
                  stop: threading.Event | None = None) -> dict[str, Any]:
    """Path, size and sha256 (streamed, ``st_size`` bytes: :func:`sha256_of`) of an input, or
    size + mtime with ``fast_hash``."""
    stat = path.stat()
    ident: dict[str, Any] = {"path": str(path), "size": stat.st_size}
    # a folder, or a FIFO or device (reading one can block or never end): its stat only
    if fast_hash or not stat_mod.S_ISREG(stat.st_mode):
        ident["mtime"] = dt.datetime.fromtimestamp(stat.st_mtime, dt.UTC).isoformat()
        return ident
    ident["sha256"] = sha256_of(path, wait=True, stop=stop)
    return ident


def identify_in_background(paths: Sequence[Path],
                           fast_hash: bool = False) -> Callable[[], list[dict[str, Any]]]:
    """Start :func:`file_identity` of every path on a thread of its own and go on: sha256
    reads and hashes with the GIL released, so it runs beside a scan (and beside its
    compilation, which keeps one core busy). The function returned waits for the thread
    and gives the identities in order, or raises the ``OSError`` it met. The thread is a
    daemon, so a command that fails meanwhile does not wait for it; an interrupt (Ctrl-C)
    while waiting stops the hashing at its next read."""
    box: dict[str, Any] = {}
    stop = threading.Event()

    def work() -> None:
        try:
            box["ids"] = [file_identity(Path(p), fast_hash, stop) for p in paths]
        except OSError as exc:  # raised where the caller asks for the result
            box["error"] = exc
        except HashStopped:
            pass

    thread = threading.Thread(target=work, name="drift-identify", daemon=True)
    thread.start()

    def result() -> list[dict[str, Any]]:
        try:
            thread.join()
        except BaseException:
            stop.set()
            raise
        if "error" in box:
            raise box["error"]
        if "ids" not in box:
            raise DriftError("hashing the inputs for provenance failed; the error is "
                             "printed above")
        return box["ids"]

    return result


def provenance(inputs: Sequence[Path] = (), *, seed: int | None = None, device: str = "cpu",
               fast_hash: bool = False, extra: dict[str, Any] | None = None,
               identities: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Where a table came from: drift version and commit, command, inputs, torch, seed, time.
    ``identities`` are the inputs' :func:`file_identity`, where they are worked out already
    (see :func:`identify_in_background`)."""
    import torch

    from driftcli import __version__

    return {
        "drift_version": __version__,
        "git_commit": _git_commit(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "inputs": list(identities) if identities is not None else
        [file_identity(Path(p), fast_hash) for p in inputs],
        "hash": "size+mtime" if fast_hash else "sha256",
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.platform(),
        "device": device,
        "seed": seed,
        "utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **(extra or {}),
    }


_NUMPY = {pa.int64(): np.int64, pa.float64(): np.float64}
# numpy kinds each column accepts: a float in an int column is a bug, not a truncation,
_KINDS = {pa.int64(): "ib", pa.float64(): "iubf"}  # "u": numpy's type for ints >= 2**63


def _utf8(text: str) -> bytes:
    """A string column's value as UTF-8 (what Arrow requires). A file name's non-UTF-8 byte,
    which Python holds as a lone surrogate, is written as ``\\xNN``, as the terminal shows it
    (``driftcli.escaping``): the row is kept, its name readable."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no file name decodes to
            return text.encode("utf-8", "backslashreplace")
        return raw.decode("utf-8", "backslashreplace").encode()


def _arrow_column(values: list[Any], field: pa.Field) -> pa.Array:
    """One column as an Arrow array, built from its buffers.

    ``pa.array`` and ``pa.table`` ask pandas whether each input is one of its objects, and
    importing pandas costs a third of a second: more than a small command's whole scan.
    A drift column holds ``str``, ``int``, ``float`` or ``bool`` values, or ``None`` where
    the field is nullable, which a validity bitmap and one or two numpy buffers describe."""
    valid = np.fromiter((v is not None for v in values), dtype=np.bool_, count=len(values))
    if not field.nullable and not valid.all():
        raise DriftError(f"column {field.name!r} has a missing value but is not nullable")
    bitmap = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    if field.type == pa.string():
        if any(not isinstance(v, str) for v in values if v is not None):
            raise pa.ArrowTypeError(f"column {field.name!r} of type string got a non-string")
        data = [_utf8(v) if v is not None else b"" for v in values]
        offsets = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in data], out=offsets[1:])
        if offsets[-1] >= 2**31:
            raise DriftError(f"column {field.name!r} holds over 2 GiB of text")
        buffers = [bitmap, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data))]
    elif field.type == pa.bool_():
        if any(not isinstance(v, bool | np.bool_) for v in values if v is not None):
            raise pa.ArrowTypeError(f"column {field.name!r} of type bool got a non-bool")
        bits = np.fromiter((bool(v) for v in values), dtype=np.bool_, count=len(values))
        buffers = [bitmap, pa.py_buffer(np.packbits(bits, bitorder="little"))]
    else:
        numbers = np.array([0 if v is None else v for v in values])
        if len(values) and numbers.dtype.kind not in _KINDS[field.type]:
            raise pa.ArrowTypeError(f"column {field.name!r} of type {field.type} got "
                                    f"{numbers.dtype} values")
        buffers = [bitmap, pa.py_buffer(numbers.astype(_NUMPY[field.type]))]
    array = pa.Array.from_buffers(field.type, len(values), buffers)
    array.validate(full=True)
    return array


class WriteError(OutputError):
    """An output that could not be written (a full disk, a file size limit, a read-only
    folder): the message names the file, and the earlier file of that name is intact."""


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a folder's entries are its own data)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform without folder handles: the rename is all there is
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself is atomic
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask (read without changing it where the system allows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], *,
                 durable: bool = True) -> Path:
    """Write a file as a whole or not at all: ``write`` fills a new temporary file in the same
    folder (created exclusively, so a planted symlink of that name is never followed), which
    is flushed to disk and renamed over ``path``; the folder's entry is flushed too. On any
    failure the temporary file is removed and :class:`WriteError` names ``path``: whatever
    was at ``path`` before is still there, whole. A symlink at ``path`` is replaced, never
    written through. ``durable=False`` leaves out the two flushes (a kept unit: thousands of
    small files, each checked by its checksum when read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = os.path.lexists(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise WriteError(f"cannot write {path}: {err.strerror or err}; choose a folder you "
                         "can write to") from None
    try:
        # a temporary file is private (0600); the file it becomes has the mode a plain
        # open() would have given it
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~_umask())
            write(fh)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        kept = "the earlier file is kept as it was" if earlier else "nothing was written"
        why = err.strerror or str(err)
        if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            why += " (the disk or the file size limit is full)"
        raise WriteError(f"cannot write {path}: {why}; {kept}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_folder(path.parent)
    return path


def write_text(path: Path, text: str) -> Path:
    """:func:`atomic_write` of a UTF-8 text (a report)."""
    data = text.encode("utf-8")

    def write(fh: IO[bytes]) -> None:
        fh.write(data)

    return atomic_write(path, write)


def write_table(path: Path, row_type: type[Row], rows: Iterable[Any], prov: dict[str, Any]) -> Path:
    """Write ``rows`` (instances of ``row_type``) to ``path`` atomically and durably (see
    :func:`atomic_write`); return the path."""
    schema = schema_of(row_type)
    names = [f.name for f in dataclasses.fields(row_type)]
    rows = list(rows)
    arrays = [_arrow_column([getattr(r, n) for r in rows], schema.field(n)) for n in names]
    table = pa.Table.from_arrays(arrays, schema=schema)
    table = table.replace_schema_metadata(
        {**schema.metadata, PROVENANCE_KEY: json.dumps(prov).encode()})
    return atomic_write(path, lambda fh: pq.write_table(table, fh))


class TableBusyError(OutputError):
    """A table another drift process is writing at the same time."""


def lock_path(table: Path) -> Path:
    """The lock file of a table: beside it, hidden."""
    return table.with_name(f".{table.name}.lock")


@contextlib.contextmanager
def table_lock(table: Path, *, option: str = "--out") -> Iterator[None]:
    """Hold the table's lock for the ``with`` block: a second drift run that would write the
    same table (and its kept units) refuses at once with one line naming the table, rather
    than both racing to one file. The lock is an advisory ``flock`` on a hidden file beside
    the table, opened without following a symlink; it is released when the process ends,
    however it ends, and the file is removed on the way out."""
    import fcntl

    lock = lock_path(table)
    made = []  # folders made for the lock: removed again if the run leaves them empty
    folder = table.parent.absolute()
    while not os.path.lexists(folder) and folder != folder.parent:
        made.append(folder)
        folder = folder.parent
    table.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        try:
            fd = os.open(lock, flags, 0o644)
        except OSError as err:
            what = "a symlink" if os.path.islink(lock) else err.strerror or str(err)
            raise OutputError(f"{option}: the lock file {lock} is {what}; drift never follows "
                              "a link in an output folder: remove it") from None
        try:
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                raise OutputError(f"{option}: the lock file {lock} is not a regular file; "
                                  "remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise TableBusyError(
                    f"{table} is being written by another drift run (pid {owner}); wait for "
                    f"it to finish, or give this run another {option}") from None
            # the file may have been removed by the run that held it just before we locked:
            # then another run can create and lock a new one, so lock that one instead
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(lock))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        break
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # while still held: a waiter then sees the file gone, and retries
        os.close(fd)
        for folder in made:  # innermost first; one holding anything stays
            with contextlib.suppress(OSError):
                folder.rmdir()


CAST_NAME = "cast_name"
"""The column of the name a cast was given by (a preset), added after tables were written
without it: :func:`read_rows` fills it."""


def read_rows(path: Path, row_type: type[Row]) -> tuple[list[Any], dict[str, Any]]:
    """A drift table of ``row_type`` as its rows (instances of ``row_type``) and provenance:
    what ``--append`` merges into. A table of another measurement, or of another drift
    version's columns, is a :class:`~driftcli.errors.DriftError` naming it; one written
    before the ``cast_name`` column gets it (:data:`CAST_NAME`)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DriftError(f"cannot read {path}: {exc}; is it a Parquet file?") from None
    meta = table.schema.metadata or {}
    names = [f.name for f in dataclasses.fields(row_type)]
    # a table written before the cast_name column: each row gets its spec's name from the
    # provenance, as a report fills it
    before_names = CAST_NAME in names and table.column_names == [n for n in names
                                                                 if n != CAST_NAME]
    if meta.get(TABLE_KEY) != row_type.TABLE.encode() or (table.column_names != names
                                                          and not before_names):
        raise DriftError(f"{path} is not a {row_type.TABLE} table of this drift version's "
                         "columns, so rows cannot be appended to it; give --overwrite to "
                         "replace it, or another --out")
    try:
        prov = json.loads(meta.get(PROVENANCE_KEY, b"{}"))
    except (ValueError, RecursionError):
        prov = None
    if not isinstance(prov, dict):
        raise DriftError(f"{path}: its provenance is not a JSON object, so rows cannot be "
                         "appended to it; give --overwrite to replace it, or another --out")
    names_of = prov.get("names")
    given = names_of.get("cast") if isinstance(names_of, dict) else None
    given = given if isinstance(given, dict) else {}
    try:
        records = table.to_pylist()
        if before_names:
            for record in records:
                record[CAST_NAME] = str(given.get(record.get("cast"), record.get("cast")))
        rows = [row_type(**record) for record in records]
    except (TypeError, ValueError, AttributeError) as exc:
        raise DriftError(f"{path}: its rows do not read back as {row_type.TABLE} rows "
                         f"({exc}); give --overwrite to replace it") from None
    return rows, prov


def merge_rows(old: Sequence[Any], new: Sequence[Any], keys: Sequence[str]) -> list[Any]:
    """``old`` rows whose ``keys`` no row of ``new`` has, in their order, then ``new``: a
    row measured again replaces the earlier one."""
    ident = [tuple(getattr(r, k) for k in keys) for r in new]
    seen = set(ident)
    return [r for r in old if tuple(getattr(r, k) for k in keys) not in seen] + list(new)


def read_table(path: Path) -> tuple[Any, dict[str, Any]]:
    """A drift table as ``(pandas.DataFrame, provenance)``."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DriftError(f"cannot read {path}: {exc}; is it a Parquet file?") from None
    meta = table.schema.metadata or {}
    if TABLE_KEY not in meta:
        raise DriftError(f"{path} is a Parquet file but not a drift table (no drift metadata)")
    return table.to_pandas(), json.loads(meta.get(PROVENANCE_KEY, b"{}"))
