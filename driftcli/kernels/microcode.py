"""The numba code of a multi-level (micro-exponent) block scale, imported on first use (it
imports numba): per block, the first-level scale ``s``, the multiplier ``r`` elements meet and
each element's total micro-exponent, the same steps as
:func:`driftcli.casts.microscale.torch_scales` (its torch twin) and
:func:`driftcli.oracle.quantization.cast_micro_block` (its exact one). The scale choice exists
once, :func:`row_scales`, inlined into both its callers: :func:`micro_scales` (the scales
alone, for the masks path and verify's scale cells) and :func:`cast_kernel` (the one-pass
cast, its elements rounded by :func:`round_nearest_wide` where the grid allows, else by
:func:`driftcli.kernels.jitcode.round_one`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit

# importing jitcode also puts its on-disk cache locator ahead of numba's own
from driftcli.kernels.jitcode import OPTIONS, round_one, row_limits

INF_BITS = 0x7F800000
"""float32 +inf: magnitudes at or above it are not finite."""


@njit(inline="always", **OPTIONS)
def round_bits(u: int, bits: int) -> int:
    """The bits ``u`` of a positive normal float64 (or +0) rounded to nearest even on ``bits``
    significant bits, on the integer (a carry moves into the exponent, as it should)."""
    drop = 53 - bits
    return (u + (1 << (drop - 1)) - 1 + ((u >> drop) & 1)) & ~((1 << drop) - 1)


@njit(inline="always", **OPTIONS)
def as_bits(v: float) -> int:
    """A float64's bits as an int64."""
    return int(np.float64(v).view(np.int64))


@njit(inline="always", **OPTIONS)
def of_bits(b: int) -> float:
    """The float64 of the bits ``b``."""
    return np.int64(b).view(np.float64)


@njit(**OPTIONS)
def level_params(levels: Any, ints: Any, cols: int) -> Any:
    """Per level, outermost first, ``(per, top, base)``: its runs counted in innermost runs
    (the division done once per call, not once per row), its largest micro-exponent, and
    ``emax + inner`` (``inner`` the steps of the levels inside it): a run whose amax ``v``
    meets ``v · r`` of binade ``b`` under its outer levels' exponent ``outer`` earns
    ``clamp(b - base - outer, 0, top)``, the count of the thresholds
    ``2**(emax + 1 + inner + outer + n)``, ``n < top``, that ``v · r`` reaches (as
    :func:`driftcli.casts.microscale.torch_scales` counts them)."""
    emax, steps = ints[1], ints[2]
    inner_size = levels[levels.shape[0] - 1, 0] if levels.shape[0] else cols
    out = np.empty((levels.shape[0], 3), dtype=np.int64)
    rest = steps
    for j in range(levels.shape[0]):
        rest -= levels[j, 1]
        out[j, 0], out[j, 1], out[j, 2] = levels[j, 0] // inner_size, levels[j, 1], emax + rest
    return out


@njit(inline="always", **OPTIONS)
def scale_params(levels: Any, ints: Any, consts: Any, cols: int) -> tuple[Any, Any]:
    """:func:`row_scales`' parameters as tuples (read once per call, not once per row):
    ``ints`` and the innermost run's size, ``consts``."""
    inner_size = levels[levels.shape[0] - 1, 0] if levels.shape[0] else cols
    return ((ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], inner_size),
            (consts[0], consts[1], consts[2]))


CHUNK = 128
"""Rows whose scales are chosen together, step by step over all of them (each step one loop
over the chunk's runs or rows); their elements stay in the cache between the amax pass and
the element pass."""


@njit(inline="always", **OPTIONS)
def row_scales(xi: Any, row0: int, n: int, cols: int, inner: int, lv: Any, ip: Any, fp: Any,
               runs: Any, worst: Any, s: Any, r: Any, bad: Any, clip: Any, rexp: Any) -> None:
    """The scale choice of the ``n`` rows of ``cols`` float32 elements from row ``row0``
    (``xi`` their int32 bits; ``inner`` elements an innermost run): the one copy on this
    back-end, for :func:`micro_scales` and :func:`cast_kernel`. Fills, per row, ``s``, ``r``
    (float64), ``bad`` (a NaN or inf member) and ``clip`` (``s`` clamped, not ``bad``), and
    per innermost run its total micro-exponent ``rexp`` (``runs`` and ``worst`` are scratch,
    one int64 per run). ``lv`` comes from :func:`level_params`, ``ip`` and ``fp`` from
    :func:`scale_params`, each once per call. NaN and inf members set ``bad`` and are left
    out of every amax, as in :func:`driftcli.casts.microscale.torch_scales`. Every amax is
    read on the bits (non-negative floats order as their bits do) and every exponent from
    bits."""
    pow2, emax, steps, low, high, sig, _ = ip
    c, smallest, largest = fp
    nin = cols // inner
    base = row0 * cols
    for k in range(n * nin):  # the innermost runs' finite amaxes and largest bits
        m, w = 0, 0
        for i in range(base + k * inner, base + (k + 1) * inner):
            u = xi[i] & 0x7FFFFFFF
            w = max(w, u)
            m = max(m, u if u < INF_BITS else 0)
        runs[k], worst[k] = m, w
    for row in range(n):
        top, w = 0, 0
        for k in range(row * nin, (row + 1) * nin):
            top, w = max(top, runs[k]), max(w, worst[k])
        bad[row] = w >= INF_BITS
        # a float32 amax is a normal float64 (or 0)
        amax = np.float64(np.int32(top).view(np.float32))
        if pow2:
            free = (as_bits(amax) >> 52) - 1023 - emax - steps if top > 0 else low
            k = min(max(free, low), high)
            s[row] = of_bits((1023 + k) << 52)
            r[row] = of_bits((1023 - k) << 52)
            clip[row] = k != free and w < INF_BITS
        else:  # amax · c is a normal float64 (or 0), so are the roundings of it
            raw_bits = round_bits(as_bits(amax * c), 8)
            raw = of_bits(raw_bits)
            rounded = of_bits(round_bits(raw_bits, sig))
            sr = min(max(rounded, smallest), largest)
            s[row] = sr
            clip[row] = top > 0 and (rounded > largest or raw < smallest) and w < INF_BITS
            r[row] = of_bits(round_bits(as_bits(1.0 / sr), 8))
    rexp[:n * nin] = 0
    for j in range(lv.shape[0]):
        per, most, lbase = lv[j, 0], lv[j, 1], lv[j, 2]
        for row in range(n):
            rr = r[row]
            if per == 1:  # the innermost level: a loop without inner loops, that unrolls
                for g in range(row * nin, (row + 1) * nin):
                    y = np.float64(np.int32(runs[g]).view(np.float32)) * rr
                    rexp[g] += min(max((as_bits(y) >> 52) - 1023 - lbase - rexp[g], 0), most)
                continue
            for g in range(row * nin, (row + 1) * nin, per):
                v = 0
                for t in range(g, g + per):
                    v = max(v, runs[t])
                # exact: 24 by 8 significant bits, a normal float64 (or 0, binade -1023)
                y = np.float64(np.int32(v).view(np.float32)) * rr
                e = min(max((as_bits(y) >> 52) - 1023 - lbase - rexp[g], 0), most)
                for t in range(g, g + per):
                    rexp[t] += e


@njit(inline="always", **OPTIONS)
def chunk_scratch(cols: int, inner: int) -> tuple[Any, Any, Any, Any, Any, Any, Any]:
    """:func:`row_scales`' arrays for a chunk of :data:`CHUNK` rows: ``runs``, ``worst``,
    ``s``, ``r``, ``bad``, ``clip``, ``rexp``."""
    nin = cols // inner
    return (np.zeros(CHUNK * nin, dtype=np.int64), np.zeros(CHUNK * nin, dtype=np.int64),
            np.zeros(CHUNK, dtype=np.float64), np.zeros(CHUNK, dtype=np.float64),
            np.zeros(CHUNK, dtype=np.bool_), np.zeros(CHUNK, dtype=np.bool_),
            np.zeros(CHUNK * nin, dtype=np.int64))


@njit(**OPTIONS)
def micro_scales(x: Any, xi: Any, cols: int, levels: Any, ints: Any, consts: Any, s_out: Any,
                 r_out: Any, bad: Any, clamped: Any, exps: Any, start: int, stop: int) -> None:
    """Rows ``start..stop`` of ``cols`` float32 elements (``xi`` their int32 view): ``s_out``,
    ``r_out`` (float64), ``bad`` (a NaN or inf member), ``clamped`` and ``exps`` (one per
    element), by :func:`row_scales`, :data:`CHUNK` rows at a time.

    ``levels`` holds ``(size, top)`` per level, outermost first; ``ints`` is ``(pow2 base,
    emax_elem, T, low, high, scale mbits + 1)``; ``consts`` is ``(rne_bf16(1 / M), smallest,
    largest)`` of the scale format.
    """
    ip, fp = scale_params(levels, ints, consts, cols)
    inner = ip[6]
    lv = level_params(levels, ints, cols)
    runs, worst, s, r, nonfinite, clip, rexp = chunk_scratch(cols, inner)
    for row0 in range(start, stop, CHUNK):
        n = min(CHUNK, stop - row0)
        row_scales(xi, row0, n, cols, inner, lv, ip, fp, runs, worst, s, r, nonfinite, clip,
                   rexp)
        s_out[row0:row0 + n], r_out[row0:row0 + n] = s[:n], r[:n]
        bad[row0:row0 + n], clamped[row0:row0 + n] = nonfinite[:n], clip[:n]
        base = row0 * cols
        for k in range(n * (cols // inner)):
            for i in range(base + k * inner, base + (k + 1) * inner):
                exps[i] = rexp[k]


def wide_nearest_applies(p: Any, rounding: int, has_draws: bool) -> bool:
    """Whether :func:`round_nearest_wide` rounds onto the grid of ``p`` (a float64 source) as
    :func:`driftcli.kernels.jitcode.round_one` does: to nearest (even or away), no random
    bits, a signed format with a zero whose binades share one width of 1 to 51 fraction bits
    (ties go by the kept bit), its smallest quantum a float64 normal."""
    lo, t_mbits = int(p[2]), int(p[3])
    return bool(rounding in (0, 1) and not has_draws and p[16] == 0 and p[17] == 0
                and p[7] and p[10] and 1 <= t_mbits <= 51 and lo - t_mbits >= -1022)


@njit(inline="always", **OPTIONS)
def round_nearest_wide(y: float, away: bool, lo: int, t_mbits: int, top_pos: float,
                       top_neg: float, over_pos: float, over_neg: float,
                       neg_zero: bool) -> float:
    """:func:`driftcli.kernels.jitcode.round_one`'s value for a finite float64 ``y``, to
    nearest with ties away (``away``) or to the even code, on a signed grid with a zero whose
    binades share one width (``t_mbits`` fraction bits, smallest normal exponent ``lo``;
    ``top_pos`` and ``top_neg`` its largest magnitudes, ``over_pos`` and ``over_neg`` what
    lies beyond them becomes). The quantum ``Q = 2**(max(e, lo) - t_mbits)`` comes from
    ``|y|``'s exponent bits; ``|y| / Q`` is exact (a power of two), and so are its integer
    part, the fraction left and the rounded multiple times ``Q``: float operations whose
    every result is exact, with no branch, so that the element loop vectorizes. A carry
    into the next binade lands on its first code, as it should."""
    a = abs(y)
    q = max((as_bits(a) >> 52) - 1023, lo) - t_mbits
    w = a * of_bits((1023 - q) << 52)
    if away:
        m = np.floor(w)
        m += 1.0 if w - m >= 0.5 else 0.0
    else:
        m = np.rint(w)  # ties to even: the even kept bit
    v = m * of_bits((1023 + q) << 52)
    if as_bits(y) < 0:
        v = over_neg if v > top_neg else v
        return -v if (v != 0 or neg_zero) else 0.0
    return over_pos if v > top_pos else v


@cache
def cast_kernel(rounding: int, overflow: int, has_draws: bool, wide_nearest: bool,
                block: int, inner: int) -> Callable[..., None]:
    """``kernel(x, xi, cols, levels, ints, consts, q, draws, out, start, stop)``: rows
    ``start..stop`` of a float32 tensor (``x``, and ``xi`` its int32 view) cast in one pass,
    :data:`CHUNK` rows at a time: the scales of :func:`row_scales` (per innermost run of
    ``inner`` elements; ``cols`` is ``block``: both constants of the machine code, so that
    the loops over a row and a run unroll; the ``cols`` argument is not read), then each
    element ``x`` rounded as ``fl32(round(x · r / 2**E) · 2**E · s)``
    (``x · r / 2**E`` is exact in float64) onto the element grid (its
    :func:`~driftcli.kernels.jitcode.row_limits` of scale 1): by :func:`round_nearest_wide`
    where ``wide_nearest`` (:func:`wide_nearest_applies`), else by
    :func:`driftcli.kernels.jitcode.round_one` on its float64 bits; ``q`` the float64
    source's parameters (their rounding and overflow codes are this kernel's). A row holding
    NaN or inf becomes NaN."""

    @njit(**OPTIONS)
    def kernel(x: Any, xi: Any, cols_given: int, levels: Any, ints: Any, consts: Any, q: Any,
               draws: Any, out: Any, start: int, stop: int) -> None:
        cols = block
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        lim = row_limits(0, p)
        lo, t_mbits = lim[0], p[3]
        top_pos, top_neg = of_bits(lim[2]), of_bits(lim[3])
        beyond = np.inf if p[8] != 0 else np.nan
        saturating = overflow == 0 or not (p[8] != 0 or p[9] != 0)
        over_pos = top_pos if saturating else beyond
        over_neg = top_neg if saturating else beyond
        neg_zero = p[11] != 0
        ip, fp = scale_params(levels, ints, consts, cols)
        lv = level_params(levels, ints, cols)
        nin = cols // inner
        runs, worst, s, r, bad, clip, rexp = chunk_scratch(cols, inner)
        ins = np.zeros(CHUNK * cols, dtype=np.float64)
        outs = np.zeros(CHUNK * cols, dtype=np.float64)
        for row0 in range(start, stop, CHUNK):
            n = min(CHUNK, stop - row0)
            row_scales(xi, row0, n, cols, inner, lv, ip, fp, runs, worst, s, r, bad, clip,
                       rexp)
            # the grid scaled by 2**E is the unscaled grid times 2**E: each element meets
            # r / 2**E on the way in and 2**E · s on the way out (exact powers of two), and
            # all round under one set of limits
            for row in range(n):
                for k in range(row * nin, (row + 1) * nin):
                    into = r[row] * of_bits((1023 - rexp[k]) << 52)
                    back = s[row] * of_bits((1023 + rexp[k]) << 52)
                    for i in range(k * inner, (k + 1) * inner):
                        ins[i], outs[i] = into, back
            base = row0 * cols
            for i in range(n * cols):  # one loop over the chunk's elements: it vectorizes
                y = np.float64(x[base + i]) * ins[i]
                if wide_nearest:
                    v = round_nearest_wide(y, rounding == 1, lo, t_mbits, top_pos, top_neg,
                                           over_pos, over_neg, neg_zero)
                else:
                    d = draws[base + i] if has_draws else 0
                    v = of_bits(round_one(as_bits(y), 0, False, d, lim, p))
                out[base + i] = np.float32(v * outs[i])
            for row in range(n):  # a row holding NaN or inf becomes NaN
                if bad[row]:
                    out[base + row * cols:base + (row + 1) * cols] = np.float32(np.nan)

    return kernel
