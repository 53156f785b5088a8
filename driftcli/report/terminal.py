"""The report in the terminal: one rich table per measurement, then broken rules, the
baseline comparison, the warnings (stale tables, mixed runs) and the verdict."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table as RichTable

from driftcli.escaping import for_terminal as escape
from driftcli.report import display as d
from driftcli.report.model import Report

WIDTH = 160
"""Fixed table width, so CI logs and piped output are not cut at 80 columns; lines outside
the tables are never wrapped (soft wrap), so they can be searched in a log."""


def render(report: Report, console: Console | None = None) -> None:
    """Print ``report`` to ``console`` (stdout, 160 columns, by default)."""
    out = console or Console(width=WIDTH, highlight=False, soft_wrap=True)
    for s in report.skipped:
        out.print(f"[yellow]skipped[/yellow] {escape(str(s.path))}: {escape(s.reason)}")
    for summary in report.summaries:
        vary, _ = d.varying(summary)
        table = RichTable(title=escape(d.title(summary)), title_justify="left")
        heads = d.headers(summary, vary)
        for i, h in enumerate(heads):
            numeric = len(vary) <= i < len(heads) - 1  # between the groups and the worst rows
            table.add_column(escape(h), justify="right" if numeric else "left", overflow="fold")
        for g in summary.groups:
            table.add_row(*(escape(c) for c in d.cells(summary, g, vary)))
        out.print(table)
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
