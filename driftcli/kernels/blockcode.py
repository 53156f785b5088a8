"""The numba code of block-stats' pass (imported on first use: importing it imports numba).

:func:`range_kernel` reads each scale group once for what block-stats needs of it: the largest
and the smallest nonzero finite magnitude, the binades between them, and whether it holds a
NaN or inf. :func:`column_range_kernel` does the same for groups that run down the columns of
a row-major matrix (the transpose a weight-gradient matmul reads), without copying it.
Magnitudes are compared as the bits of ``|x|`` (for non-negative floats the bit order is the
value order) and binades read from the exponent field, so nothing is rounded; the torch twin
is :func:`driftcli.casts.route.block_ranges`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

from driftcli.kernels.jitcode import OPTIONS


@njit(**OPTIONS)
def binade(m: int, mbits: int, bias: int) -> int:
    """``floor(log2 v)`` of the positive finite float whose bits are ``m``: its exponent field
    less the bias, or for a subnormal, its significand's top bit less ``bias + mbits - 1``."""
    field = m >> mbits
    if field:
        return field - bias
    top = -1
    while m:
        m >>= 1
        top += 1
    return top - bias - mbits + 1


@njit(**OPTIONS)
def _close(r: int, hi: int, lo: int, nonfinite: bool, inf_bits: int, mbits: int, bias: int,
           top: Any, low: Any, span: Any, bad: Any) -> None:
    top[r] = hi
    low[r] = lo
    bad[r] = nonfinite
    span[r] = binade(hi, mbits, bias) - binade(lo, mbits, bias) if lo < inf_bits else -1


@njit(**OPTIONS)
def range_kernel(bits: Any, cols: int, mask: int, inf_bits: int, mbits: int, bias: int,
                 top: Any, low: Any, span: Any, bad: Any, start: int, stop: int) -> None:
    """Rows ``start..stop`` of a row-major ``(rows, cols)`` block layout (its float bits):
    per row the largest finite ``bits & mask`` (0 for none), the smallest nonzero finite one
    (``inf_bits`` for none), the binades from that one to the largest (-1 for none) and
    whether the row holds a NaN or inf."""
    for r in range(start, stop):
        xs = bits[r * cols:(r + 1) * cols]
        hi = 0
        lo = inf_bits
        nonfinite = False
        for i in range(xs.size):  # without branches: the loop runs in vector lanes
            m = xs[i] & mask
            finite = m < inf_bits
            nonfinite |= not finite
            hi = max(hi, m if finite else 0)
            lo = min(lo, m if finite & (m != 0) else inf_bits)
        _close(r, hi, lo, nonfinite, inf_bits, mbits, bias, top, low, span, bad)


@njit(**OPTIONS)
def column_range_kernel(bits: Any, rows: int, cols: int, k: int, mask: int, inf_bits: int,
                        mbits: int, bias: int, top: Any, low: Any, span: Any, bad: Any,
                        start: int, stop: int) -> None:
    """Bands ``start..stop`` of ``k`` rows of a row-major ``(rows, cols)`` matrix: per column
    j and band b, what :func:`range_kernel` gives the group of the band's elements of column
    j, at ``j * bands + b`` (the order of the transpose's blocks). The band is read row by
    row, in memory order, into one accumulator per column."""
    bands = (rows + k - 1) // k
    his = bits[:cols].copy()
    los = bits[:cols].copy()
    nfs = bits[:cols].copy()
    for b in range(start, stop):
        for j in range(cols):
            his[j] = 0
            los[j] = inf_bits
            nfs[j] = 0
        for i in range(b * k, min((b + 1) * k, rows)):
            xs = bits[i * cols:(i + 1) * cols]
            for j in range(cols):  # without branches, as in range_kernel
                m = xs[j] & mask
                finite = m < inf_bits
                nfs[j] |= not finite
                his[j] = max(his[j], m if finite else 0)
                los[j] = min(los[j], m if finite & (m != 0) else inf_bits)
        for j in range(cols):
            _close(j * bands + b, his[j], los[j], nfs[j] != 0, inf_bits, mbits, bias, top, low,
                   span, bad)


@njit(**OPTIONS)
def merge_range_kernel(top: Any, low: Any, bad: Any, bands: int, f: int, inf_bits: int,
                       mbits: int, bias: int, otop: Any, olow: Any, ospan: Any, obad: Any,
                       start: int, stop: int) -> None:
    """Lines ``start..stop`` of groups laid out ``(lines, bands)`` (the bits of their largest
    and smallest nonzero finite magnitudes, ``top`` and ``low``, and NaN/inf flags ``bad``, as
    :func:`range_kernel` gives them): per line, what :func:`range_kernel` gives each run of
    ``f`` consecutive groups (the last run shorter where ``f`` does not divide ``bands``):
    the facts of groups ``f`` times as long, without reading the elements again. Zero padding
    of a partial group changes neither magnitude, so the runs are exactly the longer
    groups."""
    out = (bands + f - 1) // f
    for line in range(start, stop):
        for b in range(out):
            hi = 0
            lo = inf_bits
            nonfinite = False
            for i in range(line * bands + b * f, line * bands + min((b + 1) * f, bands)):
                hi = max(hi, top[i])
                lo = min(lo, low[i])
                nonfinite |= bad[i]
            _close(line * out + b, hi, lo, nonfinite, inf_bits, mbits, bias, otop, olow, ospan,
                   obad)


@njit(**OPTIONS)
def summary_kernel(top: Any, span: Any, bad: Any, poison: bool, scale: Any, clipped: Any,
                   ends: Any, elem_span: int, ranges: Any, out: Any, extremes: Any) -> None:
    """One pass over the groups' facts (their amax ``top``, binades ``span``, NaN/inf flag
    ``bad``, scale and clip flag): the counts of :func:`driftcli.measures.block_stats.
    block_summary` into ``out`` (live, zero, nonfinite, clipped, scale at max, subnormal
    scale, scale at min, range over span, largest range), the live scales' extremes into
    ``extremes`` and the live ranges' histogram into ``ranges``. ``ends`` are the scale
    format's max, smallest normal (0 where it has no subnormals) and smallest value; with
    ``poison``, a group holding NaN or inf is not finite (a block scaling makes it NaN)."""
    lo = np.inf
    hi = 0.0
    for i in range(top.size):
        if bad[i]:
            out[2] += 1
        if poison and bad[i]:
            continue
        if clipped[i]:
            out[3] += 1
        if top[i] == 0:
            out[1] += 1
            continue
        out[0] += 1
        s = scale[i]
        out[4] += s == ends[0]
        out[5] += s < ends[1]
        out[6] += s == ends[2]
        lo = min(lo, s)
        hi = max(hi, s)
        r = span[i]
        out[7] += r > elem_span
        out[8] = max(out[8], r)
        ranges[r] += 1
    extremes[0] = lo
    extremes[1] = hi


@njit(**OPTIONS)
def key_counts_kernel(keys: Any, finite: Any) -> tuple[Any, Any]:
    """How many of the ``finite`` groups hold each key: the smallest such key and the counts
    from it up to the largest (an empty count array for none). torch's ``bincount`` on a
    shared CPU costs tens of milliseconds per call where this one pass costs well under one."""
    low = np.int64(0)
    high = np.int64(-1)
    seen = False
    for i in range(keys.size):
        if finite[i]:
            k = keys[i]
            if not seen:
                low = k
                high = k
                seen = True
            else:
                low = min(low, k)
                high = max(high, k)
    counts = np.zeros(high - low + 1 if seen else 0, dtype=np.int64)
    for i in range(keys.size):
        if finite[i]:
            counts[keys[i] - low] += 1
    return low, counts


@njit(**OPTIONS)
def fused_summary_kernel(top: Any, span: Any, bad: Any, poison: bool, ks: Any, values: Any,
                         divisors: Any, vbits: Any, big: float, shift: int, klow: int,
                         kcounts: Any, ends: Any, elem_span: int, ranges: Any, out: Any,
                         extremes: Any) -> None:
    """:func:`summary_kernel` with the scale's value, the clip flag and the scale-code
    histogram computed in the same pass from what the scale kernels give: for a power-of-two
    scale (``ks`` not empty) its exponent ``k`` (the value ``2**k``; a group clips where its
    float32 amax ``top`` is above ``big * 2**k``, exact in float64; the key is ``k``), else
    the scale's float64 value in ``values``, the float32 divisor the cast divides by (a group
    clips where ``fl32(top / divisor)`` is above ``big``) and the scale's float32 bits in
    ``vbits`` (the key is ``vbits >> shift``). The finite groups' keys are counted in
    ``kcounts`` from ``klow``; a key outside it sets ``out[9]`` (the caller then takes the
    unfused path)."""
    pow2 = ks.size > 0
    # 2**k and big * 2**k of each counted key: one rounding each, as ldexp's (a key outside
    # the counted range voids the pass, so no other k is needed)
    n_keys = kcounts.size if pow2 else 0
    powers = np.empty(n_keys, dtype=np.float64)
    limits = np.empty(n_keys, dtype=np.float64)
    for j in range(n_keys):
        powers[j] = math.ldexp(1.0, klow + j)
        limits[j] = math.ldexp(big, klow + j)
    # the counts in locals, not in ``out``: stores to an array the histograms may alias would
    # be kept in memory on every group
    live = zero = nonfinite = clipped = at_max = n_sub = at_min = over = widest = missed = 0
    lo = np.inf
    hi = 0.0
    top_s, normal, bottom = ends[0], ends[1], ends[2]
    for i in range(top.size):
        if bad[i]:
            nonfinite += 1
            if poison:
                continue
        key = ks[i] - klow if pow2 else (vbits[i] >> shift) - klow
        if key < 0 or key >= kcounts.size:
            missed = 1
            continue
        kcounts[key] += 1
        if pow2:
            s = powers[key]
            clip = np.float64(top[i]) > limits[key]
        else:
            s = values[i]
            clip = np.float32(top[i] / divisors[i]) > big
        clipped += clip
        if top[i] == 0:
            zero += 1
            continue
        live += 1
        at_max += s == top_s
        n_sub += s < normal
        at_min += s == bottom
        lo = min(lo, s)
        hi = max(hi, s)
        r = span[i]
        over += r > elem_span
        widest = max(widest, r)
        ranges[r] += 1
    counts = (live, zero, nonfinite, clipped, at_max, n_sub, at_min, over, widest, missed)
    for j in range(10):
        out[j] = counts[j]
    extremes[0] = lo
    extremes[1] = hi


@njit(**OPTIONS)
def two_level_values_kernel(amax: Any, divisor: Any, consts: Any, drop: int, value: Any,
                            value32: Any) -> bool:
    """The block scales of a two-level cast from castcode's float32 ``divisor`` (``fl32(b *
    S)``) and the groups' float32 ``amax``: the tensor scale ``S`` as castcode's
    ``two_level_scales`` computes it (``consts`` as there), each quotient ``divisor / S`` in
    float64 rounded to the scale format's significant bits (``52 - drop``) into ``value``
    (and as float32 into ``value32``). False, and nothing reliable written, where a divisor
    is below float32's normals (``consts[4]``): there the product lost bits."""
    two_level_max, tiny = consts[1], consts[4]
    top = np.float32(0.0)
    for i in range(amax.size):
        top = max(top, amax[i])
    scale = max(np.float32(top / two_level_max), tiny) if top > 0 else np.float32(1.0)
    wide = np.float64(scale)
    half = np.int64(1) << (drop - 1)
    keep = ~((np.int64(1) << drop) - 1)
    bits = value.view(np.int64)
    for i in range(divisor.size):
        if divisor[i] < tiny:
            return False
        value[i] = np.float64(divisor[i]) / wide
        bits[i] = (bits[i] + half) & keep
        value32[i] = value[i]
    return True
