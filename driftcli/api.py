"""The in-memory API: :func:`measure` a tensor, a state dict, a module or a path from a notebook
or a training loop, and get the rows the command writes, as a pandas DataFrame.

Tensors in memory are a source of the command's own scan (:class:`~driftcli.io.readers.memory.
Held`): listed under the dotted names the ``.pt`` reader gives a saved state dict, and read
where they lie. The rows are those of ``drift clip-rate NAME.pt`` (same names, same numbers,
same columns and dtypes as the Parquet table read back), with ``source`` set to ``name``;
nothing is written, nothing is locked, and several threads can call :func:`measure` at once.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from driftcli.choices import Device, parse_choice
from driftcli.errors import DriftError
from driftcli.io.readers.memory import Held
from driftcli.io.tables import Row, schema_of
from driftcli.measures import MEASURES
from driftcli.measures.axes import axis_misfits
from driftcli.measures.scan import ScanOptions, Source
from driftcli.records.cast import Cast

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
        # the keys as given: two that read alike ({1: a, "1": b}) are a clash the listing
        # names, as the file's; str() here kept one of them, in silence
        return {k: _plain(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{key}.{i}" if key else str(i)) for i, v in enumerate(value)]
    if isinstance(value, _PLAIN):
        return value
    raise DriftError(f"measure: {key or 'x'} is a {type(value).__name__}; give tensors, "
                     "dicts, lists and plain numbers or strings (a state dict)")


def _casts(casts: str | Cast | Sequence[str | Cast]) -> list[str | Cast]:
    # a str is one spec, not a sequence of one-letter specs
    return [casts] if isinstance(casts, str | Cast) else list(casts)


_schema = functools.cache(schema_of)
"""A row type's schema, made once: it reads the type's hints, a third of a small call's time."""


def _frame(row_type: type[Row], rows: list[Any], skipped: list[str]) -> pd.DataFrame:
    """The rows as the Parquet table reads back (the table's schema, then pandas), with the
    tensors the axis does not fit in ``attrs["skipped"]``."""
    import pyarrow as pa

    schema = _schema(row_type)
    # column by column: the rows hold plain values, so no copy of each (dataclasses.asdict)
    table = pa.Table.from_pydict({n: [getattr(r, n) for r in rows] for n in schema.names},
                                 schema=schema)
    frame = table.to_pandas(use_threads=False)  # a few rows: a hand-off costs more
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
    sources: list[Source]
    if isinstance(x, str | Path):
        sources = [x]
    elif isinstance(x, Sequence):
        sources = list(x)
        if not all(isinstance(p, str | Path) for p in sources):
            raise DriftError("measure: a list is read as paths; give a dict for tensors "
                             "(a state dict)")
    else:
        sources = [_held(x, name)]
    fit = axis_misfits(sources, axis, include, exclude)
    rows = m.run(sources, _casts(casts), options=options, include=include,
                 exclude=[*exclude, *fit.exclude])
    return _frame(m.row_type, rows, fit.lines())


def _held(x: torch.Tensor | nn.Module | Mapping[str, Any], name: str | None) -> Held:
    """``x`` as named tensors in memory: a tensor named ``name`` (default ``"tensor"``), or a
    state dict or module's under the source ``name`` (default ``"state_dict"``)."""
    if isinstance(x, nn.Module):
        x = x.state_dict()
    if isinstance(x, torch.Tensor):
        held = Held(name or "tensor", x.detach())
    elif isinstance(x, Mapping):
        held = Held(name or "state_dict", _plain(x, ""))
    else:
        raise DriftError(f"measure: x is a {type(x).__name__}; give a tensor, a state dict, a "
                         "module or a path")
    if not held.name:
        raise DriftError("measure: name is empty; give the source a name")
    return held
