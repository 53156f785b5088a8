"""The kernel paths drift can run a cast on, for tests that run the same work on each and
compare bits: torch's eager ops, numba's machine code, inductor's compiled code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from driftcli import compiling, jit

PATHS = ("torch", "jit", "compiled")


def unavailable(path: str) -> str | None:
    """Why ``path`` cannot run here, or None."""
    if path == "jit":
        return jit.jit_unavailable()
    if path == "compiled":
        return compiling.compile_unavailable()
    return None


@contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """Run the block on ``path`` only (``xfail`` when it cannot run here), then restore the
    defaults."""
    if (why := unavailable(path)) is not None:
        pytest.xfail(f"{why}: the {path} path cannot run here")
    jit.set_jit("never" if path == "torch" else "auto")
    compiling.set_compile("always" if path == "compiled" else "never")
    try:
        yield
        if path == "compiled":
            assert not compiling.fell_back(), "a compiled kernel failed and fell back"
    finally:
        jit.set_jit("auto")
        compiling.set_compile("auto")
