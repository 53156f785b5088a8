"""Tensors in memory as a source: a state dict (or one tensor) listed as the ``.pt`` reader lists
the file ``torch.save`` would write of it, and read where it lies, without a copy.

The listing is the file's: the same dotted names, the same problems (two keys flattening to one
name, a view that repeats elements, a storage covered too many times over), the same limits,
pre-quantized weights assembled by their names. No folder's config is read: a state dict in
memory has none. Reading gives rows of the tensor itself (contiguous ones as views): nothing is
written, nothing is locked, and any number of threads can read the same tensors at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from driftcli.io.readers.collect import gathered
from driftcli.io.readers.core import Inputs, TensorRef, within_bounds
from driftcli.io.readers.pytorch import flatten, listing, rows
from driftcli.io.readers.quantized_weight import Layout


@dataclass(frozen=True)
class _Held:
    """Where a tensor in memory is: the tensor."""

    tensor: torch.Tensor

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        # the scan only reads what it is given (tests/test_api.py checks the tensors are
        # unchanged after a call), so a contiguous tensor's rows need no copy
        return rows(self.tensor, ref, start, stop, copy=False)


@dataclass(frozen=True)
class Held:
    """Named tensors in memory: a state dict (nested dicts, lists and tuples of tensors, other
    leaves skipped) or one tensor, under the source name ``name`` (a bare tensor is named
    ``name`` too, as a file's bare tensor is named by its stem)."""

    name: str
    tensors: Any

    def open(self, include: Sequence[str] = (), exclude: Sequence[str] = (),
             layout: Layout | str | None = None) -> Inputs:
        """The tensors as :func:`~driftcli.io.readers.open_inputs` lists those of the file
        ``NAME.pt`` holding them (no data read)."""
        flat = flatten(self.tensors, self.name)
        refs, problems = listing(self.name, flat, lambda key: _Held(flat.tensors[key]))
        refs, over = within_bounds(Path(self.name), refs)
        return gathered(refs, [(self.name, p) for p in [*problems, *over]], (), include,
                        exclude, layout, configs=False)
