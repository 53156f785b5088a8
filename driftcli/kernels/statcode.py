"""The numba code of the scan's fused passes (imported on first use: importing it imports numba).

:func:`facts_kernel` reads a slice once for what every cast of it shares: the raw amax of
each run of consecutive elements and, per piece, the finite count and Σ|x|.
:func:`counts_kernel` casts every element of a slice under its group's scale and counts,
in the same loop, everything :class:`driftcli.measures.stats.CastStats` holds: clips and
their excess, nonzero, underflowed, subnormal and lost elements, and the float64 error sums.
The element rounding is :func:`driftcli.kernels.jitcode.round_one` / ``round_lean``, the very
code :func:`driftcli.quantize` runs on numba, so a count here is the count of its cast.

:func:`clips_kernel` is the scan's fused pass: one read of a slice for every cast of a scan
(the routes of :mod:`driftcli.casts.route`), each cast's block scales and clips counted from the
runs' amaxes it read; for underflow-rate and error-bias each piece is also rounded once per
cast into a scratch row of L1 by the same element kernels and counted there
(:func:`_rounded_counts`). :func:`counts_kernel` still counts the casts that pass does not take.

Every sum is made per piece of a fixed number of elements. :func:`counts_kernel`'s pieces are
added in order afterwards; :func:`clips_kernel`'s are added exactly (:func:`expansions`), so its
sums depend only on each piece's content: not on the threads that ran the pieces, nor, where a
scan's slices start on piece boundaries, on where it cut the tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit

# at module level, not in clips_kernel: a closure's captured names are part of numba's cache
# key, and a captured dispatcher pickles differently in every process (a compile each time)
from driftcli.kernels.castcode import pow2_exponent, two_level_divisors, two_level_tensor_scale
from driftcli.kernels.jitcode import (
    OPTIONS,
    lean_quotient,
    nearest_fits,
    nearest_quotient,
    round_lean,
    round_nearest,
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


# --- every cast's clips in one pass (the plans of driftcli.casts.route) ---------------------

STEPS = ("tensor-divisor", "tensor-pow2", "block-pow2", "two-level")
"""The scale steps :func:`clips_kernel` takes, by code (the values of
:class:`driftcli.casts.route.ScaleStep`): one divisor for the slice, one power of two for it,
a power-of-two rule's scale per block, a two-level (NVFP4) scale per block."""
TENSOR_DIV, TENSOR_POW2, BLOCK_POW2, TWO_LEVEL = range(len(STEPS))
N_CLIPS = 4
"""Columns of a piece's counts per cast: clipped, groups with a clip, clamped scales,
groups holding NaN or inf."""
INF32 = 0x7F800000


@njit(fastmath={"reassoc"}, **OPTIONS)
def finite_abs_sum(xs: Any, vs: Any) -> tuple[int, float]:
    """The finite elements of a piece (``xs`` its int32 view, ``vs`` its float32 values) and
    their Σ|x| in float64, in the vector lanes the compiler chooses (reassociated: fixed by
    this machine code, so the same bits for any thread count)."""
    count = 0
    total = 0.0
    for i in range(xs.size):
        ok = (xs[i] & 0x7FFFFFFF) < INF32
        count += int(ok)
        total += np.float64(abs(vs[i])) if ok else 0.0
    return count, total


@njit(**OPTIONS)
def top_kernel(bits: Any, n: int, piece: int, tops: Any, start: int, stop: int) -> None:
    """Pieces ``start..stop`` of a float32 slice's int32 view: each piece's largest finite
    magnitude, as bits (the first read of the casts that need the tensor's amax)."""
    for pc in range(start, stop):
        xs = bits[pc * piece:min((pc + 1) * piece, n)]
        top = 0
        for i in range(xs.size):  # branch-free, so that it vectorizes
            u = xs[i] & 0x7FFFFFFF
            top = max(top, u if u < INF32 else 0)
        tops[pc] = top


@njit(fastmath={"reassoc"}, **OPTIONS)
def _clips(vs: Any, size: int, groups: Any, his: Any, lows: Any, divs: Any, n: int,
           pow2: bool) -> tuple[int, int, float]:
    """The clips of ``n`` groups of ``size`` elements of a piece ``vs``: group ``groups[i]``
    compared with ``his[i]`` and ``lows[i]`` (``pow2``: the element format's ends times the
    group's power of two), else its quotient by ``divs[i]`` (one operation in the elements'
    float type) with ``his[0]`` and ``lows[0]`` (the format's ends). The finite elements
    beyond, the groups holding one, and their Σ(|x| - the scaled max) in float64, in the
    vector lanes the compiler chooses (this machine code's fixed order)."""
    hits = 0
    groups_hit = 0
    total = 0.0
    for i in range(n):
        xs = vs[groups[i] * size:(groups[i] + 1) * size]
        count = 0
        part = 0.0
        if pow2:
            hi, low = his[i], lows[i]
            for j in range(xs.size):
                v = np.float64(xs[j])
                hit = (v > hi or v < low) and abs(v) < np.inf
                count += int(hit)
                part += abs(v) - hi if hit else 0.0
        else:
            d = divs[i]
            hi, low = his[0], lows[0]
            limit = np.float64(d) * hi
            for j in range(xs.size):
                y = np.float64(xs[j] / d)
                hit = (y > hi or y < low) and abs(xs[j]) < np.inf
                count += int(hit)
                part += abs(np.float64(xs[j])) - limit if hit else 0.0
        hits += count
        groups_hit += int(count > 0)
        total += part
    return hits, groups_hit, total


@njit(inline="always", **OPTIONS)
def _pow2(k: int) -> float:
    """``2.0**k`` for a normal float64 exponent, from its bits (no call into libm)."""
    return np.int64((k + 1023) << 52).view(np.float64)


@njit(**OPTIONS)
def _threshold(pow2: bool, hi: float, low: float, d: Any, e_max: float, e_min: float) -> int:
    """The smallest float32 magnitude bits whose value may clip under one scale (``pow2``:
    above ``hi`` or, negated, below ``low``; else its float64 quotient by ``d`` above
    ``e_max`` or, negated, below ``e_min``: the test :func:`counts_kernel` makes of a group's
    amax); :data:`INF32` where none does. The test is monotone in the magnitude: a binary
    search."""
    lo_bits, hi_bits = 0, INF32
    while lo_bits < hi_bits:
        mid = (lo_bits + hi_bits) // 2
        top = np.float64(np.int32(mid).view(np.float32))
        may = (top > hi or -top < low) if pow2 else (top / d > e_max or -top / d < e_min)
        if may:
            hi_bits = mid
        else:
            lo_bits = mid + 1
    return lo_bits


N_ROUNDED = 5
"""Columns of a piece's rounded counts per cast: nonzero, underflowed, subnormal, lost, and
blocks whose power-of-two grid leaves float32's range (the cast is then counted elsewhere)."""
N_ROUNDED_SUMS = 4
"""Columns of a piece's rounded sums per cast: Σx², Σe², Σe·x, Σe."""
@njit(fastmath={"reassoc"}, **OPTIONS)
def _rounded_counts(vs: Any, qs: Any, subs: Any, acc: Any, c: int, out: Any) -> None:
    """Into ``out[0:4]`` the nonzero, underflowed, subnormal and lost elements of a piece's
    values ``vs`` (float32) rounded to ``qs`` (float64; ``subs`` which are subnormal), and into
    row ``c`` of
    ``acc`` Σx², Σe², Σe·x, Σe over the elements where both are finite, in float64 in the
    vector lanes the compiler chooses (reassociated: an order fixed by this machine code and
    the piece's length, so the same bits for any thread count; measured 3 to 7 times faster
    than lanes written out, which numba does not keep in registers)."""
    nonzero = under = sub = lost = 0
    xx = ee = ex = es = 0.0
    for j in range(vs.size):  # no branch on the data, so that it vectorizes
        v = np.float64(vs[j])
        qv = qs[j]
        fin_v = abs(v) < np.inf
        fin_q = abs(qv) < np.inf
        ok = fin_v and fin_q
        e = qv - v if ok else 0.0
        xv = v if ok else 0.0
        xx += xv * xv
        ee += e * e
        ex += e * xv
        es += e
        nonzero += int(fin_v and v != 0)
        under += int(ok and v != 0 and qv == 0)
        lost += int(fin_v and not fin_q)
        sub += int(subs[j] and fin_q)
    acc[c, 0] = xx
    acc[c, 1] = ee
    acc[c, 2] = ex
    acc[c, 3] = es
    out[0] = nonzero
    out[1] = under
    out[2] = sub
    out[3] = lost


@njit(inline="always", **OPTIONS)
def with_modes(q: Any, rounding: int, overflow: int) -> tuple[int, ...]:
    """A cast's rounding parameters ``q`` (an array of :data:`driftcli.kernels.jit.PARAMS`) as
    the tuple the rounding reads, with the kernel's constant ``rounding`` and ``overflow`` in
    their places, so that numba folds them."""
    return (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
            rounding, overflow, q[15], q[16], q[17])


@cache
def clips_kernel(run: int, q: tuple[int, ...], rounded: bool = False, rounding: int = 0,
                 overflow: int = 0) -> Callable[..., None]:
    """``kernel(bits, values, n, piece, kinds, blocks, blocked, rules, consts, ends, sexp,
    div, tensor_top, counts, excess, finite, abs_sum, start, stop)``: pieces ``start..stop``
    of ``piece`` elements of a flat float32 slice, read once for every cast of a scan.

    Per run of ``run`` elements (a divisor of every block), the largest finite magnitude and
    whether it holds NaN or inf; per piece the finite elements and Σ|x|
    (:func:`finite_abs_sum`). Then, per cast ``c`` of route ``kinds[c]`` over groups of
    ``blocks[c]`` elements (``run`` for a one-scale route: its groups are only the unit
    read at a time), the group's scale from those amaxes (:func:`~driftcli.kernels.castcode.
    pow2_exponent` under ``rules[c]``, :func:`~driftcli.kernels.castcode.two_level_divisors`
    under ``consts[c]`` and the scale rounding ``q`` (a constant of the kernel: one scale
    format per scan, and its rounding folds) with the tensor amax's float32 bits
    ``tensor_top``, else the slice's ``sexp[c]`` or ``div[c]``), and the group's elements
    compared with the format's ends ``ends[c]`` (:func:`_clips`) only where its amax may
    clip, by the test and in the types of :func:`counts_kernel`: the same counts. A
    ``blocked[c]`` group holding NaN or inf is NaN whole: counted, not compared.

    With ``rounded``, each cast then rounds the piece once, group by group into a scratch row
    of L1 (``round_lean`` under the cast's parameters ``ps[c]`` with this kernel's constant
    ``rounding`` and ``overflow``, on the grid scaled by the group's power of two, else its
    quotient by the divisor by ``lean_quotient``: the code and the steps of
    :func:`counts_kernel`, so the same values; ``draws[c]`` its stochastic draws; where the
    grid admits it, :func:`~driftcli.kernels.jitcode.nearest_fits`, by ``round_nearest``,
    ``round_lean``'s bits in float32 steps that vectorize), and counts
    the piece into ``rcounts`` (:data:`N_ROUNDED`) and ``rsums`` (:data:`N_ROUNDED_SUMS`,
    :func:`_rounded_counts`). ``wide[c]`` holds the element format's ``qmin`` and ``emax``: a
    block whose power-of-two grid leaves float32's range is counted in the last column."""
    p = q
    lim = (0, 0, 0, 0, 0)

    @njit(**OPTIONS)
    def kernel(bits: Any, values: Any, n: int, piece: int, kinds: Any, blocks: Any,
               blocked: Any, rules: Any, consts: Any, ends: Any, sexp: Any, div: Any,
               tensor_top: int, counts: Any, excess: Any, finite: Any, abs_sum: Any,
               ps: Any, draws: Any, wide: Any, rcounts: Any, rsums: Any,
               start: int, stop: int) -> None:
        n_runs = -(-piece // run)
        gdivs = np.empty(n_runs, dtype=np.float32)  # per group its divisor, kept
        cast = np.empty(piece, dtype=np.float64)  # a piece's rounded values
        subs = np.empty(piece, dtype=np.bool_)  # and which of them are subnormal
        dvs = np.empty(piece, dtype=np.float32)  # each element's divisor
        has_draws = draws.shape[1] > 0
        tops = np.empty(n_runs, dtype=np.int32)
        bads = np.empty(n_runs, dtype=np.bool_)
        found = np.empty(n_runs, dtype=np.int64)  # the groups that may clip, and their
        his = np.empty(n_runs, dtype=np.float64)  # scales
        lows = np.empty(n_runs, dtype=np.float64)
        divs = np.empty(n_runs, dtype=np.float32)
        gtops = np.empty(n_runs, dtype=np.int32)  # per group: its amax, NaN, scale, clamp
        gbads = np.empty(n_runs, dtype=np.bool_)
        ks = np.empty(n_runs, dtype=np.int64)
        moves = np.empty(n_runs, dtype=np.bool_)
        n_casts = kinds.size
        limits = np.empty(n_casts, dtype=np.int64)  # one-scale routes: from which amax
        for c in range(n_casts):
            k = sexp[c]
            limits[c] = _threshold(kinds[c] == TENSOR_POW2, ends[c, 0] * _pow2(k),
                                   ends[c, 1] * _pow2(k), div[c], ends[c, 0], ends[c, 1])
        two_lim = row_limits(0, p) if p[0] else lim
        for pc in range(start, stop):
            a = pc * piece
            b = min(a + piece, n)
            m = -(-(b - a) // run)
            full = (b - a) // run
            xs = bits[a:b]  # indexed from 0: offsets the compiler cannot prove positive
            vs = values[a:b]  # would not vectorize (numba wraps negative indices)
            piece_top = 0
            for r in range(full):
                top = 0
                worst = 0
                for i in range(run):  # whole runs: a loop of constant length
                    u = xs[r * run + i] & 0x7FFFFFFF
                    worst = max(worst, u)
                    top = max(top, u if u < INF32 else 0)
                tops[r] = top
                bads[r] = worst >= INF32
                piece_top = max(piece_top, top)
            if full < m:  # a tensor scale's last run, cut short
                top = 0
                worst = 0
                for i in range(full * run, b - a):
                    u = xs[i] & 0x7FFFFFFF
                    worst = max(worst, u)
                    top = max(top, u if u < INF32 else 0)
                tops[full] = top
                bads[full] = worst >= INF32
                piece_top = max(piece_top, top)
            finite[pc], abs_sum[pc] = finite_abs_sum(xs, vs)
            for c in range(n_casts):
                kind = kinds[c]
                per = blocks[c] // run
                e_max, e_min = ends[c, 0], ends[c, 1]
                pow2 = kind in (TENSOR_POW2, BLOCK_POW2)
                n_found = clamped = n_bad = 0
                if kind in (TENSOR_POW2, TENSOR_DIV):  # one scale: only amaxes past it
                    if piece_top >= limits[c]:
                        scale = _pow2(sexp[c])
                        for r in range(m):
                            if tops[r] >= limits[c]:
                                found[n_found] = r
                                his[n_found] = e_max * scale
                                lows[n_found] = e_min * scale
                                divs[n_found] = div[c]
                                n_found += 1
                else:  # a scale per block, from its runs' amaxes
                    n_groups = m // per
                    for g in range(n_groups):  # branch-free loops, so that they vectorize
                        top = 0
                        bad = False
                        for r in range(g * per, (g + 1) * per):
                            top = max(top, tops[r])
                            bad = bad or bads[r]
                        gtops[g] = top
                        gbads[g] = bad and blocked[c]
                    if kind == TWO_LEVEL:
                        cc = consts[c]
                        scale_t = two_level_tensor_scale(tensor_top, cc)
                        two_level_divisors(gtops, n_groups, scale_t, cc, two_lim, p, gdivs, moves)
                    else:
                        for g in range(n_groups):
                            ks[g], moves[g] = pow2_exponent(gtops[g], rules[c])
                    for g in range(n_groups):
                        if gbads[g]:
                            n_bad += 1
                            continue
                        clamped += int(moves[g])
                        top64 = np.float64(np.int32(gtops[g]).view(np.float32))
                        if kind == BLOCK_POW2:
                            hi = e_max * _pow2(ks[g])
                            low = e_min * _pow2(ks[g])
                            may_clip = top64 > hi or -top64 < low
                        else:
                            d = gdivs[g]
                            hi, low = e_max, e_min
                            divs[n_found] = d
                            may_clip = top64 / d > e_max or -top64 / d < e_min
                        if may_clip:
                            found[n_found] = g
                            his[n_found] = hi
                            lows[n_found] = low
                            n_found += 1
                hits, groups_hit, total = _clips(vs, per * run, found, his, lows, divs,
                                                 n_found, pow2) if n_found else (0, 0, 0.0)
                counts[pc, c, 0] = hits
                counts[pc, c, 1] = groups_hit
                counts[pc, c, 2] = clamped
                counts[pc, c, 3] = n_bad
                excess[pc, c] = total
                if not rounded:
                    continue
                pr = with_modes(ps[c], rounding, overflow)
                size = b - a if kind in (TENSOR_POW2, TENSOR_DIV) else per * run
                n_groups = -(-(b - a) // size)
                n_out = 0
                ds = draws[c, a:b] if has_draws else draws[c, 0:0]
                if pow2:  # group by group, into cast[]: the grid scaled by its 2**k
                    for g in range(n_groups):
                        lo_j = g * size
                        hi_j = min(lo_j + size, b - a)
                        gx, qs, ss = xs[lo_j:hi_j], cast[lo_j:hi_j], subs[lo_j:hi_j]
                        gd = ds[lo_j:hi_j] if has_draws else ds
                        k = sexp[c] if kind == TENSOR_POW2 else ks[g]
                        if kind == BLOCK_POW2 and ((gtops[g] != 0 and k + wide[c, 0] < -149)
                                                   or k + wide[c, 1] >= 128):
                            n_out += 1
                        rlim = row_limits(k, pr)
                        small = ends[c, 2] * _pow2(k)
                        if nearest_fits(rlim, pr):  # a loop of either: each vectorizes
                            for j in range(gx.size):
                                qv = np.float64(np.int32(round_nearest(gx[j], rlim, pr)).view(
                                    np.float32))
                                qs[j] = qv
                                ss[j] = qv != 0 and abs(qv) < small
                        else:
                            for j in range(gx.size):
                                r = gd[j] if has_draws else 0
                                qv = np.float64(np.int32(round_lean(gx[j], r, rlim, pr)).view(
                                    np.float32))
                                qs[j] = qv
                                ss[j] = qv != 0 and abs(qv) < small
                else:  # the quotients by each element's divisor rounded, multiplied back
                    if kind == TENSOR_DIV:
                        dvs[:b - a] = div[c]
                    else:
                        for g in range(n_groups):
                            dvs[g * size:min((g + 1) * size, b - a)] = gdivs[g]
                    rlim = row_limits(0, pr)
                    e_small = ends[c, 2]
                    if nearest_fits(rlim, pr):
                        for j in range(b - a):
                            d = dvs[j]
                            code = nearest_quotient(vs[j] / d, rlim, pr)
                            cast[j] = np.float64(np.float32(code * d))
                            subs[j] = code != 0 and abs(code) < e_small
                    else:
                        for j in range(b - a):
                            r = ds[j] if has_draws else 0
                            d = dvs[j]
                            code = lean_quotient(vs[j] / d, r, rlim, pr)
                            # a float32 cast returns the product rounded to float32
                            cast[j] = np.float64(np.float32(code * d))
                            subs[j] = code != 0 and abs(code) < e_small
                if kind not in (TENSOR_POW2, TENSOR_DIV):
                    for g in range(n_groups):
                        if gbads[g]:  # lost whole
                            cast[g * size:(g + 1) * size] = np.nan
                            subs[g * size:(g + 1) * size] = False
                m_ = b - a
                _rounded_counts(vs, cast[:m_], subs[:m_], rsums[pc], c, rcounts[pc, c])
                rcounts[pc, c, 4] = n_out

    return kernel


@njit(**OPTIONS)
def expansions(terms: Any) -> tuple[Any, Any]:
    """Per column of ``terms`` (the pieces' float64 partials, one row a piece), their exact sum
    as an expansion: non-overlapping float64 partials, smallest first, whose exact sum is the
    column's (Shewchuk's algorithm, the partials ``math.fsum`` keeps: no rounding is lost, so
    the sum does not depend on the pieces' order nor on how they are grouped into slices).
    Row ``k`` of the first array holds column ``k``'s partials, the second array how many.
    A column holding an inf or NaN is its plain sum, one partial: non-finite whatever the
    order (the error-free steps would make NaN of two infinities of one sign).
    Compiled without ``fastmath``: every step here is an exact error-free transformation."""
    n, k = terms.shape
    parts = np.zeros((k, n + 1), dtype=np.float64)
    lens = np.zeros(k, dtype=np.int64)
    for c in range(k):
        plain = 0.0
        finite = True
        for pc in range(n):
            plain += terms[pc, c]
            finite = finite and abs(terms[pc, c]) < np.inf
        if not finite:
            parts[c, 0] = plain
            lens[c] = 1
            continue
        m = 0
        for pc in range(n):
            x = terms[pc, c]
            i = 0
            for j in range(m):
                y = parts[c, j]
                if abs(x) < abs(y):
                    x, y = y, x
                hi = x + y
                lo = y - (hi - x)
                if lo != 0.0:
                    parts[c, i] = lo
                    i += 1
                x = hi
            parts[c, i] = x
            m = i + 1
        lens[c] = m
    return parts, lens


# --- the casts whose operands are given (driftcli.casts.given) -------------------------------

NAN_Q, NO_CLIP = 1, 2
"""A given cast's group flags: its values are NaN whole (a block holding NaN or inf under a
policy that poisons it), and its clips are not counted (the same blocks, where the cast's
masks leave them out)."""


@njit(fastmath={"reassoc"}, **OPTIONS)
def _given_clips(vs: Any, ys: Any, fls: Any, lims: Any, e_max: float,
                 e_min: float) -> tuple[int, float]:
    """The clips of a piece's float32 elements ``vs`` whose quotients are ``ys`` (float64):
    the finite ones beyond the ends ``e_max``, ``e_min`` outside groups flagged
    :data:`NO_CLIP` (``fls``), and their Σ(|x| - e_max · scale) with each element's group
    scale ``lims``, in float64 in the vector lanes the compiler chooses (an order fixed by this
    machine code and the piece's length: :func:`_clips`' way)."""
    count = 0
    total = 0.0
    for j in range(vs.size):  # no branch on the data, so that it vectorizes
        v = np.float64(vs[j])
        y = ys[j]
        hit = (fls[j] & NO_CLIP) == 0 and abs(v) < np.inf and (y > e_max or y < e_min)
        count += int(hit)
        total += abs(v) - e_max * lims[j] if hit else 0.0
    return count, total


@cache
def given_kernel(rounded: bool, rounding: int = 0, overflow: int = 0) -> Callable[..., None]:
    """``kernel(bits, values, n, piece, wides, muls, divs, subs, grps, offs, goffs, ins, outs,
    lims, flags, ends, ps, draws, counts, excess, hits, finite, abs_sum, rcounts, rsums, start,
    stop)``: pieces ``start..stop`` of ``piece`` elements of a flat float32 slice, read once
    for every cast whose operands a scale step made beforehand (:mod:`driftcli.casts.given`).

    Cast ``c``'s element ``i`` meets the operands of its run ``offs[c] + i // subs[c]``, in
    its group ``goffs[c] + i // grps[c]`` (``subs[c]`` divides ``grps[c]``; both the slice's
    length for one scale), laid out per element for the piece first: a scale arithmetic's
    (``wides[c]`` false) as :func:`driftcli.kernels.jitcode.scaled_kernel` does,
    ``y = fl32(x / a)`` (``muls[c]``: ``x · a``), the code ``lean_quotient(y)``, the value
    ``fl32(code · u)`` (``divs[c]``:
    ``code / u``), ``a`` and ``u`` the float32 operands ``ins`` and ``outs``; micro-exponents'
    (``wides[c]``) as :func:`driftcli.kernels.microcode.cast_kernel` does, ``y = x · in``
    in float64 (exact: ``in`` is ``r / 2**E``), the code ``round_one`` of it, the value
    ``fl32(code · out)`` (``out = 2**E · s``). ``y`` beyond the element format's ends
    ``ends[c]`` is a clip of a finite ``x`` (its excess ``|x| - max · lims[g]``, the group's
    reported scale, and ``hits[g]`` set), unless the group's ``flags`` hold :data:`NO_CLIP`;
    a group holding :data:`NAN_Q` is NaN whole. With ``rounded``, each piece's values are
    counted as :func:`clips_kernel` counts them (:func:`_rounded_counts`), under ``ps[c]``
    with this kernel's constant ``rounding`` and ``overflow`` and the draws ``draws[c]``."""

    @njit(**OPTIONS)
    def kernel(bits: Any, values: Any, n: int, piece: int, wides: Any, muls: Any, divs: Any,
               subs: Any, grps: Any, offs: Any, goffs: Any, ins: Any, outs: Any, lims: Any,
               flags: Any, ends: Any, ps: Any, draws: Any, counts: Any, excess: Any, hits: Any,
               finite: Any, abs_sum: Any, rcounts: Any, rsums: Any, start: int,
               stop: int) -> None:
        cast = np.empty(piece, dtype=np.float64)  # a piece's rounded values
        subn = np.empty(piece, dtype=np.bool_)  # and which of them are subnormal
        ys = np.empty(piece, dtype=np.float64)  # each element's quotient (exact in float64)
        ain = np.empty(piece, dtype=np.float64)  # and its operands, group flags and scale,
        aout = np.empty(piece, dtype=np.float64)  # laid out run by run first: the element
        fls = np.empty(piece, dtype=np.uint8)  # loops then read arrays, not indices
        lim_e = np.empty(piece, dtype=np.float64)
        has_draws = draws.shape[1] > 0
        for pc in range(start, stop):
            a = pc * piece
            b = min(a + piece, n)
            m = b - a
            xs = bits[a:b]
            vs = values[a:b]
            finite[pc], abs_sum[pc] = finite_abs_sum(xs, vs)
            for c in range(wides.size):
                e_max, e_min, e_small = ends[c, 0], ends[c, 1], ends[c, 2]
                sub, grp, off, goff = subs[c], grps[c], offs[c], goffs[c]
                for r in range(a // sub, (b - 1) // sub + 1):
                    av, ov = ins[off + r], outs[off + r]
                    for j in range(max(r * sub - a, 0), min((r + 1) * sub - a, m)):
                        ain[j] = av
                        aout[j] = ov
                for g in range(a // grp, (b - 1) // grp + 1):
                    fv, lv = flags[goff + g], lims[goff + g]
                    for j in range(max(g * grp - a, 0), min((g + 1) * grp - a, m)):
                        fls[j] = fv
                        lim_e[j] = lv
                if wides[c]:
                    for j in range(m):
                        ys[j] = np.float64(vs[j]) * ain[j]
                elif muls[c]:
                    for j in range(m):
                        ys[j] = np.float64(vs[j] * np.float32(ain[j]))
                else:
                    for j in range(m):
                        ys[j] = np.float64(vs[j] / np.float32(ain[j]))
                clipped, total = _given_clips(vs, ys[:m], fls[:m], lim_e[:m], e_max, e_min)
                if clipped:  # the groups holding a clip (few): flagged
                    for j in range(m):
                        y = ys[j]
                        if (fls[j] & NO_CLIP) == 0 and abs(vs[j]) < np.inf and (
                                y > e_max or y < e_min):
                            hits[goff + (a + j) // grp] = True
                counts[pc, c] = clipped
                excess[pc, c] = total
                if not rounded:
                    continue
                pr = with_modes(ps[c], rounding, overflow)
                lim = row_limits(0, pr)
                if wides[c]:
                    for j in range(m):
                        r = draws[c, a + j] if has_draws else 0
                        code = wide_quotient(ys[j], r, lim, pr)
                        cast[j] = np.float64(np.float32(code * aout[j]))
                        subn[j] = code != 0 and abs(code) < e_small
                elif divs[c]:
                    for j in range(m):
                        r = draws[c, a + j] if has_draws else 0
                        code32 = lean_quotient(ys[j], r, lim, pr)
                        cast[j] = np.float64(code32 / np.float32(aout[j]))
                        subn[j] = code32 != 0 and abs(code32) < e_small
                else:
                    for j in range(m):
                        r = draws[c, a + j] if has_draws else 0
                        code32 = lean_quotient(ys[j], r, lim, pr)
                        cast[j] = np.float64(code32 * np.float32(aout[j]))
                        subn[j] = code32 != 0 and abs(code32) < e_small
                for j in range(m):  # a group NaN whole
                    if fls[j] & NAN_Q:
                        cast[j] = np.nan
                        subn[j] = False
                _rounded_counts(vs, cast[:m], subn[:m], rsums[pc], c, rcounts[pc, c])

    return kernel
