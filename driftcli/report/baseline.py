"""Comparing a run with a baseline run: tables matched by name, rows by their key columns,
the headline's change per row, and regressions in the direction the table declares worse."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from driftcli.errors import DriftError
from driftcli.report.load import Table
from driftcli.report.summary import plain

Key = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Change:
    """One row whose headline changed between the baseline and this run."""

    key: Key
    old: float
    new: float
    pct: float
    """(new - old) / |old| in percent; ±inf when the baseline was 0."""
    regression: bool
    """Whether the change goes the way the table declares worse."""

    @property
    def name(self) -> str:
        """The key values joined, for a listing."""
        return " ".join(str(v) for _, v in self.key if v is not None)


@dataclass(frozen=True)
class TableComparison:
    """One measurement compared with its baseline."""

    table: str
    headline: str
    higher_is_worse: bool
    keys: tuple[str, ...]
    n_matched: int
    changes: tuple[Change, ...]
    """Every matched row whose headline changed, largest change first."""
    new_keys: tuple[Key, ...]
    """Rows in this run without a baseline row."""
    missing_keys: tuple[Key, ...]
    """Baseline rows this run lacks."""
    duplicates: int
    """Rows dropped because another row of the same side had the same key."""

    def beyond(self, pct: float) -> tuple[Change, ...]:
        """Changes larger than ``pct`` percent either way."""
        return tuple(c for c in self.changes if abs(c.pct) > pct)

    def regressions(self, pct: float) -> tuple[Change, ...]:
        """Changes for the worse larger than ``pct`` percent."""
        return tuple(c for c in self.beyond(pct) if c.regression)


@dataclass(frozen=True)
class Comparison:
    """This run against a baseline: per table, and the tables only one side has."""

    tables: tuple[TableComparison, ...]
    new_tables: tuple[str, ...]
    missing_tables: tuple[str, ...]

    def regressions(self, pct: float) -> tuple[tuple[TableComparison, Change], ...]:
        """Every regression beyond ``pct`` percent, with its table."""
        return tuple((t, c) for t in self.tables for c in t.regressions(pct))


def _by_key(tables: Sequence[Table], keys: tuple[str, ...],
            headline: str) -> tuple[dict[Key, float | None], int]:
    frame = pd.concat([t.frame[[*keys, headline]] for t in tables], ignore_index=True)
    rows: dict[Key, float | None] = {}
    dropped = 0
    for record in frame.to_dict("records"):
        key = tuple((k, plain(record[k])) for k in keys)
        if key in rows:
            dropped += 1
            continue
        value = plain(record[headline])
        rows[key] = None if value is None else float(value)
    return rows, dropped


def percent(old: float, new: float) -> float:
    """Relative change in percent; ±inf from a zero baseline, 0 when equal."""
    if new == old:
        return 0.0
    if old == 0 or math.isinf(old):
        return math.copysign(math.inf, new - old)
    return (new - old) / abs(old) * 100


def _compare(name: str, now: list[Table], before: list[Table]) -> TableComparison:
    t = now[0]
    for b in before:
        if absent := [c for c in (*t.keys, t.headline) if c not in b.columns]:
            raise DriftError(f"baseline {b.path} lacks {', '.join(absent)}, which this run's "
                             f"{name} table compares on; use a baseline from the same drift")
    cur, dup_now = _by_key(now, t.keys, t.headline)
    old, dup_old = _by_key(before, t.keys, t.headline)
    changes = []
    for key, new_value in cur.items():
        if key not in old:
            continue
        old_value = old[key]
        if old_value is None or new_value is None or old_value == new_value:
            continue
        if math.isnan(old_value) or math.isnan(new_value):
            continue
        pct = percent(old_value, new_value)
        worse = new_value > old_value if t.higher_is_worse else new_value < old_value
        changes.append(Change(key, old_value, new_value, pct, worse))
    changes.sort(key=lambda c: (-abs(c.pct), c.name))
    return TableComparison(
        table=name, headline=t.headline, higher_is_worse=t.higher_is_worse, keys=t.keys,
        n_matched=sum(1 for k in cur if k in old), changes=tuple(changes),
        new_keys=tuple(k for k in cur if k not in old),
        missing_keys=tuple(k for k in old if k not in cur), duplicates=dup_now + dup_old)


def compare(current: Sequence[Table], baseline: Sequence[Table]) -> Comparison:
    """Compare this run's tables with the baseline's, matching tables by name and rows by
    the key columns (exact values: run both with the same input paths and casts)."""
    names = list(dict.fromkeys(t.name for t in current))
    before = {t.name for t in baseline}
    tables = tuple(_compare(n, [t for t in current if t.name == n],
                            [t for t in baseline if t.name == n])
                   for n in names if n in before)
    return Comparison(tables, tuple(n for n in names if n not in before),
                      tuple(n for n in dict.fromkeys(t.name for t in baseline)
                            if n not in names))
