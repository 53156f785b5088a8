"""Parquet tables: typed rows, documented columns, provenance, atomic writes.

Each measurement declares one row type: a frozen dataclass whose fields are the
columns (their ``doc`` metadata goes into the Arrow schema), plus what a report
needs to know (table name, key columns, headline column, direction). Files are
written under a temporary name and renamed, so an interrupted run never leaves
a truncated table, and every file carries provenance in its Parquet key-value
metadata under the key ``drift``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from driftcli.errors import DriftError

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


def schema_of(row_type: type) -> pa.Schema:
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


def file_identity(path: Path, fast_hash: bool = False) -> dict[str, Any]:
    """Path, size and sha256 (streamed) of an input, or size + mtime with ``fast_hash``."""
    stat = path.stat()
    ident: dict[str, Any] = {"path": str(path), "size": stat.st_size}
    if fast_hash or path.is_dir():
        ident["mtime"] = dt.datetime.fromtimestamp(stat.st_mtime, dt.UTC).isoformat()
        return ident
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    ident["sha256"] = digest.hexdigest()
    return ident


def identify_in_background(paths: Sequence[Path],
                           fast_hash: bool = False) -> Callable[[], list[dict[str, Any]]]:
    """Start :func:`file_identity` of every path on a thread of its own and go on: sha256
    reads and hashes with the GIL released, so it runs beside a scan (and beside its
    compilation, which keeps one core busy). The function returned waits for the thread
    and gives the identities in order, or raises the ``OSError`` it met. The thread is a
    daemon, so a command that fails meanwhile does not wait for it."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["ids"] = [file_identity(Path(p), fast_hash) for p in paths]
        except OSError as exc:  # raised where the caller asks for the result
            box["error"] = exc

    thread = threading.Thread(target=work, name="drift-identify", daemon=True)
    thread.start()

    def result() -> list[dict[str, Any]]:
        thread.join()
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
        data = [v.encode() if v is not None else b"" for v in values]
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


def write_table(path: Path, row_type: type, rows: Iterable[Any], prov: dict[str, Any]) -> Path:
    """Write ``rows`` (instances of ``row_type``) to ``path`` atomically; return the path."""
    schema = schema_of(row_type)
    names = [f.name for f in dataclasses.fields(row_type)]
    rows = list(rows)
    arrays = [_arrow_column([getattr(r, n) for r in rows], schema.field(n)) for n in names]
    table = pa.Table.from_arrays(arrays, schema=schema)
    table = table.replace_schema_metadata(
        {**schema.metadata, PROVENANCE_KEY: json.dumps(prov).encode()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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
