"""A whole report: the tables' summaries, the files skipped, the rules broken, the
comparison with a baseline, and whether the tables are current and from one run; every
renderer draws from this one record."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from driftcli.report.baseline import (
    Change,
    Comparison,
    TableComparison,
    compare,
    require_compared,
)
from driftcli.report.load import Hashes, Loaded, Skipped, Table, check_inputs, load
from driftcli.report.options import Options
from driftcli.report.summary import Provenance, TableSummary, summarize
from driftcli.report.thresholds import Violation, check, parse_rules

RUN_GAP = dt.timedelta(hours=12)
"""Tables written more than this long after the one before are from another session: drift's
own runs (a demo, a CI job) write their tables minutes apart."""


class Mix(StrEnum):
    """What tables of one report disagree on."""

    BUILDS = "builds"
    """Written by different drift versions or commits."""
    INPUTS = "inputs"
    """One input path recorded as different files (different sha256, size or mtime)."""
    TIMES = "times"
    """Written more than :data:`RUN_GAP` apart."""


@dataclass(frozen=True)
class Mixed:
    """Tables of one report that come from different runs, by one criterion."""

    kind: Mix
    subject: str
    """The input path (:attr:`Mix.INPUTS`), the time span (:attr:`Mix.TIMES`), or empty."""
    parts: tuple[tuple[str, tuple[str, ...]], ...]
    """Each distinct build, input identity or session, with the tables that have it."""


@dataclass(frozen=True)
class Report:
    """Everything a report shows."""

    tables: tuple[Table, ...]
    summaries: tuple[TableSummary, ...]
    skipped: tuple[Skipped, ...]
    options: Options
    violations: tuple[Violation, ...]
    comparison: Comparison | None
    baseline_skipped: tuple[Skipped, ...] = ()
    mixed: tuple[Mixed, ...] = ()
    """How the tables are from different runs (none: from one run, as far as they say)."""

    @property
    def regressions(self) -> tuple[tuple[TableComparison, Change], ...]:
        """Regressions beyond ``--fail-on-regression`` (none when it was not given)."""
        if self.comparison is None or self.options.fail_pct is None:
            return ()
        return self.comparison.regressions(self.options.fail_pct)

    @property
    def failed(self) -> bool:
        """Whether a rule was broken or a regression found: the command exits 1."""
        return bool(self.violations or self.regressions)

    @property
    def stale(self) -> tuple[TableSummary, ...]:
        """Tables whose inputs have changed since they were written."""
        return tuple(s for s in self.summaries if s.stale)


def _labels(tables: Sequence[Table]) -> list[str]:
    """Table names, or their paths where a name repeats."""
    names = [t.name for t in tables]
    return [n if names.count(n) == 1 else str(t.path) for n, t in zip(names, tables, strict=True)]


def _parts(pairs: list[tuple[str, str]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    grouped: dict[str, list[str]] = {}
    for what, label in pairs:
        grouped.setdefault(what, []).append(label)
    return tuple((w, tuple(ls)) for w, ls in grouped.items())


def _identity(ident: dict[str, Any]) -> tuple[Any, ...] | None:
    size = ident.get("size")
    if ident.get("sha256"):
        return ("sha256", size, ident["sha256"])
    if ident.get("mtime"):
        return ("mtime", size, ident["mtime"])
    return None


def _identity_line(ident: tuple[Any, ...]) -> str:
    kind, size, value = ident
    return f"sha256 {value[:12]}" if kind == "sha256" else f"size {size:,}, mtime {value}"


def _conflict(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two recorded identities are different files (a sha256 and an mtime of the
    same size say nothing about each other)."""
    return a[1] != b[1] or (a[0] == b[0] and a[2] != b[2])


def mixed_runs(tables: Sequence[Table]) -> tuple[Mixed, ...]:
    """How ``tables`` are from different runs: drift builds, one input recorded as
    different files, and sessions more than :data:`RUN_GAP` apart."""
    labels = _labels(tables)
    out = []
    builds = [(Provenance.of(t.provenance), label) for t, label in zip(tables, labels,
                                                                         strict=True)]
    built = _parts([(f"drift {p.drift_version or '?'}"
                     + (f" ({p.git_commit[:10]})" if p.git_commit else ""), label)
                    for p, label in builds if p.drift_version or p.git_commit])
    if len(built) > 1:
        out.append(Mixed(Mix.BUILDS, "", built))
    seen: dict[str, list[tuple[tuple[Any, ...], str]]] = {}
    for t, label in zip(tables, labels, strict=True):
        inputs = t.provenance.get("inputs")
        for i in inputs if isinstance(inputs, list) else ():
            if isinstance(i, dict) and isinstance(i.get("path"), str) and (
                    ident := _identity(i)) is not None:
                seen.setdefault(i["path"], []).append((ident, label))
    for path, found in seen.items():
        if any(_conflict(a, b) for a, _ in found for b, _ in found):
            out.append(Mixed(Mix.INPUTS, path,
                             _parts([(_identity_line(i), label) for i, label in found])))
    timed = sorted((w, label) for t, label in zip(tables, labels, strict=True)
                   if (w := _utc(t.provenance)) is not None)
    sessions: list[tuple[dt.datetime, str]] = []
    for n, (when, label) in enumerate(timed):
        start = sessions[-1][0] if sessions and when - timed[n - 1][0] <= RUN_GAP else when
        sessions.append((start, label))
    parts = _parts([(start.isoformat(timespec="seconds"), label) for start, label in sessions])
    if len(parts) > 1:
        out.append(Mixed(Mix.TIMES, _span(timed[-1][0] - timed[0][0]), parts))
    return tuple(out)


def _utc(prov: dict[str, Any]) -> dt.datetime | None:
    try:
        when = dt.datetime.fromisoformat(str(prov["utc"]))
    except (KeyError, ValueError, TypeError):
        return None
    return when if when.tzinfo is not None else None  # naive and aware do not compare


def _span(delta: dt.timedelta) -> str:
    hours = delta.total_seconds() / 3600
    return f"{hours:.1f} hours" if hours < 48 else f"{hours / 24:.1f} days"


def make_report(paths: Sequence[Path], options: Options | None = None) -> Report:
    """Read the tables under ``paths`` and build the report: summaries (with each table's
    inputs checked against the files on disk), rule checks, the baseline comparison and
    how the tables are from different runs. Rules are parsed before any file is read, so a
    malformed rule fails fast; a baseline that matches nothing raises
    :class:`~driftcli.report.baseline.BaselineError`."""
    options = options or Options()
    rules = parse_rules(options.rules)
    loaded = load(paths)
    base: Loaded | None = load([options.baseline]) if options.baseline is not None else None
    comparison = None
    if base is not None:
        comparison = compare(loaded.tables, base.tables, options.match_by)
        require_compared(comparison, loaded.tables, base.tables, str(options.baseline))
    hashes: Hashes = {}
    return Report(
        tables=loaded.tables,
        summaries=tuple(summarize(t, options.worst, check_inputs(t, hashes))
                        for t in loaded.tables),
        skipped=loaded.skipped, options=options,
        violations=check(rules, loaded.tables),
        comparison=comparison,
        baseline_skipped=base.skipped if base is not None else (),
        mixed=mixed_runs(loaded.tables))
