"""The numba code of four over six's errors (:mod:`driftcli.casts.fouroversix`; imported on first
use:
it imports numba). Each block's two candidates are rounded by the element kernel's own
``lean_quotient`` and their errors summed in the block's order, every step one IEEE float32
operation, as ``fouroversix.block_errors`` does in torch."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit

from driftcli.kernels.jitcode import OPTIONS, lean_quotient, row_limits

CHUNK = 64
"""Rows :func:`values_kernel` works on at a time (their codes and terms stay in cache)."""


@njit(inline="always", **OPTIONS)
def nearest_saturated(y: Any, lo: int, top: int, t_mbits: int, biggest: Any) -> Any:
    """A float32 ``y`` rounded to nearest even onto a grid of ``t_mbits`` fraction bits whose
    smallest normal binade is ``2**lo`` (``lo >= -126``), saturating at ``biggest`` (every
    binade from ``2**top`` up saturates, so ``top`` is one above the grid's top binade), the
    sign kept (a negative zero too): :func:`~driftcli.kernels.jitcode.round_lean`'s bits for
    such a grid and a finite or infinite ``y``, in float32 arithmetic that vectorizes. Adding
    ``M = 2**(e - t_mbits + 23)``, ``e`` the binade of ``|y|`` brought into ``[lo, top]``,
    leaves float32's last bit at the grid's quantum there, so ``fl(|y| + M) - M`` is ``|y|``
    rounded to nearest even onto the grid (the subtraction exact); the even multiple of the
    quantum is the even code (tests/test_fouroversix_fused.py holds it to round_lean)."""
    bits = np.float32(y).view(np.int32)
    u = bits & 0x7FFFFFFF
    e = min(max(np.int64(u >> 23) - 127, np.int64(lo)), np.int64(top))
    m = np.int32((e - t_mbits + 150) << 23).view(np.float32)
    mag = np.int32(u).view(np.float32)
    r = min(np.float32(np.float32(mag + m) - m), biggest)
    return np.int32(np.float32(r).view(np.int32) | (bits & np.int32(-(1 << 31)))).view(
        np.float32)


@njit(inline="always", **OPTIONS)
def candidate_error(k: Any, sb: Any, x: Any, t: Any, g: Any, enc: Any, fp16: bool) -> Any:
    """A candidate's signed error, every step one float32 operation as the reference does it:
    ``fl(fl(fl(fl(k · sb) · t) / g) − x)``, or with ``fp16`` (its fast path)
    ``fl(k · sb − fl(x · enc))``; the one formula of both kernels below."""
    if fp16:
        return k * sb - x * enc
    return ((k * sb) * t) / g - x


@cache
def errors_kernel(rounding: int, overflow: int, squared: bool,
                  fp16: bool) -> Callable[..., None]:
    """``kernel(x, inv4, inv6, sb4, sb6, ts, encs, g, cols, err4, err6, q, start, stop)``: for
    the rows ``start:stop`` of float32 ``x`` (``cols`` a row), each candidate's codes of
    ``fl(x · inv)`` (rounded by ``q``) and its error summed from 0 in element order: ``|d|``
    or ``d · d`` (``squared``) of ``d = fl(fl(fl(fl(q · sb) · t) / g) − x)``, or with ``fp16``
    ``d = fl(q · sb − fl(x · enc))``; ``t`` and ``enc`` (float32) are ``ts[0]``, ``encs[0]``,
    or where ``ts`` holds more than one, each row's own (row-scaled NVFP4; read per row, not
    compiled in: one kernel fewer for a cold start), ``g`` float32."""

    @njit(**OPTIONS)
    def kernel(x: Any, inv4: Any, inv6: Any, sb4: Any, sb6: Any, ts: Any, encs: Any, g: Any,
               cols: int, err4: Any, err6: Any, q: Any, start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        lim = row_limits(0, p)
        t, enc = ts[0], encs[0]
        per_row = ts.size > 1
        for row in range(start, stop):
            if per_row:
                t, enc = ts[row], encs[row]
            a4, a6, s4, s6 = inv4[row], inv6[row], sb4[row], sb6[row]
            e4 = np.float32(0.0)
            e6 = np.float32(0.0)
            base = row * cols
            for j in range(cols):
                v = x[base + j]
                c4 = lean_quotient(v * a4, 0, lim, p)
                c6 = lean_quotient(v * a6, 0, lim, p)
                d4 = candidate_error(c4, s4, v, t, g, enc, fp16)
                d6 = candidate_error(c6, s6, v, t, g, enc, fp16)
                if squared:
                    e4 = e4 + d4 * d4
                    e6 = e6 + d6 * d6
                else:
                    e4 = e4 + abs(d4)
                    e6 = e6 + abs(d6)
            err4[row] = e4
            err6[row] = e6

    return kernel


@cache
def values_kernel(rounding: int, overflow: int, squared: bool, fp16: bool, cols: int,
                  nearest: bool, scale_nearest: bool, per_row: bool = False,
                  runs: int = 1) -> Callable[..., None]:
    """``kernel(x, amax, ts, encs, decs, consts, per, out, q, qs, start, stop)``: a whole 4/6 cast
    of the rows ``start:stop`` of float32 ``x`` (``cols`` a row, ``amax`` each row's, every
    element finite) in one pass, the chosen candidate's values written to ``out``. Per row, the
    steps of ``fouroversix.four_over_six_scales`` in its order, each one IEEE float32
    operation: ``base = fl(fl(amax / 6) · enc)``, ``raw4 = fl(base · 1.5)``, the E4M3 block
    scales ``sb4``, ``sb6`` (rounded by ``qs``: nearest even, saturating), the multipliers
    ``min(fl(1 / fl(sb · dec)), max)``; both candidates' codes (rounded by ``q``) and errors
    as :func:`errors_kernel` sums them (from 0, in element order); map-to-4 where its error
    is strictly smaller; the values ``fl(code · fl(fl(sb · t) · inv_g))``. ``t``, ``enc``,
    ``dec`` are ``ts[0]``, ``encs[0]``, ``decs[0]``, or with ``per_row`` (row-scaled NVFP4)
    each row's own, made here as ``fouroversix.tensor_scales`` makes them: ``t`` the largest
    ``amax`` of the row's ``per`` blocks (``scalearith.row_amax``), ``enc = min(fl(g / t),
    max)``, 1 where ``t`` or it is 0, ``dec = fl(1 / enc)``; ``consts`` is ``(g, six, expand,
    inv_g, max)``, float32.

    With ``runs`` 16 a row is a 16 x 16 tile (its 16 rows of 16 one after another): each run
    of 16's error is summed so, the tile's 16 run errors are added by halves (0-7 + 8-15, then
    0-3 + 4-7, 0-1 + 2-3, 0 + 1, as ``fouroversix.tile_sum``), and the choice is the tile's.

    For speed: ``cols`` is a constant of the machine code (a block's loops unroll), rows go
    in chunks (:data:`CHUNK` runs of 16) whose scales are computed side by side, and each
    run's error sum, a chain of dependent additions, runs beside the other runs' (the order
    within a run unchanged). With ``nearest`` (``scale_nearest``: for ``qs``) a grid
    :func:`nearest_saturated` rounds (nearest even, saturating) is rounded by it, else by
    :func:`~driftcli.kernels.jitcode.lean_quotient`: the same bits."""
    run = cols // runs

    @njit(**OPTIONS)
    def kernel(x: Any, amax: Any, ts: Any, encs: Any, decs: Any, consts: Any, per: int,
               out: Any, q: Any, qs: Any, start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        ps = (qs[0], qs[1], qs[2], qs[3], qs[4], qs[5], qs[6], qs[7], qs[8], qs[9], qs[10],
              qs[11], qs[12], qs[13], qs[14], qs[15], qs[16], qs[17])
        lim = row_limits(0, p)
        slim = row_limits(0, ps)
        lo, t_mbits = lim[0], p[3]
        above = lim[1] + t_mbits + 1
        biggest = np.int32(lim[2]).view(np.float32)
        s_lo, s_mbits = slim[0], ps[3]
        s_above = slim[1] + s_mbits + 1
        s_biggest = np.int32(slim[2]).view(np.float32)
        g, six, expand, inv_g, top = consts[0], consts[1], consts[2], consts[3], consts[4]
        t, enc, dec = ts[0], encs[0], decs[0]
        one = np.float32(1.0)
        n_max = max(CHUNK // runs, 1)
        sb4s = np.empty(n_max, dtype=np.float32)
        sb6s = np.empty(n_max, dtype=np.float32)
        a4s = np.empty(n_max, dtype=np.float32)
        a6s = np.empty(n_max, dtype=np.float32)
        tr = np.empty(n_max, dtype=np.float32)  # row-scaled: each block's t and S_enc
        er = np.empty(n_max, dtype=np.float32)
        cur = -1  # the row whose scales t, enc, dec hold
        e4s = np.empty(n_max * runs, dtype=np.float32)
        e6s = np.empty(n_max * runs, dtype=np.float32)
        c4 = np.empty(n_max * cols, dtype=np.float32)
        c6 = np.empty(n_max * cols, dtype=np.float32)
        d4 = np.empty(n_max * cols, dtype=np.float32)
        d6 = np.empty(n_max * cols, dtype=np.float32)
        for first in range(start, stop, n_max):
            n = min(n_max, stop - first)
            for r in range(n):  # the scales
                if per_row:
                    row = (first + r) // per
                    if row != cur:  # a row's blocks come one after another: once a row
                        cur = row
                        t = amax[row * per]
                        for b in range(row * per + 1, row * per + per):
                            t = max(t, amax[b])
                        enc = np.float32(g / t)
                        enc = top if enc > top else enc
                        if t == 0 or enc == 0:
                            enc = one
                        dec = np.float32(one / enc)
                    tr[r] = t
                    er[r] = enc
                base = np.float32(np.float32(amax[first + r] / six) * enc)
                raw4 = np.float32(base * expand)
                if scale_nearest:
                    sb4 = nearest_saturated(raw4, s_lo, s_above, s_mbits, s_biggest)
                    sb6 = nearest_saturated(base, s_lo, s_above, s_mbits, s_biggest)
                else:
                    sb4 = lean_quotient(raw4, 0, slim, ps)
                    sb6 = lean_quotient(base, 0, slim, ps)
                a4 = np.float32(one / np.float32(sb4 * dec))
                a6 = np.float32(one / np.float32(sb6 * dec))
                sb4s[r] = sb4
                sb6s[r] = sb6
                a4s[r] = top if a4 > top else a4
                a6s[r] = top if a6 > top else a6
            xs = x[first * cols:(first + n) * cols]
            for r in range(n):  # the candidates' codes and error terms
                a4, a6, sb4, sb6 = a4s[r], a6s[r], sb4s[r], sb6s[r]
                if per_row:
                    t, enc = tr[r], er[r]
                for j in range(cols):
                    i = r * cols + j
                    v = xs[i]
                    if nearest:
                        k4 = nearest_saturated(v * a4, lo, above, t_mbits, biggest)
                        k6 = nearest_saturated(v * a6, lo, above, t_mbits, biggest)
                    else:
                        k4 = lean_quotient(v * a4, 0, lim, p)
                        k6 = lean_quotient(v * a6, 0, lim, p)
                    c4[i] = k4
                    c6[i] = k6
                    f4 = candidate_error(k4, sb4, v, t, g, enc, fp16)
                    f6 = candidate_error(k6, sb6, v, t, g, enc, fp16)
                    d4[i] = f4 * f4 if squared else abs(f4)
                    d6[i] = f6 * f6 if squared else abs(f6)
            m = n * runs
            e4s[:m] = np.float32(0.0)
            e6s[:m] = np.float32(0.0)
            for j in range(run):  # element j of every run, runs side by side
                for r in range(m):
                    e4s[r] = e4s[r] + d4[r * run + j]
                    e6s[r] = e6s[r] + d6[r * run + j]
            if runs > 1:  # a tile's run errors by halves, as the warp reduction
                for r in range(n):
                    half = runs // 2
                    while half > 0:
                        for k in range(half):
                            e4s[r * runs + k] = e4s[r * runs + k] + e4s[r * runs + k + half]
                            e6s[r * runs + k] = e6s[r * runs + k] + e6s[r * runs + k + half]
                        half //= 2
            os = out[first * cols:(first + n) * cols]
            for r in range(n):  # the choice: map-to-4 only where its error is smaller
                if per_row:
                    t = tr[r]
                pick4 = e4s[r * runs] < e6s[r * runs]
                undo = np.float32(np.float32((sb4s[r] if pick4 else sb6s[r]) * t) * inv_g)
                codes = c4 if pick4 else c6
                for j in range(cols):
                    os[r * cols + j] = codes[r * cols + j] * undo

    return kernel
