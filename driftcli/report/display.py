"""The words and numbers every renderer shares: value formatting, group labels, the lines
for broken rules and baseline changes. Renderers differ only in markup."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from driftcli.report.baseline import Change
from driftcli.report.load import InputState
from driftcli.report.model import Mix, Mixed, Report
from driftcli.report.summary import BREAKDOWN, GroupSummary, TableSummary
from driftcli.report.thresholds import Violation

ALL = "all"
"""An aggregate row's step and role where a dump's rows are grouped by them: it is over all."""
LISTED = 20
"""Changes, new keys and missing keys listed per table (the counts are always given)."""


def fmt(value: Any) -> str:
    """A value for a table cell: 4 significant digits, ``-`` for null."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else f"{value:.4g}"
    return str(value)


def fmt_pct(pct: float) -> str:
    """A signed percentage; ±inf from a zero baseline reads ``new (was 0)``."""
    if math.isinf(pct):
        return "new (was 0)"
    return f"{pct:+.3g}%"


def varying(summary: TableSummary) -> tuple[list[str], list[tuple[str, Any]]]:
    """Group columns that differ between groups, and the (column, value) of the key columns
    that are the same in every row (shown once, not in every row of the table)."""
    cols = list(summary.layout.groups)
    values = {c: {dict(g.group)[c] for g in summary.groups} for c in cols}
    vary = [c for c in cols if len(values[c]) > 1]
    return vary, list(summary.constants)


def headers(summary: TableSummary, vary: list[str]) -> list[str]:
    """Column headers of a summary table."""
    item = summary.layout.item
    cols = [*vary, "rows"]
    if summary.layout.has_aggregate:
        cols.append(f"all {item}s (*)" if item else "all (*)")
        cols += [f"{c} (*)" for c in summary.beside]
    cols += [f"median {summary.headline}", f"{summary.worst_label} {summary.headline}",
             f"worst {item}s" if item else "worst rows"]
    return cols


def cells(summary: TableSummary, group: GroupSummary, vary: list[str]) -> list[str]:
    """One summary table row."""
    g = dict(group.group)
    row = [ALL if g[c] is None and c in BREAKDOWN and group.aggregate is not None
           else fmt(summary.shown(c, g[c])) for c in vary] + [str(group.n_rows)]
    if summary.layout.has_aggregate:
        row.append(fmt(group.aggregate_value(summary.headline)))
        row += [fmt(group.aggregate_value(c)) for c in summary.beside]
    worst = ", ".join(f"{w.name} {fmt(w.value)}" for w in group.worst)
    return [*row, fmt(group.median), fmt(group.worst_value), worst or "-"]


STALE = "[STALE]"
"""Ends the title of a table whose inputs have changed since it was written."""


def title(summary: TableSummary) -> str:
    """``clip-rate: clip_rate (higher is worse)``, and :data:`STALE` for a stale table."""
    direction = "higher is worse" if summary.higher_is_worse else "higher is better"
    return (f"{summary.name}: {summary.headline} ({direction})"
            + (f" {STALE}" if summary.stale else ""))


def _noun(summary: TableSummary, n: int) -> str:
    item = summary.layout.item or "row"
    return f"{n} {item}{'' if n == 1 else 's'}"


def no_values(summary: TableSummary) -> Iterator[str]:
    """Rows measured without a headline value, per group: why the rows column counts fewer
    than the measurement's tensors."""
    vary, _ = varying(summary)
    for g in summary.groups:
        if not g.no_value:
            continue
        where = dict(g.group)
        label = " ".join(f"{c}={fmt(summary.shown(c, where[c]))}" for c in vary)
        by_reason: dict[str | None, list[str]] = {}
        for v in g.no_value:
            by_reason.setdefault(v.reason, []).append(v.name)
        named = "; ".join(", ".join(_listed(names)) + (f" ({why})" if why else "")
                          for why, names in by_reason.items())
        yield (f"no {summary.headline} for {_noun(summary, len(g.no_value))}"
               f"{' under ' + label if label else ''}, not counted in rows: {named}")


def losses(summary: TableSummary) -> Iterator[str]:
    """Per group, the rows with elements lost to inf or NaN (a cast that overflowed or made
    a block NaN): their headline counts them as an infinite error."""
    vary, _ = varying(summary)
    for g in summary.groups:
        if not g.lost:
            continue
        where = dict(g.group)
        label = " ".join(f"{c}={fmt(summary.shown(c, where[c]))}" for c in vary)
        total = int(sum(n.value for n in g.lost))
        named = ", ".join(_listed([f"{n.name} {int(n.value):,}" for n in g.lost]))
        yield (f"lost to inf/NaN: {total:,} element(s) in {_noun(summary, len(g.lost))}"
               f"{' under ' + label if label else ''} ({named}); {summary.headline} is inf "
               "where any element was lost")


def about(summary: TableSummary) -> Iterator[str]:
    """Lines under a table's title: file, rows without a headline value, headline meaning,
    provenance, inputs, fixed groups."""
    p = summary.provenance
    yield f"file {summary.path}, {summary.n_rows} rows, written by {p.line}"
    yield from summary.notes
    yield from no_values(summary)
    yield from losses(summary)
    if summary.headline_doc:
        yield f"{summary.headline}: {summary.headline_doc}"
    if p.command:
        yield f"command: {p.command}"
    if p.inputs:
        yield f"inputs: {', '.join(p.inputs)}"
    _, fixed = varying(summary)
    if fixed:
        yield "for all rows: " + ", ".join(f"{c}={fmt(summary.shown(c, v))}" for c, v in fixed)
    named = [f"{name} = {value}" for m in summary.names.values() for value, name in m.items()]
    if named:
        yield "names: " + "; ".join(named)
    if not summary.known_row_type:
        yield ("this drift has no row type for this table; summarized from the keys, headline "
               "and direction its schema declares")


def freshness(summary: TableSummary) -> Iterator[str]:
    """A line per input that is not the file the table measured, and one naming the inputs
    that are not here to check."""
    for c in summary.changed:
        yield (f"stale: {c.path} is not the file this table measured ({c.why}); re-run "
               + (summary.provenance.command or "the measurement"))
    missing = [c.path for c in summary.inputs if c.state is InputState.MISSING]
    if missing:
        yield f"not checked for changes (not found here): {', '.join(_listed(missing, 'inputs'))}"


def mixed_line(m: Mixed) -> str:
    """One way the report's tables are from different runs."""
    parts = "; ".join(f"{what}: {', '.join(tables)}" for what, tables in m.parts)
    if m.kind is Mix.BUILDS:
        return f"mixed runs: tables written by {len(m.parts)} drift builds: {parts}"
    if m.kind is Mix.INPUTS:
        return f"mixed runs: {m.subject} was {len(m.parts)} different files: {parts}"
    return f"mixed runs: tables written {m.subject} apart: {parts}"


def warnings(report: Report) -> Iterator[str]:
    """Report-wide warnings: tables from different runs, and the stale tables."""
    yield from (mixed_line(m) for m in report.mixed)
    if report.stale:
        yield (f"stale: {len(report.stale)} table(s) whose inputs changed since they were "
               f"written: {', '.join(s.path for s in report.stale)}")


def failures(summary: TableSummary) -> Iterator[str]:
    """Lines for rows that could not be measured."""
    for g in summary.groups:
        for f in g.failed:
            label = summary.label(g)
            yield f"not measured: {f.name}{' (' + label + ')' if label else ''}: {f.error}"


def violation_head(v: Violation) -> str:
    """``clip_rate > 0.01: 2 rows of clip-rate (path)``."""
    return f"{v.rule}: {v.n_rows} row(s) of {v.table} ({v.path})"


def violation_row(row: tuple[tuple[str, Any], ...]) -> str:
    """One broken row as ``col=value`` pairs."""
    return " ".join(f"{c}={fmt(v)}" for c, v in row)


def change_line(c: Change) -> str:
    """``regression name: old → new (+x%)``."""
    word = "regression" if c.regression else "improvement"
    return f"{word} {c.name}: {fmt(c.old)} → {fmt(c.new)} ({fmt_pct(c.pct)})"


def key_line(key: tuple[tuple[str, Any], ...]) -> str:
    """A key's values joined."""
    return " ".join(f"{c}={fmt(v)}" for c, v in key)


def verdict(report: Report) -> str:
    """The closing line: what broke, or that nothing did."""
    parts = []
    if report.violations:
        rules = len({v.rule for v in report.violations})
        rows = sum(v.n_rows for v in report.violations)
        parts.append(f"{rules} rule(s) broken by {rows} row(s)")
    if report.regressions:
        parts.append(f"{len(report.regressions)} regression(s) beyond "
                     f"{fmt(report.options.fail_pct)}%")
    if parts:
        return "FAILED: " + "; ".join(parts)
    checks = []
    if report.options.rules:
        checks.append(f"{len(report.options.rules)} rule(s) hold")
    if report.options.fail_pct is not None:
        checks.append(f"no regression beyond {fmt(report.options.fail_pct)}%")
    return "OK: " + "; ".join(checks) if checks else f"{len(report.summaries)} table(s) summarized"


@dataclass(frozen=True)
class Block:
    """A titled list of lines (one table's baseline comparison)."""

    title: str
    lines: tuple[str, ...]


def _listed(items: list[str], what: str = "") -> list[str]:
    more = len(items) - LISTED
    return items[:LISTED] + ([f"... and {more} more{' ' + what if what else ''}"]
                             if more > 0 else [])


def baseline_head(report: Report) -> str:
    """``baseline PATH (inputs matched by name)``."""
    comp = report.comparison
    how = f" (inputs matched by {comp.match_by.value})" if comp is not None else ""
    return f"baseline {report.options.baseline}{how}"


def baseline_blocks(report: Report) -> tuple[Block, ...]:
    """The baseline comparison as blocks: per table, its changes beyond the listing threshold
    (regressions beyond ``--fail-on-regression`` are always listed), new and missing keys;
    then the tables only one side has."""
    comp = report.comparison
    if comp is None:
        return ()
    opts = report.options
    pct = opts.change_pct if opts.fail_pct is None else min(opts.change_pct, opts.fail_pct)
    blocks = []
    for t in comp.tables:
        shown = t.beyond(pct)
        lines = _listed([change_line(c) for c in shown], "changes")
        if t.new_keys:
            lines.append(f"{len(t.new_keys)} new key(s), not in the baseline:")
            lines += _listed([key_line(k) for k in t.new_keys], "new keys")
        if t.missing_keys:
            lines.append(f"{len(t.missing_keys)} missing key(s), in the baseline only:")
            lines += _listed([key_line(k) for k in t.missing_keys], "missing keys")
        if t.duplicates:
            lines.append(f"{t.duplicates} row(s) with a repeated key were compared once")
        blocks.append(Block(
            f"{t.table} {t.headline}: {t.n_matched} row(s) matched, {len(shown)} changed by "
            f"more than {fmt(pct)}%", tuple(lines)))
    if comp.new_tables:
        blocks.append(Block("tables without a baseline: " + ", ".join(comp.new_tables), ()))
    if comp.missing_tables:
        blocks.append(Block("baseline tables this run lacks: " + ", ".join(comp.missing_tables),
                            ()))
    return tuple(blocks)
