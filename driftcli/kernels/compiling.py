"""A notice when numba compiles drift's kernels for long: a first run on a machine compiles
each kernel it uses (minutes in all on a small machine), later runs load the machine code from
the cache. Once compiling has taken :data:`NOTICE_AFTER_S` in a process, one
:func:`~driftcli.progress.notify` line says so (the CLI prints it; the library does not)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from driftcli.progress import notify

NOTICE_AFTER_S = 2.0
"""Seconds of compiling, in all, before the notice: a run that loads its kernels from the cache
(or compiles one small kernel) stays silent."""


def message() -> str:
    """The notice's one line, naming where the compiled kernels are kept."""
    cache = os.environ.get("NUMBA_CACHE_DIR", "numba's cache")
    return (f"compiling drift's kernels for this machine with numba: once per drift version, "
            f"a first run can take minutes (later runs load them from {cache})")


class _Watch:
    """Sums the time of outermost compilations (a kernel's compile compiles the functions it
    calls inside it); a timer says it while one is still compiling."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.spent = 0.0
        self.began = 0.0
        self.told = False
        self.timer: threading.Timer | None = None

    def tell(self) -> None:
        with self.lock:
            if self.told:
                return
            self.told = True
        notify(message())

    def on_start(self, _event: Any) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1 or self.told:
                return
            self.began = time.monotonic()
            self.timer = threading.Timer(max(0.0, NOTICE_AFTER_S - self.spent), self.tell)
            self.timer.daemon = True
            self.timer.start()

    def on_end(self, _event: Any) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth > 0:
                return
            self.spent += time.monotonic() - self.began
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            late = self.spent > NOTICE_AFTER_S
        if late:  # the timer may not have had its turn
            self.tell()


_WATCH = _Watch()
_REGISTERED: list[bool] = []


def watch_compiles() -> None:
    """Listen to numba's compile events (once per process); numba must be importable."""
    if _REGISTERED:
        return
    from numba.core import event

    class _Listener(event.Listener):
        def on_start(self, ev: Any) -> None:
            _WATCH.on_start(ev)

        def on_end(self, ev: Any) -> None:
            _WATCH.on_end(ev)

    event.register("numba:compile", _Listener())
    _REGISTERED.append(True)
