"""A cast's route through the fused scan pass, decided once per cast: which scale step it
takes and the plain numbers the pass reads for it (:class:`FlatRoute`), or None where the pass
does not take it and the cast's own steps (:func:`driftcli.casts.quantization.cast_blocks`)
count instead.

The pass (:func:`driftcli.kernels.jit.clip_counts`) reads a float32 slice once for every cast
of a scan; it takes the casts whose scale groups are runs of consecutive elements of the
flattened tensor: one scale for the tensor (or none), or blocks along the last axis under a
power-of-two rule written as a threshold or under the two-level rule, in drift's exact scale
arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cache

import numpy as np
import torch

from driftcli.casts.quantization import plan_scales, pow2_rule, two_level_consts
from driftcli.casts.scaling import ScalePlan
from driftcli.kernels.jit import PIECE
from driftcli.records.cast import Cast
from driftcli.records.modes import Granularity, ScaleRule


class ScaleStep(StrEnum):
    """How the fused pass finds a cast's scale."""

    TENSOR_DIVISOR = "tensor-divisor"
    """One divisor for the slice (the tensor's, from its amax)."""
    TENSOR_POW2 = "tensor-pow2"
    """One power of two for the slice (a tensor's power-of-two rule; 2**0 unscaled)."""
    BLOCK_POW2 = "block-pow2"
    """A power-of-two rule's scale per block, from the block's amax."""
    TWO_LEVEL = "two-level"
    """A two-level (NVFP4) scale per block, from its amax and the tensor's."""


_NO_RULE = np.zeros(6, dtype=np.int64)
_NO_CONSTS = np.ones(5, dtype=np.float32)
_NO_Q = np.zeros(18, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class FlatRoute:
    """What the fused pass reads for one cast."""

    kind: ScaleStep
    """How its scale is found."""
    block: int
    """Elements per scale group; 0 for one scale for the tensor."""
    rule: np.ndarray
    """A power-of-two rule's vector (:func:`driftcli.casts.quantization.pow2_rule`)."""
    consts: np.ndarray
    """A two-level cast's float32 constants
    (:func:`~driftcli.casts.quantization.two_level_consts`)."""
    q: np.ndarray
    """And its scale rounding's parameters."""
    ends: tuple[float, float, float]
    """The element format's max, min and smallest normal."""
    blocked: bool
    """A group holding NaN or inf is NaN whole (block scalings)."""
    needs_amax: bool
    """Its scale reads the tensor's amax (a tensor scale, two-level)."""

    @property
    def two_level(self) -> bool:
        """A two-level scale per block (whose scale rounding ``q`` the pass compiles in)."""
        return self.kind is ScaleStep.TWO_LEVEL

    @property
    def tensor_pow2(self) -> bool:
        """One power of two for the tensor (whose grid a float32 cast may leave)."""
        return self.kind is ScaleStep.TENSOR_POW2


@cache
def flat_route(c: Cast, shape: tuple[int, ...], axis: int, dtype: torch.dtype) -> FlatRoute | None:
    """The route of ``c`` through the fused pass for a tensor of ``shape`` and ``dtype``, its
    blocks along ``axis``; None where the pass does not take it: a dtype other than float32,
    a scale arithmetic or micro-exponents, a transform, blocks that are not runs of the
    flattened tensor or do not divide the pass's piece (:data:`driftcli.kernels.jit.PIECE`:
    no block straddles two), a block rule that is neither a
    power-of-two threshold nor two-level."""
    s, elem = c.scaling, c.format
    if dtype != torch.float32 or not shape or not s.arithmetic.exact or c.micro is not None \
            or c.rht is not None:
        return None
    ends = (float(elem.max), float(elem.min), float(elem.smallest_normal))
    if s.granularity in (Granularity.TENSOR, Granularity.NONE):
        pow2 = s.granularity is Granularity.NONE or bool(s.rule is not None and
                                                       s.rule.power_of_two)
        step = ScaleStep.TENSOR_POW2 if pow2 else ScaleStep.TENSOR_DIVISOR
        return FlatRoute(step, 0, _NO_RULE, _NO_CONSTS, _NO_Q, ends, False,
                         s.granularity is Granularity.TENSOR)
    if s.granularity is not Granularity.BLOCK or axis % len(shape) != len(shape) - 1 or \
            shape[-1] % s.block or PIECE % s.block:
        return None
    if s.rule is ScaleRule.TWO_LEVEL:
        consts, q = two_level_consts(c)
        return FlatRoute(ScaleStep.TWO_LEVEL, s.block, _NO_RULE, consts,
                         np.asarray(q, dtype=np.int64), ends, True, True)
    rule = pow2_rule(c) if s.rule is not None and s.rule.power_of_two else None
    if rule is None:
        return None
    return FlatRoute(ScaleStep.BLOCK_POW2, s.block, rule, _NO_CONSTS, _NO_Q, ends, True, False)


def one_scale(c: Cast, route: FlatRoute, amax: float) -> tuple[int, float, bool]:
    """A one-scale route's scale for a tensor whose largest finite magnitude is ``amax``: the
    exponent of a power of two, or the float32 divisor, by the rule's own steps
    (:func:`driftcli.casts.quantization.plan_scales`); and whether it was clamped."""
    if c.scaling.granularity is Granularity.NONE:
        return 0, 1.0, False
    top = torch.tensor([amax], dtype=torch.float32)
    plan = ScalePlan.of(c.format, c.scaling)
    scale, clamped = plan_scales(top, top[0], plan.divisors(top), plan=plan)
    if route.kind is ScaleStep.TENSOR_POW2:
        return int(scale[0]), 1.0, bool(clamped[0])
    return 0, float(scale[0]), bool(clamped[0])
