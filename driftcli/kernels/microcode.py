"""The numba code of a multi-level (micro-exponent) block scale, imported on first use (it
imports numba): per block, the first-level scale ``s``, the multiplier ``r`` elements meet and
each element's total micro-exponent, the same steps as
:func:`driftcli.casts.microscale.torch_scales` (its torch twin) and
:func:`driftcli.oracle.quantization.cast_micro_block` (its exact one). The scale choice exists
once, :func:`row_scales`, inlined into both its callers: :func:`micro_scales` (the scales
alone, for the masks path and verify's scale cells) and :func:`cast_kernel` (the one-pass
cast, its elements rounded by :func:`driftcli.kernels.jitcode.round_one`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit

# importing jitcode also puts its on-disk cache locator ahead of numba's own
from driftcli.kernels.jitcode import OPTIONS, round_one, row_limits


@njit(inline="always", **OPTIONS)
def round_bits(u: int, bits: int) -> int:
    """The bits ``u`` of a positive normal float64 (or +0) rounded to nearest even on ``bits``
    significant bits, on the integer (a carry moves into the exponent, as it should)."""
    drop = 53 - bits
    return (u + (1 << (drop - 1)) - 1 + ((u >> drop) & 1)) & ~((1 << drop) - 1)


@njit(**OPTIONS)
def thresholds_of(levels: Any, ints: Any) -> Any:
    """Per level ``j`` and ``n`` in ``0..T``: ``2**(emax + 1 + inner_j + n)``, ``inner_j`` the
    micro-exponent steps of the levels inside ``j``; a run's value ``v · r`` reaching the
    threshold at its outer levels' exponent plus ``e`` earns level ``j``'s ``e + 1``-th step."""
    emax, steps = ints[1], ints[2]
    out = np.zeros((levels.shape[0], steps + 1), dtype=np.float64)
    rest = steps
    for j in range(levels.shape[0]):
        rest -= levels[j, 1]
        for n in range(steps + 1):
            out[j, n] = math.ldexp(1.0, emax + 1 + rest + n)
    return out


@njit(inline="always", **OPTIONS)
def scale_params(levels: Any, ints: Any, consts: Any, cols: int) -> tuple[Any, Any]:
    """:func:`row_scales`' parameters as tuples (read once per call, not once per row):
    ``ints`` and the innermost run's size, ``consts``."""
    inner_size = levels[levels.shape[0] - 1, 0] if levels.shape[0] else cols
    return ((ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], inner_size),
            (consts[0], consts[1], consts[2]))


@njit(**OPTIONS)
def level_runs(levels: Any, inner_size: int) -> Any:
    """Per level ``(size, top)`` as ``(innermost runs per run, top)``: the division done once
    per call, not once per row."""
    out = np.empty_like(levels)
    for j in range(levels.shape[0]):
        out[j, 0], out[j, 1] = levels[j, 0] // inner_size, levels[j, 1]
    return out


@njit(inline="always", **OPTIONS)
def row_scales(xs: Any, us: Any, lv: Any, ip: Any, fp: Any, thresholds: Any,
               box: Any, bits: Any, runs: Any, rexp: Any) -> tuple[float, float, bool, bool]:
    """The scale choice of one row (the one copy on this back-end, for :func:`micro_scales`
    and :func:`cast_kernel`): float32 elements ``xs`` (``us`` their int32 bits) give
    ``(s, r, bad, clamped)`` and fill ``rexp`` with each innermost run's total micro-exponent
    (``runs`` is scratch, one float64 per innermost run; ``box`` one float64 and ``bits`` its
    int64 view). ``lv`` comes from :func:`level_runs`, ``ip`` and ``fp`` from
    :func:`scale_params`, ``thresholds`` from :func:`thresholds_of`, each once per call. NaN
    and inf members set ``bad`` and are left out of every amax, as in
    :func:`driftcli.casts.microscale.torch_scales`."""
    pow2, emax, steps, low, high, sig, inner_size = ip
    c, smallest, largest = fp
    cols, nin = xs.size, runs.size
    worst = 0
    for i in range(cols):  # without branches, so that it vectorizes
        worst = max(worst, us[i] & 0x7FFFFFFF)
    bad = worst >= 0x7F800000  # a NaN or inf member
    amax = 0.0
    for run in range(nin):  # the innermost runs' amaxes
        m = np.float32(0.0)
        for i in range(run * inner_size, (run + 1) * inner_size):
            m = max(m, abs(xs[i]))
        runs[run] = m
        amax = max(amax, np.float64(m))
    if bad:  # rare: again, of the finite members only (a branch in the loop above costs)
        amax = 0.0
        for run in range(nin):
            m = np.float32(0.0)
            for i in range(run * inner_size, (run + 1) * inner_size):
                if (us[i] & 0x7FFFFFFF) < 0x7F800000:
                    m = max(m, abs(xs[i]))
            runs[run] = m
            amax = max(amax, np.float64(m))
    # exponents from bits: a float32 amax is a normal float64 (or 0)
    if pow2:
        box[0] = amax
        free = (bits[0] >> 52) - 1023 - emax - steps if amax > 0 else low
        k = min(max(free, low), high)
        bits[0] = (1023 + k) << 52
        s = box[0]
        bits[0] = (1023 - k) << 52
        r = box[0]
        clip = k != free
    else:  # amax · c is a normal float64 (or 0), so are the roundings of it
        box[0] = amax * c
        bits[0] = round_bits(bits[0], 8)
        raw = box[0]
        bits[0] = round_bits(bits[0], sig)
        rounded = box[0]
        s = min(max(rounded, smallest), largest)
        clip = amax > 0 and (rounded > largest or raw < smallest)
        box[0] = 1.0 / s
        bits[0] = round_bits(bits[0], 8)
        r = box[0]
    rexp[:] = 0
    for j in range(lv.shape[0]):
        per, top = lv[j, 0], lv[j, 1]
        for g in range(0, nin, per):
            v = 0.0
            for t in range(g, g + per):
                v = max(v, runs[t])
            v = v * r  # exact: 24 by 8 significant bits
            # e: how many of the thresholds 2**(emax + 1 + inner + outer + e) v reaches
            e, outer = 0, rexp[g]
            while e < top and v >= thresholds[j, outer + e]:
                e += 1
            if e:
                for t in range(g, g + per):
                    rexp[t] += e
    return s, r, bad, clip and not bad


@njit(**OPTIONS)
def micro_scales(x: Any, xi: Any, cols: int, levels: Any, ints: Any, consts: Any, s_out: Any,
                 r_out: Any, bad: Any, clamped: Any, exps: Any, start: int, stop: int) -> None:
    """Rows ``start..stop`` of ``cols`` float32 elements (``xi`` their int32 view): ``s_out``,
    ``r_out`` (float64), ``bad`` (a NaN or inf member), ``clamped`` and ``exps`` (one per
    element), by :func:`row_scales`.

    ``levels`` holds ``(size, top)`` per level, outermost first; ``ints`` is ``(pow2 base,
    emax_elem, T, low, high, scale mbits + 1)``; ``consts`` is ``(rne_bf16(1 / M), smallest,
    largest)`` of the scale format.
    """
    thresholds = thresholds_of(levels, ints)
    box = np.zeros(1, dtype=np.float64)  # a float64's bits, read through an int64 view
    bits = box.view(np.int64)
    ip, fp = scale_params(levels, ints, consts, cols)
    inner_size = ip[6]
    lv = level_runs(levels, inner_size)
    runs = np.zeros(cols // inner_size, dtype=np.float64)
    rexp = np.zeros(cols // inner_size, dtype=np.int64)
    for row in range(start, stop):
        base = row * cols
        s, r, nonfinite, clip = row_scales(x[base:base + cols], xi[base:base + cols], lv,
                                           ip, fp, thresholds, box, bits, runs, rexp)
        s_out[row], r_out[row], bad[row], clamped[row] = s, r, nonfinite, clip
        for t in range(runs.size):
            for i in range(base + t * inner_size, base + (t + 1) * inner_size):
                exps[i] = rexp[t]


@cache
def cast_kernel(rounding: int, overflow: int, has_draws: bool) -> Callable[..., None]:
    """``kernel(x, xi, cols, levels, ints, consts, q, draws, out, start, stop)``: rows
    ``start..stop`` of a float32 tensor (``x``, and ``xi`` its int32 view) cast in one pass:
    the scales of :func:`row_scales` (per innermost run), then each element ``x`` rounded
    as ``fl32(round(x · r / 2**E) · 2**E · s)`` by :func:`driftcli.kernels.jitcode.round_one`
    on its float64 bits (``x · r / 2**E`` is exact in float64) onto the element grid (its
    :func:`~driftcli.kernels.jitcode.row_limits` of scale 1); ``q`` the float64 source's parameters
    (their rounding and overflow codes are this kernel's). A row holding NaN or inf becomes
    NaN."""

    @njit(**OPTIONS)
    def kernel(x: Any, xi: Any, cols: int, levels: Any, ints: Any, consts: Any, q: Any,
               draws: Any, out: Any, start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        lim = row_limits(0, p)
        pw = np.array([math.ldexp(1.0, e) for e in range(ints[2] + 1)])
        thresholds = thresholds_of(levels, ints)
        box = np.zeros(1, dtype=np.float64)  # a float64's bits, read through an int64 view
        bits = box.view(np.int64)
        ys = np.zeros(cols, dtype=np.float64)
        yb = ys.view(np.int64)
        ins = np.zeros(cols, dtype=np.float64)
        outs = np.zeros(cols, dtype=np.float64)
        ip, fp = scale_params(levels, ints, consts, cols)
        inner_size = ip[6]
        lv = level_runs(levels, inner_size)
        nin = cols // inner_size
        runs = np.zeros(nin, dtype=np.float64)
        rexp = np.zeros(nin, dtype=np.int64)
        for row in range(start, stop):
            xs = x[row * cols:(row + 1) * cols]
            us = xi[row * cols:(row + 1) * cols]
            os = out[row * cols:(row + 1) * cols]
            s, r, bad, _ = row_scales(xs, us, lv, ip, fp, thresholds, box, bits, runs, rexp)
            if bad:  # a row holding NaN or inf becomes NaN
                for i in range(cols):
                    os[i] = np.float32(np.nan)
                continue
            # the grid scaled by 2**E is the unscaled grid times 2**E: each element meets
            # r / 2**E on the way in and 2**E · s on the way out (exact powers of two), and
            # all round under one set of limits, in one loop that vectorizes
            for t in range(nin):
                up = pw[rexp[t]]
                for i in range(t * inner_size, (t + 1) * inner_size):
                    ins[i] = r / up
                    outs[i] = s * up
            for i in range(cols):
                ys[i] = np.float64(xs[i]) * ins[i]
            base = row * cols
            for i in range(cols):
                d = draws[base + i] if has_draws else 0
                yb[i] = round_one(yb[i], 0, False, d, lim, p)
            for i in range(cols):
                os[i] = np.float32(ys[i] * outs[i])

    return kernel
