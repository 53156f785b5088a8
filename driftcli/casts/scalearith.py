"""Scales as an implementation computes them: the float32 operations a
:class:`~driftcli.records.cast.ScaleArithmetic` names, in its order, each one an IEEE operation in
torch.

A cast whose arithmetic is not drift's exact one is worked on in float32 whatever its input
dtype (every implementation drift reproduces computes its scales and quotients in float32; a
float64 tensor is rounded to float32 first). For each scale group this module gives two
float32 operands: the one elements meet on the way in (``x / apply`` or ``x · apply``) and the
one codes meet on the way out (``q · undo`` or ``q / undo``), and the decoding scale reported
in :attr:`~driftcli.casts.quantization.QuantInfo.scales`. NaN and inf go through the operations as
IEEE arithmetic takes them: nothing is special-cased that the implementation does not
special-case itself. The op sequences and their sources are in docs/recipes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from driftcli.casts.rounding import round_values
from driftcli.casts.scaling import ScalePlan, plan_pow2_exponents, plan_two_level_scales
from driftcli.records.cast import Scaling
from driftcli.records.formats import FORMATS, Format
from driftcli.records.modes import (
    DEFAULT_SR_BITS,
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

Tensor = torch.Tensor

F32_MAX = torch.finfo(torch.float32).max
_E4M3 = FORMATS["float8_e4m3fn"]


@dataclass(frozen=True)
class ArithScales:
    """Per scale group (row): what its elements and codes meet, and what is reported."""

    apply: Tensor
    """float32: the elements' divisor (``apply=div``) or multiplier (``apply=mul``)."""
    undo: Tensor
    """float32: the codes' multiplier (``undo=mul``) or divisor (``undo=div``)."""
    scale: Tensor
    """float64: the decoding scale, value ≈ code · scale (NaN where the scale is NaN)."""
    clamped: Tensor
    """bool: the scale was raised or lowered into its range (see docs/recipes.md)."""
    tensor_scale: float | None = None
    """A two-level cast's decoding tensor scale."""
    apply_op: ElementOp = ElementOp.DIV
    """Whether elements are divided by ``apply`` or multiplied by it."""
    undo_op: ElementOp = ElementOp.MUL
    """Whether codes are multiplied by ``undo`` or divided by it."""


def group_amax(blocks: Tensor, finite_amax: Tensor, bad: Tensor, policy: AmaxPolicy) -> Tensor:
    """Each row's amax as ``policy`` reads it, from its amax over finite elements and which rows
    hold a NaN or inf (only those rows are reduced again)."""
    if policy is AmaxPolicy.FINITE or not bool(bad.any()):
        return finite_amax
    rows = bad.nonzero()[:, 0]
    mags = blocks.index_select(0, rows).abs()
    if policy is AmaxPolicy.FMAX:  # fmaxf skips a NaN operand
        mags = torch.where(torch.isnan(mags), 0.0, mags)
    out = finite_amax.clone()
    out[rows] = mags.amax(dim=1)  # torch.amax: NaN wins, then inf
    return out


def row_amax(amax: Tensor, row_length: int, block: int) -> Tensor:
    """Each block's row amax (row-scaled NVFP4's "tensor" amax): the largest of the block
    amaxes of its row, ``row_length`` elements along the block axis in blocks of ``block``."""
    per_row = -(-max(row_length, 1) // block)
    return amax.view(-1, per_row).amax(dim=1).repeat_interleave(per_row)


def pow2_f32(k: Tensor) -> Tensor:
    """``2**k`` as float32 for integer ``k`` in [-149, 127]: built as a float64 from its bits,
    then narrowed (exact: every such power of two is a float32, subnormal or not)."""
    return ((k.long() + 1023) << 52).view(torch.float64).float()


def arith_scales(amax: Tensor, tensor_amax: Tensor, elem: Format, scaling: Scaling) -> ArithScales:
    """The scales of every row (``amax`` float32, one per row; ``tensor_amax`` the whole
    tensor's, as the amax policy reads it) under ``scaling``'s arithmetic."""
    rule = scaling.rule
    plan = ScalePlan.of(elem, scaling)
    if rule is ScaleRule.TWO_LEVEL:
        return _TWO_LEVEL[scaling.arithmetic.two](amax, tensor_amax, plan)
    if rule is not None and rule.power_of_two:
        return _pow2_scales(amax, plan, scaling)
    return _real_scales(amax, plan, scaling)


def _quotient(amax: Tensor, m: float, op: ScaleOp) -> Tensor:
    """``fl(amax / M)`` or ``fl(amax · fl(1 / M))`` in amax's dtype (M a tensor: a compiler
    must not turn the division into a multiplication)."""
    big_m = torch.tensor(m, dtype=amax.dtype, device=amax.device)
    return amax / big_m if op is ScaleOp.DIV else amax * (1 / big_m)


def _pow2_scales(amax: Tensor, plan: ScalePlan, scaling: Scaling) -> ArithScales:
    a = scaling.arithmetic
    nan = torch.isnan(amax)
    if a.pow2 is Pow2.BITS:
        k, clamped = plan_pow2_exponents(torch.where(nan, 1.0, amax), plan)
    else:
        q = _quotient(amax, plan.elem_max, a.scale)
        # RP: the smallest k with 2**k >= q, from q's bits; LOG2: torch's float32 log2
        raw = _ceil_exponent(q, plan.low) if a.pow2 is Pow2.RP else _rounded_log2(q, up=True)
        clamped = ((raw < plan.low) | (raw > plan.high)) & (q > 0)
        k = raw.clamp(plan.low, plan.high)
    scale = torch.where(nan, torch.nan, pow2_f32(k))
    if a.apply is ElementOp.DIV:
        apply = scale.clamp(min=a.divmin) if a.divmin else scale  # clamp keeps NaN
    else:
        apply = torch.where(nan, torch.nan, pow2_f32(-k))
        if a.rcpmin is SmallestRcp.ONE:
            apply = torch.where(k == plan.low, 1.0, apply)
    return ArithScales(apply, scale, scale.double(), clamped & ~nan, apply_op=a.apply)


LOG2_SLICE = 1024
"""Elements per ``torch.log2`` call: below MKL's threading threshold."""


def _rounded_log2(v: Tensor, up: bool) -> Tensor:
    """``ceil`` (``up``) or ``floor`` of torch's float32 ``log2(v)``, as int64 (±1024 for
    ±inf, 0 for NaN: callers mask NaN). On the CPU, ``log2``, ``ceil`` and ``floor`` of a long
    vector go through MKL's threaded vector math, whose threads cost milliseconds a call on a
    busy machine (docs/performance-history.md): ``log2`` is taken in slices of :data:`LOG2_SLICE`
    (the same function, element by element the same values), the rounding on integers."""
    flat = v.reshape(-1)
    t = torch.cat([torch.log2(part) for part in flat.split(LOG2_SLICE)]).reshape(v.shape) \
        if flat.numel() > LOG2_SLICE else torch.log2(v)
    t = t.clamp(-1024, 1024)
    t = torch.where(torch.isnan(t), 0.0, t)
    whole = t.long()  # toward zero
    back = whole.float()
    return whole + (back < t).long() if up else whole - (back > t).long()


def _ceil_exponent(q: Tensor, low: int) -> Tensor:
    """``ceil(log2 q)`` from the bits of a float32 ``q >= 0`` (``low`` for 0, 128 for inf): the
    exponent field, plus one unless the mantissa is zero; a subnormal ``m · 2**-149`` takes
    ``bit_length(m - 1) - 149``."""
    bits = q.view(torch.int32).long()
    field, mantissa = bits >> 23, bits & 0x7FFFFF
    normal = field - 127 + (mantissa != 0).long()
    sub = torch.frexp((mantissa - 1).double())[1].long() - 149  # bit_length(m - 1)
    return torch.where(q == 0, low, torch.where(field == 0, sub, normal))


def _real_scales(amax: Tensor, plan: ScalePlan, scaling: Scaling) -> ArithScales:
    a = scaling.arithmetic
    rule = scaling.rule
    dtype = torch.float64 if a.prec is Precision.F64 else torch.float32
    w = amax.to(dtype)
    if a.eps:
        w = torch.clamp(w, min=a.eps)  # as the implementations do: NaN stays NaN
    big_m = torch.tensor(plan.elem_max, dtype=dtype, device=amax.device)
    reciprocal = a.scale is ScaleOp.RCP
    held = (big_m / w if reciprocal else w / big_m if a.scale is ScaleOp.DIV
            else w * (1 / big_m)).float()
    if a.guard is Guard.ONE:
        held = torch.where(torch.isinf(held), F32_MAX, held)
    if a.smin:
        held = torch.clamp(held, min=a.smin)
    # into the scale format: the rule's rounding (mirrored for a reciprocal: r rounded down
    # is s rounded up), through float32 log2 with pow2=log2
    mode = None if rule is None else rule.rounding
    if reciprocal and mode is Rounding.RUP:
        mode = Rounding.RDOWN
    finite = torch.isfinite(held) & (held > 0)
    if a.pow2 is Pow2.LOG2:
        k = _rounded_log2(held, up=not reciprocal)  # exp2 of it: 0 below 2**-149, inf above
        exp2 = torch.where(k < -149, 0.0, torch.where(k > 127, torch.inf, pow2_f32(
            k.clamp(-149, 127))))
        held = torch.where(torch.isnan(held), torch.nan, exp2)
    elif mode is not None:
        rounded = round_values(torch.where(finite, held, 1.0).contiguous(), None,
                               cast(Format, scaling.scale_format), mode, Overflow.IEEE, None,
                               DEFAULT_SR_BITS, held.dtype)
        held = torch.where(finite, rounded, held)
    over = (held > plan.largest) | (finite & ~torch.isfinite(held))
    low = finite & (held < plan.smallest)
    if a.guard is Guard.NONE and (mode is None or a.pow2 is Pow2.LOG2):
        # a scale kept as computed, or made a power of two by exp2, is not brought in range
        over = low = torch.zeros_like(over)
    clamped = over | low
    held = torch.where(over, plan.largest, torch.where(low, plan.smallest, held))
    if a.guard is Guard.ONE:
        held = torch.where((w == 0) | ~torch.isfinite(w), 1.0, held)
    one = torch.ones_like(held)
    recip = one / held
    s, r = (recip, held) if reciprocal else (held, recip)
    apply = s if a.apply is ElementOp.DIV else r
    undo = s if a.undo is ElementOp.MUL else r
    scale = s.double() if not reciprocal or a.undo is ElementOp.MUL else 1 / held.double()
    if a.guard is Guard.DRIFT:  # an all-zero group keeps its zeros (unless a floor made a scale)
        zero = ((w == 0) if not (a.smin and not reciprocal)
                else torch.zeros_like(held, dtype=torch.bool))
        apply, undo = torch.where(zero, 1.0, apply), torch.where(zero, 1.0, undo)
        scale = torch.where(zero, plan.smallest, scale)
        clamped = clamped & ~zero
    return ArithScales(apply, undo, scale, clamped & (amax != 0), apply_op=a.apply,
                       undo_op=a.undo)


def _two_level_drift(amax: Tensor, tensor_amax: Tensor, plan: ScalePlan) -> ArithScales:
    two = plan_two_level_scales(amax, tensor_amax, plan.divisors(amax), plan)
    return ArithScales(two.divisor, two.divisor, two.divisor.double(), two.clamped,
                       float(two.tensor_scale))


def _e4m3(raw: Tensor) -> Tensor:
    """Round to nearest even into E4M3, saturating (``.to(torch.float8_e4m3fn)``, PTX
    ``cvt.rn.satfinite``); NaN stays NaN."""
    return round_values(raw.contiguous(), None, _E4M3, Rounding.RNE, Overflow.SATURATE, None,
                        DEFAULT_SR_BITS, raw.dtype)


def _two_level_torchao(amax: Tensor, tensor_amax: Tensor, plan: ScalePlan) -> ArithScales:
    """torchao 0.18.0 ``nvfp4_quantize`` with ``per_tensor_amax_to_scale``."""
    tensor_scale = tensor_amax.float() / torch.tensor(2688.0)
    raw = (amax / torch.tensor(6.0)) / tensor_scale
    smallest_normal = float(_E4M3.smallest_normal)
    block = _e4m3(torch.clamp(raw, smallest_normal, 448.0))
    apply = (1 / tensor_scale) / block
    undo = tensor_scale * block
    clamped = (raw < smallest_normal) | (raw > 448.0)
    return ArithScales(apply, undo, undo.double(), clamped & (amax > 0), float(tensor_scale),
                       ElementOp.MUL)


def _two_level_te(amax: Tensor, tensor_amax: Tensor, plan: ScalePlan) -> ArithScales:
    """Transformer Engine's NVFP4 quantize kernels and its dequantize kernel (docs/recipes.md);
    ``tensor_amax`` one per row for row-scaled NVFP4."""
    t = tensor_amax.float()
    enc = torch.clamp(torch.tensor(2688.0) / t, max=F32_MAX)
    enc = torch.where((t == 0) | (enc == 0), 1.0, enc)
    dec = 1 / enc
    raw = amax * (enc * (1 / torch.tensor(6.0)))
    block = _e4m3(raw)
    apply = torch.clamp(1 / (block * dec), max=F32_MAX)
    undo = (block * t) * (1 / torch.tensor(2688.0))
    clamped = (raw > 448.0) | ((raw > 0) & (block == 0))
    return ArithScales(apply, undo, undo.double(), clamped,
                       float(dec) if dec.numel() == 1 else None, ElementOp.MUL)


_TWO_LEVEL = {TwoLevelOrder.DRIFT: _two_level_drift, TwoLevelOrder.TORCHAO: _two_level_torchao,
              TwoLevelOrder.TE: _two_level_te, TwoLevelOrder.TE_ROW: _two_level_te}
"""Each two-level order's operations."""


def apply_ops(a: Tensor, op: ElementOp, x: Tensor) -> Tensor:
    """``x / a`` or ``x · a``, row by row (``a`` one per row)."""
    return x / a[:, None] if op is ElementOp.DIV else x * a[:, None]


def undo_ops(u: Tensor, op: ElementOp, q: Tensor) -> Tensor:
    """``q · u`` or ``q / u``, row by row."""
    return q * u[:, None] if op is ElementOp.MUL else q / u[:, None]
