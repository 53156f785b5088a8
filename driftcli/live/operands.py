"""How the monitor reads one recorded operand: in which directions, along which axis (the
policy's), and its plain statistics (docs/monitor.md#directions)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from driftcli.casts.quantization import working
from driftcli.casts.route import block_ranges
from driftcli.casts.scaling import binade_and_significand
from driftcli.io.readers import TensorRef
from driftcli.live.tables import STATS_BLOCK, Direction

Tensor = torch.Tensor


@dataclass(frozen=True)
class Layout:
    """How one direction reads a recorded tensor: folded to 2-D or not, and the axis."""

    direction: Direction
    token: str
    fold: bool
    axis: int


# F.linear's activation and output gradient (docs/capture.md#the-file): their wgrad sums over
# every leading dimension, as the policy's wgrad folds the broadcast weight's batch
_LINEAR_FOLDED = ("forward.lhs wgrad.rhs", "dgrad.lhs wgrad.lhs")


def layouts(operand: str, transposed: bool) -> list[Layout]:
    """Each direction a recorded tensor feeds (its dump ``operand`` string), and the axis the
    policy casts it along there (``arith/autograd``): forward ``A·B``, A along its last axis, B
    along its second-to-last; dgrad ``dC·Bᵀ``, both along their last; wgrad ``Aᵀ·dC``, both
    along their second-to-last (M). A weight multiplied transposed (``F.linear``'s, stored
    ``(N, K)``) swaps the two."""
    out = []
    for token in operand.split():
        kind, side = token.split(".")
        axis = -1 if kind == "dgrad" or (kind == "forward" and side == "lhs") else -2
        if transposed:
            axis = -1 if axis == -2 else -2
        fold = kind == "wgrad" and operand in _LINEAR_FOLDED
        out.append(Layout(Direction(kind), token, fold, axis))
    return out


def oriented(x: Tensor, lay: Layout) -> tuple[Tensor, int] | None:
    """The tensor and axis a direction measures (folded to ``(M, K)`` for a linear's wgrad);
    None where the axis does not exist (a vector)."""
    if lay.fold and x.dim() > 2:
        x = x.reshape(-1, x.shape[-1])
    if x.dim() < -lay.axis:
        return None
    return x, lay.axis


class MemoryReader:
    """A :class:`~driftcli.io.readers.core.Reader` over a tensor in memory: rows are views."""

    def __init__(self, x: Tensor) -> None:
        self.x = x

    def read(self, ref: TensorRef, start: int, stop: int, into: Tensor | None) -> Tensor:
        """Rows ``[start, stop)`` (the tensor itself for a 0-d one)."""
        return self.x[start:stop] if self.x.dim() else self.x


def operand_stats(x: Tensor, axis: int) -> dict[str, Any]:
    """The stats table's own columns of ``x`` read along ``axis``: one pass of block-stats'
    range kernel over its blocks of :data:`STATS_BLOCK` (numba on the CPU, torch on a GPU),
    the whole tensor one row where the axis is not a multiple of the block."""
    w = working(x.detach())
    rows = w.movedim(axis, -1) if w.dim() else w.reshape(1)
    blocked = rows.shape[-1] % STATS_BLOCK == 0 and rows.numel() > 0
    groups = rows.reshape(-1, STATS_BLOCK if blocked else max(1, rows.numel())).contiguous()
    top, low, span, bad = block_ranges(groups)
    n_nonfinite = 0
    if bool(bad.any()):  # rare: count the elements of the groups holding a NaN or inf
        n_nonfinite = int(torch.count_nonzero(~torch.isfinite(groups[bad])))
    amax = float(top.max()) if top.numel() else 0.0
    amin = float(low.min()) if low.numel() else math.inf
    dyn = med = widest = None
    if math.isfinite(amin):  # some finite nonzero element: amax > 0 too
        ends = torch.tensor([amax, amin], dtype=w.dtype)
        high, small = binade_and_significand(ends)[0].tolist()
        dyn = high - small
    n_finite = w.numel() - n_nonfinite
    if blocked:
        live = span[(span >= 0) & ~bad].sort().values  # finite groups with a nonzero
        if live.numel():
            med = int(live[(live.numel() - 1) // 2])
            widest = int(live[-1])
    return {"numel": w.numel(), "n_nonfinite": n_nonfinite,
            "amax": amax if n_finite else None, "amin": amin if dyn is not None else None,
            "dynamic_range": dyn, "block": STATS_BLOCK, "block_range_median": med,
            "block_range_max": widest}
