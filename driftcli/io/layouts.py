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
