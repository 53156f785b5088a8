"""The callback every long library call reports its progress to (the CLI draws it as a bar)."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[int, int, str], None]
"""Called as work goes with how much is done, how much there is in all (the units are the
caller's: bytes of a scan, matmuls, checkpoints) and the name of what is at work."""
