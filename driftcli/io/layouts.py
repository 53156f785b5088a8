"""The pre-quantized layouts drift reads as one weight (codes and scales), named apart from
their readers (``driftcli.io.readers.quantized``): ``--layout``'s help lists them without
importing torch."""

from __future__ import annotations

from enum import StrEnum


class Layout(StrEnum):
    """The quantized layouts drift reads (``--layout``)."""

    DEEPSEEK_FP8 = "deepseek-fp8"
    """FP8 E4M3 ``weight`` and a ``weight_scale_inv`` multiplier per 128 x 128 block
    (float32, or E8M0 bytes for the ue8m0 checkpoints)."""
    MXFP8 = "mxfp8"
    """FP8 ``weight`` and E8M0 byte scales (U8 or F8_E8M0), one per 32 elements of a row."""
    CT_FP8 = "ct-fp8"
    """compressed-tensors / ModelOpt FP8: ``weight`` and a float ``weight_scale`` per tensor
    or per output channel."""
    CT_NVFP4 = "ct-nvfp4"
    """compressed-tensors NVFP4: ``weight_packed``, E4M3 ``weight_scale`` per 16, and a
    ``weight_global_scale`` the block scale is divided by."""
    MODELOPT_NVFP4 = "modelopt-nvfp4"
    """ModelOpt NVFP4: packed ``weight``, E4M3 ``weight_scale`` per 16, and a
    ``weight_scale_2`` the block scale is multiplied by."""
    GPT_OSS_MXFP4 = "gpt-oss-mxfp4"
    """gpt-oss MXFP4: ``*_blocks`` (16 bytes of nibbles per 32 elements) and ``*_scales``
    (E8M0 bytes)."""
    CT_MXFP4 = "ct-mxfp4"
    """compressed-tensors / llmcompressor ``mxfp4-pack-quantized``: ``weight_packed`` (two
    E2M1 codes a byte, low nibble first) and E8M0 byte ``weight_scale`` per 32."""
    MXFP4 = "mxfp4"
    """ModelOpt and amd-quark MXFP4: packed ``weight`` (low nibble first) and E8M0 byte
    ``weight_scale`` per 32, no global scale."""
    MXFP6_E2M3 = "mxfp6-e2m3"
    """amd-quark MXFP6 E2M3: ``weight`` of four 6-bit codes in three bytes (little endian,
    element 0 in the low bits) and E8M0 byte ``weight_scale`` per 32."""
    MXFP6_E3M2 = "mxfp6-e3m2"
    """amd-quark MXFP6 E3M2: as ``mxfp6-e2m3``, E3M2 codes."""


class Library(StrEnum):
    """Whose decoder ``--order library`` reproduces: the library that wrote the checkpoint,
    from its config (or the layout's own library where the config names none)."""

    COMPRESSED_TENSORS = "compressed-tensors"
    MODELOPT = "modelopt"
    QUARK = "quark"
    DEEPSEEK = "deepseek"
    TRANSFORMERS = "transformers"
