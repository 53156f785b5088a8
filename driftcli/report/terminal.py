"""The report in the terminal: one rich table per measurement, then broken rules, the
baseline comparison, the warnings (stale tables, mixed runs) and the verdict."""

from __future__ import annotations

import os
import shutil
import sys
from typing import TextIO

from rich.console import Console
from rich.table import Table as RichTable

from driftcli.escaping import for_terminal as escape
from driftcli.report import display as d
from driftcli.report.model import Report

WIDTH = 160
"""Table width where the output is no terminal and ``$COLUMNS`` is not set, so CI logs and
piped output are not cut at 80 columns; lines outside the tables are never wrapped (soft
wrap), so they can be searched in a log."""


def width(stream: TextIO | None = None) -> int:
    """The width tables are drawn at: ``$COLUMNS`` where set, else the terminal's width where
    ``stream`` (stdout) is one, else :data:`WIDTH`."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return shutil.get_terminal_size((WIDTH, 24)).columns
    except (AttributeError, ValueError, OSError):  # a closed or replaced stream
        pass
    return WIDTH


WORST_MIN = 24
"""Narrowest the worst-rows column is drawn; below it those rows go under the table."""


def cell_width(header: str, cells: list[str]) -> int:
    """The width a column needs so that no cell and no word of its header is broken."""
    words = [len(w) for w in header.split()]
    return max([*words, *(len(c) for c in cells), 1])


def fixed_columns(table: RichTable, columns: list[tuple[str, list[str], bool]],
                  worst: str | None, total: int) -> bool:
    """Add ``columns`` (header, cells, numeric) at fixed widths, so that names that tell rows
    apart (``mxfp8_e4m3``, ``mxfp8_e4m3_ceil``) and numbers are never cut or broken: headers
    on one line where that leaves room, else wrapped between words (:func:`cell_width`); then
    the wrapped ``worst`` column where at least :data:`WORST_MIN` of ``total`` columns are
    left for it. Returns whether it was added (if not, the caller prints the worst rows under
    the table)."""
    natural = [max(len(h), *(len(c) for c in cells)) for h, cells, _ in columns]
    compact = [cell_width(h, cells) for h, cells, _ in columns]
    borders = 3 * len(columns) + 1  # a rule and two spaces of padding a column, one rule more
    room = [(natural, True), (compact, True), (natural, False), (compact, False)]
    widths, inside = next(((w, keep) for w, keep in room
                           if sum(w) + borders + (WORST_MIN + 3 if keep else 0) <= total),
                          (compact, False))
    for (header, _, numeric), w in zip(columns, widths, strict=True):
        table.add_column(header, justify="right" if numeric else "left", width=w,
                         overflow="fold")
    if inside and worst is not None:
        table.add_column(worst, overflow="fold", min_width=WORST_MIN)
    return inside and worst is not None


def render(report: Report, console: Console | None = None) -> None:
    """Print ``report`` to ``console`` (stdout at :func:`width`, by default)."""
    out = console or Console(width=width(), highlight=False, soft_wrap=True)
    for s in report.skipped:
        out.print(f"[yellow]skipped[/yellow] {escape(str(s.path))}: {escape(s.reason)}")
    for summary in report.summaries:
        vary, _ = d.varying(summary)
        table = RichTable(title=escape(d.title(summary)), title_justify="left")
        heads = [escape(h) for h in d.headers(summary, vary)]
        rows = [[escape(c) for c in d.cells(summary, g, vary)] for g in summary.groups]
        # the groups, then numbers; the worst rows last, wrapped (or below, when narrow)
        fixed = [(h, [r[i] for r in rows], i >= len(vary)) for i, h in enumerate(heads[:-1])]
        inside = fixed_columns(table, fixed, heads[-1], out.width)
        for r in rows:
            table.add_row(*(r if inside else r[:-1]))
        out.print(table)
        if not inside:
            for g, r in zip(summary.groups, rows, strict=True):
                where = dict(g.group)
                label = escape(" ".join(f"{c}={d.fmt(summary.shown(c, where[c]))}"
                                        for c in vary))
                out.print(f"  {heads[-1]}{' (' + label + ')' if label else ''}: {r[-1]}")
        for line in d.about(summary):
            out.print(f"  {escape(line)}")
        for line in d.freshness(summary):
            style = "red" if line.startswith("stale") else "yellow"
            out.print(f"  [{style}]{escape(line)}[/{style}]")
        for line in d.failures(summary):
            out.print(f"  [red]{escape(line)}[/red]")
        out.print()
    for v in report.violations:
        out.print(f"[red]FAIL[/red] {escape(d.violation_head(v))}")
        for row in v.rows:
            out.print(f"    {escape(d.violation_row(row))}")
        if v.n_rows > len(v.rows):
            out.print(f"    ... and {v.n_rows - len(v.rows)} more row(s)")
    if report.comparison is not None:
        out.print(f"[bold]{escape(d.baseline_head(report))}[/bold]")
        for s in report.baseline_skipped:
            out.print(f"  [yellow]skipped[/yellow] {escape(str(s.path))}: {escape(s.reason)}")
        for block in d.baseline_blocks(report):
            out.print(f"  {escape(block.title)}")
            for line in block.lines:
                style = "red" if line.startswith("regression") else ""
                text = escape(line)
                out.print(f"    [{style}]{text}[/{style}]" if style else f"    {text}")
    for line in d.warnings(report):
        out.print(f"[yellow]{escape(line)}[/yellow]")
    verdict = d.verdict(report)
    out.print(f"[red]{escape(verdict)}[/red]" if report.failed else escape(verdict))
