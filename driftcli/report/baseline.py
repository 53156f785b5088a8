"""Comparing a run with a baseline run: tables matched by name, rows by their key columns
(the input's path matched as :class:`MatchBy` says), the headline's change per row, and
regressions in the direction the table declares worse."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from driftcli.errors import DriftError
from driftcli.report.load import Table, shown
from driftcli.report.options import INPUT_KEYS, MatchBy
from driftcli.report.summary import plain

Key = tuple[tuple[str, Any], ...]

class BaselineError(DriftError):
    """A baseline comparison that cannot be made, or that compared nothing."""


@dataclass(frozen=True)
class Change:
    """One row whose headline changed between the baseline and this run."""

    key: Key
    """This run's key (as written)."""
    old: float
    new: float
    pct: float
    """(new - old) / |old| in percent; ±inf when the baseline was 0."""
    regression: bool
    """Whether the change goes the way the table declares worse."""
    shown: str = ""
    """The key values as the report shows them (a cast by the name its ``-c`` gave it);
    empty: as written."""

    @property
    def name(self) -> str:
        """The key values joined, for a listing: as shown where the table names them."""
        return self.shown or " ".join(str(v) for _, v in self.key if v is not None)


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
    match_by: MatchBy = MatchBy.NAME

    def regressions(self, pct: float) -> tuple[tuple[TableComparison, Change], ...]:
        """Every regression beyond ``pct`` percent, with its table."""
        return tuple((t, c) for t in self.tables for c in t.regressions(pct))


@dataclass(frozen=True)
class _Side:
    """One side's rows of a table: match key → (key as written, headline)."""

    rows: dict[Key, tuple[Key, float | None]]
    duplicates: int


def _match_key(key: Key, match_by: MatchBy) -> Key:
    return tuple((k, match_by.compared(k, v)) for k, v in key)


def _side(tables: Sequence[Table], keys: tuple[str, ...], headline: str, match_by: MatchBy,
          side: str) -> _Side:
    frame = pd.concat([t.frame[[*keys, headline]] for t in tables], ignore_index=True)
    rows: dict[Key, tuple[Key, float | None]] = {}
    dropped = 0
    for record in frame.to_dict("records"):
        key = tuple((k, plain(record[k])) for k in keys)
        match = _match_key(key, match_by)
        if match in rows:
            if rows[match][0] != key:  # two inputs that this matching cannot tell apart
                modes = list(MatchBy)
                finer = [m.value for m in reversed(modes[:modes.index(match_by)])]
                raise BaselineError(
                    f"--match-by {match_by.value}: {side} {tables[0].name} rows "
                    f"{_shown(rows[match][0])} and {_shown(key)} cannot be told apart; use "
                    f"--match-by {' or '.join(finer)}")
            dropped += 1  # the same table read twice
            continue
        value = plain(record[headline])
        rows[match] = key, None if value is None else float(value)
    return _Side(rows, dropped)


def _shown(key: Key) -> str:
    return " ".join(f"{c}={v}" for c, v in key)


def percent(old: float, new: float) -> float:
    """Relative change in percent; ±inf from a zero baseline, 0 when equal."""
    if new == old:
        return 0.0
    if old == 0 or math.isinf(old):
        return math.copysign(math.inf, new - old)
    return (new - old) / abs(old) * 100


def _check_columns(name: str, t: Table, before: list[Table]) -> None:
    for b in before:
        if absent := [c for c in (*t.keys, t.headline) if c not in b.columns]:
            raise BaselineError(f"baseline {b.path} lacks {', '.join(absent)}, which this "
                                f"run's {name} table compares on; use a baseline from the "
                                "same drift")


def _compare(name: str, now: list[Table], before: list[Table],
             match_by: MatchBy) -> TableComparison:
    t = now[0]
    _check_columns(name, t, before)
    cur = _side(now, t.keys, t.headline, match_by, "this run's")
    old = _side(before, t.keys, t.headline, match_by, "the baseline's")
    changes = []
    for match, (key, new_value) in cur.rows.items():
        if match not in old.rows:
            continue
        old_value = old.rows[match][1]
        if old_value is None or new_value is None or old_value == new_value:
            continue
        if math.isnan(old_value) or math.isnan(new_value):
            continue
        pct = percent(old_value, new_value)
        worse = new_value > old_value if t.higher_is_worse else new_value < old_value
        names = t.names
        label = " ".join(str(shown(names.get(c, {}), v)) for c, v in key if v is not None)
        changes.append(Change(key, old_value, new_value, pct, worse, label))
    changes.sort(key=lambda c: (-abs(c.pct), c.name))
    return TableComparison(
        table=name, headline=t.headline, higher_is_worse=t.higher_is_worse, keys=t.keys,
        n_matched=sum(1 for m in cur.rows if m in old.rows), changes=tuple(changes),
        new_keys=tuple(k for m, (k, _) in cur.rows.items() if m not in old.rows),
        missing_keys=tuple(k for m, (k, _) in old.rows.items() if m not in cur.rows),
        duplicates=cur.duplicates + old.duplicates)


def _groups(tables: Sequence[Table]) -> dict[str, list[Table]]:
    out: dict[str, list[Table]] = {}
    for t in tables:
        out.setdefault(t.name, []).append(t)
    return out


def compare(current: Sequence[Table], baseline: Sequence[Table],
            match_by: MatchBy = MatchBy.NAME) -> Comparison:
    """Compare this run's tables with the baseline's, matching tables by name and rows by
    the key columns: exact values, except the input's path, matched as ``match_by`` says.
    Raises :class:`BaselineError` where the matching cannot tell two rows of one side
    apart (two inputs with one file name under ``name``)."""
    now, before = _groups(current), _groups(baseline)
    tables = tuple(_compare(n, now[n], before[n], match_by) for n in now if n in before)
    return Comparison(tables, tuple(n for n in now if n not in before),
                      tuple(n for n in before if n not in now), match_by)


def _few(values: list[Any]) -> str:
    more = f" or {len(values) - 2} more" if len(values) > 2 else ""
    return " or ".join(str(v) for v in values[:2]) + more


def _why(t: TableComparison, match_by: MatchBy) -> str:
    """Which key columns have no value in common between the two sides."""
    if not t.new_keys:
        return f"this run's {t.table} has no rows"
    if not t.missing_keys:
        return f"the baseline's {t.table} has no rows"
    apart = []
    for column in t.keys:
        here, there = ([*dict.fromkeys(match_by.compared(column, dict(k)[column]) for k in keys)]
                       for keys in (t.new_keys, t.missing_keys))
        if not set(here) & set(there):
            what = "file name" if column in INPUT_KEYS and match_by is MatchBy.NAME else column
            apart.append(f"{what} is {_few(here)} here but {_few(there)} in the baseline")
    return "; ".join(apart) or "no combination of its key values is on both sides"


def require_compared(comp: Comparison, current: Sequence[Table], baseline: Sequence[Table],
                     where: str) -> None:
    """Raise :class:`BaselineError` unless every table both sides have matched a row: a
    comparison that matched nothing would pass any regression threshold unread. The message
    says why (the key columns whose values differ) and which ``--match-by`` would match."""
    if not comp.tables:
        raise BaselineError(
            f"baseline {where} has none of this run's tables (this run: "
            f"{', '.join(comp.new_tables)}; the baseline: {', '.join(comp.missing_tables)}); "
            "give a baseline of the same measurements")
    empty = [t for t in comp.tables if t.n_matched == 0]
    if not empty:
        return
    first = empty[0]
    others = f" (and {len(empty) - 1} more table(s))" if len(empty) > 1 else ""
    hint = "; measure both runs with the same inputs and casts"
    if any(c in INPUT_KEYS for c in first.keys):
        names = {t.table for t in empty}
        now = [t for t in current if t.name in names]
        before = [t for t in baseline if t.name in names]
        for m in MatchBy:
            if m is comp.match_by:
                continue
            try:
                got = compare(now, before, m)
            except BaselineError:
                continue
            if all(t.n_matched for t in got.tables):
                hint = (f"; --match-by {m.value} matches "
                        f"{sum(t.n_matched for t in got.tables)} row(s)")
                break
    raise BaselineError(
        f"nothing compared: no row of {first.table}{others} matches baseline {where} with "
        f"--match-by {comp.match_by.value} ({_why(first, comp.match_by)}){hint}")
