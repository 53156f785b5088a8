"""The report as GitHub-flavoured Markdown, for a CI job summary (``$GITHUB_STEP_SUMMARY``)."""

from __future__ import annotations

from collections.abc import Iterable

from driftcli.report import display as d
from driftcli.report.model import Report


def _cell(text: str) -> str:
    """A table cell: pipes escaped, newlines flattened (GFM tables are one line a row)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """Inline code that survives backticks in the text."""
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"


def _table(headers: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def render(report: Report) -> str:
    """The whole report as Markdown text."""
    verdict = d.verdict(report)
    out = ["# drift report", "", f"**{verdict}**" if report.failed else verdict, ""]
    warnings = list(d.warnings(report))
    if warnings:
        out += [f"- :warning: {_cell(line)}" for line in warnings]
        out.append("")
    if report.violations:
        out += ["## Broken rules", ""]
        for v in report.violations:
            out.append(f"- {_code(v.rule)}: {v.n_rows} row(s) of **{v.table}** "
                       f"({_code(v.path)})")
            out += [f"  - {_code(d.violation_row(row))}" for row in v.rows]
            if v.n_rows > len(v.rows):
                out.append(f"  - ... and {v.n_rows - len(v.rows)} more row(s)")
        out.append("")
    for summary in report.summaries:
        vary, _ = d.varying(summary)
        out += [f"## {d.title(summary)}", ""]
        out += _table(d.headers(summary, vary),
                      (d.cells(summary, g, vary) for g in summary.groups))
        out.append("")
        out += [f"- {_cell(line)}" for line in d.about(summary)]
        out += [f"- {':warning: ' if line.startswith('stale') else ''}{_cell(line)}"
                for line in d.freshness(summary)]
        out += [f"- :x: {_cell(line)}" for line in d.failures(summary)]
        out.append("")
    if report.comparison is not None:
        comp = report.comparison
        out += [f"## Baseline {_code(str(report.options.baseline))}", "",
                f"Inputs matched by {comp.match_by.value}.", ""]
        for s in report.baseline_skipped:
            out.append(f"- skipped {_code(str(s.path))}: {s.reason}")
        for block in d.baseline_blocks(report):
            out.append(f"- **{block.title}**")
            out += [f"  - {':x: ' if line.startswith('regression') else ''}{line}"
                    for line in block.lines]
        out.append("")
    if report.skipped:
        out += ["## Skipped files", ""]
        out += [f"- {_code(str(s.path))}: {s.reason}" for s in report.skipped]
        out.append("")
    return "\n".join(out)
