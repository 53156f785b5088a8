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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cache
from typing import Any, NamedTuple

import numpy as np
import torch

from driftcli import kernels
from driftcli.casts import rounding
from driftcli.casts.fouroversix import fused_values
from driftcli.casts.given import arith_operands, given_counts, given_route
from driftcli.casts.hadamard import rht_problem, transform
from driftcli.casts.microscale import micro_scales, micro_values, numba_values
from driftcli.casts.scalearith import apply_ops, undo_ops
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
    """A power-of-two rule's vector (:func:`pow2_rule`)."""
    consts: np.ndarray
    """A two-level cast's float32 constants
    (:func:`two_level_consts`)."""
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
    (:func:`plan_scales`); and whether it was clamped."""
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


def merge_ranges(top: Tensor, low: Tensor, bad: Tensor, lines: int,
                 f: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`block_ranges` of the groups ``f`` times as long, from the facts (largest and
    smallest nonzero finite magnitude, NaN/inf flag) of groups laid out ``(lines, bands)``,
    each line's groups in order along it: each run of ``f`` groups of a line (the last one
    shorter where ``f`` does not divide ``bands``) is one longer group. Exact, as the zeros
    padding a partial group change neither magnitude. The numba back-end is
    :func:`driftcli.kernels.jit.merge_ranges`; this is its torch twin."""
    if kernels.numba_runs(top):
        return jit.merge_ranges(top.contiguous(), low.contiguous(), bad.contiguous(), lines, f)
    pad = -(top.numel() // lines if lines else 0) % f
    top, low, bad = (torch.nn.functional.pad(t.reshape(lines, -1), (0, pad), value=v)
                     .reshape(lines, -1, f) for t, v in ((top, 0.0), (low, math.inf),
                                                         (bad.to(torch.uint8), 0)))
    top, low, bad = top.amax(dim=2).reshape(-1), low.amin(dim=2).reshape(-1), \
        bad.amax(dim=2).reshape(-1).bool()
    has = torch.isfinite(low)
    span = binade_and_significand(torch.where(has, top, 1.0))[0] - \
        binade_and_significand(torch.where(has, low, 1.0))[0]
    return top, low, torch.where(has, span, -1), bad


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


# --- the counts of a cast over a tensor: the scan's steps (issue 41) ---------------------------
# What :mod:`driftcli.measures.stats` makes its record (``CastStats``) of: each count and float64
# sum of a cast, on the back-end chosen here, by the fused pass of every cast of a slice
# (:func:`fused_counts`) or one cast's own steps (:func:`count_cast`). The fields are
# ``CastStats``' by name; the measures above call these and never a kernel.

SUM_PIECE = PIECE
"""Elements per piece of the fused pass's float64 sums, counted from a slice's first element:
a slice starting on a multiple of it in the tensor has the tensor's pieces."""

ROUNDED_FIELDS = ("nonzero", "underflowed", "subnormal", "lost", "xx", "ee", "ex", "e_sum")
"""The count fields that need the rounded values (``None`` without them), in the order the
numba passes give them."""


class Counts(NamedTuple):
    """What a cast did to a tensor, counted: ``fields`` are ``CastStats``' fields by name
    (the rounded ones ``None`` when the rounding was skipped), ``partials`` the float64 sums
    known exactly as non-overlapping partials (the fused pass's; None where only the floats
    are known), ``values`` the dequantized cast when asked."""

    fields: dict[str, Any]
    partials: dict[str, tuple[float, ...]] | None = None
    values: Tensor | None = None


def _flat(x: Tensor) -> Tensor:
    return working(x).reshape(-1)


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


def error_terms(x: Tensor, q: Tensor, finite: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """``(valid, e, xv)`` of a cast ``q`` of ``x``, in float64: ``valid`` where both are finite
    (``finite``: ``x``'s mask, when already known), ``e = q - x`` and ``xv = x`` there, 0
    elsewhere. Every error sum of the torch back-end (of a cast, of an expected cast) is made
    of these terms, in this one way, so that they agree bit for bit."""
    xd, qd = x.double(), q.double()
    valid = (torch.isfinite(xd) if finite is None else finite) & torch.isfinite(qd)
    return valid, torch.where(valid, qd - xd, 0.0), torch.where(valid, xd, 0.0)


def error_sums(e: Tensor, xv: Tensor) -> list[Tensor]:
    """Σx², Σe², Σe·x, Σe of :func:`error_terms` (the ``xx ee ex e_sum`` of CastStats), the
    same bits for any thread count: torch splits a CPU sum across its threads, and a float64
    sum's last bits follow the split, so on the CPU numpy's pairwise sum (one thread) adds."""
    terms = [xv * xv, e * e, e * xv, e]
    if e.device.type != "cpu":
        return [t.sum() for t in terms]
    return [torch.tensor(t.contiguous().numpy().sum(), dtype=torch.float64) for t in terms]


def _abs_sum(x: Tensor) -> Tensor:
    """Σ|x| in float64: NaN or inf when ``x`` holds one (then :func:`slice_facts` masks)."""
    return x.abs().double().sum()


def _by_rounding(c: Cast, clipped: int) -> int:
    """The clips that only the rounding of a real scale made: all of a rule's that covers
    amax (every finite |x| is at most amax, so its exact quotient by amax / M is at most M)."""
    rule = c.scaling.rule
    return clipped if rule is not None and rule.covers_amax else 0


TENSOR_ROW = 1 << 12
"""Row length a per-tensor scaled tensor is folded into for the fused pass (zero padded:
zeros add nothing to any sum)."""

_WHOLE = (Granularity.TENSOR, Granularity.NONE)
"""Granularities whose one scale (a tensor's, or 2**0) the fused pass folds into rows of
:data:`TENSOR_ROW`."""


def _abs_max(blocks: Tensor) -> Tensor:
    """Each row's largest magnitude: NaN where the row holds a NaN, inf where it holds an
    inf and no NaN (max propagates NaN)."""
    return blocks.abs().amax(dim=1)


def _row_amax(blocks: Tensor, raw: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each row's amax over its finite elements and which rows hold a NaN or inf (as
    :func:`driftcli.casts.scaling.block_stats`), from the rows' NaN-propagating amax ``raw`` when
    given (shared from :class:`SliceFacts`): only the rows that hold a NaN or inf are then
    reduced again, masked."""
    if raw is None:
        return jit.block_amax(blocks) if kernels.numba_runs(blocks) else \
            amax_and_nonfinite(blocks)
    bad = ~torch.isfinite(raw)
    rows = bad.nonzero()[:, 0]
    if rows.numel():
        raw = raw.clone()
        raw[rows] = block_stats(blocks.index_select(0, rows)).amax
    return raw, bad


def run_length(shape: tuple[int, ...], c: Cast, axis: int) -> int:
    """How many consecutive elements of the flattened tensor each of ``c``'s scale groups
    is (a last one zero padded): :data:`TENSOR_ROW` for a tensor scale or none (as the fused
    pass folds them), the block for blocks along the last axis that divide it; 0 for any other
    layout (tiles, channels, blocks along another axis)."""
    s = c.scaling
    if not shape:
        return 0
    if s.granularity in _WHOLE:
        return TENSOR_ROW
    if s.granularity is Granularity.BLOCK and axis % len(shape) == len(shape) - 1 and \
            shape[-1] % s.block == 0:
        return s.block
    return 0


@dataclass(frozen=True)
class SliceFacts:
    """What every cast of one tensor, or one slice of it, shares: read from it once (see
    :func:`slice_facts`) instead of once per cast."""

    finite: int
    """Finite elements."""
    abs_sum: float
    """Σ|x| over them, in float64."""
    chunk: int = 0
    """Elements per entry of ``amax``; 0 without it."""
    amax: Tensor | None = None
    """Per run of ``chunk`` consecutive elements of the flattened input, its largest
    magnitude: NaN where the run holds a NaN, inf where an inf (as :func:`_abs_max`).
    A cast whose scale groups are whole runs of these (blocks along the last axis, a
    tensor scale) takes its groups' amax from it."""

    def group_amax(self, x: Tensor, c: Cast, axis: int) -> Tensor | None:
        """The raw amax of each row of ``c``'s block layout of ``x``, or None where the
        layout is not made of whole runs."""
        k = run_length(tuple(x.shape), c, axis)
        if self.amax is None or not k or k % self.chunk:
            return None
        r = k // self.chunk
        a = self.amax
        if a.numel() % r:  # a tensor scale's last row is zero padded, and so is this
            a = torch.nn.functional.pad(a, (0, -a.numel() % r))
        return a.view(-1, r).amax(dim=1) if r > 1 else a


def run_amax(x: Tensor, chunk: int) -> Tensor | None:
    """The largest magnitude of each run of ``chunk`` consecutive elements of ``x``
    flattened, NaN or inf where a run holds one (as :attr:`SliceFacts.amax`); None unless
    ``chunk`` divides ``x.numel()``."""
    flat = _flat(x)
    if not chunk or not flat.numel() or flat.numel() % chunk:
        return None
    if kernels.numba_runs(flat):
        return jit.slice_facts(flat, chunk)[0]
    return _abs_max(flat.view(-1, chunk))


def slice_facts(x: Tensor, chunk: int = 0, amax: Tensor | None = None) -> SliceFacts:
    """The :class:`SliceFacts` of ``x``: its :func:`run_amax` (given as ``amax``, or
    computed), its finite count and Σ|x|, in one read of ``x`` on the numba back-end."""
    flat = _flat(x)
    if kernels.numba_runs(flat) and flat.numel():
        runs, finite, abs_sum = jit.slice_facts(flat, 0 if amax is not None else chunk)
        amax = amax if amax is not None else runs
        return SliceFacts(finite, abs_sum, chunk if amax is not None else 0, amax)
    amax = amax if amax is not None else run_amax(flat, chunk)
    total = _abs_sum(flat)
    if flat.numel() == 0 or bool(torch.isfinite(total)):
        finite, abs_sum = flat.numel(), float(total)
    else:  # a NaN or inf: count and add up the finite elements only
        ok = torch.isfinite(flat)
        finite, abs_sum = int(ok.sum()), float(torch.where(ok, flat.abs(), 0.0).double().sum())
    return SliceFacts(finite, abs_sum, chunk if amax is not None else 0, amax)


def finite_amax(x: Tensor, runs: Tensor | None = None) -> float:
    """The largest finite magnitude in ``x`` (0 when there is none), as scales read it, from
    its :func:`run_amax` ``runs`` when given."""
    if x.numel() == 0:
        return 0.0
    flat = _flat(x)
    if runs is not None and runs.numel():
        return float(_row_amax(flat.view(runs.numel(), -1), runs)[0].max())
    n = flat.numel()
    rows = flat.view(-1, TENSOR_ROW) if n % TENSOR_ROW == 0 else flat.view(1, -1)
    return float(_row_amax(rows)[0].max())


def fused_takes(shape: tuple[int, ...], dtype: torch.dtype, casts: Sequence[Cast],
                axis: int = -1, rounded: bool = False) -> bool:
    """Whether :func:`fused_counts` counts every cast of ``casts`` on a tensor of ``shape``
    and ``dtype`` (on the numba back-end; ``rounded`` as there, without seeds: a stochastic
    cast is then not taken): then nothing else reads the tensor for them. (A power-of-two
    grid found out of float32's range sends a cast back to :func:`count_cast` even so.)"""
    moved = _axis_last(shape, axis)[0]
    rht = {i for m in rht_groups(casts, shape, axis, dtype).values() for i in m}
    return dtype == torch.float32 and kernels.jit_unavailable() is None and all(
        (flat_route(c, moved, -1, dtype) is not None or i in rht or
         given_route(c, shape, axis, dtype) is not None) and
        not (rounded and c.rounding is Rounding.SR) for i, c in enumerate(casts))


def count_cast(x: Tensor, c: Cast, *, axis: int = -1, random_bits: Tensor | None = None,
               seed: int | None = None, sr_bits: int = DEFAULT_SR_BITS,
               tensor_amax: float | None = None, want_values: bool = True,
               rounded: bool = True, facts: SliceFacts | None = None) -> Counts:
    """Cast ``x`` under ``c`` and count what happened (the steps of
    ``driftcli.measures.stats.cast_stats``, whose arguments these are), on the numba back-end
    in one pass after the scales (:func:`_numba_counts`) where it takes the cast, else by the
    torch back-end's block cast and masks (:func:`cast_blocks`, :func:`element_masks`)."""
    if not rounded:
        if want_values:
            raise DriftError("cast_stats: values need the rounding; pass want_values=False "
                             "with rounded=False")
        c = replace(c, rounding=Rounding.RTZ)  # clipping and scales do not depend on it
        seed = random_bits = None
    random_bits = checked_bits("cast_stats", x, c, seed, random_bits, sr_bits)
    if c.rht is not None:  # count the cast of what it reads: the transform of x
        x, c, facts = transform(x, c.rht, axis), replace(c, rht=None), None
    fused = _numba_counts(x, c, axis, random_bits, sr_bits, tensor_amax, want_values, rounded,
                          facts)
    if fused is not None:
        return fused
    b = cast_blocks(x, c, axis, random_bits, sr_bits, tensor_amax)
    m = element_masks(b, c, sr_bits)
    xd = b.blocks.double()
    scale = b.scales[:, None]
    valid, e, xv = error_terms(b.blocks, b.q, m.finite)
    xx, ee, ex, e_sum = (float(t) for t in error_sums(e, xv))
    mags = torch.where(m.finite, xd.abs(), 0.0)
    excess = torch.where(m.clipped, mags - float(c.format.max) * scale, 0.0)
    n_nonfinite = int((~m.finite).sum())
    fields: dict[str, Any] = dict(
        numel=x.numel(), nonfinite=n_nonfinite,
        nonzero=int(((xd != 0) & m.finite).sum()), groups=b.blocks.shape[0] if x.numel() else 0,
        clipped=int(m.clipped.sum()), clipped_by_rounding=_by_rounding(c, int(m.clipped.sum())),
        clipped_groups=int(m.clipped.any(dim=1).sum()),
        clip_excess=float(excess.sum()), abs_sum=float(mags.sum()),
        underflowed=int(m.underflowed.sum()), subnormal=int(m.subnormal.sum()),
        scale_clamped=int(b.clamped.sum()), nonfinite_groups=int(b.bad_blocks.sum()),
        lost=int((m.finite & ~valid).sum()), xx=xx, ee=ee, ex=ex, e_sum=e_sum)
    if not rounded:
        return Counts(fields | dict.fromkeys(ROUNDED_FIELDS))
    return Counts(fields, None, b.back(b.q).to(x.dtype) if want_values else None)


def policy_amax(x: Tensor, policy: AmaxPolicy) -> float:
    """The largest magnitude of ``x`` (as float32, as a scale arithmetic reads it) as ``policy``
    takes it over the elements: the finite ones (:func:`finite_amax`), all of them (a NaN
    makes it NaN, else an inf inf: ``torch.amax``), or all but NaN (``fmaxf``); 0 for no
    element. What a cast reads as the tensor's amax where ``x`` is the whole tensor."""
    if policy is AmaxPolicy.FINITE or x.numel() == 0:
        return finite_amax(x)
    mags = x.float().abs()
    if policy is AmaxPolicy.FMAX:
        mags = torch.where(torch.isnan(mags), 0.0, mags)
    return float(mags.amax())


def combined_amax(parts: Sequence[float]) -> float:
    """The amax of a tensor from its slices' :func:`policy_amax`: NaN where any is."""
    return math.nan if any(math.isnan(v) for v in parts) else max(parts, default=0.0)


def fused_counts(x: Tensor, casts: Sequence[Cast], *, axis: int = -1,
                 tensor_amax: float | None = None, rounded: bool = False,
                 seeds: Sequence[int | None] | None = None,
                 sr_bits: int = DEFAULT_SR_BITS,
                 rht_amax: dict[int, float] | None = None,
                 cast_amax: dict[int, float] | None = None) -> dict[int, Counts]:
    """:func:`count_cast` (``rounded`` as there) for every cast of ``casts`` the fused pass
    takes (:func:`flat_route`), keyed by the cast's index, in one read of
    ``x`` for all of them (and one first read for the tensor's amax where a cast needs it and
    ``tensor_amax`` is not given); the same counts, bit for bit, and the float sums within a few
    units in their last place (summed per piece in lanes, the pieces added exactly). A
    stochastic cast is taken with its ``seeds`` entry (its draws made as :func:`count_cast`
    makes them); the casts of one rounding mode and overflow policy share a pass. The casts
    whose scales the pass does not make (a scale arithmetic, micro-exponents) are counted with
    the operands their scale steps give (:mod:`driftcli.casts.given`), an ``rht=`` cast on the
    slice's transform (:func:`rht_groups`; ``rht_amax``: by cast index, the transformed
    tensor's amax where ``x`` is a slice of it; ``cast_amax``: by cast index, the whole tensor's
    amax as that cast's policy reads it, :func:`policy_amax`, where it is not the finite one).
    The casts it does not take, and every cast on the torch back-end, are left out:
    :func:`count_cast` counts them."""
    if x.numel() == 0 or x.dtype != torch.float32 or not kernels.numba_runs(x):
        return {}
    parsed = list(casts)
    shape, last = _axis_last(tuple(x.shape), axis)
    if not any(c.scaling.granularity is Granularity.BLOCK for c in parsed):
        shape, last = tuple(x.shape), None  # one scale: the layout does not matter
    found = {i: r for i, c in enumerate(parsed)
             if (r := flat_route(c, shape, -1, x.dtype)) is not None and
             (not rounded or c.rounding is not Rounding.SR or
              (seeds is not None and seeds[i] is not None))}
    moved = x if last is None else x.movedim(last, -1)
    flat = moved.reshape(-1).contiguous()
    top = tensor_amax
    if top is None and any(r.needs_amax for r in found.values()):
        top = jit.finite_top(flat)
    scales = {i: one_scale(parsed[i], r, top or 0.0) if not r.block else (0, 1.0, False)
              for i, r in found.items()}
    if rounded:  # a tensor's power-of-two grid out of float32's range: the torch back-end's
        found = {i: r for i, r in found.items() if not r.tensor_pow2 or
                 not needs_wide(torch.tensor([top or 0.0]), parsed[i])}
    # a pass per rounding mode and overflow policy, and per two-level scale rounding (both
    # constants of its code): every other cast joins the first pass of its mode
    passes: list[tuple[Any, list[Any], dict[int, Any]]] = []
    for i, r in found.items():
        c = parsed[i]
        mode = (c.rounding, c.overflow) if rounded else None
        q = [tuple(int(v) for v in r.q)] if r.two_level else []
        into = next((p for p in passes if p[0] == mode and (not q or p[1] in ([], q))), None)
        if into is None:
            into = (mode, q, {})
            passes.append(into)
        if q:
            into[1][:] = q
        into[2][i] = r
    out: dict[int, Counts] = {}
    for _, _, group in passes:
        out |= _fused_pass(x, flat, parsed, group, scales, top, rounded, seeds, sr_bits, last)
    out |= _given_pass(x, parsed, [i for i in range(len(parsed)) if i not in found], axis,
                       tensor_amax, rounded, seeds, sr_bits, cast_amax)
    for rht, members in rht_groups(parsed, tuple(x.shape), axis, x.dtype).items():
        got = fused_counts(transform(x, rht, axis), [without_rht(parsed[i]) for i in members],
                           axis=axis, rounded=rounded, sr_bits=sr_bits,
                           tensor_amax=next((rht_amax[i] for i in members
                                             if rht_amax and i in rht_amax), None),
                           seeds=None if seeds is None else [seeds[i] for i in members])
        out |= {members[j]: counts for j, counts in got.items()}
    return dict(sorted(out.items()))


def _given_pass(x: Tensor, parsed: list[Cast], rest: list[int], axis: int,
                tensor_amax: float | None, rounded: bool, seeds: Sequence[int | None] | None,
                sr_bits: int, cast_amax: dict[int, float] | None) -> dict[int, Counts]:
    """The casts of ``rest`` the given-scales step takes (:func:`driftcli.casts.given.
    given_route`; a stochastic one rounded only with its seed), counted in its pass
    (:func:`driftcli.casts.given.given_counts`)."""
    taken = [i for i in rest if given_route(parsed[i], tuple(x.shape), axis, x.dtype)
             is not None and (not rounded or parsed[i].rounding is not Rounding.SR or
                              (seeds is not None and seeds[i] is not None))]
    if not taken:
        return {}
    bits = [checked_bits("fused_stats", x, c, seeds[i], None, sr_bits)
            if rounded and c.rounding is Rounding.SR and seeds is not None else None
            for i, c in enumerate(parsed)]
    out = {}
    for i, g in given_counts(x, parsed, taken, axis=axis, tensor_amax=tensor_amax,
                             rounded=rounded, bits=bits, sr_bits=sr_bits,
                             cast_amax=cast_amax).items():
        fields: dict[str, Any] = dict.fromkeys(ROUNDED_FIELDS)
        fields |= g.fields | {f: math.fsum(e) for f, e in g.exact.items()}
        fields["clipped_by_rounding"] = _by_rounding(parsed[i], fields["clipped"])
        out[i] = Counts(fields, g.exact)
    return out


def rht_groups(casts: Sequence[Cast], shape: tuple[int, ...], axis: int,
               dtype: torch.dtype) -> dict[Any, list[int]]:
    """The casts with ``rht=`` the fused pass takes, by transform: each transform's copy of
    the slice goes through the pass as the casts without it (:func:`without_rht`), where those
    have a route there (:func:`flat_route` or :func:`driftcli.casts.given.given_route`)."""
    out: dict[Any, list[int]] = {}
    for i, c in enumerate(casts):
        if c.rht is None or not shape or rht_problem(c.rht, shape, axis) is not None:
            continue
        bare = without_rht(c)
        if flat_route(bare, _axis_last(shape, axis)[0], -1, dtype) is None and \
                given_route(bare, shape, axis, dtype) is None:
            continue
        out.setdefault(c.rht, []).append(i)
    return out


def without_rht(c: Cast) -> Cast:
    """``c`` as it casts the transform it reads."""
    return replace(c, rht=None)


def _moved_bits(bits: Tensor | None, last: int | None) -> Tensor | None:
    return bits if bits is None or last is None else bits.movedim(last, -1).reshape(-1)


def _axis_last(shape: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], int | None]:
    """``shape`` with dimension ``axis`` moved last, and that dimension (None where it is
    last already): blocks along another axis are runs of a copy laid out so (the counts do
    not depend on the elements' order; a stochastic cast's draws move with them)."""
    if not shape or axis % len(shape) == len(shape) - 1:
        return shape, None
    dim = axis % len(shape)
    return (*shape[:dim], *shape[dim + 1:], shape[dim]), dim


def _fused_pass(x: Tensor, flat: Tensor, parsed: list[Cast], found: dict[int, Any],
                scales: dict[int, tuple[int, float, bool]], top: float | None, rounded: bool,
                seeds: Sequence[int | None] | None, sr_bits: int,
                last: int | None) -> dict[int, Counts]:
    """One pass of :func:`fused_counts` over the casts ``found`` (their indices and routes) on
    ``flat``, ``x`` with dimension ``last`` moved last (when not None) and flattened."""
    how = None
    if rounded:
        src = rounding.source_of(torch.float32)
        how = jit.Rounded(
            [rounding.jit_params(src=src, tgt=rounding.target_of(parsed[i].format),
                                 rounding=parsed[i].rounding, overflow=parsed[i].overflow,
                                 sr_bits=sr_bits) for i in found],
            [_moved_bits(checked_bits("fused_stats", x, parsed[i], seeds[i], None, sr_bits),
                         last)
             if parsed[i].rounding is Rounding.SR and seeds is not None else None
             for i in found],
            [(parsed[i].format.qmin, parsed[i].format.emax) for i in found])
    got = jit.clip_counts(flat, list(found.values()), [scales[i][0] for i in found],
                          [scales[i][1] for i in found], top or 0.0, how)
    out = {}
    for n, (i, r) in enumerate(found.items()):
        clipped, clipped_groups, clamped, n_bad = got.counts[n]
        extra: dict[str, Any] = dict.fromkeys(ROUNDED_FIELDS)
        exact: dict[str, tuple[float, ...]] = {"clip_excess": got.excess[n],
                                               "abs_sum": got.abs_sum}
        if rounded:
            nonzero, under, sub, lost, n_wide = got.rounded[n]
            if n_wide:  # a block's grid out of float32's range: the torch back-end's
                continue
            extra = dict(zip(ROUNDED_FIELDS[:4], (nonzero, under, sub, lost), strict=True))
            exact |= dict(zip(ROUNDED_FIELDS[4:], got.sums[n], strict=True))
        one = not r.block
        sums: dict[str, Any] = {f: math.fsum(e) for f, e in exact.items()}
        out[i] = Counts(dict(
            numel=x.numel(), nonfinite=x.numel() - got.finite,
            groups=1 if one else x.numel() // r.block, clipped=clipped,
            clipped_by_rounding=_by_rounding(parsed[i], clipped),
            clipped_groups=min(clipped, 1) if one else clipped_groups,
            scale_clamped=int(scales[i][2]) if one else clamped, nonfinite_groups=n_bad,
            **extra, **sums), exact)
    return out


def _numba_counts(x: Tensor, c: Cast, axis: int, bits: Tensor | None, sr_bits: int,
                  tensor_amax: float | None, want_q: bool, rounded: bool,
                  facts: SliceFacts | None) -> Counts | None:
    """:func:`count_cast` on the numba back-end, fused: the rows' amax (from ``facts`` where
    they hold it), the rows' scales (:func:`plan_scales`, one per scale
    group, on torch), then one pass that casts every element and counts
    (:func:`driftcli.kernels.jit.cast_counts`). None where the torch back-end runs instead:
    an empty input, an implementation's scale arithmetic (:mod:`driftcli.casts.scalearith`), a
    float32 input whose scaled grid leaves float32's range, or tensors numba does not take."""
    s, elem = c.scaling, c.format
    if x.numel() == 0 or not s.arithmetic.exact or not kernels.numba_runs(x, bits):
        return None
    if c.micro is not None:  # micro-exponents: counted from cast_blocks' masks
        return None
    whole = s.granularity in _WHOLE  # one scale for the tensor, or none
    work = working(x)
    back: Callable[[Tensor], Tensor]
    if whole:
        blocks = work.reshape(1, -1).contiguous()
        rbits = None if bits is None else bits.reshape(1, -1)

        def back(t: Tensor) -> Tensor:
            return t.reshape(x.shape)
    else:
        blocks, back = to_blocks(work, s, axis)
        blocks = blocks.contiguous()
        rbits = None if bits is None else to_blocks(bits, s, axis)[0].contiguous()
    fused = _fused_scales(blocks, c, tensor_amax)
    if fused is not None:  # the scales in one numba pass over the blocks, as quantize's
        if fused is _OUT_OF_RANGE:
            return None
        facts = facts or slice_facts(work)
        return _counted(x, c, blocks, back, rbits, fused.scale, fused.bad, fused.amax,
                        s.rule is not None and s.rule.power_of_two, fused.clamped, facts,
                        sr_bits, rounded, want_q, whole=False)
    facts = facts or slice_facts(work, run_length(tuple(work.shape), c, axis))
    if whole:
        # the runs' largest magnitudes are the finite amax where every element is finite
        runs = facts.amax if facts.finite == x.numel() else None
        a = float(runs.max()) if runs is not None and runs.numel() else finite_amax(work)
        row_amax = torch.tensor([a], dtype=work.dtype)
        nonfinite = torch.tensor([facts.finite < x.numel()])
    else:
        row_amax, nonfinite = _row_amax(blocks, facts.group_amax(work, c, axis))
    top = tensor_amax_of(row_amax, tensor_amax)
    amax = top.expand_as(row_amax) if whole else row_amax
    unscaled = s.granularity is Granularity.NONE
    pow2 = unscaled or bool(s.rule is not None and s.rule.power_of_two)
    if pow2 and work.dtype == torch.float32 and needs_wide(amax, c):
        return None  # rounded in float64, then stored as float32: the torch back-end's steps
    if unscaled:
        scale = torch.zeros(1, dtype=torch.long)
        clamped = torch.zeros(1, dtype=torch.bool)
    else:
        plan = ScalePlan.of(elem, s)
        scale, clamped = plan_scales(amax.contiguous(), top, plan.divisors(amax), plan=plan)
    bad = nonfinite if s.blocked else None
    n_clamped = int((clamped if bad is None else clamped & ~bad).sum())
    return _counted(x, c, blocks, back, rbits, scale, bad, row_amax, pow2, n_clamped, facts,
                    sr_bits, rounded, want_q, whole=whole)


_OUT_OF_RANGE = jit.BlockScales(torch.empty(0), torch.empty(0), torch.empty(0), 0, 0, 0)
"""What :func:`_fused_scales` returns where the blocks' power-of-two grid leaves float32's
range (the torch back-end rounds those in float64)."""


def _fused_scales(blocks: Tensor, c: Cast,
                  tensor_amax: float | None) -> jit.BlockScales | None:
    """The scales of float32 blocks in one numba pass (the kernels of quantize's fused block
    cast, :func:`fused_block_cast_applies`); None where that does not
    apply (the scales are then planned on torch from the rows' amax)."""
    if not fused_block_cast_applies(blocks, c):
        return None
    if c.scaling.rule is ScaleRule.TWO_LEVEL:
        consts, q = two_level_consts(c)
        return jit.two_level_block_scales(blocks, consts, q, tensor_amax)
    rule = pow2_rule(c)
    if rule is None:
        return None
    got = jit.pow2_block_scales(blocks, rule)
    if (got.kmin != jit.NO_ROW and got.kmin + c.format.qmin < -149) or \
            got.kmax + c.format.emax >= 128:
        return _OUT_OF_RANGE
    return got


def _counted(x: Tensor, c: Cast, blocks: Tensor, back: Any, rbits: Tensor | None,
             scale: Tensor, bad: Tensor | None, row_amax: Tensor, pow2: bool, n_clamped: int,
             facts: SliceFacts, sr_bits: int, rounded: bool, want_q: bool, *,
             whole: bool) -> Counts:
    """The numba pass that casts every element of ``blocks`` under its row's scale and counts
    (:func:`driftcli.kernels.jit.cast_counts`)."""
    elem = c.format
    n_bad = 0 if bad is None else int(bad.sum())
    p = rounding.jit_params(src=rounding.source_of(blocks.dtype), tgt=rounding.target_of(elem),
                            rounding=c.rounding, overflow=c.overflow, sr_bits=sr_bits)
    counts, sums, q = jit.cast_counts(
        blocks, blocks.shape[1], rbits, scale if pow2 else None, None if pow2 else scale, bad,
        row_amax, p, (float(elem.max), float(elem.min), float(elem.smallest_normal)),
        rounded, want_q)
    clipped, clipped_groups, nonzero, under, sub, lost = counts
    if whole:  # pieces are not groups here: the one group clips or not
        clipped_groups = min(clipped, 1)
    excess, xx, ee, ex, e_sum = sums
    got = dict(zip(ROUNDED_FIELDS, (nonzero, under, sub, lost, xx, ee, ex, e_sum),
                   strict=True)) if rounded else dict.fromkeys(ROUNDED_FIELDS)
    return Counts(dict(
        numel=x.numel(), nonfinite=x.numel() - facts.finite, groups=blocks.shape[0],
        clipped=clipped, clipped_by_rounding=_by_rounding(c, clipped),
        clipped_groups=clipped_groups, clip_excess=excess, abs_sum=facts.abs_sum,
        scale_clamped=n_clamped, nonfinite_groups=n_bad, **got), None,
        None if q is None else back(q).to(x.dtype))
