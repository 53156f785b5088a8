"""When drift runs its kernels through ``torch.compile``: the compile policy.

Every compiled function gives the bits its eager version gives (the tests compare them over
boundary-heavy inputs); compiling only changes the time. A function is compiled once per
process (dynamic shapes; each format, mode and policy is its own graph), for calls large
enough to pay for the compile, and only where inductor's code for this machine's instruction
set is checked (:func:`compile_unavailable`). A compile that fails leaves that function eager
for the rest of the process, with the same answer.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from driftcli.errors import DriftError

_COMPILE_MODES = ("auto", "always", "never")
COMPILE_MIN_ELEMENTS = 1 << 25
"""In ``auto``, compile only for a single call this large: below it, compiling (tens of
seconds for the first kernel in a process, seconds for each new variant; measured in
``docs/performance.md``) costs more than it saves."""
_compile_mode = os.environ.get("DRIFT_COMPILE", "auto")


def set_compile(mode: str) -> None:
    """Choose when rounding uses ``torch.compile``: ``auto`` (large calls), ``always``, ``never``.

    The compiled kernel gives results bit-identical to the eager one; when
    compilation is unavailable (no C++ compiler, an instruction set whose code is not checked:
    :func:`compile_unavailable`) drift falls back to eager without a word.
    """
    global _compile_mode
    if mode not in _COMPILE_MODES:
        raise DriftError(f"unknown compile mode {mode!r}; choose from {', '.join(_COMPILE_MODES)}")
    _compile_mode = mode


CHECKED_VECTOR_ISAS = ("avx512",)
"""Vector ISAs on which inductor's code for drift's kernels is checked bit for bit against
eager (the compiled-against-eager tests); on any other, drift stays eager."""
_ISA_FAULTS = {
    "avx2": "torch 2.13 selects the wrong lanes in integer where(): every value can be wrong",
    "scalar": "ATEN_CPU_CAPABILITY=default asks for it, and it does not build",
}
"""What goes wrong with inductor's code for drift's kernels on other ISAs (torch 2.13)."""


@cache
def compile_unavailable() -> str | None:
    """Why drift does not use ``torch.compile`` in this process, or None when it does."""
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        return "no C++ compiler: every cast is eager"
    from torch._inductor import cpu_vec_isa

    picked = cpu_vec_isa.pick_vec_isa()
    # AVX-512 with VNNI or AMX is AVX-512 code with more instructions at hand
    isa = ("scalar" if not picked else
           "avx512" if isinstance(picked, cpu_vec_isa.VecAVX512) else str(picked))
    if isa not in CHECKED_VECTOR_ISAS:
        why = _ISA_FAULTS.get(isa, "its output is not checked against eager on this ISA")
        return f"inductor's {isa} code is not used ({why}), so every cast is eager"
    # keep inductor's cache between runs, under the user's cache directory
    cache_home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_home, "drift", "inductor"))
    return None


RECOMPILE_LIMIT = 256
"""Compiled variants per function (format x mode x policy x argument kinds) before eager: a
format's constants (its max, smallest normal) are part of each variant, so a scan of many
casts needs several per cast."""
_COMPILED: dict[Callable[..., Any], Any] = {}
_BROKEN: set[Callable[..., Any]] = set()
"""Functions whose compiled version failed once: they stay eager in this process."""


def compiled(fn: Callable[..., Any], numel: int) -> Callable[..., Any] | None:
    """``fn`` compiled (dynamic shapes), when the compile policy wants it for ``numel`` elements
    (0: never) and compilation works here; otherwise None, and the caller runs eagerly."""
    if _compile_mode not in _COMPILE_MODES:
        raise DriftError(f"DRIFT_COMPILE={_compile_mode!r} is not a compile mode; "
                         f"use one of {', '.join(_COMPILE_MODES)}")
    use = numel > 0 and (_compile_mode == "always" or (
        _compile_mode == "auto" and numel >= COMPILE_MIN_ELEMENTS))
    if not use or fn in _BROKEN or compile_unavailable() is not None:
        return None
    if fn not in _COMPILED:
        try:
            _COMPILED[fn] = torch.compile(fn, dynamic=True)
        except (RuntimeError, ImportError):  # pragma: no cover - platform without inductor
            return None
    return _COMPILED[fn]


def forced() -> bool:
    """Whether ``DRIFT_COMPILE=always`` (or ``set_compile("always")``) asks for inductor's
    code wherever drift has a compiled function, ahead of the numba kernels."""
    return _compile_mode == "always"


def run_compiled(fn: Callable[..., Any], numel: int, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` compiled if :func:`compiled` says so; None when it did not run compiled."""
    fast_fn = compiled(fn, numel)
    if fast_fn is None:
        return None
    try:
        # each format, mode and policy is its own graph: allow many, and when even that runs
        # out, fail loudly into the chunked eager path rather than dynamo's whole-tensor eager.
        # Float arguments (a format's max) are constants of the graph: unspecialised, they
        # become tensor inputs and the element loops stop vectorising (several times slower).
        # Integer arguments (a format's bit counts) too: unspecialised, inductor writes
        # `1 << (ks1)` with a 32-bit 1 into its C++, wrong for float64's 52 fraction bits
        # (and right for float32's masks only by two's complement wrap-around)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                        fail_on_recompile_limit_hit=True,
                                        specialize_float=True, specialize_int=True):
            return fast_fn(*args, **kwargs)
    except Exception:  # any compiler failure means: stay eager, same answer
        _BROKEN.add(fn)
        return None




def fell_back(fn: Callable[..., Any] | None = None) -> bool:
    """Whether ``fn`` (or, without it, any function) failed to compile in this process and
    runs eagerly from now on."""
    return bool(_BROKEN) if fn is None else fn in _BROKEN


def compiled_names() -> list[str]:
    """The functions compiled in this process so far (and not fallen back), by name."""
    return [fn.__qualname__ for fn in _COMPILED if fn not in _BROKEN]


def was_compiled(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` has been compiled in this process and did not fall back."""
    return fn in _COMPILED and fn not in _BROKEN
