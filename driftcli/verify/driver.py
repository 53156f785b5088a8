"""The driver of ``verify-formats``: every suite on every format, in order, on one of
drift's execution engines (:mod:`driftcli.engines`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from driftcli import engines
from driftcli.engines import Execution
from driftcli.progress import Progress
from driftcli.records.formats import FORMATS, Format, get_format
from driftcli.verify.blocks import check_blocks
from driftcli.verify.codes import check_codes
from driftcli.verify.compare import Outcome, Plan, VerifyRow
from driftcli.verify.inputs import check_float32_inputs
from driftcli.verify.matmuls import MATMUL_ACCUMULATORS, check_matmul
from driftcli.verify.pairs import check_pairs
from driftcli.verify.recipes import check_recipes

FULL_PLAN = Plan()
"""The full plan, the default."""

CHECKS: list[Callable[[Format, Plan], Iterator[Outcome]]] = [
    check_codes, check_pairs, check_float32_inputs, check_blocks, check_matmul, check_recipes]
"""Every check ``verify-formats`` runs, in order."""


def element_formats(names: list[str] | None = None) -> list[Format]:
    """The formats to verify: the given names, or every registered format and the custom
    accumulators of :data:`MATMUL_ACCUMULATORS` (``e8m13``)."""
    if names:
        return [get_format(n) for n in names]
    registered = list(FORMATS.values())
    return registered + [get_format(n) for n in MATMUL_ACCUMULATORS if n not in set(FORMATS)]


@dataclass(frozen=True)
class CheckUnit:
    """One check on one format, all of its cells: the work unit an engine runs. It names the
    format rather than holding it, so that it pickles (a custom ``eXmY`` is parsed again
    where it runs)."""

    format: str
    check: int
    """The index of the check in :data:`CHECKS`."""
    plan: Plan

    def __str__(self) -> str:
        return f"{self.format}: {CHECKS[self.check].__name__.removeprefix('check_')}"

    def key(self) -> str:
        """Everything the unit's outcomes depend on."""
        return f"verify|{self}|{self.plan}"


def run_check(unit: CheckUnit) -> list[Outcome]:
    """The outcomes (cells) of one check on one format, in the check's order."""
    return list(CHECKS[unit.check](get_format(unit.format), unit.plan))


def verify(formats: list[Format], plan: Plan = FULL_PLAN, execution: Execution | None = None,
           progress: Progress | None = None) -> list[Outcome]:
    """Run every check on every format; return all outcomes in a fixed order (no printing).

    ``execution`` runs the (format, check) pairs (one :class:`CheckUnit` each) on an engine;
    the outcomes and their order are the serial run's on every engine. ``progress`` is told
    the units done, of all, and the one that finished.
    """
    execution = execution or Execution()
    if execution.threads is None:
        # every comparison is exact, so the thread count cannot change an outcome; one
        # thread per worker keeps one worker per CPU from starting a pool of threads each
        execution = dataclasses.replace(execution, threads=1)
    units = [CheckUnit(f.name, i, plan) for f in formats for i in range(len(CHECKS))]
    done = engines.run(units, run_check, execution, progress=progress)
    return [o for outcomes in done for o in outcomes]


def rows(outcomes: list[Outcome]) -> list[VerifyRow]:
    """The Parquet rows: one summary per cell, then its disagreements."""
    return [r for o in outcomes for r in o.rows()]
