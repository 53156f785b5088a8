"""``drift report``: summaries of drift tables, thresholds, baselines, and renderers.

One job per module: :mod:`~driftcli.report.load` finds and checks tables,
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

from driftcli.report.expr import ExpressionError, Rule, parse_rule
from driftcli.report.load import SchemaError, Table, load
from driftcli.report.model import Options, Report, make_report
from driftcli.report.summary import TableSummary, summarize

__all__ = [
    "ExpressionError",
    "Options",
    "Report",
    "Rule",
    "SchemaError",
    "Table",
    "TableSummary",
    "load",
    "make_report",
    "parse_rule",
    "summarize",
]
