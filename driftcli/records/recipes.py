"""Implementation presets: casts named ``<implementation>/<recipe>`` that reproduce how torchao,
Transformer Engine and DeepSeek compute their scales, operation for operation, including where
they depart from their own specification. Each names its source and the exact drift cast of
the same recipe beside it. Nothing here imports torch (``drift formats --presets`` lists them).

The op sequences, their sources and every departure are in docs/recipes.md; the settings that
spell them are :class:`driftcli.records.cast.ScaleArithmetic`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from driftcli.records.cast import TE_SIGNS, Cast, Rht, ScaleArithmetic, Scaling
from driftcli.records.formats import FORMATS, Format
from driftcli.records.modes import (
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


TE = Implementation("te", "Transformer Engine (NVIDIA)", "2.20.0.dev0 at d0067d0",
                    "https://github.com/NVIDIA/TransformerEngine")

_TE_CURRENT = ScaleArithmetic(amax=AmaxPolicy.FMAX, scale=ScaleOp.RCP, guard=Guard.ONE,
                              apply=ElementOp.MUL)
"""Transformer Engine's ``compute_scale_from_amax``: ``r = fl(M / amax)`` (1 where amax is 0,
inf or NaN; float32's max where it overflows), ``fl(x · r)``, ``fl(q · fl(1 / r))``, amax by
``fmaxf`` (NaN skipped)."""
_TE_FP8_SOURCE = ("common/recipe/recipe_common.cuh compute_scale_from_amax, "
                  "util/vectorized_pointwise.h unary_kernel, fp8/dequantize_fp8.cuh")
_TE_BLOCK_SOURCE = ("common/transpose/quantize_transpose_vector_blockwise.cu "
                    "block_scaled_1d_cast_transpose_kernel, quantize_transpose_square_blockwise"
                    ".cu block_scaled_cast_transpose_kernel")
_TE_MXFP8_SOURCE = ("common/cast/mxfp8/quantize_mxfp8.cuh quantize_mxfp8_kernel, "
                    "util/ptx_arch_spec.cuh float_to_e8m0, util/ptx.cuh exp2f_rcp")
_TE_NVFP4_SOURCE = ("common/cast/nvfp4/quantize_transpose_nvfp4.cuh "
                    "quantize_transpose_nvfp4_kernel, core_nvfp4.cuh, dequantize_nvfp4.cuh")

_TE_4OVER6_SOURCE = ("pytorch/custom_recipes/reference_nvfp4.py _quantize_blockwise_reference, "
                     "_quantize_blockwise_4over6_reference; common/cast/nvfp4/"
                     "quantize_4over6_nvfp4.cuh, dequantize_nvfp4.cuh (E4M3_MAX 256)")

_TE_ROW_SOURCE = ("pytorch/custom_recipes/reference_nvfp4.py _quantize, "
                  "_quantize_blockwise_reference (row_scaled_nvfp4); common/cast/nvfp4/"
                  "dequantize_nvfp4.cuh (ROW_SCALED_NVFP4)")

_TE_ROW_4OVER6_SOURCE = ("pytorch/custom_recipes/reference_nvfp4.py _quantize (line 881), "
                         "_quantize_blockwise_reference (lines 709-710, 731-745), "
                         "_quantize_blockwise_4over6_reference (lines 594, 614-617); common/cast/"
                         "nvfp4/quantize_4over6_nvfp4.cuh quantize_stage_rowwise (line 481), "
                         "dequantize_nvfp4.cuh (ROW_SCALED_NVFP4, E4M3_MAX 256); "
                         "pytorch/quantization.py lines 1700-1745 (row_scaled_activation with "
                         "nvfp4_4over6)")

_TE_RHT_SOURCE = ("pytorch/custom_recipes/reference_nvfp4.py _apply_rht, "
                  "_build_hadamard_matrix, get_wgrad_sign_vector (the columnwise input); "
                  "common/hadamard_transform/hadamard_transform_cast_fusion.cu")


def _te_presets() -> list[ImplementationPreset]:
    e4m3, e5m2 = FORMATS["float8_e4m3fn"], FORMATS["float8_e5m2"]
    fp4 = FORMATS["float4_e2m1fn"]
    f32 = FORMATS["float32"]

    def scaled(elem: Format, g: Granularity, size: int, fmt: Format, rule: ScaleRule,
               a: ScaleArithmetic) -> Cast:
        return Cast(elem, Scaling(g, size, fmt, rule, arithmetic=a))

    current = ScaleRule.AMAX
    pow2 = ScaleRule.AMAX_UP  # r rounded down to a power of two on its bits
    mx = ScaleArithmetic(amax=AmaxPolicy.FMAX, scale=ScaleOp.MULRCP, pow2=Pow2.RP,
                         apply=ElementOp.MUL)
    nvfp4 = ScaleArithmetic(amax=AmaxPolicy.FMAX, two=TwoLevelOrder.TE)
    tensor, block, tile = Granularity.TENSOR, Granularity.BLOCK, Granularity.TILE
    return [
        ImplementationPreset(
            "te/float8_current", scaled(e4m3, tensor, 0, f32, current, _TE_CURRENT),
            "Float8CurrentScaling, E4M3 (inputs, weights): r = fl(448 / amax), x·r, "
            "q·fl(1 / r)", TE, _TE_FP8_SOURCE, "fp8_e4m3"),
        ImplementationPreset(
            "te/float8_current_e5m2", scaled(e5m2, tensor, 0, f32, current, _TE_CURRENT),
            "Float8CurrentScaling, E5M2 (gradients under the default HYBRID format)", TE,
            _TE_FP8_SOURCE, "fp8_e5m2"),
        ImplementationPreset(
            "te/float8_current_pow2", scaled(e4m3, tensor, 0, _E8M0, pow2, _TE_CURRENT),
            "Float8CurrentScaling with NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1: r's "
            "mantissa cleared", TE, _TE_FP8_SOURCE, "float8_e4m3fn:tensor:float8_e8m0fnu:amax-up"),
        ImplementationPreset(
            "te/float8_block", scaled(e4m3, block, 128, _E8M0, pow2, _TE_CURRENT),
            "Float8BlockScaling, 1 x 128 blocks (inputs, gradients): power-of-two r per block",
            TE, _TE_BLOCK_SOURCE, "float8_e4m3fn:block128:float8_e8m0fnu:amax-up"),
        ImplementationPreset(
            "te/float8_block_weight", scaled(e4m3, tile, 128, _E8M0, pow2, _TE_CURRENT),
            "Float8BlockScaling, 128 x 128 tiles (weights)", TE, _TE_BLOCK_SOURCE,
            "float8_e4m3fn:tile128:float8_e8m0fnu:amax-up"),
        ImplementationPreset(
            "te/mxfp8", scaled(e4m3, block, 32, _E8M0, ScaleRule.CEIL, mx),
            "MXFP8BlockScaling: E8M0 = cvt.rp(fl(amax · fl(1 / 448))), x·2**-k", TE,
            _TE_MXFP8_SOURCE, "mxfp8_e4m3_ceil"),
        ImplementationPreset(
            "te/nvfp4", scaled(fp4, block, 16, _E4M3, ScaleRule.TWO_LEVEL, nvfp4),
            "NVFP4BlockScaling, 1 x 16 blocks: S_enc = fl(2688 / amax), sb = rn(fl(amax_b · "
            "fl(S_enc · fl(1/6))))", TE, _TE_NVFP4_SOURCE, "nvfp4"),
        ImplementationPreset(
            "te/nvfp4_2d", scaled(fp4, tile, 16, _E4M3, ScaleRule.TWO_LEVEL, nvfp4),
            "NVFP4BlockScaling, 16 x 16 tiles (weights)", TE,
            _TE_NVFP4_SOURCE.replace("nvfp4_kernel", "nvfp4_2D_kernel"), "nvfp4_2d"),
        ImplementationPreset(
            "te/nvfp4_row", scaled(fp4, block, 16, _E4M3, ScaleRule.TWO_LEVEL,
                                   ScaleArithmetic(amax=AmaxPolicy.FMAX, two=TwoLevelOrder.TE_ROW)),
            "row-scaled NVFP4 (row_scaled_nvfp4): te/nvfp4 with one float32 amax per row "
            "instead of per tensor", TE, _TE_ROW_SOURCE, "nvfp4"),
        ImplementationPreset(
            "te/nvfp4_rht", replace(scaled(fp4, block, 16, _E4M3, ScaleRule.TWO_LEVEL, nvfp4),
                                    rht=Rht(TE_SIGNS, "te")),
            "NVFP4 wgrad operand (columnwise use): each 16 along the block axis times "
            "diag(signs)·H16/4, fl32 sums rounded to bfloat16, then te/nvfp4 (post-RHT amax)",
            TE, _TE_RHT_SOURCE, "nvfp4:rht=te"),
        *[ImplementationPreset(
            f"te/nvfp4_4over6{suffix}",
            scaled(fp4, block, 16, _E4M3, ScaleRule.TWO_LEVEL,
                   ScaleArithmetic(amax=AmaxPolicy.FMAX, two=order)),
            f"NVFP4 four over six ({what}): each block cast with sb6 and sb4 = rn(1.5·...), "
            "S_enc = fl(1536 / amax), the smaller error kept, ties to sb6", TE,
            _TE_4OVER6_SOURCE, "nvfp4")
          for suffix, order, what in (
              ("", TwoLevelOrder.TE_4OVER6_MAE, "MAE, TE's default"),
              ("_mse", TwoLevelOrder.TE_4OVER6_MSE, "MSE"),
              ("_fast", TwoLevelOrder.TE_4OVER6_MAE_FP16, "MAE, fp16 fast error path"),
              ("_mse_fast", TwoLevelOrder.TE_4OVER6_MSE_FP16, "MSE, fp16 fast error path"))],
        ImplementationPreset(
            "te/nvfp4_2d_4over6",
            scaled(fp4, tile, 16, _E4M3, ScaleRule.TWO_LEVEL,
                   ScaleArithmetic(amax=AmaxPolicy.FMAX, two=TwoLevelOrder.TE_4OVER6_MAE)),
            "NVFP4 four over six on 16 x 16 tiles (weights, MAE): each tile row's error as a "
            "block's, the 16 row errors added by halves, one choice per tile", TE,
            _TE_4OVER6_SOURCE + " (_sum_4over6_2d_error)", "nvfp4_2d"),
        *[ImplementationPreset(
            f"te/nvfp4_row_4over6{suffix}",
            scaled(fp4, block, 16, _E4M3, ScaleRule.TWO_LEVEL,
                   ScaleArithmetic(amax=AmaxPolicy.FMAX, two=order)),
            f"row-scaled NVFP4 with four over six ({what}): te/nvfp4_4over6{suffix} with each "
            "row's float32 amax as the tensor amax (S_enc = fl(1536 / amax_row), the error and "
            "the dequantization read it too)", TE, _TE_ROW_4OVER6_SOURCE, "nvfp4")
          for suffix, order, what in (
              ("", TwoLevelOrder.TE_ROW_4OVER6_MAE, "MAE, TE's default; forward activations "
               "under row_scaled_activation and nvfp4_4over6"),
              ("_mse", TwoLevelOrder.TE_ROW_4OVER6_MSE, "MSE"))],
    ]


DEEPSEEK = Implementation("deepseek", "DeepSeek-V3 and DeepGEMM",
                          "DeepSeek-V3 9b4e978, DeepGEMM 54e2261",
                          "https://github.com/deepseek-ai/DeepSeek-V3")

_DEEPSEEK_ACT = ScaleArithmetic(amax=AmaxPolicy.FMAX, eps=1e-4, guard=Guard.NONE)
"""DeepSeek-V3 ``inference/kernel.py`` ``act_quant_kernel``: ``s = fl(max(amax, 1e-4) / 448)``,
``fl(x / s)``, dequantized ``fl(q · s)``."""
_DEEPSEEK_WEIGHT = ScaleArithmetic(amax=AmaxPolicy.IEEE, eps=1e-4, guard=Guard.NONE,
                                   apply=ElementOp.MUL)
"""DeepGEMM ``deep_gemm/utils/math.py`` ``per_block_cast_to_fp8``: the same ``s``, then
``fl(x · fl(1 / s))``."""


def _deepseek_presets() -> list[ImplementationPreset]:
    e4m3, f32 = FORMATS["float8_e4m3fn"], FORMATS["float32"]
    act, weight = "DeepSeek-V3 inference/kernel.py act_quant", \
        "DeepGEMM deep_gemm/utils/math.py per_block_cast_to_fp8, ceil_to_ue8m0"

    def cast(g: Granularity, fmt: Format, rule: ScaleRule, a: ScaleArithmetic) -> Cast:
        return Cast(e4m3, Scaling(g, 128, fmt, rule, arithmetic=a))

    block, tile = Granularity.BLOCK, Granularity.TILE
    return [
        ImplementationPreset(
            "deepseek/v3", cast(block, f32, ScaleRule.AMAX, _DEEPSEEK_ACT),
            "1 x 128 activation blocks, float32 scales: s = fl(max(amax, 1e-4) / 448), x / s",
            DEEPSEEK, act, "float8_e4m3fn:block128:float32:amax"),
        ImplementationPreset(
            "deepseek/v3_weight", cast(tile, f32, ScaleRule.AMAX, _DEEPSEEK_WEIGHT),
            "128 x 128 weight tiles, float32 scales: x·fl(1 / s)", DEEPSEEK, weight,
            "float8_e4m3fn:tile128:float32:amax"),
        ImplementationPreset(
            "deepseek/v3_ue8m0",
            cast(block, _E8M0, ScaleRule.AMAX_UP, replace(_DEEPSEEK_ACT, pow2=Pow2.LOG2)),
            "1 x 128 blocks, scale_fmt='ue8m0': s = exp2(ceil(log2 s)) in float32", DEEPSEEK,
            act, "float8_e4m3fn:block128:float8_e8m0fnu:amax-up"),
        ImplementationPreset(
            "deepseek/v3_ue8m0_weight", cast(tile, _E8M0, ScaleRule.AMAX_UP, _DEEPSEEK_WEIGHT),
            "128 x 128 tiles, use_ue8m0: s rounded up to a power of two on its bits", DEEPSEEK,
            weight, "float8_e4m3fn:tile128:float8_e8m0fnu:amax-up"),
    ]


IMPLEMENTATIONS: tuple[Implementation, ...] = (TORCHAO, TE, DEEPSEEK)
"""Every implementation drift has presets for, in the order ``drift formats`` lists them."""

IMPLEMENTATION_PRESETS: dict[str, ImplementationPreset] = {
    p.name: p for p in [*_torchao_presets(), *_te_presets(), *_deepseek_presets()]}
"""Every implementation preset by name."""
