"""A whole report: the tables' summaries, the files skipped, the rules broken and the
comparison with a baseline; every renderer draws from this one record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from driftcli.report.baseline import Change, Comparison, TableComparison, compare
from driftcli.report.load import Loaded, Skipped, Table, load
from driftcli.report.summary import WORST, TableSummary, summarize
from driftcli.report.thresholds import Violation, check, parse_rules

CHANGE_PCT = 1.0
"""Headline changes listed against a baseline when larger than this many percent."""


@dataclass(frozen=True)
class Options:
    """What the report was asked for."""

    rules: tuple[str, ...] = ()
    baseline: Path | None = None
    change_pct: float = CHANGE_PCT
    """List baseline changes beyond this many percent."""
    fail_pct: float | None = None
    """Fail on regressions beyond this many percent (None: do not fail on regressions)."""
    worst: int = WORST


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


def make_report(paths: Sequence[Path], options: Options = Options()) -> Report:
    """Read the tables under ``paths`` and build the report: summaries, rule checks and the
    baseline comparison. Rules are parsed before any file is read, so a malformed rule fails
    fast."""
    rules = parse_rules(options.rules)
    loaded = load(paths)
    base: Loaded | None = load([options.baseline]) if options.baseline is not None else None
    return Report(
        tables=loaded.tables,
        summaries=tuple(summarize(t, options.worst) for t in loaded.tables),
        skipped=loaded.skipped, options=options,
        violations=check(rules, loaded.tables),
        comparison=compare(loaded.tables, base.tables) if base is not None else None,
        baseline_skipped=base.skipped if base is not None else ())
