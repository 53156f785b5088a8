"""The numba code of the scan's fused passes (imported on first use: importing it imports numba).

:func:`facts_kernel` reads a slice once for what every cast of it shares: the raw amax of
each run of consecutive elements and, per piece, the finite count and Σ|x|.
:func:`counts_kernel` casts every element of a slice under its group's scale and counts,
in the same loop, everything :class:`driftcli.measures.stats.CastStats` holds: clips and
their excess, nonzero, underflowed, subnormal and lost elements, and the float64 error sums.
The element rounding is :func:`driftcli.kernels.jitcode.round_one` / ``round_lean``, the very
code :func:`driftcli.quantize` runs on numba, so a count here is the count of its cast.

Every sum is made per piece of a fixed number of elements, and the pieces are added in order
afterwards: the result does not depend on how many threads ran the pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit

from driftcli.kernels.jitcode import (
    OPTIONS,
    lean_quotient,
    round_lean,
    round_one,
    row_limits,
    wide_quotient,
)


@njit(**OPTIONS)
def facts_kernel(bits: Any, values: Any, n: int, chunk: int, piece: int, mask: int,
                 inf_bits: int, run_top: Any, finite: Any, abs_sum: Any, start: int,
                 stop: int) -> None:
    """Pieces ``start..stop`` of ``piece`` elements (a multiple of ``chunk``) of a flat
    slice: the largest ``bits & mask`` of every run of ``chunk`` elements (its raw amax:
    NaN bits order above inf bits, and inf above every finite magnitude; skipped when
    ``chunk`` is 0), and per piece the finite elements and their Σ|x| in float64."""
    for pc in range(start, stop):
        a = pc * piece
        b = min(a + piece, n)
        if chunk:
            for r in range(a // chunk, (b + chunk - 1) // chunk):
                xs = bits[r * chunk:min((r + 1) * chunk, n)]
                top = 0
                for i in range(xs.size):  # branch-free, so that it vectorizes
                    top = max(top, xs[i] & mask)
                run_top[r] = top
        xs, vs = bits[a:b], values[a:b]
        count = 0
        total = 0.0
        for i in range(xs.size):
            ok = (xs[i] & mask) < inf_bits
            count += int(ok)
            total += abs(np.float64(vs[i])) if ok else 0.0
        finite[pc] = count
        abs_sum[pc] = total


@njit(inline="always", **OPTIONS)
def _add(total: float, comp: float, term: float) -> tuple[float, float]:
    """``total + term`` with its rounding error gathered in ``comp`` (Neumaier's sum): signed
    sums such as Σe·x cancel, and a plain running sum would keep only the error of its order."""
    t = total + term
    if abs(total) >= abs(term):
        comp += (total - t) + term
    else:
        comp += (term - t) + total
    return t, comp


N_COUNTS = 6
"""Columns of a piece's counts: clipped, groups with a clip, nonzero, underflowed, subnormal,
lost."""
N_SUMS = 5
"""Columns of a piece's sums: clip excess, Σx², Σe², Σe·x, Σe."""


@cache
def counts_kernel(pow2: bool, rounded: bool, has_bad: bool, want_q: bool, rounding: int,
                  overflow: int) -> Callable[..., None]:
    """``kernel(bits, values, draws, sexp, div, bad, amax, cols, piece, n, out, counts, sums,
    q, ends, start, stop)``: pieces ``start..stop`` of ``piece`` elements of a flat slice
    whose scale groups are runs of ``cols`` elements, each cast under its group's scale
    (``sexp``: the exponent of a power of two; else ``div``, the divisor) and counted into the
    piece's row of ``counts`` (:data:`N_COUNTS`) and ``sums`` (:data:`N_SUMS`).

    ``amax`` is each group's largest finite magnitude: a group whose amax cannot clip is not
    compared element by element. A ``bad`` group (a block holding NaN or inf) is NaN whole.
    ``ends`` holds the element format's max, min and smallest normal. Without ``rounded``
    only clipping is counted; with ``want_q`` the cast values go to ``out``. ``draws`` (SR's
    random bits) is empty for every other rounding.

    The rounding mode and overflow policy are this kernel's ``rounding`` and ``overflow``
    (constants, as in the element kernels of :mod:`driftcli.kernels.jitcode`), and each group
    is rounded in a loop of its own into a scratch row before it is counted: the rounding then
    compiles to vector code, as the casts' does. A scan meets few modes, so few variants.
    """

    @njit(**OPTIONS)
    def kernel(bits: Any, values: Any, draws: Any, sexp: Any, div: Any, bad: Any, amax: Any,
               cols: int, piece: int, n: int, out: Any, counts: Any, sums: Any, q: Any,
               ends: Any, start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        lean = values.itemsize == 4  # float32: the lean rounding
        has_draws = draws.size > 0
        cast = np.empty(piece, dtype=np.float64)  # a group's cast values
        subs = np.empty(piece, dtype=np.bool_)  # and which of them are subnormal
        e_max, e_min, e_small = ends[0], ends[1], ends[2]
        lim = row_limits(0, p)
        d = div[0]
        hi, low, small, limit = e_max, e_min, e_small, e_max
        for pc in range(start, stop):
            a = pc * piece
            b = min(a + piece, n)
            clipped = clipped_groups = nonzero = under = sub = lost = 0
            excess = xx = ee = ex = es = 0.0
            ex_c = es_c = 0.0  # compensations of the two signed sums (Neumaier)
            i = a
            while i < b:  # group by group: the clips, and the rounding into cast[]
                g = i // cols
                end = min((g + 1) * cols, b)
                xs, vs = bits[i:end], values[i:end]
                qs, ss = cast[i - a:end - a], subs[i - a:end - a]
                if has_bad and bad[g]:
                    if rounded:  # lost whole: counted as lost below
                        qs[:] = np.nan
                        ss[:] = False
                    i = end
                    continue
                top = amax[g]
                if pow2:
                    k = sexp[g]
                    hi = np.ldexp(e_max, k)
                    low = np.ldexp(e_min, k)
                    small = np.ldexp(e_small, k)
                    limit = hi
                    may_clip = top > hi or -top < low
                    if rounded:
                        lim = row_limits(k, p)
                else:
                    d = div[g]
                    limit = np.float64(d) * e_max
                    may_clip = top / d > e_max or -top / d < e_min
                before = clipped
                if may_clip:
                    for j in range(vs.size):
                        v = np.float64(vs[j])
                        y = v if pow2 else vs[j] / d
                        if np.isfinite(v) and (y > (hi if pow2 else e_max) or
                                               y < (low if pow2 else e_min)):
                            clipped += 1
                            excess += abs(v) - limit
                clipped_groups += int(clipped > before)
                if rounded:
                    ds = draws[i:end] if has_draws else draws
                    if pow2:  # the value, rounded on the grid scaled by the group's 2**k
                        for j in range(vs.size):
                            r = ds[j] if has_draws else 0
                            if lean:
                                qv = np.float64(np.int32(round_lean(xs[j], r, lim, p)).view(
                                    np.float32))
                            else:
                                qv = np.int64(round_one(xs[j], 0, False, r, lim, p)).view(
                                    np.float64)
                            qs[j] = qv
                            ss[j] = qv != 0 and abs(qv) < small
                    else:  # the quotient rounded, then multiplied back
                        for j in range(vs.size):
                            r = ds[j] if has_draws else 0
                            y = vs[j] / d
                            code = lean_quotient(y, r, lim, p) if lean else \
                                wide_quotient(y, r, lim, p)
                            # the value a float32 cast returns is the product rounded to float32
                            qs[j] = np.float64(np.float32(code * d)) if lean else \
                                np.float64(code * d)
                            ss[j] = code != 0 and abs(code) < e_small
                i = end
            if rounded:  # the whole piece at once: its counts and sums
                m = b - a
                vs, qs, ss = values[a:b], cast[:m], subs[:m]
                if want_q:
                    out[a:b] = qs
                for j in range(m):
                    v = np.float64(vs[j])
                    qv = qs[j]
                    fin_q = np.isfinite(qv)
                    if np.isfinite(v):
                        nonzero += int(v != 0)
                        if fin_q:
                            under += int(v != 0 and qv == 0)
                            e = qv - v
                            xx += v * v
                            ee += e * e
                            ex, ex_c = _add(ex, ex_c, e * v)
                            es, es_c = _add(es, es_c, e)
                        else:
                            lost += 1
                    sub += int(ss[j] and fin_q)
            counts[pc, 0] = clipped
            counts[pc, 1] = clipped_groups
            counts[pc, 2] = nonzero
            counts[pc, 3] = under
            counts[pc, 4] = sub
            counts[pc, 5] = lost
            sums[pc, 0] = excess
            sums[pc, 1] = xx
            sums[pc, 2] = ee
            sums[pc, 3] = ex + ex_c
            sums[pc, 4] = es + es_c

    return kernel


@njit(**OPTIONS)
def add_pieces(counts: Any, sums: Any, finite: Any, abs_sum: Any) -> tuple[Any, Any]:
    """Every piece's counts and sums added in piece order (the same total whatever threads
    made the pieces); ``finite`` and ``abs_sum`` (per piece, may be empty) likewise, as two
    more columns."""
    c_out = np.zeros(counts.shape[1] + 1, dtype=np.int64)
    s_out = np.zeros(sums.shape[1] + 1, dtype=np.float64)
    comp = np.zeros(sums.shape[1] + 1, dtype=np.float64)
    for pc in range(counts.shape[0]):
        for k in range(counts.shape[1]):
            c_out[k] += counts[pc, k]
        for k in range(sums.shape[1]):
            s_out[k], comp[k] = _add(s_out[k], comp[k], sums[pc, k])
    last = sums.shape[1]
    for pc in range(finite.size):
        c_out[counts.shape[1]] += finite[pc]
        s_out[last], comp[last] = _add(s_out[last], comp[last], abs_sum[pc])
    return c_out, s_out + comp
