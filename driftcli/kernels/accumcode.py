"""The numba code of the simulated matmul's accumulation (:mod:`driftcli.arith.matmul`'s
``_sequential``, ``_chunked`` and ``_pairwise``), imported on first use: it imports numba.

Every step is the torch step :func:`driftcli.arith.matmul._round_sum` for one element: the
term ``a * b`` in the working dtype (float32 where the products and sums are exact in it, else
float64), TwoSum, then one rounding of ``s + r`` onto the accumulator: none for a float32
accumulator rounding to nearest (``fl(acc + t)`` is already that), the float32-layout cut of
:func:`truncate32` (``truncate_float32``), or :func:`driftcli.kernels.jitcode.round_one` with
the residual as a sticky bit (``rounding.round_sum``), in float64 with no residual where the
sum is not finite. An exact-zero sum keeps IEEE's sign as ``fl(acc + t)`` gives it. No step may
be reassociated: the kernels are compiled without ``fastmath``.

Each output row's columns are worked side by side (the accumulators of a tile of columns in a
small array, the terms of one ``k`` read along a row of ``B``): each column's steps run in
their own order, and the columns' independent chains keep the processor busy where one chain
would wait on every step. The pairwise tree is built as its terms arrive, a stack of
finished subtrees (:func:`pairwise_tree`), so it holds no more than ``log2 K`` partial sums
per column. A kernel is made per working dtype, kind of step and rounding, and cached on
disk like :mod:`driftcli.kernels.jitcode`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

# importing jitcode also puts its on-disk cache locator ahead of numba's own
from driftcli.kernels.jitcode import OPTIONS, round_one, row_limits

PLAIN, LAYOUT, ROUNDED, WIDE = 0, 1, 2, 3
"""The kinds of step: ``fl(acc + t)`` in float32 (a float32 accumulator rounding to nearest);
the float32-layout cut (:func:`truncate32`); the generic rounding from float32; the generic
rounding from float64."""
SEQUENTIAL, CHUNKED, PAIRWISE = 0, 1, 2
"""The orders, as the kernel factory takes them."""

TILE = 64
"""Output columns worked side by side: their accumulators stay in the first-level cache."""


@njit(inline="always", **OPTIONS)
def truncate32(s: Any, r: Any, drop: int, rne: bool) -> Any:
    """``s + r`` (a float32 TwoSum pair) rounded to a format laid out as float32 with ``drop``
    fewer mantissa bits: :func:`driftcli.arith.matmul.truncate_float32` for one element."""
    bits = np.int64(np.float32(s).view(np.int32))
    mag = bits & 0x7FFFFFFF
    toward = (r < 0 and s > 0) or (r > 0 and s < 0)
    stepped = mag - (1 if toward else 0)
    kept = stepped >> drop
    if rne:
        if drop == 0:
            return s  # float32 addition is already rounded to nearest even
        low = stepped & ((1 << drop) - 1)
        half = 1 << (drop - 1)
        if low > half or (low == half and (r != 0 or (kept & 1) == 1)):
            kept += 1
    out = (kept << drop) if mag < 0x7F800000 else mag
    return np.int32(out | (bits & -(1 << 31))).view(np.float32)


@njit(inline="always", **OPTIONS)
def step32(acc: Any, t: Any, kind: int, drop: int, rne: bool, lim: Any, p: Any) -> Any:
    """``round(acc + t)`` of a float32 accumulator step (``kind``: PLAIN, LAYOUT or ROUNDED)."""
    s = acc + t
    if kind == PLAIN:
        return s
    bb = s - acc
    r = (acc - (s - bb)) + (t - bb)
    if kind == LAYOUT:
        return truncate32(s, r, drop, rne)
    bits = round_one(np.int64(np.float32(s).view(np.int32)),
                     np.int64(np.float32(r).view(np.int32)), True, 0, lim, p)
    return np.int32(bits).view(np.float32)


@njit(inline="always", **OPTIONS)
def step64(acc: Any, t: Any, lim: Any, p: Any) -> Any:
    """``round(acc + t)`` of a float64 accumulator step; no residual where the sum is inf or
    NaN (TwoSum's error is then NaN, not an error)."""
    s = acc + t
    bb = s - acc
    r = (acc - (s - bb)) + (t - bb)
    if not np.isfinite(s):
        r = 0.0
    bits = round_one(np.float64(s).view(np.int64), np.float64(r).view(np.int64), True, 0,
                     lim, p)
    return np.int64(bits).view(np.float64)


def pairwise_tree(k: int) -> list[tuple[int, int, int]]:
    """The pairwise order's additions over ``k`` terms as ``(lo, mid, hi)``: the sum of terms
    ``lo..mid-1`` plus the sum of ``mid..hi-1`` (the root's addition to +0 not listed), in the
    order the kernel makes them. The torch back-end's tree (adjacent pairs level by level, an
    odd last one carried up) has a node for each aligned block of ``2**lv`` terms (cut at
    ``k``), made of its two halves where the right one is not empty; the kernel makes the full
    blocks as their last term arrives (a binary counter: term ``j`` closes one block per
    trailing 1 bit of ``j``) and the cut ones at the end, from the right. The same nodes, so
    the same sums: the tests compare this list with the level-by-level tree."""
    steps = []
    for j in range(k):
        lv = 0
        while (j >> lv) & 1:
            hi = j + 1
            steps.append((hi - (2 << lv), hi - (1 << lv), hi))
            lv += 1
    edge = None
    for lv in range(k.bit_length()):
        if (k >> lv) & 1:
            lo = (k >> (lv + 1) << (lv + 1))
            if edge is not None:
                steps.append((lo, lo + (1 << lv), k))
            edge = lo
    return steps


@cache
def accum_kernel(wide: bool, kind: int, rounding: int) -> Callable[..., None]:
    """``kernel(a, b, a_of, b_of, m, k, order, chunk, q, qm, drop, out, start, stop)``:
    rows ``start..stop`` of ``out`` (rows x N), each output ``out[row, n]`` the accumulated
    sum of its ``k`` terms ``a[a_of[row // m] * m + row % m, j] * b[b_of[row // m] * k + j, n]``
    in ``order`` (``CHUNKED``: ``chunk`` terms per chunk, each chunk's sum added into a float32
    master sum rounded to nearest; ``PAIRWISE``: the tree of :func:`pairwise_tree`). Every step is
    one of ``kind`` (float64 when ``wide``) rounding by the parameters ``q``, the master sum's
    by ``qm``; ``drop`` is the float32-layout cut's. The rounding is this kernel's
    ``rounding`` (numba folds it into the steps: about 1.5x faster than reading it at run
    time); the order is read at run time, outside the inner loops."""

    rne = rounding == 0

    @njit(**OPTIONS)
    def kernel(a: Any, b: Any, a_of: Any, b_of: Any, m: int, k: int, order: int, chunk: int,
               q: Any, qm: Any, drop: int, out: Any, start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, 1, q[15], q[16], q[17])
        pm = (qm[0], qm[1], qm[2], qm[3], qm[4], qm[5], qm[6], qm[7], qm[8], qm[9], qm[10],
              qm[11], qm[12], 0, 1, qm[15], qm[16], qm[17])
        lim = row_limits(0, p)
        limm = row_limits(0, pm)
        n_cols = out.shape[1]
        tile = TILE
        acc = np.zeros(tile, dtype=out.dtype)
        master = np.zeros(tile, dtype=out.dtype)
        levels = 64 - leading_zeros(np.int64(k)) + 1  # type: ignore[call-arg]  # numba's intrinsic
        # one row more than the subtrees use: +0, the root's left operand
        stack = np.zeros((levels + 1, tile), dtype=out.dtype)
        zero = acc[0]  # +0 of the working dtype
        for n0 in range(0, n_cols, tile):  # a tile of B's columns serves every row
            w = min(tile, n_cols - n0)
            for row in range(start, stop):
                batch = row // m
                ar = a[a_of[batch] * m + row % m]
                b0 = b_of[batch] * k
                if order == PAIRWISE:
                    # stack[lv] holds a finished subtree of 2**lv terms waiting for its right
                    # sibling: the terms' index j in binary says which (see pairwise_tree).
                    # Every addition of the tree, the right edge's and the root's too, is the
                    # one step below (each inlined copy of a step costs seconds of compiling)
                    for j in range(k + 1):
                        edge = j == k
                        if not edge:
                            x = ar[j]
                            bk = b[b0 + j, n0:n0 + w]
                            for c in range(w):
                                acc[c] = x * bk[c]
                            lv = 0
                            more = (j & 1) == 1
                        elif k == 0:  # no terms: +0
                            acc[:w] = zero
                            more = False
                        else:
                            # the right edge: the partial subtrees, lowest first, each finished
                            # one to their left added in front of them, then the root to +0
                            lv = 0
                            while not (k >> lv) & 1:
                                lv += 1
                            first = stack[lv]
                            for c in range(w):
                                acc[c] = first[c]
                            lv += 1
                            while lv < levels and not (k >> lv) & 1:
                                lv += 1
                            more = True
                        while more:
                            left = stack[lv]
                            for c in range(w):
                                if wide:
                                    acc[c] = step64(left[c], acc[c], lim, p)
                                else:
                                    acc[c] = step32(left[c], acc[c], kind, drop, rne, lim, p)
                            if not edge:
                                lv += 1
                                more = ((j >> lv) & 1) == 1
                            elif lv == levels:
                                more = False
                            else:
                                lv += 1
                                while lv < levels and not (k >> lv) & 1:
                                    lv += 1
                        if not edge:
                            stack[lv, :w] = acc[:w]
                    for c in range(w):
                        out[row, n0 + c] = acc[c]
                    continue
                master[:w] = zero
                size = chunk if order == CHUNKED else max(k, 1)
                for c0 in range(0, k, size):
                    acc[:w] = zero
                    for j in range(c0, min(c0 + size, k)):
                        x = ar[j]
                        bk = b[b0 + j, n0:n0 + w]
                        for c in range(w):
                            if wide:
                                acc[c] = step64(acc[c], x * bk[c], lim, p)
                            else:
                                acc[c] = step32(acc[c], x * bk[c], kind, drop, rne, lim, p)
                    if order == CHUNKED:  # promotion: the master sum, float32 to nearest
                        for c in range(w):
                            if wide:
                                master[c] = step64(master[c], acc[c], limm, pm)
                            else:
                                master[c] = master[c] + acc[c]
                    else:
                        master[:w] = acc[:w]
                out[row, n0:n0 + w] = master[:w]

    return kernel
