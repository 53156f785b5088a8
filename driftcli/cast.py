"""Casts as settings: a format, a scaling, a rounding mode and an overflow policy; the spec
strings and the presets. Nothing here imports torch (``drift formats`` and ``--help`` use it).

A cast spec is colon-separated parts, the element format first; the other
parts may come in any order and are recognised by their words::

    float8_e4m3fn:block32:float8_e8m0fnu:floor:rne:saturate     (the canonical form)
    float8_e4m3fn:block32                                        (the same, by defaults)
    float4_e2m1fn:block16:float8_e4m3fn:two-level                (NVFP4)
    float8_e4m3fn:tensor:amax                                    (per-tensor current scaling)
    mxfp8_e4m3_floor+1                                           (a preset)
    mxfp4_e2m1:sr                                                (a preset, rounding changed)
    nvfp4:ue5m3                                                  (a preset, scale format changed)

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

import math
import re
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, NamedTuple

from driftcli.errors import CastSpecError, DriftError, FormatSpecError, close_matches
from driftcli.formats import FORMATS, Format, colon_free, get_format
from driftcli.modes import (
    AmaxPolicy,
    ElementOp,
    Granularity,
    Guard,
    Overflow,
    Pow2,
    Precision,
    Rounding,
    ScaleOp,
    ScaleRule,
    SmallestRcp,
    TwoLevelOrder,
    parse_choice,
)


def _number(value: float) -> str:
    """A non-negative float as the spec writes it: ``2^k`` for a power of two, else its
    shortest round-tripping decimal."""
    mantissa, exponent = math.frexp(value)
    return f"2^{exponent - 1}" if value > 0 and mantissa == 0.5 else repr(value)


def _parse_number(text: str) -> float:
    if m := re.fullmatch(r"2\^(-?\d+)", text):
        value = math.ldexp(1.0, int(m[1]))
    else:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
    if not math.isfinite(value) or value < 0:
        raise CastSpecError(f"{text!r} is not a non-negative number; write e.g. 1e-12 or 2^-126")
    return value


@dataclass(frozen=True)
class ScaleArithmetic:
    """Where each float operation of a scale happens, and in what precision: the order an
    implementation computes in. The defaults are drift's exact rules (docs/scaling.md); any
    other setting is written in the cast's spec as ``key=value`` items (docs/recipes.md).

    Each field is one spec key (:data:`ARITHMETIC_KEYS`): ``amax`` which elements amax reads;
    ``eps`` a floor on amax; ``scale`` the operation giving the real scale (``s = amax / M``,
    its reciprocal ``r = M / amax``, or ``amax · fl(1 / M)``) and ``prec`` its precision;
    ``guard`` what an all-zero (or nonfinite) group gets; ``pow2`` how a power of two is taken;
    ``smin`` a floor on the real scale before it is rounded into the scale format; ``divmin``
    a floor on a power-of-two divisor that leaves the stored scale alone; ``apply`` whether
    elements are divided by ``s`` or multiplied by ``r``, ``rcpmin`` the multiplier of the
    smallest power-of-two scale, ``undo`` whether codes are multiplied by ``s`` or divided by
    ``r`` (the missing one of ``s`` and ``r`` is the rounded reciprocal of the other); ``two``
    the whole order of a two-level cast."""

    amax: AmaxPolicy = AmaxPolicy.FINITE
    eps: float = 0.0
    scale: ScaleOp = ScaleOp.DIV
    prec: Precision = Precision.F32
    guard: Guard = Guard.DRIFT
    pow2: Pow2 = Pow2.BITS
    smin: float = 0.0
    divmin: float = 0.0
    apply: ElementOp = ElementOp.DIV
    rcpmin: SmallestRcp = SmallestRcp.EXACT
    undo: ElementOp = ElementOp.MUL
    two: TwoLevelOrder = TwoLevelOrder.DRIFT

    def __post_init__(self) -> None:
        for name in ("eps", "smin", "divmin"):
            value = getattr(self, name)
            if not (isinstance(value, float | int) and math.isfinite(value) and value >= 0):
                raise CastSpecError(f"scale arithmetic {name}={value!r} must be a finite "
                                    "non-negative number, e.g. 1e-12 or 2^-126")

    @property
    def exact(self) -> bool:
        """Whether this is drift's exact arithmetic (every setting at its default)."""
        return self == EXACT_ARITHMETIC

    def changed(self) -> list[str]:
        """The keys set away from their defaults, in canonical order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]

    def __str__(self) -> str:
        items = []
        for name in self.changed():
            value = getattr(self, name)
            items.append(f"{name}={_number(value) if isinstance(value, float) else value}")
        return ",".join(items)

    @staticmethod
    def parse(text: str) -> ScaleArithmetic:
        """The arithmetic a ``key=value,...`` spec part names (unnamed keys keep defaults)."""
        kinds = {f.name: f for f in fields(ScaleArithmetic)}
        found: dict[str, Any] = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            if key not in kinds:
                raise CastSpecError(f"unknown scale arithmetic key {key!r}"
                                    f"{close_matches(key, kinds)} (keys: {', '.join(kinds)})")
            if key in found:
                raise CastSpecError(f"scale arithmetic key {key!r} given twice")
            kind = type(kinds[key].default)
            if issubclass(kind, StrEnum):
                choices = [m.value for m in kind]
                if value not in choices:
                    raise CastSpecError(f"scale arithmetic {key}={value!r}: choose from "
                                        f"{', '.join(choices)}")
                found[key] = kind(value)
            else:
                found[key] = _parse_number(value)
        return ScaleArithmetic(**found)


EXACT_ARITHMETIC = ScaleArithmetic()
"""drift's own: every scale exact to its rule's definition."""

ARITHMETIC_KEYS = tuple(f.name for f in fields(ScaleArithmetic))
"""The spec keys of a scale arithmetic, in canonical order."""

_POW2_KEYS = {"amax", "scale", "pow2", "divmin", "apply", "rcpmin"}
_REAL_KEYS = {"amax", "eps", "scale", "prec", "guard", "pow2", "smin", "apply", "undo"}
_TWO_LEVEL_KEYS = {"amax", "two"}


@dataclass(frozen=True)
class Scaling:
    """Granularity, block size, scale format, rule and headroom binades (``floor+k``)."""

    granularity: Granularity = Granularity.NONE
    block: int = 0
    scale_format: Format | None = None
    rule: ScaleRule | None = None
    headroom: int = 0
    arithmetic: ScaleArithmetic = EXACT_ARITHMETIC

    def __post_init__(self) -> None:
        blocked = self.granularity in (Granularity.BLOCK, Granularity.TILE)
        if blocked and self.block < 1:
            raise CastSpecError(f"{self.granularity.value} scaling needs a size, e.g. block32")
        if not blocked and self.block:
            raise CastSpecError(f"{self.granularity.value} scaling takes no block size")
        if self.granularity is Granularity.NONE:
            if self.scale_format is not None or self.rule is not None or self.headroom or \
                    not self.arithmetic.exact:
                raise CastSpecError("an unscaled cast takes no scale format, rule, headroom or "
                                    "scale arithmetic")
            return
        if self.scale_format is None or self.rule is None:
            raise CastSpecError("a scaled cast needs a scale format and a rule")
        if self.headroom and self.rule is not ScaleRule.FLOOR:
            raise CastSpecError(f"headroom (+{self.headroom}) applies to the floor rule only")
        if self.headroom < 0:
            raise CastSpecError("headroom must be a positive number of binades")
        if self.rule is ScaleRule.TWO_LEVEL and not blocked:
            raise CastSpecError("the two-level rule needs block or tile granularity")
        _check_arithmetic(self.arithmetic, self.rule, self.scale_format)
        if self.arithmetic.two.row_scaled and self.granularity is not Granularity.BLOCK:
            raise CastSpecError(f"two={self.arithmetic.two} (row-scaled NVFP4) takes 1 x 16 "
                                "blocks (block16), not tiles")
        if self.arithmetic.two.four_over_six and (self.granularity is not Granularity.BLOCK
                                                  or self.block != 16):
            raise CastSpecError(f"two={self.arithmetic.two} is implemented for 1 x 16 blocks "
                                "(block16); 16 x 16 tiles are not yet")

    @property
    def blocked(self) -> bool:
        """Whether scales are per block or tile (which makes nonfinite blocks NaN)."""
        return self.granularity in (Granularity.BLOCK, Granularity.TILE)



def _check_arithmetic(a: ScaleArithmetic, rule: ScaleRule, scale_format: Format) -> None:
    """Refuse settings that mean nothing under ``rule`` (one line naming the key and why)."""
    if a.exact:
        return
    allowed = (_TWO_LEVEL_KEYS if rule is ScaleRule.TWO_LEVEL else
               _POW2_KEYS if rule.power_of_two else _REAL_KEYS)
    for key in a.changed():
        if key not in allowed:
            takes = ", ".join(k for k in ARITHMETIC_KEYS if k in allowed)
            raise CastSpecError(f"scale arithmetic {key}= does not apply to the {rule} rule "
                                f"(it takes {takes})")
    if rule.power_of_two:
        if a.pow2 is not Pow2.BITS and rule is not ScaleRule.CEIL:
            raise CastSpecError(f"pow2={a.pow2} rounds amax / M up: it applies to the ceil rule, "
                                f"not {rule}")
        if a.scale is ScaleOp.RCP or (a.scale is not ScaleOp.DIV and a.pow2 is Pow2.BITS):
            raise CastSpecError(f"scale={a.scale} needs pow2=rp or pow2=log2 under a "
                                "power-of-two rule (scale=rcp never applies)")
        if a.rcpmin is SmallestRcp.ONE and a.apply is not ElementOp.MUL:
            raise CastSpecError("rcpmin=one sets a multiplier: it needs apply=mul")
        if a.divmin and a.apply is not ElementOp.DIV:
            raise CastSpecError("divmin= floors a divisor: it needs apply=div")
    elif rule is not ScaleRule.TWO_LEVEL:
        if a.pow2 is Pow2.RP:
            raise CastSpecError(f"pow2=rp applies to the ceil rule, not {rule}")
        if a.pow2 is Pow2.LOG2 and (rule is not ScaleRule.AMAX_UP or scale_format.mbits
                                    or scale_format.integer):
            raise CastSpecError("pow2=log2 on a real scale needs the amax-up rule into a "
                                f"power-of-two scale format (float8_e8m0fnu), not {rule} into "
                                f"{scale_format.name}")
        if a.smin and a.scale is ScaleOp.RCP:
            raise CastSpecError("smin= floors the scale s; with scale=rcp there is none")
    if a.two is not TwoLevelOrder.DRIFT and rule is not ScaleRule.TWO_LEVEL:
        raise CastSpecError(f"two={a.two} is an order of the two-level rule, not of {rule}")


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
        two = s.arithmetic.two
        if two is not TwoLevelOrder.DRIFT and (self.format, s.scale_format) != _NVFP4_PAIR:
            # the libraries' orders are written with NVFP4's constants (6, 448, 2688) and an
            # E4M3 rounding of the block scale: on other formats they would be silently wrong
            raise CastSpecError(
                f"two={two} is {two.value.split('-')[0]}'s NVFP4 order, written for "
                f"float4_e2m1fn elements under float8_e4m3fn block scales, not "
                f"{self.format.name} under {s.scale_format.name if s.scale_format else 'none'}; "
                "leave two= out for drift's exact two-level rule on these formats")

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
        tail = [] if s.arithmetic.exact else [str(s.arithmetic)]
        return ":".join([*parts, self.rounding.value, self.overflow.value, *tail])


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
_RULE = re.compile(r"(.+?)(?:\+(\d+))?")
"""A rule part: a :class:`ScaleRule` member's name, optionally ``+<headroom>``; the names are
the members' (read at parse time, so the grammar is the enum)."""


class _Parts(NamedTuple):
    granularity: tuple[Granularity, int] | None
    rule: tuple[ScaleRule, int] | None
    scale_format: Format | None
    rounding: Rounding | None
    overflow: Overflow | None
    arithmetic: ScaleArithmetic | None


_NVFP4_PAIR = (FORMATS["float4_e2m1fn"], FORMATS["float8_e4m3fn"])
"""The element and block-scale formats the libraries' two-level orders are written for."""


def _bad(spec: str, part: str, why: str, hint: str = "") -> CastSpecError:
    return CastSpecError(f"cast spec {spec!r}: {why} {part!r}{hint}; write FORMAT[:GRANULARITY]"
                         "[:SCALE_FORMAT][:RULE][:ROUNDING][:OVERFLOW], e.g. "
                         "float8_e4m3fn:block32:floor, or a preset (drift formats --presets)")


def _classify(spec: str, parts: list[str]) -> _Parts:
    found: dict[str, Any] = {}

    def put(kind: str, value: object, part: str) -> None:
        if kind in found:
            raise _bad(spec, part, f"a second {kind}")
        found[kind] = value

    for part in parts:
        if "=" in part:
            try:
                put("scale arithmetic", ScaleArithmetic.parse(part), part)
            except CastSpecError as err:
                raise CastSpecError(f"cast spec {spec!r}: {err}") from None
        elif g := _GRANULARITY.fullmatch(part):
            gran = Granularity(g[1] or g[2])
            put("granularity", (gran, int(g[3] or 0)), part)
        elif (r := _RULE.fullmatch(part)) and r[1] in ScaleRule.__members__.values():
            put("rule", (parse_choice(ScaleRule, r[1], "scale rule"), int(r[2] or 0)), part)
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
    return _Parts(found.get("granularity"), found.get("rule"),
                  found.get("scale format"), found.get("rounding"),
                  found.get("overflow"), found.get("scale arithmetic"))


def _preset(name: str) -> Cast | None:
    """The cast a preset name stands for: drift's (:data:`PRESETS`) or an implementation's
    (:data:`driftcli.recipes.IMPLEMENTATION_PRESETS`, looked up when asked: that module builds
    its presets from this one)."""
    if name in PRESETS:
        return PRESETS[name][0]
    from driftcli.recipes import IMPLEMENTATION_PRESETS

    found = IMPLEMENTATION_PRESETS.get(name)
    return None if found is None else found.cast


def preset_names() -> list[str]:
    """Every preset name: drift's, then the implementations'."""
    from driftcli.recipes import IMPLEMENTATION_PRESETS

    return [*PRESETS, *IMPLEMENTATION_PRESETS]


def parse_cast(spec: str | Cast) -> Cast:
    """A :class:`Cast` from a preset name or a spec string (see the module docs)."""
    if isinstance(spec, Cast):
        return spec
    spec = colon_free(spec)  # p3109:k8p4se:block32 reads as binary8p4se:block32
    if (whole := _preset(spec)) is not None:
        return whole
    head, *rest = spec.strip().split(":")
    if (base := _preset(head)) is not None:  # rounding or overflow changed: mxfp4_e2m1:sr
        p = _classify(spec, rest)
        if p.granularity or p.rule or p.arithmetic:
            raise _bad(spec, ":".join(rest), "a preset fixes its scaling; write the full spec "
                       f"({base}) to change it, not")
        scaling = base.scaling
        if p.scale_format is not None:  # another block-scale format: nvfp4:ue5m3 (AMD-FP4)
            if scaling.granularity is Granularity.NONE:
                raise _bad(spec, p.scale_format.name,
                           f"preset {head!r} is unscaled: it takes no scale format")
            try:
                scaling = replace(scaling, scale_format=p.scale_format)
                return replace(base, scaling=scaling, rounding=p.rounding or base.rounding,
                               overflow=p.overflow or base.overflow)
            except CastSpecError as err:
                raise CastSpecError(f"cast spec {spec!r}: {err}") from None
        return replace(base, rounding=p.rounding or base.rounding,
                       overflow=p.overflow or base.overflow)
    try:
        elem = get_format(head)
    except FormatSpecError as err:
        raise CastSpecError(f"cast spec {spec!r}: {err}") from None
    except DriftError:
        raise CastSpecError(
            f"cast spec {spec!r}: unknown format or preset {head!r}"
            f"{close_matches(head, [*preset_names(), *FORMATS])} (see drift formats --presets)"
        ) from None
    p = _classify(spec, rest)
    gran, size = p.granularity or (Granularity.NONE, 0)
    if gran is Granularity.NONE:
        if p.rule is not None or p.scale_format is not None or p.arithmetic is not None:
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
                              headroom, p.arithmetic or EXACT_ARITHMETIC)
        except CastSpecError as err:
            raise CastSpecError(f"cast spec {spec!r}: {err}") from None
    try:
        return Cast(elem, scaling, p.rounding or Rounding.RNE, p.overflow or Overflow.SATURATE)
    except CastSpecError as err:
        raise CastSpecError(f"cast spec {spec!r}: {err}") from None
