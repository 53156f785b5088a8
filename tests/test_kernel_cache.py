"""numba's disk cache serves drift's kernels in every later process: a kernel made by a factory
(a closure) is cached under a key that holds its captured values pickled, so a closure over
anything whose pickle differs per process (a compiled function: its dispatcher pickles with a
fresh id) is compiled again in every process. Every factory's kernel captures plain values
only, and a second process running a scan compiles nothing."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numba import njit
from numba.core.dispatcher import Dispatcher

import driftcli.kernels

_PLAIN = (bool, int, float, str, type(None), np.generic)


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def closure_misfits(kernel: Dispatcher) -> list[str]:
    """The names a kernel's closure captures whose values are not plain numbers, strings or
    tuples of them (their pickles, part of numba's cache key, may differ per process)."""
    func = kernel.py_func
    cells = func.__closure__ or ()
    return [name for name, cell in zip(func.__code__.co_freevars, cells, strict=True)
            if not _plain(cell.cell_contents)]


def _argument(annotation: str) -> Any:
    """A value of a factory's parameter: only captured, never compiled here."""
    if annotation.startswith("bool"):
        return False
    if annotation.startswith("tuple"):
        return tuple(range(18))  # a parameter vector's length (jit.PARAMS)
    return 16


def _factories() -> Iterator[tuple[str, Callable[..., Any]]]:
    """Every cached kernel factory of drift's numba modules (a function whose code defines an
    inner function), found rather than listed: a new factory is checked too."""
    for info in pkgutil.iter_modules(driftcli.kernels.__path__):
        if not info.name.endswith("code"):
            continue
        module = importlib.import_module(f"driftcli.kernels.{info.name}")
        for name, obj in vars(module).items():
            func = getattr(obj, "__wrapped__", None)
            if (func is not None and getattr(func, "__module__", None) == module.__name__
                    and any(inspect.iscode(c) and c.co_freevars
                            for c in func.__code__.co_consts)):
                yield f"{info.name}.{name}", obj


def test_the_factories_are_found() -> None:
    names = {name for name, _ in _factories()}
    assert {"statcode.clips_kernel", "statcode.counts_kernel", "jitcode.flat_kernel",
            "castcode.pow2_round_kernel", "microcode.cast_kernel", "fourcode.values_kernel",
            "fmacode.fma_kernel", "accumcode.accum_kernel"} <= names


def test_no_kernel_closes_over_a_value_that_pickles_per_process() -> None:
    misfits: dict[str, list[str]] = {}
    for name, factory in _factories():
        params = inspect.signature(factory).parameters.values()
        kernel = factory(*(_argument(str(p.annotation)) for p in params))
        # cached on disk (numba keeps a NullCache for a kernel without cache=True)
        assert isinstance(kernel, Dispatcher)
        assert type(vars(kernel)["_cache"]).__name__ != "NullCache"
        if closure_misfits(kernel):
            misfits[name] = closure_misfits(kernel)
    assert misfits == {}


def test_a_closure_over_a_compiled_function_is_caught() -> None:
    """The planted fault: the bug found in clips_kernel (efca379), a dispatcher captured."""
    @njit(cache=True)
    def helper(x: int) -> int:
        return x + 1

    def factory(k: int) -> Dispatcher:
        step = helper

        @njit(cache=True)
        def kernel(x: int) -> int:
            return step(x) * k

        return kernel

    assert closure_misfits(factory(3)) == ["step"]


SCAN = """
import torch, driftcli as drift
g = torch.Generator().manual_seed(0)
x = {"w": torch.randn(64, 256, generator=g) * 3, "e": torch.randn(32, 128, generator=g) * 1e3}
for what in ("clip-rate", "underflow-rate"):
    drift.measure(x, ["fp8_e4m3", "mxfp8_e4m3", "nvfp4"], what)
"""


def _cache_files(cache: Path) -> dict[str, int]:
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns
            for p in cache.rglob("*") if p.is_file()}


@pytest.mark.slow  # the first process compiles a scan's kernels: about 30 s of one core
def test_a_second_process_compiles_no_kernel_of_a_scan(tmp_path: Path) -> None:
    """Every kernel the scan's first process compiled and saved, the second loads: it saves
    no index or machine code of its own."""
    cache = tmp_path / "numba"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, "-c", SCAN], check=True, env=env, capture_output=True)
    first = _cache_files(cache)
    subprocess.run([sys.executable, "-c", SCAN], check=True, env=env, capture_output=True)
    assert len([f for f in first if f.endswith(".nbc")]) >= 3  # the scan compiled kernels
    assert _cache_files(cache) == first


def test_an_edit_to_any_kernel_file_moves_every_kernel_files_cache(tmp_path: Path) -> None:
    """A kernel inlines helpers of the kernel files it imports, and numba's index checks only
    the kernel's own file: each file's cache folder is keyed on every kernel file's content, so
    an edit to a helper (here, jitcode's) moves the folder of a file that did not change
    (statcode's), and the same content anywhere gives the same folder."""
    from driftcli.kernels.jitcode import content_key, kernel_files

    files = kernel_files()
    assert {f.name for f in files} >= {"jitcode.py", "statcode.py", "castcode.py"}
    copies = []
    for f in files:
        copy = tmp_path / f.name
        copy.write_bytes(f.read_bytes())
        copies.append(copy)
    stat = tmp_path / "statcode.py"
    assert content_key(stat, copies) == content_key(Path(driftcli.kernels.__path__[0]) /
                                                    "statcode.py", files)
    before = content_key(stat, copies)
    helper = tmp_path / "jitcode.py"
    helper.write_bytes(helper.read_bytes() + b"\n# an edit to an inlined helper\n")
    assert content_key(stat, copies) != before
