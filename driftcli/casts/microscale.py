"""Multi-level block scales (HiFloat4, MX6, MX9): a block's first-level scale refined by
one-bit micro-exponents per run of elements (:class:`driftcli.records.cast.MicroScaling`), and the
cast of a block's elements under them.

The scale choice is a hot loop with two back-ends behind :func:`driftcli.kernels.numba_runs`:
:func:`torch_scales` (vectorised torch, the readable reference) and
:func:`driftcli.kernels.microcode.micro_scales` (numba); its exact twin is
:func:`driftcli.oracle.quantization.cast_micro_block`. Every step is exact in float64 (a float32
amax
times an 8-bit multiplier has 32 significant bits), so each back-end gives the oracle's bits.
The elements are then rounded by :func:`driftcli.casts.rounding.round_fused`, which picks its own
back-end.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cache

import numpy as np
import torch

from driftcli import kernels
from driftcli.casts.rounding import jit_params, round_fused, source_of, target_of
from driftcli.kernels import jit
from driftcli.oracle.rounding import binade, round_exact
from driftcli.records.cast import Cast, MicroBase, MicroScaling
from driftcli.records.formats import FORMATS, Exact, Format
from driftcli.records.modes import DEFAULT_SR_BITS

Tensor = torch.Tensor


@dataclass(frozen=True)
class MicroScales:
    """Per block: the first-level scale ``s`` and multiplier ``r`` (float64), whether it held
    NaN or inf, whether ``s`` was clamped; per element its total micro-exponent."""

    s: Tensor
    r: Tensor
    bad: Tensor
    clamped: Tensor
    exps: Tensor


@cache
def _consts(elem: Format, micro: MicroScaling) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernels' parameters: ``levels``, ``ints`` and ``consts`` of
    :func:`driftcli.kernels.microcode.micro_scales`."""
    fmt = micro.scale_format
    bf16 = FORMATS["bfloat16"]
    c = round_exact(bf16, Exact.of(Fraction(1) / (elem.max * 2**micro.steps))).mag
    levels = np.array([[lv.size, lv.top] for lv in micro.levels], dtype=np.int64).reshape(-1, 2)
    ints = np.array([micro.base is MicroBase.POW2, elem.emax, micro.steps,
                     binade(fmt.smallest_positive), fmt.emax, fmt.mbits + 1], dtype=np.int64)
    consts = np.array([float(c), float(fmt.smallest_positive), float(fmt.max)],
                      dtype=np.float64)
    return levels, ints, consts


def _round_significand(v: Tensor, bits: int) -> Tensor:
    """``v >= 0`` (float64) rounded to nearest even on ``bits`` significant bits, exactly."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.round(torch.ldexp(m, torch.tensor(bits))), (e - bits).double())


def _binade(v: Tensor) -> Tensor:
    return torch.frexp(v)[1].long() - 1


def torch_scales(blocks: Tensor, elem: Format, micro: MicroScaling) -> MicroScales:
    """The torch back-end of the scale choice (the numba one is
    :func:`driftcli.kernels.microcode.micro_scales`): the same steps, vectorised."""
    levels, ints, consts = _consts(elem, micro)
    pow2, emax, steps, low, high, sig = (int(i) for i in ints)
    c, smallest, largest = (float(f) for f in consts)
    finite = torch.isfinite(blocks)
    mags = torch.where(finite, blocks.abs(), 0.0).double()
    bad = ~finite.all(dim=1)
    amax = mags.amax(dim=1) if mags.shape[1] else torch.zeros(mags.shape[0], dtype=torch.float64)
    positive = amax > 0
    if pow2:
        free = torch.where(positive, _binade(amax) - emax - steps, low)
        k = free.clamp(low, high)
        s = torch.ldexp(torch.ones_like(amax), k.double())
        r = torch.ldexp(torch.ones_like(amax), -k.double())
        clamped = k != free
    else:
        raw = _round_significand(amax * c, 8)
        rounded = _round_significand(raw, sig)
        s = rounded.clamp(smallest, largest)
        clamped = positive & ((rounded > largest) | (raw < smallest))
        r = _round_significand(1.0 / s, 8)
    rows, cols = blocks.shape
    exps = torch.zeros(rows, cols, dtype=torch.int64, device=blocks.device)
    inner = steps
    for size, top in levels.tolist():
        inner -= top
        v = mags.view(rows, -1, size).amax(dim=2) * r[:, None]
        v = torch.ldexp(v, -exps[:, ::size].double())
        e = torch.where(v > 0, (_binade(v) - emax - inner).clamp(0, top), 0)
        exps += e.repeat_interleave(size, dim=1)
    return MicroScales(s, r, bad, clamped & ~bad, exps)


def micro_scales(blocks: Tensor, elem: Format, micro: MicroScaling) -> MicroScales:
    """Each block's scales, on the back-end :func:`driftcli.kernels.numba_runs` chooses."""
    if kernels.numba_runs(blocks) and blocks.dtype == torch.float32 and blocks.numel():
        s, r, bad, clamped, exps = jit.micro_block_scales(blocks.contiguous(),
                                                          *_consts(elem, micro))
        return MicroScales(s, r, bad, clamped, exps)
    return torch_scales(blocks, elem, micro)


def numba_values(blocks: Tensor, bits: Tensor | None, c: Cast,
                 sr_bits: int = DEFAULT_SR_BITS) -> Tensor | None:
    """The values of :func:`micro_values` in one numba pass (scales and elements), or None
    where the numba back-end does not run (then :func:`micro_values`)."""
    if c.micro is None or blocks.dtype != torch.float32 or not blocks.numel() \
            or not kernels.numba_runs(blocks, bits):
        return None
    p = jit_params(src=source_of(torch.float64), tgt=target_of(c.format), rounding=c.rounding,
                   overflow=c.overflow, sr_bits=sr_bits)
    return jit.micro_cast(blocks.contiguous(), bits, *_consts(c.format, c.micro), p)


def micro_values(blocks: Tensor, bits: Tensor | None, c: Cast,
                 sr_bits: int = DEFAULT_SR_BITS) -> tuple[Tensor, Tensor, MicroScales]:
    """The cast of float32 rows of one block each under ``c.micro``: the values (float32,
    NaN for a block holding NaN or inf), each element's exact quotient ``x · r / 2**E``
    (float64) and the scales."""
    if c.micro is None:
        raise ValueError(f"{c} has no micro-exponents")
    sc = micro_scales(blocks, c.format, c.micro)
    y = blocks.double() * sc.r[:, None]  # exact: 24 by at most 8 significant bits
    grid = round_fused(y, target_of(c.format), c.rounding, c.overflow, bits, sc.exps, sr_bits)
    q = (grid * sc.s[:, None]).float()
    q = torch.where(sc.bad[:, None], torch.nan, q)
    return q, torch.ldexp(y, -sc.exps.double()), sc

