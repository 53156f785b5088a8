"""``drift report``: summarize drift tables; check thresholds and a baseline for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftcli.cli.app import EXIT_FOUND, command
from driftcli.escaping import for_terminal
from driftcli.report.options import CHANGE_PCT, WORST, MatchBy, Options


def _write(path: Path, text: str) -> None:
    """Write a report atomically (a temporary file renamed over it): a full disk leaves the
    earlier report whole, and the error names the file."""
    from driftcli.io.tables import write_text

    write_text(path, text)


@command("report")
def report(
    paths: Annotated[list[Path], typer.Argument(
        metavar="PATH...", exists=True, show_default=False,
        help="Drift tables (.parquet) or folders, searched recursively.")],
    markdown_file: Annotated[Path | None, typer.Option(
        "--markdown", metavar="FILE", dir_okay=False,
        help="Write GitHub-flavoured Markdown (e.g. $GITHUB_STEP_SUMMARY, which is appended "
             "to).")] = None,
    append: Annotated[bool, typer.Option(
        "--append", help="Append the Markdown to FILE instead of replacing it (always for "
                         "$GITHUB_STEP_SUMMARY).")] = False,
    json_file: Annotated[Path | None, typer.Option(
        "--json", metavar="FILE", dir_okay=False, help="Write the summary as JSON.")] = None,
    html_file: Annotated[Path | None, typer.Option(
        "--html", metavar="FILE", dir_okay=False,
        help="Write one self-contained HTML page with plots.")] = None,
    fail_on: Annotated[list[str] | None, typer.Option(
        "--fail-on", metavar="EXPR",
        help="Exit 1 if any row matches, e.g. 'underflow-rate:underflow_rate > 0.05' "
             "(repeatable; grammar in docs/report.md).")] = None,
    baseline: Annotated[Path | None, typer.Option(
        metavar="PATH", exists=True,
        help="An earlier run's tables (file or folder) to compare with, row by row.")] = None,
    fail_on_regression: Annotated[float | None, typer.Option(
        metavar="PCT", min=0,
        help="With --baseline: exit 1 if a headline got worse by more than PCT percent.")
    ] = None,
    match_by: Annotated[MatchBy, typer.Option(
        help="With --baseline: match rows' inputs by path as recorded, file name, or not at "
             "all (tensor: by tensor name, whatever file holds it).")] = MatchBy.NAME,
    change_threshold: Annotated[float, typer.Option(
        metavar="PCT", min=0, help="With --baseline: list headline changes beyond PCT percent.")
    ] = CHANGE_PCT,
    worst: Annotated[int, typer.Option(
        metavar="N", min=0, help="Worst rows named per group.")] = WORST,
) -> None:
    """Summarize drift tables; gate CI with rules and baselines.

    Per measurement and cast or policy; exit 1 when a rule breaks.
    """
    from driftcli.io.outputs import check_writable
    from driftcli.report import html, jsonout, markdown, terminal
    from driftcli.report.model import make_report

    if fail_on_regression is not None and baseline is None:
        raise typer.BadParameter("needs --baseline PATH", param_hint="--fail-on-regression")
    if append and markdown_file is None:
        raise typer.BadParameter("needs --markdown FILE", param_hint="--append")
    for option, file in (("--markdown", markdown_file), ("--json", json_file),
                         ("--html", html_file)):
        if file is not None:
            check_writable(file, option=option, folder=False)  # before reading any table
    options = Options(rules=tuple(fail_on or ()), baseline=baseline,
                      change_pct=change_threshold, fail_pct=fail_on_regression, worst=worst,
                      match_by=match_by)
    result = make_report(paths, options)
    terminal.render(result)
    for path, renderer in ((markdown_file, markdown.render), (json_file, jsonout.render),
                           (html_file, html.render)):
        if path is not None and path == markdown_file and markdown.appends(path, append):
            markdown.append_to(path, renderer(result))  # a job summary gathers every step's
        elif path is not None:
            _write(path, renderer(result))
            typer.echo(for_terminal(f"wrote {path}", markup=False), err=True)
    if result.failed:
        raise typer.Exit(EXIT_FOUND)
