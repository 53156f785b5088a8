"""Output paths, checked before a command does any work: a table's folder, a dump's file.
Nothing is created here; what is missing is made when the output is written, so a run that
fails leaves no empty folder behind."""

from __future__ import annotations

import tempfile
from pathlib import Path

from driftcli.errors import DriftError


class OutputError(DriftError):
    """An output path a command cannot write to."""


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: Path, *, option: str = "--out", folder: bool = True) -> None:
    """Raise :class:`OutputError` unless ``path`` (a folder, or with ``folder=False`` a file)
    can be written, creating nothing: a command checks its output before any work, and a run
    that fails leaves no empty folder behind. What is missing is made when the output is
    written."""
    if path.exists() and path.is_dir() != folder:
        raise OutputError(
            f"{option} {path} is a file; {option} names a folder (the tables go in it)"
            if folder else f"{option} {path} is a folder; {option} names the file to write")
    base = _nearest_existing(path if folder else path.parent)
    if not base.is_dir():
        raise OutputError(f"{option} {path}: {base} is a file, so nothing can be made under "
                          f"it; choose another {option}")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as err:
        raise OutputError(f"{option} {path}: cannot write in {base} ({err.strerror or err}); "
                          f"choose a {option} you can write to") from None
