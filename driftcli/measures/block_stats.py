"""``block-stats``: what happens inside the scale groups of a cast, per tensor, cast and
direction.

A block-scaled operand is read along its rows by the forward matmul and along its columns by
the weight-gradient matmul (the transpose): the same tensor gives other blocks, other scales
and other clips. For each direction (``rows``: blocks along the last axis; ``columns``: along
the first axis of the tensor seen as 2-D, leading axes folded into it; ``tiles`` for a tile
cast, whose tiles are the same either way; ``tensor`` for one tensor scale) and each scale
group g with largest finite magnitude ``amax_g`` and smallest nonzero finite magnitude
``low_g``, the scale ``s_g`` the cast's rule gives (the rule's own implementation, as
``quantize`` runs it) and ``M`` the element format's max:

- the scale code histogram (:class:`BlockScaleRow`): blocks per code of the scale format (the
  block scale of a two-level cast, without its tensor scale);
- clipped blocks: at least one ``|x / s_g|`` above ``M`` (as clip-rate counts them);
- scales at the scale format's max (saturated), in its subnormals, at its smallest value;
- the block's dynamic range in binades, ``floor(log2 amax_g) - floor(log2 low_g)`` read from
  the bits, against the element format's span ``floor(log2 M) - floor(log2 m)`` (``m`` its
  smallest positive value): a block above it cannot hold its smallest element beside its
  largest;
- the spread of the scales: ``max - min`` of ``floor(log2 s_g)``.

Scale flags and ranges count the *live* blocks: finite, holding a nonzero value (an all-zero
block gets the smallest scale by convention, a block holding NaN or inf becomes NaN).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import torch

from driftcli import engines, kernels
from driftcli.casts.codec import encode
from driftcli.casts.quantization import pow2_rule, two_level_consts, working
from driftcli.casts.scaling import (
    ScalePlan,
    binade_and_significand,
    plan_divisors,
    plan_pow2_exponents,
    plan_two_level_scales,
    pow2_range,
    to_blocks,
)
from driftcli.engines import Execution
from driftcli.errors import DriftError
from driftcli.io.readers import ReadError, TensorRef, open_inputs
from driftcli.io.tables import column
from driftcli.kernels import jit
from driftcli.measures.common import CAST_NAME_DOC
from driftcli.measures.scan import NothingToMeasure, nothing_to_measure
from driftcli.progress import Progress
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import Format
from driftcli.records.modes import Granularity, ScaleRule

Tensor = torch.Tensor


class Direction(StrEnum):
    """Which way a tensor's scale groups run."""

    ROWS = "rows"
    """Along the last axis: the forward matmul's operand."""
    COLUMNS = "columns"
    """Along the first axis (the transpose): the weight-gradient matmul's operand."""
    TILES = "tiles"
    """2-D tiles: the same groups whichever way the tensor is read."""
    TENSOR = "tensor"
    """One scale for the whole tensor."""


@dataclass(frozen=True)
class BlockStatsRow:
    """One tensor under one cast, in one direction: its blocks."""

    TABLE: ClassVar[str] = "block-stats"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "tensor", "cast", "direction")
    HEADLINE: ClassVar[str] = "clipped_block_share"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    source: str = column("File holding the tensor")
    tensor: str = column("Tensor name")
    layer: str | None = column("Layer (module) from a drift dump; null if unknown")
    dtype: str | None = column("Stored dtype")
    shape: str | None = column("Shape as a JSON list")
    cast: str = column("Canonical cast spec")
    format: str = column("Element format")
    scale_format: str = column("Scale format (of the block scale, for a two-level cast)")
    granularity: str = column("Scale granularity: tensor, channel, block or tile")
    block: int = column("Block or tile size (0 for tensor and channel scales)")
    direction: str = column("rows (along the last axis), columns (along the first: the "
                            "transpose), tiles or tensor")
    n_blocks: int | None = column("Scale groups in this direction")
    zero_blocks: int | None = column("Groups whose finite elements are all zero")
    nonfinite_blocks: int | None = column("Groups holding a NaN or inf")
    clipped_blocks: int | None = column("Groups with at least one |x/s| above the element max")
    clipped_block_share: float | None = column("clipped_blocks / n_blocks")
    scale_at_max: int | None = column("Live groups whose scale is the scale format's max "
                                      "(saturated)")
    scale_subnormal: int | None = column("Live groups whose scale is a subnormal of the scale "
                                         "format")
    scale_at_min: int | None = column("Live groups whose scale is the scale format's smallest "
                                      "positive value")
    scale_exponent_min: int | None = column("Smallest floor(log2 s) over the live groups")
    scale_exponent_max: int | None = column("Largest floor(log2 s) over the live groups")
    scale_spread: int | None = column("scale_exponent_max - scale_exponent_min (binades)")
    element_span: int = column("floor(log2 max) - floor(log2 smallest positive) of the "
                               "element format (binades)")
    range_median: int | None = column("Lower median over live groups of floor(log2 amax) - "
                                      "floor(log2 smallest nonzero |x|) (binades)")
    range_max: int | None = column("Largest such dynamic range (binades)")
    range_over_span: float | None = column("Share of live groups whose range exceeds "
                                           "element_span")
    error: str | None = column("Why this tensor could not be measured; null when it was")
    cast_name: str = column(CAST_NAME_DOC, default="")


@dataclass(frozen=True)
class BlockScaleRow:
    """How many blocks of a tensor, cast and direction have one scale code."""

    TABLE: ClassVar[str] = "block-scales"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "tensor", "cast", "direction", "scale_code")
    HEADLINE: ClassVar[str] = "blocks"
    HIGHER_IS_WORSE: ClassVar[bool] = False

    source: str = column("File holding the tensor")
    tensor: str = column("Tensor name")
    layer: str | None = column("Layer (module) from a drift dump; null if unknown")
    cast: str = column("Canonical cast spec")
    direction: str = column("rows, columns, tiles or tensor (as in block-stats)")
    scale_code: int = column("Code of the scale in the scale format (E8M0: exponent + 127; "
                             "a float32 scale of a float64 tensor: the nearest float32's)")
    scale_exponent: int = column("floor(log2 s) of that scale")
    blocks: int = column("Finite groups with this scale")
    cast_name: str = column(CAST_NAME_DOC, default="")


# --- the pass over the groups (the kernel seam: numba or torch) -------------------------------

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


def floor_log2(value: Fraction) -> int:
    """``floor(log2 value)`` of a positive rational, exactly."""
    e = value.numerator.bit_length() - value.denominator.bit_length()
    return e - 1 if value < Fraction(2) ** e else e


def element_span(fmt: Format) -> int:
    """Binades from the format's smallest positive value to its largest."""
    return floor_log2(fmt.max) - floor_log2(fmt.smallest_positive)


def directions(c: Cast, ndim: int) -> tuple[Direction, ...]:
    """The directions ``c`` has groups in for a tensor of ``ndim`` axes."""
    g = c.scaling.granularity
    if g is Granularity.TENSOR:
        return (Direction.TENSOR,)
    if g is Granularity.TILE:
        return (Direction.TILES,)
    return (Direction.ROWS, Direction.COLUMNS) if ndim >= 2 else (Direction.ROWS,)


def _checked(c: Cast) -> Cast:
    s = c.scaling
    if s.granularity is Granularity.NONE:
        raise DriftError(f"block-stats: cast {c} has no scales; give a scaled cast "
                         "(mxfp8_e4m3, nvfp4, fp8_e4m3, ...)")
    if c.micro is not None:
        # the scale rule alone is not the cast's scale: a micro-scaled cast derives its base
        # scale its own way and multiplies sub-blocks by micro-exponents (docs/block-stats.md)
        raise DriftError(f"block-stats: cast {c} has micro-exponents ({c.micro.name}), which "
                         "block-stats does not model yet; measure it with clip-rate, "
                         "underflow-rate or error-bias, or give a block cast without them "
                         "(mxfp4_e2m1, nvfp4)")
    if c.rht is not None:
        raise DriftError(f"block-stats: cast {c} transforms its input (rht=), which "
                         "block-stats does not model yet; leave rht= out")
    if not s.arithmetic.exact:
        raise DriftError(f"block-stats: cast {c} sets a scale arithmetic, which block-stats "
                         "does not model yet; give the exact cast (e.g. nvfp4 for "
                         "torchao/nvfp4)")
    return c


@dataclass(frozen=True)
class _Scales:
    value: Tensor
    """Each group's scale in the scale format, float64 (a two-level cast's block scale)."""
    exponent: Tensor | None
    """Each group's ``k`` of a power-of-two scale ``2**k``; None for the other rules."""
    clipped: Tensor
    """Each group holds an element with |x / s| above the element format's max."""


def _symmetric(c: Cast) -> bool:
    """Whether the element format's range is ±max (an integer format's reaches one further
    below), so that a group clips exactly when its amax does."""
    return bool(-c.format.min == c.format.max)


def _powers_of_two(k: Tensor, sf: Format | None) -> Tensor:
    """``2**k`` in float64 for the exponents ``k`` of a power-of-two scale in ``sf``."""
    low, high = pow2_range(sf) if sf is not None else (-1075, 1024)
    if low >= -1022 and high <= 1023:
        # every value of the format is a float64 normal: write its exponent field (exact,
        # and several times cheaper than ldexp, which multiplies by a computed power)
        return ((k.long() + 1023) << 52).view(torch.float64)
    return torch.ldexp(torch.ones_like(k, dtype=torch.float64), k.double())


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


def _scales(blocks: Tensor | None, amax: Tensor, c: Cast) -> _Scales:
    """Each group's scale by the rule's fast implementation (``plan_*``: what ``quantize``
    divides by) and whether the group clips, from its amax (and from its elements, ``blocks``,
    for an asymmetric element format)."""
    s, elem = c.scaling, c.format
    plan = ScalePlan.of(elem, s)
    rule = s.rule
    # the tensor's amax: read by a tensor scale and by the rules that take it (two-level's)
    top = amax.max() if s.granularity is Granularity.TENSOR or not (
        rule is not None and rule.power_of_two) else amax[:0]
    if s.granularity is Granularity.TENSOR:
        amax = top.expand_as(amax).contiguous()
    big = float(elem.max)
    if rule is not None and rule.power_of_two:
        vector = pow2_rule(c) if amax.dtype == torch.float32 and kernels.numba_runs(amax) \
            else None
        if vector is not None:  # castcode's scale kernel, each group's amax a block of one
            k = jit.pow2_block_scales(amax.reshape(-1, 1).contiguous(), vector).scale
        else:
            k, _ = plan_pow2_exponents(amax, plan)
        value = _powers_of_two(k, s.scale_format)
        # |x| > M·2**k in float64 is exact (as quantize's masks test it)
        if blocks is None:
            clipped = amax.double() > value * big
        else:
            wide = blocks.double()
            clipped = ((wide > (value * big)[:, None]) |
                       (wide < (value * float(elem.min))[:, None])).any(dim=1)
        return _Scales(value, k, clipped)
    fast = _two_level_numba(amax, c) if rule is ScaleRule.TWO_LEVEL and \
        s.granularity is not Granularity.TENSOR else None
    if fast is not None:
        value, divisor = fast[0], fast[2]
    elif rule is ScaleRule.TWO_LEVEL:
        two = plan_two_level_scales(amax, top, plan.divisors(amax), plan)
        value, divisor = two.block_scale.double(), two.divisor
    else:
        div = plan.divisors(amax)
        divisor, _ = plan_divisors(amax, top, div, plan)
        value = divisor.double()
    # the cast's own float division, monotone in x: the group's largest quotient is amax's
    d = divisor.to(amax.dtype)
    if blocks is None:
        clipped = (amax / d) > big
    else:
        y = blocks / d[:, None]
        clipped = ((y > big) | (y < float(elem.min))).any(dim=1)
    return _Scales(value, None, clipped)


def _groups(x: Tensor, c: Cast, d: Direction) -> tuple[Tensor | None, tuple[Tensor, ...]]:
    """``x``'s groups under ``c`` in direction ``d``: one row each (None where the numba pass
    read the columns in place and nothing else needs the elements) and their
    :func:`block_ranges`."""
    two = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
    s = c.scaling
    if d is Direction.COLUMNS and _symmetric(c) and kernels.numba_runs(two) and \
            s.granularity in (Granularity.BLOCK, Granularity.CHANNEL):
        k = s.block if s.granularity is Granularity.BLOCK else two.shape[0]
        return None, jit.block_ranges(two.contiguous(), k)
    blocks = to_blocks(two, s, 0 if d is Direction.COLUMNS else -1)[0].contiguous()
    return blocks, block_ranges(blocks)


def _floor_log2(v: float) -> int:
    return math.frexp(v)[1] - 1  # v = m * 2**e, 0.5 <= m < 1: exact


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


def _histogram(sc: _Scales, finite: Tensor, sf: Format) -> dict[int, tuple[int, int]]:
    """Scale code -> (floor(log2 scale), finite groups with it)."""
    if sc.exponent is not None:  # powers of two: count the exponents, encode the few found
        low, counts = key_counts(sc.exponent, finite)
        present = counts.nonzero()[:, 0]
        ks = present + low
        values = torch.ldexp(torch.ones_like(ks, dtype=torch.float64), ks.double())
        found = counts[present]
    elif sf.bits <= 16 and not sf.integer:
        # a narrow float format's values are float32s whose low significand bits are zero:
        # count the float32 bits above them (scales are positive)
        shift = 23 - sf.mbits
        low, counts = key_counts(sc.value.float().view(torch.int32) >> shift, finite)
        present = counts.nonzero()[:, 0]
        values = ((present + low).int() << shift).view(torch.float32).double()
        found = counts[present]
    else:
        # a float32 scale: drift computes a float64 tensor's in float64 (as quantize divides
        # by it); a scale register holds it as float32, so it is counted under the code of
        # the nearest float32
        values, found = torch.unique(sc.value[finite].float().double(), return_counts=True)
    return _coded(values, found, sf)


def _coded(values: Tensor, found: Tensor, sf: Format) -> dict[int, tuple[int, int]]:
    """Scale code -> (floor(log2 scale), groups) of the scales ``values`` found ``found``
    times each."""
    codes = encode(values, sf)
    out: dict[int, tuple[int, int]] = {}
    for code, v, n in zip(codes.tolist(), values.tolist(), found.tolist(), strict=True):
        out[int(code)] = (_floor_log2(v), out.get(int(code), (0, 0))[1] + int(n))
    return out


MAX_SPAN = 2200
"""Above any group's range in binades (float64: 2**1023 over 2**-1074 is 2097)."""

Summary = tuple[list[int], tuple[float, float], Tensor]
"""Counts (live, zero, nonfinite, clipped, scale at max, subnormal scale, scale at min,
range over span, largest range), the live scales' smallest and largest, and the live ranges'
histogram (groups per binade count)."""


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


def _fused(amax: Tensor, span: Tensor, bad: Tensor, poison: bool, c: Cast, sf: Format,
           ends: tuple[float, float, float], elem_span: int
           ) -> tuple[Summary, dict[int, tuple[int, int]]] | None:
    """The scales, clip flags, summary and histogram of float32 groups in one numba pass after
    castcode's scale kernel (:func:`driftcli.kernels.jit.fused_summary`): what
    :func:`_scales`, :func:`block_summary` and :func:`_histogram` give, for the casts whose
    scales that kernel computes (a power-of-two rule written as a threshold, a two-level
    rule into a narrow float scale format) on a symmetric element format with block or
    channel scales. None for the others (and where a key falls outside the counted range),
    which take those three steps."""
    s = c.scaling
    if amax.dtype != torch.float32 or not kernels.numba_runs(amax) or not _symmetric(c) or \
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
        values = _powers_of_two(keys, sf)
    return (counts[:9], extremes, ranges), _coded(values, kcounts[present], sf)


def _lower_median(ranges: Tensor, n: int) -> int:
    """The lower median of ``n`` values from their histogram ``ranges``."""
    return int(torch.searchsorted(ranges.cumsum(0), (n - 1) // 2, right=True))


def _count(mask: Tensor) -> int:
    return int(torch.count_nonzero(mask))  # several times faster than a bool sum


def direction_stats(x: Tensor, c: Cast, d: Direction) -> tuple[dict[str, Any],
                                                                 dict[int, tuple[int, int]]]:
    """The block-stats columns of ``x`` under ``c`` in direction ``d``, and its histogram:
    scale code -> (floor(log2 scale), finite groups)."""
    c = _checked(c)
    if x.numel() == 0:  # no group: every count 0, every statistic of groups null
        return {**dict.fromkeys(_NULLS), "n_blocks": 0, "zero_blocks": 0,
                "nonfinite_blocks": 0, "clipped_blocks": 0, "scale_at_max": 0,
                "scale_subnormal": 0, "scale_at_min": 0,
                "element_span": element_span(c.format)}, {}
    blocks, (amax, _, span, bad) = _groups(working(x), c, d)
    sf = c.scaling.scale_format
    if sf is None:  # every scaled cast has one (Scaling checks it)
        raise DriftError(f"block-stats: cast {c} has no scale format")
    # a NaN or inf makes a block scaling's group NaN; a tensor or channel scale reads the
    # finite elements and casts them as any other
    poison = c.scaling.blocked
    sub = sf.has_subnormals and not sf.integer
    ends = (float(sf.max), float(sf.smallest_normal) if sub else 0.0,
            float(sf.smallest_positive))
    elem_span = element_span(c.format)
    fused = _fused(amax, span, bad, poison, c, sf, ends, elem_span)
    if fused is not None:
        (counts, (lo, hi), ranges), codes = fused
    else:
        sc = _scales(None if _symmetric(c) else blocks, amax, c)
        counts, (lo, hi), ranges = block_summary(amax, span, bad, poison, sc.value,
                                                 sc.clipped, ends, elem_span)
        codes = _histogram(sc, ~bad if poison else torch.ones_like(bad), sf)
    n_live, zero, nonfinite, clipped, at_max, n_sub, at_min, over, widest = counts
    n = int(amax.numel())
    cols: dict[str, Any] = {
        "n_blocks": n, "zero_blocks": zero, "nonfinite_blocks": nonfinite,
        "clipped_blocks": clipped, "clipped_block_share": clipped / n if n else None,
        "scale_at_max": at_max, "scale_subnormal": n_sub, "scale_at_min": at_min,
        "scale_exponent_min": _floor_log2(lo) if n_live else None,
        "scale_exponent_max": _floor_log2(hi) if n_live else None,
        "scale_spread": _floor_log2(hi) - _floor_log2(lo) if n_live else None,
        "element_span": elem_span,
        "range_median": _lower_median(ranges, n_live) if n_live else None,
        "range_max": widest if n_live else None,
        "range_over_span": over / n_live if n_live else None,
    }
    return cols, codes


# --- tensors, units, rows ----------------------------------------------------------------------

@dataclass(frozen=True)
class BlockUnit:
    """One tensor under every cast: the work unit an engine runs."""

    input: str
    ref: TensorRef
    casts: tuple[Cast, ...]

    def key(self) -> str:
        """Everything the unit's rows depend on, its file's stamp included."""
        ref = self.ref
        return (f"block-stats|{self.input}|{engines.stamp(ref.source)}|{ref.name}|{ref.dtype}|"
                f"{list(ref.shape)}|{[str(c) for c in self.casts]}")


def _base(ref: TensorRef, c: Cast) -> dict[str, Any]:
    s = c.scaling
    return {"source": ref.source, "tensor": ref.name, "layer": ref.layer, "dtype": ref.dtype,
            "shape": json.dumps(list(ref.shape)), "cast": str(c), "format": c.format.name,
            "scale_format": s.scale_format.name if s.scale_format else "",
            "granularity": s.granularity.value, "block": s.block}


_NULLS: dict[str, Any] = {f.name: None for f in fields(BlockStatsRow)
          if f.name not in ("source", "tensor", "layer", "dtype", "shape", "cast", "format",
                       "scale_format", "granularity", "block", "direction", "element_span",
                       "error", "cast_name")}


def block_unit(unit: BlockUnit) -> tuple[list[BlockStatsRow], list[BlockScaleRow]]:
    """Every cast and direction of one tensor: its rows and histogram rows (an error row per
    cast when the tensor cannot be read)."""
    ref = unit.ref
    try:
        x = ref.read()
    except ReadError as err:
        return ([BlockStatsRow(**_base(ref, c), direction="", **_NULLS,
                               element_span=element_span(c.format), error=str(err))
                 for c in unit.casts], [])
    rows: list[BlockStatsRow] = []
    hist: list[BlockScaleRow] = []
    for c in unit.casts:
        for d in directions(c, x.dim()):
            cols, codes = direction_stats(x, c, d)
            rows.append(BlockStatsRow(**_base(ref, c), direction=d.value, **cols, error=None))
            hist.extend(BlockScaleRow(ref.source, ref.name, ref.layer, str(c), d.value, code,
                                      exp, count)
                        for code, (exp, count) in sorted(codes.items()))
    return rows, hist


@dataclass(frozen=True)
class BlockStats:
    """What ``block-stats`` found: a row per tensor, cast and direction, the histogram rows,
    and every file read (for provenance)."""

    rows: list[BlockStatsRow]
    scales: list[BlockScaleRow]
    files: list[Path]


def block_stats(paths: Sequence[str | Path], casts: Sequence[Cast | str], *,
                include: Sequence[str] = (), exclude: Sequence[str] = (),
                execution: Execution | None = None,
                progress: Progress | None = None) -> BlockStats:
    """Every selected floating-point tensor of ``paths`` under every cast, in each direction
    its groups run: :class:`BlockStatsRow` and :class:`BlockScaleRow` rows, the same on every
    engine. A tensor that cannot be read gets an error row per cast; the others go on."""
    if not casts:
        raise DriftError("no cast given; add --cast SPEC (a block cast such as mxfp8_e4m3 or "
                         "nvfp4, see drift formats --presets)")
    parsed = tuple(_checked(parse_cast(c)) for c in casts)
    opened = [(str(p), open_inputs([p], include, exclude)) for p in paths]
    empty = [why for inp, inputs in opened if (why := nothing_to_measure(inp, inputs))]
    if len(empty) == len(opened):
        raise NothingToMeasure("; ".join(empty))
    units = [BlockUnit(inp, ref, parsed) for inp, inputs in opened for ref in inputs.tensors
             if ref.is_float]
    found = engines.run(units, block_unit, execution or Execution(), progress=progress,
                        label=lambda u: u.ref.name, size=lambda u: u.ref.nbytes)
    rows: list[BlockStatsRow] = []
    scales: list[BlockScaleRow] = []
    for _, inputs in opened:
        for e in inputs.errors:
            rows.extend(BlockStatsRow(
                source=e.source, tensor=e.tensor or "(unreadable file)", layer=None, dtype=None,
                shape=None, cast=str(c), format=c.format.name,
                scale_format=c.scaling.scale_format.name if c.scaling.scale_format else "",
                granularity=c.scaling.granularity.value, block=c.scaling.block, direction="",
                **_NULLS, element_span=element_span(c.format), error=e.message)
                for c in parsed)
    for r, h in found:
        rows.extend(r)
        scales.extend(h)
    names = {str(p): c for c, p in zip(casts, parsed, strict=True) if isinstance(c, str)}
    return BlockStats([replace(r, cast_name=names.get(r.cast, r.cast)) for r in rows],
                      [replace(r, cast_name=names.get(r.cast, r.cast)) for r in scales],
                      [f for _, i in opened for f in i.files])
