"""Implementation presets: casts named ``<implementation>/<recipe>`` that reproduce how torchao,
Transformer Engine and DeepSeek compute their scales, operation for operation, including where
they depart from their own specification. Each names its source and the exact drift cast of
the same recipe beside it. Nothing here imports torch (``drift formats --presets`` lists them).

The op sequences, their sources and every departure are in docs/recipes.md; the settings that
spell them are :class:`driftcli.cast.ScaleArithmetic`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from driftcli.cast import Cast, ScaleArithmetic, Scaling
from driftcli.formats import FORMATS
from driftcli.modes import (
    AmaxPolicy,
    ElementOp,
    Granularity,
    Guard,
    Pow2,
    Precision,
    ScaleOp,
    ScaleRule,
    SmallestRcp,
    TwoLevelOrder,
)


@dataclass(frozen=True)
class Implementation:
    """A library or codebase whose casts drift reproduces."""

    name: str
    """The prefix of its presets (``torchao``)."""
    title: str
    version: str
    """The version (and commit, where there is no release) the presets follow."""
    home: str


@dataclass(frozen=True)
class ImplementationPreset:
    """One implementation's cast, as it computes it."""

    name: str
    """``<implementation>/<recipe>``."""
    cast: Cast
    meaning: str
    implementation: Implementation
    source: str
    """The file(s), under the implementation's source tree, and the function(s) whose
    operations the cast follows (docs/recipes.md has each step with its lines)."""
    exact: str
    """drift's exact cast of the same recipe (a preset name or a spec)."""


TORCHAO = Implementation("torchao", "torchao (PyTorch)", "0.18.0", "https://github.com/pytorch/ao")

_E8M0, _E4M3 = FORMATS["float8_e8m0fnu"], FORMATS["float8_e4m3fn"]

_TORCHAO_TENSOR = ScaleArithmetic(
    amax=AmaxPolicy.IEEE, eps=1e-12, scale=ScaleOp.RCP, prec=Precision.F64, guard=Guard.NONE,
    apply=ElementOp.MUL, undo=ElementOp.DIV)
"""torchao's float8 training casts: ``r = fl32(fl64(M / max(amax, 1e-12)))`` over every element
(NaN and inf included), ``fl(x · r)``, ``fl(q / r)``."""

_TORCHAO_FLOAT8 = ("float8/float8_scaling_utils.py hp_tensor_to_float8_dynamic, "
                   "float8_utils.py amax_to_scale")
_TORCHAO_MX = "prototype/mx_formats/mx_tensor.py to_mx, to_dtype"
_TORCHAO_RCEIL = "prototype/mx_formats/mx_tensor.py _to_mx_rceil (eager), to_dtype"
_TORCHAO_NVFP4 = "prototype/mx_formats/nvfp4_tensor.py nvfp4_quantize, NVFP4Tensor.dequantize"


def _tensorwise(elem: str, rule: ScaleRule, scale_format: str, pow2: Pow2,
                granularity: Granularity = Granularity.TENSOR) -> Cast:
    arithmetic = replace(_TORCHAO_TENSOR, pow2=pow2)
    return Cast(FORMATS[elem], Scaling(granularity, 0, FORMATS[scale_format], rule,
                                       arithmetic=arithmetic))


_MX_ELEMENTS = {"mxfp8": "float8_e4m3fn", "mxfp6_e3m2": "float6_e3m2fn",
                "mxfp6_e2m3": "float6_e2m3fn", "mxfp4": "float4_e2m1fn"}
"""torchao's MX recipe names and their element formats (drift's exact presets are
``mxfp8_e4m3``, ``mxfp6_e3m2``, ``mxfp6_e2m3``, ``mxfp4_e2m1``)."""
_DRIFT_MX = {"mxfp8": "mxfp8_e4m3", "mxfp6_e3m2": "mxfp6_e3m2", "mxfp6_e2m3": "mxfp6_e2m3",
             "mxfp4": "mxfp4_e2m1"}

_TORCHAO_MX_FLOORED = ScaleArithmetic(amax=AmaxPolicy.IEEE, divmin=2.0**-126)
"""torchao's FLOOR, CEIL and EVEN: the exponent from amax's bits, elements divided by the scale
raised to float32's smallest normal (the stored E8M0 code keeps 2**-127)."""
_TORCHAO_MX_RCEIL = ScaleArithmetic(amax=AmaxPolicy.IEEE, pow2=Pow2.LOG2, apply=ElementOp.MUL,
                                    rcpmin=SmallestRcp.ONE)
"""torchao's eager RCEIL: ``ceil(log2(fl(amax / M)))`` in float32, elements multiplied by
``2**-k`` (by 1 for code 0)."""


def _mx(recipe: str, rule: ScaleRule, arithmetic: ScaleArithmetic) -> Cast:
    return Cast(FORMATS[_MX_ELEMENTS[recipe]],
                Scaling(Granularity.BLOCK, 32, _E8M0, rule, arithmetic=arithmetic))


def _torchao_presets() -> list[ImplementationPreset]:
    out = [
        ImplementationPreset(
            "torchao/float8_tensorwise",
            _tensorwise("float8_e4m3fn", ScaleRule.AMAX, "float32", Pow2.BITS),
            "float8 training, tensorwise (the default recipe): r = fl32(fl64(448 / max(amax, "
            "1e-12))), x·r, q / r", TORCHAO, _TORCHAO_FLOAT8, "fp8_e4m3"),
        ImplementationPreset(
            "torchao/float8_tensorwise_e5m2",
            _tensorwise("float8_e5m2", ScaleRule.AMAX, "float32", Pow2.BITS),
            "the same cast into E5M2 (torchao's gradients under a custom config)", TORCHAO,
            _TORCHAO_FLOAT8, "fp8_e5m2"),
        ImplementationPreset(
            "torchao/float8_tensorwise_pow2",
            _tensorwise("float8_e4m3fn", ScaleRule.AMAX_UP, "float8_e8m0fnu", Pow2.LOG2),
            "tensorwise with round_scales_to_power_of_2: r = exp2(floor(log2 r)) in float32",
            TORCHAO, _TORCHAO_FLOAT8 + ", _round_scale_down_to_power_of_2",
            "float8_e4m3fn:tensor:float8_e8m0fnu:amax-up"),
        ImplementationPreset(
            "torchao/float8_rowwise",
            _tensorwise("float8_e4m3fn", ScaleRule.AMAX_UP, "float8_e8m0fnu", Pow2.LOG2,
                        Granularity.CHANNEL),
            "float8 training, rowwise recipe: one power-of-two r per row along the axis, "
            "exp2(floor(log2 r)) in float32", TORCHAO,
            _TORCHAO_FLOAT8 + "; config.py Float8LinearConfig.from_recipe_name",
            "float8_e4m3fn:channel:float8_e8m0fnu:amax-up"),
    ]
    for recipe, drift in _DRIFT_MX.items():
        elem = _MX_ELEMENTS[recipe]
        out += [
            ImplementationPreset(
                f"torchao/{recipe}", _mx(recipe, ScaleRule.FLOOR, _TORCHAO_MX_FLOORED),
                f"MX {elem}, FLOOR (torchao's default): the OCP exponent, divided by "
                "max(2**k, 2**-126)", TORCHAO, _TORCHAO_MX, drift),
            ImplementationPreset(
                f"torchao/{recipe}_rceil", _mx(recipe, ScaleRule.CEIL, _TORCHAO_MX_RCEIL),
                f"MX {elem}, RCEIL eager: ceil(log2(fl(amax / M))) in float32, x·2**-k",
                TORCHAO, _TORCHAO_RCEIL, f"{drift}_ceil"),
            ImplementationPreset(
                f"torchao/{recipe}_ceil", _mx(recipe, ScaleRule.CEIL_AMAX, _TORCHAO_MX_FLOORED),
                f"MX {elem}, CEIL: 2**(ceil(log2 amax) - emax), divided by max(2**k, 2**-126)",
                TORCHAO, _TORCHAO_MX, f"{_MX_ELEMENTS[recipe]}:block32:ceil-amax"),
            ImplementationPreset(
                f"torchao/{recipe}_even", _mx(recipe, ScaleRule.EVEN, _TORCHAO_MX_FLOORED),
                f"MX {elem}, EVEN: amax rounded to the element's mantissa, then FLOOR",
                TORCHAO, _TORCHAO_MX, f"{drift}_even"),
        ]
    fp4 = FORMATS["float4_e2m1fn"]
    out += [
        ImplementationPreset(
            "torchao/nvfp4",
            Cast(fp4, Scaling(Granularity.BLOCK, 16, _E4M3, ScaleRule.TWO_LEVEL,
                              arithmetic=ScaleArithmetic(amax=AmaxPolicy.IEEE,
                                                         two=TwoLevelOrder.TORCHAO))),
            "NVFP4 with the per-tensor scale: S = fl(amax / 2688), block scales clamped to "
            "[2**-6, 448], x·fl(fl(1 / S) / sb)", TORCHAO, _TORCHAO_NVFP4, "nvfp4"),
        ImplementationPreset(
            "torchao/nvfp4_1level",
            Cast(fp4, Scaling(Granularity.BLOCK, 16, _E4M3, ScaleRule.AMAX_RNE,
                              arithmetic=ScaleArithmetic(amax=AmaxPolicy.IEEE, smin=2.0**-6,
                                                         guard=Guard.NONE,
                                                         apply=ElementOp.MUL))),
            "NVFP4 without the per-tensor scale: sb = rne(clamp(fl(amax / 6), 2**-6, 448)), "
            "x·fl(1 / sb), q·sb", TORCHAO, _TORCHAO_NVFP4,
            "float4_e2m1fn:block16:float8_e4m3fn:amax-rne"),
    ]
    return out


IMPLEMENTATIONS: tuple[Implementation, ...] = (TORCHAO,)
"""Every implementation drift has presets for, in the order ``drift formats`` lists them."""

IMPLEMENTATION_PRESETS: dict[str, ImplementationPreset] = {
    p.name: p for p in _torchao_presets()}
"""Every implementation preset by name."""
