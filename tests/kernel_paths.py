"""The kernel back-ends drift can run a cast on (:mod:`driftcli.kernels`), for tests that run
the same work on each and compare bits: torch's ops and numba's machine code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from driftcli import kernels

PATHS = ("torch", "jit")


def unavailable(path: str) -> str | None:
    """Why ``path`` cannot run here, or None."""
    return kernels.jit_unavailable() if path == "jit" else None


@contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """Run the block on ``path`` only (``xfail`` when it cannot run here), then restore the
    default."""
    if (why := unavailable(path)) is not None:
        pytest.xfail(f"{why}: the {path} path cannot run here")
    kernels.set_jit("never" if path == "torch" else "auto")
    try:
        yield
    finally:
        kernels.set_jit("auto")
