"""The search: the models of the family that give every probe's bits, the simplest chosen
(:func:`infer`), or the best where none does."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from driftcli.arith.blockfma import (
    NO_FLOOR,
    FMAUnit,
    Prepared,
    survivors,
)
from driftcli.arith.matmul import Order
from driftcli.measures.calibrate.backends import FLOAT32, Backend
from driftcli.measures.calibrate.design import (
    LONG_K,
    PROBE_K,
    RANDOM_ROWS,
    long_rows,
    probe_columns,
    probe_rows,
    tiny_rows,
)
from driftcli.measures.calibrate.family import Model, blockfma_models, classic_models
from driftcli.measures.calibrate.probes import (
    Observed,
    model_results,
    observe,
    probe_share,
    same_bits,
)
from driftcli.records.formats import Format


@dataclass(frozen=True)
class Inference:
    """What the probes say: the chosen model, how many models gave every probe's bits (and
    in what they differ), and the best share of probes reproduced where none did."""

    model: Model
    survivors: int
    probe_share: float
    probes: int
    seconds: float
    alternatives: str = ""


def alternatives(models: Sequence[Model], c_modes: Sequence[str] = ()) -> str:
    """In what models that give the same bits differ, e.g. ``kept_bits 17-48; acc e8m10,
    float16`` (empty for one model)."""
    if len(models) < 2:
        return ""
    fields: dict[str, list[str]] = {
        "order": [m.order.value for m in models],
        "fma_size": [str(m.unit.size) if m.unit else "-" for m in models],
        "interleave": [str(m.unit.interleave) if m.unit else "-" for m in models],
        "kept_bits": [str(m.unit.kept_bits) if m.unit else "-" for m in models],
        "acc": [m.acc.name for m in models],
        "acc_rounding": [m.rounding.value for m in models],
        "promote": [str(m.chunk) for m in models],
        "c": list(c_modes)}
    parts = []
    for name, values in fields.items():
        distinct = set(values)
        if len(distinct) < 2:
            continue
        numbers = sorted(int(v) for v in distinct if v.lstrip("-").isdigit())
        words = sorted(v for v in distinct if not v.lstrip("-").isdigit())
        shown = ([f"{numbers[0]}-{numbers[-1]}"] if len(numbers) > 2 else
                 [str(n) for n in numbers]) + [w if w != "-" else "none" for w in words]
        parts.append(f"{name} {', '.join(shown)}")
    return "; ".join(parts)


def search(models: Sequence[Model], prep: Prepared, want: Tensor,
           output: Format | None) -> list[Model]:
    """The block-FMA models among ``models`` that give every result of ``want`` on the
    prepared operands (grouped by unit shape, each group one search in numba)."""
    shapes: dict[tuple[int, int], list[Model]] = {}
    for m in models:
        if m.order is Order.BLOCKFMA and m.unit is not None:
            shapes.setdefault((m.unit.size, m.unit.interleave), []).append(m)
    found = []
    for (size, il), group in shapes.items():
        ok = survivors(prep, size, il, [(cast(FMAUnit, m.unit).kept_bits, m.acc, m.rounding,
                                          m.chunk) for m in group], want, output)
        found += [m for m, good in zip(group, ok, strict=True) if good]
    return found


def infer(be: Backend, *, seed: int = 0, max_k: int = max(LONG_K)) -> Inference:
    """The simplest model of the family that gives every probe's bits on ``be`` (see
    :mod:`driftcli.measures.calibrate`), or the one that gives the most."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    rows = probe_rows(be.inputs, PROBE_K, gen)
    cols = probe_columns(be.inputs, PROBE_K, gen)
    # the random rows first: they tell most models apart within a few results
    rows = torch.cat([rows[-RANDOM_ROWS:], rows[:-RANDOM_ROWS]])
    full = observe(be, rows, cols)
    output = None if be.output == FLOAT32 else be.output
    blockfma = list(blockfma_models(PROBE_K))
    classic = list(classic_models(PROBE_K))
    found = search(blockfma, cast(Prepared, full.prepared), full.results, output)
    screen = observe(be, rows[:RANDOM_ROWS], cols)  # the random rows
    for model in classic:
        if bool(same_bits(model_results(model, be, screen), screen.results).all()) and \
                probe_share(model, be, full) == 1.0:
            found.append(model)
    survivors_ = _long(be, found, gen, max_k)
    probes = full.results.numel()
    if survivors_:
        chosen = _floor(be, min(survivors_, key=Model.simplicity))
        return Inference(chosen, len(survivors_), 1.0, probes, time.perf_counter() - start,
                         alternatives(survivors_))
    if found:  # the short probes have models, the long ones none: the simplest, and how far
        best = min(found, key=Model.simplicity)
        k = max(k for k in LONG_K if k <= max_k) if any(k <= max_k for k in LONG_K) else 0
        if k:
            obs = observe(be, long_rows(be.inputs, k, gen), probe_columns(be.inputs, k, gen))
            share = probe_share(best, be, obs)
            note = (f"{len(found)} model(s) give every K={PROBE_K} probe; the simplest gives "
                    f"{share:.4%} of the K={k} probes")
            return Inference(best, 0, share, obs.results.numel(),
                             time.perf_counter() - start, note)
    best, share = _best([*blockfma, *classic], be, screen, full)
    return Inference(best, 0, share, probes, time.perf_counter() - start)


BEST_STRIDE = 41
"""Where no model fits, every this-many-th model of the family is scored (about 3,000)."""


MIN_EXPS = range(-160, -99)
"""Exponent floors tried once a block-FMA model is chosen."""


def _floor(be: Backend, model: Model) -> Model:
    """``model`` with the exponent floor the tiny probes show (none where none is needed)."""
    if model.order is not Order.BLOCKFMA or model.unit is None:
        return model
    gen = torch.Generator().manual_seed(1)
    obs = observe(be, tiny_rows(be.inputs, PROBE_K), probe_columns(be.inputs, PROBE_K, gen))
    unit = model.unit
    for floor in (NO_FLOOR, *MIN_EXPS):
        trial = Model(model.order, model.acc, model.rounding,
                      FMAUnit(unit.size, unit.kept_bits, floor, unit.interleave), model.chunk)
        if probe_share(trial, be, obs) == 1.0:
            return trial
    return model


def _best(models: Sequence[Model], be: Backend, screen: Observed,
          full: Observed) -> tuple[Model, float]:
    """The best model found: a pass over every ``BEST_STRIDE``-th model on the screen's
    probes, then the twenty best of it on all of them (a report of how far the family is
    from the backend, not a search for a fit: none exists)."""
    step = BEST_STRIDE
    coarse = sorted(((probe_share(m, be, screen), i) for i, m in enumerate(models[::step])),
                    reverse=True)[:20]
    scored = [(probe_share(models[step * i], be, full), models[step * i]) for _, i in coarse]
    share, model = max(scored, key=lambda s: s[0])
    return model, share


def _long(be: Backend, survivors: list[Model], gen: torch.Generator,
          max_k: int) -> list[Model]:
    """The survivors of the structure probes, with every promotion interval up to ``max_k``,
    kept where they give the long probes' bits."""
    if not survivors:
        return []
    kept = survivors
    for k in (k for k in LONG_K if k <= max_k):
        obs = observe(be, long_rows(be.inputs, k, gen), probe_columns(be.inputs, k, gen))
        trials = {m for m in kept}
        for m in kept:
            if m.order is Order.BLOCKFMA and m.unit is not None and m.chunk == 0:
                trials.update(Model(m.order, m.acc, m.rounding, m.unit, p)
                              for p in (m.unit.size << i for i in range(16))
                              if PROBE_K <= p < k)
            elif m.order is Order.CHUNKED or (m.order is Order.SEQUENTIAL):
                # a BLAS's K blocking: any multiple of 32 up to 512 (192 on this machine's
                # float32 matmul), and the powers of two beyond
                sizes = {*range(PROBE_K, 513, 32), *(1 << i for i in range(10, 14))}
                trials.update(Model(Order.CHUNKED, m.acc, m.rounding, chunk=p)
                              for p in sizes if p < k)
        kept = [m for m in sorted(trials, key=Model.simplicity) if probe_share(m, be, obs) == 1.0]
    return kept
