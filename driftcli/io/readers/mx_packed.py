"""MX weights whose sub-byte codes are packed into bytes, with one E8M0 byte scale per 32
elements of a row and no global scale: compressed-tensors / llmcompressor
``mxfp4-pack-quantized`` (``weight_packed``), ModelOpt and amd-quark MXFP4 (packed
``weight``, the low nibble first) and amd-quark MXFP6 (E2M3 or E3M2, four 6-bit codes in
three bytes).

A packed ``weight`` of uint8 beside E8M0 byte ``weight_scale`` is MXFP4 where the scales
cover two codes a byte, MXFP6 where they cover four codes per three bytes; which of E2M3 and
E3M2 a 6-bit weight holds only its config (or ``--layout``) says. ``docs/inputs.md`` cites
each library's code.
"""

from __future__ import annotations

from driftcli.io.readers.core import TensorRef
from driftcli.io.readers.quantized_weight import Config, Family, Layout, QuantSpec

MX_BLOCK = 32
"""Elements of a row one MX scale covers (OCP MX v1.0), where the config gives none."""
E8M0 = {"uint8", "float8_e8m0fnu"}
"""The dtypes E8M0 scale bytes are stored as."""
_ELEMENT = {Layout.CT_MXFP4: "float4_e2m1fn", Layout.MXFP4: "float4_e2m1fn",
            Layout.MXFP6_E2M3: "float6_e2m3fn", Layout.MXFP6_E3M2: "float6_e3m2fn"}
_SIXES = (Layout.MXFP6_E2M3, Layout.MXFP6_E3M2)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _columns(layout: Layout, stored: int) -> int | None:
    """Elements a row of ``stored`` bytes holds in ``layout``, None where it cannot."""
    if layout in _SIXES:
        return None if stored % 3 else stored // 3 * 4
    return 2 * stored


def claims(by_name: dict[str, TensorRef], unreadable: set[str]) -> dict[str, set[Layout]]:
    """Weights with E8M0 byte ``weight_scale`` beside uint8 ``weight_packed`` and no global
    scale (compressed-tensors MXFP4), or beside a uint8 ``weight`` and no ``weight_scale_2``
    (MXFP4, or MXFP6 where the scales cover four codes per three bytes)."""
    del unreadable
    out: dict[str, set[Layout]] = {}
    for name, scale in by_name.items():
        if not name.endswith(".weight_scale") or scale.dtype not in E8M0:
            continue
        stem = name.removesuffix("_scale")
        if f"{stem}_global_scale" in by_name or f"{stem}_scale_2" in by_name:
            continue
        packed, codes = by_name.get(f"{stem}_packed"), by_name.get(stem)
        if packed is not None and packed.dtype == "uint8":
            out[stem] = {Layout.CT_MXFP4}
        elif codes is not None and codes.dtype == "uint8" and codes.shape:
            fits = {lay for lay in (Layout.MXFP4, *_SIXES)
                    if (cols := _columns(lay, codes.shape[-1])) is not None
                    and scale.shape == (*codes.shape[:-1], _cdiv(cols, MX_BLOCK))}
            out[stem] = fits or {Layout.MXFP4}
    return out


def parts(layout: Layout, stem: str) -> tuple[str, ...]:
    """The stored tensors of one packed MX weight."""
    if layout is Layout.CT_MXFP4:
        return (f"{stem}_packed", f"{stem}_scale")
    return (stem, f"{stem}_scale")


def build(layout: Layout, stem: str, by_name: dict[str, TensorRef],
          config: Config) -> QuantSpec | str:
    """The spec of one packed MX weight, or what is wrong with its tensors."""
    names = parts(layout, stem)
    codes, scale = by_name.get(names[0]), by_name.get(names[1])
    if codes is None or scale is None:
        have, lack = (names[0], names[1]) if codes is not None else (names[1], names[0])
        return (f"weight {stem} has {have if have in by_name else 'none of its tensors'} "
                f"but no {lack}; re-download the checkpoint")
    if codes.dtype != "uint8" or len(codes.shape) < 2:
        return (f"tensor {codes.name} is {codes.dtype} {list(codes.shape)}; packed {layout} "
                "codes are uint8 with 2 dims or more")
    if scale.dtype not in E8M0:
        return (f"tensor {scale.name} is {scale.dtype}; {layout} scales are E8M0 bytes "
                "(uint8 or float8_e8m0fnu)")
    cols = _columns(layout, codes.shape[-1])
    if cols is None:
        return (f"tensor {codes.name} has {codes.shape[-1]} bytes a row, which is not whole "
                f"groups of three bytes (four 6-bit codes); it is not {layout}")
    block = config.block if config.block is not None and config.block[0] == 1 else \
        (1, MX_BLOCK)
    shape = (*codes.shape[:-1], cols)
    want = (*shape[:-1], _cdiv(cols, block[1]))
    if scale.shape != want:
        return (f"tensor {scale.name} has shape {list(scale.shape)} but weight {stem} "
                f"{list(shape)} ({layout}) in blocks of {block[1]} needs {list(want)}; the "
                "scales do not cover the weight")
    return QuantSpec(stem, layout, _ELEMENT[layout], shape, codes, True, scale, "e8m0", block,
                     pow2_declared=True)


FAMILY = Family((Layout.CT_MXFP4, Layout.MXFP4, *_SIXES), claims, build, parts)
"""Packed MX elements with E8M0 byte scales and no global scale."""
