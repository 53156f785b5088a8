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
``rtz`` ``rup`` ``rdown`` ``sr``. Overflow: ``saturate`` ``ieee``. Transform (a scaled cast
only, also after a preset: ``nvfp4:rht=te``): ``rht=te`` ``rht=h`` ``rht=signs/<16 of + ->``
``rht=random/<seed>`` (:class:`~driftcli.records.cast.Rht`), and beside it ``tc=<tensor core>`` for
the transform on a tensor core's block-FMA unit (``nvfp4:rht=te,tc=h100_bf16_f32``). Defaults:
no scaling; with a granularity, ``floor`` for blocks and tiles and ``amax``
for tensors and channels; the scale format ``float8_e8m0fnu`` for
power-of-two rules, ``float8_e4m3fn`` for ``two-level``, ``float32`` for the
``amax`` rules; ``rne``; ``saturate``. ``str(cast)`` writes every part, in
the order above, and ``parse_cast(str(c)) == c``.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, NamedTuple

from driftcli.choices import parse_choice
from driftcli.errors import CastSpecError, DriftError, FormatSpecError, close_matches
from driftcli.records.cast import EXACT_ARITHMETIC, Cast, Rht, ScaleArithmetic, Scaling
from driftcli.records.formats import FORMATS, Format, colon_free, get_format
from driftcli.records.modes import Granularity, Overflow, Rounding, ScaleRule
from driftcli.records.presets import preset, preset_names

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
    rht: Rht | None




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
            items = part.split(",")
            rest = ",".join(i for i in items if not i.startswith(("rht=", "tc=")))
            # tc= names the tensor core the rht= of the same part runs on
            cores = [i.removeprefix("tc=") for i in items if i.startswith("tc=")]
            try:
                transforms = [Rht.parse(i.removeprefix("rht=")) for i in items
                              if i.startswith("rht=")]
                if cores and (len(cores) > 1 or len(transforms) != 1 or not cores[0]):
                    raise CastSpecError(
                        f"{part!r}: tc= names the tensor core of the one rht= transform "
                        "in its part, e.g. nvfp4:rht=te,tc=h100_bf16_f32")
                transforms = [replace(t, core=cores[0]) for t in transforms] if cores \
                    else transforms
                arithmetic = ScaleArithmetic.parse(rest) if rest else None
            except CastSpecError as err:
                raise CastSpecError(f"cast spec {spec!r}: {err}") from None
            for transform in transforms:
                put("rht", transform, part)
            if arithmetic is not None:
                put("scale arithmetic", arithmetic, part)
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
                  found.get("overflow"), found.get("scale arithmetic"), found.get("rht"))


def parse_cast(spec: str | Cast) -> Cast:
    """A :class:`Cast` from a preset name or a spec string (see the module docs)."""
    if isinstance(spec, Cast):
        return spec
    spec = colon_free(spec)  # p3109:k8p4se:block32 reads as binary8p4se:block32
    if (whole := preset(spec)) is not None:
        return whole
    head, *rest = spec.strip().split(":")
    if (base := preset(head)) is not None:  # rounding or overflow changed: mxfp4_e2m1:sr
        p = _classify(spec, rest)
        if p.granularity or p.rule or p.arithmetic:
            raise _bad(spec, ":".join(rest), "a preset fixes its scaling; write the full spec "
                       f"({base}) to change it, not")
        scaling = base.scaling
        if p.rht is not None:  # a transform before the preset's cast: nvfp4:rht=te
            if base.rht is not None:
                raise _bad(spec, f"rht={p.rht}", f"preset {head!r} has rht={base.rht}; a second")
            try:
                base = replace(base, rht=p.rht)
            except CastSpecError as err:
                raise CastSpecError(f"cast spec {spec!r}: {err}") from None
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
        # names are lower case: MXFP8_E4M3 is the name mxfp8_e4m3 in capitals
        names, folded = [*preset_names(), *FORMATS], head.casefold()
        hint = f"; did you mean {folded}?" if folded in names else close_matches(folded, names)
        raise CastSpecError(f"cast spec {spec!r}: unknown format or preset {head!r}{hint} "
                            "(see drift formats --presets)") from None
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
        return Cast(elem, scaling, p.rounding or Rounding.RNE, p.overflow or Overflow.SATURATE,
                    p.rht)
    except CastSpecError as err:
        raise CastSpecError(f"cast spec {spec!r}: {err}") from None
