"""The exact reference: rounding and two-operand arithmetic in ``fractions.Fraction``.

Written to read like the standards (IEEE 754 §4.3 and §6.3, OCP 8-bit FP and
MX v1.0), one value at a time, with an explicit sign on zero and explicit
infinities and NaN. It imports neither torch nor the fast path it judges.

Rounding a value ``x`` to a format:

1. NaN stays NaN. ±inf is an overflow that is exact (see 5).
2. On an unsigned format a negative nonzero value is out of range: the least value
   (0, or E8M0's 2**-127) under ``saturate``, NaN under ``ieee``.
3. Zero keeps its sign where the format has −0; a format with no zero (E8M0)
   gives its smallest value instead of zero.
4. Otherwise ``|x|`` lies in the binade ``2**e <= |x| < 2**(e+1)``, with ``e``
   found from integer bit lengths. The grid there has the quantum
   ``2**(max(e, emin) - mbits)``; ``lo`` and ``hi = lo + quantum`` bracket
   ``|x|``, and ``f = (|x| - lo) / quantum`` is the fraction of the way to
   ``hi``. The mode picks ``lo`` or ``hi`` from ``f``, the sign and, for ties,
   whether ``lo``'s significand is even.
5. A magnitude beyond the format's largest (``max``, or ``|min|`` for negative
   integers) overflows: ``saturate`` clamps; ``ieee`` gives ±inf where the
   format has it and the mode does not round toward zero, ±max where it does,
   NaN where the format has only NaN, and ±max where it has neither.
6. A nonzero value that rounds to 0 keeps its sign (−0) where −0 exists.

``round_cells`` applies this rule under several (mode, overflow, draw) cells at once, finding
the bracket of step 4 once; ``round_exact`` is it with one cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache

from driftcli.records.formats import NAN, Exact, Format, Kind
from driftcli.records.modes import DEFAULT_SR_BITS, Overflow, Rounding


def binade(mag: Fraction) -> int:
    """``floor(log2(mag))`` for ``mag > 0``, exactly, from integer bit lengths."""
    n, d = mag.numerator, mag.denominator
    e = n.bit_length() - d.bit_length()
    # 2**e <= n / d, in integers
    return e if ((d << e) <= n if e >= 0 else d <= (n << -e)) else e - 1


HALF = Fraction(1, 2)


@lru_cache(maxsize=1 << 20)
def bracket(fmt: Format, mag: Fraction) -> tuple[Fraction, Fraction, Fraction, bool]:
    """The grid neighbours of ``mag > 0``: ``(lo, hi, f, lo_is_odd)``.

    ``lo <= mag < hi`` are adjacent points of the format's grid extended
    without bound above, and ``f = (mag - lo) / (hi - lo)``.
    """
    top = max(binade(mag), fmt.grid_emin)
    mbits = fmt.mbits_at(top)  # a tapered format's width varies by binade
    # mag = n / d and quantum = 2**q: steps = floor(mag / quantum) and f = rem / unit, in
    # integers (Fraction's arithmetic was most of the oracle's time in a verify run)
    q = top - mbits
    n, d = mag.numerator, mag.denominator
    scaled, unit = (n, d << q) if q >= 0 else (n << -q, d)  # mag / quantum = scaled / unit
    steps, rem = divmod(scaled, unit)
    if q >= 0:
        lo, hi = Fraction(steps << q), Fraction((steps + 1) << q)
    else:
        lo, hi = Fraction(steps, 1 << -q), Fraction(steps + 1, 1 << -q)
    f = Fraction(rem, unit)
    if mbits == 0 and fmt.has_zero and not fmt.integer and steps:
        # Format.ties_by_code, and a tapered format's denormals: with no mantissa bits lo's code
        # counts binades, binade - grid_emin + 1 (P = 1: emin = 1 - bias; HiFloat8: 2**-22 is 1)
        return lo, hi, f, (binade(lo) - fmt.grid_emin + 1) % 2 == 1
    return lo, hi, f, steps % 2 == 1


def rounds_away(rounding: Rounding, f: Fraction, lo_is_odd: bool, negative: bool,
                random: int, sr_bits: int) -> bool:
    """Whether the mode moves a magnitude ``f`` of the way past ``lo`` up to ``hi``."""
    if not f:
        return False
    # f against 1/2 as integers, 2·num against den (Fraction's comparisons are slow): +1 above
    past_half = (2 * f.numerator > f.denominator) - (2 * f.numerator < f.denominator)
    match rounding:
        case Rounding.RNE:
            return past_half > 0 or (past_half == 0 and lo_is_odd)
        case Rounding.RNA:
            return past_half >= 0
        case Rounding.RTZ:
            return False
        case Rounding.RUP:
            return not negative
        case Rounding.RDOWN:
            return negative
        case Rounding.SR:
            # floor(f * 2**sr_bits) in integers: f >= 0, and Fraction arithmetic is slow
            return (f.numerator << sr_bits) // f.denominator + random >= 1 << sr_bits


def _overflow(fmt: Format, negative: bool, limit: Fraction, rounding: Rounding,
              overflow: Overflow, exact_inf: bool) -> Exact:
    clamps = overflow is Overflow.SATURATE or (
        not exact_inf and rounding.toward_zero(negative))
    if clamps or not (fmt.has_inf or fmt.has_nan):
        return Exact(Kind.FINITE, negative, limit)
    return Exact(Kind.INF, negative) if fmt.has_inf else NAN


def _zero(fmt: Format, negative: bool) -> Exact:
    if not fmt.has_zero:
        return Exact(Kind.FINITE, False, fmt.smallest_positive)
    return Exact(Kind.FINITE, negative and fmt.has_neg_zero, Fraction(0))


RoundingCell = tuple[Rounding, Overflow, int, int]
"""One way to round: ``(rounding, overflow, random, sr_bits)``, as :func:`round_exact` takes
them (``random`` is the SR draw, below ``2**sr_bits``; other modes ignore both)."""


def round_exact(fmt: Format, x: Exact, rounding: Rounding = Rounding.RNE,
                overflow: Overflow = Overflow.SATURATE, random: int = 0,
                sr_bits: int = DEFAULT_SR_BITS) -> Exact:
    """Round the exact value ``x`` onto ``fmt``; ``random`` is the SR draw, below 2**sr_bits."""
    return round_cells(fmt, x, ((rounding, overflow, random, sr_bits),))[0]


def round_cells(fmt: Format, x: Exact, cells: Sequence[RoundingCell]) -> list[Exact]:
    """:func:`round_exact` of ``x`` under each cell, in order, finding its bracket once.

    The one rule of the module's docstring: :func:`round_exact` is this with one cell.
    """
    if x.kind is Kind.NAN:
        return [NAN] * len(cells)
    limit = fmt.extremes[x.negative]
    if not fmt.signed and x.negative and (x.kind is Kind.INF or x.mag):
        least = Exact(Kind.FINITE, False, Fraction(0) if fmt.has_zero else fmt.smallest_positive)
        return [least if overflow is Overflow.SATURATE or not fmt.has_nan else NAN
                for _, overflow, _, _ in cells]
    if x.kind is Kind.INF:
        return [_overflow(fmt, x.negative, limit, rounding, overflow, exact_inf=True)
                for rounding, overflow, _, _ in cells]
    if not x.mag:
        return [_zero(fmt, x.negative)] * len(cells)
    lo, hi, f, lo_is_odd = bracket(fmt, x.mag)
    # the two candidates, each past the limit (the cell's overflow decides) or one result
    down, up = (None if mag > limit else _zero(fmt, x.negative) if not mag
                else Exact(Kind.FINITE, x.negative, mag) for mag in (lo, hi))
    out = []
    away: dict[tuple[Rounding, int, int], bool] = {}  # both overflow policies ask alike
    for rounding, overflow, random, sr_bits in cells:
        key = (rounding, random, sr_bits)
        if key not in away:
            away[key] = rounds_away(rounding, f, lo_is_odd, x.negative, random, sr_bits)
        picked = up if away[key] else down
        out.append(picked if picked is not None else
                   _overflow(fmt, x.negative, limit, rounding, overflow, exact_inf=False))
    return out


def product(a: Exact, b: Exact) -> Exact:
    """The exact product: the sign is the XOR of the signs, 0·inf is NaN."""
    negative = a.negative != b.negative
    if Kind.NAN in (a.kind, b.kind):
        return NAN
    if Kind.INF in (a.kind, b.kind):
        zero = (a.kind is Kind.FINITE and a.mag == 0) or (b.kind is Kind.FINITE and b.mag == 0)
        return NAN if zero else Exact(Kind.INF, negative)
    return Exact(Kind.FINITE, negative, a.mag * b.mag)


def total(a: Exact, b: Exact, rounding: Rounding = Rounding.RNE) -> Exact:
    """The exact sum, with IEEE 754 §6.3's sign of an exact zero.

    A zero sum of operands with opposite signs (x + (−x), (+0) + (−0)) is +0,
    or −0 when rounding toward −inf; zeros of one sign keep it.
    """
    if Kind.NAN in (a.kind, b.kind):
        return NAN
    if a.kind is Kind.INF and b.kind is Kind.INF:
        return a if a.negative == b.negative else NAN
    if Kind.INF in (a.kind, b.kind):
        return a if a.kind is Kind.INF else b
    value = a.value + b.value
    if value != 0:
        return Exact.of(value)
    if a.negative == b.negative:
        return Exact(Kind.FINITE, a.negative, Fraction(0))
    return Exact(Kind.FINITE, rounding is Rounding.RDOWN, Fraction(0))
