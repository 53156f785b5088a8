"""The numba code of four over six's errors (:mod:`driftcli.fouroversix`; imported on first use:
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


@cache
def errors_kernel(rounding: int, overflow: int, squared: bool,
                  fp16: bool) -> Callable[..., None]:
    """``kernel(x, inv4, inv6, sb4, sb6, consts, cols, err4, err6, q, start, stop)``: for the
    rows ``start:stop`` of float32 ``x`` (``cols`` a row), each candidate's codes of
    ``fl(x · inv)`` (rounded by ``q``) and its error summed from 0 in element order: ``|d|``
    or ``d · d`` (``squared``) of ``d = fl(fl(fl(fl(q · sb) · t) / g) − x)``, or with ``fp16``
    ``d = fl(q · sb − fl(x · enc))``; ``consts`` is ``(t, enc, g)``, float32."""

    @njit(**OPTIONS)
    def kernel(x: Any, inv4: Any, inv6: Any, sb4: Any, sb6: Any, consts: Any, cols: int,
               err4: Any, err6: Any, q: Any, start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        lim = row_limits(0, p)
        t, enc, g = consts[0], consts[1], consts[2]
        for row in range(start, stop):
            a4, a6, s4, s6 = inv4[row], inv6[row], sb4[row], sb6[row]
            e4 = np.float32(0.0)
            e6 = np.float32(0.0)
            base = row * cols
            for j in range(cols):
                v = x[base + j]
                c4 = lean_quotient(v * a4, 0, lim, p)
                c6 = lean_quotient(v * a6, 0, lim, p)
                if fp16:
                    o = v * enc
                    d4 = c4 * s4 - o
                    d6 = c6 * s6 - o
                else:
                    d4 = ((c4 * s4) * t) / g - v
                    d6 = ((c6 * s6) * t) / g - v
                if squared:
                    e4 = e4 + d4 * d4
                    e6 = e6 + d6 * d6
                else:
                    e4 = e4 + abs(d4)
                    e6 = e6 + abs(d6)
            err4[row] = e4
            err6[row] = e6

    return kernel
