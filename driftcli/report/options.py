"""What a report is asked for: the options of ``drift report`` and their defaults. Nothing
here imports pandas (``drift report --help`` reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

INPUT_KEYS = ("source", "checkpoint")
"""Key columns that hold the path of the input a row measured (per-tensor measurements,
accum-error; grad-cosine)."""

WORST = 3
"""Rows named as the worst in each group, unless asked otherwise."""
CHANGE_PCT = 1.0
"""Headline changes listed against a baseline when larger than this many percent."""


class MatchBy(StrEnum):
    """How a row's input (its ``source`` or ``checkpoint`` key) is matched with the
    baseline's; every other key column always matches exactly."""

    PATH = "path"
    """The path as the measurement recorded it (as given on its command line)."""
    NAME = "name"
    """The file name alone: runs whose checkpoints lie in different folders match."""
    TENSOR = "tensor"
    """Not at all: rows match by tensor (or parameter) name and the other keys, whatever
    file holds them (last week's ``ckpt-48.safetensors`` against this week's
    ``ckpt-49.safetensors``)."""

    def compared(self, column: str, value: Any) -> Any:
        """What of a key cell is compared: the input's path, its file name, or nothing."""
        if column not in INPUT_KEYS or self is MatchBy.PATH or value is None:
            return value
        if self is MatchBy.TENSOR:
            return None
        return PurePosixPath(str(value).replace("\\", "/")).name or value


@dataclass(frozen=True)
class Options:
    """What the report was asked for."""

    rules: tuple[str, ...] = ()
    baseline: Path | None = None
    change_pct: float = CHANGE_PCT
    """List baseline changes beyond this many percent."""
    fail_pct: float | None = None
    """Fail on regressions beyond this many percent (None: do not fail on regressions)."""
    worst: int = WORST
    match_by: MatchBy = MatchBy.NAME
    """How rows' inputs are matched with the baseline's."""
