"""Summaries of drift tables: per measurement and per group (cast, policy, ...), the
headline's median and worst value and the worst rows by name, from each table's own
declared keys, headline and direction.

How a table is cut (its :class:`Layout`) follows from its keys and values, not from its name:

- the *item* column is the key column holding the aggregate marker ``*`` (``tensor`` in the
  per-tensor measurements, ``parameter`` in the gradient ones); its ``*`` rows are the
  aggregates, the others are summarized and named;
- otherwise a key column named ``step`` with more than one value is the item (a training or
  probe run, summarized over steps);
- the *group* columns are the other key columns, and in a table with an item the columns
  of :data:`BREAKDOWN` that vary between its items: the tensors of a dump at steps 100 and
  200 are summarized per step and role (activation, weight, gradient), never pooled; the
  aggregate rows, over every step and role, are then groups of their own;
- a table with neither an item nor steps is grouped by its first key column that takes
  between 2 and ``MAX_GROUPS`` values, and its rows are named by the remaining key values.
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from driftcli.report.load import ALL_ROWS, InputCheck, InputState, Table, shown
from driftcli.report.options import WORST

SOURCE = "source"
"""The key column naming the file a row was read from (in an aggregate row: the input)."""
FILE = "file"
"""The column :func:`by_input` adds: a merged row's file, relative to its input."""
INDEX_SUFFIX = ".safetensors.index.json"
"""A sharded checkpoint's index: given as an input, its shards sit in its folder."""
MAX_GROUPS = 24
"""A key column with more values than this is not used to group a table without an item."""
STEP = "step"
"""The key column of per-step tables (training runs, probes)."""
ERROR = "error"
"""A column, where a table has it, holding why a row could not be measured."""
LOST = "n_lost"
"""A count column, where a table has it, of elements lost to inf or NaN by the cast: left out
of the error sums, so the summary names the rows that have any."""
BREAKDOWN = (STEP, "role")
"""Columns (not keys) that split an item's rows into groups where they vary: a dump's
training step and tensor role."""
EMPTY = (("numel", "no elements"), ("n_finite", "no finite elements"),
         ("n_nonzero", "no nonzero elements"))
"""Count columns whose 0 says why a row has no headline: drift's headlines are ratios, null
where there is nothing to divide by (an all-zero tensor has no underflow rate)."""


def plain(value: Any) -> Any:
    """A cell as a plain Python value: NaN and pandas' missing values become None."""
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


@dataclass(frozen=True)
class Layout:
    """How a table is cut for a summary: its item column (if any) and its group columns."""

    item: str | None
    groups: tuple[str, ...]
    names: tuple[str, ...]
    """Key columns that name a row within its group (the item, or the leftover keys)."""
    has_aggregate: bool
    """Whether the item column holds ``*`` rows."""


def layout(table: Table) -> Layout:
    """The item and group columns of ``table`` (see the module docstring)."""
    frame, keys = table.frame, table.keys
    for k in keys:
        if k in frame and (is_agg := frame[k].astype(object) == ALL_ROWS).any():
            items = frame[~is_agg]
            split = tuple(c for c in BREAKDOWN if c in frame and c not in keys
                          and items[c].nunique() > 1)
            return Layout(k, (*(c for c in keys if c != k), *split), (k,), True)
    if STEP in keys and frame[STEP].nunique() > 1:
        return Layout(STEP, tuple(c for c in keys if c != STEP), (STEP,), False)
    for k in keys:
        if 1 < frame[k].nunique() <= MAX_GROUPS:
            return Layout(None, (k,), tuple(c for c in keys if c != k), False)
    return Layout(None, (), keys, False)


@dataclass(frozen=True)
class Named:
    """One row named by its key values within a group, with its headline value."""

    name: str
    value: float


@dataclass(frozen=True)
class Failed:
    """A row that could not be measured, and why."""

    name: str
    error: str


@dataclass(frozen=True)
class NoValue:
    """A row that was measured but has no headline value (drift's headlines are ratios,
    null where there is nothing to divide by), and why, where a count column says."""

    name: str
    reason: str | None


@dataclass(frozen=True)
class GroupSummary:
    """One group of a table (one cast, one policy, ...)."""

    group: tuple[tuple[str, Any], ...]
    """(column, value) of each group column."""
    n_rows: int
    """Rows summarized (not aggregates) with a headline value."""
    median: float | None
    worst_value: float | None
    """The max of the headline, or its min when higher is better."""
    worst: tuple[Named, ...]
    """The worst rows, worst first; rows equal to the group's best value are left out."""
    aggregate: tuple[tuple[str, Any], ...] | None
    """The group's ``*`` row as (column, value) pairs, where the table has one."""
    failed: tuple[Failed, ...]
    no_value: tuple[NoValue, ...] = ()
    """Rows measured without a headline value: not in ``n_rows``, the median or the worst."""
    lost: tuple[Named, ...] = ()
    """Rows (not aggregates) with elements lost to inf or NaN (:data:`LOST` > 0), most first;
    ``value`` is the count."""

    def aggregate_value(self, column: str) -> Any:
        """A column of the aggregate row, or None."""
        return dict(self.aggregate or ()).get(column)


@dataclass(frozen=True)
class Provenance:
    """Where a table came from, as its file records it."""

    drift_version: str | None
    git_commit: str | None
    utc: str | None
    command: str | None
    inputs: tuple[str, ...]

    @classmethod
    def of(cls, prov: dict[str, Any]) -> Provenance:
        """From the provenance dict a table carries (missing fields become None)."""
        cmd = prov.get("command")
        inputs = prov.get("inputs") or []
        return cls(
            drift_version=prov.get("drift_version"), git_commit=prov.get("git_commit"),
            utc=prov.get("utc"),
            command=" ".join(str(c) for c in cmd) if isinstance(cmd, list) else None,
            inputs=tuple(str(i.get("path", i)) if isinstance(i, dict) else str(i)
                         for i in inputs if i is not None))

    @property
    def line(self) -> str:
        """One line: version, commit, time."""
        commit = f" ({self.git_commit[:10]})" if self.git_commit else ""
        return f"drift {self.drift_version or '?'}{commit}, {self.utc or 'time unknown'}"


@dataclass(frozen=True)
class TableSummary:
    """One table's summary: its facts, layout, provenance and one summary per group."""

    name: str
    path: str
    headline: str
    higher_is_worse: bool
    keys: tuple[str, ...]
    layout: Layout
    n_rows: int
    provenance: Provenance
    groups: tuple[GroupSummary, ...]
    known_row_type: bool
    """False for a table this drift has no row type for (summarized from its schema)."""
    headline_doc: str
    constants: tuple[tuple[str, Any], ...] = ()
    """Key columns with one value in every row, and that value (shown once)."""
    names: dict[str, dict[str, str]] = field(default_factory=dict)
    """What key values are called where they are shown (:attr:`Table.names`)."""
    inputs: tuple[InputCheck, ...] = ()
    """The recorded inputs against the files now at their paths (:func:`check_inputs`;
    empty where they were not checked)."""
    beside: tuple[str, ...] = ()
    """Columns of each group's aggregate row shown beside the headline (the row type's
    ``SHOWN``: error-bias's bias, alignment and n_lost; clip-rate's exact_clip_rate)."""
    notes: tuple[str, ...] = ()
    """What of the file was left out (:attr:`Table.notes`), a line each."""

    @property
    def changed(self) -> tuple[InputCheck, ...]:
        """Inputs that are not the files the table measured."""
        return tuple(c for c in self.inputs if c.state is InputState.CHANGED)

    @property
    def stale(self) -> bool:
        """Whether an input has changed since the table was written."""
        return bool(self.changed)

    def shown(self, column: str, value: Any) -> Any:
        """A value of ``column`` as shown: its name, or itself."""
        return shown(self.names.get(column, {}), value)

    def label(self, group: GroupSummary) -> str:
        """``cast=mxfp8_e4m3 source=model.safetensors``-style label of one of its groups
        (empty for no groups)."""
        return " ".join(f"{k}={self.shown(k, v)}" for k, v in group.group)

    @property
    def worst_label(self) -> str:
        """``max`` or ``min``: which extreme is the worst."""
        return "max" if self.higher_is_worse else "min"


def _name(row: pd.Series, columns: Sequence[str],
          names: Mapping[str, dict[str, str]] | None = None) -> str:
    """A row's name within its group: its values of ``columns``, each as shown (a cast as the
    user named it, from :attr:`Table.names`)."""
    parts = [str(shown((names or {}).get(c, {}), plain(row[c]))) for c in columns
             if plain(row[c]) is not None]
    if columns == (STEP,) and parts:
        return f"{STEP} {parts[0]}"  # a bare number reads as a value, not a name
    return " ".join(parts) if parts else "(row)"


def _why_empty(row: pd.Series) -> str | None:
    return next((why for c, why in EMPTY if c in row.index and plain(row[c]) == 0), None)


def _group(frame: pd.DataFrame, lay: Layout, table: Table, key: tuple[tuple[str, Any], ...],
           worst: int) -> GroupSummary:
    head = table.headline
    agg = None
    if lay.has_aggregate and lay.item is not None:
        is_agg = frame[lay.item].astype(object) == ALL_ROWS
        if is_agg.any():
            agg = tuple((c, plain(v)) for c, v in frame[is_agg].iloc[0].items())
        frame = frame[~is_agg]
    failed: tuple[Failed, ...] = ()
    if ERROR in frame.columns:
        bad = frame[ERROR].notna()
        failed = tuple(Failed(_name(r, lay.names, table.names), str(r[ERROR]))
                       for _, r in frame[bad].iterrows())
        frame = frame[~bad]
    values = pd.to_numeric(frame[head], errors="coerce").astype(float)
    ok = values.notna()
    no_value = tuple(NoValue(_name(r, lay.names, table.names), _why_empty(r))
                     for _, r in frame[~ok].iterrows())
    lost: tuple[Named, ...] = ()
    if LOST in frame.columns:
        counts = pd.to_numeric(frame[LOST], errors="coerce").fillna(0)
        lost = tuple(Named(_name(frame.loc[i], lay.names, table.names), float(n)) for i, n in
                     counts[counts > 0].sort_values(ascending=False, kind="stable").items())
    frame, values = frame[ok], values[ok]
    if values.empty:
        return GroupSummary(key, 0, None, None, (), agg, failed, no_value, lost)
    order = values.sort_values(ascending=not table.higher_is_worse, kind="stable")
    best = values.min() if table.higher_is_worse else values.max()
    named = tuple(Named(_name(frame.loc[i], lay.names, table.names), float(v))
                  for i, v in order.items()
                  if v != best)[:worst]
    extreme = values.max() if table.higher_is_worse else values.min()
    return GroupSummary(key, len(values), float(values.median()), float(extreme), named, agg,
                        failed, no_value, lost)


def input_of(path: str, inputs: Sequence[str]) -> str | None:
    """The input ``path`` was found under: itself, the deepest folder holding it, or the index
    in whose folder it is; None for none."""
    norm = posixpath.normpath(path.replace("\\", "/"))
    found, depth = None, -1
    for inp in inputs:
        root = posixpath.normpath(inp.replace("\\", "/"))
        if norm == root:
            return inp
        if root.endswith(INDEX_SUFFIX):
            root = posixpath.dirname(root) or "."
        inside = root == "." and not norm.startswith("../") and not posixpath.isabs(norm)
        if (inside or norm.startswith(root.rstrip("/") + "/")) and len(root) > depth:
            found, depth = inp, len(root)
    return found


def by_input(frame: pd.DataFrame, lay: Layout) -> pd.DataFrame:
    """The rows with each per-tensor row's ``source`` (a file) made the input it was read
    through (a folder, an index, a file), as its aggregate row's is, so one input and cast
    is one group; the file goes to :data:`FILE`, relative to the input. ``frame`` itself
    where no row moves (every input a file, or a table without aggregate rows)."""
    if not lay.has_aggregate or lay.item is None or SOURCE not in lay.groups:
        return frame
    is_agg = frame[lay.item].astype(object) == ALL_ROWS
    inputs = list(dict.fromkeys(str(s) for s in frame.loc[is_agg, SOURCE]
                                if plain(s) is not None))
    sources = frame[SOURCE].map(plain)
    owner = sources.map(lambda s: None if s is None else input_of(str(s), inputs))
    moved = owner.notna() & (owner != sources) & ~is_agg
    if not moved.any():
        return frame
    out = frame.copy()

    def relative(src: str, inp: str) -> str:
        root = posixpath.normpath(inp.replace("\\", "/"))
        root = posixpath.dirname(root) if root.endswith(INDEX_SUFFIX) else root
        return posixpath.relpath(posixpath.normpath(src.replace("\\", "/")), root or ".")

    out[FILE] = [relative(str(s), str(o)) if m else None
                 for s, o, m in zip(sources, owner, moved, strict=True)]
    out[SOURCE] = frame[SOURCE].where(~moved, owner)
    return out


def summarize(table: Table, worst: int = WORST,
              inputs: tuple[InputCheck, ...] = ()) -> TableSummary:
    """Summarize one table: per group, the headline's median and worst value, the worst rows
    by name, the aggregate row, the rows that could not be measured and those without a
    headline value; ``inputs`` are its inputs checked (:func:`check_inputs`). The rows of
    a folder or sharded input are one group per cast with its aggregate (:func:`by_input`),
    named by file and tensor."""
    lay = layout(table)
    frame = by_input(table.frame, lay)
    if FILE in frame.columns and lay.item is not None:
        lay = dataclasses.replace(lay, names=(FILE, *lay.names))
    same = [k for k in table.keys
            if k != lay.item and len(frame) and frame[k].nunique(dropna=False) == 1]
    fixed = set(same)
    constants = tuple((k, plain(frame[k].iloc[0])) for k in same
                      if plain(frame[k].iloc[0]) is not None)  # an all-null key says nothing
    if any(n not in fixed for n in lay.names):  # name rows by what tells them apart
        lay = dataclasses.replace(lay, names=tuple(n for n in lay.names if n not in fixed))
    groups: list[GroupSummary] = []
    if lay.groups:
        # group on one string per row so null keys form a group too (pandas drops NaN keys)
        labels = frame[list(lay.groups)].astype(object).map(lambda v: str(plain(v)))
        joined = labels.agg("\x1f".join, axis=1)
        for _, part in frame.groupby(joined, sort=False):
            key = tuple((c, plain(part[c].iloc[0])) for c in lay.groups)
            groups.append(_group(part, lay, table, key, worst))
    else:
        groups.append(_group(frame, lay, table, (), worst))
    return TableSummary(
        name=table.name, path=str(table.path), headline=table.headline,
        higher_is_worse=table.higher_is_worse, keys=table.keys, layout=lay,
        n_rows=len(frame), provenance=Provenance.of(table.provenance), groups=tuple(groups),
        known_row_type=table.row_type is not None,
        headline_doc=table.docs.get(table.headline, ""), constants=constants,
        names=table.names, inputs=inputs, notes=table.notes,
        beside=tuple(c for c in getattr(table.row_type, "SHOWN", ())
                    if lay.has_aggregate and c in frame.columns))
