"""The report as GitHub-flavoured Markdown, for a CI job summary (``$GITHUB_STEP_SUMMARY``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from driftcli.report import display as d
from driftcli.report.model import Report


def _text(text: str) -> str:
    """Text outside code spans: ``&``, ``<`` and ``>`` as entities, so a tensor, file or table
    name is shown as written and never read as HTML (GFM passes raw HTML through)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cell(text: str) -> str:
    """A table cell or list item: HTML escaped (:func:`_text`), pipes escaped, newlines
    flattened (GFM tables are one line a row)."""
    return _text(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


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
            out.append(f"- {_code(v.rule)}: {v.n_rows} row(s) of **{_cell(v.table)}** "
                       f"({_code(v.path)})")
            # the rows' names are data: escaped text, which a backtick in a name cannot break
            out += [f"  - {_cell(d.violation_row(row))}" for row in v.rows]
            if v.n_rows > len(v.rows):
                out.append(f"  - ... and {v.n_rows - len(v.rows)} more row(s)")
        out.append("")
    for summary in report.summaries:
        vary, _ = d.varying(summary)
        out += [f"## {_cell(d.title(summary))}", ""]
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
            out.append(f"- skipped {_code(str(s.path))}: {_cell(s.reason)}")
        for block in d.baseline_blocks(report):
            out.append(f"- **{_cell(block.title)}**")
            out += [f"  - {':x: ' if line.startswith('regression') else ''}{_cell(line)}"
                    for line in block.lines]
        out.append("")
    if report.skipped:
        out += ["## Skipped files", ""]
        out += [f"- {_code(str(s.path))}: {_cell(s.reason)}" for s in report.skipped]
        out.append("")
    return "\n".join(out)


STEP_SUMMARY = "GITHUB_STEP_SUMMARY"
"""The variable GitHub Actions sets to the job summary's file: a step appends to it (other
steps' summaries are in it too), never replaces it."""


def appends(path: Path, append: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``--markdown path`` appends: with ``--append``, or when ``path`` is the file
    ``$GITHUB_STEP_SUMMARY`` names."""
    if append:
        return True
    summary = (os.environ if environ is None else environ).get(STEP_SUMMARY)
    if not summary:
        return False
    try:
        return Path(summary).resolve() == path.resolve()
    except OSError:  # an unresolvable path (a symlink loop) is not the job summary
        return False


def append_to(path: Path, text: str) -> None:
    """Add the report to the end of ``path`` (created if absent), after a blank line where the
    file already holds text, so a Markdown block before it stays closed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab+") as f:
        end = f.seek(0, os.SEEK_END)
        last = b""
        if end:
            f.seek(end - 1)
            last = f.read(1)
        sep = "" if not end else "\n" if last == b"\n" else "\n\n"
        f.write(f"{sep}{text.rstrip()}\n".encode())
