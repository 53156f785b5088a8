"""Every named cast, in one table: drift's own presets (:data:`PRESETS`) and the
implementations' (:data:`driftcli.records.recipes.IMPLEMENTATION_PRESETS`), looked up by name for
the
spec grammar (:mod:`driftcli.records.castspec`) and listed by ``drift formats --presets``."""

from __future__ import annotations

from driftcli.records.cast import Cast, MicroBase, MicroLevel, MicroScaling, Scaling
from driftcli.records.formats import FORMATS, Format, NanEncoding
from driftcli.records.modes import Granularity, Overflow, Rounding, ScaleRule
from driftcli.records.recipes import IMPLEMENTATION_PRESETS

E8M0 = FORMATS["float8_e8m0fnu"]


def _mx(elem: str, rule: ScaleRule = ScaleRule.FLOOR, headroom: int = 0) -> Cast:
    return Cast(FORMATS[elem], Scaling(Granularity.BLOCK, 32, E8M0, rule, headroom))


_MX = {"mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2",
       "mxfp6_e3m2": "float6_e3m2fn", "mxfp6_e2m3": "float6_e2m3fn",
       "mxfp4_e2m1": "float4_e2m1fn", "mxint8": "int8"}
_NVFP4 = (FORMATS["float4_e2m1fn"], FORMATS["float8_e4m3fn"])

UE6M2 = Format("ue6m2", 6, 2, 48, signed=False, nan=NanEncoding.TOP, has_subnormals=False)
"""HiFloat4's first-level scale: 2**(-48..15) times 1.00, 1.25, 1.50 or 1.75, no zero and no
subnormals, NaN at the top code, so 49,152 is the largest (docs/formats.md#hifloat4). Not in
the registry: only a multi-level cast rounds onto it (clamp, then nearest even on three
significant bits); the element kernels round onto grids with subnormals."""
HIFLOAT4 = MicroScaling("hifloat4", 64, UE6M2, MicroBase.BF16_RCP,
                        (MicroLevel(8), MicroLevel(4)))
"""64 elements under one UE6M2 scale, a x1/x2 micro-exponent per 8 and per 4."""
MX6, MX9 = (MicroScaling(name, 16, E8M0, MicroBase.POW2, (MicroLevel(2),))
            for name in ("mx6", "mx9"))
"""16 elements under one E8M0 shared exponent, a one-bit micro-exponent per pair."""


def _micro(elem: str, micro: MicroScaling, rule: ScaleRule) -> Cast:
    return Cast(FORMATS[elem], Scaling(Granularity.BLOCK, micro.block, micro.scale_format, rule),
                Rounding.RNA, micro=micro)


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
    "mxint8_sym": (_mx("int8_sym"), "mxint8 clamped to ±127, never -128 (microxcaling's range)"),
    "nvfp4": (Cast(_NVFP4[0], Scaling(Granularity.BLOCK, 16, _NVFP4[1], ScaleRule.TWO_LEVEL)),
              "NVFP4: FP4 E2M1 in blocks of 16, E4M3 block scales under a float32 tensor scale"),
    "nvfp4_2d": (Cast(_NVFP4[0], Scaling(Granularity.TILE, 16, _NVFP4[1], ScaleRule.TWO_LEVEL)),
                 "NVFP4 with 16x16 tiles (as for weights)"),
    "hifloat4": (_micro("float4_e1m2", HIFLOAT4, ScaleRule.AMAX_RNE),
                 "HiFloat4: S1E1M2 in blocks of 64, a UE6M2 scale, x1/x2 micro-exponents per 8 "
                 "and per 4, ties away"),
    "mx6": (_micro("float5_e1m3", MX6, ScaleRule.FLOOR),
            "MX6: S1E1M3 in blocks of 16, an E8M0 exponent, a one-bit micro-exponent per pair, "
            "ties away"),
    "mx9": (_micro("float8_e1m6", MX9, ScaleRule.FLOOR),
            "MX9: S1E1M6 in blocks of 16, an E8M0 exponent, a one-bit micro-exponent per pair, "
            "ties away"),
}
"""Every preset: its cast and what it means."""


def preset(name: str) -> Cast | None:
    """The cast a preset name stands for, drift's or an implementation's; None if no preset
    has the name."""
    if name in PRESETS:
        return PRESETS[name][0]
    found = IMPLEMENTATION_PRESETS.get(name)
    return None if found is None else found.cast


def preset_names() -> list[str]:
    """Every preset name: drift's, then the implementations'."""
    return [*PRESETS, *IMPLEMENTATION_PRESETS]
