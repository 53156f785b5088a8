"""``cast-diff``: where two casts of the same tensors disagree, element by element.

Every cast given is compared with the first (the baseline): the share of elements whose code
differs, the share whose dequantized float32 value differs (in its bits; NaN equals NaN), the
largest difference in units of the baseline's grid spacing at that element, and each cast's clip
and underflow counts. It answers "does torchao's or Transformer Engine's order of operations
matter on my checkpoint" (docs/cast-diff.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from driftcli.io.tables import column
from driftcli.measures.common import Measure, TensorCastRow, ratio
from driftcli.measures.diffstats import DiffStats
from driftcli.measures.stats import CastStats


@dataclass(frozen=True)
class CastDiffRow(TensorCastRow):
    """One tensor (or all tensors of an input) under one cast, against the baseline cast."""

    TABLE: ClassVar[str] = "cast-diff"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "tensor", "cast", "against")
    HEADLINE: ClassVar[str] = "values_differ"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    against: str = column("The baseline cast (the first --cast), canonical spec")
    values_differ: float | None = column(
        "Share of elements whose dequantized float32 value differs from the baseline's (bits)")
    codes_differ: float | None = column(
        "Share of elements whose code (value on the element grid before the scale) differs")
    n_values_differ: int | None = column("Elements whose dequantized value differs")
    n_codes_differ: int | None = column("Elements whose code differs")
    n_nan_differ: int | None = column("Elements NaN under one of the two casts only")
    max_spacings: float | None = column(
        "Largest |q - q_against| in units of the baseline's grid spacing at that element (the "
        "element format's quantum at the baseline's code, times its scale)")
    clipped: int | None = column("This cast's clipped elements (clip-rate's definition)")
    clipped_against: int | None = column("The baseline's clipped elements")
    clipped_by_rounding: int | None = column(
        "This cast's clips made only by rounding a real scale (clip-rate.md)")
    clipped_by_rounding_against: int | None = column("The baseline's, likewise")
    underflowed: int | None = column("This cast's nonzero elements that came back zero")
    underflowed_against: int | None = column("The baseline's, likewise")


def columns(mine: CastStats, theirs: CastStats, diff: DiffStats) -> dict[str, Any]:
    """The row's own columns from both casts' stats and where they differ."""
    return {"values_differ": ratio(diff.values_differ, diff.compared),
            "codes_differ": ratio(diff.codes_differ, diff.compared),
            "n_values_differ": diff.values_differ, "n_codes_differ": diff.codes_differ,
            "n_nan_differ": diff.nan_differ, "max_spacings": diff.max_spacings,
            "clipped": mine.clipped, "clipped_against": theirs.clipped,
            "clipped_by_rounding": mine.clipped_by_rounding,
            "clipped_by_rounding_against": theirs.clipped_by_rounding,
            "underflowed": mine.underflowed, "underflowed_against": theirs.underflowed}


MEASURE = Measure("cast-diff", CastDiffRow, lambda draws, expected: {}, pair_columns=columns)
