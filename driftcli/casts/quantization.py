"""``quantize``: a cast applied to a torch tensor, and the per-element facts of it.

A :class:`~driftcli.records.cast.Cast` says how (element format, scaling, rounding, overflow);
:func:`driftcli.casts.route.cast_route` decides the route that casts a given tensor (which
steps, on which back-end of :mod:`driftcli.kernels`: the same bits on each), and ``quantize``
follows it: the tensor cut into its scale groups (:func:`~driftcli.casts.scaling.to_blocks`),
each group's scale chosen by its rule, every element rounded onto the format's grid times that
scale (:mod:`driftcli.casts.rounding`). The steps live in :mod:`driftcli.casts.route`; the
names :mod:`driftcli.measures.stats` still takes from here are theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from driftcli.casts import rounding
from driftcli.casts.hadamard import transform
from driftcli.casts.route import (
    amax_and_nonfinite,
    cast_blocks,
    cast_route,
    cast_values,
    element_masks,
    fused_block_cast_applies,
    needs_wide,
    plan_scales,
    pow2_rule,
    tensor_amax_of,
    two_level_consts,
    working,
    working_dtype,
)
from driftcli.errors import DriftError
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import DEFAULT_SR_BITS, Rounding

__all__ = [
    "QuantInfo", "amax_and_nonfinite", "cast_blocks", "checked_bits", "element_masks",
    "fused_block_cast_applies", "needs_wide", "plan_scales", "pow2_rule", "quantize",
    "tensor_amax_of", "two_level_consts", "working", "working_dtype",
]
"""``quantize`` and its record, and the steps of :mod:`driftcli.casts.route` that
:mod:`driftcli.measures.stats` takes from here (issue 41 moves it onto the route's steps)."""

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


def checked_bits(what: str, x: Tensor, c: Cast, seed: int | None, random_bits: Tensor | None,
                  sr_bits: int) -> Tensor | None:
    """Check ``x`` is a float tensor; the random bits a stochastic cast reads (drawn from
    ``seed`` when not given), checked against ``x``'s shape."""
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise DriftError(f"{what} needs a floating-point tensor, not {x.dtype}")
    if c.rounding is Rounding.SR and random_bits is None:
        if seed is None:
            raise DriftError("stochastic rounding needs seed= or random_bits=")
        random_bits = rounding.draw_random_bits(x.shape, seed, sr_bits, x.device)
    if random_bits is not None:
        rounding.check_random_bits(random_bits, x.shape, sr_bits)
    return random_bits


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
