"""drift's kernels as machine code: numba compiles them with the LLVM it bundles (no system
compiler), once per machine, and keeps the code on disk between processes.

Each kernel is the element rule of :mod:`driftcli.casts.rounding` written for one element (the same
integer steps on the same bit fields, so the same bits: the tests run every format, rounding
and overflow policy through both and compare, and ``drift verify-formats`` runs on each path),
plus the block amax that block scalings read. The work is split into slices that threads run
side by side, as many as torch's thread count, with the interpreter lock released.

Without numba (or with ``DRIFT_JIT=never``) drift runs the torch kernels instead: same bits,
slower. :func:`jit_unavailable` says why.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any, NamedTuple

import numpy as np
import torch

from driftcli.errors import DriftError

Tensor = torch.Tensor

_JIT_MODES = ("auto", "never")
_jit_mode = os.environ.get("DRIFT_JIT", "auto")

SLICE = 1 << 16
"""Elements per thread's slice: below two slices a call runs on the calling thread alone (a
hand-off to a thread costs tens of microseconds)."""


def set_jit(mode: str) -> None:
    """Choose whether drift's kernels run as numba code (``auto``) or as torch ops (``never``);
    both give the same bits."""
    global _jit_mode
    if mode not in _JIT_MODES:
        raise DriftError(f"unknown jit mode {mode!r}; choose from {', '.join(_JIT_MODES)}")
    _jit_mode = mode


@cache
def _numba_problem() -> str | None:
    cache_home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    # one cache per user, wherever drift is installed (a site-packages may be read-only)
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(cache_home, "drift", "numba"))
    try:
        import driftcli.kernels.jitcode  # noqa: F401
    except ImportError as err:
        return f"numba is not importable ({err}): pip install numba"
    from driftcli.kernels.compiling import watch_compiles

    watch_compiles()  # a first run's minutes of compiling are said, not silent
    return None


def jit_unavailable() -> str | None:
    """Why drift's kernels run as torch ops in this process, or None when they run as numba
    code."""
    if _jit_mode not in _JIT_MODES:
        raise DriftError(f"DRIFT_JIT={_jit_mode!r} is not a jit mode; "
                         f"use one of {', '.join(_JIT_MODES)}")
    if _jit_mode == "never":
        return "DRIFT_JIT=never asks for the torch kernels"
    return _numba_problem()


# --- the kernels' parameters -------------------------------------------------------------------

PARAMS = ("s_ebits", "s_mbits", "emin", "t_mbits", "qmax", "max_sig", "min_sig", "signed",
          "has_inf", "has_nan", "has_zero", "has_neg_zero", "smallest_exp", "rounding",
          "overflow", "sr_bits", "taper_lo", "taper_hi")
"""The integers a kernel reads, in the order of its parameter vector (see :func:`params`)."""
ROUNDING_CODES = ("rne", "rna", "rtz", "rup", "rdown", "sr")
OVERFLOW_CODES = ("saturate", "ieee")


# --- running them ---------------------------------------------------------------------------

_POOL: list[ThreadPoolExecutor] = []


def _pool(threads: int) -> ThreadPoolExecutor:
    if not _POOL or _POOL[0]._max_workers < threads:  # grows with torch's thread count
        _POOL[:] = [ThreadPoolExecutor(threads, thread_name_prefix="drift-jit")]
    return _POOL[0]


def spread(kernel: Callable[..., Any], n: int, per_item: int, *args: Any) -> None:
    """``kernel(*args, start, stop)`` over ``range(n)`` in slices, on torch's thread count."""
    threads = torch.get_num_threads()
    parts = min(threads, n * per_item // SLICE)
    if parts < 2:
        kernel(*args, 0, n)
        return
    bounds = [n * j // parts for j in range(parts + 1)]
    pool = _pool(threads)
    futures = [pool.submit(kernel, *args, bounds[j], bounds[j + 1]) for j in range(1, parts)]
    kernel(*args, bounds[0], bounds[1])
    for f in futures:
        f.result()


_INT = {torch.float32: torch.int32, torch.float64: torch.int64}
_EMPTY = {dtype: np.empty(0, dtype) for dtype in (np.int32, np.int64, np.bool_)}


def params(src_ebits: int, src_mbits: int, tgt: Any, rounding: str, overflow: str,
           sr_bits: int) -> tuple[int, ...]:
    """The parameter vector of :data:`PARAMS` for rounding a float of ``src_ebits`` and
    ``src_mbits`` onto ``tgt`` (a :class:`driftcli.casts.rounding.Target`)."""
    own = {"s_ebits": src_ebits, "s_mbits": src_mbits, "t_mbits": tgt.mbits,
           "rounding": ROUNDING_CODES.index(rounding),
           "overflow": OVERFLOW_CODES.index(overflow), "sr_bits": sr_bits}
    return tuple(int(own[name]) if name in own else int(getattr(tgt, name)) for name in PARAMS)


def _flat(t: Tensor | None, dtype: torch.dtype | None = None) -> np.ndarray | None:
    if t is None:
        return None
    return _array(t, dtype)


def _array(t: Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """``t`` as a flat numpy view (of its bits as ``dtype`` when given)."""
    t = t.contiguous() if dtype is None else t.contiguous().view(dtype)
    return t.reshape(-1).numpy()


def _or_empty(a: np.ndarray | None, itype: Any) -> np.ndarray:
    return _EMPTY[itype] if a is None else a


def _code() -> Any:
    import driftcli.kernels.jitcode as code  # numba, on first use only

    return code


def round_bits(x: Tensor, residual: Tensor | None, random: Tensor | None,
               scale_exp: Tensor | None, p: tuple[int, ...], bad: Tensor | None = None) -> Tensor:
    """The rounding kernel of :mod:`driftcli.casts.rounding` on a contiguous float32 or float64
    tensor: ``residual`` and ``random`` (integers) shaped like ``x``, ``scale_exp`` one per
    element or one per row of a 2-D ``x`` (shape ``(rows, 1)``); rows where ``bad`` (one
    flag per row) become NaN."""
    itype = _INT[x.dtype]
    bits = _array(x, itype)
    out = np.empty_like(bits)
    kind = bits.dtype.type
    sexp = _flat(None if scale_exp is None else scale_exp.to(torch.int64))
    cols = max(bits.size, 1) if sexp is None else bits.size // max(sexp.size, 1)
    draws = _flat(None if random is None else random.to(itype))
    res = _flat(residual, itype)
    flags = _flat(bad)
    lean = x.dtype == torch.float32 and res is None
    # with a residual the overflow policy is read at run time (no slower measured there):
    # one kernel for both policies, half as many to compile on a cold start
    kernel = _code().flat_kernel(p[13], p[14] if res is None else -1, lean, res is not None,
                                 draws is not None, sexp is not None, flags is not None)
    spread(kernel, bits.size, 1, bits, _or_empty(res, kind), _or_empty(draws, kind),
            _or_empty(sexp, np.int64), _or_empty(flags, np.bool_), cols, out, p)
    return torch.from_numpy(out).view(x.dtype).view(x.shape)


def round_divided(blocks: Tensor, divisor: Tensor, random: Tensor | None,
                  p: tuple[int, ...], bad: Tensor | None = None) -> Tensor:
    """Rows of a 2-D ``blocks`` divided by their ``divisor``, rounded (``p``), multiplied back:
    ``fl(round(fl(x / d)) * d)``, each step one IEEE operation in ``blocks``' dtype; rows
    where ``bad`` become NaN."""
    x = _array(blocks)
    d = _array(divisor.to(blocks.dtype))
    out = np.empty_like(x)
    wide = blocks.dtype == torch.float64
    draws = _flat(None if random is None else random.to(_INT[blocks.dtype]))
    flags = _flat(bad)
    kernel = _code().divided_kernel(p[13], p[14], draws is not None, wide, flags is not None)
    kind = np.int64 if wide else np.int32
    spread(kernel, x.size, 1, x, d, _or_empty(draws, kind), _or_empty(flags, np.bool_),
            blocks.shape[1], out, p)
    return torch.from_numpy(out).view(blocks.shape)


def round_scaled(blocks: Tensor, apply: Tensor, undo: Tensor, random: Tensor | None,
                 p: tuple[int, ...], bad: Tensor | None, apply_mul: bool,
                 undo_div: bool) -> Tensor:
    """Rows of a 2-D float32 ``blocks`` divided by (``apply_mul``: multiplied by) their
    ``apply``, rounded (``p``), and the codes multiplied by (``undo_div``: divided by) their
    ``undo``, each step one IEEE float32 operation; rows where ``bad`` become NaN."""
    x = _array(blocks)
    out = np.empty_like(x)
    draws = _flat(None if random is None else random.to(torch.int32))
    flags = _flat(bad)
    kernel = _code().scaled_kernel(p[13], p[14], draws is not None, flags is not None,
                                   apply_mul, undo_div)
    spread(kernel, x.size, 1, x, _array(apply.float()), _array(undo.float()),
           _or_empty(draws, np.int32), _or_empty(flags, np.bool_), blocks.shape[1], out, p)
    return torch.from_numpy(out).view(blocks.shape)


def block_amax(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of a 2-D float32 or float64 tensor: the largest finite magnitude, and whether
    the row holds NaN or inf (the values of :func:`driftcli.casts.scaling.block_stats`)."""
    rows, cols = blocks.shape
    bits = _array(blocks, _INT[blocks.dtype])
    top = np.empty(rows, dtype=bits.dtype)
    bad = np.empty(rows, dtype=np.bool_)
    inf_bits = 0x7F800000 if blocks.dtype == torch.float32 else 0x7FF0000000000000
    if rows:
        spread(_code().block_amax, rows, cols, bits, cols, top, bad, inf_bits)
    return torch.from_numpy(top).view(blocks.dtype), torch.from_numpy(bad)



def block_ranges(blocks: Tensor, k: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of a 2-D float32 or float64 tensor (with ``k``: per group of ``k`` rows of each
    column, in the transpose's block order, read in place): the largest finite magnitude (0
    for none), the smallest nonzero finite one (inf for none), the binades between them (-1
    for none) and whether it holds NaN or inf (:mod:`driftcli.kernels.blockcode`)."""
    import driftcli.kernels.blockcode as code  # numba, on first use only

    rows, cols = blocks.shape
    bits = _array(blocks, _INT[blocks.dtype])
    n = cols * -(-rows // k) if k else rows
    top = np.empty(n, dtype=bits.dtype)
    low = np.empty(n, dtype=bits.dtype)
    span = np.empty(n, dtype=np.int64)
    bad = np.empty(n, dtype=np.bool_)
    layout = _LAYOUT_BITS[blocks.dtype]
    consts = (_MASK[blocks.dtype], _INF_BITS[blocks.dtype], *layout, top, low, span, bad)
    if n and k:
        spread(code.column_range_kernel, -(-rows // k), k * cols, bits, rows, cols, k, *consts)
    elif n:
        spread(code.range_kernel, rows, cols, bits, cols, *consts)
    return (torch.from_numpy(top).view(blocks.dtype), torch.from_numpy(low).view(blocks.dtype),
            torch.from_numpy(span), torch.from_numpy(bad))


def merge_ranges(top: Tensor, low: Tensor, bad: Tensor, lines: int,
                 f: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`block_ranges` of groups ``f`` times as long from those of groups laid out
    ``(lines, bands)`` (:func:`driftcli.kernels.blockcode.merge_range_kernel`)."""
    import driftcli.kernels.blockcode as code  # numba, on first use only

    bands = top.numel() // lines if lines else 0
    n = lines * -(-bands // f)
    kind = _INT[top.dtype]
    bits = _array(top, kind)
    otop, olow = np.empty(n, dtype=bits.dtype), np.empty(n, dtype=bits.dtype)
    span = np.empty(n, dtype=np.int64)
    flags = np.empty(n, dtype=np.bool_)
    if n:
        spread(code.merge_range_kernel, lines, bands, bits, _array(low, kind), _array(bad),
               bands, f, _INF_BITS[top.dtype], *_LAYOUT_BITS[top.dtype], otop, olow, span,
               flags)
    return (torch.from_numpy(otop).view(top.dtype), torch.from_numpy(olow).view(top.dtype),
            torch.from_numpy(span), torch.from_numpy(flags))


def block_summary(top: Tensor, span: Tensor, bad: Tensor, poison: bool, scale: Tensor,
                  clipped: Tensor, ends: tuple[float, float, float], elem_span: int,
                  max_span: int) -> tuple[list[int], tuple[float, float], Tensor]:
    """The counts, live scales' extremes and live ranges' histogram of the groups' facts, in
    one pass (:func:`driftcli.kernels.blockcode.summary_kernel`)."""
    import driftcli.kernels.blockcode as code  # numba, on first use only

    out = np.zeros(9, dtype=np.int64)
    extremes = np.zeros(2, dtype=np.float64)
    ranges = np.zeros(max_span + 1, dtype=np.int64)
    code.summary_kernel(_array(top), _array(span), _array(bad), poison,
                        _array(scale.double()), _array(clipped), np.array(ends, np.float64),
                        elem_span, ranges, out, extremes)
    return out.tolist(), (float(extremes[0]), float(extremes[1])), torch.from_numpy(ranges)


def key_counts(keys: Tensor, finite: Tensor) -> tuple[int, Tensor]:
    """The smallest key of the ``finite`` groups and the groups per key from it up
    (:func:`driftcli.kernels.blockcode.key_counts_kernel`)."""
    import driftcli.kernels.blockcode as code  # numba, on first use only

    low, counts = code.key_counts_kernel(_array(keys.to(torch.int64)), _array(finite))
    return int(low), torch.from_numpy(counts)


def two_level_values(amax: Tensor, divisor: Tensor, consts: np.ndarray, drop: int
                     ) -> tuple[Tensor, Tensor] | None:
    """A two-level cast's block scales (float64, and their float32 bits) read back from its
    float32 ``divisor`` (:func:`driftcli.kernels.blockcode.two_level_values_kernel`); None
    where a divisor is below float32's normals."""
    import driftcli.kernels.blockcode as code  # numba, on first use only

    value = np.empty(divisor.numel(), dtype=np.float64)
    value32 = np.empty(divisor.numel(), dtype=np.float32)
    if not code.two_level_values_kernel(_array(amax), _array(divisor), consts, drop, value,
                                        value32):
        return None
    return torch.from_numpy(value), torch.from_numpy(value32.view(np.int32))


def fused_summary(top: Tensor, span: Tensor, bad: Tensor, poison: bool, ks: Tensor | None,
                  two: tuple[Tensor, Tensor, Tensor] | None, big: float, shift: int,
                  keys: tuple[int, int], ends: tuple[float, float, float], elem_span: int,
                  max_span: int) -> tuple[list[int], tuple[float, float], Tensor, Tensor]:
    """:func:`block_summary` and the scale-key counts (``keys``: the smallest key and how
    many) in one pass from a power-of-two scale's exponents ``ks`` or a two-level scale's
    float64 values, their float32 bits and the float32 divisors (``two``)
    (:func:`driftcli.kernels.blockcode.fused_summary_kernel`); the counts' tenth is 1 where a
    key fell outside ``keys``."""
    import driftcli.kernels.blockcode as code  # numba, on first use only

    out = np.zeros(10, dtype=np.int64)
    extremes = np.zeros(2, dtype=np.float64)
    ranges = np.zeros(max_span + 1, dtype=np.int64)
    kcounts = np.zeros(keys[1], dtype=np.int64)
    pow2 = ks is not None
    code.fused_summary_kernel(
        _array(top), _array(span), _array(bad), poison,
        _array(ks) if pow2 and ks is not None else _EMPTY[np.int64],
        _array(two[0]) if two is not None else np.zeros(0, np.float64),
        _array(two[2]) if two is not None else np.zeros(0, np.float32),
        _array(two[1]) if two is not None else _EMPTY[np.int32],
        big, shift, keys[0], kcounts, np.array(ends, np.float64), elem_span, ranges, out,
        extremes)
    return (out.tolist(), (float(extremes[0]), float(extremes[1])), torch.from_numpy(ranges),
            torch.from_numpy(kcounts))


_LAYOUT_BITS = {torch.float32: (23, 127), torch.float64: (52, 1023)}
"""Significand bits and exponent bias of the float layouts the kernels read."""


# --- the scan's fused passes (driftcli.kernels.statcode) ---------------------------------------

PIECE = 1 << 12
"""Elements per piece of the fused passes' sums (the unit a thread takes; each piece's float64
partials depend only on its elements, and :func:`clip_counts` adds them exactly, so a scan
whose slices start on multiples of it gets the whole tensor's sums, bit for bit)."""

_MASK = {torch.float32: 0x7FFFFFFF, torch.float64: 0x7FFFFFFFFFFFFFFF}
_INF_BITS = {torch.float32: 0x7F800000, torch.float64: 0x7FF0000000000000}


def _stat_code() -> Any:
    import driftcli.kernels.statcode as code  # numba, on first use only

    return code


def slice_facts(x: Tensor, chunk: int) -> tuple[Tensor | None, int, float]:
    """One read of a float32 or float64 slice ``x`` (flattened): the raw amax of each run of
    ``chunk`` consecutive elements (NaN where the run holds a NaN, else inf where an inf;
    None when ``chunk`` is 0 or does not divide the slice), its finite elements and their
    Σ|x| in float64."""
    values = _array(x)
    n = values.size
    bits = values.view(np.int32 if x.dtype == torch.float32 else np.int64)
    chunk = chunk if chunk and n % chunk == 0 else 0
    piece = chunk * max(1, PIECE // chunk) if chunk else PIECE
    pieces = -(-n // piece)
    tops = np.empty(n // chunk if chunk else 0, dtype=bits.dtype)
    finite = np.empty(pieces, dtype=np.int64)
    sums = np.empty(pieces, dtype=np.float64)
    if pieces:
        spread(_stat_code().facts_kernel, pieces, piece, bits, values, n, chunk, piece,
               _MASK[x.dtype], _INF_BITS[x.dtype], tops, finite, sums)
    counts, totals = _stat_code().add_pieces(np.zeros((0, 0), np.int64),
                                             np.zeros((0, 0), np.float64), finite, sums)
    amax = torch.from_numpy(tops).view(x.dtype) if chunk else None
    return amax, int(counts[0]), float(totals[0])


def finite_top(x: Tensor) -> float:
    """The largest finite magnitude of a float32 tensor (0 for none), in one read: the first
    read of the casts that need the tensor's amax."""
    bits = _array(x, torch.int32)
    n = bits.size
    pieces = -(-n // PIECE)
    tops = np.zeros(max(pieces, 1), dtype=np.int32)
    if pieces:
        spread(_stat_code().top_kernel, pieces, PIECE, bits, n, PIECE, tops)
    return float(tops.max().view(np.float32))


Expansion = tuple[float, ...]
"""A float64 sum kept exactly: non-overlapping partials, smallest first, whose exact sum is
the value (:func:`driftcli.kernels.statcode.expansions`); ``math.fsum`` of them rounds it
correctly."""


class ClipCounts(NamedTuple):
    """Per cast of :func:`clip_counts`: its clipped elements, groups with a clip, clamped
    scales, groups holding NaN or inf, and its clip excess; and the slice's finite elements
    and their Σ|x|. With the rounding, per cast also its nonzero, underflowed, subnormal and
    lost elements and its blocks out of float32's range (``rounded``), and its Σx², Σe², Σe·x
    and Σe (``sums``); else both empty. Every float64 sum is the exact sum of the pieces'
    partials, as an :data:`Expansion`."""

    counts: list[list[int]]
    excess: list[Expansion]
    finite: int
    abs_sum: Expansion
    rounded: list[list[int]]
    sums: list[list[Expansion]]


class Rounded(NamedTuple):
    """What :func:`clip_counts` rounds by: per cast its parameter vector (:data:`PARAMS`;
    the rounding mode and overflow policy, shared by every cast of the pass, are constants of
    its code), its stochastic draws (int32, one per element, or None), and its element
    format's ``qmin`` and ``emax``."""

    params: list[tuple[int, ...]]
    draws: list[Tensor | None]
    wide: list[tuple[int, int]]


def _rounded_arrays(what: str, rounded: Rounded | None, pieces: int, n_casts: int, n: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]:
    """A fused pass's rounded counts and sums (zeros; no columns without ``rounded``), the
    casts' parameter vectors, their draws (one row a cast, empty where none draws) and the
    rounding and overflow codes they share (constants of the kernel's code)."""
    code = _stat_code()
    r_counts = np.zeros((pieces, n_casts, code.N_ROUNDED if rounded else 0), dtype=np.int64)
    r_sums = np.zeros((pieces, n_casts, code.N_ROUNDED_SUMS if rounded else 0))
    ps = np.zeros((n_casts, len(PARAMS)), dtype=np.int64)
    draws = np.zeros((n_casts, 0), dtype=np.int32)
    modes = (0, 0)
    if rounded is not None:
        ps = np.array(rounded.params, dtype=np.int64).reshape(n_casts, len(PARAMS))
        modes = (int(ps[0, 13]), int(ps[0, 14])) if n_casts else modes
        if any(tuple(int(v) for v in row[13:15]) != modes for row in ps):
            raise DriftError(f"{what}: the casts of one rounded pass share their rounding "
                             "and overflow")
        if any(d is not None for d in rounded.draws):
            draws = np.zeros((n_casts, n), dtype=np.int32)
            for c, d in enumerate(rounded.draws):
                if d is not None:
                    draws[c] = _array(d.to(torch.int32))
    return r_counts, r_sums, ps, draws, modes


def clip_counts(x: Tensor, routes: list[Any], sexp: list[int], div: list[float],
                tensor_amax: float, rounded: Rounded | None = None) -> ClipCounts:
    """Every cast's clips in one read of a contiguous float32 slice ``x``, flattened
    (:func:`driftcli.kernels.statcode.clips_kernel`): ``routes`` are the casts'
    :class:`driftcli.casts.route.FlatRoute`, ``sexp`` and ``div`` the one-scale routes'
    exponent or divisor, ``tensor_amax`` the tensor's largest finite magnitude (two-level
    scales); with ``rounded``, in the same pass every cast's rounded counts and sums."""
    values = _array(x)
    bits = values.view(np.int32)
    n = values.size
    pieces = -(-n // PIECE)
    n_casts = len(routes)
    run = math.gcd(16, *(r.block for r in routes if r.block))
    code = _stat_code()
    counts = np.zeros((pieces, n_casts, code.N_CLIPS), dtype=np.int64)
    excess = np.zeros((pieces, n_casts), dtype=np.float64)
    finite = np.zeros(pieces, dtype=np.int64)
    sums = np.zeros(pieces, dtype=np.float64)
    blocks = np.array([r.block or run for r in routes], dtype=np.int64)
    kinds = np.array([code.STEPS.index(str(r.kind)) for r in routes], dtype=np.int64)
    two = {tuple(int(v) for v in r.q) for r, k in zip(routes, kinds, strict=True)
           if k == code.TWO_LEVEL}
    if len(two) > 1:
        raise DriftError("clip_counts: the two-level casts of one pass share their scale "
                         "format and its rounding")
    r_counts, r_sums, ps, draws, modes = _rounded_arrays("clip_counts", rounded, pieces,
                                                         n_casts, n)
    wide = np.zeros((n_casts, 2), dtype=np.int64)
    if rounded is not None:
        wide = np.array(rounded.wide, dtype=np.int64).reshape(n_casts, 2)
    if pieces:
        spread(code.clips_kernel(run, two.pop() if two else (0,) * len(PARAMS),
                                 rounded is not None, *modes),
               pieces, PIECE, bits, values, n, PIECE, kinds, blocks,
               np.array([r.blocked for r in routes], dtype=np.bool_),
               np.stack([r.rule for r in routes]), np.stack([r.consts for r in routes]),
               np.array([r.ends for r in routes], dtype=np.float64),
               np.array(sexp, dtype=np.int64), np.array(div, dtype=np.float32),
               int(np.float32(tensor_amax).view(np.int32)), counts, excess, finite, sums,
               ps, draws, wide, r_counts, r_sums)
    # the pieces' partials added exactly: the same expansions' sums whatever the threads and,
    # for pieces on the tensor's piece boundaries, whatever the slicing
    parts, lens = code.expansions(np.concatenate(
        (excess, sums[:, None], r_sums.reshape(pieces, -1)), axis=1))
    exp = [tuple(parts[k, :m].tolist()) for k, m in enumerate(lens.tolist())]
    n_sums = r_sums.shape[2]
    return ClipCounts(counts.sum(axis=0).tolist(), exp[:n_casts], int(finite.sum()),
                      exp[n_casts], r_counts.sum(axis=0).tolist(),
                      [exp[n_casts + 1 + c * n_sums:n_casts + 1 + (c + 1) * n_sums]
                       for c in range(n_casts)] if rounded is not None else [])


def cast_counts(blocks: Tensor, cols: int, random: Tensor | None, sexp: Tensor | None,
                div: Tensor | None, bad: Tensor | None, amax: Tensor, p: tuple[int, ...],
                ends: tuple[float, float, float], rounded: bool, want_q: bool
                ) -> tuple[list[int], list[float], Tensor | None]:
    """Every element of a contiguous float32 or float64 ``blocks`` (scale groups of ``cols``
    consecutive elements) cast under its group's scale, and counted in one pass: the six
    counts of :data:`driftcli.kernels.statcode.N_COUNTS` and five float64 sums of
    ``N_SUMS``, and the cast values when ``want_q``. ``sexp`` holds the exponent of each
    group's power-of-two scale, else ``div`` its divisor; ``bad`` the groups that are NaN
    whole; ``amax`` each group's largest finite magnitude (float64)."""
    values = _array(blocks)
    n = values.size
    itype = np.int32 if blocks.dtype == torch.float32 else np.int64
    bits = values.view(itype)
    piece = cols * max(1, PIECE // cols) if cols < n else PIECE
    pieces = -(-n // piece)
    counts = np.zeros((pieces, 6), dtype=np.int64)
    sums = np.zeros((pieces, 5), dtype=np.float64)
    out = np.empty_like(values) if want_q else values[:0]
    draws = _flat(None if random is None else random.to(_INT[blocks.dtype]))
    pow2 = sexp is not None
    exps = _flat(sexp.to(torch.int64)) if sexp is not None else _EMPTY[np.int64]
    divs = _array(div.to(blocks.dtype)) if div is not None else values[:0]
    flags = _flat(bad)
    kernel = _stat_code().counts_kernel(pow2, rounded, flags is not None, want_q, p[13], p[14])
    if pieces:
        spread(kernel, pieces, piece, bits, values, _or_empty(draws, itype), exps,
               divs if divs.size else np.ones(1, dtype=values.dtype),
               _or_empty(flags, np.bool_), _array(amax.double()), cols, piece, n, out, counts,
               sums, p, np.asarray(ends, dtype=np.float64))
    c, s = _stat_code().add_pieces(counts, sums, np.zeros(0, np.int64), np.zeros(0))
    q = torch.from_numpy(out).view(blocks.shape) if want_q else None
    return [int(v) for v in c[:6]], [float(v) for v in s[:5]], q


# --- a block-scaled cast's scales in one pass (driftcli.kernels.castcode) -----------------------

def _cast_code() -> Any:
    import driftcli.kernels.castcode as code  # numba, on first use only

    return code


NO_ROW = 1 << 40
"""Stands for "no row" in the exponent range :func:`pow2_block_scales` returns (the value of
:data:`driftcli.kernels.castcode.NONE`, kept here so that reading it imports no numba)."""


class BlockScales(NamedTuple):
    """Per row of a block layout: its scale (the exponent ``k`` of ``2**k``, or the float32
    divisor), whether it holds NaN or inf, its largest finite magnitude; and over all rows,
    the smallest and largest exponent (power-of-two rules; ``NO_ROW`` and ``-NO_ROW`` for
    none) and how many rows without NaN or inf had their scale clamped."""

    scale: Tensor
    bad: Tensor
    amax: Tensor
    kmin: int
    kmax: int
    clamped: int


def pow2_block_scales(blocks: Tensor, rule: np.ndarray) -> BlockScales:
    """Per row of a contiguous 2-D float32 ``blocks``: the exponent of its power-of-two scale
    under ``rule`` (:func:`driftcli.kernels.castcode.pow2_scales`), with the rest of
    :class:`BlockScales`."""
    rows, cols = blocks.shape
    ks = np.empty(rows, dtype=np.int64)
    bad = np.empty(rows, dtype=np.bool_)
    tops = np.empty(rows, dtype=np.int32)
    kmin, kmax, clamped = _cast_code().pow2_scales(_array(blocks, torch.int32), cols, ks, bad,
                                                   rule, tops)
    return BlockScales(torch.from_numpy(ks), torch.from_numpy(bad),
                       torch.from_numpy(tops.view(np.float32)), int(kmin), int(kmax),
                       int(clamped))


def two_level_block_scales(blocks: Tensor, consts: np.ndarray, q: tuple[int, ...],
                           tensor_amax: float | None = None) -> BlockScales:
    """Per row of a contiguous 2-D float32 ``blocks``: the float32 divisor of a two-level
    (NVFP4) scale (:func:`driftcli.kernels.castcode.two_level_scales`), with the rest of
    :class:`BlockScales`; ``tensor_amax`` is the whole tensor's when ``blocks`` are a slice
    of it (else the rows' largest)."""
    rows, cols = blocks.shape
    divisor = np.empty(rows, dtype=np.float32)
    bad = np.empty(rows, dtype=np.bool_)
    tops = np.empty(rows, dtype=np.int32)
    given = -1 if tensor_amax is None else int(np.float32(tensor_amax).view(np.int32))
    clamped = _cast_code().two_level_scales(_array(blocks, torch.int32), cols, divisor, bad,
                                            consts, np.asarray(q, dtype=np.int64), tops, given)
    return BlockScales(torch.from_numpy(divisor), torch.from_numpy(bad),
                       torch.from_numpy(tops.view(np.float32)), NO_ROW, -NO_ROW, int(clamped))


def round_pow2_rows(blocks: Tensor, random: Tensor | None, ks: Tensor, bad: Tensor,
                    p: tuple[int, ...]) -> Tensor:
    """Rows of a contiguous 2-D float32 ``blocks`` rounded (``p``: ``rne`` or ``sr``, a signed
    format with zero) on the grid scaled by ``2**ks[row]``, a ``bad`` row NaN
    (:func:`driftcli.kernels.castcode.pow2_round_kernel`: :func:`round_bits`' bits, in fewer
    steps)."""
    rows, cols = blocks.shape
    kernel = _cast_code().pow2_round_kernel(p[13], p[14], random is not None)
    draws = _EMPTY[np.int32] if random is None else _array(random.to(torch.int32))
    view = _array(blocks, torch.int32)
    out = np.empty_like(view)
    spread(kernel, rows, cols, view, draws, _array(ks), _array(bad), cols, out, p)
    return torch.from_numpy(out).view(torch.float32).view(rows, cols)


# --- the simulated matmul's accumulation (driftcli.kernels.accumcode) --------------------------

def _accum_code() -> Any:
    import driftcli.kernels.accumcode as code  # numba, on first use only

    return code


def accumulate(a: Tensor, b: Tensor, a_of: Tensor, b_of: Tensor, m: int, order: str,
               chunk: int, kind: str, drop: int, p: tuple[int, ...], pm: tuple[int, ...]
               ) -> Tensor:
    """The simulated matmul's accumulated sums (:func:`driftcli.kernels.accumcode.accum_kernel`)
    as a ``(len(a_of) * m, N)`` tensor in the dtype of ``a`` and ``b`` (float32 or float64):
    ``a`` is ``(rows_a, K)``, ``b`` is ``(rows_b, N)``, output row ``i`` of batch ``i // m``
    sums ``a[a_of[batch] * m + i % m, j] * b[b_of[batch] * K + j, :]`` over ``j`` in
    ``order`` (``sequential``, ``chunked`` with ``chunk`` terms per chunk, ``pairwise``) with
    steps of ``kind`` (float32: ``plain``, ``layout`` with ``drop`` bits cut, ``rounded``;
    float64 steps are always rounded) rounding by ``p``, the chunks' master sum by ``pm``."""
    code = _accum_code()
    k = a.shape[1]
    rows, n = a_of.numel() * m, b.shape[1]
    wide = a.dtype == torch.float64
    out = np.zeros((rows, n), dtype=np.float64 if wide else np.float32)
    if rows == 0 or n == 0:
        return torch.from_numpy(out)
    number = {"sequential": code.SEQUENTIAL, "chunked": code.CHUNKED,
              "pairwise": code.PAIRWISE}[order]
    kinds = {"plain": code.PLAIN, "layout": code.LAYOUT, "rounded": code.ROUNDED}
    kernel = code.accum_kernel(wide, code.WIDE if wide else kinds[kind], p[13])
    spread(kernel, rows, max(n * k, 1), a.contiguous().numpy(), b.contiguous().numpy(),
           _array(a_of.to(torch.int64)), _array(b_of.to(torch.int64)), m, k, number,
           max(chunk, 1), np.asarray(p, dtype=np.int64), np.asarray(pm, dtype=np.int64),
           drop, out)
    return torch.from_numpy(out)


# --- four over six's errors (driftcli.kernels.fourcode) ----------------------------------------

def four_over_six_errors(blocks: Tensor, inv4: Tensor, inv6: Tensor, sb4: Tensor, sb6: Tensor,
                         t: Tensor, enc: Tensor, g: float, p: tuple[int, ...], squared: bool,
                         fp16: bool) -> tuple[Tensor, Tensor]:
    """Per row of a contiguous 2-D float32 ``blocks``: the map-to-4 and map-to-6 candidates'
    errors (:func:`driftcli.kernels.fourcode.errors_kernel`; ``t`` the tensor amax and ``enc``
    the encode scale, float32, one value or one per row (row-scaled), ``g`` the global max)."""
    import driftcli.kernels.fourcode as code  # numba, on first use only

    rows, cols = blocks.shape
    err4 = np.empty(rows, dtype=np.float32)
    err6 = np.empty(rows, dtype=np.float32)
    kernel = code.errors_kernel(p[13], p[14], squared, fp16)
    spread(kernel, rows, cols, _array(blocks), *(_array(v.float()) for v in (inv4, inv6, sb4, sb6)),
           _array(t.float().reshape(-1)), _array(enc.float().reshape(-1)), np.float32(g), cols,
           err4, err6, p)
    return torch.from_numpy(err4), torch.from_numpy(err6)


def hadamard16(groups: Tensor, entries: tuple[float, ...]) -> Tensor:
    """The random Hadamard transform of each row of a contiguous ``(n, 16)`` float32 or
    float64 ``groups`` under the row-major matrix ``entries``
    (:func:`driftcli.kernels.rhtcode.rht_kernel`): float32 values on bfloat16's grid."""
    import driftcli.kernels.rhtcode as code  # numba, on first use only

    n = groups.shape[0]
    out = np.empty(n * 16, dtype=np.float32)
    spread(code.rht_kernel, n, 16 * 16, _array(groups), np.asarray(entries, dtype=np.float32),
           out, out.view(np.uint32))
    return torch.from_numpy(out).view(n, 16)


def four_over_six_values(blocks: Tensor, amax: Tensor, scales: tuple[Tensor, Tensor, Tensor],
                         consts: tuple[float, ...], p: tuple[int, ...], ps: tuple[int, ...],
                         squared: bool, fp16: bool, runs: int = 1, per: int = 0) -> Tensor:
    """A whole four-over-six cast of each row of a contiguous 2-D float32 ``blocks`` (every
    element finite, ``amax`` each row's; a row a block, or with ``runs`` 16 a 16 x 16 tile) in
    one pass: its scales, both candidates, their errors, the choice and the chosen values
    (:func:`driftcli.kernels.fourcode.values_kernel`; ``scales`` the tensor amax, encode and
    decode scales, float32, or with ``per`` > 0 (row-scaled: that many blocks a row) unused,
    each row's made in the kernel; ``consts`` the other float32 constants, ``p`` the
    elements' rounding, ``ps`` the block scales')."""
    import driftcli.kernels.fourcode as code  # numba, on first use only

    rows, cols = blocks.shape
    out = np.empty(rows * cols, dtype=np.float32)
    t, enc, dec = (_array(v.float().reshape(-1)) for v in scales)
    kernel = code.values_kernel(p[13], p[14], squared, fp16, cols, nearest_saturates(p),
                                nearest_saturates(ps), per > 0, runs)
    spread(kernel, rows, cols, _array(blocks), _array(amax.float()), t, enc, dec,
           np.asarray(consts, dtype=np.float32), max(per, 1), out,
           np.asarray(p, dtype=np.int64), np.asarray(ps, dtype=np.int64))
    return torch.from_numpy(out).view(rows, cols)


def nearest_saturates(p: tuple[int, ...]) -> bool:
    """Whether :func:`driftcli.kernels.fourcode.nearest_saturated` rounds float32 onto the
    grid of ``p`` (scaled by ``2**0``) as ``round_lean`` does: nearest even, saturating, a
    signed format with a zero and a negative zero, 1 to 22 fraction bits (ties by the kept
    bit), normals from ``2**-126`` up, and every magic constant a float32 normal."""
    ebits, mbits, emin, t_mbits, qmax = p[0], p[1], p[2], p[3], p[4]
    signed, has_inf, has_nan, has_zero, has_neg_zero, rounding, overflow = (
        p[7], p[8], p[9], p[10], p[11], p[13], p[14])
    saturating = overflow == 0 or not (has_inf or has_nan)
    tapered = p[16] != 0 or p[17] != 0  # a grid whose binades differ in width
    return bool((ebits, mbits) == (8, 23) and rounding == 0 and saturating and signed
                and not tapered
                and has_zero and has_neg_zero and 1 <= t_mbits <= 22 and emin >= -126
                and qmax + t_mbits + 1 - t_mbits + 150 <= 254)


def micro_block_scales(blocks: Tensor, levels: np.ndarray, ints: np.ndarray,
                       consts: np.ndarray) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per row of a contiguous 2-D float32 ``blocks``: a multi-level cast's first-level scale
    and multiplier (float64), NaN-or-inf flag, clamp flag, and each element's total
    micro-exponent (:func:`driftcli.kernels.microcode.micro_scales`, whose scale choice is
    :func:`~driftcli.kernels.microcode.row_scales`, the one :func:`micro_cast` runs)."""
    import driftcli.kernels.microcode as code  # numba, on first use only

    rows, cols = blocks.shape
    s = np.empty(rows, dtype=np.float64)
    r = np.empty(rows, dtype=np.float64)
    bad = np.empty(rows, dtype=np.bool_)
    clamped = np.empty(rows, dtype=np.bool_)
    exps = np.empty(rows * cols, dtype=np.int64)
    spread(code.micro_scales, rows, cols, _array(blocks), _array(blocks, torch.int32), cols,
           levels, ints, consts, s, r, bad, clamped, exps)
    return (torch.from_numpy(s), torch.from_numpy(r), torch.from_numpy(bad),
            torch.from_numpy(clamped), torch.from_numpy(exps).view(rows, cols))


def micro_cast(blocks: Tensor, random: Tensor | None, levels: np.ndarray, ints: np.ndarray,
               consts: np.ndarray, p: tuple[int, ...]) -> Tensor:
    """A multi-level cast of the rows of a contiguous 2-D float32 ``blocks`` in one pass
    (:func:`driftcli.kernels.microcode.cast_kernel`): float32 values, NaN rows for blocks
    holding NaN or inf; ``p`` the float64 source's rounding parameters."""
    import driftcli.kernels.microcode as code  # numba, on first use only

    rows, cols = blocks.shape
    out = np.empty(rows * cols, dtype=np.float32)
    draws = _flat(None if random is None else random.to(torch.int64))
    inner = int(levels[-1, 0]) if len(levels) else cols  # constants of the kernel's code
    kernel = code.cast_kernel(p[13], p[14], draws is not None,
                              code.wide_nearest_applies(p, p[13], draws is not None), cols,
                              inner)
    spread(kernel, rows, cols, _array(blocks), _array(blocks, torch.int32), cols, levels, ints,
           consts, np.asarray(p, dtype=np.int64), _or_empty(draws, np.int64), out)
    return torch.from_numpy(out).view(rows, cols)


class GivenOperands(NamedTuple):
    """One cast's operands for :func:`given_counts`, made by its scale step beforehand
    (:mod:`driftcli.casts.given`)."""

    wide: bool
    """Micro-exponents: ``y = x · in`` in float64, rounded from float64; else a scale
    arithmetic's float32 operations."""
    mul: bool
    """The elements are multiplied by ``ins`` (else divided)."""
    div: bool
    """The codes are divided by ``outs`` (else multiplied)."""
    sub: int
    """Elements per run of one operand (the slice's length for one)."""
    group: int
    """Elements per scale group, a multiple of ``sub`` (the slice's length for one group)."""
    ins: np.ndarray
    """float64, per run: what the elements meet on the way in."""
    outs: np.ndarray
    """float64, per run: what the codes meet on the way out."""
    lims: np.ndarray
    """float64, per group: the scale reported, ``max`` times which each clip's excess is."""
    flags: np.ndarray
    """uint8, per group: :data:`driftcli.kernels.statcode.NAN_Q` and ``NO_CLIP``."""
    ends: tuple[float, float, float]
    """The element format's max, min and smallest normal."""


class GivenCounts(NamedTuple):
    """Per cast of :func:`given_counts`: its clipped elements, groups with a clip and clip
    excess; the slice's finite elements and their Σ|x|; with the rounding per cast its nonzero,
    underflowed, subnormal and lost elements and its Σx², Σe², Σe·x, Σe (else empty). Every
    float64 sum is an :data:`Expansion`, as :func:`clip_counts` gives them."""

    clipped: list[int]
    clipped_groups: list[int]
    excess: list[Expansion]
    finite: int
    abs_sum: Expansion
    rounded: list[list[int]]
    sums: list[list[Expansion]]


def given_counts(x: Tensor, casts: list[GivenOperands], rounded: Rounded | None = None
                 ) -> GivenCounts:
    """Every cast's clips (and with ``rounded`` its rounded counts and sums: ``wide`` unused)
    in one read of a contiguous float32 slice ``x``, flattened, under the operands its scale
    step gave (:func:`driftcli.kernels.statcode.given_kernel`)."""
    values = _array(x)
    bits = values.view(np.int32)
    n = values.size
    pieces = -(-n // PIECE)
    n_casts = len(casts)
    code = _stat_code()
    offs = np.cumsum([0] + [g.ins.size for g in casts])
    goffs = np.cumsum([0] + [g.flags.size for g in casts])
    counts = np.zeros((pieces, n_casts), dtype=np.int64)
    excess = np.zeros((pieces, n_casts), dtype=np.float64)
    hits = np.zeros(int(goffs[-1]), dtype=np.bool_)
    finite = np.zeros(pieces, dtype=np.int64)
    sums = np.zeros(pieces, dtype=np.float64)
    r_counts, r_sums, ps, draws, modes = _rounded_arrays("given_counts", rounded, pieces,
                                                         n_casts, n)
    if pieces and n_casts:
        spread(code.given_kernel(rounded is not None, *modes), pieces, PIECE, bits, values, n,
               PIECE, np.array([g.wide for g in casts], dtype=np.bool_),
               np.array([g.mul for g in casts], dtype=np.bool_),
               np.array([g.div for g in casts], dtype=np.bool_),
               np.array([g.sub for g in casts], dtype=np.int64),
               np.array([g.group for g in casts], dtype=np.int64),
               offs[:-1].astype(np.int64), goffs[:-1].astype(np.int64),
               np.concatenate([g.ins for g in casts]), np.concatenate([g.outs for g in casts]),
               np.concatenate([g.lims for g in casts]),
               np.concatenate([g.flags for g in casts]),
               np.array([g.ends for g in casts], dtype=np.float64), ps, draws, counts, excess,
               hits, finite, sums, r_counts, r_sums)
    parts, lens = code.expansions(np.concatenate(
        (excess, sums[:, None], r_sums.reshape(pieces, -1)), axis=1))
    exp = [tuple(parts[k, :m].tolist()) for k, m in enumerate(lens.tolist())]
    n_sums = r_sums.shape[2]
    return GivenCounts(
        counts.sum(axis=0).tolist(),
        [int(hits[goffs[c]:goffs[c + 1]].sum()) for c in range(n_casts)], exp[:n_casts],
        int(finite.sum()), exp[n_casts], r_counts.sum(axis=0).tolist(),
        [exp[n_casts + 1 + c * n_sums:n_casts + 1 + (c + 1) * n_sums] for c in range(n_casts)]
        if rounded is not None else [])
