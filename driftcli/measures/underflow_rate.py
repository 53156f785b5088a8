"""``underflow-rate``: how much of a tensor flushes to zero or lands in the subnormals.

underflow_rate = #{x_i ≠ 0, q_i = 0} / #{x_i ≠ 0} (zeros that were already zero are not
underflow); subnormal_rate = #{q_i ≠ 0, |q_i / s_i| < smallest normal} / #{x_i ≠ 0};
scale_clamped counts scale groups whose scale fell outside the scale format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from driftcli.io.tables import column
from driftcli.measures.common import Measure, TensorCastRow, ratio
from driftcli.measures.stats import CastStats


@dataclass(frozen=True)
class UnderflowRateRow(TensorCastRow):
    """One tensor (or all tensors of an input) under one cast: what vanished."""

    TABLE: ClassVar[str] = "underflow-rate"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "tensor", "cast")
    HEADLINE: ClassVar[str] = "underflow_rate"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    underflow_rate: float | None = column("Nonzero finite elements cast to zero / nonzero "
                                          "finite elements")
    underflowed: int | None = column("Nonzero finite elements cast to zero")
    n_nonzero: int | None = column("Nonzero finite input elements")
    subnormal_rate: float | None = column("Elements cast to a subnormal of the element format "
                                          "/ nonzero finite elements")
    subnormal: int | None = column("Elements cast to a nonzero value below the smallest normal "
                                   "(after removing the scale)")
    n_blocks: int | None = column("Scale groups (blocks, tiles, channels; 1 per tensor scale)")
    scale_clamped: int | None = column("Scale groups whose scale fell outside the scale format "
                                       "and was clamped")


def columns(draws: tuple[CastStats, ...], expected: CastStats | None) -> dict[str, Any]:
    """Stochastic casts: the counts of the first draw (each draw is one possible cast)."""
    st = draws[0]
    return {"underflow_rate": ratio(st.underflowed, st.nonzero), "underflowed": st.underflowed,
            "n_nonzero": st.nonzero, "subnormal_rate": ratio(st.subnormal, st.nonzero),
            "subnormal": st.subnormal, "n_blocks": st.groups, "scale_clamped": st.scale_clamped}


MEASURE = Measure("underflow-rate", UnderflowRateRow, columns)
