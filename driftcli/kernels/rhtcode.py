"""The numba code of the random Hadamard transform (:mod:`driftcli.casts.hadamard`; imported on
first
use: it imports numba). Each output is ``fl32(x_i · m_ij)`` summed from +0 in ``i`` order, one
float32 addition each, then rounded to bfloat16 on its bits (nearest even), as
``hadamard.torch_groups`` does in torch."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from driftcli.kernels.jitcode import OPTIONS

SIZE = 16


@njit(**OPTIONS)
def rht_kernel(x: Any, m: Any, out: Any, bits: Any, start: int, stop: int) -> None:
    """For the groups ``start:stop`` of flat ``x`` (16 elements each, float32 or float64),
    ``out`` (float32, ``bits`` its uint32 view) gets each group's transform under the
    row-major float32 matrix ``m`` (256 entries, each ±1/4)."""
    acc = np.empty(SIZE, dtype=np.float32)
    for g in range(start, stop):
        base = g * SIZE
        acc[:] = np.float32(0.0)
        # i outer, the 16 sums side by side: each output still adds its products in i order
        for i in range(SIZE):
            xi = x[base + i]
            row = i * SIZE
            for j in range(SIZE):
                # x · (±1/4) is exact in x's precision, so one rounding to float32
                acc[j] = np.float32(acc[j] + np.float32(xi * m[row + j]))
        for j in range(SIZE):
            k = base + j
            out[k] = acc[j]
            b = np.uint32(bits[k])
            if (b & np.uint32(0x7F800000)) != np.uint32(0x7F800000) or \
                    (b & np.uint32(0x007FFFFF)) == np.uint32(0):
                # nearest even onto bfloat16's 8 significant bits; a carry into the
                # exponent is the next binade (or inf), as IEEE rounding gives; NaN kept
                lsb = (b >> np.uint32(16)) & np.uint32(1)
                bits[k] = (b + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)
