"""The exact twin of :mod:`driftcli.casts.scaling`: every scale rule's exact implementation
(:data:`EXACT_RULES`, checked on import to cover every :class:`ScaleRule`), a real scale
rounded into its scale format, and a power-of-two rule's exponent with its headroom and
clamp. Written in ``fractions.Fraction`` one block at a time; it imports neither torch
nor the fast path it judges. Real-valued scales are computed with the float32
operations the recipe prescribes, each rounded to nearest even by :func:`fl32`.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import cast

from driftcli.oracle.rounding import HALF, binade, round_exact
from driftcli.records.formats import Exact, Format, Kind, pow2
from driftcli.records.modes import Overflow, Rounding, ScaleRule, check_rule_table

# --- block-scaled casts ------------------------------------------------------------------------
#
# The reference for driftcli.casts.scaling: the scale chosen by the rule from the exact amax, each
# element rounded exactly. Real-valued scales are computed with the same float32 operations the
# recipe prescribes, each one rounded to nearest even here by round_exact onto float32.


def fl32(x: Exact, float32: Format) -> Exact:
    """One IEEE float32 operation's rounding of an exact result (nearest even, overflow to inf)."""
    return round_exact(float32, x, Rounding.RNE, Overflow.IEEE)


def times(x: Exact, factor: Fraction) -> Exact:
    """``x * factor`` for a positive rational factor, exactly (specials and signs kept)."""
    return Exact(x.kind, x.negative, x.mag * factor) if x.kind is Kind.FINITE else x


def into_scale_format(raw: Fraction, fmt: Format,
                      mode: Rounding | None) -> tuple[Fraction, bool]:
    """A real scale ``raw > 0`` rounded into the scale format (None: kept), and whether it was
    clamped: it overflowed the format under that rounding, or lay below its smallest value."""
    if mode is None:
        over, scale = raw > fmt.max, raw
    else:
        rounded = round_exact(fmt, Exact.of(raw), mode, Overflow.IEEE)
        over = rounded.kind is not Kind.FINITE if fmt.has_inf or fmt.has_nan else raw > fmt.max
        scale = rounded.mag
    low = raw < fmt.smallest_positive
    return (fmt.max if over else max(scale, fmt.smallest_positive)), over or low


ExponentRule = Callable[[Fraction, Format], int]
"""A power-of-two rule's exact implementation: the exponent ``k`` of the scale ``2**k`` of a
block of amax > 0 with this element format, before the headroom and the clamp to the scale
format that :func:`pow2_scale_exponent` adds for every such rule."""

DivisorRule = Callable[[Fraction, Fraction, Format, Format, Format], tuple[Fraction, bool]]
"""Any other rule's: from a block's amax (0 included), the tensor's amax, the element format,
the scale format and float32, the divisor of the block's elements and whether its scale was
clamped (ignored for an all-zero block)."""


def floor_exponent(amax: Fraction, elem: Format) -> int:
    """``floor``: ``floor(log2 amax) - emax_elem`` (OCP MX v1.0)."""
    return binade(amax) - elem.emax


def ceil_exponent(amax: Fraction, elem: Format) -> int:
    """``ceil``: the smallest ``k`` with ``max_elem * 2**k >= amax``."""
    k = floor_exponent(amax, elem)
    while elem.max * pow2(k) < amax:
        k += 1
    while elem.max * pow2(k - 1) >= amax:
        k -= 1
    return k


def even_exponent(amax: Fraction, elem: Format) -> int:
    """``even``: ``floor`` of amax rounded (ties away) to the element's mantissa width."""
    quantum = pow2(binade(amax) - elem.mbits)
    return floor_exponent((amax / quantum + HALF).__floor__() * quantum, elem)


def ceil_amax_exponent(amax: Fraction, elem: Format) -> int:
    """``ceil-amax``: ``ceil(log2 amax) - emax_elem`` (amax rounded up to a power of two)."""
    e = binade(amax)
    return e - elem.emax + (amax > pow2(e))


def even_e2m1_exponent(amax: Fraction, elem: Format) -> int:
    """``even-e2m1``: ``floor`` of amax rounded (ties away) to one mantissa bit: a binade up
    where its significand is at least 7/4."""
    e = binade(amax)
    return e - elem.emax + (amax >= Fraction(7, 4) * pow2(e))


def real_rule(mode: Rounding | None) -> DivisorRule:
    """The rule ``fl32(amax / max_elem)`` rounded into the scale format by ``mode`` (None: kept
    as computed); an all-zero block gets the scale format's smallest value."""

    def divisor(amax: Fraction, tensor_amax: Fraction, elem: Format, scale_format: Format,
                float32: Format) -> tuple[Fraction, bool]:
        raw = fl32(times(Exact.of(amax), 1 / elem.max), float32).mag
        scale, clamped = into_scale_format(raw, scale_format, mode)
        return (scale if amax else scale_format.smallest_positive), clamped

    return divisor


def two_level_divisor(amax: Fraction, tensor_amax: Fraction, elem: Format,
                      scale_format: Format, float32: Format) -> tuple[Fraction, bool]:
    """``two-level`` (NVFP4): the float32 tensor scale ``S = fl32(tensor_amax / fl32(Ms *
    max_elem))`` (at least float32's smallest normal; 1 for an all-zero tensor), the block
    scale ``fl32(fl32(amax / max_elem) / S)`` rounded to nearest into the scale format, and the
    divisor ``fl32(block scale * S)``."""
    if tensor_amax == 0:
        tensor_scale = Fraction(1)
    else:
        denominator = fl32(Exact.of(scale_format.max * elem.max), float32).mag
        tensor_scale = max(fl32(Exact.of(tensor_amax / denominator), float32).mag,
                           float32.smallest_normal)
    raw = fl32(times(fl32(times(Exact.of(amax), 1 / elem.max), float32), 1 / tensor_scale),
               float32).mag
    block_scale, clamped = into_scale_format(raw, scale_format, Rounding.RNE)
    if not amax:
        block_scale = scale_format.smallest_positive
    return fl32(Exact.of(block_scale * tensor_scale), float32).mag, clamped


EXACT_RULES: dict[ScaleRule, ExponentRule | DivisorRule] = {
    ScaleRule.FLOOR: floor_exponent,
    ScaleRule.CEIL: ceil_exponent,
    ScaleRule.EVEN: even_exponent,
    ScaleRule.AMAX: real_rule(ScaleRule.AMAX.rounding),
    ScaleRule.AMAX_RNE: real_rule(ScaleRule.AMAX_RNE.rounding),
    ScaleRule.AMAX_UP: real_rule(ScaleRule.AMAX_UP.rounding),
    ScaleRule.TWO_LEVEL: two_level_divisor,
    ScaleRule.CEIL_AMAX: ceil_amax_exponent,
    ScaleRule.EVEN_E2M1: even_e2m1_exponent,
}
"""Each scale rule's exact implementation: an :data:`ExponentRule` for a power-of-two rule, a
:data:`DivisorRule` for any other (see :class:`~driftcli.records.modes.ScaleRule`)."""
check_rule_table(EXACT_RULES, "driftcli.oracle.scaling.EXACT_RULES")


def pow2_scale_exponent(amax: Fraction, elem: Format, rule: ScaleRule, headroom: int,
                        low: int, high: int) -> tuple[int, bool]:
    """The exponent ``k`` of a power-of-two rule's scale, ``headroom`` binades added, clamped to
    ``[low, high]``; and whether it clamped. An all-zero block gets ``low``."""
    if amax == 0:
        return low, False
    k = cast(ExponentRule, EXACT_RULES[rule])(amax, elem) + headroom
    return min(max(k, low), high), not low <= k <= high
