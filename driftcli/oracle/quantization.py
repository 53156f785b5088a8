"""The exact twin of :mod:`driftcli.casts.quantization`: a block of values cast under its
scale (:func:`cast_block`): the scale chosen by the rule from the exact amax
(:mod:`driftcli.oracle.scaling`), each element rounded exactly
(:mod:`driftcli.oracle.rounding`). It imports neither torch nor the fast path.
"""

from __future__ import annotations

from fractions import Fraction
from typing import cast

from driftcli.oracle.fouroversix import four_over_six
from driftcli.oracle.rounding import binade, round_exact
from driftcli.oracle.scalearith import (
    TWO_LEVEL,
    amax_of,
    elementwise,
    pow2_scales,
    real_scales,
    undo,
)
from driftcli.oracle.scaling import (
    EXACT_RULES,
    DivisorRule,
    fl32,
    into_scale_format,
    pow2_scale_exponent,
    times,
)
from driftcli.records.cast import MicroBase, MicroScaling, Scaling
from driftcli.records.formats import NAN, Exact, Format, Kind, pow2
from driftcli.records.modes import (
    DEFAULT_SR_BITS,
    AmaxPolicy,
    ElementOp,
    Overflow,
    Rounding,
    ScaleRule,
)


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

Group = tuple[list[Exact], list[Exact], Exact]
"""A group's dequantized values, its codes, and its decoding scale."""


def _elements(values: list[Exact], elem: Format, apply: Exact, apply_op: ElementOp,
              undo_by: Exact, undo_op: ElementOp, rounding: Rounding,
              overflow: Overflow) -> tuple[list[Exact], list[Exact]]:
    codes = [round_exact(elem, elementwise(v, apply, apply_op), rounding, overflow)
             for v in values]
    return [undo(c, undo_by, undo_op) for c in codes], codes


def cast_group(values: list[Exact], elem: Format, scaling: Scaling, tensor_amax: Exact,
               rounding: Rounding = Rounding.RNE,
               overflow: Overflow = Overflow.SATURATE) -> Group:
    """One scale group (block, tile, channel or tensor) cast by ``scaling``'s arithmetic, every
    float operation rounded exactly. ``tensor_amax`` is the whole tensor's amax under the
    arithmetic's policy (two-level scales read it)."""
    a = scaling.arithmetic
    if (scaling.blocked and a.amax is AmaxPolicy.FINITE
            and any(v.kind is not Kind.FINITE for v in values)):
        return [NAN] * len(values), [NAN] * len(values), NAN
    amax = amax_of(values, a.amax)
    rule = scaling.rule
    if rule is ScaleRule.TWO_LEVEL and a.two.four_over_six:
        apply, apply_op, undo_by = four_over_six(values, amax, tensor_amax, elem, scaling)
        undo_op = ElementOp.MUL
    elif rule is ScaleRule.TWO_LEVEL:
        apply, apply_op, undo_by = TWO_LEVEL[a.two](amax, tensor_amax, elem, scaling)
        undo_op = ElementOp.MUL
    elif rule is not None and rule.power_of_two:
        apply, apply_op, undo_by = pow2_scales(amax, elem, scaling)
        undo_op = ElementOp.MUL
    else:
        apply, apply_op, undo_by, undo_op = real_scales(amax, elem, scaling)
    out, codes = _elements(values, elem, apply, apply_op, undo_by, undo_op, rounding, overflow)
    return out, codes, undo_by
