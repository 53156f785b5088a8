"""The cast record: what one tensor's cast is (an element format, a scaling with its scale
arithmetic, a rounding mode and an overflow policy), and the checks that make every record a
cast drift can compute. Nothing here imports torch (``drift formats`` and ``--help`` use it).

The spec strings that name casts are :mod:`driftcli.records.castspec`'s; the named casts (presets)
are
:mod:`driftcli.records.presets`'.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from enum import StrEnum
from functools import cached_property
from typing import Any

from driftcli.errors import CastSpecError, close_matches
from driftcli.records.formats import FORMATS, Format
from driftcli.records.modes import (
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
        if self.arithmetic.two.four_over_six and (self.granularity not in (Granularity.BLOCK,
                                                                           Granularity.TILE)
                                                  or self.block != 16):
            raise CastSpecError(f"two={self.arithmetic.two} takes 1 x 16 blocks (block16) or "
                                "16 x 16 tiles (tile16), as Transformer Engine's reference")

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


class MicroBase(StrEnum):
    """How a multi-level cast's first-level (whole-block) scale is chosen from the block's
    amax; the levels below it are one-bit micro-exponents (:class:`MicroScaling`)."""

    POW2 = "pow2"
    """``2**k`` with ``k = floor(log2 amax) - emax_elem - T`` (``T`` the micro-exponents'
    total range), clamped to the scale format; elements are multiplied by ``2**-k`` (MX6,
    MX9: the block's shared exponent sits one binade below its largest pair's)."""
    BF16_RCP = "bf16-rcp"
    """HiFloat4's: ``s = rne_scale_format(rne_bf16(amax · rne_bf16(1 / M)))`` with ``M =
    max_elem · 2**T``, clamped to the scale format; elements are multiplied by ``r =
    rne_bf16(1 / s)`` (exactly) and the codes times ``s`` are the values."""


@dataclass(frozen=True)
class MicroLevel:
    """One micro-exponent level: each run of ``size`` elements shares an exponent ``e`` in
    ``0..top`` that multiplies its scale by ``2**e``."""

    size: int
    top: int = 1


@dataclass(frozen=True)
class MicroScaling:
    """A block scale refined by micro-exponents: the block's first-level scale (``base``, in
    ``scale_format``) and the levels below it, outermost first, each level's runs nested in
    the one above. ``name`` is the preset that writes it (``hifloat4``, ``mx6``)."""

    name: str
    block: int
    scale_format: Format
    base: MicroBase
    levels: tuple[MicroLevel, ...]

    def __post_init__(self) -> None:
        outer = self.block
        for level in self.levels:
            if level.size < 1 or outer % level.size or level.top < 1:
                raise CastSpecError(
                    f"{self.name}: a micro-exponent level of {level.size} elements (range "
                    f"0..{level.top}) must divide the level above it ({outer})")
            outer = level.size

    @property
    def steps(self) -> int:
        """``T``: the binades all levels together can add to the first-level scale."""
        return sum(level.top for level in self.levels)


RHT_SIZE = 16
"""The Hadamard transform's length: NVFP4's block (Transformer Engine refuses any other)."""
RHT_CHECKPOINT = "checkpoint"
"""``rht=checkpoint``: the signs of each layer's ``_rht_sign_vector`` in the scanned checkpoint
(torchao's NVFP4 training stores one per layer)."""
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""Transformer Engine's hard-coded wgrad sign vector (``pytorch/tensor/nvfp4_tensor.py``
``get_wgrad_sign_vector`` lines 49-59 and ``custom_recipes/reference_nvfp4.py`` lines 335-340, at
d0067d0); torchao's NVFP4 training uses the same one (``_TP_RHT_SIGN_VECTOR`` in
``torchao/prototype/moe_training/nvfp4_training/nvfp4_tensor_parallel.py``, pytorch/ao at
9c82552)."""


def _splitmix64(state: int) -> int:
    """One output of splitmix64 (Steele, Lea, Flood 2014): a fixed integer function, so a seed
    gives the same signs on every machine and version."""
    mask = (1 << 64) - 1
    z = (state + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


@dataclass(frozen=True)
class Rht:
    """A 16-point random Hadamard transform applied before a cast, along the block axis:
    each group of 16 elements ``x`` becomes ``y_j = rn_bf16(sum_i x_i · s_i · H16[i][j] / 4)``,
    the sum in float32 from i = 0, or on the tensor core ``core`` names
    (docs/recipes.md#random-hadamard-transform). ``signs`` are the
    16 ``s_i``; ``name`` is how the spec writes them (``te``, ``h``, ``signs/…``,
    ``random/<seed>``)."""

    signs: tuple[int, ...]
    name: str
    core: str = ""
    """The tensor core whose block-FMA unit runs the transform (``tc=`` beside ``rht=``, a
    ``CORES`` name with bfloat16 inputs, checked where the transform runs:
    :mod:`driftcli.casts.hadamard`), or "" for the float32 sum in order."""

    def __post_init__(self) -> None:
        if self.core and not re.fullmatch(r"[a-z0-9_]{1,64}", self.core):
            raise CastSpecError(f"rht tc={self.core!r}: name a tensor core with bfloat16 "
                                "inputs, e.g. tc=h100_bf16_f32 (docs/tensor-cores.md)")
        if self.from_checkpoint and not self.signs:
            return  # resolved per tensor by a scan (driftcli.io.rht_signs)
        if len(self.signs) != RHT_SIZE or any(s not in (1, -1) for s in self.signs):
            raise CastSpecError(f"rht signs must be {RHT_SIZE} values of +1 or -1, not "
                                f"{self.signs!r}")

    def __str__(self) -> str:
        return f"{self.name},tc={self.core}" if self.core else self.name

    @property
    def from_checkpoint(self) -> bool:
        """Whether the signs are each layer's ``_rht_sign_vector`` in the checkpoint scanned
        (``rht=checkpoint``), still to be read (:mod:`driftcli.io.rht_signs`)."""
        return self.name == RHT_CHECKPOINT

    @staticmethod
    def parse(text: str) -> Rht:
        """The transform a spec's ``rht=`` value names."""
        if text == RHT_CHECKPOINT:
            return Rht((), RHT_CHECKPOINT)
        if text == "te":
            return Rht(TE_SIGNS, "te")
        if text == "h":
            return Rht((1,) * RHT_SIZE, "h")
        kind, _, arg = text.partition("/")
        if kind == "signs" and re.fullmatch(r"[+-]{16}", arg):
            return Rht(tuple(1 if c == "+" else -1 for c in arg), text)
        if kind == "random" and re.fullmatch(r"\d{1,20}", arg) and int(arg) < 1 << 64:
            bits = _splitmix64(int(arg))
            return Rht(tuple(-1 if bits >> i & 1 else 1 for i in range(RHT_SIZE)),
                       f"random/{int(arg)}")
        raise CastSpecError(f"rht={text!r}: write rht=te (Transformer Engine's signs), rht=h "
                            "(no signs), rht=signs/<16 of + or ->, rht=random/<seed> or "
                            "rht=checkpoint (each layer's _rht_sign_vector)")

    def entries(self) -> tuple[float, ...]:
        """The transform's matrix, row-major: ``m[16 i + j] = s_i · H16[i][j] / 4`` with
        Sylvester's ``H16[i][j] = (-1)**popcount(i & j)``: ``diag(signs) @ H / sqrt(16)``, as
        the reference builds it (``reference_nvfp4.py`` lines 396-419, 438-444)."""
        if self.from_checkpoint:
            raise CastSpecError(
                "rht=checkpoint takes each layer's signs from its _rht_sign_vector, which only "
                "a scan of that checkpoint reads (drift clip-rate CKPT -c 'nvfp4:rht=checkpoint'); "
                "here give the signs: rht=signs/<16 of + or -> or rht=te")
        return tuple(s * (-1) ** (i & j).bit_count() / 4 for i, s in enumerate(self.signs)
                     for j in range(RHT_SIZE))

    @staticmethod
    def of_signs(signs: tuple[int, ...]) -> Rht:
        """The transform of a sign vector read from a checkpoint (``_rht_sign_vector``)."""
        vector = tuple(int(s) for s in signs)
        return Rht(vector, "signs/" + "".join("+" if s > 0 else "-" for s in vector))


@dataclass(frozen=True)
class Cast:
    """How one tensor is cast: element format, scaling, rounding, overflow."""

    format: Format
    scaling: Scaling = field(default_factory=Scaling)
    rounding: Rounding = Rounding.RNE
    overflow: Overflow = Overflow.SATURATE
    rht: Rht | None = None
    """A random Hadamard transform of the input before the cast (None: none)."""
    micro: MicroScaling | None = None
    """Micro-exponents under the block scale (None: one level); the scaling then says the
    block, its scale format and the nearest single-level rule (docs/formats.md#hifloat4)."""

    def __post_init__(self) -> None:
        s = self.scaling
        m = self.micro
        if m is not None and (s.granularity is not Granularity.BLOCK or s.block != m.block
                              or s.scale_format != m.scale_format or not s.arithmetic.exact):
            raise CastSpecError(f"{m.name} fixes its scaling (blocks of {m.block} under "
                                f"{m.scale_format.name}, drift's exact arithmetic)")
        if self.rht is not None and s.granularity is Granularity.NONE:
            raise CastSpecError(f"rht={self.rht} transforms what a scaled cast reads; "
                                f"{self.format.name} is unscaled: give a granularity "
                                "(e.g. nvfp4:rht=te)")
        if s.rule is ScaleRule.TWO_LEVEL and s.scale_format is not None and (
                s.scale_format.max * self.format.max > FORMATS["float32"].max):
            raise CastSpecError(
                f"two-level scaling needs a scale format whose max times {self.format.name}'s "
                f"max fits a float32 (the tensor scale is amax / that product); "
                f"{s.scale_format.name} does not: use float8_e4m3fn as NVFP4 does")
        two = s.arithmetic.two
        if two is not TwoLevelOrder.DRIFT and (self.format, s.scale_format) != NVFP4_PAIR:
            # the libraries' orders are written with NVFP4's constants (6, 448, 2688) and an
            # E4M3 rounding of the block scale: on other formats they would be silently wrong
            raise CastSpecError(
                f"two={two} is {two.value.split('-')[0]}'s NVFP4 order, written for "
                f"float4_e2m1fn elements under float8_e4m3fn block scales, not "
                f"{self.format.name} under {s.scale_format.name if s.scale_format else 'none'}; "
                "leave two= out for drift's exact two-level rule on these formats")

    def __str__(self) -> str:
        return self._spec

    @cached_property
    def _spec(self) -> str:
        # a scan names its cast in every row it writes: spelled once per Cast, not per row
        s = self.scaling
        if self.micro is not None:  # its preset, with the parts a preset may change
            tail = [f"rht={self.rht}"] if self.rht is not None else []
            return ":".join([self.micro.name, self.rounding.value, self.overflow.value, *tail])
        parts = [self.format.name]
        if s.granularity is Granularity.NONE:
            parts.append("none")
        else:
            size = str(s.block) if s.block else ""
            rule = f"{s.rule}+{s.headroom}" if s.headroom else str(s.rule)
            scale_name = s.scale_format.name if s.scale_format is not None else ""
            parts += [f"{s.granularity}{size}", scale_name, rule]
        tail = [] if s.arithmetic.exact else [str(s.arithmetic)]
        if self.rht is not None:
            tail.append(f"rht={self.rht}")
        return ":".join([*parts, self.rounding.value, self.overflow.value, *tail])


NVFP4_PAIR = (FORMATS["float4_e2m1fn"], FORMATS["float8_e4m3fn"])
"""The element and block-scale formats the libraries' two-level orders are written for."""
