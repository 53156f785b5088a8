"""``quantize``: a cast applied to a torch tensor, and the per-element facts of it.

A :class:`~driftcli.records.cast.Cast` says how (element format, scaling, rounding, overflow);
:func:`driftcli.casts.route.cast_route` decides the route that casts a given tensor (which
steps, on which back-end of :mod:`driftcli.kernels`: the same bits on each), and ``quantize``
follows it: the tensor cut into its scale groups (:func:`~driftcli.casts.scaling.to_blocks`),
each group's scale chosen by its rule, every element rounded onto the format's grid times that
scale (:mod:`driftcli.casts.rounding`). The steps live in :mod:`driftcli.casts.route`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from driftcli.casts.hadamard import transform
from driftcli.casts.route import (
    cast_blocks,
    cast_route,
    cast_values,
    checked_bits,
    element_masks,
    fused_block_cast_applies,
    working,
    working_dtype,
)
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import DEFAULT_SR_BITS

__all__ = [
    "QuantInfo", "cast_blocks", "fused_block_cast_applies", "quantize", "working",
    "working_dtype",
]
"""``quantize`` and its record, and the steps of :mod:`driftcli.casts.route` that older
callers (the operands' statistics, the fast-cast tests) take from here."""

Tensor = torch.Tensor


@dataclass(frozen=True)
class QuantInfo:
    """What a cast did, element by element and block by block."""

    values: Tensor
    """The dequantized values, shaped and typed like the input."""
    clipped: Tensor
    """|x / s| above the element format's max (before saturation)."""
    underflowed: Tensor
    """x nonzero and finite, the result zero."""
    subnormal: Tensor
    """The result nonzero and, divided by its scale, below the element's smallest normal."""
    nonfinite: Tensor
    """The input element is NaN or ±inf."""
    scales: Tensor
    """The scale each block was divided by (float64; NaN for a nonfinite block)."""
    scale_clamped: Tensor
    """Per block: the rule's scale fell outside the scale format and was clamped."""
    nonfinite_blocks: Tensor
    """Per block: it held NaN or inf (block scalings make all its elements NaN)."""
    tensor_scale: float | None = None
    """The float32 tensor scale of a two-level cast."""
    codes: Tensor | None = None
    """Each element's code, decoded: its value on the element format's grid before the scale
    is applied back (``values`` = codes · scale, as the cast's arithmetic computes it); NaN
    where the value is NaN for want of a scale."""


def quantize(x: Tensor, cast_or_spec: Cast | str, *, axis: int = -1, seed: int | None = None,
             random_bits: Tensor | None = None, sr_bits: int = DEFAULT_SR_BITS,
             return_info: bool = False) -> Tensor | QuantInfo:
    """Cast ``x`` as the spec says and return the dequantized values (same shape and dtype).

    ``axis`` is the axis blocks run along (the contraction axis of a matmul).
    Stochastic rounding reads ``random_bits`` (shaped like ``x``) or draws
    them from ``seed``. With ``return_info`` a :class:`QuantInfo` comes back. A cast with
    ``rht=`` casts the transform of ``x`` (:func:`driftcli.casts.hadamard.transform`), and the
    values
    are the transform's, not ``x``'s: no inverse is applied.
    """
    c = parse_cast(cast_or_spec)
    random_bits = checked_bits("quantize", x, c, seed, random_bits, sr_bits)
    if c.rht is not None:  # the cast reads the transform (float32 on bfloat16's grid)
        out = _quantize(transform(x, c.rht, axis), c, axis, random_bits, sr_bits, return_info)
        if isinstance(out, Tensor):
            return out.to(x.dtype)
        return replace(out, values=out.values.to(x.dtype))
    return _quantize(x, c, axis, random_bits, sr_bits, return_info)


def _quantize(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None,
              sr_bits: int, want_info: bool) -> Tensor | QuantInfo:
    """The cast; the masks only when asked (they cost more passes than the cast itself)."""
    route = cast_route(c, x, axis, random_bits)
    if not want_info:
        fused = cast_values(x, c, axis, random_bits, sr_bits, route)
        if fused is not None:
            return fused
    b = cast_blocks(x, c, axis, random_bits, sr_bits, None, route)
    if not want_info:
        return b.back(b.q).to(x.dtype)
    m = element_masks(b, c, sr_bits)
    return QuantInfo(
        values=b.back(b.q).to(x.dtype), clipped=b.back(m.clipped),
        underflowed=b.back(m.underflowed), subnormal=b.back(m.subnormal),
        nonfinite=b.back(~m.finite), scales=b.scales, scale_clamped=b.clamped,
        nonfinite_blocks=b.bad_blocks, tensor_scale=b.tensor_scale, codes=b.back(m.codes))
