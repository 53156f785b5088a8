"""The report as JSON: the same summary the terminal shows, as plain values.

Non-finite numbers are written as the strings ``"inf"``, ``"-inf"`` and ``"nan"``, so that the
file is strict JSON that every parser reads.
"""

from __future__ import annotations

import json
import math
from typing import Any

from driftcli.report import display as d
from driftcli.report.model import Report
from driftcli.report.summary import GroupSummary, TableSummary

FORMAT_VERSION = 1
"""Bumped when a field changes meaning or disappears."""


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _group(g: GroupSummary) -> dict[str, Any]:
    return {
        "group": dict(g.group), "rows": g.n_rows, "median": g.median, "worst": g.worst_value,
        "worst_rows": [{"name": w.name, "value": w.value} for w in g.worst],
        "aggregate": dict(g.aggregate) if g.aggregate is not None else None,
        "not_measured": [{"name": f.name, "error": f.error} for f in g.failed],
        "no_value": [{"name": v.name, "reason": v.reason} for v in g.no_value],
        "lost": [{"name": n.name, "n_lost": int(n.value)} for n in g.lost],
    }


def _table(s: TableSummary) -> dict[str, Any]:
    p = s.provenance
    return {
        "table": s.name, "path": s.path, "headline": s.headline,
        "higher_is_worse": s.higher_is_worse, "keys": list(s.keys), "rows": s.n_rows,
        "item": s.layout.item, "group_by": list(s.layout.groups),
        "known_row_type": s.known_row_type, "names": s.names,
        "provenance": {"drift_version": p.drift_version, "git_commit": p.git_commit,
                       "utc": p.utc, "command": p.command, "inputs": list(p.inputs)},
        "groups": [_group(g) for g in s.groups],
        "stale": s.stale,
        "inputs_checked": [{"path": c.path, "state": c.state.value, "why": c.why}
                           for c in s.inputs],
    }


def to_dict(report: Report) -> dict[str, Any]:
    """The report as plain JSON-ready values."""
    out: dict[str, Any] = {
        "drift_report": FORMAT_VERSION,
        "failed": report.failed,
        "tables": [_table(s) for s in report.summaries],
        "skipped": [{"path": str(s.path), "reason": s.reason} for s in report.skipped],
        "rules": list(report.options.rules),
        "violations": [{"rule": v.rule, "table": v.table, "path": v.path, "rows": v.n_rows,
                        "shown": [dict(r) for r in v.rows]} for v in report.violations],
        "baseline": None,
        "stale": [s.path for s in report.stale],
        "mixed_runs": [{"kind": m.kind.value, "subject": m.subject,
                        "parts": [{"what": w, "tables": list(ts)} for w, ts in m.parts],
                        "line": d.mixed_line(m)} for m in report.mixed],
    }
    comp = report.comparison
    if comp is not None:
        opts = report.options
        pct = opts.change_pct if opts.fail_pct is None else min(opts.change_pct, opts.fail_pct)
        out["baseline"] = {
            "path": str(opts.baseline), "match_by": comp.match_by.value,
            "change_pct": pct, "fail_pct": opts.fail_pct,
            "new_tables": list(comp.new_tables), "missing_tables": list(comp.missing_tables),
            "regressions": len(report.regressions),
            "tables": [{
                "table": t.table, "headline": t.headline, "higher_is_worse": t.higher_is_worse,
                "matched": t.n_matched,
                "changes": [{"key": dict(c.key), "old": c.old, "new": c.new, "pct": c.pct,
                             "regression": c.regression} for c in t.beyond(pct)],
                "new_keys": [dict(k) for k in t.new_keys],
                "missing_keys": [dict(k) for k in t.missing_keys],
            } for t in comp.tables],
        }
    return _plain(out)


def strict(value: Any) -> str:
    """``value`` as indented, strict JSON: non-finite numbers as ``"inf"``, ``"-inf"`` and
    ``"nan"`` (``json.dumps`` would write ``Infinity``, which JSON parsers refuse)."""
    return json.dumps(_plain(value), indent=2, allow_nan=False, default=str)


def render(report: Report) -> str:
    """The report as indented JSON text."""
    return strict(to_dict(report)) + "\n"
