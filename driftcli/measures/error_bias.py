"""``error-bias``: the size of the cast error, separately from which way it points.

e = q - x over elements where x and q are finite: rel_error = ‖e‖/‖x‖; sqnr_db =
20·log10(‖x‖/‖e‖); bias = ⟨e, x⟩/‖x‖² (signed: how far the cast shrinks the tensor along
itself; clipping makes it negative); alignment = ⟨e, x⟩/(‖e‖‖x‖) (near 0: the error points
nowhere in particular); mean_error = Σe/Σ|x|. A finite element whose cast is not finite (a
NaN block, ieee overflow to inf) is *lost*: it cannot enter the sums, so rel_error is inf and
sqnr_db -inf wherever ``n_lost`` > 0 (as accum-error's rel_error is inf where C overflowed),
and the tensor ranks worst instead of best; bias, alignment and mean_error stay over the
elements kept, their direction still worth reading. For stochastic rounding the first five are
the means over ``draws`` independent draws, and the ``expected_`` columns are the same
metrics of the mean of the draws, so the bias of the expected cast is separated from the
per-draw error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean
from typing import Any, ClassVar

from driftcli.io.tables import column
from driftcli.measures.common import Measure, TensorCastRow, ratio
from driftcli.measures.stats import CastStats

METRICS = ("rel_error", "sqnr_db", "bias", "alignment", "mean_error")


@dataclass(frozen=True)
class ErrorBiasRow(TensorCastRow):
    """One tensor (or all tensors of an input) under one cast: error size and direction."""

    TABLE: ClassVar[str] = "error-bias"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "tensor", "cast")
    HEADLINE: ClassVar[str] = "rel_error"
    HIGHER_IS_WORSE: ClassVar[bool] = True
    SHOWN: ClassVar[tuple[str, ...]] = ("bias", "alignment", "n_lost")
    """Columns of the all-tensors row shown beside the headline in summaries and reports."""

    rel_error: float | None = column("‖q - x‖ / ‖x‖ (mean over draws for sr); inf when an "
                                     "element was lost (n_lost > 0)")
    sqnr_db: float | None = column("20·log10(‖x‖ / ‖q - x‖) in dB; inf for an exact cast, -inf "
                                   "when an element was lost")
    bias: float | None = column("⟨q - x, x⟩ / ‖x‖²: signed shrink along x (negative: the cast "
                                "makes the tensor smaller)")
    alignment: float | None = column("⟨q - x, x⟩ / (‖q - x‖‖x‖): cosine between error and "
                                     "signal; null for an exact cast")
    mean_error: float | None = column("Σ(q - x) / Σ|x|")
    n_lost: int | None = column("Finite elements whose cast is not finite (a NaN block, ieee "
                                "overflow); left out of the sums")
    draws: int | None = column("Independent draws (1 unless the cast rounds stochastically)")
    expected_rel_error: float | None = column("sr: rel_error of the mean of the draws")
    expected_sqnr_db: float | None = column("sr: sqnr_db of the mean of the draws")
    expected_bias: float | None = column("sr: bias of the mean of the draws")
    expected_alignment: float | None = column("sr: alignment of the mean of the draws")
    expected_mean_error: float | None = column("sr: mean_error of the mean of the draws")


def metrics(st: CastStats) -> dict[str, float | None]:
    """The five error metrics from one set of sums; an element lost to inf or NaN makes the
    error infinite (it is not in the sums, and leaving it out would read as no error)."""
    if st.ee is None or st.xx is None or st.ex is None:
        raise ValueError("error metrics need the rounded sums (cast_stats(rounded=True))")
    norms = math.sqrt(st.ee * st.xx)
    lost = bool(st.lost)
    rel = math.inf if lost else math.sqrt(st.ee / st.xx) if st.xx else None
    sqnr = -math.inf if lost else (
        (10 * math.log10(st.xx / st.ee) if st.ee else math.inf) if st.xx else None)
    return {
        "rel_error": rel,
        "sqnr_db": sqnr,
        "bias": ratio(st.ex, st.xx),
        "alignment": ratio(st.ex, norms),
        "mean_error": ratio(st.e_sum, st.abs_sum),
    }


def _mean(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else fmean(v for v in values if v is not None)


def columns(draws: tuple[CastStats, ...], expected: CastStats | None) -> dict[str, Any]:
    """Per-draw metrics averaged over draws, and those of the expected cast for sr."""
    each = [metrics(st) for st in draws]
    out: dict[str, Any] = {m: _mean([e[m] for e in each]) for m in METRICS}
    exp = metrics(expected) if expected is not None else dict.fromkeys(METRICS)
    out.update({f"expected_{m}": exp[m] for m in METRICS})
    return {**out, "n_lost": draws[0].lost, "draws": len(draws)}


MEASURE = Measure("error-bias", ErrorBiasRow, columns)
