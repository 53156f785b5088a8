"""Where two casts of one tensor disagree, element by element: :class:`DiffStats` and
:func:`cast_diff_stats`, what ``drift cast-diff`` counts on every slice of the shared scan."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from driftcli.casts.hadamard import transformed
from driftcli.casts.route import cast_elements
from driftcli.errors import DriftError
from driftcli.records.cast import Cast
from driftcli.records.modes import Rounding

Tensor = torch.Tensor


@dataclass(frozen=True)
class DiffStats:
    """Cast B against cast A (the baseline) on one tensor or slice; slices add with
    :meth:`merge`."""

    compared: int
    """Elements compared (every element of the input)."""
    codes_differ: int
    """Elements whose code (the value on the element grid before the scale) differs in its bits;
    a NaN equals any NaN."""
    values_differ: int
    """Elements whose dequantized float32 value differs in its bits (a NaN equals any NaN)."""
    nan_differ: int
    """Elements NaN under one cast only (counted in ``values_differ`` too)."""
    max_spacings: float
    """The largest |q_B − q_A| in units of A's grid spacing at that element (its element
    format's quantum at A's code, times A's scale), over elements finite under both; 0 when
    none differ."""

    @staticmethod
    def merge(parts: list[DiffStats]) -> DiffStats:
        """The stats of a whole tensor from those of its slices."""
        if not parts:
            return DiffStats(0, 0, 0, 0, 0.0)
        counts = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(DiffStats)
                  if f.name != "max_spacings"}
        return DiffStats(**counts, max_spacings=max(p.max_spacings for p in parts))


def _bits_differ(a: Tensor, b: Tensor) -> Tensor:
    a, b = a.float(), b.float()
    return (a.view(torch.int32) != b.view(torch.int32)) & ~(a.isnan() & b.isnan())


def spacing(codes: Tensor, c: Cast, scale: Tensor) -> Tensor:
    """The gap of ``c``'s scaled grid at each code: the element format's quantum there
    (``2**(max(binade, emin) - mbits)``, 1 for integers) times the element's scale."""
    fmt = c.format
    if fmt.integer:
        return scale
    _, e = torch.frexp(codes.double().abs())
    binade = torch.where(codes == 0, fmt.emin, e - 1)
    quantum = torch.exp2((torch.clamp(binade, min=fmt.emin) - fmt.mbits).double())
    return quantum * scale


def cast_diff_stats(x: Tensor, a: Cast, b: Cast, axis: int = -1,
                    tensor_amax: float | None = None) -> DiffStats:
    """Cast ``x`` by ``a`` and by ``b`` and count where they part (``tensor_amax``: the whole
    tensor's, when ``x`` is a slice of it). Stochastic casts are refused: their codes differ
    by the draw."""
    for c in (a, b):
        if c.rounding is Rounding.SR:
            raise DriftError(f"cast-diff compares deterministic casts; {c} rounds "
                             "stochastically: give it a deterministic rounding (e.g. :rne)")
    out = []
    for c in (a, b):
        if c.rht is not None and tensor_amax is not None:
            raise DriftError(f"cast-diff: {c} reads the amax of the transformed tensor, "
                             "which a slice cannot give: compare whole tensors")
        out.append(cast_elements(transformed(x, c, axis), c, axis, tensor_amax))
    (va, ca), (vb, cb) = (out[0].values, out[0].codes), (out[1].values, out[1].codes)
    values = _bits_differ(va, vb)
    both = torch.isfinite(va) & torch.isfinite(vb)
    gap = spacing(ca, a, out[0].scales())
    units = torch.where(both & values & (gap > 0), (va.double() - vb.double()).abs() / gap, 0.0)
    return DiffStats(compared=x.numel(), codes_differ=int(_bits_differ(ca, cb).sum()),
                     values_differ=int(values.sum()),
                     nan_differ=int((va.isnan() != vb.isnan()).sum()),
                     max_spacings=float(units.max()) if units.numel() else 0.0)
