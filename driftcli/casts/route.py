"""A cast's route through the fused scan pass, decided once per cast: which scale step it
takes and the plain numbers the pass reads for it (:class:`FlatRoute`), or None where the pass
does not take it and the cast's own steps (:func:`driftcli.casts.quantization.cast_blocks`)
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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import cache

import numpy as np
import torch

from driftcli import kernels
from driftcli.casts.microscale import micro_scales
from driftcli.casts.quantization import (
    cast_blocks,
    element_masks,
    plan_scales,
    pow2_rule,
    two_level_consts,
)
from driftcli.casts.scaling import (
    ScalePlan,
    binade_and_significand,
    block_stats,
    plan_divisors,
    plan_pow2_exponents,
    plan_two_level_scales,
    pow2_range,
    to_blocks,
)
from driftcli.errors import DriftError
from driftcli.kernels import jit
from driftcli.kernels.jit import PIECE
from driftcli.records.cast import Cast, Scaling
from driftcli.records.formats import Format
from driftcli.records.modes import DEFAULT_SR_BITS, Granularity, ScaleRule

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
