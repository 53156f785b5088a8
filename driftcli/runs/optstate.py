"""Adam's moments under a quantized optimizer-state layout: what ``drift health`` measures of
them at a checkpoint and between two checkpoints of a run.

Three layouts, torchao's low-bit Adam states (``torchao.optim``, pytorch/ao; line numbers of
torchao 0.18.0 as installed; the 8-bit files were first read at the commits named):

- ``torchao-8bit`` (``AdamW8bit``; after Dettmers et al., "8-bit Optimizers via Block-wise
  Quantization", arXiv 2110.02861): ``torchao/optim/quant_utils.py`` at 173b31e, lines 11-61:
  the dynamic map ``create_dynamic_map(signed, 7, 8)``, 256 values: for each of seven decades
  ``i = 0..6`` the midpoints of ``linspace(0.1, 1, n + 1)`` (float32) times ``10**(i - 6)``,
  ``n = 2**i`` for the signed map (both signs) and ``2**(i + 1)`` for the unsigned one, with 0
  and 1; lines 64-72: each block (the flattened tensor) divided by its absolute maximum (at
  least 1e-12); lines 75-94: each value to the nearest map entry, a tie to the upper one;
  ``subclass_8bit.py`` at eebb71b: ``exp_avg`` on the signed map, ``exp_avg_sq`` on the
  unsigned one, blocks of 256;
- ``torchao-4bit`` (``AdamW4bit``; Li, Chen and Zhu, "Memory Efficient Optimizers with 4-bit
  States", arXiv 2309.01507): ``subclass_4bit.py`` (torchao 0.18.0) lines 34-41: ``exp_avg``
  on ``create_dynamic_map(True, 3, 4)`` (16 values: decades ``10**-2 .. 10**0`` with 1, 2
  and 4 intervals, both signs, 0 and 1), ``exp_avg_sq`` on ``linspace(0, 1, 17)[1:]`` (the
  linear map without 0: no second moment is ever stored as 0); lines 143-147 with
  ``quant_utils.py`` lines 97-112: the same scaling and nearest-entry rounding; ``adam.py``
  lines 250-274: blocks of 128;
- ``torchao-fp8`` (``AdamWFp8``): ``subclass_fp8.py`` (torchao 0.18.0) lines 19-28: per block
  of 256 the scale ``max(|x|, 1e-12) / 448`` (float32), ``x / scale`` rounded to
  float8_e4m3fn (nearest even; drift's exact cast), read back as ``code · scale``; both
  moments.

In every layout (``adam.py``, torchao 0.18.0, lines 71-78) only a tensor of 4,096 values or
more, a whole number of blocks, is quantized (the others stay float32, as bitsandbytes does);
lines 190-204: each step's moments are ``lerp(dequantized state, g, 1 − β)`` in float32, the
weights are updated from those, and then they are quantized again.

:func:`state_values` is that quantization, tested bit for bit against torchao's own
``OptimState8bit``, ``OptimState4bit`` and ``OptimStateFp8`` (``tests/test_health.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import cache

import torch

Tensor = torch.Tensor


class StateLayout(StrEnum):
    """A quantized layout of Adam's moments."""

    TORCHAO_8BIT = "torchao-8bit"
    """torchao's AdamW8bit: dynamic 8-bit maps, blocks of 256, tensors of 4,096 values up."""
    TORCHAO_4BIT = "torchao-4bit"
    """torchao's AdamW4bit: a 4-bit dynamic map (m), a linear map without 0 (v), blocks of 128."""
    TORCHAO_FP8 = "torchao-fp8"
    """torchao's AdamWFp8: float8_e4m3fn codes under a float32 scale per block of 256."""


BLOCK = 256
SMALLEST = 4096
"""Tensors with fewer values keep float32 moments."""
FP8_MAX = 448.0
"""float8_e4m3fn's largest value, the top of torchao's FP8 state scale."""


@cache
def dynamic_map(signed: bool, exponent_bits: int = 7, total_bits: int = 8) -> Tensor:
    """The ``2**total_bits`` values of the dynamic map (float32, ascending; module docs):
    torchao's ``create_dynamic_map(signed, exponent_bits, total_bits)``."""
    values: list[float] = [0.0, 1.0]
    spare = total_bits - 1 - exponent_bits
    for decade in range(exponent_bits):
        n = 2 ** (decade + spare) if signed else 2 ** (decade + spare + 1)
        values += _decade(decade - (exponent_bits - 1), n, signed)
    extra = 2**spare - 1
    if extra > 0:  # the codes left over when every exponent bit is zero join the top decade
        values += _decade(0, extra, signed)
    out = torch.tensor(sorted(values), dtype=torch.float32)
    if out.numel() != 2**total_bits:
        raise RuntimeError(f"the dynamic map has {out.numel()} values, not {2**total_bits}")
    return out


def _decade(power: int, n: int, signed: bool) -> list[float]:
    """The midpoints of ``n`` equal intervals of [0.1, 1] times ``10**power`` (float32, as the
    map is built), both signs if ``signed``."""
    edges = torch.linspace(0.1, 1, n + 1)
    level = (10**power) * ((edges[:-1] + edges[1:]) / 2.0)
    return level.tolist() + ((-level).tolist() if signed else [])


@cache
def linear_map() -> Tensor:
    """torchao's 4-bit unsigned map: ``linspace(0, 1, 17)`` without its 0 (float32)."""
    return torch.linspace(0, 1, 17)[1:].contiguous()


@dataclass(frozen=True)
class LayoutSpec:
    """How a layout stores each moment: the block, and each moment's map (None: FP8 codes)."""

    block: int
    m_map: Callable[[], Tensor] | None
    v_map: Callable[[], Tensor] | None


LAYOUTS: dict[StateLayout, LayoutSpec] = {
    StateLayout.TORCHAO_8BIT: LayoutSpec(256, lambda: dynamic_map(True),
                                         lambda: dynamic_map(False)),
    StateLayout.TORCHAO_4BIT: LayoutSpec(128, lambda: dynamic_map(True, 3, 4), linear_map),
    StateLayout.TORCHAO_FP8: LayoutSpec(256, None, None),
}


def quantized(numel: int, layout: StateLayout | str = StateLayout.TORCHAO_8BIT) -> bool:
    """Whether the layout quantizes a moment of ``numel`` values (module docs)."""
    return numel >= SMALLEST and numel % LAYOUTS[StateLayout(layout)].block == 0


def state_values(x: Tensor, signed: bool,
                 layout: StateLayout | str = StateLayout.TORCHAO_8BIT) -> Tensor:
    """``x`` (float32) stored in ``layout`` and read back, shaped like ``x``: ``exp_avg``
    (``signed``) or ``exp_avg_sq`` (module docs)."""
    spec = LAYOUTS[StateLayout(layout)]
    flat = x.detach().to(torch.float32).reshape(-1, spec.block)
    make = spec.m_map if signed else spec.v_map
    if make is None:
        return _fp8_values(flat).reshape(x.shape)
    qmap = make()
    top = qmap.numel() - 1
    scale = flat.abs().amax(-1).clip(1e-12)
    scaled = flat / scale.view(-1, 1)
    # below the map's first entry the search gives -1: torchao's search starts at code 0
    low = (torch.searchsorted(qmap, scaled, right=True) - 1).clamp(0, top)
    up = (low + 1).clamp(max=top)
    lo, hi = qmap[low], qmap[up]
    codes = torch.where(scaled - lo >= (hi - lo) * 0.5, up, low)
    return (qmap[codes] * scale.view(-1, 1)).reshape(x.shape)


def _fp8_values(flat: Tensor) -> Tensor:
    """Blocks (rows) of float32 stored as torchao's FP8 state and read back."""
    from driftcli.casts.quantization import quantize
    from driftcli.records.castspec import parse_cast

    scale = flat.abs().amax(-1).clip(1e-12) / FP8_MAX
    scaled = flat / scale.view(-1, 1)
    # max |scaled| is 448 up to a float32 rounding, far below the midpoint 464 to the next
    # binade: nothing saturates that torchao's cast would not
    codes = quantize(scaled, parse_cast("float8_e4m3fn:none"))
    if not isinstance(codes, Tensor):
        raise TypeError(f"quantize returned {type(codes).__name__}, not a tensor")
    return codes.to(torch.float32) * scale.view(-1, 1)


@dataclass
class StateCounts:
    """One parameter's moments at a checkpoint (and over the step before it), counted."""

    numel: int
    m_moved: int | None
    """Values whose float32 EMA changed over the step (None: no one-step interval)."""
    m_stale: int | None
    """Of those, the values whose stored value the layout's update left unchanged."""
    v_moved: int | None
    v_stale: int | None
    v_zero: int
    v_nonzero: int
    dot: float
    exact_sq: float
    stored_sq: float

    def cosine(self) -> float | None:
        """The cosine of the Adam update the layout takes against the exact one (None when
        unknown: no one-step interval)."""
        norm = math.sqrt(self.exact_sq * self.stored_sq)
        return None if norm == 0 or not math.isfinite(norm) else self.dot / norm


def state_counts(m0: Tensor | None, v0: Tensor | None, m1: Tensor, v1: Tensor, *,
                 betas: tuple[float, float], eps: float, step: int,
                 layout: StateLayout | str = StateLayout.TORCHAO_8BIT) -> StateCounts:
    """The moments ``m1, v1`` at a checkpoint (a float32 run's) under ``layout``, and, given
    ``m0, v0`` one step before, their staleness:

    - staleness: the step's gradient recovered from the trajectory, ``g = (m1 − β₁m0) /
      (1 − β₁)`` (float64, exact up to the float32 rounding of the saved moments), applied as
      the layout applies it, ``lerp(stored, g, 1 − β₁)`` (and ``g²`` into v) in float32, and
      stored again: an element whose float32 moment changed over the step is stale when its
      stored value does not;
    - ``v_zero``: nonzero second moments at ``v1`` that the layout stores as 0;
    - the Adam update's direction ``m̂ / (√v̂ + ε)`` at ``step`` (the step of ``m1``) as the
      layout takes it, from ``lerp(stored m0, g, 1 − β₁)`` and ``lerp(stored v0, g², 1 − β₂)``
      in float32 (torchao updates the weights from these and only then stores them: ``adam.py``
      lines 190-204), against the float32 run's own ``m1, v1``: their dot product and squared
      norms (NaN without ``m0, v0``: the cosine is then unknown).
    """
    b1, b2 = betas
    m_moved = m_stale = v_moved = v_stale = None
    c1, c2 = 1 - b1**step, 1 - b2**step

    def direction(m: Tensor, v: Tensor) -> Tensor:
        return (m.double() / c1) / ((v.double() / c2).sqrt() + eps)

    dot = exact_sq = stored_sq = math.nan
    if m0 is not None and v0 is not None:
        g32 = ((m1.double() - b1 * m0.double()) / (1 - b1)).float()
        sm0, sv0 = state_values(m0, True, layout), state_values(v0, False, layout)
        m_next = torch.lerp(sm0, g32, 1 - b1)
        v_next = torch.lerp(sv0, g32.square(), 1 - b2)
        m_move, v_move = m1 != m0, v1 != v0
        m_moved, v_moved = int(m_move.sum()), int(v_move.sum())
        m_stale = int((m_move & (state_values(m_next, True, layout) == sm0)).sum())
        v_stale = int((v_move & (state_values(v_next, False, layout) == sv0)).sum())
        exact, taken = direction(m1, v1), direction(m_next, v_next)
        dot, exact_sq = float((exact * taken).sum()), float(exact.pow(2).sum())
        stored_sq = float(taken.pow(2).sum())
    sv1 = state_values(v1, False, layout)
    nonzero = v1 != 0
    return StateCounts(m1.numel(), m_moved, m_stale, v_moved, v_stale,
                       int((nonzero & (sv1 == 0)).sum()), int(nonzero.sum()), dot, exact_sq,
                       stored_sq)
