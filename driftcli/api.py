"""The in-memory API: :func:`measure` a tensor, a state dict, a module or a path from a notebook
or a training loop, and get the rows the command writes, as a pandas DataFrame.

The in-memory cases go through the command's own path: the tensors are saved with
``torch.save`` into a temporary folder and scanned as the ``.pt`` file a user would give the
command, so the rows are those of ``drift clip-rate FILE.pt`` (same names, same numbers, same
columns and dtypes as the Parquet table read back), with ``source`` set to ``name``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from driftcli.choices import Device, parse_choice
from driftcli.errors import DriftError
from driftcli.io.tables import Row, schema_of
from driftcli.measures import MEASURES
from driftcli.measures.axes import axis_misfits
from driftcli.measures.scan import ScanOptions
from driftcli.records.cast import Cast

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # not on Windows: calls there are not serialised
    fcntl = None

if TYPE_CHECKING:
    import pandas as pd

Measurable = torch.Tensor | nn.Module | Mapping[str, Any] | str | Path | Sequence[str | Path]
"""What :func:`measure` takes: a tensor, a module (its ``state_dict()``), a state dict (nested
dicts, lists and tuples flattened to dotted names, as the ``.pt`` reader does), or paths."""

_PLAIN = (int, float, bool, str, type(None))
"""Leaf values a state dict may hold beside tensors (skipped by the scan, as in a file)."""


def _plain(value: Any, key: str) -> Any:
    """``value`` with every tensor detached (a parameter saved as a plain tensor) and every
    container a dict or list; a leaf of any other type is refused, naming its key."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{key}.{i}" if key else str(i)) for i, v in enumerate(value)]
    if isinstance(value, _PLAIN):
        return value
    raise DriftError(f"measure: {key or 'x'} is a {type(value).__name__}; give tensors, "
                     "dicts, lists and plain numbers or strings (a state dict)")


def _casts(casts: str | Cast | Sequence[str | Cast]) -> list[str | Cast]:
    # a str is one spec, not a sequence of one-letter specs
    return [casts] if isinstance(casts, str | Cast) else list(casts)


@contextlib.contextmanager
def _scratch(label: str) -> Iterator[Path]:
    """The file an in-memory input is saved to, held (locked) for one call, removed after.

    Its path is the same on every call (a folder of the user's in the temporary folder):
    a stochastic cast's draws are seeded by the tensor's source path, so a fresh random
    folder would give other draws on every call with the same ``seed``."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    folder = Path(tempfile.gettempdir()) / f"drift-measure-{uid if uid is not None else 'user'}"
    folder.mkdir(mode=0o700, exist_ok=True)
    st = folder.lstat()
    # a shared temporary folder: a folder of that name made by another user is not ours
    if not stat.S_ISDIR(st.st_mode) or (uid is not None and st.st_uid != uid):
        raise DriftError(f"measure: {folder} is not a folder of this user's; remove it or "
                         "set TMPDIR to a folder of your own")
    with open(folder / ".lock", "a+b") as lock:
        if fcntl is not None:  # calls in other threads and processes wait their turn
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        path = folder / f"{label}.pt"  # a bare tensor is named by the file's stem
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)


def _frame(row_type: type[Row], rows: list[Any], skipped: list[str]) -> pd.DataFrame:
    """The rows as the Parquet table reads back (the table's schema, then pandas), with the
    tensors the axis does not fit in ``attrs["skipped"]``."""
    import pyarrow as pa

    table = pa.Table.from_pylist([dataclasses.asdict(r) for r in rows],
                                 schema=schema_of(row_type))
    frame = table.to_pandas()
    frame.attrs["skipped"] = skipped
    return frame


def measure(x: Measurable, casts: str | Cast | Sequence[str | Cast],
            what: str = "clip-rate", *, axis: int = -1, draws: int | None = None,
            seed: int = 0, device: Device | str = Device.CPU, include: Sequence[str] = (),
            exclude: Sequence[str] = (), name: str | None = None) -> pd.DataFrame:
    """The rows of the measurement ``what`` (``clip-rate``, ``underflow-rate``,
    ``error-bias``, ``cast-diff``) of ``x`` under ``casts``, as the command writes them: one
    row per (source, tensor, cast), then one per (input, cast) over all tensors
    (``tensor == "*"``).

    ``x`` is a tensor (one tensor, named ``name``, default ``"tensor"``), a state dict or a
    module (``source`` is ``name``, default ``"state_dict"``), or a path or list of paths
    (files and folders, read as the command reads them). ``casts`` is one spec or preset or
    a list of them. ``axis``, ``draws`` (default: 8 for ``error-bias``, else 1, as the
    commands), ``seed``, ``device``, ``include`` and ``exclude`` are the commands' options.
    A tensor or file that cannot be read is a row with ``error`` set (the command's exit 2
    is for the caller to decide); bad arguments raise :class:`~driftcli.errors.DriftError`.
    """
    m = MEASURES.get(what)
    if m is None:
        raise DriftError(f"measure: unknown measurement {what!r}; choose one of "
                         f"{', '.join(MEASURES)}")
    options = ScanOptions(axis=axis, draws=(8 if what == "error-bias" else 1)
                          if draws is None else draws, seed=seed,
                          device=parse_choice(Device, device, "device"))
    if isinstance(x, str | Path) or (isinstance(x, Sequence) and not isinstance(x, str)):
        paths = [x] if isinstance(x, str | Path) else list(x)
        if not all(isinstance(p, str | Path) for p in paths):
            raise DriftError("measure: a list is read as paths; give a dict for tensors "
                             "(a state dict)")
        fit = axis_misfits(paths, axis, include, exclude)
        rows = m.run(paths, _casts(casts), options=options, include=include,
                     exclude=[*exclude, *fit.exclude])
        return _frame(m.row_type, rows, fit.lines())
    if isinstance(x, nn.Module):
        x = x.state_dict()
    if isinstance(x, torch.Tensor):
        label = name or "tensor"
        payload: Any = x.detach()
    elif isinstance(x, Mapping):
        label = name or "state_dict"
        payload = _plain(x, "")
    else:
        raise DriftError(f"measure: x is a {type(x).__name__}; give a tensor, a state dict, a "
                         "module or a path")
    if "/" in label or label in ("", ".", ".."):
        raise DriftError(f"measure: name {label!r} cannot be a file name; give a plain name")
    with _scratch(label) as path:
        torch.save(payload, path)
        where = str(path)
        fit = axis_misfits([path], axis, include, exclude)
        try:
            rows = m.run([path], _casts(casts), options=options, include=include,
                         exclude=[*exclude, *fit.exclude])
        except DriftError as err:  # the scratch file is ours, not the user's: name the input
            if err.args and isinstance(err.args[0], str):
                err.args = (err.args[0].replace(where, label), *err.args[1:])
            raise
    rows = [dataclasses.replace(
        r, source=label if r.source == where else r.source,
        error=r.error.replace(where, label) if r.error else r.error) for r in rows]
    return _frame(m.row_type, rows, [line.replace(where, label, 1) for line in fit.lines()])
