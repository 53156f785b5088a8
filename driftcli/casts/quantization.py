"""``quantize``: a cast applied to a torch tensor, and the per-element facts of it.

A :class:`~driftcli.records.cast.Cast` says how (element format, scaling, rounding, overflow); here
the
tensor is cut into its scale groups (:func:`~driftcli.casts.scaling.to_blocks`), each group's scale
is
chosen by its rule, and every element is rounded onto the format's grid times that scale
(:mod:`driftcli.casts.rounding`), on the back-end :mod:`driftcli.kernels` chooses (the same bits on
each). :mod:`driftcli.measures.stats` counts what a cast did from the same block layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import numpy as np
import torch

from driftcli import kernels
from driftcli.casts import rounding
from driftcli.casts.fouroversix import four_over_six_scales, fused_values
from driftcli.casts.hadamard import transform
from driftcli.casts.microscale import micro_values, numba_values
from driftcli.casts.scalearith import apply_ops, arith_scales, group_amax, row_amax, undo_ops
from driftcli.casts.scaling import (
    ScalePlan,
    block_stats,
    plan_divisors,
    plan_pow2_exponents,
    pow2_exponents,
    pow2_range,
    rule_threshold,
    to_blocks,
    two_level_scales,
)
from driftcli.errors import DriftError
from driftcli.kernels import jit
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import (
    DEFAULT_SR_BITS,
    AmaxPolicy,
    ElementOp,
    Granularity,
    Overflow,
    Rounding,
    ScaleRule,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class QuantInfo:
    """What a cast did, element by element and block by block."""

    values: Tensor
    """The dequantized values, shaped and typed like the input."""
    clipped: Tensor
    """|x / s| above the element format's max (before saturation)."""
    underflowed: Tensor
    """x nonzero and finite, the result zero."""
    subnormal: Tensor
    """The result nonzero and, divided by its scale, below the element's smallest normal."""
    nonfinite: Tensor
    """The input element is NaN or ±inf."""
    scales: Tensor
    """The scale each block was divided by (float64; NaN for a nonfinite block)."""
    scale_clamped: Tensor
    """Per block: the rule's scale fell outside the scale format and was clamped."""
    nonfinite_blocks: Tensor
    """Per block: it held NaN or inf (block scalings make all its elements NaN)."""
    tensor_scale: float | None = None
    """The float32 tensor scale of a two-level cast."""
    codes: Tensor | None = None
    """Each element's code, decoded: its value on the element format's grid before the scale
    is applied back (``values`` = codes · scale, as the cast's arithmetic computes it); NaN
    where the value is NaN for want of a scale."""


def quantize(x: Tensor, cast_or_spec: Cast | str, *, axis: int = -1, seed: int | None = None,
             random_bits: Tensor | None = None, sr_bits: int = DEFAULT_SR_BITS,
             return_info: bool = False) -> Tensor | QuantInfo:
    """Cast ``x`` as the spec says and return the dequantized values (same shape and dtype).

    ``axis`` is the axis blocks run along (the contraction axis of a matmul).
    Stochastic rounding reads ``random_bits`` (shaped like ``x``) or draws
    them from ``seed``. With ``return_info`` a :class:`QuantInfo` comes back. A cast with
    ``rht=`` casts the transform of ``x`` (:func:`driftcli.casts.hadamard.transform`), and the
    values
    are the transform's, not ``x``'s: no inverse is applied.
    """
    c = parse_cast(cast_or_spec)
    random_bits = checked_bits("quantize", x, c, seed, random_bits, sr_bits)
    if c.rht is not None:  # the cast reads the transform (float32 on bfloat16's grid)
        out = _quantize(transform(x, c.rht, axis), c, axis, random_bits, sr_bits, return_info)
        if isinstance(out, Tensor):
            return out.to(x.dtype)
        return replace(out, values=out.values.to(x.dtype))
    return _quantize(x, c, axis, random_bits, sr_bits, return_info)


def checked_bits(what: str, x: Tensor, c: Cast, seed: int | None, random_bits: Tensor | None,
                  sr_bits: int) -> Tensor | None:
    """Check ``x`` is a float tensor; the random bits a stochastic cast reads (drawn from
    ``seed`` when not given), checked against ``x``'s shape."""
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise DriftError(f"{what} needs a floating-point tensor, not {x.dtype}")
    if c.rounding is Rounding.SR and random_bits is None:
        if seed is None:
            raise DriftError("stochastic rounding needs seed= or random_bits=")
        random_bits = rounding.draw_random_bits(x.shape, seed, sr_bits, x.device)
    if random_bits is not None:
        rounding.check_random_bits(random_bits, x.shape, sr_bits)
    return random_bits


def _scales(amax: Tensor, tensor_amax: Tensor, c: Cast) -> tuple[Tensor, Tensor]:
    """Each row's scale (the exponent ``k`` of ``2**k``, or the divisor) and if it clamped."""
    plan = ScalePlan.of(c.format, c.scaling)
    return plan_scales(amax, tensor_amax, plan.divisors(amax), plan=plan)


def plan_scales(amax: Tensor, tensor_amax: Tensor, div: Tensor, *,
                 plan: ScalePlan) -> tuple[Tensor, Tensor]:
    """Each block's scale under the plan's rule (an exponent for power-of-two rules, a divisor
    for the others) and whether it was clamped: the rule's own fast implementation."""
    if plan.rule.power_of_two:
        return plan_pow2_exponents(amax, plan)
    return plan_divisors(amax, tensor_amax, div, plan)


def _apply(blocks: Tensor, bits: Tensor | None, scale: Tensor, nonfinite: Tensor, *,
           tgt: rounding.Target, mode: Rounding, overflow: Overflow, sr_bits: int, pow2: bool,
           blocked: bool, wide: bool) -> Tensor:
    """The element cast of every row under its scale, on the torch back-end."""
    if pow2:
        # a scaled grid beyond float32's range is rounded in float64, then stored as float32
        work = blocks.double() if wide else blocks
        q = rounding.round_fused(work, tgt, mode, overflow, bits, scale[:, None],
                                 sr_bits).to(blocks.dtype)
    else:
        y = (blocks / scale[:, None]).contiguous()
        q = rounding.round_fused(y, tgt, mode, overflow, bits, None, sr_bits) * scale[:, None]
    if blocked:
        q = torch.where(nonfinite[:, None], torch.nan, q)
    return q


def _scaled_values(blocks: Tensor, bits: Tensor | None, amax: Tensor, nonfinite: Tensor,
                   tensor_amax: Tensor, *, c: Cast, sr_bits: int,
                   wide: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Dequantized rows, each row's scale and whether it clamped, from the rows' amax."""
    scale, clamped = _scales(amax, tensor_amax, c)
    s = c.scaling
    q = _apply(blocks, bits, scale, nonfinite, tgt=rounding.target_of(c.format),
               mode=c.rounding, overflow=c.overflow, sr_bits=sr_bits,
               pow2=bool(s.rule is not None and s.rule.power_of_two), blocked=s.blocked,
               wide=wide)
    return q, scale, clamped


def amax_and_nonfinite(blocks: Tensor) -> tuple[Tensor, Tensor]:
    stats = block_stats(blocks)
    return stats.amax, stats.nonfinite


def needs_wide(amax: Tensor, c: Cast) -> bool:
    """Whether a power-of-two scaled grid leaves float32's range for some block (then float64);
    an unscaled cast's grid is its format's own (a scale of 2**0).

    The extreme exponents bound every block's, as the rules are monotone in amax."""
    low = high = 0
    if c.scaling.granularity is not Granularity.NONE:
        positive = torch.where(amax > 0, amax, torch.inf)
        ends = torch.stack([positive.min(), amax.max()]).nan_to_num(posinf=1.0)
        k, _ = pow2_exponents(torch.where(ends > 0, ends, 1.0), c.format, c.scaling)
        low, high = int(k.min()), int(k.max())
    return low + c.format.qmin < -149 or high + c.format.emax >= 128


@dataclass(frozen=True)
class Blocked:
    """A cast done in block layout: one row per scale group."""

    blocks: Tensor
    q: Tensor
    scales: Tensor
    """Each row's scale as a float64 divisor (NaN for a nonfinite block)."""
    clamped: Tensor
    bad_blocks: Tensor
    back: Callable[[Tensor], Tensor]
    bits: Tensor | None
    tensor_scale: float | None
    apply: tuple[ElementOp, Tensor] | None = None
    """Under a scale arithmetic: how elements met their row's operand on the way in (the
    element masks divide or multiply the same way)."""
    quotient: Tensor | None = None
    """Under micro-exponents: each element's exact quotient on its element grid (float64)."""


def cast_blocks(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None, sr_bits: int,
                 tensor_amax: float | None) -> Blocked:
    """The cast of every scale group of ``x``; ``tensor_amax`` stands in for the tensor's own
    amax when ``x`` is one slice of a larger tensor (per-tensor and two-level scales)."""
    if not c.scaling.arithmetic.exact:
        return _cast_blocks_arith(x, c, axis, random_bits, sr_bits, tensor_amax)
    if c.micro is not None:
        return _cast_blocks_micro(x, c, axis, random_bits, sr_bits)
    work = working(x)
    elem, s = c.format, c.scaling
    blocks, back = to_blocks(work, s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    n_rows = blocks.shape[0]
    no_blocks = torch.zeros(n_rows, dtype=torch.bool, device=blocks.device)
    rule = s.rule
    pow2 = rule is not None and rule.power_of_two
    tensor_scale = None
    if s.granularity is Granularity.NONE or blocks.numel() == 0:
        q = rounding.round_values(blocks, None, elem, c.rounding, c.overflow, bits, sr_bits,
                                  blocks.dtype)
        ones = torch.ones(n_rows, dtype=torch.float64, device=blocks.device)
        return Blocked(blocks, q, ones, no_blocks, no_blocks, back, bits, None)
    if kernels.numba_runs(blocks, bits):
        amax, nonfinite = jit.block_amax(blocks)
        top = tensor_amax_of(amax, tensor_amax)
        if s.granularity is Granularity.TENSOR:
            amax = top.expand_as(amax)
        scale, clamped = _scales(amax, top, c)
        q = _jit_apply(blocks, bits, scale, nonfinite if s.blocked else None, c, sr_bits,
                       pow2 and needs_wide(amax, c))
    else:
        amax, nonfinite = amax_and_nonfinite(blocks)
        top = tensor_amax_of(amax, tensor_amax)
        if s.granularity is Granularity.TENSOR:
            amax = top.expand_as(amax)
        static: dict[str, Any] = {"c": c, "sr_bits": sr_bits, "wide": pow2 and needs_wide(amax, c)}
        # in cache-sized slices: several times faster than whole tensors
        q, scale, clamped = _sliced(blocks, bits, amax, nonfinite, top, static)
    bad_blocks = nonfinite if s.blocked else no_blocks
    clamped = clamped & ~bad_blocks  # a NaN block's scale is NaN, not clamped
    scales = torch.ldexp(torch.ones_like(scale, dtype=torch.float64), scale.double()) \
        if pow2 else scale.double()
    if s.blocked:
        scales = torch.where(bad_blocks, torch.nan, scales)
    if rule is ScaleRule.TWO_LEVEL:
        tensor_scale = float(two_level_scales(amax[:1], top, elem, s).tensor_scale)
    return Blocked(blocks, q, scales, clamped, bad_blocks, back, bits, tensor_scale)


def _cast_blocks_micro(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None,
                       sr_bits: int) -> Blocked:
    """:func:`cast_blocks` under micro-exponents (:mod:`driftcli.casts.microscale`): the scales
    reported are the first-level ones."""
    s = c.scaling
    blocks, back = to_blocks(x.float(), s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    q, quotient, sc = micro_values(blocks, bits, c, sr_bits)
    scales = torch.where(sc.bad, torch.nan, sc.s)
    return Blocked(blocks, q, scales, sc.clamped, sc.bad, back, bits, None, None, quotient)


def _cast_blocks_arith(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None,
                       sr_bits: int, tensor_amax: float | None) -> Blocked:
    """:func:`cast_blocks` under a scale arithmetic (:mod:`driftcli.casts.scalearith`): in float32,
    the scales by the arithmetic's operations, the elements through its apply and undo
    operations."""
    s, a = c.scaling, c.scaling.arithmetic
    blocks, back = to_blocks(x.float(), s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    n_rows = blocks.shape[0]
    if blocks.numel() == 0:
        none = torch.zeros(n_rows, dtype=torch.bool, device=blocks.device)
        ones = torch.ones(n_rows, dtype=torch.float64, device=blocks.device)
        return Blocked(blocks, blocks.clone(), ones, none, none, back, bits, None)
    use_jit = kernels.numba_runs(blocks, bits)
    finite_amax, bad = jit.block_amax(blocks) if use_jit else amax_and_nonfinite(blocks)
    amax = group_amax(blocks, finite_amax, bad, a.amax)
    top = tensor_amax_of(amax, tensor_amax)
    if a.two.row_scaled:  # one amax per row: a slice of whole rows needs no tensor amax
        top = row_amax(amax, x.shape[axis] if x.dim() else 1, s.block)
    if s.granularity is Granularity.TENSOR:
        amax = top.expand_as(amax).contiguous()
    sc = (four_over_six_scales(blocks, amax, top, c.format, a.two) if a.two.four_over_six
          else arith_scales(amax, top, c.format, s))
    poisoned = bad if s.blocked and a.amax is AmaxPolicy.FINITE else None
    if use_jit:
        p = rounding.jit_params(src=rounding.source_of(torch.float32),
                                tgt=rounding.target_of(c.format), rounding=c.rounding,
                                overflow=c.overflow, sr_bits=sr_bits)
        q = jit.round_scaled(blocks, sc.apply, sc.undo, bits, p, poisoned,
                             sc.apply_op is ElementOp.MUL, sc.undo_op is ElementOp.DIV)
    else:
        y = apply_ops(sc.apply, sc.apply_op, blocks).contiguous()
        code = rounding.round_fused(y, rounding.target_of(c.format), c.rounding, c.overflow, bits,
                                    None, sr_bits)
        q = undo_ops(sc.undo, sc.undo_op, code)
        if poisoned is not None:
            q = torch.where(poisoned[:, None], torch.nan, q)
    bad_blocks = bad if s.blocked else torch.zeros_like(bad)
    scales = sc.scale if poisoned is None else torch.where(poisoned, torch.nan, sc.scale)
    clamped = sc.clamped & ~(poisoned if poisoned is not None else torch.zeros_like(bad))
    return Blocked(blocks, q, scales, clamped, bad_blocks, back, bits, sc.tensor_scale,
                   (sc.apply_op, sc.apply))


def _jit_apply(blocks: Tensor, bits: Tensor | None, scale: Tensor, bad: Tensor | None, c: Cast,
               sr_bits: int, wide: bool) -> Tensor:
    """:func:`_apply` on numba's kernels: the element cast of every row under its scale, and
    NaN for the ``bad`` rows of a block scaling."""
    s = c.scaling
    if s.rule is not None and s.rule.power_of_two:
        work = blocks.double() if wide else blocks
        p = rounding.jit_params(src=rounding.source_of(work.dtype),
                                tgt=rounding.target_of(c.format), rounding=c.rounding,
                                overflow=c.overflow, sr_bits=sr_bits)
        return jit.round_bits(work, None, bits, scale[:, None], p, bad).to(blocks.dtype)
    p = rounding.jit_params(src=rounding.source_of(blocks.dtype), tgt=rounding.target_of(c.format),
                            rounding=c.rounding, overflow=c.overflow, sr_bits=sr_bits)
    return jit.round_divided(blocks, scale, bits, p, bad)


def tensor_amax_of(amax: Tensor, given: float | None) -> Tensor:
    return amax.max() if given is None else torch.tensor(given, dtype=amax.dtype,
                                                         device=amax.device)


@dataclass(frozen=True)
class Masks:
    """Per-element facts of a cast, in block layout."""

    finite: Tensor
    clipped: Tensor
    underflowed: Tensor
    subnormal: Tensor
    codes: Tensor


def element_masks(b: Blocked, c: Cast, sr_bits: int) -> Masks:
    """Which elements clipped, underflowed, came out subnormal, and each one's code: the
    definitions of docs/measurements.md#what-is-measured, with s the scale each element's
    block was divided by."""
    elem, s = c.format, c.scaling
    blocks, q, scales = b.blocks, b.q, b.scales
    finite = torch.isfinite(blocks)
    poisoned = s.blocked and s.arithmetic.amax is AmaxPolicy.FINITE
    if b.quotient is not None:  # micro-exponents: the exact quotient on the element grid
        y = b.quotient
        qy = rounding.round_values(y, None, elem, c.rounding, c.overflow, b.bits, sr_bits, y.dtype)
        clipped = (y > float(elem.max)) | (y < float(elem.min))
        subnormal = (qy != 0) & (qy.abs() < float(elem.smallest_normal))
        codes = torch.where(torch.isnan(q), torch.nan, qy).to(q.dtype)
    elif b.apply is not None:  # a scale arithmetic: the quotient its apply operation made
        y = apply_ops(b.apply[1], b.apply[0], blocks).contiguous()
        qy = rounding.round_values(y, None, elem, c.rounding, c.overflow, b.bits, sr_bits, y.dtype)
        clipped = (y > float(elem.max)) | (y < float(elem.min))
        subnormal = (qy != 0) & (qy.abs() < float(elem.smallest_normal))
        codes = torch.where(torch.isnan(q), torch.nan, qy)
    elif s.rule is not None and s.rule.power_of_two:
        exps = (torch.frexp(scales)[1] - 1).double()[:, None]  # scales are powers of two
        top = torch.ldexp(torch.full_like(exps, float(elem.max)), exps)
        bottom = torch.ldexp(torch.full_like(exps, float(elem.min)), exps)
        small = torch.ldexp(torch.full_like(exps, float(elem.smallest_normal)), exps)
        wide_blocks = blocks.double()
        clipped = (wide_blocks > top) | (wide_blocks < bottom)
        subnormal = (q != 0) & (q.double().abs() < small)
        codes = torch.ldexp(q.double(), -exps).to(q.dtype)  # exact: q is a code times 2**k
    else:
        y, qy = blocks, q
        if s.granularity is not Granularity.NONE:  # the same float division the cast made
            y = (blocks / scales.to(blocks.dtype)[:, None]).contiguous()
            qy = rounding.round_values(y, None, elem, c.rounding, c.overflow, b.bits, sr_bits,
                                       y.dtype)
        clipped = (y > float(elem.max)) | (y < float(elem.min))
        subnormal = (qy != 0) & (qy.abs() < float(elem.smallest_normal))
        codes = torch.where(torch.isnan(q), torch.nan, qy)
    underflowed = (blocks != 0) & finite & (q == 0)
    clipped = clipped & finite
    if poisoned:
        clipped = clipped & ~b.bad_blocks[:, None]
    return Masks(finite, clipped, underflowed, subnormal & torch.isfinite(q), codes)


def _quantize(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None,
              sr_bits: int, want_info: bool) -> Tensor | QuantInfo:
    """The cast; the masks only when asked (they cost more passes than the cast itself)."""
    if not want_info:
        fused = _block_cast_numba(x, c, axis, random_bits, sr_bits)
        if fused is None and c.scaling.arithmetic.two.four_over_six:
            fused = fused_values(x, c, axis)
        if fused is not None:
            return fused
    b = cast_blocks(x, c, axis, random_bits, sr_bits, None)
    if not want_info:
        return b.back(b.q).to(x.dtype)
    m = element_masks(b, c, sr_bits)
    return QuantInfo(
        values=b.back(b.q).to(x.dtype), clipped=b.back(m.clipped),
        underflowed=b.back(m.underflowed), subnormal=b.back(m.subnormal),
        nonfinite=b.back(~m.finite), scales=b.scales, scale_clamped=b.clamped,
        nonfinite_blocks=b.bad_blocks, tensor_scale=b.tensor_scale, codes=b.back(m.codes))


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype casts work in: float64 stays, every other float widens exactly to
    float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def working(x: Tensor) -> Tensor:
    """``x`` in its :func:`working_dtype`."""
    return x.to(working_dtype(x.dtype))


def _sliced(blocks: Tensor, bits: Tensor | None, amax: Tensor, nonfinite: Tensor,
            tensor_amax: Tensor, static: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_scaled_values` eagerly, on cache-sized slices (faster than whole tensors)."""
    n_rows, n_cols = blocks.shape
    col_step = min(n_cols, rounding.EAGER_CHUNK)
    row_step = max(1, rounding.EAGER_CHUNK // col_step)
    q = torch.empty_like(blocks)
    scales, clamps = [], []
    for r in range(0, n_rows, row_step):
        rows = slice(r, r + row_step)
        for col in range(0, n_cols, col_step):
            cols = slice(col, col + col_step)
            part = None if bits is None else bits[rows, cols].contiguous()
            q[rows, cols], scale, clamped = _scaled_values(
                blocks[rows, cols].contiguous(), part, amax[rows], nonfinite[rows], tensor_amax,
                **static)
        scales.append(scale)
        clamps.append(clamped)
    return q, torch.cat(scales), torch.cat(clamps)


# --- block casts in two passes, on the numba back-end ------------------------------------------
# A training step casts dozens of operands of thousands of elements each; there a cast's cost is
# the dozen small torch operations that choose the block scales, not its element arithmetic
# (docs/performance-history.md#simulated-training-benchmarksbench_trainpy). For the two block-scaled
# families the policies use, one numba pass computes every block's scale and one rounds: the
# same bits as cast_blocks (tests/test_fastcast.py).

_VECTOR_ROUNDINGS = (Rounding.RNE, Rounding.SR)
"""The rounding modes of :func:`driftcli.kernels.jit.round_pow2_rows` (the others round
power-of-two blocks with :func:`driftcli.kernels.jit.round_bits`)."""
_FLOAT32_TINY = 2.0**-126


@cache
def pow2_rule(c: Cast) -> np.ndarray | None:
    """The one-pass kernel's rule vector of a power-of-two cast (``emax, threshold, strict,
    headroom, low, high``), or None for a rule not written as a threshold."""
    plan = ScalePlan.of(c.format, c.scaling)
    found = rule_threshold(plan)
    if found is None:
        return None
    if c.scaling.scale_format is None:  # ScalePlan.of has refused it already
        return None
    low, high = pow2_range(c.scaling.scale_format)
    return np.array([plan.elem_emax, found[0], int(found[1]), plan.headroom, low, high],
                    dtype=np.int64)


@cache
def two_level_consts(c: Cast) -> tuple[np.ndarray, tuple[int, ...]]:
    """The float32 constants and the scale rounding's parameters of a two-level cast."""
    plan = ScalePlan.of(c.format, c.scaling)
    consts = np.array([plan.elem_max, plan.two_level_max, plan.smallest, plan.largest,
                       _FLOAT32_TINY], dtype=np.float32)
    q = rounding.jit_params(src=rounding.source_of(torch.float32),
                            tgt=plan.scale_target,
                            rounding=Rounding.RNE, overflow=Overflow.IEEE, sr_bits=DEFAULT_SR_BITS)
    return consts, q


def fused_block_cast_applies(x: Tensor, c: Cast) -> bool:
    """Whether :func:`quantize` casts ``x`` under ``c`` in two numba passes (a float32 CPU
    tensor, blocks of a power-of-two rule written as a threshold or of the two-level rule,
    drift's exact scale arithmetic); otherwise it takes the general steps, with the same
    bits."""
    s = c.scaling
    return (x.dtype == torch.float32 and x.numel() > 0 and s.granularity is Granularity.BLOCK
            and s.arithmetic.exact and c.micro is None and s.rule is not None
            and (s.rule is ScaleRule.TWO_LEVEL or (s.rule.power_of_two
                                                   and pow2_rule(c) is not None))
            and kernels.numba_runs(x))


def _block_cast_numba(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None,
                      sr_bits: int) -> Tensor | None:
    """``quantize(x, c)`` in two numba passes (one for the scales, one for the elements), or
    None where :func:`fused_block_cast_applies` does not hold or a power-of-two grid leaves
    float32's range (the general steps round it in float64)."""
    if c.micro is not None and x.dtype == torch.float32:  # scales and elements in one pass
        blocks, back = to_blocks(x, c.scaling, axis)
        bits = None if random_bits is None else to_blocks(random_bits, c.scaling, axis)[0]
        values = numba_values(blocks.contiguous(), bits, c, sr_bits)
        return None if values is None else back(values).to(x.dtype)
    if not fused_block_cast_applies(x, c):
        return None
    s = c.scaling
    blocks, back = to_blocks(x, s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    p = rounding.jit_params(src=rounding.source_of(torch.float32), tgt=rounding.target_of(c.format),
                            rounding=c.rounding, overflow=c.overflow, sr_bits=sr_bits)
    if s.rule is ScaleRule.TWO_LEVEL:
        consts, q = two_level_consts(c)
        divisor, bad, *_ = jit.two_level_block_scales(blocks, consts, q)
        return back(jit.round_divided(blocks, divisor, bits, p, bad)).to(x.dtype)
    rule = pow2_rule(c)
    if rule is None:
        return None
    ks, bad, _, kmin, kmax, _ = jit.pow2_block_scales(blocks, rule)
    fmt = c.format
    if (kmin != jit.NO_ROW and kmin + fmt.qmin < -149) or kmax + fmt.emax >= 128:
        return None
    tgt = rounding.target_of(fmt)
    if c.rounding not in _VECTOR_ROUNDINGS or not (tgt.signed and tgt.has_zero):
        return back(jit.round_bits(blocks, None, bits, ks[:, None], p, bad)).to(x.dtype)
    return back(jit.round_pow2_rows(blocks, bits, ks, bad, p)).to(x.dtype)
