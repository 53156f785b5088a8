"""Adam's moments under a quantized optimizer-state layout: what ``drift health`` measures of
them between two checkpoints of a run.

One layout so far, torchao's 8-bit Adam state (``AdamW8bit``, ``Adam8bit``; after Dettmers et
al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861), from pytorch/ao:

- ``torchao/optim/quant_utils.py`` at 173b31e, lines 11-55: the dynamic map, 256 values: for
  each of seven decades ``i = 0..6`` the midpoints of ``linspace(0.1, 1, n + 1)`` (float32)
  times ``10**(i - 6)``, ``n = 2**i`` for the signed map (both signs) and ``2**(i + 1)`` for the
  unsigned one, with 0 and 1; lines 58-65: each block of 256 (the flattened tensor) divided by
  its absolute maximum (at least 1e-12); lines 68-85: each value to the nearest map entry, a
  tie to the upper one;
- ``torchao/optim/subclass_8bit.py`` at eebb71b: ``exp_avg`` on the signed map,
  ``exp_avg_sq`` on the unsigned one, block 256;
- ``torchao/optim/adam.py`` at 83379fe, lines 66-69: only a tensor of 4,096 values or more,
  a whole number of blocks, is quantized (the others stay float32, as bitsandbytes does);
  lines 180-184: each step's moments are ``lerp(dequantized state, g, 1 − β)`` in float32,
  then quantized again.

:func:`state_values` is that quantization, tested bit for bit against torchao's own
``OptimState8bit`` (``tests/test_health.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import cache

import torch

Tensor = torch.Tensor


class StateLayout(StrEnum):
    """A quantized layout of Adam's moments."""

    TORCHAO_8BIT = "torchao-8bit"
    """torchao's AdamW8bit: dynamic 8-bit maps, blocks of 256, tensors of 4,096 values up."""


BLOCK = 256
SMALLEST = 4096
"""Tensors with fewer values keep float32 moments."""


@cache
def dynamic_map(signed: bool) -> Tensor:
    """The 256 values of the dynamic 8-bit map (float32, ascending; module docs)."""
    values: list[float] = [0.0, 1.0]
    for decade in range(7):
        n = 2**decade if signed else 2 ** (decade + 1)
        edges = torch.linspace(0.1, 1, n + 1)
        mids = (edges[:-1] + edges[1:]) / 2.0
        level = (10 ** (decade - 6)) * mids  # float32, as the map is built
        values += level.tolist()
        if signed:
            values += (-level).tolist()
    out = torch.tensor(sorted(values), dtype=torch.float32)
    if out.numel() != 256:
        raise RuntimeError(f"the dynamic map has {out.numel()} values, not 256")
    return out


def quantized(numel: int) -> bool:
    """Whether the layout quantizes a moment of ``numel`` values (module docs)."""
    return numel >= SMALLEST and numel % BLOCK == 0


def state_values(x: Tensor, signed: bool) -> Tensor:
    """``x`` (float32) stored in the layout and read back: per block of 256 the absolute
    maximum (at least 1e-12), each value divided by it, to the nearest map entry (a tie up),
    times the maximum again. Shaped like ``x``."""
    qmap = dynamic_map(signed)
    flat = x.detach().to(torch.float32).reshape(-1, BLOCK)
    scale = flat.abs().amax(-1).clip(1e-12)
    scaled = flat / scale.view(-1, 1)
    low = (torch.searchsorted(qmap, scaled, right=True) - 1).clamp(0, 255)
    up = (low + 1).clamp(max=255)
    lo, hi = qmap[low], qmap[up]
    codes = torch.where(scaled - lo >= (hi - lo) * 0.5, up, low)
    return (qmap[codes] * scale.view(-1, 1)).reshape(x.shape)


@dataclass
class StateCounts:
    """One parameter's moments between two checkpoints, counted."""

    numel: int
    m_moved: int
    """Values whose float32 EMA changed over the step."""
    m_stale: int
    """Of those, the values whose stored value the layout's update left unchanged."""
    v_moved: int
    v_stale: int
    v_zero: int
    v_nonzero: int
    dot: float
    exact_sq: float
    stored_sq: float

    def cosine(self) -> float | None:
        """The cosine of the Adam direction from the stored moments against the exact one."""
        norm = math.sqrt(self.exact_sq * self.stored_sq)
        return None if norm == 0 or not math.isfinite(norm) else self.dot / norm


def state_counts(m0: Tensor, v0: Tensor, m1: Tensor, v1: Tensor, *, betas: tuple[float, float],
                 eps: float, step: int) -> StateCounts:
    """The moments ``m0, v0`` at a checkpoint and ``m1, v1`` one step later (a float32 run's),
    under the 8-bit layout:

    - staleness: the step's gradient recovered from the trajectory, ``g = (m1 − β₁m0) /
      (1 − β₁)`` (float64, exact up to the float32 rounding of the saved moments), applied as
      the layout applies it, ``lerp(stored, g, 1 − β₁)`` (and ``g²`` into v) in float32, and
      stored again: an element whose float32 moment changed over the step is stale when its
      stored value does not;
    - ``v_zero``: nonzero second moments at ``v1`` that the layout stores as 0;
    - the Adam direction ``m̂ / (√v̂ + ε)`` at ``step`` (the step of ``m1``) from the float32
      moments against the one from the stored moments: their dot product and squared norms.
    """
    b1, b2 = betas
    g = (m1.double() - b1 * m0.double()) / (1 - b1)
    g32 = g.float()
    sm0, sv0 = state_values(m0, True), state_values(v0, False)
    m_next = torch.lerp(sm0, g32, 1 - b1)
    v_next = torch.lerp(sv0, g32.square(), 1 - b2)
    m_moved, v_moved = m1 != m0, v1 != v0
    m_stale = int((m_moved & (state_values(m_next, True) == sm0)).sum())
    v_stale = int((v_moved & (state_values(v_next, False) == sv0)).sum())
    sv1 = state_values(v1, False)
    nonzero = v1 != 0
    c1, c2 = 1 - b1**step, 1 - b2**step

    def direction(m: Tensor, v: Tensor) -> Tensor:
        return (m.double() / c1) / ((v.double() / c2).sqrt() + eps)

    exact, stored = direction(m1, v1), direction(state_values(m1, True), sv1)
    return StateCounts(m1.numel(), int(m_moved.sum()), m_stale, int(v_moved.sum()), v_stale,
                       int((nonzero & (sv1 == 0)).sum()),
                       int(nonzero.sum()), float((exact * stored).sum()),
                       float(exact.pow(2).sum()), float(stored.pow(2).sum()))
