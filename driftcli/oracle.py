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
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import cast

from driftcli.cast import MicroBase, MicroScaling
from driftcli.formats import NAN, Exact, Format, Kind, pow2
from driftcli.modes import DEFAULT_SR_BITS, Overflow, Rounding, ScaleRule, check_rule_table


def binade(mag: Fraction) -> int:
    """``floor(log2(mag))`` for ``mag > 0``, exactly, from integer bit lengths."""
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    return e if pow2(e) <= mag else e - 1


HALF = Fraction(1, 2)


@lru_cache(maxsize=1 << 20)
def bracket(fmt: Format, mag: Fraction) -> tuple[Fraction, Fraction, Fraction, bool]:
    """The grid neighbours of ``mag > 0``: ``(lo, hi, f, lo_is_odd)``.

    ``lo <= mag < hi`` are adjacent points of the format's grid extended
    without bound above, and ``f = (mag - lo) / (hi - lo)``.
    """
    top = max(binade(mag), fmt.grid_emin)
    mbits = fmt.mbits_at(top)  # a tapered format's width varies by binade
    quantum = pow2(top - mbits)
    steps = mag // quantum
    lo = steps * quantum
    if mbits == 0 and fmt.has_zero and not fmt.integer and steps:
        # Format.ties_by_code, and a tapered format's denormals: with no mantissa bits lo's code
        # counts binades, binade - grid_emin + 1 (P = 1: emin = 1 - bias; HiFloat8: 2**-22 is 1)
        return lo, lo + quantum, (mag - lo) / quantum, (binade(lo) - fmt.grid_emin + 1) % 2 == 1
    return lo, lo + quantum, (mag - lo) / quantum, steps % 2 == 1


def rounds_away(rounding: Rounding, f: Fraction, lo_is_odd: bool, negative: bool,
                random: int, sr_bits: int) -> bool:
    """Whether the mode moves a magnitude ``f`` of the way past ``lo`` up to ``hi``."""
    if not f:
        return False
    match rounding:
        case Rounding.RNE:
            return f > HALF or (f == HALF and lo_is_odd)
        case Rounding.RNA:
            return f >= HALF
        case Rounding.RTZ:
            return False
        case Rounding.RUP:
            return not negative
        case Rounding.RDOWN:
            return negative
        case Rounding.SR:
            return int(f * 2**sr_bits) + random >= 2**sr_bits


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


def round_exact(fmt: Format, x: Exact, rounding: Rounding = Rounding.RNE,
                overflow: Overflow = Overflow.SATURATE, random: int = 0,
                sr_bits: int = DEFAULT_SR_BITS) -> Exact:
    """Round the exact value ``x`` onto ``fmt``; ``random`` is the SR draw, below 2**sr_bits."""
    if x.kind is Kind.NAN:
        return NAN
    limit = fmt.extremes[x.negative]
    if not fmt.signed and x.negative and (x.kind is Kind.INF or x.mag):
        if overflow is Overflow.SATURATE or not fmt.has_nan:
            return Exact(Kind.FINITE, False, Fraction(0) if fmt.has_zero else fmt.smallest_positive)
        return NAN
    if x.kind is Kind.INF:
        return _overflow(fmt, x.negative, limit, rounding, overflow, exact_inf=True)
    if not x.mag:
        return _zero(fmt, x.negative)
    lo, hi, f, lo_is_odd = bracket(fmt, x.mag)
    mag = hi if rounds_away(rounding, f, lo_is_odd, x.negative, random, sr_bits) else lo
    if mag > limit:
        return _overflow(fmt, x.negative, limit, rounding, overflow, exact_inf=False)
    if not mag:
        return _zero(fmt, x.negative)
    return Exact(Kind.FINITE, x.negative, mag)


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


# --- block-scaled casts ------------------------------------------------------------------------
#
# The reference for driftcli.scaling: the scale chosen by the rule from the exact amax, each
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
}
"""Each scale rule's exact implementation: an :data:`ExponentRule` for a power-of-two rule, a
:data:`DivisorRule` for any other (see :class:`~driftcli.modes.ScaleRule`)."""
check_rule_table(EXACT_RULES, "driftcli.oracle.EXACT_RULES")


def pow2_scale_exponent(amax: Fraction, elem: Format, rule: ScaleRule, headroom: int,
                        low: int, high: int) -> tuple[int, bool]:
    """The exponent ``k`` of a power-of-two rule's scale, ``headroom`` binades added, clamped to
    ``[low, high]``; and whether it clamped. An all-zero block gets ``low``."""
    if amax == 0:
        return low, False
    k = cast(ExponentRule, EXACT_RULES[rule])(amax, elem) + headroom
    return min(max(k, low), high), not low <= k <= high


def cast_block(values: list[Exact], elem: Format, scale_format: Format, rule: ScaleRule,
               headroom: int, blocked: bool, float32: Format,
               rounding: Rounding = Rounding.RNE, overflow: Overflow = Overflow.SATURATE,
               randoms: list[int] | None = None, sr_bits: int = DEFAULT_SR_BITS,
               tensor_amax: Fraction | None = None,
               scale_only: bool = False) -> tuple[list[Exact], Exact, bool]:
    """One block (or tensor, or channel) cast exactly: ``(dequantized, scale, clamped)``.

    The scale comes from ``rule``'s entry in :data:`EXACT_RULES`; ``blocked`` says a
    NaN or inf member makes the whole block NaN (block and tile scalings);
    ``tensor_amax`` is the whole tensor's amax (default: this block's);
    ``scale_only`` skips the elements.
    """
    randoms = randoms or [0] * len(values)
    finite = [v.mag for v in values if v.kind is Kind.FINITE]
    if blocked and len(finite) < len(values):
        return [NAN] * len(values), NAN, False
    amax = max(finite, default=Fraction(0))

    def cast_element(v: Exact, r: int) -> Exact:
        return round_exact(elem, v, rounding, overflow, r, sr_bits)

    if rule.power_of_two:
        low = binade(scale_format.smallest_positive)
        k, clamped = pow2_scale_exponent(amax, elem, rule, headroom, low, scale_format.emax)
        scale = pow2(k)
        if scale_only:
            return [], Exact.of(scale), clamped
        # the dequantized value, stored as a float32 (2**128 overflows to inf)
        return ([fl32(times(cast_element(times(v, 1 / scale), r), scale), float32)
                 for v, r in zip(values, randoms, strict=True)], Exact.of(scale), clamped)
    tensor_amax = amax if tensor_amax is None else tensor_amax  # a one-block tensor
    divisor, clamped = cast(DivisorRule, EXACT_RULES[rule])(amax, tensor_amax, elem,
                                                             scale_format, float32)
    clamped = clamped and amax != 0
    if scale_only:
        return [], Exact.of(divisor), clamped
    return ([fl32(times(cast_element(fl32(times(v, 1 / divisor), float32), r), divisor),
                  float32) for v, r in zip(values, randoms, strict=True)],
            Exact.of(divisor), clamped)


def micro_first_scale(amax: Fraction, elem: Format, micro: MicroScaling,
                      bfloat16: Format) -> tuple[Fraction, Fraction, bool]:
    """A multi-level block's first-level scale ``s``, the multiplier ``r`` its elements meet
    and whether ``s`` was clamped, from the block's finite amax (docs/formats.md#hifloat4)."""
    fmt = micro.scale_format
    if micro.base is MicroBase.POW2:
        low = binade(fmt.smallest_positive)
        free = binade(amax) - elem.emax - micro.steps if amax else low
        k = min(max(free, low), fmt.emax)
        return pow2(k), pow2(-k), k != free
    near = Rounding.RNE
    c = round_exact(bfloat16, Exact.of(1 / (elem.max * pow2(micro.steps))), near).mag
    raw = round_exact(bfloat16, Exact.of(amax * c), near).mag
    s, clamped = into_scale_format(raw, fmt, near)
    return s, round_exact(bfloat16, Exact.of(1 / s), near).mag, clamped and amax != 0


def micro_exponents(mags: list[Fraction], elem: Format, micro: MicroScaling,
                    r: Fraction) -> list[int]:
    """Each element's total micro-exponent: level by level, outermost first, a run's ``e`` is
    the least in ``0..top`` with ``amax_run · r / 2**(outer e) < 2**(emax_elem + 1 + inner
    range + e)``: the run fits the element's binades with every inner level at its top."""
    total = [0] * len(mags)
    inner = micro.steps
    for level in micro.levels:
        inner -= level.top
        for start in range(0, len(mags), level.size):
            run = range(start, min(start + level.size, len(mags)))
            v = max(mags[i] for i in run) * r / pow2(total[start])
            e = min(max(binade(v) - elem.emax - inner, 0), level.top) if v else 0
            for i in run:
                total[i] += e
    return total


def cast_micro_block(values: list[Exact], elem: Format, micro: MicroScaling, float32: Format,
                     bfloat16: Format, rounding: Rounding = Rounding.RNA,
                     overflow: Overflow = Overflow.SATURATE, randoms: list[int] | None = None,
                     sr_bits: int = DEFAULT_SR_BITS) -> tuple[list[Exact], Exact, bool]:
    """One multi-level block cast exactly: ``(dequantized, first-level scale, clamped)``.

    A NaN or inf member makes the block NaN. Otherwise each element ``x`` with total
    micro-exponent ``E`` becomes ``fl32(round(x · r / 2**E) · 2**E · s)``
    (:func:`micro_first_scale`, :func:`micro_exponents`)."""
    randoms = randoms or [0] * len(values)
    if any(v.kind is not Kind.FINITE for v in values):
        return [NAN] * len(values), NAN, False
    mags = [v.mag for v in values]
    s, r, clamped = micro_first_scale(max(mags, default=Fraction(0)), elem, micro, bfloat16)
    out = []
    for v, e, rnd in zip(values, micro_exponents(mags, elem, micro, r), randoms, strict=True):
        code = round_exact(elem, times(v, r / pow2(e)), rounding, overflow, rnd, sr_bits)
        out.append(fl32(times(code, pow2(e) * s), float32))
    return out, Exact.of(s), clamped


# --- dot products ---------------------------------------------------------------------------
#
# The reference for driftcli.arith.matmul: one output element of a simulated matmul, from the
# exact operand values (the casts already applied), the exact products, and an accumulator that
# rounds after every addition in a stated order. Every step is oracle.total followed by
# round_exact onto the accumulator; nothing else is ever rounded.

ZERO = Exact(Kind.FINITE, False, Fraction(0))
"""+0: the value of a cleared accumulator."""


def products(a: list[Exact], b: list[Exact]) -> list[Exact]:
    """The exact products ``a[k] * b[k]``, k = 0..K-1 (sign of zero and specials as IEEE)."""
    return [product(x, y) for x, y in zip(a, b, strict=True)]


def exact_sum(terms: list[Exact]) -> Exact:
    """The exact sum of ``terms``, with +0 for a zero sum (a cleared register plus the terms);
    ±inf and NaN as IEEE (inf + -inf is NaN), whatever the order."""
    s = ZERO
    for t in terms:
        s = total(s, t, Rounding.RNE)
    return s


def block_terms(a_elements: list[Exact], b_elements: list[Exact], a_scales: list[Exact],
                b_scales: list[Exact], block: int) -> list[Exact]:
    """Scale application ``block``: one term per block of ``block`` consecutive k, the exact dot
    product of the blocks' elements (in element units, +0 when it is zero) times the two scales.

    The last block may be shorter. ``a_scales[j]`` and ``b_scales[j]`` are block ``j``'s scales.
    """
    terms = []
    for j, (sa, sb) in enumerate(zip(a_scales, b_scales, strict=True)):
        ks = slice(j * block, (j + 1) * block)
        dot = exact_sum(products(a_elements[ks], b_elements[ks]))
        terms.append(product(product(dot, sa), sb) if dot.kind is not Kind.FINITE or dot.mag
                     else ZERO if Kind.NAN not in (sa.kind, sb.kind) else NAN)
    return terms


def accumulate_step(acc: Exact, term: Exact, fmt: Format, rounding: Rounding) -> Exact:
    """One accumulator step: the exact ``acc + term`` rounded once onto ``fmt``.

    An accumulator overflows as IEEE 754 arithmetic does (to ±inf, to ±max under ``rtz``).
    """
    return round_exact(fmt, total(acc, term, rounding), rounding, Overflow.IEEE)


def sequential(terms: list[Exact], fmt: Format, rounding: Rounding) -> Exact:
    """``acc = +0; for k in 0..K-1: acc = round(acc + t[k])``."""
    acc = ZERO
    for t in terms:
        acc = accumulate_step(acc, t, fmt, rounding)
    return acc


def pairwise(terms: list[Exact], fmt: Format, rounding: Rounding) -> Exact:
    """The pairwise tree: level by level, adjacent pairs ``(t0 + t1), (t2 + t3), …`` are each
    rounded once; an odd last element is carried to the next level unchanged; when one value
    is left it is added to a cleared accumulator (+0) and rounded.

    K = 5: ``((t0 + t1) + (t2 + t3)) + t4``; K = 6: ``((t0 + t1) + (t2 + t3)) + (t4 + t5)``.
    """
    level = list(terms)
    while len(level) > 1:
        pairs = [accumulate_step(level[i], level[i + 1], fmt, rounding)
                 for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2:]
    return accumulate_step(ZERO, level[0], fmt, rounding) if level else ZERO


def chunked(terms: list[Exact], chunk: int, fmt: Format, rounding: Rounding,
            master: Format) -> Exact:
    """Promotion every ``chunk`` terms: each run of ``chunk`` consecutive terms is summed
    sequentially in ``fmt`` from +0; each run's result is then added, in order, into a master
    sum in ``master`` (float32) rounded to nearest even, starting from +0."""
    total_ = ZERO
    for start in range(0, len(terms), chunk):
        part = sequential(terms[start:start + chunk], fmt, rounding)
        total_ = accumulate_step(total_, part, master, Rounding.RNE)
    return total_


def dot(terms: list[Exact], order: str, fmt: Format, rounding: Rounding, chunk: int = 0,
        master: Format | None = None) -> Exact:
    """The accumulated sum of ``terms`` in ``order``: ``sequential``, ``pairwise`` or
    ``chunked`` (with ``chunk`` and the ``master`` format). ``order`` is a
    :class:`driftcli.arith.Order` value; ``native`` has no reference of its own (see
    docs/arithmetic.md) and is rejected here."""
    if order == "sequential":
        return sequential(terms, fmt, rounding)
    if order == "pairwise":
        return pairwise(terms, fmt, rounding)
    if order == "chunked" and chunk >= 1 and master is not None:
        return chunked(terms, chunk, fmt, rounding, master)
    raise ValueError(f"the oracle has no order {order!r} (chunk {chunk}, master {master})")
