"""The callbacks every long library call reports to: its progress (the CLI draws it as a bar,
or prints plain lines without a terminal) and notices, one line each, of what the user waits
for (kernels compiling). The library never prints: with no listener a notice goes nowhere."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

Progress = Callable[[int, int, str], None]
"""Called as work goes with how much is done, how much there is in all (the units are the
caller's: bytes of a scan, matmuls, checkpoints) and the name of what is at work."""

Notice = Callable[[str], None]
"""Called with one line for the user (no trailing newline); it may come from another thread."""

_LISTENERS: list[Notice] = []


def notify(message: str) -> None:
    """Hand ``message`` to every listener (see :func:`notices_to`); none: it is dropped."""
    for listener in list(_LISTENERS):
        listener(message)


@contextmanager
def notices_to(listener: Notice) -> Iterator[None]:
    """Have ``listener`` receive the notices given while the block runs."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)
