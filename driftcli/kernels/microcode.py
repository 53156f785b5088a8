"""The numba code of a multi-level (micro-exponent) block scale, imported on first use (it
imports numba): per block, the first-level scale ``s``, the multiplier ``r`` elements meet and
each element's total micro-exponent, the same steps as :func:`driftcli.microscale.torch_scales`
(its torch twin) and :func:`driftcli.oracle.cast_micro_block` (its exact one). The elements
are then rounded by :mod:`driftcli.kernels.jitcode`'s kernels, unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

# importing jitcode also puts its on-disk cache locator ahead of numba's own
from driftcli.kernels.jitcode import OPTIONS


@njit(inline="always", **OPTIONS)
def round_significand(v: float, bits: int) -> float:
    """``v >= 0`` rounded to nearest even on ``bits`` significant bits (exact: frexp and ldexp
    move the binary point, ``rint`` rounds half to even)."""
    if v == 0.0:
        return 0.0
    m, e = math.frexp(v)
    return math.ldexp(np.rint(math.ldexp(m, bits)), e - bits)


@njit(inline="always", **OPTIONS)
def binade(v: float) -> int:
    """``floor(log2 v)`` of a float64 ``v > 0``, from its exponent."""
    return math.frexp(v)[1] - 1


@njit(**OPTIONS)
def micro_scales(x: Any, cols: int, levels: Any, ints: Any, consts: Any, s_out: Any,
                 r_out: Any, bad: Any, clamped: Any, exps: Any, start: int, stop: int) -> None:
    """Rows ``start..stop`` of ``cols`` float32 elements: ``s_out``, ``r_out`` (float64),
    ``bad`` (a NaN or inf member), ``clamped`` and ``exps`` (one per element).

    ``levels`` holds ``(size, top)`` per level, outermost first; ``ints`` is ``(pow2 base,
    emax_elem, T, low, high, scale mbits + 1)``; ``consts`` is ``(rne_bf16(1 / M), smallest,
    largest)`` of the scale format.
    """
    pow2, emax, steps, low, high, sig = ints[0], ints[1], ints[2], ints[3], ints[4], ints[5]
    c, smallest, largest = consts[0], consts[1], consts[2]
    for row in range(start, stop):
        base = row * cols
        amax, nonfinite = 0.0, False
        for i in range(cols):
            a = abs(np.float64(x[base + i]))
            if math.isfinite(a):
                amax = max(amax, a)
            else:
                nonfinite = True
        bad[row] = nonfinite
        if pow2:
            free = binade(amax) - emax - steps if amax > 0 else low
            k = min(max(free, low), high)
            s, r, clip = math.ldexp(1.0, k), math.ldexp(1.0, -k), k != free
        else:
            raw = round_significand(amax * c, 8)
            rounded = round_significand(raw, sig)
            s = min(max(rounded, smallest), largest)
            clip = amax > 0 and (rounded > largest or raw < smallest)
            r = round_significand(1.0 / s, 8)
        s_out[row], r_out[row], clamped[row] = s, r, clip and not nonfinite
        for i in range(cols):
            exps[base + i] = 0
        inner = steps
        for j in range(levels.shape[0]):
            size, top = levels[j, 0], levels[j, 1]
            inner -= top
            for run in range(base, base + cols, size):
                v = 0.0
                for i in range(run, run + size):
                    a = abs(np.float64(x[i]))
                    if math.isfinite(a):
                        v = max(v, a)
                v = math.ldexp(v * r, -exps[run])
                e = min(max(binade(v) - emax - inner, 0), top) if v > 0 else 0
                for i in range(run, run + size):
                    exps[i] += e
