"""The numba code of block-stats' pass (imported on first use: importing it imports numba).

:func:`range_kernel` reads each scale group once for what block-stats needs of it: the largest
and the smallest nonzero finite magnitude, and whether it holds a NaN or inf. Magnitudes are
compared as the bits of ``|x|`` (for non-negative floats the bit order is the value order), so
nothing is rounded; the torch twin is :func:`driftcli.measures.block_stats.block_ranges`.
"""

from __future__ import annotations

from typing import Any

from numba import njit

from driftcli.kernels.jitcode import OPTIONS


@njit(**OPTIONS)
def range_kernel(bits: Any, cols: int, mask: int, inf_bits: int, top: Any, low: Any, bad: Any,
                 start: int, stop: int) -> None:
    """Rows ``start..stop`` of a row-major ``(rows, cols)`` block layout (its float bits):
    per row the largest finite ``bits & mask`` (0 for none), the smallest nonzero finite one
    (``inf_bits`` for none) and whether the row holds a NaN or inf."""
    for r in range(start, stop):
        xs = bits[r * cols:(r + 1) * cols]
        hi = 0
        lo = inf_bits
        nonfinite = False
        for i in range(xs.size):
            m = xs[i] & mask
            if m >= inf_bits:
                nonfinite = True
            else:
                hi = max(hi, m)
                if m != 0:
                    lo = min(lo, m)
        top[r] = hi
        low[r] = lo
        bad[r] = nonfinite
