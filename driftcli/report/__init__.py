"""``drift report``: summaries of drift tables, thresholds, baselines, and renderers.

One job per module: :mod:`~driftcli.report.load` finds and checks tables (as much of them
as :mod:`~driftcli.report.budget` allows),
:mod:`~driftcli.report.summary` summarizes them, :mod:`~driftcli.report.expr` is the
``--fail-on`` language and :mod:`~driftcli.report.thresholds` applies it,
:mod:`~driftcli.report.baseline` compares runs, :mod:`~driftcli.report.model` assembles a
:class:`Report`, and :mod:`~driftcli.report.terminal`, :mod:`~driftcli.report.markdown`,
:mod:`~driftcli.report.jsonout` and :mod:`~driftcli.report.html` (with
:mod:`~driftcli.report.plots`) render it::

    from driftcli.report import Options, make_report, markdown
    report = make_report([Path("drift-out")], Options(rules=("clip_rate > 0.01",)))
    print(markdown.render(report)); exit(1 if report.failed else 0)
"""

from driftcli.lazy import exports

_API = {
    "ExpressionError": "driftcli.report.expr", "Rule": "driftcli.report.expr",
    "parse_rule": "driftcli.report.expr",
    "SchemaError": "driftcli.report.load", "Table": "driftcli.report.load",
    "Options": "driftcli.report.options",
    "Report": "driftcli.report.model", "make_report": "driftcli.report.model",
    "TableSummary": "driftcli.report.summary", "summarize": "driftcli.report.summary",
}
"""Each name and its module, imported on first use (pandas is not needed to read options)."""

__getattr__ = exports(globals(), _API)
__all__ = sorted(_API)
