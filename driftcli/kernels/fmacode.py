"""The numba code of :mod:`driftcli.arith.blockfma` (imported on first use: it imports numba).

A kernel is made per group size and interleave (compile-time constants: a loop of known length
unrolls and vectorizes, about three times faster than one of run-time length) and per
combination of ``c``, block scales and pairing; each is compiled once per machine and cached
on disk like :mod:`driftcli.kernels.jitcode`. A group is two passes over its products: the largest
exponent, then the cut terms summed; its one rounding is done on the integer sum where the
result is a normal number below the top binade, else by :func:`driftcli.kernels.jitcode.round_one`
on float64 bits (the torch kernels' integer steps). Both are correctly rounded, so the numba
and torch implementations give the same bits (tests and ``drift verify-formats`` compare them
with the exact reference).

The kernels may reassociate floating-point operations (``fastmath={"reassoc"}``; numba
compiles a function inlined in its IR with its caller's flags, so the whole kernel has them)
because every step that can be reassociated is exact: each cut term is an integer below
``2**(kept_bits + 2)``, and so is every partial sum of a group. So is the product
``a * b * 2**(kept - E)`` in any association: every factor and partial product lies within
float64's normal range (``E`` is at least ``TOP_FLOOR`` and at most ``TOP_CEIL``, the operands
are float32 values); a row with NaN or infinity sums to NaN or the infinity in any order. The
one inexact step, :func:`added` (TwoSum, which reassociation would reduce to nothing), is its
own function compiled without the flag: LLVM keeps flags per instruction, so they do not reach
its code even where it is inlined.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit

# importing jitcode also puts its on-disk cache locator ahead of numba's own
from driftcli.kernels.jitcode import OPTIONS, bit_length, round_one, row_limits

_SUMS: dict[str, Any] = {**OPTIONS, "fastmath": {"reassoc"}}

NONE_EXP = -(1 << 20)
C_EMIN = -126
TOP_CEIL = 300
"""Above every finite term's exponent (products of float32 values stay below 2**256)."""


@njit(inline="always", **OPTIONS)
def pow2(e: int) -> float:
    """``2.0**e`` for a normal float64 exponent, from its bits."""
    return np.int64((e + 1023) << 52).view(np.float64)


@njit(inline="always", **OPTIONS)
def exponent_of(x: float) -> int:
    """floor(log2 |x|) of a normal float64 ``x != 0``, at least :data:`C_EMIN`; NONE for 0."""
    if x == 0.0:
        return NONE_EXP
    return max(int((np.float64(x).view(np.int64) >> 52) & 0x7FF) - 1023, C_EMIN)


@njit(**OPTIONS)
def rounded(x: float, r: float, has_res: bool, lim: Any, p: Any) -> float:
    """``x`` (+ its residual ``r``) rounded by the parameters ``p``, as a float64."""
    bits = round_one(np.float64(x).view(np.int64), np.float64(r).view(np.int64), has_res, 0,
                     lim, p)
    return np.int64(bits).view(np.float64)


@njit(**OPTIONS)
def added(x: float, y: float, lim: Any, p: Any) -> float:
    """``x + y`` rounded once by ``p``: TwoSum's error enters the rounding as a sticky bit."""
    s = x + y
    bb = s - x
    r = (x - (s - bb)) + (y - bb)
    if s == 0.0:  # an exact zero, with IEEE's sign (as the torch kernels' addition)
        return s
    return rounded(s, r, True, lim, p)


@njit(inline="always", **OPTIONS)
def finish(s: float, top: int, kept: int, lim: Any, p: Any) -> float:
    """A group's exact sum ``s * 2**(top - kept)`` (``s`` an integer) rounded once, to nearest
    even or toward zero (an exact zero is +0, as in the published models).

    Where the result is a normal number below the format's top binade, the rounding is done
    here on the integer (drop the bits below the format's precision, round, carry); anywhere
    else, and always onto a tapered format (HiFloat8: its mantissa width varies by binade,
    ``p[16]``, ``p[17]``), by :func:`round_one`. Both give the correctly rounded value, so the
    same bits."""
    if s == 0.0:
        return 0.0
    if not np.isfinite(s):  # an overflowed chain (an infinite c): no integer to round
        return rounded(s, 0.0, False, lim, p)
    mag = np.int64(abs(s))
    length = bit_length(mag)
    mbits, emin, qmax = p[3], p[2], p[4]
    lead = top - kept + length - 1  # the exponent of the sum's leading bit
    drop = length - 1 - mbits
    if lead < emin or lead >= qmax + mbits or p[16] != 0 or p[17] != 0:
        return rounded(s * pow2(top - kept), 0.0, False, lim, p)
    if drop <= 0:
        return s * pow2(top - kept)
    kept_mag = mag >> drop
    if p[13] == 0:  # to nearest, ties to even
        low = mag - (kept_mag << drop)
        half = np.int64(1) << (drop - 1)
        if low > half or (low == half and (kept_mag & 1) == 1):
            kept_mag += 1  # a carry to 2**(mbits + 1) is still exact below the top binade
    value = np.float64(kept_mag) * pow2(top - kept + drop)
    return -value if s < 0 else value


@njit(**_SUMS)
def partial(a: Any, ea: Any, b: Any, eb: Any, k0: int, k1: int, il: int, c: float, kept: int,
            floor: int, la: Any, pa: Any, ln: Any, pn: Any) -> float:
    """A group of run-time length (a short last group), positions ``k0..k1``, onto ``c``;
    interleaved when ``il``: two halves, then ``c`` added to nearest."""
    part = c if not il else 0.0
    for h in range(2 if il else 1):
        top = np.int32(min(max(exponent_of(part), floor), TOP_CEIL))
        for k in range(k0, k1):
            if not il or ((k - k0) // il) % 2 == h:
                top = max(top, np.int32(ea[k] + eb[k]))
        up = pow2(kept - top)
        s = np.trunc(part * up)
        for k in range(k0, k1):
            if not il or ((k - k0) // il) % 2 == h:
                s += np.trunc(np.float64(a[k]) * np.float64(b[k]) * up)
        part = finish(s, top, kept, la, pa)
    return added(part, c, ln, pn) if il else part


@njit(inline="always", **_SUMS)
def dot(ar: Any, er: Any, br: Any, fr: Any, K: int, c0: float, sa: Any, sb: Any, size: int,
        il: int, kept: int, floor: int, per: int, scaled: bool, pa: Any, la: Any, pn: Any,
        ln: Any, pm: Any, lm: Any) -> float:
    """One dot product of rows ``ar``, ``br`` (with their exponents ``er``, ``fr``) from
    ``c0``. Inlined into each kernel, where ``size`` and ``il`` are constants: the loops of a
    whole group then have known lengths."""
    if not np.isfinite(c0):
        total = c0  # IEEE on the exact terms: NaN, or the infinity
        for k in range(K):
            total += np.float64(ar[k]) * np.float64(br[k])
        return total
    acc = c0
    master = 0.0
    groups = max(1, (K + size - 1) // size)
    run = il if il else size
    width = 2 * il if il else size
    for g in range(groups):
        k0 = g * size
        if k0 + size > K:  # a short last group
            acc = partial(ar, er, br, fr, k0, K, il, acc, kept, floor, la, pa, ln, pn)
        elif not il:  # the simplest loop, which unrolls and vectorizes best
            top = np.int32(min(max(exponent_of(acc), floor), TOP_CEIL))
            for k in range(k0, k0 + size):
                top = max(top, np.int32(er[k] + fr[k]))
            up = pow2(kept - top)
            s = np.trunc(acc * up)
            for k in range(k0, k0 + size):
                s += np.trunc(np.float64(ar[k]) * np.float64(br[k]) * up)
            acc = finish(s, top, kept, la, pa)
        else:  # two halves, dealt run by run; c added last, to nearest
            part = 0.0
            for h in range(2):
                # an infinite part (an overflowed half) reads as exponent 1024: the ceiling
                # keeps both powers of two normal
                top = np.int32(min(max(exponent_of(part), floor), TOP_CEIL))
                first = k0 + h * run
                for j in range(0, size, width):
                    for q in range(run):
                        top = max(top, np.int32(er[first + j + q] + fr[first + j + q]))
                up = pow2(kept - top)
                s = np.trunc(part * up)
                for j in range(0, size, width):
                    for q in range(run):
                        k = first + j + q
                        s += np.trunc(np.float64(ar[k]) * np.float64(br[k]) * up)
                part = finish(s, top, kept, la, pa)
            acc = added(part, acc, ln, pn)
        if per and ((g + 1) % per == 0 or g == groups - 1):
            if scaled:
                acc = acc * sa[g // per] * sb[g // per]
            master = added(master, acc, lm, pm)
            acc = 0.0
    return master if per else acc


@njit(inline="always", **OPTIONS)
def unpack(q: Any) -> Any:
    """A parameter vector as the tuple :func:`round_one` reads."""
    return (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
            q[13], q[14], q[15], q[16], q[17])


@njit(inline="always", **OPTIONS)
def rows_of(i: int, M: int, N: int, paired: bool) -> tuple[int, int]:
    """The rows of ``a`` and ``b`` that result ``i`` multiplies."""
    if paired:
        return i, i
    return i // N, (i // (M * N)) * N + i % N


@cache
def fma_kernel(size: int, il: int, has_c: bool, scaled: bool,
               paired: bool) -> Callable[..., None]:
    """``kernel(a, ea, b, eb, bad_a, bad_b, c, sa, sb, K, M, N, size, il, kept, floor, per,
    tile, p_acc, p_near, p_master, out, start, stop)``: the results of
    :func:`driftcli.arith.blockfma.fma_dot` (flat arrays: float32 operands, int32 exponents;
    ``p_*`` the rounding parameters onto the accumulator, onto it to nearest, and onto the
    float32 master). Paired: results ``start..stop``; else rows ``start..stop`` of ``a``
    against every row of their batch's ``b``, ``tile`` rows of ``b`` at a time (they stay in
    cache while every row of ``a`` passes).

    With ``size`` = 0 the kernel is generic: it reads the group size and interleave from its
    arguments (one compile serves every unit; about three times slower per product). Else
    they are constants of the kernel (``size`` and ``il`` given there must be these), and
    :func:`dot` is inlined with loops of known length. A closure over integers only: numba
    caches such a kernel on disk, not one that closes over other compiled functions."""
    fixed, fixed_il = size, il

    @njit(**_SUMS)
    def kernel(a: Any, ea: Any, b: Any, eb: Any, bad_a: Any, bad_b: Any, c: Any, sa: Any,
               sb: Any, K: int, M: int, N: int, size_: int, il_: int, kept: int, floor: int,
               per: int, tile: int, p_acc: Any, p_near: Any, p_master: Any, out: Any,
               start: int, stop: int) -> None:
        size = size_ if fixed == 0 else fixed
        il = il_ if fixed == 0 else fixed_il
        pa, pn, pm = unpack(p_acc), unpack(p_near), unpack(p_master)
        la, ln, lm = row_limits(0, pa), row_limits(0, pn), row_limits(0, pm)
        groups = max(1, (K + size - 1) // size)
        chunks = (groups + per - 1) // per if per else 1
        if paired:
            n_tiles, rows_b = 1, 1
        else:
            n_tiles, rows_b = (N + tile - 1) // tile, tile
        for nt in range(n_tiles):
            for r in range(start, stop):
                for t in range(rows_b):
                    if paired:
                        i, ra, rb = r, r, r
                    else:
                        n = nt * tile + t
                        if n >= N:
                            break
                        i, ra, rb = r * N + n, r, (r // M) * N + n
                    c0 = c[i] if has_c else 0.0
                    if bad_a[ra] or bad_b[rb]:
                        total = c0  # IEEE on the exact terms: NaN, or the infinity
                        for k in range(K):
                            total += np.float64(a[ra * K + k]) * np.float64(b[rb * K + k])
                        out[i] = total
                        continue
                    out[i] = dot(a[ra * K:(ra + 1) * K], ea[ra * K:(ra + 1) * K],
                                 b[rb * K:(rb + 1) * K], eb[rb * K:(rb + 1) * K], K, c0,
                                 sa[ra * chunks:(ra + 1) * chunks] if scaled else sa,
                                 sb[rb * chunks:(rb + 1) * chunks] if scaled else sb,
                                 size, il, kept, floor, per, scaled, pa, la, pn, ln, pm, lm)

    return kernel


@cache
def search_kernel(has_c: bool, paired: bool, has_out: bool) -> Callable[..., None]:
    """``kernel(a, ea, b, eb, bad_a, bad_b, c, K, M, N, size, il, floor, kept, per, p_acc,
    p_near, p_master, p_out, want, ok, start, stop)``: for candidates ``start..stop`` (their kept
    bits, promotion groups and accumulator parameters one row each of ``kept``, ``per``,
    ``p_acc``, ``p_near``), whether every result (rounded by ``p_out`` when ``has_out``) has
    ``want``'s bits; a candidate stops at its first miss (what ``drift calibrate`` searches
    with: most models of the family miss within a few results). Generic in the unit's size
    and interleave (one compile for every unit)."""

    @njit(**_SUMS)
    def kernel(a: Any, ea: Any, b: Any, eb: Any, bad_a: Any, bad_b: Any, c: Any, K: int,
               M: int, N: int, size: int, il: int, floor: int, kept: Any, per: Any, p_acc: Any,
               p_near: Any, p_master: Any, p_out: Any, want: Any, ok: Any, start: int,
               stop: int) -> None:
        pm = unpack(p_master)
        lm = row_limits(0, pm)
        po = unpack(p_out)
        lo = row_limits(0, po)
        count = want.size
        for m in range(start, stop):
            pa, pn = unpack(p_acc[m]), unpack(p_near[m])
            la, ln = row_limits(0, pa), row_limits(0, pn)
            good = True
            for i in range(count):
                ra, rb = rows_of(i, M, N, paired)
                c0 = c[i] if has_c else 0.0
                if bad_a[ra] or bad_b[rb]:
                    got = c0
                    for k in range(K):
                        got += np.float64(a[ra * K + k]) * np.float64(b[rb * K + k])
                else:
                    got = dot(a[ra * K:(ra + 1) * K], ea[ra * K:(ra + 1) * K],
                              b[rb * K:(rb + 1) * K], eb[rb * K:(rb + 1) * K], K, c0, a, a,
                              size, il, kept[m], floor, per[m], False, pa, la, pn, ln, pm, lm)
                if has_out:
                    got = rounded(got, 0.0, False, lo, po)
                w = want[i]
                if not (np.float64(got).view(np.int64) == np.float64(w).view(np.int64)
                        or (np.isnan(got) and np.isnan(w))):
                    good = False
                    break
            ok[m] = good

    return kernel
