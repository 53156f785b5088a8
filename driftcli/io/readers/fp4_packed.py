"""FP4 (E2M1) weights packed two codes a byte, the low nibble first: compressed-tensors
NVFP4 (``weight_packed``, E4M3 ``weight_scale`` per 16, ``weight_global_scale`` a divisor),
ModelOpt NVFP4 (packed ``weight``, E4M3 ``weight_scale`` per 16, ``weight_scale_2`` a
multiplier) and gpt-oss MXFP4 (``*_blocks`` of 16 bytes per 32 elements, ``*_scales`` E8M0
bytes, 3-D expert tensors).

``docs/inputs.md`` cites the reference code of each convention.
"""

from __future__ import annotations

from driftcli.io.readers.core import TensorRef
from driftcli.io.readers.mx_packed import E8M0
from driftcli.io.readers.quantized_weight import Config, Family, Layout, QuantSpec

NV_BLOCK = 16
"""Elements of a row one NVFP4 scale covers."""
MX_BLOCK = 32
"""Elements one gpt-oss MXFP4 scale covers (16 bytes of its ``_blocks``)."""
_GLOBAL = {Layout.CT_NVFP4: "_global_scale", Layout.MODELOPT_NVFP4: "_scale_2"}
_FLOATS = {"float32", "bfloat16", "float16"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _oss_stem(name: str) -> tuple[str, str] | None:
    """``(weight, separator)`` of a gpt-oss ``*_blocks`` / ``*.blocks`` / ``*_scales`` name."""
    for sep in ("_", "."):
        for kind in ("blocks", "scales"):
            if name.endswith(sep + kind):
                return name[:-len(sep + kind)], sep
    return None


def _partner(name: str) -> str:
    """A gpt-oss ``_blocks`` tensor's ``_scales`` name, and the other way round."""
    if name.endswith("blocks"):
        return name[:-len("blocks")] + "scales"
    return name[:-len("scales")] + "blocks"


def claims(by_name: dict[str, TensorRef], unreadable: set[str]) -> dict[str, set[Layout]]:
    """Weights with ``weight_packed`` / ``weight_global_scale`` (compressed-tensors NVFP4),
    ``weight_scale_2`` (ModelOpt NVFP4) or ``_blocks`` / ``_scales`` (gpt-oss MXFP4)."""
    out: dict[str, set[Layout]] = {}
    for name in [*by_name, *unreadable]:
        ref = by_name.get(name)
        if name.endswith((".weight_packed", ".weight_global_scale")):
            stem = name[:-len("_packed")] if name.endswith("_packed") else \
                name[:-len("_global_scale")]
            scale = by_name.get(f"{stem}_scale")
            glob = f"{stem}_global_scale"
            if scale is not None and scale.dtype in E8M0 and glob not in by_name and \
                    glob not in unreadable:
                continue  # E8M0 bytes and no global scale: MXFP4 (the MX family's)
            out.setdefault(stem, set()).add(Layout.CT_NVFP4)
        elif name.endswith(".weight_scale_2"):
            out.setdefault(name[:-len("_scale_2")], set()).add(Layout.MODELOPT_NVFP4)
        elif (got := _oss_stem(name)) is not None and (
                ref is None or ref.dtype == "uint8" or _partner(name) in by_name
                or _partner(name) in unreadable):
            out.setdefault(got[0], set()).add(Layout.GPT_OSS_MXFP4)
    return out


def _oss_names(stem: str, by_name: dict[str, TensorRef]) -> tuple[str, str]:
    sep = "." if f"{stem}.blocks" in by_name or f"{stem}.scales" in by_name else "_"
    return f"{stem}{sep}blocks", f"{stem}{sep}scales"


def parts(layout: Layout, stem: str) -> tuple[str, ...]:
    """The stored tensors of one FP4 weight."""
    if layout is Layout.GPT_OSS_MXFP4:
        return tuple(f"{stem}{sep}{k}" for sep in "_." for k in ("blocks", "scales"))
    if layout is Layout.CT_NVFP4:
        return (f"{stem}_packed", f"{stem}_scale", f"{stem}_global_scale")
    return (stem, f"{stem}_scale", f"{stem}_scale_2")


def build(layout: Layout, stem: str, by_name: dict[str, TensorRef],
          config: Config) -> QuantSpec | str:
    """The spec of one packed FP4 weight, or what is wrong with its tensors."""
    del config
    if layout is Layout.GPT_OSS_MXFP4:
        return _build_oss(stem, by_name)
    names = parts(layout, stem)
    missing = [n for n in names if n not in by_name]
    if missing:
        have = [n for n in names if n in by_name]
        return (f"weight {stem} has {', '.join(have) or 'none of its tensors'} but no "
                f"{', '.join(missing)}; re-download the checkpoint")
    codes, scale, glob = (by_name[n] for n in names)
    if codes.dtype != "uint8" or len(codes.shape) < 2:
        return (f"tensor {codes.name} is {codes.dtype} {list(codes.shape)}; packed FP4 codes "
                "are uint8 with 2 dims or more")
    shape = (*codes.shape[:-1], 2 * codes.shape[-1])
    want = (*shape[:-1], _cdiv(shape[-1], NV_BLOCK))
    if scale.dtype != "float8_e4m3fn":
        return f"tensor {scale.name} is {scale.dtype}; NVFP4 block scales are float8_e4m3fn"
    if scale.shape != want:
        return (f"tensor {scale.name} has shape {list(scale.shape)} but weight {stem} "
                f"{list(shape)} in blocks of {NV_BLOCK} needs {list(want)}; the scales do not "
                "cover the weight")
    if glob.numel != 1 or glob.dtype not in _FLOATS:
        return (f"tensor {glob.name} is {glob.dtype} {list(glob.shape)}; a global scale is "
                "one float")
    return QuantSpec(stem, layout, "float4_e2m1fn", shape, codes, True, scale,
                     "float8_e4m3fn", (1, NV_BLOCK), glob,
                     global_divides=layout is Layout.CT_NVFP4)


def _build_oss(stem: str, by_name: dict[str, TensorRef]) -> QuantSpec | str:
    bname, sname = _oss_names(stem, by_name)
    blocks, scales = by_name.get(bname), by_name.get(sname)
    if blocks is None or scales is None:
        have, lack = (bname, sname) if blocks is not None else (sname, bname)
        return (f"tensor {have} has no {lack} beside it; gpt-oss MXFP4 weights need both "
                "(re-download the checkpoint)")
    if blocks.dtype != "uint8" or len(blocks.shape) < 3 or blocks.shape[-1] != MX_BLOCK // 2:
        return (f"tensor {bname} is {blocks.dtype} {list(blocks.shape)}; gpt-oss blocks are "
                f"uint8 [..., groups, {MX_BLOCK // 2}]")
    if scales.shape != blocks.shape[:-1]:
        return (f"tensor {sname} has shape {list(scales.shape)} but {bname} "
                f"{list(blocks.shape)} needs {list(blocks.shape[:-1])}; the scales do not "
                "cover the weight")
    if scales.dtype not in {"uint8", "float8_e8m0fnu"}:
        return f"tensor {sname} is {scales.dtype}; gpt-oss scales are E8M0 bytes"
    shape = (*blocks.shape[:-2], blocks.shape[-2] * MX_BLOCK)
    if len(shape) < 2:
        return f"tensor {bname} has shape {list(blocks.shape)}; a weight has 2 dims or more"
    return QuantSpec(stem, Layout.GPT_OSS_MXFP4, "float4_e2m1fn", shape, blocks, True, scales,
                     "e8m0", (1, MX_BLOCK), pow2_declared=True)


FAMILY = Family((Layout.CT_NVFP4, Layout.MODELOPT_NVFP4, Layout.GPT_OSS_MXFP4), claims,
                build, parts)
"""Packed FP4 elements."""
