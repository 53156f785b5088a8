"""How a tensor is scaled before its elements are cast.

A :class:`Scaling` has a granularity (which elements share a scale), a scale
format and a scale rule. The axis the blocks run along is not stored: the
caller (a matmul, a measurement) supplies it. Each rule's torch implementation
is its entry in :data:`FAST_RULES` (the exact one is in
:data:`driftcli.oracle.scaling.EXACT_RULES`).

Where every division happens (bit-exactness against a recipe depends on it):

- Power-of-two rules (``floor``, ``ceil``, ``even``, ``floor+k``): the scale
  is ``2**k`` with ``k`` an integer computed from the bits of amax. Elements
  are rounded directly onto the element grid times ``2**k``: no division and
  no multiplication is ever rounded.
- ``amax`` rules (real-valued): ``s = fl32(amax / M)`` with ``M`` the element
  format's max, optionally rounded into the scale format (``amax-rne``,
  ``amax-up``); elements ``y = fl32(x / s)`` are cast, and the dequantized
  value is ``fl32(q * s)``.
- ``two-level`` (NVFP4): a float32 tensor scale ``S = fl32(amax_tensor /
  fl32(Ms * M))`` (``Ms`` the scale format's max: 448 · 6 for NVFP4), block
  scales ``sb = cast_rne(fl32(fl32(amax_block / M) / S))`` in the scale
  format, the divisor ``d = fl32(sb * S)``, elements ``y = fl32(x / d)`` cast,
  dequantized ``fl32(q * d)``.

``fl32`` is one IEEE float32 operation, rounded to nearest even (float64 when
the tensor is float64). Edge cases: a trailing partial block is padded with
zeros; an all-zero block gets the scale format's smallest positive scale and
stays zero; a block holding NaN or ±inf gets a NaN scale and all its elements
become NaN (the OCP MX rule, applied to every block scaling), counted; a
scale outside the scale format's range is clamped to it, counted; per-tensor
and per-channel scales take amax over the finite elements and cast nonfinite
elements one by one. A two-level tensor scale below float32's smallest normal
is raised to it, and an all-zero tensor gets ``S = 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import cast

import torch

from driftcli.casts.rounding import Target, round_fused, target_of
from driftcli.errors import CastSpecError
from driftcli.records.cast import Scaling
from driftcli.records.formats import Format, pow2
from driftcli.records.modes import Granularity, Overflow, Rounding, ScaleRule, check_rule_table

Tensor = torch.Tensor


# --- blocking --------------------------------------------------------------------------------

def to_blocks(x: Tensor, scaling: Scaling, axis: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``x`` as a 2-D ``(n_blocks, block_elements)`` tensor and the function that undoes it.

    Partial blocks are padded with zeros; the inverse crops them again.
    """
    shape = x.shape
    if x.dim() == 0:
        x = x.reshape(1)
    if not -x.dim() <= axis < x.dim():
        raise CastSpecError(f"axis {axis} is out of range for a tensor of shape {tuple(shape)}")
    g = scaling.granularity
    if g in (Granularity.NONE, Granularity.TENSOR):
        return x.reshape(1, -1), lambda b: b.reshape(shape)
    moved = x.movedim(axis, -1)
    moved_shape = moved.shape
    if g is Granularity.CHANNEL:
        return moved.reshape(-1, moved_shape[-1]), \
            lambda b: b.reshape(moved_shape).movedim(-1, axis).reshape(shape)
    k = scaling.block
    if g is Granularity.BLOCK:
        n = moved_shape[-1]
        pad = -n % k
        padded = torch.nn.functional.pad(moved, (0, pad)) if pad else moved

        def unblock(b: Tensor) -> Tensor:
            out = b.reshape(*moved_shape[:-1], n + pad)[..., :n]
            return out.movedim(-1, axis).reshape(shape)

        return padded.reshape(-1, k), unblock
    # tiles: the axis and the one before it
    two = moved if moved.dim() >= 2 else moved.unsqueeze(0)
    lead, (rows, cols) = two.shape[:-2], two.shape[-2:]
    pr, pc = -rows % k, -cols % k
    padded = torch.nn.functional.pad(two, (0, pc, 0, pr)) if pr or pc else two
    R, C = rows + pr, cols + pc
    tiles = padded.reshape(*lead, R // k, k, C // k, k).transpose(-3, -2)

    def untile(b: Tensor) -> Tensor:
        t = b.reshape(*lead, R // k, C // k, k, k).transpose(-3, -2).reshape(*lead, R, C)
        t = t[..., :rows, :cols].reshape(moved_shape)
        return t.movedim(-1, axis).reshape(shape)

    return tiles.reshape(-1, k * k), untile


# --- scales ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockStats:
    """Per block: largest finite magnitude, and whether it holds a NaN or inf."""

    amax: Tensor
    nonfinite: Tensor


def block_stats(blocks: Tensor) -> BlockStats:
    """amax over the finite elements of each block, and which blocks hold NaN or inf."""
    finite = torch.isfinite(blocks)
    mags = torch.where(finite, blocks.abs(), torch.zeros_like(blocks))
    return BlockStats(mags.amax(dim=1), ~finite.all(dim=1))


def pow2_range(scale_format: Format) -> tuple[int, int]:
    """The exponents ``k`` whose ``2**k`` is a value of the scale format."""
    smallest = scale_format.smallest_positive
    low = smallest.numerator.bit_length() - smallest.denominator.bit_length()
    return low, scale_format.emax


_LAYOUT = {torch.float32: (torch.int32, 23, 127, 64), torch.float64: (torch.int64, 52, 1023, 128)}


def binade_and_significand(a: Tensor) -> tuple[Tensor, Tensor]:
    """``floor(log2 a)`` (int64) and ``a / 2**floor(log2 a)`` in [1, 2), for finite ``a > 0``,
    read from the bits (subnormals are first lifted by an exact power of two)."""
    itype, mbits, bias, lift = _LAYOUT[a.dtype]
    sub = a < torch.finfo(a.dtype).tiny
    lifted = torch.where(sub, a * 2.0**lift, a)
    bits = lifted.view(itype)
    exponent = (bits >> mbits).long() - bias - sub.long() * lift
    significand = ((bits & ((1 << mbits) - 1)) | (bias << mbits)).view(a.dtype)
    return exponent, significand


@dataclass(frozen=True)
class ScalePlan:
    """Everything a scale rule reads, as plain numbers and hashable kernel constants, so the
    rules below are pure tensor arithmetic that a compiler traces as one graph."""

    rule: ScaleRule
    elem_emax: int
    elem_max: float
    """The element format's largest finite value M."""
    elem_max_significand: float
    """``M / 2**emax``, in [1, 2)."""
    even_threshold: float
    """``2 - 2**-(mbits + 1)``: an amax significand at or above it rounds up to 2."""
    headroom: int
    low: int
    """The smallest ``k`` whose ``2**k`` the scale format holds."""
    high: int
    smallest: float
    """The scale format's smallest positive value."""
    largest: float
    scale_target: Target
    """The rounding kernel's constants of the scale format."""
    scale_special: bool
    """The scale format has inf or NaN (overflow shows as a nonfinite rounding)."""
    two_level_max: float
    """``Ms · M``: the scale format's max times the element's (two-level tensor scales)."""

    @staticmethod
    @cache
    def of(elem: Format, scaling: Scaling) -> ScalePlan:
        """The plan of a scaling with element format ``elem`` (cached)."""
        if scaling.rule is None:
            raise ValueError(f"a scale plan needs a scale rule; {scaling} has none")
        fmt = _scale_format(scaling)
        low, high = pow2_range(fmt)
        return ScalePlan(
            scaling.rule, elem.emax, float(elem.max), float(elem.max / pow2(elem.emax)),
            2 - 2.0 ** -(elem.mbits + 1), scaling.headroom, low, high,
            float(fmt.smallest_positive), float(fmt.max), target_of(fmt),
            fmt.has_inf or fmt.has_nan, float(fmt.max * elem.max))

    def divisors(self, like: Tensor) -> Tensor:
        """``[M, Ms · M]`` as a tensor of ``like``'s dtype and device. Divisors enter the
        rules as tensors, never as Python constants: a compiler rewrites division by a
        constant as multiplication by its reciprocal, which is not the IEEE quotient."""
        return torch.tensor([self.elem_max, self.two_level_max], dtype=like.dtype,
                            device=like.device)


def pow2_exponents(amax: Tensor, elem: Format, scaling: Scaling) -> tuple[Tensor, Tensor]:
    """Scale exponents ``k`` (int64) of power-of-two rules, and which of them were clamped.

    Exponents come from the bits, never from a floating log2: the largest
    float32 below 8.0 has binade 2, not 3.
    """
    return plan_pow2_exponents(amax, ScalePlan.of(elem, scaling))


def plan_pow2_exponents(amax: Tensor, plan: ScalePlan) -> tuple[Tensor, Tensor]:
    """:func:`pow2_exponents` from a :class:`ScalePlan`: the rule's :data:`ExponentRule`, then
    the headroom and the clamp every power-of-two rule shares."""
    zero = amax == 0
    e, significand = binade_and_significand(torch.where(zero, torch.ones_like(amax), amax))
    k = cast(ExponentRule, FAST_RULES[plan.rule])(e, significand, plan) + plan.headroom
    clamped = ((k < plan.low) | (k > plan.high)) & ~zero
    k = torch.where(zero, torch.full_like(k, plan.low), torch.clamp(k, plan.low, plan.high))
    return k, clamped


def plan_divisors(amax: Tensor, tensor_amax: Tensor, div: Tensor,
                  plan: ScalePlan) -> tuple[Tensor, Tensor]:
    """Each block's divisor under a rule that is not a power of two (its :data:`DivisorRule`),
    and whether its scale was clamped; ``div`` is :meth:`ScalePlan.divisors`."""
    return cast(DivisorRule, FAST_RULES[plan.rule])(amax, tensor_amax, div, plan)


def _scale_format(scaling: Scaling) -> Format:
    if scaling.scale_format is None:
        raise CastSpecError("this scaling has no scale format")
    return scaling.scale_format


def _into_scale_format(raw: Tensor, plan: ScalePlan,
                       mode: Rounding | None) -> tuple[Tensor, Tensor]:
    """``raw`` (> 0) rounded into the scale format (``None``: kept as is), and whether it had
    to be clamped: it overflowed the format under the rounding, or lay below its smallest
    positive value. Clamped scales are raised or lowered into the range."""
    if mode is None:
        scale, over = raw, raw > plan.largest
    else:
        scale = round_fused(raw.contiguous(), plan.scale_target,
                            mode, Overflow.IEEE)
        over = ~torch.isfinite(scale) if plan.scale_special else raw > plan.largest
    low = raw < plan.smallest
    scale = torch.where(over, plan.largest, torch.clamp(scale, min=plan.smallest))
    return scale, over | low


def real_scales(amax: Tensor, elem: Format, scaling: Scaling) -> tuple[Tensor, Tensor]:
    """Real-valued scales ``fl(amax / M)`` (optionally rounded into the scale format), clamped.

    Computed in ``amax``'s dtype (float32, or float64 for float64 tensors).
    """
    plan = ScalePlan.of(elem, scaling)
    return plan_real_scales(amax, plan.divisors(amax), plan)


def plan_real_scales(amax: Tensor, div: Tensor, plan: ScalePlan) -> tuple[Tensor, Tensor]:
    """:func:`real_scales` from a :class:`ScalePlan` and its :meth:`~ScalePlan.divisors`: the
    divisors of a rule that reads no tensor amax."""
    return plan_divisors(amax, amax, div, plan)


@dataclass(frozen=True)
class TwoLevel:
    """The scales of a two-level cast: per-block divisors, block scales, the tensor scale."""

    divisor: Tensor
    block_scale: Tensor
    tensor_scale: Tensor
    clamped: Tensor


def two_level_scales(amax: Tensor, tensor_amax: Tensor, elem: Format,
                     scaling: Scaling) -> TwoLevel:
    """NVFP4-style scales, every step one IEEE operation in ``amax``'s dtype (see module doc)."""
    plan = ScalePlan.of(elem, scaling)
    return plan_two_level_scales(amax, tensor_amax, plan.divisors(amax), plan)


def plan_two_level_scales(amax: Tensor, tensor_amax: Tensor, div: Tensor,
                          plan: ScalePlan) -> TwoLevel:
    """:func:`two_level_scales` from a :class:`ScalePlan` and its divisors."""
    tiny = torch.finfo(amax.dtype).tiny
    tensor_scale = torch.where(tensor_amax > 0, torch.clamp(tensor_amax / div[1], min=tiny),
                               torch.ones_like(tensor_amax))
    raw = (amax / div[0]) / tensor_scale
    block, clamped = _into_scale_format(raw, plan, Rounding.RNE)
    zero = amax == 0
    block = torch.where(zero, plan.smallest, block)
    return TwoLevel(block * tensor_scale, block, tensor_scale, clamped & ~zero)


# --- the rules -------------------------------------------------------------------------------

ExponentRule = Callable[[Tensor, Tensor, ScalePlan], Tensor]
"""A power-of-two rule's fast implementation: each block's scale exponent ``k`` (int64) from
its amax's binade ``floor(log2 amax)`` (int64) and significand (in [1, 2)), before the
headroom and the clamp to the scale format that :func:`plan_pow2_exponents` adds."""

DivisorRule = Callable[[Tensor, Tensor, Tensor, ScalePlan], tuple[Tensor, Tensor]]
"""Any other rule's: from the blocks' amax, the tensor's amax (``amax`` itself where the rule
reads none), :meth:`ScalePlan.divisors` and the plan, each block's divisor (the scale
format's smallest value for an all-zero block) and whether its scale was clamped."""


def _floor(e: Tensor, significand: Tensor, plan: ScalePlan) -> Tensor:
    """``floor(log2 amax) - emax_elem``."""
    return e - plan.elem_emax


def _ceil(e: Tensor, significand: Tensor, plan: ScalePlan) -> Tensor:
    """The smallest ``k`` with ``M * 2**k >= amax``."""
    # amax > max * 2**k, both significands in [1, 2): compare them
    return e - plan.elem_emax + (significand > plan.elem_max_significand).long()


def _even(e: Tensor, significand: Tensor, plan: ScalePlan) -> Tensor:
    """``floor`` of amax rounded (ties away) to the element's mantissa width."""
    # the significand rounds (ties away) to 2 at the element's mantissa width
    return e - plan.elem_emax + (significand >= plan.even_threshold).long()


def _ceil_amax(e: Tensor, significand: Tensor, plan: ScalePlan) -> Tensor:
    """``ceil(log2 amax) - emax_elem``: one binade up unless amax is a power of two."""
    return e - plan.elem_emax + (significand > 1).long()


EVEN_E2M1_THRESHOLD = 1.75
"""``even-e2m1``'s significand threshold: 2 - 2**-2, E2M1's ``even_threshold``."""


def _even_e2m1(e: Tensor, significand: Tensor, plan: ScalePlan) -> Tensor:
    """``floor`` of amax rounded (ties away) to one mantissa bit, whatever the element."""
    return e - plan.elem_emax + (significand >= EVEN_E2M1_THRESHOLD).long()


def real_rule(mode: Rounding | None) -> DivisorRule:
    """The rule ``fl(amax / M)`` rounded into the scale format by ``mode`` (None: kept as
    computed), one IEEE division in amax's dtype (M is exact there)."""

    def divisors(amax: Tensor, tensor_amax: Tensor, div: Tensor,
                 plan: ScalePlan) -> tuple[Tensor, Tensor]:
        scale, clamped = _into_scale_format(amax / div[0], plan, mode)
        zero = amax == 0
        return torch.where(zero, plan.smallest, scale), clamped & ~zero

    return divisors


def _two_level(amax: Tensor, tensor_amax: Tensor, div: Tensor,
               plan: ScalePlan) -> tuple[Tensor, Tensor]:
    two = plan_two_level_scales(amax, tensor_amax, div, plan)
    return two.divisor, two.clamped


FAST_RULES: dict[ScaleRule, ExponentRule | DivisorRule] = {
    ScaleRule.FLOOR: _floor,
    ScaleRule.CEIL: _ceil,
    ScaleRule.EVEN: _even,
    ScaleRule.AMAX: real_rule(ScaleRule.AMAX.rounding),
    ScaleRule.AMAX_RNE: real_rule(ScaleRule.AMAX_RNE.rounding),
    ScaleRule.AMAX_UP: real_rule(ScaleRule.AMAX_UP.rounding),
    ScaleRule.TWO_LEVEL: _two_level,
    ScaleRule.CEIL_AMAX: _ceil_amax,
    ScaleRule.EVEN_E2M1: _even_e2m1,
}
"""Each scale rule's fast implementation: an :data:`ExponentRule` for a power-of-two rule, a
:data:`DivisorRule` for any other (see :class:`~driftcli.records.modes.ScaleRule`; the exact ones
are
:data:`driftcli.oracle.scaling.EXACT_RULES`)."""
check_rule_table(FAST_RULES, "driftcli.casts.scaling.FAST_RULES")


def _fraction_bits(value: float) -> int | None:
    """The 23 fraction bits of a significand in [1, 2], or None when it has more; 2 gives
    ``2**23``, above every fraction."""
    f = (Fraction(value) - 1) * (1 << 23)
    return int(f) if f.denominator == 1 and 0 <= f <= (1 << 23) else None


THRESHOLD_RULES: dict[ScaleRule, Callable[[ScalePlan], tuple[float, bool]]] = {
    ScaleRule.FLOOR: lambda plan: (2.0, True),  # no significand in [1, 2) is above 2
    ScaleRule.CEIL_AMAX: lambda plan: (1.0, True),  # one binade up unless a power of two
    ScaleRule.CEIL: lambda plan: (plan.elem_max_significand, True),
    ScaleRule.EVEN: lambda plan: (plan.even_threshold, False),
    ScaleRule.EVEN_E2M1: lambda plan: (EVEN_E2M1_THRESHOLD, False),
}
"""The power-of-two rules written as a threshold on amax's significand (:func:`rule_threshold`),
keyed by member; a rule absent here is not written so, and its casts take the two-pass path."""


def rule_threshold(plan: ScalePlan) -> tuple[int, bool] | None:
    """A power-of-two rule as ``(threshold, strict)`` on float32 amaxes: its exponent is
    ``floor(log2 amax) - emax`` (plus the headroom, clamped), plus one where amax's significand,
    as 23 fraction bits, is above the threshold (``strict``) or at least it. The numba
    back-end's one-pass block scales read a rule so (:mod:`driftcli.kernels.castcode`); the
    tests compare every rule on every format with :data:`FAST_RULES`. None for a rule that is
    not written so (:data:`THRESHOLD_RULES`)."""
    written = THRESHOLD_RULES.get(plan.rule)
    if written is None:
        return None
    threshold, strict = written(plan)
    bits = _fraction_bits(threshold)
    return None if bits is None else (bits, strict)
