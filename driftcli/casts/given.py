"""The scan pass's given-scales step: the casts whose scales the fused pass does not make itself
(:func:`driftcli.casts.route.flat_route` gives them no route) counted in one read of a slice
all the same, with their operands made beforehand by the cast's own scale steps.

Two kinds of cast take it:

- a scale arithmetic (:mod:`driftcli.casts.scalearith`: the torchao, Transformer Engine and
  DeepSeek presets, row-scaled NVFP4, four over six's choice): each scale group's float32
  apply and undo operands from :func:`arith_operands`, the step
  :func:`driftcli.casts.route.cast_blocks` takes too; the pass meets them with the element
  operations of :func:`driftcli.kernels.jit.round_scaled`;
- micro-exponents (:mod:`driftcli.casts.microscale`: HiFloat4, MX6, MX9): each block's
  first-level scale ``s`` and multiplier ``r`` and each innermost run's micro-exponent ``E``
  from :func:`~driftcli.casts.microscale.micro_scales`, given as the run's powers of two
  ``r / 2**E`` (in) and ``2**E · s`` (out); the pass rounds ``x · r / 2**E`` (exact in
  float64) as :func:`driftcli.kernels.jit.micro_cast` does.

Making the operands reads the slice once more (the groups' amax; four over six's candidates,
micro-exponents' runs); the elements are then read once for every such cast of the slice
(:func:`driftcli.kernels.jit.given_counts`). Groups must be runs of the slice as laid out:
blocks and channels along the last axis, or one scale for the tensor, share one call on the
slice; tiles, and blocks along another axis, are first copied into their block layout, one
call per layout. Blocks that would be padded (a length along the axis not a multiple of the
block) are not taken: their padding counts in :func:`~driftcli.casts.route.cast_blocks`' way.

A cast with ``rht=`` reads the transform of the slice (:func:`driftcli.casts.route.rht_groups`):
the transformed copy is made once per transform and goes through the pass (its own call) as the
cast without the transform.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from driftcli import kernels
from driftcli.casts import rounding
from driftcli.casts.fouroversix import four_over_six_scales
from driftcli.casts.microscale import micro_scales
from driftcli.casts.scalearith import ArithScales, arith_scales, group_amax, row_amax
from driftcli.casts.scaling import block_stats, to_blocks
from driftcli.kernels import jit
from driftcli.kernels.jit import Expansion, GivenOperands
from driftcli.records.cast import Cast
from driftcli.records.modes import AmaxPolicy, ElementOp, Granularity

Tensor = torch.Tensor

NAN_Q, NO_CLIP = 1, 2
"""A group's flags (:data:`driftcli.kernels.statcode.NAN_Q`, ``NO_CLIP``): its values are NaN
whole; its clips are not counted."""


class GivenStep(StrEnum):
    """Which scale step makes a given cast's operands."""

    ARITH = "arith"
    """A scale arithmetic's apply and undo operands per group."""
    MICRO = "micro"
    """Micro-exponents' powers of two per innermost run."""


def given_route(c: Cast, shape: tuple[int, ...], axis: int, dtype: torch.dtype
                ) -> GivenStep | None:
    """The given-scales step of ``c`` for a tensor of ``shape`` and ``dtype`` (its blocks along
    ``axis``), or None where the pass does not take it that way: not float32, a transform
    (:func:`driftcli.casts.route.rht_groups`), drift's exact arithmetic without
    micro-exponents (the flat route's), blocks or tiles that would be padded."""
    s = c.scaling
    if dtype != torch.float32 or not shape or c.rht is not None or \
            (s.arithmetic.exact and c.micro is None):
        return None
    dim, k = axis % len(shape), s.block
    moved = (*shape[:dim], *shape[dim + 1:], shape[dim])  # the block axis last, as to_blocks
    if s.granularity is Granularity.BLOCK and moved[-1] % k:
        return None
    if s.granularity is Granularity.TILE and (len(moved) < 2 or moved[-1] % k or
                                              moved[-2] % k):
        return None
    return GivenStep.MICRO if c.micro is not None else GivenStep.ARITH


def _flat_layout(c: Cast, nd: int, axis: int) -> bool:
    """Whether ``c``'s groups are runs of the slice as it is laid out."""
    g = c.scaling.granularity
    return g in (Granularity.NONE, Granularity.TENSOR) or (
        g in (Granularity.BLOCK, Granularity.CHANNEL) and axis % nd == nd - 1)


@dataclass(frozen=True)
class Given:
    """What the given pass counted of one cast: every field of
    :class:`driftcli.measures.stats.CastStats` but ``clipped_by_rounding`` (``fields``; the
    rounded ones left out without the rounding) and its float64 sums exactly (``exact``)."""

    fields: dict[str, Any]
    exact: dict[str, Expansion]


def arith_operands(blocks: Tensor, c: Cast, row_length: int, tensor_amax: float | None,
                   use_jit: bool) -> tuple[ArithScales, Tensor, Tensor | None]:
    """The scale step of a scale arithmetic (:mod:`driftcli.casts.scalearith`, four over six's
    choice included) on nonempty float32 ``blocks`` (one row a scale group; ``row_length``:
    the elements along the block axis, for row-scaled casts): each row's operands, which rows
    hold NaN or inf, and the rows made NaN whole (None where none are: the amax policy lets
    NaN through the operations). :func:`driftcli.casts.route.cast_blocks` and this module's
    pass both take it."""
    s, a = c.scaling, c.scaling.arithmetic
    if use_jit:
        fin_amax, bad = jit.block_amax(blocks)
    else:
        found = block_stats(blocks)
        fin_amax, bad = found.amax, found.nonfinite
    amax = group_amax(blocks, fin_amax, bad, a.amax)
    top = amax.max() if tensor_amax is None else torch.tensor(tensor_amax, dtype=amax.dtype,
                                                              device=amax.device)
    if a.two.row_scaled:  # one amax per row: a slice of whole rows needs no tensor amax
        top = row_amax(amax, row_length, s.block)
    if s.granularity is Granularity.TENSOR:
        amax = top.expand_as(amax).contiguous()
    sc = (four_over_six_scales(blocks, amax, top, c.format, a.two) if a.two.four_over_six
          else arith_scales(amax, top, c.format, s))
    poisoned = bad if s.blocked and a.amax is AmaxPolicy.FINITE else None
    return sc, bad, poisoned


def _operands(blocks: Tensor, c: Cast, row_length: int, tensor_amax: float | None
              ) -> tuple[GivenOperands, int, int]:
    """The operands of ``c``'s groups, the rows of contiguous float32 ``blocks``, and its
    clamped scales and groups holding NaN or inf."""
    s = c.scaling
    elem = c.format
    ends = (float(elem.max), float(elem.min), float(elem.smallest_normal))
    size = blocks.shape[1]
    poison = s.blocked and s.arithmetic.amax is AmaxPolicy.FINITE
    if c.micro is not None:
        sc = micro_scales(blocks, elem, c.micro)
        inner = c.micro.levels[-1].size if c.micro.levels else size
        e = sc.exps[:, ::inner].double()
        flags = sc.bad.to(torch.uint8) * (NAN_Q | (NO_CLIP if poison else 0))
        lims = torch.where(sc.bad, torch.nan, sc.s)
        op = GivenOperands(True, True, False, inner, size,
                           _np(torch.ldexp(sc.r[:, None], -e)),
                           _np(torch.ldexp(sc.s[:, None], e)), _np(lims), _np(flags), ends)
        return op, int(sc.clamped.sum()), int(sc.bad.sum())
    arith, bad, poisoned = arith_operands(blocks, c, row_length, tensor_amax,
                                          kernels.numba_runs(blocks))
    none = torch.zeros_like(bad)
    cut = none if poisoned is None else poisoned
    flags = cut.to(torch.uint8) * (NAN_Q | NO_CLIP)
    op = GivenOperands(False, arith.apply_op is ElementOp.MUL, arith.undo_op is ElementOp.DIV,
                       size, size, _np(arith.apply.double()), _np(arith.undo.double()),
                       _np(arith.scale.double()), _np(flags), ends)
    return op, int((arith.clamped & ~cut).sum()), int((bad if s.blocked else none).sum())


def _group(c: Cast, row_length: int, n: int) -> int:
    """Elements per group of ``c`` on a slice of ``n`` elements laid out as it is
    (:func:`_flat_layout`)."""
    g = c.scaling.granularity
    return c.scaling.block if g is Granularity.BLOCK else row_length \
        if g is Granularity.CHANNEL else n


def _np(t: Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).numpy()


def given_counts(x: Tensor, casts: Sequence[Cast], taken: Sequence[int], *, axis: int = -1,
                 tensor_amax: float | None = None, rounded: bool = False,
                 bits: Sequence[Tensor | None] | None = None,
                 sr_bits: int = rounding.DEFAULT_SR_BITS,
                 cast_amax: dict[int, float] | None = None) -> dict[int, Given]:
    """The given pass over a nonempty float32 slice ``x`` for the casts ``casts[i]``, ``i`` in
    ``taken`` (each of :func:`given_route`; a stochastic one rounded with its draws
    ``bits[i]``, shaped like ``x``): ``tensor_amax`` the whole tensor's where ``x`` is a slice
    of it, ``cast_amax[i]`` in its place for cast ``i`` where given (its policy's amax). One
    call per layout and, rounded, per rounding mode and overflow policy."""
    nd = x.dim()
    row_length = x.shape[axis] if nd else 1
    work = x.contiguous()
    layouts: dict[Any, tuple[Tensor, list[int]]] = {}
    for i in taken:
        c = casts[i]
        key: Any = "flat" if _flat_layout(c, nd, axis) else (c.scaling.granularity,
                                                               c.scaling.block)
        if key not in layouts:
            layouts[key] = (work.reshape(-1) if key == "flat"
                            else to_blocks(work, c.scaling, axis)[0].contiguous(), [])
        layouts[key][1].append(i)
    out: dict[int, Given] = {}
    for key, (laid, members) in layouts.items():
        flat = laid.reshape(-1)
        ops = {i: _operands(laid if key != "flat" else
                            flat.view(-1, _group(casts[i], row_length, flat.numel())),
                            casts[i], row_length, (cast_amax or {}).get(i, tensor_amax))
               for i in members}
        modes: dict[Any, list[int]] = {}
        for i in members:
            modes.setdefault((casts[i].rounding, casts[i].overflow) if rounded else None,
                             []).append(i)
        for group in modes.values():
            how = None
            if rounded:
                how = jit.Rounded(
                    [_params(casts[i], sr_bits) for i in group],
                    [_draws(None if bits is None else bits[i], casts[i], axis, key)
                     for i in group],
                    [(0, 0)] * len(group))
            got = jit.given_counts(flat, [ops[i][0] for i in group], how)
            for n, i in enumerate(group):
                out[i] = _given(x, got, n, ops[i], rounded)
    return out


def _params(c: Cast, sr_bits: int) -> tuple[int, ...]:
    """The element rounding's parameters: from float64 under micro-exponents (``x · r / 2**E``
    is rounded as a float64), else from float32."""
    src = rounding.source_of(torch.float64 if c.micro is not None else torch.float32)
    return rounding.jit_params(src=src, tgt=rounding.target_of(c.format), rounding=c.rounding,
                               overflow=c.overflow, sr_bits=sr_bits)


def _draws(bits: Tensor | None, c: Cast, axis: int, key: Any) -> Tensor | None:
    """A stochastic cast's draws laid out as the slice its layout ``key`` reads."""
    if bits is None:
        return None
    return bits.reshape(-1) if key == "flat" else to_blocks(bits, c.scaling, axis)[0].reshape(-1)


def _given(x: Tensor, got: jit.GivenCounts, n: int, op: tuple[GivenOperands, int, int],
           rounded: bool) -> Given:
    operands, clamped, bad = op
    fields: dict[str, Any] = {
        "numel": x.numel(), "nonfinite": x.numel() - got.finite,
        "groups": operands.flags.size, "clipped": got.clipped[n],
        "clipped_groups": got.clipped_groups[n], "scale_clamped": clamped,
        "nonfinite_groups": bad}
    exact: dict[str, Expansion] = {"clip_excess": got.excess[n], "abs_sum": got.abs_sum}
    if rounded:
        fields |= dict(zip(("nonzero", "underflowed", "subnormal", "lost"), got.rounded[n][:4],
                           strict=True))
        exact |= dict(zip(("xx", "ee", "ex", "e_sum"), got.sums[n], strict=True))
    return Given(fields, exact)
