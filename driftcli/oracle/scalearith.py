"""The exact reference for scale arithmetic: a cast's op sequence evaluated in exact rationals,
every float32 operation (and float64 one, for ``prec=f64``) rounded exactly, IEEE specials
included. It judges :mod:`driftcli.casts.scalearith` (verify-formats' ``recipes`` check) and reads
like :class:`~driftcli.records.cast.ScaleArithmetic`'s settings, one step at a time. It imports
neither
torch nor the fast path.

Each float operation is :func:`op`: the exact result of two operands (a product, a quotient,
with IEEE 754's signs of zero, infinities and NaN) rounded once to nearest even. A float32
``log2`` is modelled as correctly rounded (:func:`log2_f32`, computed to 200 bits), the rounding
the implementations' libraries aim for; an amax of inf read for its bits (a power-of-two rule)
is 2**128, as its exponent field says.
"""

from __future__ import annotations

import decimal
from collections.abc import Callable
from fractions import Fraction
from typing import cast

from driftcli.oracle.rounding import binade, product, round_exact
from driftcli.oracle.scaling import pow2_scale_exponent
from driftcli.records.cast import Scaling
from driftcli.records.formats import FORMATS, NAN, Exact, Format, Kind, pow2
from driftcli.records.modes import (
    AmaxPolicy,
    ElementOp,
    Guard,
    Overflow,
    Pow2,
    Precision,
    Rounding,
    ScaleOp,
    ScaleRule,
    SmallestRcp,
    TwoLevelOrder,
)

F32 = FORMATS["float32"]
E4M3 = FORMATS["float8_e4m3fn"]
ZERO, ONE = Exact.of(0), Exact.of(1)
INF = Exact(Kind.INF)


def fl(x: Exact, precision: Precision = Precision.F32) -> Exact:
    """One float operation's rounding of an exact result: to float32, or to float64 (Python's
    int / int division is correctly rounded), nearest even, overflow to inf."""
    if precision is Precision.F32 or x.kind is not Kind.FINITE:
        return round_exact(F32, x, Rounding.RNE, Overflow.IEEE)
    try:
        v = Fraction(x.mag.numerator / x.mag.denominator)
    except OverflowError:
        return Exact(Kind.INF, x.negative)
    return Exact(Kind.FINITE, x.negative, v)


def _quotient(a: Exact, b: Exact) -> Exact:
    negative = a.negative != b.negative
    if Kind.NAN in (a.kind, b.kind) or (a.kind is b.kind is Kind.INF):
        return NAN
    if a.kind is Kind.INF:
        return Exact(Kind.INF, negative)
    if b.kind is Kind.INF:
        return Exact(Kind.FINITE, negative, Fraction(0))
    if b.mag == 0:
        return NAN if a.mag == 0 else Exact(Kind.INF, negative)
    return Exact(Kind.FINITE, negative, a.mag / b.mag)


def div(a: Exact, b: Exact, precision: Precision = Precision.F32) -> Exact:
    """``fl(a / b)``."""
    return fl(_quotient(a, b), precision)


def mul(a: Exact, b: Exact, precision: Precision = Precision.F32) -> Exact:
    """``fl(a · b)``."""
    return fl(product(a, b), precision)


def elementwise(x: Exact, a: Exact, op: ElementOp) -> Exact:
    """``fl(x / a)`` or ``fl(x · a)``."""
    return div(x, a) if op is ElementOp.DIV else mul(x, a)


def undo(q: Exact, u: Exact, op: ElementOp) -> Exact:
    """``fl(q · u)`` or ``fl(q / u)``."""
    return mul(q, u) if op is ElementOp.MUL else div(q, u)


def nan(x: Exact) -> bool:
    return x.kind is Kind.NAN


def finite_positive(x: Exact) -> bool:
    return x.kind is Kind.FINITE and x.mag > 0 and not x.negative


def at_least(x: Exact, low: Exact) -> Exact:
    """``torch.clamp(x, min=low)``: NaN stays NaN."""
    if nan(x) or nan(low):
        return NAN
    return low if less(x, low) else x


def at_most(x: Exact, high: Exact) -> Exact:
    """``torch.clamp(x, max=high)`` / ``fminf`` of a non-NaN pair."""
    if nan(x):
        return NAN
    return high if less(high, x) else x


def less(a: Exact, b: Exact) -> bool:
    def key(v: Exact) -> Fraction | float:
        if v.kind is Kind.INF:
            return float("-inf") if v.negative else float("inf")
        return v.value
    return key(a) < key(b)


def of(value: float) -> Exact:
    """A Python float's exact value (rounded to float32 first, as torch does with a scalar
    that meets a float32 tensor)."""
    return round_exact(F32, Exact.of(Fraction(value)), Rounding.RNE, Overflow.IEEE)


def of64(value: float) -> Exact:
    """A Python float's exact (float64) value."""
    return Exact.of(Fraction(value))


def amax_of(values: list[Exact], policy: AmaxPolicy) -> Exact:
    """A group's amax as ``policy`` reads it (see :class:`~driftcli.records.modes.AmaxPolicy`)."""
    if policy is AmaxPolicy.IEEE and any(nan(v) for v in values):
        return NAN
    if policy is not AmaxPolicy.FINITE and any(v.kind is Kind.INF for v in values):
        return INF
    return Exact.of(max((v.mag for v in values if v.kind is Kind.FINITE), default=Fraction(0)))


_LOG2_CONTEXT = decimal.Context(prec=70)


def log2_f32(x: Exact) -> Exact:
    """A float32's ``log2``, correctly rounded: -inf for 0, inf for inf, NaN for NaN."""
    if nan(x) or (x.negative and not (x.kind is Kind.FINITE and x.mag == 0)):
        return NAN
    if x.kind is Kind.INF:
        return INF
    if x.mag == 0:
        return Exact(Kind.INF, True)
    e = binade(x.mag)
    if x.mag == pow2(e):
        return Exact.of(e)
    m = decimal.Decimal(x.mag.numerator) / decimal.Decimal(x.mag.denominator)
    with decimal.localcontext(_LOG2_CONTEXT):
        value = m.ln() / decimal.Decimal(2).ln()
    # 200+ bits: a transcendental is never within them of a float32 rounding boundary
    return fl(Exact.of(Fraction(value)))


def _ceil(x: Exact) -> int | None:
    """``ceil`` of a float as an int (None for NaN; ±inf as ±2048, beyond every clamp)."""
    if nan(x):
        return None
    if x.kind is Kind.INF:
        return -2048 if x.negative else 2048
    return -((-x.value).__floor__())


def _floor(x: Exact) -> int | None:
    if nan(x):
        return None
    if x.kind is Kind.INF:
        return -2048 if x.negative else 2048
    return x.value.__floor__()


def exp2_f32(k: int) -> Exact:
    """``exp2`` of an integer in float32: ``2**k``, 0 below 2**-149, inf above 2**127."""
    if k > 127:
        return INF
    return Exact.of(pow2(k)) if k >= -149 else ZERO


def pow2_scales(amax: Exact, elem: Format, scaling: Scaling) -> tuple[Exact, ElementOp, Exact]:
    a = scaling.arithmetic
    fmt = cast(Format, scaling.scale_format)
    low, high = binade(fmt.smallest_positive), fmt.emax
    if nan(amax):
        return NAN, a.apply, NAN
    if a.pow2 is Pow2.BITS:
        mag = pow2(128) if amax.kind is Kind.INF else amax.mag  # inf's exponent field
        k, _ = pow2_scale_exponent(mag, elem, cast(ScaleRule, scaling.rule), scaling.headroom,
                                   low, high)
    else:
        big_m = Exact.of(elem.max)
        q = div(amax, big_m) if a.scale is ScaleOp.DIV else mul(amax, div(ONE, big_m))
        if a.pow2 is Pow2.RP:  # the smallest k with 2**k >= q
            if q.kind is Kind.INF:
                raw = high + 1
            elif q.mag == 0:
                raw = low
            else:
                e = binade(q.mag)
                raw = e + (q.mag > pow2(e))
        else:
            raw = cast(int, _ceil(log2_f32(q)))
        k = min(max(raw, low), high)
    scale = Exact.of(pow2(k))
    if a.apply is ElementOp.DIV:
        apply = at_least(scale, of(a.divmin)) if a.divmin else scale
    else:
        apply = ONE if a.rcpmin is SmallestRcp.ONE and k == low else Exact.of(pow2(-k))
    return apply, a.apply, scale


def real_scales(amax: Exact, elem: Format,
          scaling: Scaling) -> tuple[Exact, ElementOp, Exact, ElementOp]:
    a = scaling.arithmetic
    fmt = cast(Format, scaling.scale_format)
    p = a.prec
    w = amax  # float32 amax is exact in float64
    if a.eps:
        w = at_least(w, of64(a.eps) if p is Precision.F64 else of(a.eps))
    big_m = Exact.of(elem.max)
    reciprocal = a.scale is ScaleOp.RCP
    held = (div(big_m, w, p) if reciprocal else div(w, big_m, p) if a.scale is ScaleOp.DIV
            else mul(w, div(ONE, big_m, p), p))
    held = fl(held)  # once more to float32 (a no-op for f32)
    if a.guard is Guard.ONE and held.kind is Kind.INF:
        held = Exact.of(F32.max)
    if a.smin:
        held = at_least(held, of(a.smin))
    rule = scaling.rule
    mode = None if rule is None else rule.rounding
    if reciprocal and mode is Rounding.RUP:
        mode = Rounding.RDOWN
    finite = finite_positive(held)
    rounded_inf = False
    if a.pow2 is Pow2.LOG2:
        t = log2_f32(held)
        k = _floor(t) if reciprocal else _ceil(t)
        held = NAN if k is None else exp2_f32(k) if -2048 < k < 2048 else (
            INF if k > 0 else ZERO)
    elif mode is not None and finite:
        rounded = round_exact(fmt, held, mode, Overflow.IEEE)
        rounded_inf = rounded.kind is not Kind.FINITE
        held = rounded if not rounded_inf else held
    largest, smallest = Exact.of(fmt.max), Exact.of(fmt.smallest_positive)
    over = (held.kind is Kind.INF and not held.negative) or (
        held.kind is Kind.FINITE and held.mag > fmt.max) or rounded_inf
    low = finite and held.kind is Kind.FINITE and held.mag < fmt.smallest_positive
    if a.guard is Guard.NONE and (mode is None or a.pow2 is Pow2.LOG2):
        over = low = False
    held = largest if over else smallest if low else held
    if a.guard is Guard.ONE and (w.kind is not Kind.FINITE or w.mag == 0):
        held = ONE
    recip = div(ONE, held)
    s, r = (recip, held) if reciprocal else (held, recip)
    apply = s if a.apply is ElementOp.DIV else r
    undo_by = s if a.undo is ElementOp.MUL else r
    if a.guard is Guard.DRIFT and w.kind is Kind.FINITE and w.mag == 0 and not (
            a.smin and not reciprocal):
        return ONE, a.apply, ONE, a.undo  # an all-zero group keeps its zeros
    return apply, a.apply, undo_by, a.undo


def _two_level_drift(amax: Exact, tensor_amax: Exact, elem: Format,
                     scaling: Scaling) -> tuple[Exact, ElementOp, Exact]:
    fmt = cast(Format, scaling.scale_format)
    t = tensor_amax
    if finite_positive(t) or t.kind is Kind.INF:
        s = at_least(div(t, fl(Exact.of(fmt.max * elem.max))), Exact.of(F32.smallest_normal))
    else:  # torch.where(t > 0, ..., 1): 0 and NaN take 1
        s = ONE
    raw = div(div(amax, Exact.of(elem.max)), s)
    if nan(raw):  # a rounding that is not finite counts as an overflow: the max, clamped
        block = Exact.of(fmt.max)
    else:
        rounded = round_exact(fmt, raw, Rounding.RNE, Overflow.IEEE) if finite_positive(raw) \
            else raw
        over = rounded.kind is not Kind.FINITE or (rounded.kind is Kind.FINITE
                                                   and rounded.mag > fmt.max)
        block = Exact.of(fmt.max) if over else at_least(rounded, Exact.of(fmt.smallest_positive))
    if amax.kind is Kind.FINITE and amax.mag == 0:
        block = Exact.of(fmt.smallest_positive)
    d = mul(block, s)
    return d, ElementOp.DIV, d


def _two_level_torchao(amax: Exact, tensor_amax: Exact, elem: Format,
                       scaling: Scaling) -> tuple[Exact, ElementOp, Exact]:
    s = div(tensor_amax, Exact.of(2688))
    raw = div(div(amax, Exact.of(6)), s)
    block = round_exact(E4M3, at_most(at_least(raw, Exact.of(E4M3.smallest_normal)),
                                       Exact.of(448)), Rounding.RNE, Overflow.SATURATE)
    return div(div(ONE, s), block), ElementOp.MUL, mul(s, block)


def _two_level_te(amax: Exact, tensor_amax: Exact, elem: Format,
                  scaling: Scaling) -> tuple[Exact, ElementOp, Exact]:
    t = tensor_amax
    enc = at_most(div(Exact.of(2688), t), Exact.of(F32.max))
    if (t.kind is Kind.FINITE and t.mag == 0) or (enc.kind is Kind.FINITE and enc.mag == 0):
        enc = ONE
    dec = div(ONE, enc)
    raw = mul(amax, mul(enc, div(ONE, Exact.of(6))))
    block = round_exact(E4M3, raw, Rounding.RNE, Overflow.SATURATE)
    apply = at_most(div(ONE, mul(block, dec)), Exact.of(F32.max))
    return apply, ElementOp.MUL, mul(mul(block, t), div(ONE, Exact.of(2688)))


TWO_LEVEL: dict[TwoLevelOrder, Callable[[Exact, Exact, Format, Scaling],
                                         tuple[Exact, ElementOp, Exact]]] = {
    TwoLevelOrder.DRIFT: _two_level_drift, TwoLevelOrder.TORCHAO: _two_level_torchao,
    TwoLevelOrder.TE: _two_level_te, TwoLevelOrder.TE_ROW: _two_level_te}
"""Each two-level order, exactly (the fast ones: ``driftcli.casts.scalearith._TWO_LEVEL``)."""
