"""``clip-rate``: how much of a tensor lies beyond the element format's range after scaling.

x the finite input elements, s_i the scale seen by element i, M the element format's
largest finite value: clip_rate = #{|x_i / s_i| > M} / n_finite; clipped_blocks is the
share of scale groups with at least one clip; clip_mass = Σ_clipped (|x_i| - M·s_i) /
Σ|x_i|, the share of the tensor's absolute mass cut off. clipped_by_rounding counts the clipped
elements whose exact quotient by the rule's real scale amax / M is at most M (every clip of a
rule whose exact scale covers amax: ceil, ceil-amax, amax, amax-rne, amax-up, two-level; none of
floor's and even's), and exact_clip_rate the others: what the rule itself cuts, in exact
arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from driftcli.io.tables import column
from driftcli.measures.common import Measure, TensorCastRow, ratio
from driftcli.measures.stats import CastStats


@dataclass(frozen=True)
class ClipRateRow(TensorCastRow):
    """One tensor (or all tensors of an input) under one cast: what clipped."""

    TABLE: ClassVar[str] = "clip-rate"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "tensor", "cast")
    HEADLINE: ClassVar[str] = "clip_rate"
    HIGHER_IS_WORSE: ClassVar[bool] = True
    SHOWN: ClassVar[tuple[str, ...]] = ("exact_clip_rate",)
    """Columns of the all-tensors row shown beside the headline in summaries and reports: the
    headline counts saturation the scale's rounding alone causes, this one what the rule cuts."""

    clip_rate: float | None = column("Clipped elements / finite elements: |x/s| > max finite "
                                     "with the scale as rounded (see exact_clip_rate)")
    clipped: int | None = column("Finite elements with |x/s| above the element format's max")
    n_blocks: int | None = column("Scale groups (blocks, tiles, channels; 1 per tensor scale)")
    clipped_blocks: float | None = column("Share of scale groups holding at least one clip")
    clip_mass: float | None = column("Σ over clipped of (|x| - max·s) / Σ|x|: mass cut off")
    clipped_by_rounding: int | None = column(
        "Of the clipped, those whose exact quotient by the rule's real scale amax/max is at most "
        "max: saturated only through the rounding of the scale (every clip of ceil, amax and "
        "two-level rules, none of floor's)")
    exact_clip_rate: float | None = column(
        "(clipped - clipped_by_rounding) / finite elements: what the rule clips in exact "
        "arithmetic")


def columns(draws: tuple[CastStats, ...], expected: CastStats | None) -> dict[str, Any]:
    """Clipping does not depend on the rounding draw: the first draw's counts."""
    st = draws[0]
    return {"clip_rate": ratio(st.clipped, st.numel - st.nonfinite), "clipped": st.clipped,
            "n_blocks": st.groups, "clipped_blocks": ratio(st.clipped_groups, st.groups),
            "clip_mass": ratio(st.clip_excess, st.abs_sum),
            "clipped_by_rounding": st.clipped_by_rounding,
            "exact_clip_rate": ratio(st.clipped - st.clipped_by_rounding, st.numel - st.nonfinite)}


MEASURE = Measure("clip-rate", ClipRateRow, columns, rounded=False)
