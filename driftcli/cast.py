"""Casts: a format, a scaling, a rounding mode and an overflow policy; the spec strings.

A cast spec is colon-separated parts, the element format first; the other
parts may come in any order and are recognised by their words::

    float8_e4m3fn:block32:float8_e8m0fnu:floor:rne:saturate     (the canonical form)
    float8_e4m3fn:block32                                        (the same, by defaults)
    float4_e2m1fn:block16:float8_e4m3fn:two-level                (NVFP4)
    float8_e4m3fn:tensor:amax                                    (per-tensor current scaling)
    mxfp8_e4m3_floor+1                                           (a preset)
    mxfp4_e2m1:sr                                                (a preset, rounding changed)

Granularity: ``none`` ``tensor`` ``channel`` ``block<k>`` ``tile<k>``. Rule:
``floor`` ``floor+<k>`` ``ceil`` ``even`` ``amax`` ``amax-rne`` ``amax-up``
``two-level``. Scale format: any format name. Rounding: ``rne`` ``rna``
``rtz`` ``rup`` ``rdown`` ``sr``. Overflow: ``saturate`` ``ieee``. Defaults:
no scaling; with a granularity, ``floor`` for blocks and tiles and ``amax``
for tensors and channels; the scale format ``float8_e8m0fnu`` for
power-of-two rules, ``float8_e4m3fn`` for ``two-level``, ``float32`` for the
``amax`` rules; ``rne``; ``saturate``. ``str(cast)`` writes every part, in
the order above, and ``parse_cast(str(c)) == c``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from driftcli import rounding as fast
from driftcli.errors import DriftError, FormatSpecError, close_matches
from driftcli.formats import FORMATS, Format, get_format
from driftcli.modes import DEFAULT_SR_BITS, Overflow, Rounding
from driftcli.scaling import (
    CastSpecError,
    Granularity,
    ScaleRule,
    Scaling,
    block_stats,
    pow2_exponents,
    real_scales,
    to_blocks,
    two_level_scales,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class Cast:
    """How one tensor is cast: element format, scaling, rounding, overflow."""

    format: Format
    scaling: Scaling = field(default_factory=Scaling)
    rounding: Rounding = Rounding.RNE
    overflow: Overflow = Overflow.SATURATE

    def __post_init__(self) -> None:
        s = self.scaling
        if s.rule is ScaleRule.TWO_LEVEL and s.scale_format is not None and (
                s.scale_format.max * self.format.max > FORMATS["float32"].max):
            raise CastSpecError(
                f"two-level scaling needs a scale format whose max times {self.format.name}'s "
                f"max fits a float32 (the tensor scale is amax / that product); "
                f"{s.scale_format.name} does not: use float8_e4m3fn as NVFP4 does")

    def __str__(self) -> str:
        s = self.scaling
        parts = [self.format.name]
        if s.granularity is Granularity.NONE:
            parts.append("none")
        else:
            size = str(s.block) if s.block else ""
            rule = f"{s.rule}+{s.headroom}" if s.headroom else str(s.rule)
            scale_name = s.scale_format.name if s.scale_format is not None else ""
            parts += [f"{s.granularity}{size}", scale_name, rule]
        return ":".join([*parts, self.rounding.value, self.overflow.value])


# --- presets ----------------------------------------------------------------------------------

E8M0 = FORMATS["float8_e8m0fnu"]


def _mx(elem: str, rule: ScaleRule = ScaleRule.FLOOR, headroom: int = 0) -> Cast:
    return Cast(FORMATS[elem], Scaling(Granularity.BLOCK, 32, E8M0, rule, headroom))


_MX = {"mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2",
       "mxfp6_e3m2": "float6_e3m2fn", "mxfp6_e2m3": "float6_e2m3fn",
       "mxfp4_e2m1": "float4_e2m1fn", "mxint8": "int8"}
_NVFP4 = (FORMATS["float4_e2m1fn"], FORMATS["float8_e4m3fn"])

PRESETS: dict[str, tuple[Cast, str]] = {
    "bf16": (Cast(FORMATS["bfloat16"], overflow=Overflow.IEEE),
             "plain bfloat16 cast, no scaling (overflow to inf, as torch)"),
    "fp16": (Cast(FORMATS["float16"], overflow=Overflow.IEEE),
             "plain float16 cast, no scaling (overflow to inf, as torch)"),
    "fp8_e4m3": (Cast(FORMATS["float8_e4m3fn"],
                      Scaling(Granularity.TENSOR, 0, FORMATS["float32"], ScaleRule.AMAX)),
                 "FP8 E4M3 with one float32 scale amax/448 per tensor (current scaling)"),
    "fp8_e5m2": (Cast(FORMATS["float8_e5m2"],
                      Scaling(Granularity.TENSOR, 0, FORMATS["float32"], ScaleRule.AMAX)),
                 "FP8 E5M2 with one float32 scale amax/57344 per tensor (current scaling)"),
    "fp8_e4m3_unscaled": (Cast(FORMATS["float8_e4m3fn"]), "the bare FP8 E4M3 cast, scale 1"),
    **{name: (_mx(elem), f"OCP MX: {elem} in blocks of 32, E8M0 scale, floor rule")
       for name, elem in _MX.items()},
    **{f"{name}_ceil": (_mx(elem, ScaleRule.CEIL), f"{name} with the scale rounded up (ceil)")
       for name, elem in _MX.items()},
    **{f"{name}_even": (_mx(elem, ScaleRule.EVEN), f"{name} with the even rule")
       for name, elem in _MX.items()},
    **{f"{name}_floor+1": (_mx(elem, headroom=1), f"{name} with one binade of headroom")
       for name, elem in _MX.items()},
    "nvfp4": (Cast(_NVFP4[0], Scaling(Granularity.BLOCK, 16, _NVFP4[1], ScaleRule.TWO_LEVEL)),
              "NVFP4: FP4 E2M1 in blocks of 16, E4M3 block scales under a float32 tensor scale"),
    "nvfp4_2d": (Cast(_NVFP4[0], Scaling(Granularity.TILE, 16, _NVFP4[1], ScaleRule.TWO_LEVEL)),
                 "NVFP4 with 16x16 tiles (as for weights)"),
}
"""Every preset: its cast and what it means."""


# --- parsing ----------------------------------------------------------------------------------

_GRANULARITY = re.compile(r"(none|tensor|channel)|(block|tile)(\d+)")
_RULE = re.compile(r"(floor|ceil|even|amax|amax-rne|amax-up|two-level)(?:\+(\d+))?")


class _Parts(NamedTuple):
    granularity: tuple[Granularity, int] | None
    rule: tuple[ScaleRule, int] | None
    scale_format: Format | None
    rounding: Rounding | None
    overflow: Overflow | None


def _bad(spec: str, part: str, why: str, hint: str = "") -> CastSpecError:
    return CastSpecError(f"cast spec {spec!r}: {why} {part!r}{hint}; write FORMAT[:GRANULARITY]"
                         "[:SCALE_FORMAT][:RULE][:ROUNDING][:OVERFLOW], e.g. "
                         "float8_e4m3fn:block32:floor, or a preset (drift formats --presets)")


def _classify(spec: str, parts: list[str]) -> _Parts:
    found: dict[str, object] = {}

    def put(kind: str, value: object, part: str) -> None:
        if kind in found:
            raise _bad(spec, part, f"a second {kind}")
        found[kind] = value

    for part in parts:
        if g := _GRANULARITY.fullmatch(part):
            gran = Granularity(g[1] or g[2])
            put("granularity", (gran, int(g[3] or 0)), part)
        elif r := _RULE.fullmatch(part):
            put("rule", (ScaleRule(r[1]), int(r[2] or 0)), part)
        elif part in Rounding.__members__.values():
            put("rounding", Rounding(part), part)
        elif part in Overflow.__members__.values():
            put("overflow", Overflow(part), part)
        elif part in FORMATS or re.fullmatch(r"e\d+m\d+(b-?\d+)?", part):
            try:
                put("scale format", get_format(part), part)
            except FormatSpecError as err:
                raise CastSpecError(f"cast spec {spec!r}: scale format: {err}") from None
        else:
            words = ["none", "tensor", "channel", "block32", "tile16", *list(ScaleRule),
                     *list(Rounding), *list(Overflow), *FORMATS]
            guess = close_matches(part, words).removeprefix("; ")
            raise _bad(spec, part, "unknown part", f" ({guess})" if guess else "")
    return _Parts(found.get("granularity"), found.get("rule"),  # type: ignore[arg-type]
                  found.get("scale format"), found.get("rounding"),  # type: ignore[arg-type]
                  found.get("overflow"))  # type: ignore[arg-type]


def parse_cast(spec: str | Cast) -> Cast:
    """A :class:`Cast` from a preset name or a spec string (see the module docs)."""
    if isinstance(spec, Cast):
        return spec
    if spec in PRESETS:
        return PRESETS[spec][0]
    head, *rest = spec.strip().split(":")
    if head in PRESETS:  # a preset with its rounding or overflow changed: mxfp4_e2m1:sr
        base = PRESETS[head][0]
        p = _classify(spec, rest)
        if p.granularity or p.rule or p.scale_format:
            raise _bad(spec, ":".join(rest), "a preset fixes its scaling; write the full spec "
                       f"({base}) to change it, not")
        return replace(base, rounding=p.rounding or base.rounding,
                       overflow=p.overflow or base.overflow)
    try:
        elem = get_format(head)
    except FormatSpecError as err:
        raise CastSpecError(f"cast spec {spec!r}: {err}") from None
    except DriftError:
        raise CastSpecError(
            f"cast spec {spec!r}: unknown format or preset {head!r}"
            f"{close_matches(head, [*PRESETS, *FORMATS])} (see drift formats --presets)") from None
    p = _classify(spec, rest)
    gran, size = p.granularity or (Granularity.NONE, 0)
    if gran is Granularity.NONE:
        if p.rule is not None or p.scale_format is not None:
            raise _bad(spec, ":".join(rest), "a rule or scale format needs a granularity, not")
        scaling = Scaling()
    else:
        rule, headroom = p.rule or (
            (ScaleRule.FLOOR, 0) if gran in (Granularity.BLOCK, Granularity.TILE)
            else (ScaleRule.AMAX, 0))
        if headroom and rule is not ScaleRule.FLOOR:
            raise _bad(spec, f"{rule}+{headroom}", "headroom applies to floor only, not")
        default_scale = ("float8_e8m0fnu" if rule.power_of_two else
                         "float8_e4m3fn" if rule is ScaleRule.TWO_LEVEL else "float32")
        try:
            scaling = Scaling(gran, size, p.scale_format or FORMATS[default_scale], rule,
                              headroom)
        except CastSpecError as err:
            raise CastSpecError(f"cast spec {spec!r}: {err}") from None
    try:
        return Cast(elem, scaling, p.rounding or Rounding.RNE, p.overflow or Overflow.SATURATE)
    except CastSpecError as err:
        raise CastSpecError(f"cast spec {spec!r}: {err}") from None


# --- quantize ---------------------------------------------------------------------------------

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


def quantize(x: Tensor, cast_or_spec: Cast | str, *, axis: int = -1, seed: int | None = None,
             random_bits: Tensor | None = None, sr_bits: int = DEFAULT_SR_BITS,
             return_info: bool = False) -> Tensor | QuantInfo:
    """Cast ``x`` as the spec says and return the dequantized values (same shape and dtype).

    ``axis`` is the axis blocks run along (the contraction axis of a matmul).
    Stochastic rounding reads ``random_bits`` (shaped like ``x``) or draws
    them from ``seed``. With ``return_info`` a :class:`QuantInfo` comes back.
    """
    c = parse_cast(cast_or_spec)
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise DriftError(f"quantize needs a floating-point tensor, not {x.dtype}")
    if c.rounding is Rounding.SR and random_bits is None:
        if seed is None:
            raise DriftError("stochastic rounding needs seed= or random_bits=")
        random_bits = fast.draw_random_bits(x.shape, seed, sr_bits, x.device)
    if random_bits is not None:
        fast.check_random_bits(random_bits, x.shape, sr_bits)
    return _quantize(x, c, axis, random_bits, sr_bits, return_info)


def _scales(amax: Tensor, tensor_amax: Tensor, c: Cast) -> tuple[Tensor, Tensor]:
    """Each row's scale (the exponent ``k`` of ``2**k``, or the divisor) and if it clamped."""
    s = c.scaling
    if s.rule is not None and s.rule.power_of_two:
        return pow2_exponents(amax, c.format, s)
    if s.rule is ScaleRule.TWO_LEVEL:
        two = two_level_scales(amax, tensor_amax, c.format, s)
        return two.divisor, two.clamped
    return real_scales(amax, c.format, s)


def _apply(blocks: Tensor, bits: Tensor | None, scale: Tensor, nonfinite: Tensor, *,
           tgt: object, rounding: Rounding, overflow: Overflow, sr_bits: int, pow2: bool,
           blocked: bool, wide: bool) -> Tensor:
    """The element cast of every row under its scale: plain tensors and hashable constants
    only, so a compiler sees one graph."""
    if pow2:
        # a scaled grid beyond float32's range is rounded in float64, then stored as float32
        work = blocks.double() if wide else blocks
        q = fast.round_fused(work, tgt, rounding, overflow, bits, scale[:, None],
                             sr_bits).to(blocks.dtype)
    else:
        y = (blocks / scale[:, None]).contiguous()
        q = fast.round_fused(y, tgt, rounding, overflow, bits, None, sr_bits) * scale[:, None]
    if blocked:
        q = torch.where(nonfinite[:, None], torch.nan, q)
    return q


def _scaled_values(blocks: Tensor, bits: Tensor | None, amax: Tensor, nonfinite: Tensor,
                   tensor_amax: Tensor, *, c: Cast, sr_bits: int,
                   wide: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Dequantized rows, each row's scale and whether it clamped, from the rows' amax."""
    scale, clamped = _scales(amax, tensor_amax, c)
    s = c.scaling
    q = _apply(blocks, bits, scale, nonfinite, tgt=fast.target_of(c.format),
               rounding=c.rounding, overflow=c.overflow, sr_bits=sr_bits,
               pow2=bool(s.rule is not None and s.rule.power_of_two), blocked=s.blocked,
               wide=wide)
    return q, scale, clamped


def _stats(blocks: Tensor) -> tuple[Tensor, Tensor]:
    stats = block_stats(blocks)
    return stats.amax, stats.nonfinite


def _wide(amax: Tensor, c: Cast) -> bool:
    """Whether a power-of-two scaled grid leaves float32's range for some block (then float64).

    The extreme exponents bound every block's, as the rules are monotone in amax."""
    positive = torch.where(amax > 0, amax, torch.inf)
    ends = torch.stack([positive.min(), amax.max()]).nan_to_num(posinf=1.0)
    k, _ = pow2_exponents(torch.where(ends > 0, ends, 1.0), c.format, c.scaling)
    return int(k.min()) + c.format.qmin < -149 or int(k.max()) + c.format.emax >= 128


def _quantize(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None,
              sr_bits: int, want_info: bool) -> Tensor | QuantInfo:
    """The cast; the masks only when asked (they cost more passes than the cast itself)."""
    work = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    elem, s = c.format, c.scaling
    blocks, back = to_blocks(work, s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    n_rows = blocks.shape[0]
    no_blocks = torch.zeros(n_rows, dtype=torch.bool)
    rule = s.rule
    pow2 = rule is not None and rule.power_of_two
    tensor_scale = None
    if s.granularity is Granularity.NONE or blocks.numel() == 0:
        q = fast._round(blocks, None, elem, c.rounding, c.overflow, bits, sr_bits, blocks.dtype)
        scales = torch.ones(n_rows, dtype=torch.float64)
        clamped, bad_blocks = no_blocks, no_blocks
    else:
        out = None
        n = blocks.numel() if s.blocked else 0  # only block and tile scalings compile
        stats = fast.run_compiled(_stats, n, blocks)
        if stats is not None:  # compiled: amax pass, scales per block eagerly, element pass
            amax, nonfinite = stats
            scale, clamped = _scales(amax, amax.max(), c)
            q = fast.run_compiled(
                _apply, n, blocks, bits, scale, nonfinite, tgt=fast.target_of(elem),
                rounding=c.rounding, overflow=c.overflow, sr_bits=sr_bits, pow2=pow2,
                blocked=True, wide=pow2 and _wide(amax, c))
            out = None if q is None else (q, scale, clamped)
        if out is None:
            amax, nonfinite = _stats(blocks)
            static = {"c": c, "sr_bits": sr_bits, "wide": pow2 and _wide(amax, c)}
            # eagerly, in cache-sized slices (tensor and channel scalings always: one long row
            # per tensor or channel has tripped dynamo's shape specialisation)
            out = _sliced(blocks, bits, amax, nonfinite, amax.max(), static)
        tensor_amax = amax.max()
        q, scale, clamped = out
        bad_blocks = nonfinite if s.blocked else no_blocks
        clamped = clamped & ~bad_blocks  # a NaN block's scale is NaN, not clamped
        scales = torch.ldexp(torch.ones_like(scale, dtype=torch.float64), scale.double()) \
            if pow2 else scale.double()
        if s.blocked:
            scales = torch.where(bad_blocks, torch.nan, scales)
        if rule is ScaleRule.TWO_LEVEL:
            tensor_scale = float(two_level_scales(amax[:1], tensor_amax, elem, s).tensor_scale)
    if not want_info:
        return back(q).to(x.dtype)
    finite = torch.isfinite(blocks)
    if pow2:
        exps = (torch.frexp(scales)[1] - 1).double()[:, None]  # scales are powers of two
        top = torch.ldexp(torch.full_like(exps, float(elem.max)), exps)
        bottom = torch.ldexp(torch.full_like(exps, float(elem.min)), exps)
        small = torch.ldexp(torch.full_like(exps, float(elem.smallest_normal)), exps)
        wide_blocks = blocks.double()
        clipped = (wide_blocks > top) | (wide_blocks < bottom)
        subnormal = (q != 0) & (q.double().abs() < small)
    else:
        y, qy = blocks, q
        if s.granularity is not Granularity.NONE:  # the same float division the cast made
            y = (blocks / scales.to(blocks.dtype)[:, None]).contiguous()
            qy = fast._round(y, None, elem, c.rounding, c.overflow, bits, sr_bits, y.dtype)
        clipped = (y > float(elem.max)) | (y < float(elem.min))
        subnormal = (qy != 0) & (qy.abs() < float(elem.smallest_normal))
    underflowed = (blocks != 0) & finite & (q == 0)
    clipped = clipped & finite & ~bad_blocks[:, None]
    return QuantInfo(
        values=back(q).to(x.dtype), clipped=back(clipped), underflowed=back(underflowed),
        subnormal=back(subnormal & torch.isfinite(q)), nonfinite=back(~finite),
        scales=scales, scale_clamped=clamped, nonfinite_blocks=bad_blocks,
        tensor_scale=tensor_scale)


def _sliced(blocks: Tensor, bits: Tensor | None, amax: Tensor, nonfinite: Tensor,
            tensor_amax: Tensor, static: dict[str, object]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_scaled_values` eagerly, on cache-sized slices (3x faster than whole tensors)."""
    n_rows, n_cols = blocks.shape
    col_step = min(n_cols, fast.EAGER_CHUNK)
    row_step = max(1, fast.EAGER_CHUNK // col_step)
    q = torch.empty_like(blocks)
    scales, clamps = [], []
    for r in range(0, n_rows, row_step):
        rows = slice(r, r + row_step)
        for col in range(0, n_cols, col_step):
            cols = slice(col, col + col_step)
            part = None if bits is None else bits[rows, cols].contiguous()
            q[rows, cols], scale, clamped = _scaled_values(
                blocks[rows, cols].contiguous(), part, amax[rows], nonfinite[rows], tensor_amax,
                **static)  # type: ignore[arg-type]
        scales.append(scale)
        clamps.append(clamped)
    return q, torch.cat(scales), torch.cat(clamps)
