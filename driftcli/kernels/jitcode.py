"""The numba code of :mod:`driftcli.kernels.jit` (imported on first use: it imports numba).

:func:`round_one` is :func:`driftcli.casts.rounding._kernel` for one element: the same integer steps
on the same bit fields; :func:`round_lean` reaches the same bits for float32 inputs in fewer
steps. A kernel is made per rounding mode, overflow policy and kind of input (a few dozen
in all), with the format's integers a run-time argument: numba folds the mode and the policy
in as constants where that pays at run time, and each kernel's machine code is cached on
disk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit
from numba.core import caching
from numba.cpython.unsafe.numbers import leading_zeros

OPTIONS: dict[str, Any] = {"cache": True, "nogil": True, "error_model": "numpy"}


_PACKAGE = Path(__file__).resolve().parent.parent


def content_key(py_file: Path, kernel_files: list[Path]) -> str:
    """The cache folder of ``py_file``'s kernels: a digest of its content and of every kernel
    file's (``kernel_files``, in order). A kernel inlines the helpers of the other kernel
    files it imports (``round_lean`` of this one, ``pow2_exponent`` of castcode), and numba's
    index checks only the kernel's own file: keyed on that file alone, an edit to a helper
    would leave the kernels calling it running the old machine code."""
    digest = hashlib.sha256(py_file.read_bytes())
    for f in kernel_files:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    return "driftcli-" + digest.hexdigest()[:16]


@cache
def kernel_files() -> list[Path]:
    """drift's numba modules (``kernels/*code.py``), in a fixed order."""
    return sorted(Path(__file__).resolve().parent.glob("*code.py"))


class _ByContent(caching.UserProvidedCacheLocator):
    """Finds this file's cached machine code by the kernel files' content, not by where they
    lie: numba's own locator keys the cache on the source's folder, so every new checkout or
    virtual environment of the same drift would compile every kernel again (see
    :func:`content_key`)."""

    @classmethod
    def get_suitable_cache_subpath(cls, py_file: str) -> str:
        return content_key(Path(py_file), kernel_files())

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Any:
        # drift's kernel files (this one, and those that import from it), nobody else's
        if _PACKAGE not in Path(py_file).resolve().parents:
            return None
        return super().from_function(py_func, py_file)


# ahead of numba's own locators (a numba without this list keeps its own: the same code, kept
# per folder)
_LOCATORS = getattr(getattr(caching, "CacheImpl", None), "_locator_classes", None)
if isinstance(_LOCATORS, list) and _ByContent not in _LOCATORS:
    _LOCATORS.insert(0, _ByContent)


@njit(inline="always", **OPTIONS)
def bit_length(v: int) -> int:
    """Bits of a non-negative integer (``int.bit_length``), from the count of leading zeros."""
    return 64 - leading_zeros(np.int64(v))  # type: ignore[call-arg]  # numba adds the context


@njit(inline="always", **OPTIONS)
def assemble(mag: int, qexp: int, ebits: int, mbits: int) -> int:
    """Bits of the float ``mag * 2**qexp`` of ``ebits`` and ``mbits`` (a representable value,
    ``mag < 2**(mbits + 2)``)."""
    if mag == 0:
        return 0
    bias = (1 << (ebits - 1)) - 1
    top = bit_length(mag) - 1
    biased = top + bias + qexp
    if biased >= 1:
        frac = mag << (mbits - top) if top <= mbits else mag >> (top - mbits)
        return (biased << mbits) | (frac & ((1 << mbits) - 1))
    shift = min(max(qexp - (1 - bias - mbits), 0), ebits + mbits - 1)
    return mag << shift


@njit(inline="always", **OPTIONS)
def row_limits(k: int, p: Any) -> tuple[int, int, int, int, int]:
    """For a grid scaled by ``2**k``: its smallest normal exponent and top quantum exponent,
    the bits of its largest magnitude for a positive and a negative value, and the bits of
    its smallest positive value (the constants of a row, so they stay out of the element
    loop)."""
    ebits, mbits, emin, qmax, max_sig, min_sig, smallest_exp = (
        p[0], p[1], p[2], p[4], p[5], p[6], p[12])
    return (emin + k, qmax + k, assemble(max_sig, qmax + k, ebits, mbits),
            assemble(min_sig, qmax + k, ebits, mbits), assemble(1, smallest_exp + k, ebits, mbits))


@njit(inline="always", **OPTIONS)
def binade_mbits(floor_e: int, lo: int, p: Any) -> int:
    """The target's mantissa width in the binade ``floor_e`` (at least the grid's floor
    ``lo``): ``p[3]``, less what a tapered format's masks ``p[16]``, ``p[17]`` take off there
    (:func:`driftcli.casts.rounding.taper_masks`)."""
    if p[16] == 0 and p[17] == 0:
        return p[3]
    i = min(floor_e - lo, 62)
    return p[3] - (((p[16] >> i) & 1) | (((p[17] >> i) & 1) << 1))


@njit(inline="always", **OPTIONS)
def round_one(bits: int, rbits: int, has_res: bool, draw: int, lim: Any, p: Any) -> int:
    """One element of :func:`driftcli.casts.rounding._kernel`: ``bits`` (+ the residual ``rbits``)
    of a float of ``p[0]`` exponent and ``p[1]`` fraction bits, rounded onto the grid whose
    :func:`row_limits` are ``lim``."""
    ebits, mbits, t_mbits, rounding, sr_bits = p[0], p[1], p[3], p[13], p[15]
    lo, hi, lim_pos, lim_neg = lim[0], lim[1], lim[2], lim[3]
    w = ebits + mbits
    bias = (1 << (ebits - 1)) - 1
    man_mask = (1 << mbits) - 1
    exp_all = (1 << ebits) - 1

    neg = bits < 0
    u = bits & ((1 << w) - 1)
    nonfinite = (u >> mbits) == exp_all
    if nonfinite and (u & man_mask) != 0:
        return (exp_all << mbits) | (1 << (mbits - 1))
    sticky = False
    if has_res:
        # x + r with r below x's last bit: one ulp toward zero when r points that way
        sticky = (rbits & ((1 << w) - 1)) != 0
        if sticky and ((rbits < 0) != neg):
            u -= 1
    exp_field = u >> mbits
    sig = (u & man_mask) | ((1 << mbits) if exp_field > 0 else 0)
    q_src = max(exp_field, 1) - (bias + mbits)
    sub_binade = bit_length(sig) - 1 if sig != 0 else -bias
    e = sub_binade + q_src if exp_field == 0 else q_src + mbits
    t_mbits = binade_mbits(max(e, lo), lo, p)
    s = max(max(e, lo) - t_mbits - q_src, 0)
    qexp = q_src + s
    sc = min(s, w - 1)
    kept = sig >> sc
    dropped = sig - (kept << sc)
    inexact = dropped != 0 or sticky
    if rounding == 0 or rounding == 1:
        two_d, full = dropped << 1, 1 << sc
        if rounding == 1:
            away = two_d >= full
        else:
            # Format.ties_by_code (P = 1 with a zero), a tapered format's denormals: the
            # parity of lo's binade
            odd = (kept & 1) == 1 if t_mbits > 0 or p[10] == 0 else (
                kept != 0 and ((qexp - lo + 1) & 1) == 1)
            away = two_d > full or (two_d == full and (odd or sticky))
    elif rounding == 2:
        away = False
    elif rounding == 3:
        away = inexact and not neg
    elif rounding == 4:
        away = inexact and neg
    else:
        if s >= sr_bits:
            head = dropped >> min(s - sr_bits, w - 1)
        else:
            head = dropped << min(sr_bits - s, w - 1)
        away = head + draw >= (1 << sr_bits)
    mag = kept + (1 if away else 0)
    over = qexp > hi or (qexp == hi and mag > (p[6] if neg else p[5]))
    out = assemble(mag, qexp, ebits, mbits)
    return finish(out, over, neg, u, nonfinite, lim_neg if neg else lim_pos, lim[4], p)


@njit(inline="always", **OPTIONS)
def finish(out: int, over: bool, neg: bool, u: int, nonfinite: bool, limit_bits: int,
           smallest_bits: int, p: Any) -> int:
    """The bits of a rounded magnitude ``out`` after overflow (``over``), nonfinite inputs,
    a format without zero, and the sign: the last steps of :func:`round_one`."""
    ebits, mbits = p[0], p[1]
    signed, has_inf, has_nan, has_zero, has_neg_zero = p[7], p[8], p[9], p[10], p[11]
    rounding, overflow = p[13], p[14]
    inf_bits = ((1 << ebits) - 1) << mbits
    nan_bits = inf_bits | (1 << (mbits - 1))
    if overflow == 0 or not (has_inf or has_nan):
        over_bits = limit_bits
        inf_in = limit_bits
    else:
        special = inf_bits if has_inf else nan_bits
        if rounding == 2:
            toward_zero = True
        elif rounding == 3:
            toward_zero = neg
        elif rounding == 4:
            toward_zero = not neg
        else:
            toward_zero = False
        over_bits = limit_bits if toward_zero else special
        inf_in = special
    if over:
        out = over_bits
    if nonfinite:
        out = inf_in
    if not has_zero:
        out = max(out, smallest_bits)
    if signed:
        if neg and (out != 0 or has_neg_zero):
            out |= -(1 << (ebits + mbits))
    elif neg and (u != 0 or nonfinite):
        # an unsigned format's least value: 0 where it has a zero (UE5M3), else its smallest
        out = nan_bits if (overflow == 1 and has_nan) else (0 if has_zero else smallest_bits)
    return out


@njit(inline="always", **OPTIONS)
def round_lean(bits: int, draw: int, lim: Any, p: Any) -> int:
    """:func:`round_one` for a float32 without residual, in fewer steps: the rounding is an
    increment added to the bits, whose carry runs into the exponent field as the value's
    does, then the dropped bits are cleared (a cut above the significand's top bit leaves 0
    or one quantum)."""
    t_mbits, rounding, sr_bits = p[3], p[13], p[15]
    lo, lim_pos, lim_neg = lim[0], lim[2], lim[3]
    neg = bits < 0
    u = bits & 0x7FFFFFFF
    if u > 0x7F800000:
        return 0x7FC00000
    exp_field = u >> 23
    sig = (u & 0x7FFFFF) | (0x800000 if exp_field > 0 else 0)
    q_src = max(exp_field, 1) - 150
    # a subnormal's binade matters only where the grid's normals reach below float32's
    sub_binade = bit_length(sig) - 150 if sig != 0 else -276
    e = exp_field - 127 if exp_field > 0 else sub_binade
    t_mbits = binade_mbits(max(e, lo), lo, p)
    s = max(max(e, lo) - t_mbits - q_src, 0)
    qexp = q_src + s
    sc = min(s, 62)
    mask = (1 << sc) - 1
    if rounding == 0:  # to nearest, ties to the even kept bit (the even code: ties_by_code)
        kept = sig >> sc
        odd = kept & 1 if t_mbits > 0 or p[10] == 0 else (
            1 if kept != 0 and ((qexp - lo + 1) & 1) == 1 else 0)
        inc = (mask >> 1) + odd if sc > 0 else 0
    elif rounding == 1:
        inc = (1 << (sc - 1)) if sc > 0 else 0
    elif rounding == 2:
        inc = 0
    elif rounding == 3:
        inc = 0 if neg else mask
    elif rounding == 4:
        inc = mask if neg else 0
    else:  # draw holds sr_bits uniform bits, set below the cut
        inc = draw << (sc - sr_bits) if sc >= sr_bits else draw >> (sr_bits - sc)
    if sc <= 23:
        out = (u + inc) & ~mask
    else:  # 0 or one quantum 2**qexp
        one = ((qexp + 127) << 23) if qexp >= -126 else 1 << (qexp + 149)
        out = one if ((sig + inc) >> sc) != 0 else 0
    # the rounded magnitude lies beyond the limit exactly where its bits do
    limit = lim_neg if neg else lim_pos
    over = out > limit
    return finish(out, over, neg, u, u == 0x7F800000, limit, lim[4], p)


@njit(inline="always", **OPTIONS)
def nearest_fits(lim: Any, p: Any) -> bool:
    """Whether :func:`round_nearest` gives :func:`round_lean`'s bits on the grid whose
    :func:`row_limits` are ``lim``: rounding to nearest with ties to the even kept bit, a grid
    of one width (not tapered, at most 22 fraction bits, and not a ``P = 1`` format with a
    zero, whose ties go by code), its smallest normal ``2**lim[0]`` a float32 normal, its
    quanta and largest magnitudes within float32's finite range. A loop's constant: its caller
    asks once per row and runs a loop of either routine, so that each loop vectorizes without
    computing both."""
    return (p[13] == 0 and p[16] == 0 and p[17] == 0 and 0 <= p[3] <= 22
            and (p[3] > 0 or p[10] == 0) and lim[0] >= -126 and lim[0] - p[3] <= 104
            and lim[1] <= 103 and lim[2] < 0x7F800000 and lim[3] < 0x7F800000)


@njit(inline="always", **OPTIONS)
def round_nearest(bits: int, lim: Any, p: Any) -> int:
    """:func:`round_lean` of a float32 rounded to nearest even, on a grid where
    :func:`nearest_fits`, in float32 operations without a branch on the data: the magnitude
    ``a`` plus ``c = 2**(q + 23)``, with ``2**q`` the quantum of ``a``'s binade on the grid,
    lies in ``[c, 2c]``, where float32's spacing is ``2**q``: the addition rounds ``a`` to
    nearest even on the grid (the kept multiple's parity is the sum's last bit, ``c / 2**q``
    being even) and the subtraction is exact. ``q`` is held in ``[-149, 104]``: below, every
    float32 is on the grid already; above, ``a`` lies beyond the grid's largest magnitude
    (``lim[1] <= 103``) either way, and :func:`finish` sets overflow, infinity, the sign and a
    format without zero as for :func:`round_lean`. Like every float32 step of drift's
    kernels, it takes IEEE arithmetic as the processor's default sets it (no flushing of
    subnormals to zero). tests/test_nearest_rounding.py compares the two over every float32
    bit pattern."""
    neg = bits < 0
    u = bits & 0x7FFFFFFF
    # the binade's quantum; a float32 subnormal lies below the grid's normals (lim[0] >= -126)
    quantum = min(max(max((u >> 23) - 127, lim[0]) - p[3], -149), 104)
    magic = np.int32((quantum + 150) << 23).view(np.float32)
    a = np.int32(u).view(np.float32)
    out = np.int64(np.float32(np.float32(a + magic) - magic).view(np.int32))
    limit = lim[3] if neg else lim[2]
    out = finish(out, out > limit, neg, u, u == 0x7F800000, limit, lim[4], p)
    return 0x7FC00000 if u > 0x7F800000 else out


@njit(inline="always", **OPTIONS)
def lean_quotient(y: Any, draw: int, lim: Any, p: Any) -> Any:
    """A float32 quotient rounded by ``p``, as a float32."""
    return np.int32(round_lean(np.float32(y).view(np.int32), draw, lim, p)).view(np.float32)


@njit(inline="always", **OPTIONS)
def nearest_quotient(y: Any, lim: Any, p: Any) -> Any:
    """:func:`lean_quotient` by :func:`round_nearest` (where :func:`nearest_fits`)."""
    return np.int32(round_nearest(np.float32(y).view(np.int32), lim, p)).view(np.float32)


@njit(inline="always", **OPTIONS)
def wide_quotient(y: Any, draw: int, lim: Any, p: Any) -> Any:
    """A float64 quotient rounded by ``p``, as a float64."""
    q = round_one(np.float64(y).view(np.int64), 0, False, draw, lim, p)
    return np.int64(q).view(np.float64)


@njit(**OPTIONS)
def block_amax(x: Any, cols: int, top_bits: Any, bad: Any, inf_bits: int, start: int,
               stop: int) -> None:
    """Per row of ``cols`` elements of an integer view: the bits of the largest finite
    magnitude (non-negative floats order as their bits do) and whether the row holds NaN or
    inf."""
    mask = inf_bits | (inf_bits - 1)
    for row in range(start, stop):
        top, worst = 0, 0
        xs = x[row * cols:(row + 1) * cols]
        for i in range(xs.size):  # without branches, so that it vectorizes
            u = xs[i] & mask
            worst = max(worst, u)
            top = max(top, u if u < inf_bits else 0)
        top_bits[row] = top
        bad[row] = worst >= inf_bits


@cache
def flat_kernel(rounding: int, overflow: int, lean: bool, has_res: bool, has_draws: bool,
                scaled: bool, has_bad: bool) -> Callable[..., None]:
    """``kernel(x, res, draws, sexp, bad, cols, out, q, start, stop)``: elements
    ``start..stop`` of a flat integer view rounded by the parameters ``q`` (their rounding
    code is this kernel's ``rounding``, their overflow code its ``overflow``, or with
    ``overflow`` -1 read from ``q``); ``res``, ``draws`` shaped like ``x`` where present (else
    empty), ``sexp`` one scale exponent per row of ``cols`` elements when ``scaled``, ``bad``
    per row when ``has_bad``: the row becomes NaN. ``lean``: float32 without residual, by
    :func:`round_lean`.

    With a residual (``round_sum``'s inputs) the overflow policy is read at run time (no
    slower measured), which halves the kernels a cold start compiles there; the others keep
    it compiled in (read at run time it measured 3-8% slower there; docs/performance.md,
    "With an empty kernel cache")."""

    @njit(**OPTIONS)
    def kernel(x: Any, res: Any, draws: Any, sexp: Any, bad: Any, cols: int, out: Any, q: Any,
               start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow if overflow >= 0 else q[14], q[15], q[16], q[17])
        nan_bits = ((1 << p[0]) - 1) << p[1] | (1 << (p[1] - 1))
        lim = row_limits(0, p)
        last = 0
        i = start
        while i < stop:  # row by row (one scale exponent each)
            row = i // cols
            end = min((row + 1) * cols, stop)
            if has_bad and bad[row]:
                out[i:end] = nan_bits
                i = end
                continue
            if scaled and sexp[row] != last:  # neighbouring blocks mostly share theirs
                last = sexp[row]
                lim = row_limits(last, p)
            # slices, so that indices start at 0: a signed index that might be negative
            # costs numba a wraparound select per element, and the loop stops vectorizing
            xs, os = x[i:end], out[i:end]
            rs = res[i:end] if has_res else res
            ds = draws[i:end] if has_draws else draws
            if lean and nearest_fits(lim, p):  # a loop of either: each vectorizes
                for j in range(xs.size):
                    os[j] = round_nearest(xs[j], lim, p)
            else:
                for j in range(xs.size):
                    d = ds[j] if has_draws else 0
                    if lean:
                        os[j] = round_lean(xs[j], d, lim, p)
                    else:
                        os[j] = round_one(xs[j], rs[j] if has_res else 0, has_res, d, lim, p)
            i = end

    return kernel


@cache
def divided_kernel(rounding: int, overflow: int, has_draws: bool, wide: bool,
                   has_bad: bool) -> Callable[..., None]:
    """``kernel(x, divisor, draws, bad, cols, out, q, start, stop)``: ``fl(round(fl(x / d)) *
    d)`` with ``d`` the divisor of each row of ``cols`` elements, every step one IEEE
    operation in float32 (float64 when ``wide``); a ``bad`` row becomes NaN."""

    @njit(**OPTIONS)
    def kernel(x: Any, divisor: Any, draws: Any, bad: Any, cols: int, out: Any, q: Any,
               start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        lim = row_limits(0, p)
        near = not wide and nearest_fits(lim, p)
        i = start
        while i < stop:
            row = i // cols
            end = min((row + 1) * cols, stop)
            if has_bad and bad[row]:
                out[i:end] = np.nan
                i = end
                continue
            d = divisor[row]
            xs, os = x[i:end], out[i:end]
            ds = draws[i:end] if has_draws else draws
            if near:  # a loop of either: each vectorizes
                for j in range(xs.size):
                    os[j] = nearest_quotient(xs[j] / d, lim, p) * d
            else:
                for j in range(xs.size):
                    r = ds[j] if has_draws else 0
                    if wide:
                        os[j] = wide_quotient(xs[j] / d, r, lim, p) * d
                    else:
                        os[j] = lean_quotient(xs[j] / d, r, lim, p) * d
            i = end

    return kernel


@cache
def scaled_kernel(rounding: int, overflow: int, has_draws: bool, has_bad: bool, apply_mul: bool,
                  undo_div: bool) -> Callable[..., None]:
    """``kernel(x, apply, undo, draws, bad, cols, out, q, start, stop)`` on float32: each
    element divided by (``apply_mul``: multiplied by) its row's ``apply``, rounded (``q``), the
    code multiplied by (``undo_div``: divided by) its row's ``undo``, every step one IEEE
    float32 operation; a ``bad`` row becomes NaN. The element pass of a scale arithmetic."""

    @njit(**OPTIONS)
    def kernel(x: Any, apply: Any, undo: Any, draws: Any, bad: Any, cols: int, out: Any, q: Any,
               start: int, stop: int) -> None:
        p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
             rounding, overflow, q[15], q[16], q[17])
        lim = row_limits(0, p)
        near = nearest_fits(lim, p)
        i = start
        while i < stop:
            row = i // cols
            end = min((row + 1) * cols, stop)
            if has_bad and bad[row]:
                out[i:end] = np.nan
                i = end
                continue
            a, u = apply[row], undo[row]
            xs, os = x[i:end], out[i:end]
            ds = draws[i:end] if has_draws else draws
            if near:  # a loop of either: each vectorizes
                for j in range(xs.size):
                    y = xs[j] * a if apply_mul else xs[j] / a
                    c = nearest_quotient(y, lim, p)
                    os[j] = c / u if undo_div else c * u
            else:
                for j in range(xs.size):
                    r = ds[j] if has_draws else 0
                    y = xs[j] * a if apply_mul else xs[j] / a
                    c = lean_quotient(y, r, lim, p)
                    os[j] = c / u if undo_div else c * u
            i = end

    return kernel
