"""Reading drift tables for a report: finding them, checking each against its row type, and
checking the inputs it recorded against the files now at their paths.

A table knows its own name, key columns, headline and direction from its schema metadata
(``driftcli.io.tables.schema_of`` writes them), so a report can summarize a table from a
drift it has never heard of. Where this drift has the table's row type, the file's columns
must be the row type's columns: a table from an older or newer drift with other columns is
refused with a message saying so, rather than summarized wrongly.

A table whose input has changed since (a dump overwritten by a later run) is *stale*:
:func:`check_inputs` compares each recorded input's size, then its mtime (tables written
with ``--fast-hash``) or its sha256. Hashing reads the whole file, so it is skipped where
the file's mtime and ctime are both older than the table: the file has not been written or
replaced since it was hashed (ctime cannot be set back by a copy that keeps the mtime).
What is now not a regular file at a recorded path (a FIFO, a device such as /dev/zero, a
socket, a folder) is only stat'ed, never opened: it is not the file the table measured.

The rows a report reads, and the bytes they decode to, are bounded
(:mod:`driftcli.report.budget`), before the values are decoded.

Nothing read from a table's metadata can crash a report: provenance that is not JSON (or
nested past the parser's stack) is shown as unreadable in one line, and columns of a table
this drift has no row type for that are nested (structs, maps, lists) are left out, named in
one line; such a table whose key or headline is nested is skipped, with the reason.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import json
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from driftcli.errors import DriftError
from driftcli.io.tables import (
    PROVENANCE_KEY,
    TABLE_KEY,
    Row,
    file_identity,
    schema_of,
)
from driftcli.report.budget import BudgetError as BudgetError
from driftcli.report.budget import TooManyRowsError as TooManyRowsError  # where tests find it
from driftcli.report.budget import byte_budget, read_columns, row_budget, too_many

ALL_ROWS = "*"
"""The key value of a row that aggregates the others (``driftcli.measures.common.ALL_TENSORS``
for tensors, the same star for parameters)."""

ROW_TYPES: dict[str, str] = {
    "accum-error": "driftcli.measures.accum_error:AccumErrorRow",
    "advise": "driftcli.measures.advise:AdviseRow",
    "attention": "driftcli.measures.probe_attention:AttentionRow",
    "block-scales": "driftcli.measures.block_stats:BlockScaleRow",
    "block-stats": "driftcli.measures.block_stats:BlockStatsRow",
    "calibrate": "driftcli.measures.calibrate:CalibrateRow",
    "cast-diff": "driftcli.measures.cast_diff:CastDiffRow",
    "clip-rate": "driftcli.measures.clip_rate:ClipRateRow",
    "error-bias": "driftcli.measures.error_bias:ErrorBiasRow",
    "grad-cosine": "driftcli.measures.grad_cosine:GradCosineRow",
    "health": "driftcli.runs.health:HealthRow",
    "inspect": "driftcli.measures.inspect:InspectRow",
    "monitor-block-stats": "driftcli.live.tables:MonitorBlockStatsRow",
    "monitor-clip-rate": "driftcli.live.tables:MonitorClipRateRow",
    "monitor-error-bias": "driftcli.live.tables:MonitorErrorBiasRow",
    "monitor-stats": "driftcli.live.tables:MonitorStatsRow",
    "monitor-underflow-rate": "driftcli.live.tables:MonitorUnderflowRateRow",
    "probe": "driftcli.runs.probe:ProbeRow",
    "te-dumps": "driftcli.measures.te_dumps:TeDumpRow",
    "train": "driftcli.runs.training:TrainRow",
    "underflow-rate": "driftcli.measures.underflow_rate:UnderflowRateRow",
    "verify-formats": "driftcli.verify.compare:VerifyRow",
}
"""Every table drift writes, and where its row type is (``module:class``), imported when a
report first needs it. A new table is one entry here; ``tests/test_report.py`` checks that
every row type of the package is listed, under its own ``TABLE``."""

JUDGING = ("clip-rate", "underflow-rate", "error-bias", "grad-cosine", "cast-diff",
           "block-stats", "accum-error", "attention", "health", "probe", "calibrate",
           "advise")
"""Tables that judge a cast, policy or run, in the order a report shows them: what a cast
loses (clipped, flushed to zero, its error and bias), then what training sees of it."""
BOOKKEEPING = ("train", "inspect", "verify-formats", "block-scales")
"""Tables a report shows last: logs and counts that explain, but do not judge, a cast
(block-scales' "blocks, higher is better" says nothing by itself). Tables of neither list
(another drift's) come between the two."""


def concern(name: str) -> int:
    """Where a table named ``name`` comes in a report (see :data:`JUDGING`)."""
    if name in JUDGING:
        return JUDGING.index(name)
    if name in BOOKKEEPING:
        return len(JUDGING) + 1 + BOOKKEEPING.index(name)
    return len(JUDGING)


CAST, CAST_NAME = "cast", "cast_name"
"""A cast's canonical spec, and the name it was given by (a preset), the columns of every
table that measures casts. A table without ``cast_name`` (written before it, or by a
measurement that keeps the names in its provenance) gets it on reading: the provenance's
name for each spec, else the spec."""
NAME_DOC = ("The cast as it was given (a preset such as nvfp4); the canonical spec where it "
            "was given as one, or as a Cast")


class SchemaError(DriftError):
    """A drift table whose columns or metadata are not the ones its row type declares."""


@dataclass(frozen=True)
class Table:
    """One drift table read from a file, with the facts its schema declares."""

    path: Path
    name: str
    """Measurement name (``drift.table``), e.g. ``clip-rate``."""
    keys: tuple[str, ...]
    headline: str
    higher_is_worse: bool
    frame: pd.DataFrame = field(compare=False, repr=False)
    provenance: dict[str, Any] = field(compare=False, repr=False)
    docs: dict[str, str] = field(compare=False, repr=False)
    """Column → its documentation from the schema."""
    kinds: dict[str, str] = field(compare=False, repr=False, default_factory=dict)
    """Column → ``string``, ``int``, ``float`` or ``bool`` from the Arrow schema (pandas
    turns an integer column with nulls into floats)."""
    row_type: type[Row] | None = field(compare=False, default=None)
    """This drift's row type for the table, or None for a table it does not know."""
    notes: tuple[str, ...] = field(compare=False, default=())
    """What could not be read and was left out (unreadable provenance, nested columns), a
    line each."""

    @property
    def columns(self) -> list[str]:
        """Column names in schema order."""
        return list(self.frame.columns)

    @property
    def names(self) -> dict[str, dict[str, str]]:
        """What the report calls key values, where the writing command recorded it
        (provenance ``names``: column → value → name, e.g. a cast's canonical spec → the
        preset the user gave). Only what is shown changes: expressions and baselines read
        the values as written."""
        got = self.provenance.get("names")
        names = ({str(c): {str(v): str(n) for v, n in m.items()} for c, m in got.items()
                  if isinstance(m, dict)} if isinstance(got, dict) else {})
        if CAST_NAME in self.frame.columns:
            given = self.frame[[CAST, CAST_NAME]].dropna().drop_duplicates()
            names[CAST] = {**names.get(CAST, {}), **{
                str(c): str(n) for c, n in zip(given[CAST], given[CAST_NAME], strict=True)
                if c != n}}
            if not names[CAST]:
                del names[CAST]
        return names

    def display_frame(self) -> pd.DataFrame:
        """The frame with its named values (see :attr:`names`) replaced by their names."""
        names = {c: m for c, m in self.names.items() if c in self.frame.columns}
        if not names:
            return self.frame
        return self.frame.assign(**{c: self.frame[c].map(lambda v, m=m: shown(m, v))
                                    for c, m in names.items()})


def shown(names: dict[str, str], value: Any) -> Any:
    """``value`` as the report shows it: its name in ``names``, or itself."""
    return names.get(value, value) if isinstance(value, str) else value


@dataclass(frozen=True)
class Skipped:
    """A file that was named or found but is not a drift table."""

    path: Path
    reason: str


@dataclass(frozen=True)
class Loaded:
    """What a set of paths held: the tables, in order of concern (:func:`concern`, then
    path order), and the files skipped."""

    tables: tuple[Table, ...]
    skipped: tuple[Skipped, ...]


@functools.cache
def row_types() -> dict[str, type[Row]]:
    """Every row type this drift declares, by table name (:data:`ROW_TYPES`)."""
    found: dict[str, type[Row]] = {}
    for table, where in ROW_TYPES.items():
        module, _, name = where.partition(":")
        try:
            found[table] = getattr(importlib.import_module(module), name)
        except ImportError:  # an optional dependency missing: its tables read from metadata
            continue
    return found


def _kind(t: pa.DataType) -> str:
    """An Arrow type as the row types' Python types see it (Parquet may widen strings)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    return str(t)


def _written_by(prov: dict[str, Any]) -> str:
    version = prov.get("drift_version")
    return f"drift {version}" if version else "another drift"


def check_schema(path: Path, schema: pa.Schema, row_type: type[Row], prov: dict[str, Any]) -> None:
    """Raise :class:`SchemaError` unless ``schema`` has ``row_type``'s columns, types and
    table facts."""
    from driftcli import __version__

    want = schema_of(row_type)
    have = {f.name: f for f in schema}
    need = {f.name: f for f in want}
    problems = []
    if missing := [n for n in need if n not in have
                   and not (n == CAST_NAME and CAST in have)]:  # derived on reading
        problems.append(f"missing {', '.join(missing)}")
    if extra := [n for n in have if n not in need]:
        problems.append(f"unexpected {', '.join(extra)}")
    changed = [f"{n} {_kind(have[n].type)} (now {_kind(f.type)})" for n, f in need.items()
               if n in have and _kind(have[n].type) != _kind(f.type)]
    if changed:
        problems.append(f"retyped {', '.join(changed)}")
    meta = schema.metadata or {}
    for key in (b"drift.keys", b"drift.headline", b"drift.higher_is_worse"):
        if meta.get(key) != want.metadata[key]:
            problems.append(f"{key.decode()} {meta.get(key, b'absent').decode()} "
                            f"(now {want.metadata[key].decode()})")
    if problems:
        raise SchemaError(
            f"{path}: this {row_type.TABLE} table, written by {_written_by(prov)}, does not "
            f"match drift {__version__}'s ({'; '.join(problems)}); re-run drift "
            f"{row_type.TABLE} with this drift, or report it with the drift that wrote it")


def _facts(path: Path, meta: dict[bytes, bytes], columns: list[str],
           prov: dict[str, Any]) -> tuple[tuple[str, ...], str, bool]:
    """Keys, headline and direction from the schema metadata, checked against the columns."""
    damaged = (f"{path}: its drift metadata is damaged or from an incompatible drift "
               f"({_written_by(prov)})")
    keys, bad_keys = _json(meta.get(b"drift.keys", b"[]"), None)
    worse, bad_worse = _json(meta.get(b"drift.higher_is_worse", b"true"), None)
    try:
        headline = meta.get(b"drift.headline", b"").decode()
    except UnicodeDecodeError:
        bad_keys = "not UTF-8"
    if bad_keys or bad_worse:
        raise SchemaError(f"{damaged}; re-run the measurement")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)
            and isinstance(worse, bool)):
        raise SchemaError(f"{damaged}; re-run the measurement")
    absent = [c for c in (*keys, headline) if c not in columns]
    if absent:
        raise SchemaError(f"{damaged}: it declares column(s) {', '.join(absent)} it does not "
                          f"have (columns: {', '.join(columns)}); re-run the measurement")
    return tuple(keys), headline, worse


def _json(raw: bytes | None, default: Any) -> tuple[Any, str]:
    """``raw`` parsed as JSON, and '' or why it could not be (never raises: metadata is
    data)."""
    if raw is None:
        return default, ""
    try:
        return json.loads(raw.decode("utf-8")), ""
    except UnicodeDecodeError:
        return default, "not UTF-8"
    except RecursionError:
        return default, "nested too deep"
    except ValueError:
        return default, "not JSON"


NESTED = "nested"
"""What :func:`_nested` calls a column it leaves out, in a note."""


def _nested(schema: pa.Schema) -> dict[str, str]:
    """Columns of nested types (struct, map, list, ...), by name, with their kind."""
    return {f.name: str(f.type).split("<")[0] for f in schema if pa.types.is_nested(f.type)}


def read(path: Path, budget: int | None = None, *, total: int | None = None,
         max_bytes: int | None = None, bytes_total: int | None = None) -> Table:
    """One drift table, checked. Raises :class:`DriftError` for a file that is not a drift
    table (the caller may skip it), :class:`SchemaError` for a mismatched one,
    :class:`TooManyRowsError` for one whose footer declares more than ``budget`` rows (of
    ``total``, the whole budget, named in the message) and :class:`TooManyBytesError` for one
    whose columns decode to more than ``max_bytes`` bytes (of ``bytes_total``), before any of
    its values is decoded."""
    return _read(path, budget, total, max_bytes, bytes_total)[0]


def _read(path: Path, budget: int | None, total: int | None, max_bytes: int | None,
          bytes_total: int | None) -> tuple[Table, int]:
    try:
        schema = pq.read_schema(path)
        rows = pq.read_metadata(path).num_rows
    except (OSError, pa.ArrowException) as exc:
        raise DriftError(f"{path} is not a readable Parquet file ({exc})") from None
    if budget is not None and rows > budget:
        raise too_many(path, rows, budget, budget if total is None else total)
    meta = schema.metadata or {}
    if TABLE_KEY not in meta:
        raise DriftError(f"{path} is a Parquet file but not a drift table (no drift metadata)")
    name = meta[TABLE_KEY].decode("utf-8", "replace")
    prov, why = _json(meta.get(PROVENANCE_KEY), {})
    notes = [f"provenance unreadable ({why}); shown without it"] if why else []
    if not isinstance(prov, dict):
        prov = {}
        notes = notes or ["provenance unreadable (not a JSON object); shown without it"]
    row_type = row_types().get(name)
    if row_type is not None:
        check_schema(path, schema, row_type, prov)
    keys, headline, worse = _facts(path, meta, schema.names, prov)
    nested = _nested(schema) if row_type is None else {}
    if inner := [c for c in (*keys, headline) if c in nested]:
        raise DriftError(f"{path} is a {name} table whose key or headline column "
                         f"{', '.join(f'{c} ({nested[c]})' for c in inner)} is nested; a "
                         "report summarizes tables of plain columns")
    if nested:
        notes.append(f"left out {NESTED} columns: "
                     + ", ".join(f"{c} ({kind})" for c, kind in nested.items()))
    columns = [c for c in schema.names if c not in nested]
    try:
        table, size = read_columns(path, schema, columns, max_bytes, bytes_total)
    except (OSError, pa.ArrowException) as exc:
        raise DriftError(f"{path} is not a readable Parquet file ({exc})") from None
    docs = {f.name: (f.metadata or {}).get(b"doc", b"").decode("utf-8", "replace")
            for f in schema if f.name in columns}
    kinds = {f.name: _kind(f.type) for f in schema if f.name in columns}
    frame = table.to_pandas()
    if CAST in frame.columns and (CAST_NAME not in frame.columns
                                  or not frame[CAST_NAME].astype(bool).all()):
        frame = _named_casts(frame, prov)
        docs[CAST_NAME], kinds[CAST_NAME] = NAME_DOC, "string"
    return Table(path, name, keys, headline, worse, frame, prov, docs, kinds=kinds,
                 row_type=row_type, notes=tuple(notes)), size


def _named_casts(frame: pd.DataFrame, prov: dict[str, Any]) -> pd.DataFrame:
    """``frame`` with :data:`CAST_NAME` beside :data:`CAST` (or, where it has the column,
    its empty and null cells filled): the name the provenance recorded for each spec, else
    the spec."""
    got = prov.get("names")
    given = got.get(CAST) if isinstance(got, dict) else None
    names = ({str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {})
    named = frame[CAST].map(lambda c: names.get(c, c) if isinstance(c, str) else c)
    if CAST_NAME in frame.columns:  # written, but empty in some rows: those are filled
        given = frame[CAST_NAME]
        return frame.assign(**{CAST_NAME: given.where(given.astype(bool), named)})
    return frame.assign(**{CAST_NAME: named})[
        [*frame.columns[:frame.columns.get_loc(CAST) + 1], CAST_NAME,
         *frame.columns[frame.columns.get_loc(CAST) + 1:]]]


def _candidates(paths: Iterable[Path]) -> Iterable[Path]:
    for p in paths:
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.parquet") if q.is_file())
            if not found:
                raise DriftError(f"{p} holds no .parquet files; give the folder a measurement "
                                 "wrote (drift clip-rate ... --out DIR) or table files")
            yield from found
        elif p.exists():
            yield p
        else:
            raise DriftError(f"{p} does not exist; give drift tables (.parquet) or folders "
                             "holding them")


PART = "part-"
"""How a table written in parts names each (``drift.monitor``'s, docs/monitor.md): the parts of
one table in one folder are read as one table, whose path is the folder."""


def _joined(tables: list[Table]) -> list[Table]:
    """``tables`` with the parts of each table written in parts joined, in file order."""
    parts: dict[tuple[Path, str], list[Table]] = {}
    out: list[Table | tuple[Path, str]] = []
    for t in tables:
        if not t.path.name.startswith(PART):
            out.append(t)
            continue
        key = (t.path.parent, t.name)
        if key not in parts:
            out.append(key)
        parts.setdefault(key, []).append(t)
    return [t if isinstance(t, Table) else replace(
        parts[t][-1], path=t[0],
        frame=pd.concat([p.frame for p in parts[t]], ignore_index=True)) for t in out]


def load(paths: Sequence[Path]) -> Loaded:
    """Every drift table in ``paths`` (files, and folders searched recursively for
    ``*.parquet``); Parquet files that are not drift tables are skipped with the reason.
    Raises :class:`DriftError` when no drift table is found at all, and
    :class:`BudgetError` when the tables hold more rows than :func:`row_budget` or decode to
    more bytes than :func:`byte_budget`."""
    tables: list[Table] = []
    skipped: list[Skipped] = []
    seen: set[Path] = set()
    total, byte_total = row_budget(), byte_budget()
    left, bytes_left = total, byte_total
    for path in _candidates(paths):
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        try:
            table, size = _read(path, left, total, bytes_left, byte_total)
            tables.append(table)
            left -= len(table.frame)
            bytes_left -= size
        except (SchemaError, BudgetError):
            raise
        except DriftError as err:
            skipped.append(Skipped(path, str(err).removeprefix(f"{path} is ")))
    tables = _joined(tables)
    if not tables:
        named = ", ".join(str(p) for p in paths)
        raise DriftError(f"no drift tables in {named}; run a measurement first (e.g. drift "
                         "clip-rate MODEL --cast mxfp8_e4m3 --out DIR) and report DIR")
    return Loaded(tuple(sorted(tables, key=lambda t: concern(t.name))), tuple(skipped))


class InputState(StrEnum):
    """What the file now at a recorded input's path is."""

    SAME = "same"
    """The file the table measured (same size, and same sha256 or mtime)."""
    CHANGED = "changed"
    """Another file: the table is stale."""
    MISSING = "missing"
    """Not found (or unreadable) here: not checked. Paths are as the measurement's command
    line gave them, relative to the folder it ran in."""


@dataclass(frozen=True)
class InputCheck:
    """One recorded input against the file now at its path."""

    path: str
    state: InputState
    why: str = ""
    """What differs (a changed input) or why it could not be checked."""
    hashed: bool = False
    """Whether the check had to read and hash the file."""


Hashes = dict[tuple[str, int, int, int], str]
"""sha256 by (resolved path, size, mtime_ns, ctime_ns): each file hashed once a report."""


def _written(prov: dict[str, Any]) -> float | None:
    try:
        return dt.datetime.fromisoformat(str(prov["utc"])).timestamp()
    except (KeyError, ValueError, TypeError):
        return None


def _kind_of(mode: int) -> str:
    """What a file that is not a regular one is, for a message."""
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "a special file"


def _check(ident: dict[str, Any], written: float | None, hashes: Hashes) -> InputCheck | None:
    path, size, sha = ident.get("path"), ident.get("size"), ident.get("sha256")
    mtime = ident.get("mtime")
    if not isinstance(path, str) or not isinstance(size, int) or not (sha or mtime):
        return None  # nothing recorded to compare with
    p = Path(path)
    try:
        st = p.stat()
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            # opening a FIFO blocks for a writer; reading /dev/zero never ends
            return InputCheck(path, InputState.CHANGED, f"now {_kind_of(st.st_mode)}, not "
                                                        "a regular file")
        if st.st_size != size:
            return InputCheck(path, InputState.CHANGED, f"size {st.st_size:,} bytes, was {size:,}")
        if not sha:
            now = file_identity(p, fast_hash=True)["mtime"]
            return (InputCheck(path, InputState.SAME) if now == mtime else
                    InputCheck(path, InputState.CHANGED, f"modified {now}, was {mtime}"))
        if stat.S_ISDIR(st.st_mode):
            return InputCheck(path, InputState.CHANGED, "now a folder")
        if written is not None and max(st.st_mtime, st.st_ctime) < written:
            return InputCheck(path, InputState.SAME)  # not written to since it was hashed
        key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key not in hashes:
            hashes[key] = file_identity(p)["sha256"]
    except OSError as exc:
        return InputCheck(path, InputState.MISSING, exc.strerror or str(exc))
    if hashes[key] != sha:
        return InputCheck(path, InputState.CHANGED, "sha256 differs", hashed=True)
    return InputCheck(path, InputState.SAME, hashed=True)


def check_inputs(table: Table, hashes: Hashes | None = None) -> tuple[InputCheck, ...]:
    """Each input ``table`` recorded with its size and sha256 or mtime, against the file now
    at its path (see the module docstring); inputs recorded without them are left out.
    ``hashes`` shares the sha256s worked out between calls."""
    written = _written(table.provenance)
    hashes = {} if hashes is None else hashes
    inputs = table.provenance.get("inputs")
    checks = (_check(i, written, hashes) for i in (inputs if isinstance(inputs, list) else ())
              if isinstance(i, dict))
    return tuple(c for c in checks if c is not None)
