"""Adam's moments under a quantized optimizer-state layout: what ``drift health`` measures of
them at a checkpoint and between two checkpoints of a run.

Four layouts. Three are torchao's low-bit Adam states (``torchao.optim``, pytorch/ao; line
numbers of torchao 0.18.0 as installed; the 8-bit files were first read at the commits named):

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

And MS-AMP's (Azure/MS-AMP at 9746ea8, ``LBAdamW``; Peng et al., "FP8-LM", arXiv 2310.18313):

- ``ms-amp``: ``msamp/optim/adamw.py`` lines 90-92: ``exp_avg`` in FP8 E4M3 (``torch.uint8``,
  ``msamp/common/dtype/dtypes.py`` lines 9 and 38-43) and ``exp_avg_sq`` in float16, each
  with one scale per tensor (``tensor_scale=True``), every tensor whatever its size
  (``adamw_base.py`` lines 191-204). The scale (``adamw.py`` lines 176-184 with
  ``msamp/common/tensor/meta.py`` lines 39-56, margin 0): ``sf = 2**floor(log2(fp_max /
  amax))`` of the tensor's new absolute maximum (``fp_max`` 448 and 65504:
  ``msamp/common/dtype/floating.py`` lines 18-45), ``fp_max / amax`` in float32; an amax of 0 or
  not finite gives the scale 1 (``adamw.py`` passes ones as the fallback scale of
  ``compute_scaling_factor``); the amax skips NaN (the kernel's ``fmaxf``).
  The CUDA kernel (``msamp/optim/adamw.cu`` lines 61-74, stage 2)
  stores ``T(m · sf)``: ``__nv_fp8_e4m3(float)`` (round to nearest even, saturating to ±448)
  and ``__float2half`` (nearest even); it reads a state back as ``code · (1 / sf)``. Each
  step (lines 31-50 and 67-69) computes ``β · stored + (1 − β) · g`` (``g · g`` for v) in
  float32, updates the weights from those (stage 1) and stores them under the scale of their
  new amax (stage 2).

  Three steps drift takes as stated rather than read: (1) the kernel's expression is
  ``beta1 * stored_code * factor + (1.f - beta1) * grad``; nvcc contracts ``a * b + c * d``
  into a fused multiply-add by default, and which product it fuses is not in the source:
  drift rounds each product to float32 and then the sum (no contraction; the factor is a power
  of two, so ``(β · code) · factor`` is ``β · stored`` unless float32 underflows). (2) MS-AMP
  takes the exponent as ``floor`` of a float32 ``torch.log2`` on the GPU; drift reads it from
  the bits of the float32 quotient. They differ only where the quotient lies within about
  ``|exponent| · 2**-24`` below a power of two (a few float32 values per binade), where a
  log2 rounded up gives MS-AMP a scale twice drift's; both formats being floating point, the
  moments read back the same but where an element is subnormal or flushed under drift's
  smaller scale.
  (3) Where ``fp_max / amax`` reaches 2**128 (an amax below about ``fp_max · 2**-128``)
  MS-AMP's float32 scale overflows to inf and its inverse is 0; drift reads the state back as
  that arithmetic gives it (E4M3 saturates ±inf to ±448: ``cuda_fp8.hpp`` of CUDA 13.0, lines
  175-190 and 1587-1589; float16 keeps inf): ±0 for a nonzero first moment, NaN for a zero
  one and for every second moment.

:func:`state_values` is that quantization, tested bit for bit against torchao's own
``OptimState8bit``, ``OptimState4bit`` and ``OptimStateFp8``, and MS-AMP's against a
transcription of its scale rule and kernel casts (``tests/test_health.py``).
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
    MS_AMP = "ms-amp"
    """MS-AMP's LBAdamW: an FP8 E4M3 first moment and a float16 second moment, each under a
    power-of-two scale per tensor."""


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


def lerp_step(stored: Tensor, target: Tensor, beta: float) -> Tensor:
    """torchao's EMA step: ``lerp(stored, target, 1 − β)`` in float32."""
    return torch.lerp(stored, target, 1 - beta)


def msamp_step(stored: Tensor, target: Tensor, beta: float) -> Tensor:
    """MS-AMP's EMA step (module docs): ``β · stored + (1 − β) · target`` in float32, each
    product rounded, then the sum, with ``β`` and ``1 − β`` float32 as the kernel's ``float``
    arguments are."""
    b = torch.tensor(beta, dtype=torch.float32)
    return b * stored.to(torch.float32) + (1 - b) * target.to(torch.float32)


@dataclass(frozen=True)
class TensorScaled:
    """A moment stored under one power-of-two scale per tensor (MS-AMP's rule, module docs):
    codes of the exact cast ``cast``, whose largest finite value is ``fp_max``."""

    cast: str
    fp_max: float
    saturates: bool
    """Whether the kernel's conversion turns ±inf into ±fp_max (``__nv_fp8_e4m3``) rather
    than keeping it (``__float2half``)."""


@dataclass(frozen=True)
class LayoutSpec:
    """How a layout stores each moment: the block, and each moment's map (None: FP8 codes),
    or a per-tensor scaled format; the smallest tensor it quantizes; its EMA step."""

    block: int
    m_map: Callable[[], Tensor] | None
    v_map: Callable[[], Tensor] | None
    smallest: int = SMALLEST
    step: Callable[[Tensor, Tensor, float], Tensor] = lerp_step
    m_scaled: TensorScaled | None = None
    v_scaled: TensorScaled | None = None


LAYOUTS: dict[StateLayout, LayoutSpec] = {
    StateLayout.TORCHAO_8BIT: LayoutSpec(256, lambda: dynamic_map(True),
                                         lambda: dynamic_map(False)),
    StateLayout.TORCHAO_4BIT: LayoutSpec(128, lambda: dynamic_map(True, 3, 4), linear_map),
    StateLayout.TORCHAO_FP8: LayoutSpec(256, None, None),
    StateLayout.MS_AMP: LayoutSpec(1, None, None, smallest=1, step=msamp_step,
                                   m_scaled=TensorScaled("float8_e4m3fn:none", FP8_MAX, True),
                                   v_scaled=TensorScaled("float16:none", 65504.0, False)),
}


def quantized(numel: int, layout: StateLayout | str = StateLayout.TORCHAO_8BIT) -> bool:
    """Whether the layout quantizes a moment of ``numel`` values (module docs)."""
    spec = LAYOUTS[StateLayout(layout)]
    return numel >= spec.smallest and numel % spec.block == 0


SCALE_OVERFLOW = 128
"""From this exponent up MS-AMP's float32 scale ``2**exponent`` is inf."""


def msamp_exponent(amax: float, fp_max: float) -> int | None:
    """The exponent of MS-AMP's per-tensor scale for a tensor of absolute maximum ``amax``:
    ``floor(log2(fp_max / amax))`` with the quotient rounded to float32 as MS-AMP computes it
    and its exponent read from the bits (module docs, step 2); :data:`SCALE_OVERFLOW` when the
    quotient itself overflows float32; None for an amax of 0 or not finite (MS-AMP's scale is
    then 1)."""
    a = torch.tensor(amax, dtype=torch.float32)
    if not (bool(torch.isfinite(a)) and float(a) > 0):
        return None
    quotient = torch.tensor(fp_max, dtype=torch.float32) / a
    if not bool(torch.isfinite(quotient)):
        return SCALE_OVERFLOW
    _, exponent = torch.frexp(quotient)  # quotient = mantissa · 2**exponent, mantissa in [½, 1)
    return int(exponent) - 1


def _tensor_scaled_values(x: Tensor, scaled: TensorScaled) -> Tensor:
    """``x`` (float32) stored under MS-AMP's per-tensor scale and read back."""
    from driftcli.casts.quantization import quantize
    from driftcli.records.castspec import parse_cast

    flat = x.detach().to(torch.float32)
    # the kernel's amax is an fmaxf reduction, which skips NaN (inf is kept)
    amax = torch.where(flat.isnan(), 0.0, flat).abs().max() if flat.numel() else 0.0
    exponent = msamp_exponent(float(amax), scaled.fp_max)
    if exponent is not None and exponent >= SCALE_OVERFLOW:
        # the scale is inf (module docs, step 3): x · inf is ±inf (0 · inf NaN), its code
        # ±fp_max or ±inf, read back times 1 / inf = 0: ±0 where saturated, NaN elsewhere
        nan = torch.full_like(flat, math.nan)
        if not scaled.saturates:
            return nan
        return torch.where(flat == 0, nan, torch.copysign(torch.zeros_like(flat), flat))
    # an amax of 0 or inf: MS-AMP falls back to the scale 1
    sf = torch.tensor(1.0 if exponent is None else math.ldexp(1.0, exponent),
                      dtype=torch.float32)
    # sf is a power of two: the product is exact unless float32 underflows, as on the GPU
    codes = quantize(flat * sf, parse_cast(scaled.cast))
    if not isinstance(codes, Tensor):
        raise TypeError(f"quantize returned {type(codes).__name__}, not a tensor")
    return codes.to(torch.float32) * (1 / sf)


def state_values(x: Tensor, signed: bool,
                 layout: StateLayout | str = StateLayout.TORCHAO_8BIT) -> Tensor:
    """``x`` (float32) stored in ``layout`` and read back, shaped like ``x``: ``exp_avg``
    (``signed``) or ``exp_avg_sq`` (module docs)."""
    spec = LAYOUTS[StateLayout(layout)]
    per_tensor = spec.m_scaled if signed else spec.v_scaled
    if per_tensor is not None:
        return _tensor_scaled_values(x, per_tensor)
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
        step_of = LAYOUTS[StateLayout(layout)].step
        m_next = step_of(sm0, g32, b1)
        v_next = step_of(sv0, g32.square(), b2)
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
