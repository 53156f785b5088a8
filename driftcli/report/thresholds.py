"""Applying ``--fail-on`` rules to tables: which tables a rule covers, and the rows that
break it.

A rule scoped with ``TABLE:`` applies to the tables of that measurement, and every column
it names must be one of theirs. An unscoped rule applies to every table that has all the
columns it names; a rule that no table can be checked against is an error, not a silent
pass, so a typo in CI cannot turn a threshold off.

A quoted string compared with a cast column (``cast == 'nvfp4'``) stands for the casts the
report shows by that name: the preset or spelling the user gave on the measurement's command
line (the table's ``cast_name`` column, or its provenance ``names``), as well as the canonical
spec the table stores and the spec the string itself parses to; ``cast_name == 'nvfp4'``
selects by the name alone. A string compared with a key column (or ``cast_name``) that stands
for no value of any table the rule covers is an error naming the values there are: such a
rule could never break, whatever the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from driftcli.errors import DriftError, close_matches
from driftcli.report.expr import (
    ExpressionError,
    Rule,
    Synonyms,
    check_columns,
    evaluate,
    parse_rule,
)
from driftcli.report.load import CAST_NAME, Table
from driftcli.report.summary import plain

SHOWN_ROWS = 20
"""Rows kept per (rule, table) in a violation; the count says how many broke it."""
CAST_COLUMNS = ("cast", "against")
NAMED_COLUMNS = (CAST_NAME,)
"""Columns that are not keys but name what a row measured: a string compared with one that
no row holds is refused, as with a key column."""
"""Columns holding canonical cast specs: a string compared with them may be any spelling of
the cast (a preset, the user's ``-c``)."""
LISTED_VALUES = 12
"""Values named when a rule's string stands for none."""


@dataclass(frozen=True)
class Violation:
    """The rows of one table that break one rule."""

    rule: str
    table: str
    path: str
    n_rows: int
    """How many rows break the rule."""
    rows: tuple[tuple[tuple[str, Any], ...], ...]
    """The first ``SHOWN_ROWS`` of them: their key columns and the columns the rule names."""


def parse_rules(texts: Sequence[str]) -> tuple[Rule, ...]:
    """Parse every rule, failing on the first malformed one."""
    return tuple(parse_rule(t) for t in texts)


def _targets(rule: Rule, tables: Sequence[Table]) -> list[Table]:
    if rule.scope is not None:
        scoped = [t for t in tables if t.name == rule.scope]
        if not scoped:
            names = ", ".join(sorted({t.name for t in tables}))
            raise ExpressionError(f"rule {rule.text!r} is scoped to {rule.scope!r}, but the "
                                  f"report has no such table (tables: {names})")
        for t in scoped:
            check_columns(rule, t.columns, f"table {t.name}")
        return scoped
    covered = [t for t in tables if all(c in t.columns for c in rule.columns)]
    if not covered:
        known = sorted({c for t in tables for c in t.columns})
        check_columns(rule, known, "every table")  # a column no table has: name the choices
        per_table = "; ".join(f"{t.name}: {', '.join(t.columns)}" for t in tables)
        raise ExpressionError(f"rule {rule.text!r} names columns no single table has all of "
                              f"(columns by table: {per_table}); scope it with TABLE:")
    return covered


def _canonical(text: str) -> str | None:
    """The canonical spec of a cast spelt ``text``, or None where it is no cast."""
    from driftcli.records.castspec import parse_cast

    try:
        return str(parse_cast(text))
    except (DriftError, ValueError, KeyError):
        return None


def _values(table: Table, column: str) -> list[str]:
    """The distinct text values of ``column``, in table order."""
    return [str(v) for v in dict.fromkeys(table.frame[column].dropna().tolist())]


def _names(table: Table, column: str) -> dict[str, str]:
    names = table.names
    return names.get(column) or (names.get("cast", {}) if column in CAST_COLUMNS else {})


def meant(table: Table, column: str, text: str) -> frozenset[str]:
    """The values of ``column`` in ``table`` that ``text`` stands for: itself, a value the
    report shows as ``text``, and for a cast column the canonical spec ``text`` parses to."""
    names = _names(table, column)
    spec = _canonical(text) if column in CAST_COLUMNS else None
    return frozenset(v for v in _values(table, column)
                     if text in (v, names.get(v)) or (spec is not None and v == spec))


def synonyms(rule: Rule, table: Table) -> Synonyms:
    """What each string the rule compares with a column of ``table`` stands for there."""
    return {(c, text): meant(table, c, text) for c, text in rule.text_comparisons
            if c in table.frame.columns}


def _require_meaningful(rule: Rule, tables: Sequence[Table]) -> None:
    """Raise :class:`ExpressionError` when a string compared with a key column stands for no
    value of any table the rule covers, naming the values it could have meant."""
    for column, text in rule.text_comparisons:
        keyed = [t for t in tables if column in t.keys
                 or (column in NAMED_COLUMNS and column in t.frame.columns)]
        if not keyed or any(meant(t, column, text) for t in keyed):
            continue
        shown = list(dict.fromkeys(_names(t, column).get(v, v) for t in keyed
                                   for v in _values(t, column)))
        listed = ", ".join(shown[:LISTED_VALUES]) + (
            f", ... ({len(shown)} in all)" if len(shown) > LISTED_VALUES else "")
        where = ", ".join(dict.fromkeys(t.name for t in keyed))
        raise ExpressionError(
            f"rule {rule.text!r} compares {column} with {text!r}, which no row of {where} "
            f"has, so the rule could never break{close_matches(text, shown)} "
            f"({column} values: {listed or 'none'})")


def check(rules: Sequence[Rule], tables: Sequence[Table]) -> tuple[Violation, ...]:
    """Every (rule, table) with rows that break the rule. Raises :class:`ExpressionError` for
    a rule that names an unknown column or table, compares values of different kinds, or
    compares a key column with a string that no row of the tables it covers holds."""
    out = []
    for rule in rules:
        targets = _targets(rule, tables)
        _require_meaningful(rule, targets)
        for t in targets:
            mask = evaluate(rule, t.frame, synonyms(rule, t))
            if not mask.any():
                continue
            show = [*t.keys, *(c for c in rule.columns if c not in t.keys)]
            # key values as the report shows them (a preset, not its canonical spec)
            rows = tuple(tuple((c, plain(v)) for c, v in r.items()) for r in
                         t.display_frame().loc[mask, show].head(SHOWN_ROWS).to_dict("records"))
            out.append(Violation(rule.text, t.name, str(t.path), int(mask.sum()), rows))
    return tuple(out)
