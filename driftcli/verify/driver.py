"""The driver of ``verify-formats``: every suite on every format, in order, in one process
or spread over several."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

from driftcli.formats import FORMATS, Format, get_format
from driftcli.verify.blocks import check_blocks
from driftcli.verify.codes import check_codes
from driftcli.verify.compare import Outcome, Plan, VerifyRow
from driftcli.verify.inputs import check_float32_inputs
from driftcli.verify.matmuls import MATMUL_ACCUMULATORS, check_matmul
from driftcli.verify.pairs import check_pairs

FULL_PLAN = Plan()
"""The full plan, the default."""

CHECKS: list[Callable[[Format, Plan], Iterator[Outcome]]] = [
    check_codes, check_pairs, check_float32_inputs, check_blocks, check_matmul]
"""Every check ``verify-formats`` runs, in order."""


def element_formats(names: list[str] | None = None) -> list[Format]:
    """The formats to verify: the given names, or every registered format and the custom
    accumulators of :data:`MATMUL_ACCUMULATORS` (``e8m13``)."""
    if names:
        return [get_format(n) for n in names]
    registered = list(FORMATS.values())
    return registered + [get_format(n) for n in MATMUL_ACCUMULATORS if n not in set(FORMATS)]


def _run_task(name: str, index: int, plan: Plan) -> list[Outcome]:
    torch.set_num_threads(1)  # one worker per core does better than threads on small tensors
    return list(CHECKS[index](get_format(name), plan))


def verify(formats: list[Format], plan: Plan = FULL_PLAN, jobs: int = 1,
           progress: Callable[[str], None] | None = None) -> list[Outcome]:
    """Run every check on every format; return all outcomes in a fixed order (no printing).

    ``jobs > 1`` spreads (format, check) tasks over that many processes.
    """
    tasks = [(f.name, i) for f in formats for i in range(len(CHECKS))]

    def label(task: tuple[str, int]) -> str:
        return f"{task[0]}: {CHECKS[task[1]].__name__.removeprefix('check_')}"

    results: dict[tuple[str, int], list[Outcome]] = {}
    if jobs <= 1:
        for task in tasks:
            results[task] = list(CHECKS[task[1]](get_format(task[0]), plan))
            if progress is not None:
                progress(label(task))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_run_task, name, i, plan): (name, i) for name, i in tasks}
            for done in as_completed(futures):
                results[futures[done]] = done.result()
                if progress is not None:
                    progress(label(futures[done]))
    return [o for task in tasks for o in results[task]]


def rows(outcomes: list[Outcome]) -> list[VerifyRow]:
    """The Parquet rows: one summary per cell, then its disagreements."""
    return [r for o in outcomes for r in o.rows()]
