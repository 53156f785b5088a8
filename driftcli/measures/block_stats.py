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
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import torch

from driftcli import engines
from driftcli.casts.codec import encode
from driftcli.casts.quantization import working_dtype
from driftcli.casts.route import (
    GroupScales,
    Summary,
    block_summary,
    fused_summary,
    group_ranges,
    group_scales,
    key_counts,
    merge_ranges,
)
from driftcli.engines import Execution
from driftcli.errors import DriftError
from driftcli.io.readers import ReadError, TensorRef, open_inputs
from driftcli.io.tables import column
from driftcli.measures.common import CAST_NAME_DOC
from driftcli.measures.scan import NothingToMeasure, nothing_to_measure
from driftcli.progress import Progress
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import Format, pow2
from driftcli.records.modes import Granularity

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


# --- the groups' facts (the cast's steps, driftcli.casts.route, on either back-end) ------------

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


def _scales(blocks: Tensor | None, amax: Tensor, c: Cast) -> _Scales:
    """Each group's scale (:func:`driftcli.casts.route.group_scales`: what ``quantize``
    divides by) and whether the group clips, from its amax (and from its elements, ``blocks``,
    for an asymmetric element format)."""
    elem = c.format
    if c.scaling.granularity is Granularity.TENSOR:
        amax = amax.max().expand_as(amax).contiguous()
    sc: GroupScales = group_scales(c, amax)
    big = float(elem.max)
    if sc.divisor is None:  # a power of two: |x| > M·2**k in float64 is exact (as quantize's
        # masks test it)
        if blocks is None:
            clipped = amax.double() > sc.value * big
        else:
            wide = blocks.double()
            clipped = ((wide > (sc.value * big)[:, None]) |
                       (wide < (sc.value * float(elem.min))[:, None])).any(dim=1)
        return _Scales(sc.value, sc.exponent, clipped)
    # the cast's own float division, monotone in x: the group's largest quotient is amax's
    d = sc.divisor.to(amax.dtype)
    if blocks is None:
        clipped = (amax / d) > big
    else:
        y = blocks / d[:, None]
        clipped = ((y > big) | (y < float(elem.min))).any(dim=1)
    return _Scales(sc.value, None, clipped)


Facts = tuple[Tensor, Tensor, Tensor, Tensor]
"""The groups' :func:`~driftcli.casts.route.block_ranges`: largest and smallest nonzero finite
magnitude, binades between them, NaN/inf flag."""


def _two(x: Tensor) -> Tensor:
    """``x`` as the 2-D matrix whose rows and columns the directions run along."""
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)


def _groups(x: Tensor, c: Cast, d: Direction) -> tuple[Tensor | None, Facts]:
    """``x``'s groups under ``c`` in direction ``d``: one row each (None where the numba pass
    read the columns in place and nothing else needs the elements) and their facts."""
    return group_ranges(_two(x), c.scaling, 0 if d is Direction.COLUMNS else -1,
                        keep=not _symmetric(c))


def _run(c: Cast, d: Direction, two: Tensor) -> int | None:
    """The elements of a line (a row, or a column for ``columns``) in one group of ``c``; None
    where the groups are not runs along the lines (tiles, one tensor scale)."""
    g = c.scaling.granularity
    if d not in (Direction.ROWS, Direction.COLUMNS):
        return None
    return c.scaling.block if g is Granularity.BLOCK else \
        two.shape[1 if d is Direction.ROWS else 0]


def _shared(two: Tensor, c: Cast, d: Direction,
            known: dict[tuple[Direction, int], Facts]) -> tuple[Tensor | None, Facts]:
    """:func:`_groups`, from the facts of shorter groups already read (``known``: by direction
    and run) where that gives the same: groups made of whole runs of known groups along the
    same lines, or one tensor group made of any known groups. The elements are read only where
    nothing known covers them; what is read is added to ``known``."""
    run = _run(c, d, two)
    if not _symmetric(c) or (run is None and d is not Direction.TENSOR):
        return _groups(two, c, d)
    if run is None:  # one tensor scale: every known grouping covers every element
        if not known:
            return _groups(two, c, d)
        top, low, _, bad = min(known.values(), key=lambda f: f[0].numel())
        return None, merge_ranges(top, low, bad, 1, max(top.numel(), 1))
    width = two.shape[1 if d is Direction.ROWS else 0]
    lines = two.numel() // width if width else 0
    fits = [k for (e, k) in known if e is d and (k == run or run % k == 0 or run >= width)]
    if not fits:
        blocks, facts = _groups(two, c, d)
        known[(d, run)] = facts
        return blocks, facts
    k = max(fits)
    top, low, _, bad = known[(d, k)]
    facts = known[(d, k)] if k == run else \
        merge_ranges(top, low, bad, lines, -(-width // k) if run >= width else run // k)
    known[(d, run)] = facts
    return None, facts


def _floor_log2(v: float) -> int:
    return math.frexp(v)[1] - 1  # v = m * 2**e, 0.5 <= m < 1: exact


def _histogram(sc: _Scales, finite: Tensor, sf: Format) -> dict[int, tuple[int, int]]:
    """Scale code -> (floor(log2 scale), finite groups with it)."""
    if sc.exponent is not None:  # powers of two: count the exponents, encode the few found
        low, counts = key_counts(sc.exponent, finite)
        present = counts.nonzero()[:, 0]
        ks = present + low
        values = torch.ldexp(torch.ones_like(ks, dtype=torch.float64), ks.double())
        found = counts[present]
    elif sf.bits <= 16 and not sf.integer:
        # a narrow float format's values are floats whose low significand bits are zero:
        # count the bits above them (scales are positive), float32's unless the format goes
        # below their grid (E8M0's 2**-127, a float32 subnormal, has no bit above 23 - mbits):
        # then float64's, where each of its values is a normal
        wide = sf.smallest_positive < pow2(-126 - sf.mbits)
        real, bits, width = (torch.float64, torch.int64, 52) if wide else \
            (torch.float32, torch.int32, 23)
        shift = width - sf.mbits
        low, counts = key_counts(sc.value.to(real).view(bits) >> shift, finite)
        present = counts.nonzero()[:, 0]
        values = ((present + low).to(bits) << shift).view(real).double()
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
    out: dict[int, tuple[int, int]] = {}
    for v, n in zip(values.tolist(), found.tolist(), strict=True):
        code = _code(v, sf)
        out[code] = (_floor_log2(v), out.get(code, (0, 0))[1] + int(n))
    return out


@cache
def _code(v: float, sf: Format) -> int:
    """The code of the scale ``v`` in ``sf``: a format holds a few hundred scales at most,
    and a call of ``encode`` per group costs more than the pass over the groups."""
    return int(encode(torch.tensor([v], dtype=torch.float64), sf)[0])


def _fused(amax: Tensor, span: Tensor, bad: Tensor, poison: bool, c: Cast, sf: Format,
           ends: tuple[float, float, float], elem_span: int
           ) -> tuple[Summary, dict[int, tuple[int, int]]] | None:
    """The summary and histogram of :func:`driftcli.casts.route.fused_summary` (one numba
    pass), or None where it does not answer."""
    got = fused_summary(amax, span, bad, poison, c, ends, elem_span)
    if got is None:
        return None
    summary, values, found = got
    return summary, _coded(values, found, sf)


def _lower_median(ranges: Tensor, n: int) -> int:
    """The lower median of ``n`` values from their histogram ``ranges``."""
    return int(torch.searchsorted(ranges.cumsum(0), (n - 1) // 2, right=True))


def direction_stats(x: Tensor, c: Cast, d: Direction,
                    known: dict[tuple[Direction, int], Facts] | None = None
                    ) -> tuple[dict[str, Any], dict[int, tuple[int, int]]]:
    """The block-stats columns of ``x`` under ``c`` in direction ``d``, and its histogram:
    scale code -> (floor(log2 scale), finite groups). ``known``: the facts of groups of ``x``
    already read, by direction and run (:func:`_shared`; what this call reads is added)."""
    c = _checked(c)
    if x.numel() == 0:  # no group: every count 0, every statistic of groups null
        return {**dict.fromkeys(_NULLS), "n_blocks": 0, "zero_blocks": 0,
                "nonfinite_blocks": 0, "clipped_blocks": 0, "scale_at_max": 0,
                "scale_subnormal": 0, "scale_at_min": 0,
                "element_span": element_span(c.format)}, {}
    blocks, (amax, _, span, bad) = _shared(_two(x.to(working_dtype(x.dtype))), c, d,
                                           {} if known is None else known)
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
    names: tuple[str, ...] = ()
    """Each cast's name in the rows (``cast_name``), as the caller gave it; none: its spec."""

    def key(self) -> str:
        """Everything the unit's rows depend on, its file's stamp included."""
        ref = self.ref
        return (f"block-stats|{self.input}|{engines.stamp(ref.source)}|{ref.name}|{ref.dtype}|"
                f"{list(ref.shape)}|{[str(c) for c in self.casts]}|{list(self.names)}")


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
    x = x.to(working_dtype(x.dtype))
    two = _two(x)
    work = [(c, d) for c in unit.casts for d in directions(c, x.dim())]

    def order(i: int) -> int:  # the shortest runs first, a tensor scale last: the longer
        # groups are made of the shorter ones' facts (merge_ranges), not read again
        c, d = work[i]
        run = _run(c, d, two)
        return run if run is not None else (1 << 62) if d is Direction.TENSOR else 0

    known: dict[tuple[Direction, int], Facts] = {}
    found = {i: direction_stats(x, *work[i], known)
             for i in sorted(range(len(work)), key=order)}
    names = dict(zip(map(str, unit.casts), unit.names, strict=True)) if unit.names else {}
    for i, (c, d) in enumerate(work):
        cols, codes = found[i]
        name = names.get(str(c), str(c))
        rows.append(BlockStatsRow(**_base(ref, c), direction=d.value, **cols, error=None,
                                  cast_name=name))
        hist.extend(BlockScaleRow(ref.source, ref.name, ref.layer, str(c), d.value, code, exp,
                                  count, name) for code, (exp, count) in sorted(codes.items()))
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
    names = {str(p): c for c, p in zip(casts, parsed, strict=True) if isinstance(c, str)}
    given = tuple(names.get(str(p), str(p)) for p in parsed)
    units = [BlockUnit(inp, ref, parsed, given) for inp, inputs in opened
             for ref in inputs.tensors if ref.is_float]
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
    rows = [replace(r, cast_name=names.get(r.cast, r.cast)) for r in rows]  # the error rows
    for r, h in found:  # named by their units
        rows.extend(r)
        scales.extend(h)
    return BlockStats(rows, scales, [f for _, i in opened for f in i.files])
