"""A cast's route through the fused scan pass, decided once per cast: which scale step it
takes and the plain numbers the pass reads for it (:class:`FlatRoute`), or None where the pass
does not take it and the cast's own steps (:func:`cast_blocks`)
count instead.

The pass (:func:`driftcli.kernels.jit.clip_counts`) reads a float32 slice once for every cast
of a scan; it takes the casts whose scale groups are runs of consecutive elements of the
flattened tensor: one scale for the tensor (or none), or blocks along the last axis under a
power-of-two rule written as a threshold or under the two-level rule, in drift's exact scale
arithmetic.

Below it, the cast's steps as public functions, each choosing its back-end here: the groups'
amax (:func:`block_amax`, :func:`block_ranges`), their scales (:func:`group_scales`), the
values (:func:`cast_elements`) and the counts block-stats makes of groups
(:func:`block_summary`, :func:`key_counts`, :func:`fused_summary`).

Last, ``quantize``'s route for a tensor (:func:`cast_route`, a :class:`CastRoute`), decided once
and followed by :func:`driftcli.casts.quantization.quantize`: a one-pass values cast
(:func:`cast_values`), the block cast (:func:`cast_blocks`) and its masks
(:func:`element_masks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Any

import numpy as np
import torch

from driftcli import kernels
from driftcli.casts import rounding
from driftcli.casts.fouroversix import four_over_six_scales, fused_values
from driftcli.casts.microscale import micro_scales, micro_values, numba_values
from driftcli.casts.scalearith import (
    ArithScales,
    apply_ops,
    arith_scales,
    group_amax,
    row_amax,
    undo_ops,
)
from driftcli.casts.scaling import (
    ScalePlan,
    binade_and_significand,
    block_stats,
    plan_divisors,
    plan_pow2_exponents,
    plan_two_level_scales,
    pow2_exponents,
    pow2_range,
    rule_threshold,
    to_blocks,
    two_level_scales,
)
from driftcli.errors import DriftError
from driftcli.kernels import jit
from driftcli.kernels.jit import PIECE
from driftcli.records.cast import Cast, Scaling
from driftcli.records.formats import Format
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


class ScaleStep(StrEnum):
    """How the fused pass finds a cast's scale."""

    TENSOR_DIVISOR = "tensor-divisor"
    """One divisor for the slice (the tensor's, from its amax)."""
    TENSOR_POW2 = "tensor-pow2"
    """One power of two for the slice (a tensor's power-of-two rule; 2**0 unscaled)."""
    BLOCK_POW2 = "block-pow2"
    """A power-of-two rule's scale per block, from the block's amax."""
    TWO_LEVEL = "two-level"
    """A two-level (NVFP4) scale per block, from its amax and the tensor's."""


_NO_RULE = np.zeros(6, dtype=np.int64)
_NO_CONSTS = np.ones(5, dtype=np.float32)
_NO_Q = np.zeros(18, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class FlatRoute:
    """What the fused pass reads for one cast."""

    kind: ScaleStep
    """How its scale is found."""
    block: int
    """Elements per scale group; 0 for one scale for the tensor."""
    rule: np.ndarray
    """A power-of-two rule's vector (:func:`driftcli.casts.quantization.pow2_rule`)."""
    consts: np.ndarray
    """A two-level cast's float32 constants
    (:func:`~driftcli.casts.quantization.two_level_consts`)."""
    q: np.ndarray
    """And its scale rounding's parameters."""
    ends: tuple[float, float, float]
    """The element format's max, min and smallest normal."""
    blocked: bool
    """A group holding NaN or inf is NaN whole (block scalings)."""
    needs_amax: bool
    """Its scale reads the tensor's amax (a tensor scale, two-level)."""

    @property
    def two_level(self) -> bool:
        """A two-level scale per block (whose scale rounding ``q`` the pass compiles in)."""
        return self.kind is ScaleStep.TWO_LEVEL

    @property
    def tensor_pow2(self) -> bool:
        """One power of two for the tensor (whose grid a float32 cast may leave)."""
        return self.kind is ScaleStep.TENSOR_POW2


@cache
def flat_route(c: Cast, shape: tuple[int, ...], axis: int, dtype: torch.dtype) -> FlatRoute | None:
    """The route of ``c`` through the fused pass for a tensor of ``shape`` and ``dtype``, its
    blocks along ``axis``; None where the pass does not take it: a dtype other than float32,
    a scale arithmetic or micro-exponents, a transform, blocks that are not runs of the
    flattened tensor or do not divide the pass's piece (:data:`driftcli.kernels.jit.PIECE`:
    no block straddles two), a block rule that is neither a
    power-of-two threshold nor two-level."""
    s, elem = c.scaling, c.format
    if dtype != torch.float32 or not shape or not s.arithmetic.exact or c.micro is not None \
            or c.rht is not None:
        return None
    ends = (float(elem.max), float(elem.min), float(elem.smallest_normal))
    if s.granularity in (Granularity.TENSOR, Granularity.NONE):
        pow2 = s.granularity is Granularity.NONE or bool(s.rule is not None and
                                                       s.rule.power_of_two)
        step = ScaleStep.TENSOR_POW2 if pow2 else ScaleStep.TENSOR_DIVISOR
        return FlatRoute(step, 0, _NO_RULE, _NO_CONSTS, _NO_Q, ends, False,
                         s.granularity is Granularity.TENSOR)
    if s.granularity is not Granularity.BLOCK or axis % len(shape) != len(shape) - 1 or \
            shape[-1] % s.block or PIECE % s.block:
        return None
    if s.rule is ScaleRule.TWO_LEVEL:
        consts, q = two_level_consts(c)
        return FlatRoute(ScaleStep.TWO_LEVEL, s.block, _NO_RULE, consts,
                         np.asarray(q, dtype=np.int64), ends, True, True)
    rule = pow2_rule(c) if s.rule is not None and s.rule.power_of_two else None
    if rule is None:
        return None
    return FlatRoute(ScaleStep.BLOCK_POW2, s.block, rule, _NO_CONSTS, _NO_Q, ends, True, False)


def one_scale(c: Cast, route: FlatRoute, amax: float) -> tuple[int, float, bool]:
    """A one-scale route's scale for a tensor whose largest finite magnitude is ``amax``: the
    exponent of a power of two, or the float32 divisor, by the rule's own steps
    (:func:`driftcli.casts.quantization.plan_scales`); and whether it was clamped."""
    if c.scaling.granularity is Granularity.NONE:
        return 0, 1.0, False
    top = torch.tensor([amax], dtype=torch.float32)
    plan = ScalePlan.of(c.format, c.scaling)
    scale, clamped = plan_scales(top, top[0], plan.divisors(top), plan=plan)
    if route.kind is ScaleStep.TENSOR_POW2:
        return int(scale[0]), 1.0, bool(clamped[0])
    return 0, float(scale[0]), bool(clamped[0])


# --- the cast's steps: block amax, scales, values, counts (issue 41) ---------------------------
# Each step chooses its back-end here (numba's kernels in driftcli.kernels.jit, or torch's ops),
# with the same bits on each; the layers above (measures/, verify/, runs/) call the steps and
# never a kernel or a scale rule's pieces. The exact twins are in driftcli.oracle: the block
# amax and the scales of oracle.quantization.cast_block (scale_only=True), the values of
# oracle.quantization.cast_block and cast_group.

def block_amax(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of 2-D float32 or float64 ``blocks``: the largest finite magnitude (0 for none)
    and whether the row holds NaN or inf. numba: :func:`driftcli.kernels.jit.block_amax`;
    torch: :func:`driftcli.casts.scaling.block_stats`."""
    if kernels.numba_runs(blocks):
        return jit.block_amax(blocks.contiguous())
    found = block_stats(blocks)
    return found.amax, found.nonfinite


def block_ranges(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of 2-D float32 or float64 ``blocks``: the largest finite magnitude (0 for
    none), the smallest nonzero finite one (inf for none), the binades from it to the largest,
    ``floor(log2 top) - floor(log2 low)`` (-1 for none), and whether it holds NaN or inf.
    The numba back-end is :func:`driftcli.kernels.jit.block_ranges`; this is its torch
    twin."""
    if kernels.numba_runs(blocks):
        return jit.block_ranges(blocks.contiguous())
    finite = torch.isfinite(blocks)
    mags = blocks.abs()
    top = torch.where(finite, mags, 0.0).amax(dim=1)
    low = torch.where(finite & (blocks != 0), mags, torch.inf).amin(dim=1)
    has = torch.isfinite(low)
    span = binade_and_significand(torch.where(has, top, 1.0))[0] - \
        binade_and_significand(torch.where(has, low, 1.0))[0]
    return top, low, torch.where(has, span, -1), ~finite.all(dim=1)


def group_ranges(two: Tensor, scaling: Scaling, along: int,
                 keep: bool) -> tuple[Tensor | None, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The scale groups of 2-D ``two`` under ``scaling``, their blocks running along axis
    ``along`` (0: the columns, the transpose's blocks), one row each, and their
    :func:`block_ranges`. Without ``keep`` the numba back-end reads the columns of block and
    channel groups in place, and the rows come back None."""
    if along % 2 == 0 and not keep and kernels.numba_runs(two) and \
            scaling.granularity in (Granularity.BLOCK, Granularity.CHANNEL):
        k = scaling.block if scaling.granularity is Granularity.BLOCK else two.shape[0]
        return None, jit.block_ranges(two.contiguous(), k)
    blocks = to_blocks(two, scaling, along)[0].contiguous()
    return blocks, block_ranges(blocks)


def powers_of_two(k: Tensor, sf: Format | None) -> Tensor:
    """``2**k`` in float64 for the exponents ``k`` of a power-of-two scale in ``sf``."""
    low, high = pow2_range(sf) if sf is not None else (-1075, 1024)
    if low >= -1022 and high <= 1023:
        # every value of the format is a float64 normal: write its exponent field (exact,
        # and several times cheaper than ldexp, which multiplies by a computed power)
        return ((k.long() + 1023) << 52).view(torch.float64)
    return torch.ldexp(torch.ones_like(k, dtype=torch.float64), k.double())


@dataclass(frozen=True)
class GroupScales:
    """Each scale group's scale, as :func:`group_scales` chose it."""

    value: Tensor
    """The scale as the scale format holds it, float64: ``2**k`` for a power-of-two rule, a
    two-level cast's block scale (without its tensor scale), a micro-scaled cast's first-level
    scale, the divisor for the other rules."""
    exponent: Tensor | None
    """A power-of-two rule's ``k`` (int64); None for the other rules."""
    divisor: Tensor | None
    """What the elements are divided by, in the amax's dtype (a two-level cast's block scale
    times its tensor scale); None where they are not divided (a power-of-two grid, micro
    exponents)."""


def _two_level_numba(amax: Tensor, c: Cast) -> tuple[Tensor, Tensor, Tensor] | None:
    """A two-level cast's block scales (float64, and their float32 bits) and float32 divisors
    by castcode's kernel (the one ``quantize`` runs, each group's amax a block of one), or
    None where it does not apply: not float32, not the numba back-end, or a divisor below
    float32's normals.

    The kernel gives the divisor ``fl32(b * S)`` of the block scale ``b`` (a value of the
    scale format, ``mbits + 1`` significant bits at most) and the tensor scale ``S``. Where the
    divisor is a float32 normal its relative error is at most 2**-24, and the float64 quotient
    by ``S`` adds 2**-53: far inside half the spacing (2**-(mbits+1) relative) of the scale
    format's values, so rounding the quotient to ``mbits + 1`` significant bits gives ``b``
    back exactly (:func:`driftcli.kernels.blockcode.two_level_values_kernel`)."""
    sf = c.scaling.scale_format
    if amax.dtype != torch.float32 or sf is None or sf.integer or \
            not kernels.numba_runs(amax) or not amax.numel():
        return None
    consts, q = two_level_consts(c)
    # without a given tensor amax the kernel takes the largest of the rows: amax.max()
    divisor = jit.two_level_block_scales(amax.reshape(-1, 1).contiguous(), consts, q).scale
    got = jit.two_level_values(amax, divisor, consts, 52 - sf.mbits)
    return None if got is None else (got[0], got[1], divisor)


def group_scales(c: Cast, amax: Tensor | None = None, *, blocks: Tensor | None = None,
                 tensor_amax: Tensor | None = None) -> GroupScales:
    """Each group's scale under ``c``'s rule, from the groups' ``amax`` (finite, as
    :func:`block_amax` gives it), the one ``quantize`` divides by; ``tensor_amax`` (a scalar,
    or one per group) is the amax the rule reads beside the group's (two-level, per tensor),
    ``amax.max()`` when not given. A micro-scaled cast reads its groups' elements, ``blocks``
    (its first-level scales). Exact twin: :func:`driftcli.oracle.quantization.cast_block` with
    ``scale_only`` (the divisor; ``micro_first_scale`` for micro exponents)."""
    s = c.scaling
    if c.micro is not None:
        if blocks is None:
            raise DriftError(f"the scales of {c} read its groups' elements: give blocks=")
        sc = micro_scales(blocks, c.format, c.micro)
        return GroupScales(sc.s, None, None)
    if amax is None:
        if blocks is None:
            raise DriftError("group_scales needs the groups' amax or their elements")
        amax = block_amax(blocks)[0]
    plan = ScalePlan.of(c.format, s)
    rule = plan.rule
    if rule.power_of_two:
        vector = pow2_rule(c) if amax.dtype == torch.float32 and kernels.numba_runs(amax) \
            else None
        if vector is not None:  # castcode's scale kernel, each group's amax a block of one
            k = jit.pow2_block_scales(amax.reshape(-1, 1).contiguous(), vector).scale
        else:
            k, _ = plan_pow2_exponents(amax, plan)
        return GroupScales(powers_of_two(k, s.scale_format), k, None)
    top = amax.max() if tensor_amax is None else tensor_amax
    fast = _two_level_numba(amax, c) if rule is ScaleRule.TWO_LEVEL and tensor_amax is None \
        and s.granularity is not Granularity.TENSOR else None
    if fast is not None:
        return GroupScales(fast[0], None, fast[2])
    if rule is ScaleRule.TWO_LEVEL:
        two = plan_two_level_scales(amax, top, plan.divisors(amax), plan)
        return GroupScales(two.block_scale.double(), None, two.divisor)
    divisor, _ = plan_divisors(amax, top, plan.divisors(amax), plan)
    return GroupScales(divisor.double(), None, divisor)


MAX_SPAN = 2200
"""Above any group's range in binades (float64: 2**1023 over 2**-1074 is 2097)."""

Summary = tuple[list[int], tuple[float, float], Tensor]
"""Counts (live, zero, nonfinite, clipped, scale at max, subnormal scale, scale at min,
range over span, largest range), the live scales' smallest and largest, and the live ranges'
histogram (groups per binade count)."""


def _count(mask: Tensor) -> int:
    return int(torch.count_nonzero(mask))  # several times faster than a bool sum


def block_summary(top: Tensor, span: Tensor, bad: Tensor, poison: bool, scale: Tensor,
                  clipped: Tensor, ends: tuple[float, float, float],
                  elem_span: int) -> Summary:
    """What block-stats counts of the groups' facts (their amax ``top``, ranges ``span``,
    NaN/inf flags ``bad``, scales and clip flags; ``ends``: the scale format's max, smallest
    normal, 0 where it has no subnormals, and smallest value; with ``poison`` a group holding
    NaN or inf is not counted but as nonfinite). The numba back-end is
    :func:`driftcli.kernels.jit.block_summary`; this is its torch twin."""
    if kernels.numba_runs(top, scale):
        return jit.block_summary(top, span, bad, poison, scale, clipped, ends, elem_span,
                                 MAX_SPAN)
    finite = ~bad if poison else torch.ones_like(bad)
    live = finite & (top > 0)
    ranges = span[live]
    sl = scale.double()[live]
    counts = [_count(live), _count(finite & (top == 0)), _count(bad), _count(clipped & finite),
              _count(sl == ends[0]), _count(sl < ends[1]), _count(sl == ends[2]),
              _count(ranges > elem_span), int(ranges.max()) if ranges.numel() else 0]
    lo = float(sl.min()) if sl.numel() else math.inf
    hi = float(sl.max()) if sl.numel() else 0.0
    return counts, (lo, hi), torch.bincount(ranges, minlength=MAX_SPAN + 1)


def key_counts(keys: Tensor, finite: Tensor) -> tuple[int, Tensor]:
    """The smallest of the integer ``keys`` where ``finite`` holds, and how many ``finite``
    groups hold each key from it up to the largest (empty for none). The numba back-end is
    :func:`driftcli.kernels.jit.key_counts`; this is its torch twin."""
    if kernels.numba_runs(keys, finite):
        return jit.key_counts(keys, finite)
    k = keys[finite].long()
    if not k.numel():
        return 0, torch.zeros(0, dtype=torch.int64)
    low = int(k.min())
    return low, torch.bincount(k - low)


def fused_summary(amax: Tensor, span: Tensor, bad: Tensor, poison: bool, c: Cast,
                  ends: tuple[float, float, float], elem_span: int
                  ) -> tuple[Summary, Tensor, Tensor] | None:
    """:func:`group_scales`, the clip flags, :func:`block_summary` and the groups per scale
    of float32 groups in one numba pass after castcode's scale kernel
    (:func:`driftcli.kernels.jit.fused_summary`): the summary, the scales found (float64)
    and the finite groups with each. For the casts whose scales that kernel computes (a
    power-of-two rule written as a threshold, a two-level rule into a narrow float scale
    format) on a symmetric element format with block or channel scales; None for the others
    (and where a key falls outside the counted range), which take the steps one by one."""
    s = c.scaling
    sf = s.scale_format
    if amax.dtype != torch.float32 or not kernels.numba_runs(amax) or sf is None or \
            -c.format.min != c.format.max or \
            s.granularity not in (Granularity.BLOCK, Granularity.CHANNEL):
        return None
    rule = s.rule
    big = float(c.format.max)
    if rule is not None and rule.power_of_two:
        vector = pow2_rule(c)
        if vector is None:
            return None
        ks = jit.pow2_block_scales(amax.reshape(-1, 1).contiguous(), vector).scale
        low, high = pow2_range(sf)
        got = jit.fused_summary(amax, span, bad, poison, ks, None, big, 0,
                                (low, high - low + 1), ends, elem_span, MAX_SPAN)
        shift = 0
    elif rule is ScaleRule.TWO_LEVEL and sf.bits <= 16 and not sf.integer:
        two = _two_level_numba(amax, c)
        if two is None:
            return None
        shift = 23 - sf.mbits
        got = jit.fused_summary(amax, span, bad, poison, None, two, big, shift,
                                (0, 1 << (31 - shift)), ends, elem_span, MAX_SPAN)
        low = 0
    else:
        return None
    counts, extremes, ranges, kcounts = got
    if counts[9]:
        return None
    present = kcounts.nonzero()[:, 0]
    keys = present + low
    if shift:
        values = (keys.int() << shift).view(torch.float32).double()
    else:
        values = powers_of_two(keys, sf)
    return (counts[:9], extremes, ranges), values, kcounts[present]


@dataclass(frozen=True)
class ElementCast:
    """A cast of a tensor, element by element, in the tensor's layout."""

    values: Tensor
    """The dequantized values, in the cast's working dtype."""
    codes: Tensor
    """Each element's code, decoded: its value on the element grid before the scale (NaN
    where the value is NaN for want of a scale)."""
    scales: Callable[[], Tensor]
    """Each element's scale, float64 (its group's divisor; NaN for a nonfinite group), made
    when called."""


def cast_elements(x: Tensor, c: Cast, axis: int = -1, tensor_amax: float | None = None, *,
                  random_bits: Tensor | None = None,
                  sr_bits: int = DEFAULT_SR_BITS) -> ElementCast:
    """Cast ``x`` under ``c`` (its blocks along ``axis``; ``tensor_amax``: the whole tensor's
    when ``x`` is a slice of it): each element's value, code and scale, by the steps
    ``quantize`` takes with ``return_info``. Exact twin:
    :func:`driftcli.oracle.quantization.cast_block` per group."""
    b = cast_blocks(x, c, axis, random_bits, sr_bits, tensor_amax)
    codes = element_masks(b, c, sr_bits).codes

    def scales() -> Tensor:
        return b.back(b.scales[:, None].expand(b.blocks.shape).contiguous())

    return ElementCast(b.back(b.q), b.back(codes), scales)


# --- quantize's route: decided once per cast and tensor (issue 41) -----------------------------
# quantize (driftcli.casts.quantization) asks cast_route which steps cast a tensor and on which
# back-end, then follows the record: below, the block cast those steps make (one row per scale
# group), the masks of what it did, and the numba passes that cast values alone.

class Backend(StrEnum):
    """Where a route's block steps run (:mod:`driftcli.kernels`): the same bits on each."""

    NUMBA = "numba"
    TORCH = "torch"


class ValuesStep(StrEnum):
    """The numba cast :func:`~driftcli.casts.quantization.quantize` tries first when only the
    values are asked (no masks); each may decline on what it reads, and then the
    :class:`BlockStep` casts, with the same bits."""

    MICRO = "micro"
    """Micro-exponents' scales and elements in one pass
    (:func:`driftcli.casts.microscale.numba_values`)."""
    POW2_ROWS = "pow2-rows"
    """A power-of-two rule written as a threshold: the block exponents in one pass, then each
    row rounded on its grid (:func:`driftcli.kernels.jit.round_pow2_rows`); declines where a
    grid leaves float32's range."""
    POW2_BITS = "pow2-bits"
    """The same exponents, then :func:`driftcli.kernels.jit.round_bits`: the roundings and
    element formats (unsigned, no zero) ``round_pow2_rows`` does not take."""
    TWO_LEVEL = "two-level"
    """A two-level rule's block divisors in one pass, then the rows divided and rounded."""
    FOUR_OVER_SIX = "four-over-six"
    """Four over six's values in one pass (:func:`driftcli.casts.fouroversix.fused_values`);
    declines on a block holding NaN or inf."""


class BlockStep(StrEnum):
    """How :func:`cast_blocks` casts the scale groups: ``quantize``'s route with
    ``return_info``, and the fallback of a declined :class:`ValuesStep`."""

    ARITH = "arith"
    """A scale arithmetic (:mod:`driftcli.casts.scalearith`): float32, the rows through its
    apply and undo operations."""
    MICRO = "micro"
    """Micro-exponents (:func:`driftcli.casts.microscale.micro_values`)."""
    UNSCALED = "unscaled"
    """No scale, or no element: the elements rounded as they are."""
    POW2 = "pow2"
    """A power-of-two rule: each row rounded on its scaled grid (in float64 where a grid
    leaves float32's range, :func:`needs_wide`)."""
    DIVIDED = "divided"
    """Another rule: each row divided by its scale, rounded, multiplied back."""


@dataclass(frozen=True)
class CastRoute:
    """A cast's route for one tensor, as :func:`cast_route` decided it."""

    values: ValuesStep | None
    """The one-pass values cast tried first when only values are asked; None for none."""
    blocks: BlockStep
    """The block cast's steps."""
    backend: Backend
    """Where the block cast's amax, scales and rounding run. Micro-exponents' and the unscaled
    rounding's own kernels choose theirs (:mod:`driftcli.casts.microscale`,
    :mod:`driftcli.casts.rounding`)."""


_VECTOR_ROUNDINGS = (Rounding.RNE, Rounding.SR)
"""The rounding modes of :func:`driftcli.kernels.jit.round_pow2_rows` (the others round
power-of-two blocks with :func:`driftcli.kernels.jit.round_bits`)."""


def cast_route(c: Cast, x: Tensor, axis: int = -1,
               random_bits: Tensor | None = None) -> CastRoute:
    """The route ``quantize`` takes to cast ``x`` (its blocks along ``axis``, stochastic
    rounding reading ``random_bits``) under ``c``: decided here once, from the cast and the
    tensor's dtype, size and device (and whether it needs a gradient, which numba's kernels
    refuse). The axis does not change today's route; it is the route's input all the same."""
    del axis  # every step reads its groups along any axis alike
    if kernels.numba_runs(x, random_bits):
        return _numba_route(c, x.dtype == torch.float32, x.numel() == 0)
    return CastRoute(None, _block_step(c, x.numel() == 0), Backend.TORCH)


def _block_step(c: Cast, empty: bool) -> BlockStep:
    s = c.scaling
    if not s.arithmetic.exact:
        return BlockStep.ARITH
    if c.micro is not None:
        return BlockStep.MICRO
    if s.granularity is Granularity.NONE or empty:
        return BlockStep.UNSCALED
    return BlockStep.POW2 if s.rule is not None and s.rule.power_of_two else BlockStep.DIVIDED


@cache
def _numba_route(c: Cast, float32: bool, empty: bool) -> CastRoute:
    """The route of ``c`` on the numba back-end (once per cast: ``quantize`` casts small
    tensors many times in a training step)."""
    blocks = _block_step(c, empty)
    values = _values_step(c, blocks) if float32 and not empty else None
    return CastRoute(values, blocks, Backend.NUMBA)


def _values_step(c: Cast, blocks: BlockStep) -> ValuesStep | None:
    """The one-pass values cast of ``c`` on a nonempty float32 tensor numba casts."""
    s = c.scaling
    if blocks is BlockStep.MICRO:
        return ValuesStep.MICRO
    if blocks is BlockStep.ARITH:
        four = s.arithmetic.two.four_over_six and c.rounding is Rounding.RNE and \
            c.overflow is Overflow.SATURATE and s.granularity in (Granularity.BLOCK,
                                                                  Granularity.TILE)
        return ValuesStep.FOUR_OVER_SIX if four else None
    if s.granularity is not Granularity.BLOCK:
        return None
    if blocks is BlockStep.DIVIDED:
        return ValuesStep.TWO_LEVEL if s.rule is ScaleRule.TWO_LEVEL else None
    if blocks is not BlockStep.POW2 or pow2_rule(c) is None:
        return None
    tgt = rounding.target_of(c.format)
    lean = c.rounding in _VECTOR_ROUNDINGS and tgt.signed and tgt.has_zero
    return ValuesStep.POW2_ROWS if lean else ValuesStep.POW2_BITS


def fused_block_cast_applies(x: Tensor, c: Cast) -> bool:
    """Whether :func:`~driftcli.casts.quantization.quantize` casts ``x`` under ``c`` in two
    numba passes (a float32 CPU tensor, blocks of a power-of-two rule written as a threshold
    or of the two-level rule, drift's exact scale arithmetic); otherwise it takes the general
    steps, with the same bits."""
    return cast_route(c, x).values in (ValuesStep.POW2_ROWS, ValuesStep.POW2_BITS,
                                       ValuesStep.TWO_LEVEL)


def cast_values(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None, sr_bits: int,
                route: CastRoute) -> Tensor | None:
    """``quantize(x, c)``'s values by the route's :class:`ValuesStep`, or None where it has
    none or it declines (then :func:`cast_blocks`)."""
    step = route.values
    if step is None:
        return None
    if step is ValuesStep.FOUR_OVER_SIX:
        return fused_values(x, c, axis)
    s = c.scaling
    blocks, back = to_blocks(x, s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    if step is ValuesStep.MICRO:
        values = numba_values(blocks, bits, c, sr_bits)
        return None if values is None else back(values).to(x.dtype)
    p = rounding.jit_params(src=rounding.source_of(torch.float32),
                            tgt=rounding.target_of(c.format), rounding=c.rounding,
                            overflow=c.overflow, sr_bits=sr_bits)
    if step is ValuesStep.TWO_LEVEL:
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
    if step is ValuesStep.POW2_BITS:
        return back(jit.round_bits(blocks, None, bits, ks[:, None], p, bad)).to(x.dtype)
    return back(jit.round_pow2_rows(blocks, bits, ks, bad, p)).to(x.dtype)


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
                   tensor_amax: Tensor, *, c: Cast, sr_bits: int, pow2: bool,
                   wide: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Dequantized rows, each row's scale and whether it clamped, from the rows' amax."""
    scale, clamped = _scales(amax, tensor_amax, c)
    s = c.scaling
    q = _apply(blocks, bits, scale, nonfinite, tgt=rounding.target_of(c.format),
               mode=c.rounding, overflow=c.overflow, sr_bits=sr_bits, pow2=pow2,
               blocked=s.blocked, wide=wide)
    return q, scale, clamped


def amax_and_nonfinite(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's finite amax and whether it holds NaN or inf, by torch's ops."""
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
                tensor_amax: float | None, route: CastRoute | None = None) -> Blocked:
    """The cast of every scale group of ``x`` by the steps of ``route`` (:func:`cast_route`'s
    when not given); ``tensor_amax`` stands in for the tensor's own amax when ``x`` is one
    slice of a larger tensor (per-tensor and two-level scales)."""
    if route is None:
        route = cast_route(c, x, axis, random_bits)
    if route.blocks is BlockStep.ARITH:
        return _cast_blocks_arith(x, c, axis, random_bits, sr_bits, tensor_amax,
                                  route.backend is Backend.NUMBA)
    if route.blocks is BlockStep.MICRO:
        return _cast_blocks_micro(x, c, axis, random_bits, sr_bits)
    work = working(x)
    elem, s = c.format, c.scaling
    blocks, back = to_blocks(work, s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    n_rows = blocks.shape[0]
    no_blocks = torch.zeros(n_rows, dtype=torch.bool, device=blocks.device)
    rule = s.rule
    pow2 = route.blocks is BlockStep.POW2
    tensor_scale = None
    if route.blocks is BlockStep.UNSCALED:
        q = rounding.round_values(blocks, None, elem, c.rounding, c.overflow, bits, sr_bits,
                                  blocks.dtype)
        ones = torch.ones(n_rows, dtype=torch.float64, device=blocks.device)
        return Blocked(blocks, q, ones, no_blocks, no_blocks, back, bits, None)
    if route.backend is Backend.NUMBA:
        amax, nonfinite = jit.block_amax(blocks)
        top = tensor_amax_of(amax, tensor_amax)
        if s.granularity is Granularity.TENSOR:
            amax = top.expand_as(amax)
        scale, clamped = _scales(amax, top, c)
        q = _jit_apply(blocks, bits, scale, nonfinite if s.blocked else None, c, sr_bits,
                       pow2, pow2 and needs_wide(amax, c))
    else:
        amax, nonfinite = amax_and_nonfinite(blocks)
        top = tensor_amax_of(amax, tensor_amax)
        if s.granularity is Granularity.TENSOR:
            amax = top.expand_as(amax)
        static: dict[str, Any] = {"c": c, "sr_bits": sr_bits, "pow2": pow2,
                                  "wide": pow2 and needs_wide(amax, c)}
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


def arith_operands(blocks: Tensor, c: Cast, row_length: int, tensor_amax: float | None,
                   use_jit: bool) -> tuple[ArithScales, Tensor, Tensor | None]:
    """The scale step of a scale arithmetic (:mod:`driftcli.casts.scalearith`, four over six's
    choice included) on nonempty float32 ``blocks`` (one row a scale group; ``row_length``:
    the elements along the block axis, for row-scaled casts): each row's operands, which rows
    hold NaN or inf, and the rows made NaN whole (None where none are: the amax policy lets
    NaN through the operations). :func:`cast_blocks` and the scan's given-scales step
    (:mod:`driftcli.casts.given`) both take it."""
    s, a = c.scaling, c.scaling.arithmetic
    finite_amax, bad = jit.block_amax(blocks) if use_jit else amax_and_nonfinite(blocks)
    amax = group_amax(blocks, finite_amax, bad, a.amax)
    top = tensor_amax_of(amax, tensor_amax)
    if a.two.row_scaled:  # one amax per row: a slice of whole rows needs no tensor amax
        top = row_amax(amax, row_length, s.block)
    if s.granularity is Granularity.TENSOR:
        amax = top.expand_as(amax).contiguous()
    sc = (four_over_six_scales(blocks, amax, top, c.format, a.two) if a.two.four_over_six
          else arith_scales(amax, top, c.format, s))
    poisoned = bad if s.blocked and a.amax is AmaxPolicy.FINITE else None
    return sc, bad, poisoned


def _cast_blocks_arith(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None,
                       sr_bits: int, tensor_amax: float | None, use_jit: bool) -> Blocked:
    """:func:`cast_blocks` under a scale arithmetic (:mod:`driftcli.casts.scalearith`): in float32,
    the scales by the arithmetic's operations, the elements through its apply and undo
    operations."""
    s = c.scaling
    blocks, back = to_blocks(x.float(), s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    n_rows = blocks.shape[0]
    if blocks.numel() == 0:
        none = torch.zeros(n_rows, dtype=torch.bool, device=blocks.device)
        ones = torch.ones(n_rows, dtype=torch.float64, device=blocks.device)
        return Blocked(blocks, blocks.clone(), ones, none, none, back, bits, None)
    sc, bad, poisoned = arith_operands(blocks, c, x.shape[axis] if x.dim() else 1,
                                       tensor_amax, use_jit)
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
               sr_bits: int, pow2: bool, wide: bool) -> Tensor:
    """:func:`_apply` on numba's kernels: the element cast of every row under its scale, and
    NaN for the ``bad`` rows of a block scaling."""
    if pow2:
        work = blocks.double() if wide else blocks
        p = rounding.jit_params(src=rounding.source_of(work.dtype),
                                tgt=rounding.target_of(c.format), rounding=c.rounding,
                                overflow=c.overflow, sr_bits=sr_bits)
        return jit.round_bits(work, None, bits, scale[:, None], p, bad).to(blocks.dtype)
    p = rounding.jit_params(src=rounding.source_of(blocks.dtype), tgt=rounding.target_of(c.format),
                            rounding=c.rounding, overflow=c.overflow, sr_bits=sr_bits)
    return jit.round_divided(blocks, scale, bits, p, bad)


def tensor_amax_of(amax: Tensor, given: float | None) -> Tensor:
    """The tensor's amax: ``given`` (a slice's whole tensor's) or the largest of the rows'."""
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
