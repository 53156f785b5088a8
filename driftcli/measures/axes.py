"""Tensors an ``--axis`` does not fit, found before a scan: skipped and named, not fatal.

``--axis 1`` (blocks along the second dimension) fits a weight matrix but not a model's 1-D
biases and norms; without this, the first of them aborted the whole scan with a message naming
no tensor. :func:`axis_misfits` lists them from the inputs' headers (no tensor data read) so
the scan leaves them out (:attr:`AxisFit.exclude`) and the command names them beside the
tensors it measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from driftcli.errors import DriftError
from driftcli.io.readers.core import TensorRef
from driftcli.measures.scan import Source, open_source


def fits(shape: Sequence[int], axis: int) -> bool:
    """Whether blocks can run along ``axis`` of a tensor of ``shape``: the axis exists (a
    0-d tensor takes only the defaults, -1 and 0)."""
    nd = len(shape)
    return axis in (-1, 0) if nd == 0 else -nd <= axis < nd


def _literal(name: str) -> str:
    """An ``fnmatch`` pattern matching exactly ``name``."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


@dataclass(frozen=True)
class AxisFit:
    """What an axis leaves out of a scan."""

    axis: int
    skipped: tuple[TensorRef, ...]
    """Selected floating-point tensors left out: those the axis does not fit, and any other
    tensor of the same name (the scan's selection is by name)."""

    @property
    def exclude(self) -> tuple[str, ...]:
        """Exclude globs that leave exactly the skipped names out."""
        return tuple(dict.fromkeys(_literal(r.name) for r in self.skipped))

    def lines(self) -> list[str]:
        """One line per skipped tensor, for a summary."""
        return [f"{r.source} {r.name} {list(r.shape)}: --axis {self.axis} is not one of its "
                "axes" + ("" if not fits(r.shape, self.axis) else
                          " (skipped with a same-named tensor that lacks it)")
                for r in self.skipped]


def axis_misfits(paths: Sequence[Source], axis: int, include: Sequence[str] = (),
                 exclude: Sequence[str] = (), layout: str | None = None) -> AxisFit:
    """The selected floating-point tensors of ``paths`` that ``axis`` does not fit, from
    their headers. Raises :class:`DriftError` when it fits none of them (nothing would be
    measured). The default axes (-1, 0) fit every tensor, and list nothing."""
    if axis in (-1, 0):
        return AxisFit(axis, ())
    refs = [r for p in paths for r in open_source(p, include, exclude, layout).tensors
            if r.is_float]
    bad = {r.name for r in refs if not fits(r.shape, axis)}
    skipped = tuple(r for r in refs if r.name in bad)
    if refs and len(skipped) == len(refs):
        dims = sorted({len(r.shape) for r in refs})
        raise DriftError(f"--axis {axis} fits no tensor of the inputs (they have "
                         f"{', '.join(map(str, dims))} dimension(s), first {refs[0].name} "
                         f"{list(refs[0].shape)}); give an axis they have, e.g. --axis -1")
    return AxisFit(axis, skipped)
