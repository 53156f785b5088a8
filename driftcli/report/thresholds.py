"""Applying ``--fail-on`` rules to tables: which tables a rule covers, and the rows that
break it.

A rule scoped with ``TABLE:`` applies to the tables of that measurement, and every column
it names must be one of theirs. An unscoped rule applies to every table that has all the
columns it names; a rule that no table can be checked against is an error, not a silent
pass, so a typo in CI cannot turn a threshold off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from driftcli.report.expr import ExpressionError, Rule, check_columns, evaluate, parse_rule
from driftcli.report.load import Table
from driftcli.report.summary import plain

SHOWN_ROWS = 20
"""Rows kept per (rule, table) in a violation; the count says how many broke it."""


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


def check(rules: Sequence[Rule], tables: Sequence[Table]) -> tuple[Violation, ...]:
    """Every (rule, table) with rows that break the rule. Raises :class:`ExpressionError` for
    a rule that names an unknown column or table, or compares values of different kinds."""
    out = []
    for rule in rules:
        for t in _targets(rule, tables):
            mask = evaluate(rule, t.frame)
            if not mask.any():
                continue
            show = [*t.keys, *(c for c in rule.columns if c not in t.keys)]
            rows = tuple(tuple((c, plain(v)) for c, v in r.items())
                         for r in t.frame.loc[mask, show].head(SHOWN_ROWS).to_dict("records"))
            out.append(Violation(rule.text, t.name, str(t.path), int(mask.sum()), rows))
    return tuple(out)
