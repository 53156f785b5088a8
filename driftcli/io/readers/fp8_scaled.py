"""FP8 weights stored with a scale tensor: DeepSeek's block-scaled ``weight_scale_inv``
(float32 or E8M0 bytes, 128 x 128 blocks), MXFP8 (E8M0 bytes per 32 elements of a row) and
compressed-tensors / ModelOpt FP8 (a float ``weight_scale`` per tensor or output channel).

The element is the stored FP8 code; its value is the code's value times its block's scale
(DeepSeek's ``weight_scale_inv`` is a multiplier despite its name). ``docs/inputs.md`` cites
the reference code of each convention.
"""

from __future__ import annotations

from driftcli.io.readers.core import TensorRef
from driftcli.io.readers.quantized_weight import Config, Family, Layout, QuantSpec

_FP8 = {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
_E8M0 = {"uint8", "float8_e8m0fnu"}
_FLOAT_SCALES = {"float32", "bfloat16", "float16"}
_SUFFIXES = {Layout.DEEPSEEK_FP8: "_scale_inv", Layout.MXFP8: "_scale", Layout.CT_FP8: "_scale"}
MX_BLOCK = 32
"""Elements of a row one MXFP8 scale covers (OCP MX v1.0)."""
DEEPSEEK_BLOCK = (128, 128)
"""DeepSeek-V3's ``weight_block_size`` where the config gives none."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocked(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape that covers ``shape`` with ``block``-sized tiles (edges partial)."""
    return (*shape[:-2], _cdiv(shape[-2], block[0]), _cdiv(shape[-1], block[1]))


def _grid(scale: tuple[int, ...], weight: tuple[int, ...]) -> tuple[int, ...]:
    """The scale grid a 2-D weight's scale shape stands for: ModelOpt stores one scale per
    row as ``[rows]`` (``FP8_PER_CHANNEL_PER_TOKEN``) and 2-D blocks as ``[R, 1, C, 1]``
    (``fp8_pb_wo``); the readers read them as ``[rows, 1]`` and ``[R, C]``."""
    if len(weight) == 2 and len(scale) == 1 and scale[0] == weight[0] > 1:
        return (scale[0], 1)
    if len(weight) == 2 and len(scale) == 4 and scale[1] == scale[3] == 1:
        return (scale[0], scale[2])
    return scale


def _e8m0_layouts(codes: TensorRef | None, scale: TensorRef, inv: bool) -> set[Layout]:
    """Which block shape E8M0 scale bytes fit: 1 x 32 (MXFP8), 128 x 128 (DeepSeek)."""
    if codes is None or len(codes.shape) < 2:
        return {Layout.DEEPSEEK_FP8 if inv else Layout.MXFP8}
    fits = set()
    if scale.shape == _blocked(codes.shape, (1, MX_BLOCK)):
        fits.add(Layout.MXFP8)
    if scale.shape == _blocked(codes.shape, DEEPSEEK_BLOCK):
        fits.add(Layout.DEEPSEEK_FP8)
    return fits or {Layout.DEEPSEEK_FP8 if inv else Layout.MXFP8}


def claims(by_name: dict[str, TensorRef], unreadable: set[str]) -> dict[str, set[Layout]]:
    """Weights with an FP8 ``weight`` beside a ``weight_scale_inv`` or ``weight_scale``
    (float, or E8M0 bytes), and scales whose weight is missing."""
    out: dict[str, set[Layout]] = {}
    for name in [*by_name, *unreadable]:
        for suffix, inv in ((".weight_scale_inv", True), (".weight_scale", False)):
            if not name.endswith(suffix):
                continue
            stem = name[:-len(suffix)] + ".weight"
            codes = by_name.get(stem)
            if codes is not None and codes.dtype not in _FP8 and (
                    f"{stem}_scale_2" in by_name or f"{stem}_scale_2" in unreadable):
                continue  # a ModelOpt NVFP4 weight's block scale (the FP4 family's)
            scale = by_name.get(name)
            if codes is not None and codes.dtype == "uint8" and not inv and \
                    scale is not None and scale.dtype in _E8M0:
                continue  # packed MXFP4 / MXFP6 codes (the MX family's)
            if codes is None and stem not in unreadable and not inv and (
                    f"{stem}_packed" in by_name or f"{stem}_global_scale" in by_name):
                continue
            scale = by_name.get(name)
            if scale is None:
                lays = {Layout.DEEPSEEK_FP8 if inv else Layout.CT_FP8}
            elif scale.dtype in _E8M0:
                lays = _e8m0_layouts(codes, scale, inv)
            else:
                lays = {Layout.DEEPSEEK_FP8 if inv else Layout.CT_FP8}
            out.setdefault(stem, set()).update(lays)
    return out


def parts(layout: Layout, stem: str) -> tuple[str, ...]:
    """The stored tensors of one FP8 weight."""
    if layout is Layout.MXFP8:
        return (stem, stem + "_scale", stem + "_scale_inv")
    return (stem, stem + _SUFFIXES.get(layout, "_scale"))


def build(layout: Layout, stem: str, by_name: dict[str, TensorRef],
          config: Config) -> QuantSpec | str:
    """The spec of one FP8 weight, or what is wrong with its tensors."""
    scale_name = stem + _SUFFIXES[layout]
    if layout is Layout.MXFP8 and stem + "_scale_inv" in by_name:
        scale_name = stem + "_scale_inv"
    codes, scale = by_name.get(stem), by_name.get(scale_name)
    if scale is None:
        return f"weight {stem} has no scale tensor {scale_name}; re-download the checkpoint"
    if codes is None:
        return (f"tensor {scale_name} is the scale of weight {stem}, which the checkpoint "
                "does not hold; re-download the checkpoint")
    if codes.dtype not in _FP8:
        return (f"tensor {stem} is {codes.dtype}, not an FP8 dtype, so {scale_name} cannot "
                "be its scale")
    if len(codes.shape) < 2:
        return (f"tensor {stem} has shape {list(codes.shape)}; a quantized weight has 2 dims "
                "or more")
    e8m0 = scale.dtype in _E8M0
    if scale.dtype not in _E8M0 | _FLOAT_SCALES:
        return (f"tensor {scale_name} is {scale.dtype}; a scale is float32, bfloat16, float16 "
                "or E8M0 bytes")
    shape = codes.shape
    if config.block_error is not None and config.block is None:
        return config.block_error
    grid = _grid(scale.shape, shape)
    if layout is Layout.MXFP8:
        block = config.block if config.block is not None and config.block[0] == 1 else \
            (1, MX_BLOCK)
    elif layout is Layout.DEEPSEEK_FP8:
        block = config.block or DEEPSEEK_BLOCK
    elif scale.numel == 1:
        block = (shape[-2], shape[-1])
    elif grid == (*shape[:-1], 1):
        block = (1, shape[-1])
    elif grid == _blocked(shape, config.block or DEEPSEEK_BLOCK):
        block = config.block or DEEPSEEK_BLOCK  # compressed-tensors' and ModelOpt's blocks
    else:
        tile = "x".join(map(str, config.block or DEEPSEEK_BLOCK))
        return (f"tensor {scale_name} has shape {list(scale.shape)}, which is neither one scale "
                f"per tensor, one per row, nor one per {tile} block of weight {stem} "
                f"{list(shape)}; re-export it, or give --layout")
    if scale.numel != 1 and grid != _blocked(shape, block):
        return (f"tensor {scale_name} has shape {list(scale.shape)} but weight {stem} "
                f"{list(shape)} in {block[0]} x {block[1]} blocks needs "
                f"{list(_blocked(shape, block))}; the scales do not cover the weight")
    if layout is Layout.MXFP8 and not e8m0:
        return f"tensor {scale_name} is {scale.dtype}; MXFP8 scales are E8M0 bytes"
    return QuantSpec(stem, layout, codes.dtype, shape, codes, False, scale,
                     "e8m0" if e8m0 else scale.dtype, block,
                     pow2_declared=e8m0 or config.pow2_declared)


FAMILY = Family((Layout.DEEPSEEK_FP8, Layout.MXFP8, Layout.CT_FP8), claims, build, parts)
"""FP8 elements with a scale tensor."""
