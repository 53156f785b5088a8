"""drift's kernels as machine code: numba compiles them with the LLVM it bundles (no system
compiler), once per machine, and keeps the code on disk between processes.

Each kernel is the element rule of :mod:`driftcli.rounding` written for one element (the same
integer steps on the same bit fields, so the same bits: the tests run every format, rounding
and overflow policy through both and compare, and ``drift verify-formats`` runs on each path),
plus the block amax that block scalings read. The work is split into slices that threads run
side by side, as many as torch's thread count, with the interpreter lock released.

Without numba (or with ``DRIFT_JIT=never``) drift runs the torch kernels instead: same bits,
slower. :func:`jit_unavailable` says why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

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
        import driftcli.jitkernels  # noqa: F401
    except ImportError as err:
        return f"numba is not importable ({err}): pip install numba"
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
          "overflow", "sr_bits")
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
    ``src_mbits`` onto ``tgt`` (a :class:`driftcli.rounding.Target`)."""
    own = {"s_ebits": src_ebits, "s_mbits": src_mbits, "t_mbits": tgt.mbits,
           "rounding": ROUNDING_CODES.index(rounding),
           "overflow": OVERFLOW_CODES.index(overflow), "sr_bits": sr_bits}
    return tuple(int(own[name]) if name in own else int(getattr(tgt, name)) for name in PARAMS)


def usable(*tensors: Tensor | None) -> bool:
    """Whether the numba kernels take these tensors: numba is at hand and every tensor is on
    the CPU."""
    return jit_unavailable() is None and not torch.compiler.is_compiling() and all(
        t is None or (t.device.type == "cpu" and not t.requires_grad) for t in tensors)


def _flat(t: Tensor | None, dtype: torch.dtype | None = None) -> np.ndarray | None:
    if t is None:
        return None
    return _array(t, dtype)


def _array(t: Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """``t`` as a flat numpy view (of its bits as ``dtype`` when given)."""
    t = t.contiguous() if dtype is None else t.contiguous().view(dtype)
    return t.reshape(-1).numpy()


def _or_empty(a: np.ndarray | None, itype: type) -> np.ndarray:
    return _EMPTY[itype] if a is None else a


def _code() -> Any:
    import driftcli.jitkernels as code  # numba, on first use only

    return code


def round_bits(x: Tensor, residual: Tensor | None, random: Tensor | None,
               scale_exp: Tensor | None, p: tuple[int, ...], bad: Tensor | None = None) -> Tensor:
    """The rounding kernel of :mod:`driftcli.rounding` on a contiguous float32 or float64
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
    kernel = _code().flat_kernel(p[13], p[14], lean, res is not None, draws is not None,
                                 sexp is not None, flags is not None)
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
    the row holds NaN or inf (the values of :func:`driftcli.scaling.block_stats`)."""
    rows, cols = blocks.shape
    bits = _array(blocks, _INT[blocks.dtype])
    top = np.empty(rows, dtype=bits.dtype)
    bad = np.empty(rows, dtype=np.bool_)
    inf_bits = 0x7F800000 if blocks.dtype == torch.float32 else 0x7FF0000000000000
    if rows:
        spread(_code().block_amax, rows, cols, bits, cols, top, bad, inf_bits)
    return torch.from_numpy(top).view(blocks.dtype), torch.from_numpy(bad)
