"""The report as one self-contained HTML page: inline CSS, figures as base64 PNG data URIs,
no script, and a Content-Security-Policy that forbids the browser any other load, so the
page can be opened from a CI artifact with no network. One :class:`~plots.Palette` styles
every figure, so a cast has one colour on the whole page."""

from __future__ import annotations

import base64
import datetime as dt
import re
from html import escape

from driftcli.report import display as d
from driftcli.report.blockmaps import block_maps
from driftcli.report.model import Report
from driftcli.report.monitor import is_monitor, monitor_maps
from driftcli.report.plots import Note, Palette, Plot, figures

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1150px; padding: 0 1em; color: #1d1d1f; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.verdict { font-weight: 600; padding: 0.4em 0.7em; border-radius: 4px; display: inline-block; }
.ok { background: #e7f6ea; color: #14532d; } .fail { background: #fdecec; color: #7f1d1d; }
.regression, .error { color: #b91c1c; } .about { color: #555; margin: 0; padding-left: 1.2em; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; max-width: 60em; }
.note { color: #555; font-size: 13px; }
code { background: #f4f4f6; padding: 0 3px; border-radius: 3px; }
footer { margin-top: 3em; color: #888; font-size: 12px; }
"""


def _anchor(name: str, n: int) -> str:
    return f"t{n}-" + re.sub(r"[^A-Za-z0-9_-]", "-", name)


def _figure(plot: Plot | Note) -> str:
    if isinstance(plot, Note):
        return f'<p class="note"><b>{escape(plot.title)}.</b> {escape(plot.text)}</p>'
    data = base64.b64encode(plot.png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{escape(plot.alt)}" '
            f'title="{escape(plot.title)}"><figcaption><b>{escape(plot.title)}.</b> '
            f"{escape(plot.caption)}</figcaption></figure>")


def render(report: Report) -> str:
    """The page as text. Draws every figure (see :mod:`driftcli.report.plots`)."""
    from driftcli import __version__

    verdict = d.verdict(report)
    cls = "fail" if report.failed else "ok"
    body = [f"<h1>drift report</h1><p class=\"verdict {cls}\">{escape(verdict)}</p>"]
    warned = list(d.warnings(report))  # tables from different runs, stale tables
    if warned:
        body.append('<ul class="error">' + "".join(f"<li>{escape(w)}</li>" for w in warned)
                    + "</ul>")
    body.append("<nav><ul>" + "".join(
        f'<li><a href="#{_anchor(s.name, n)}">{escape(s.name)}</a> '
        f"<code>{escape(s.path)}</code></li>" for n, s in enumerate(report.summaries))
        + "</ul></nav>")
    if report.violations:
        body.append("<h2>Broken rules</h2><ul>")
        for v in report.violations:
            items = "".join(f"<li><code>{escape(d.violation_row(r))}</code></li>"
                            for r in v.rows)
            more = (f"<li>... and {v.n_rows - len(v.rows)} more row(s)</li>"
                    if v.n_rows > len(v.rows) else "")
            body.append(f'<li class="error">{escape(d.violation_head(v))}<ul>{items}{more}'
                        "</ul></li>")
        body.append("</ul>")
    palette = Palette()
    for n, (summary, table) in enumerate(zip(report.summaries, report.tables, strict=True)):
        vary, _ = d.varying(summary)
        heads = d.headers(summary, vary)
        body.append(f'<section id="{_anchor(summary.name, n)}">'
                    f"<h2>{escape(d.title(summary))}</h2>")
        body.append('<ul class="about">' + "".join(f"<li>{escape(line)}</li>"
                                                   for line in d.about(summary))
                    + "".join(f'<li class="error">{escape(line)}</li>'
                              for line in d.freshness(summary)) + "</ul>")
        rows: list[str] = []
        for g in summary.groups:
            tds = []
            for i, c in enumerate(d.cells(summary, g, vary)):
                numeric = len(vary) <= i < len(heads) - 1
                tds.append(f'<td class="num">{escape(c)}</td>' if numeric
                           else f"<td>{escape(c)}</td>")
            rows.append("<tr>" + "".join(tds) + "</tr>")
        body.append("<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in heads)
                    + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
        fails = list(d.failures(summary))
        if fails:
            body.append('<ul class="error">' + "".join(f"<li>{escape(f)}</li>" for f in fails)
                        + "</ul>")
        drawn = monitor_maps(table) if is_monitor(table) else [*figures(table, palette),
                                                                *block_maps(table)]
        body += [_figure(p) for p in drawn]
        body.append("</section>")
    if report.comparison is not None:
        body.append(f"<h2>Baseline <code>{escape(str(report.options.baseline))}</code></h2>")
        for s in report.baseline_skipped:
            body.append(f"<p>skipped <code>{escape(str(s.path))}</code>: {escape(s.reason)}</p>")
        for block in d.baseline_blocks(report):
            items = "".join(
                f'<li class="regression">{escape(line)}</li>' if line.startswith("regression")
                else f"<li>{escape(line)}</li>" for line in block.lines)
            body.append(f"<h3>{escape(block.title)}</h3>" + (f"<ul>{items}</ul>" if items else ""))
    if report.skipped:
        body.append("<h2>Skipped files</h2><ul>" + "".join(
            f"<li><code>{escape(str(s.path))}</code>: {escape(s.reason)}</li>"
            for s in report.skipped) + "</ul>")
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    body.append(f"<footer>drift {escape(__version__)} report, {now}</footer>")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>drift report</title><style>{STYLE}</style></head><body>\n"
        + "\n".join(body) + "\n</body></html>\n")
