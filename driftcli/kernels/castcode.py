"""The numba code of a block-scaled cast in two passes (imported on first use: it imports
numba): :func:`driftcli.casts.quantization.quantize`'s numba path for block scalings.

Two kernels give a block-scaled cast's per-block scales in one pass over a tensor's rows:
:func:`pow2_scales` (amax, then the power-of-two rule's exponent, the headroom and the clamp)
and :func:`two_level_scales` (NVFP4's float32 tensor scale and block divisors, every step one
IEEE float32 operation in the order of :func:`driftcli.casts.scaling.plan_two_level_scales`). The
elements are then rounded by :mod:`driftcli.kernels.jitcode`' own kernels, unchanged. Each kernel is
compiled once per machine and cached on disk like :mod:`driftcli.kernels.jitcode`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit

# importing jitcode also puts its on-disk cache locator ahead of numba's own
from driftcli.kernels.jitcode import (
    OPTIONS,
    bit_length,
    nearest_fits,
    round_lean,
    round_nearest,
    row_limits,
)

INF_BITS = 0x7F800000
"""float32 +inf: magnitudes at or above it are not finite."""
NONE = 1 << 40
"""Stands for "no row" in the exponent range :func:`pow2_scales` returns."""


@njit(inline="always", **OPTIONS)
def row_amax(xs: Any) -> tuple[int, bool]:
    """The bits of a row's largest finite magnitude (non-negative floats order as their bits
    do) and whether the row holds NaN or inf, from its int32 view."""
    top, worst = 0, 0
    for i in range(xs.size):  # without branches, so that it vectorizes
        u = xs[i] & 0x7FFFFFFF
        worst = max(worst, u)
        top = max(top, u if u < INF_BITS else 0)
    return top, worst >= INF_BITS


@njit(**OPTIONS)
def pow2_scales(x: Any, cols: int, ks: Any, bad: Any, rule: Any,
                tops: Any) -> tuple[int, int, int]:
    """Per row of ``cols`` elements of a float32 tensor's int32 view: the scale exponent ``k``
    of a power-of-two rule (``ks``), whether the row holds NaN or inf (``bad``) and the bits
    of its largest finite magnitude (``tops``).

    ``rule`` is ``(emax, threshold, strict, headroom, low, high)``: ``k = floor(log2 amax) -
    emax + step + headroom`` clamped to ``[low, high]``, where ``step`` is 1 when amax's
    significand, as its 23 fraction bits, is above ``threshold`` (``strict``) or at least it;
    an all-zero row gets ``low``. Returns the smallest ``k`` of a row with a nonzero amax and
    the largest ``k`` of any row (:data:`NONE` and ``-NONE`` when there is none): the range
    :func:`driftcli.casts.route.needs_wide` reads; and how many rows without NaN or inf had
    their ``k`` clamped (as :func:`driftcli.casts.scaling.plan_pow2_exponents` flags them).
    """
    kmin, kmax, clamped = NONE, -NONE, 0
    for row in range(ks.size):
        top, nonfinite = row_amax(x[row * cols:(row + 1) * cols])
        bad[row] = nonfinite
        tops[row] = top
        k, moved = pow2_exponent(top, rule)
        clamped += int(moved and not nonfinite)
        if top != 0:
            kmin = min(kmin, k)
        kmax = max(kmax, k)
        ks[row] = k
    return kmin, kmax, clamped


@njit(inline="always", **OPTIONS)
def pow2_exponent(top: int, rule: Any) -> tuple[int, bool]:
    """The scale exponent ``k`` of a power-of-two ``rule`` (as :func:`pow2_scales` reads it)
    for a row whose largest finite magnitude has the float32 bits ``top``, and whether ``k``
    was clamped into the rule's range (never for an all-zero row, which gets the low end)."""
    emax, threshold, strict, headroom, low, high = (rule[0], rule[1], rule[2], rule[3],
                                                    rule[4], rule[5])
    if top == 0:
        return low, False
    field = top >> 23
    if field == 0:  # a subnormal amax: normalise its fraction
        length = bit_length(top)
        e = length - 150
        fraction = (top << (24 - length)) & 0x7FFFFF
    else:
        e = field - 127
        fraction = top & 0x7FFFFF
    up = fraction > threshold if strict else fraction >= threshold
    free = e - emax + (1 if up else 0) + headroom
    k = min(max(free, low), high)
    return k, k != free


@njit(**OPTIONS)
def two_level_scales(x: Any, cols: int, divisor: Any, bad: Any, consts: Any, q: Any,
                     tops: Any, given_top: int) -> int:
    """Per row of ``cols`` elements of a float32 tensor's int32 view: the two-level divisor
    (``divisor``, float32), whether the row holds NaN or inf (``bad``) and the bits of its
    largest finite magnitude (``tops``). The tensor's amax is the largest of the rows' unless
    ``given_top`` (its float32 bits) is not negative: a slice of a larger tensor. Returns how
    many rows without NaN or inf had their block scale clamped (as
    :func:`driftcli.casts.scaling.plan_two_level_scales` flags them).

    ``consts`` holds, as float32, the element format's max ``M``, ``two_level_max`` (the scale
    format's max times ``M``), the scale format's ``smallest`` and ``largest`` values and
    float32's smallest normal ``tiny``. The steps of
    :func:`driftcli.casts.scaling.plan_two_level_scales`, each one IEEE float32 operation:
    ``S = max(fl(amax_tensor / two_level_max), tiny)`` (1 for an all-zero tensor),
    ``raw = fl(fl(amax / elem_max) / S)``, the block scale ``raw`` rounded to nearest into the
    scale format by :func:`driftcli.kernels.jitcode.round_lean` with the parameters ``q`` (IEEE
    overflow), set to ``largest`` where that overflows and raised to ``smallest`` below it
    (``smallest`` for an all-zero row), and the divisor ``fl(scale · S)``.
    """
    rows = divisor.size
    tensor_top = 0
    for row in range(rows):
        top, nonfinite = row_amax(x[row * cols:(row + 1) * cols])
        tops[row] = top
        bad[row] = nonfinite
        tensor_top = max(tensor_top, top)
    if given_top >= 0:
        tensor_top = given_top
    tensor_scale = two_level_tensor_scale(tensor_top, consts)
    p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
         q[13], q[14], q[15], q[16], q[17])
    moved = np.empty(rows, dtype=np.bool_)
    two_level_divisors(tops, rows, tensor_scale, consts, row_limits(0, p), p, divisor, moved)
    clamped = 0
    for row in range(rows):
        clamped += int(moved[row] and not bad[row])
    return clamped


@njit(inline="always", **OPTIONS)
def two_level_tensor_scale(tensor_top: int, consts: Any) -> Any:
    """A two-level cast's float32 tensor scale from the float32 bits of the tensor's amax
    (``consts`` as :func:`two_level_scales` reads them)."""
    tensor_amax = np.int32(tensor_top).view(np.float32)
    if tensor_amax > 0:
        return max(np.float32(tensor_amax / consts[1]), consts[4])
    return np.float32(1.0)


@njit(inline="always", **OPTIONS)
def two_level_divisor(amax: Any, tensor_scale: Any, consts: Any, lim: Any, p: Any,
                      nearest: bool) -> tuple[Any, bool]:
    """A block's float32 divisor under a two-level cast from its float32 ``amax`` and the
    tensor scale (the steps of :func:`two_level_scales`), and whether its block scale was
    clamped (not for an all-zero block). ``nearest``: the scale rounding is
    :func:`~driftcli.kernels.jitcode.round_nearest` (where
    :func:`~driftcli.kernels.jitcode.nearest_fits`: the same bits as ``round_lean``)."""
    elem_max, smallest, largest = consts[0], consts[2], consts[3]
    # np.float32 of each step: an operation on two float32 values rounded once to float32,
    # however numba types it (a float64 quotient of float32 operands rounds to the same
    # float32: double rounding is harmless at twice the precision + 2)
    raw = np.float32(np.float32(amax / elem_max) / tensor_scale)
    bits = round_nearest(raw.view(np.int32), lim, p) if nearest else round_lean(
        raw.view(np.int32), 0, lim, p)
    scale = np.int32(bits).view(np.float32)
    # without branches, so that a loop over blocks vectorizes: an all-zero block's raw 0
    # rounds to 0 and is raised to ``smallest``, not counted as clamped
    finite = np.isfinite(scale)
    moved = (not finite or raw < smallest) and amax != 0
    scale = max(scale, smallest) if finite else largest
    return np.float32(scale * tensor_scale), moved


@njit(**OPTIONS)
def two_level_divisors(tops: Any, n: int, tensor_scale: Any, consts: Any, lim: Any, p: Any,
                       divisors: Any, moved: Any) -> None:
    """:func:`two_level_divisor` of the first ``n`` blocks whose amaxes' float32 bits are
    ``tops``, into ``divisors`` and ``moved``: a function of its own, whose loop over the
    blocks the compiler vectorizes (inlined into the scan's pass, it did not), the scale
    rounding by :func:`~driftcli.kernels.jitcode.round_nearest` where the scale format's grid
    admits it (NVFP4's E4M3 scale does)."""
    amaxes = tops[:n].view(np.float32)
    if nearest_fits(lim, p):
        for g in range(n):
            divisors[g], moved[g] = two_level_divisor(amaxes[g], tensor_scale, consts, lim, p,
                                                      True)
    else:
        for g in range(n):
            divisors[g], moved[g] = two_level_divisor(amaxes[g], tensor_scale, consts, lim, p,
                                                      False)


@cache
def pow2_round_kernel(rounding: int, overflow: int, has_draws: bool) -> Callable[..., None]:
    """``kernel(x, draws, ks, bad, cols, out, q, start, stop)``: rows ``start..stop`` of
    ``cols`` float32 elements (an int32 view, every element of a row that is not ``bad``
    finite) rounded onto the element grid of ``q`` scaled by ``2**ks[row]``; a ``bad`` row
    becomes NaN. The result is :func:`driftcli.kernels.jitcode.round_lean`'s, bit for bit
    (``rounding`` is its code 0, nearest even, or 5, stochastic; the format has a zero and a
    sign), in steps that vectorize: a finite input needs none of its NaN and infinity
    branches, and where the grid's smallest normal ``2**lo`` is a float32 normal (``lo >=
    -126``) a float32 subnormal's binade does not matter (``max(e, lo)`` is ``lo`` for every
    ``e`` below it), so it is not computed; rows where it is not run
    :func:`~driftcli.kernels.jitcode.round_lean` itself. Overflow, the sign and a negative zero
    follow :func:`~driftcli.kernels.jitcode.finish`."""

    @njit(**OPTIONS)
    def kernel(x: Any, draws: Any, ks: Any, bad: Any, cols: int, out: Any, q: Any,
               start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        t_mbits, has_inf, has_nan, has_neg_zero, sr_bits = p[3], p[8], p[9], p[11], p[15]
        special = 0x7F800000 if has_inf else 0x7FC00000
        saturating = overflow == 0 or not (has_inf or has_nan)
        for row in range(start, stop):
            xs, os = x[row * cols:(row + 1) * cols], out[row * cols:(row + 1) * cols]
            ds = draws[row * cols:(row + 1) * cols] if has_draws else draws
            if bad[row]:
                os[:] = 0x7FC00000
                continue
            lim = row_limits(ks[row], p)
            lo, lim_pos, lim_neg = lim[0], lim[2], lim[3]
            # the grid reaches below float32's normals, or its width varies (tapered): the
            # general steps
            if lo < -126 or p[16] != 0 or p[17] != 0:
                for j in range(xs.size):
                    os[j] = round_lean(xs[j], ds[j] if has_draws else 0, lim, p)
                continue
            over_pos = lim_pos if saturating else special
            over_neg = lim_neg if saturating else special
            # below half the grid's smallest quantum 2**(lo - t_mbits): 0 or that quantum
            tiny_exp = lo - t_mbits
            one = ((tiny_exp + 127) << 23) if tiny_exp >= -126 else 1 << (tiny_exp + 149)
            for j in range(xs.size):
                bits = xs[j]
                neg = bits < 0
                u = bits & 0x7FFFFFFF
                exp_field = u >> 23
                sig = (u & 0x7FFFFF) | (0x800000 if exp_field > 0 else 0)
                q_src = max(exp_field, 1) - 150
                s = max(max(exp_field - 127, lo) - t_mbits - q_src, 0)
                sc = min(s, 62)
                mask = (1 << sc) - 1
                if rounding == 0:  # ties to the even code, as round_lean
                    kept = sig >> sc
                    odd = kept & 1 if t_mbits > 0 or p[10] == 0 else (
                        1 if kept != 0 and ((q_src + s - lo + 1) & 1) == 1 else 0)
                    inc = (mask >> 1) + odd if sc > 0 else 0
                else:
                    d = ds[j] if has_draws else 0
                    inc = d << (sc - sr_bits) if sc >= sr_bits else d >> (sr_bits - sc)
                r = ((u + inc) & ~mask) if sc <= 23 else (one if ((sig + inc) >> sc) else 0)
                limit = lim_neg if neg else lim_pos
                if r > limit:
                    r = over_neg if neg else over_pos
                if neg and (r != 0 or has_neg_zero):
                    r |= -(1 << 31)
                os[j] = r

    return kernel
