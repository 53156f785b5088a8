"""The numba code of :mod:`driftcli.arith.blockfma` (imported on first use: it imports numba).

One kernel per combination of interleaving, ``c``, block scales and pairing (16 at most), each
compiled once per machine and cached on disk like :mod:`driftcli.jitkernels`. A group is two
passes over its products: the largest exponent, then the cut terms summed; every rounding is
:func:`driftcli.jitkernels.round_one` on float64 bits, the same integer steps as the torch
kernels, so both implementations give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit

# importing jitkernels also puts its on-disk cache locator ahead of numba's own
from driftcli.jitkernels import round_one, row_limits

_OPTIONS: dict[str, Any] = {"cache": True, "nogil": True, "error_model": "numpy"}

NONE_EXP = -(1 << 20)
C_EMIN = -126
TOP_CEIL = 300
"""Above every finite term's exponent (products of float32 values stay below 2**256)."""


@njit(inline="always", **_OPTIONS)
def pow2(e: int) -> float:
    """``2.0**e`` for a normal float64 exponent, from its bits."""
    return np.int64((e + 1023) << 52).view(np.float64)


@njit(inline="always", **_OPTIONS)
def exponent_of(x: float) -> int:
    """floor(log2 |x|) of a normal float64 ``x != 0``, at least :data:`C_EMIN`; NONE for 0."""
    if x == 0.0:
        return NONE_EXP
    return max(((np.float64(x).view(np.int64) >> 52) & 0x7FF) - 1023, C_EMIN)


@njit(inline="always", **_OPTIONS)
def rounded(x: float, r: float, has_res: bool, lim: Any, p: Any) -> float:
    """``x`` (+ its residual ``r``) rounded by the parameters ``p``, as a float64."""
    bits = round_one(np.float64(x).view(np.int64), np.float64(r).view(np.int64), has_res, 0,
                     lim, p)
    return np.int64(bits).view(np.float64)


@njit(inline="always", **_OPTIONS)
def added(x: float, y: float, lim: Any, p: Any) -> float:
    """``x + y`` rounded once by ``p``: TwoSum's error enters the rounding as a sticky bit."""
    s = x + y
    bb = s - x
    r = (x - (s - bb)) + (y - bb)
    if s == 0.0:  # an exact zero, with IEEE's sign (as the torch kernels' addition)
        return s
    return rounded(s, r, True, lim, p)


@njit(inline="always", **_OPTIONS)
def group(a: Any, ea: Any, b: Any, eb: Any, k0: int, k1: int, il: int, half: int, c: float,
          kept: int, floor: int, lim: Any, p: Any) -> float:
    """One group (positions ``k0..k1``, only those of half ``half`` when ``il``), ``c``
    included: every term cut toward zero below 2**(E - kept), summed exactly, rounded once."""
    top = max(exponent_of(c), floor)
    for k in range(k0, k1):
        if il == 0 or ((k - k0) // il) % 2 == half:
            top = max(top, ea[k] + eb[k])
    # an infinite c (an overflowed group) reads as exponent 1024: a ceiling keeps both powers
    # of two normal, and inf times either stays inf
    top = min(top, TOP_CEIL)
    up = pow2(kept - top)
    s = np.trunc(c * up)
    for k in range(k0, k1):
        if il == 0 or ((k - k0) // il) % 2 == half:
            s += np.trunc(a[k] * b[k] * up)
    if s == 0.0:  # an exact zero is +0, as in the published models
        return 0.0
    return rounded(s * pow2(top - kept), 0.0, False, lim, p)


@cache
def fma_kernel(interleaved: bool, has_c: bool, scaled: bool,
               paired: bool) -> Callable[..., None]:
    """``kernel(a, ea, b, eb, bad_a, bad_b, c, sa, sb, K, M, N, size, kept, floor, il, per,
    groups, p_acc, p_near, p_master, out, start, stop)``: results ``start..stop`` of
    :func:`driftcli.arith.blockfma.fma_dot` (flat arrays; ``p_*`` the rounding parameters onto
    the accumulator, onto it to nearest, and onto the float32 master)."""

    @njit(**_OPTIONS)
    def kernel(a: Any, ea: Any, b: Any, eb: Any, bad_a: Any, bad_b: Any, c: Any, sa: Any,
               sb: Any, K: int, M: int, N: int, size: int, kept: int, floor: int, il: int,
               per: int, groups: int, p_acc: Any, p_near: Any, p_master: Any, out: Any,
               start: int, stop: int) -> None:
        pa = (p_acc[0], p_acc[1], p_acc[2], p_acc[3], p_acc[4], p_acc[5], p_acc[6], p_acc[7],
              p_acc[8], p_acc[9], p_acc[10], p_acc[11], p_acc[12], p_acc[13], p_acc[14],
              p_acc[15])
        pn = (p_near[0], p_near[1], p_near[2], p_near[3], p_near[4], p_near[5], p_near[6],
              p_near[7], p_near[8], p_near[9], p_near[10], p_near[11], p_near[12], p_near[13],
              p_near[14], p_near[15])
        pm = (p_master[0], p_master[1], p_master[2], p_master[3], p_master[4], p_master[5],
              p_master[6], p_master[7], p_master[8], p_master[9], p_master[10], p_master[11],
              p_master[12], p_master[13], p_master[14], p_master[15])
        lim_a, lim_n, lim_m = row_limits(0, pa), row_limits(0, pn), row_limits(0, pm)
        chunks = (groups + per - 1) // per if per else 1
        for i in range(start, stop):
            if paired:
                ra, rb = i, i
            else:
                bi, rest = i // (M * N), i % (M * N)
                ra, rb = bi * M + rest // N, bi * N + rest % N
            ar, er = a[ra * K:(ra + 1) * K], ea[ra * K:(ra + 1) * K]
            br, fr = b[rb * K:(rb + 1) * K], eb[rb * K:(rb + 1) * K]
            c0 = c[i] if has_c else 0.0
            if bad_a[ra] or bad_b[rb] or not np.isfinite(c0):
                total = c0  # IEEE on the exact terms: NaN, or the infinity
                for k in range(K):
                    total += ar[k] * br[k]
                out[i] = total
                continue
            acc = c0
            master = 0.0
            for g in range(groups):
                k0, k1 = g * size, min((g + 1) * size, K)
                if interleaved:
                    part = group(ar, er, br, fr, k0, k1, il, 0, 0.0, kept, floor, lim_a, pa)
                    part = group(ar, er, br, fr, k0, k1, il, 1, part, kept, floor, lim_a, pa)
                    acc = added(part, acc, lim_n, pn)
                else:
                    acc = group(ar, er, br, fr, k0, k1, 0, 0, acc, kept, floor, lim_a, pa)
                if per and ((g + 1) % per == 0 or g == groups - 1):
                    if scaled:
                        j = g // per
                        acc = acc * sa[ra * chunks + j] * sb[rb * chunks + j]
                    master = added(master, acc, lim_m, pm)
                    acc = 0.0
            out[i] = master if per else acc

    return kernel
