"""The casts of a simulated training step, in fewer passes: the same bits as
:func:`driftcli.quantize`.

A training step of the small transformer casts 78 operands of a few thousand to a hundred
thousand elements each (six per matmul: both operands of the forward, dgrad and wgrad). At that
size a cast's cost is not its element arithmetic but the dozen small torch operations around
it that choose the block scales (docs/performance.md#simulated-training-benchmarksbench_trainpy).
:func:`fast_cast` computes the scales of the two block-scaled families the policies use in one
numba pass over the blocks (:mod:`driftcli.arith.castkernels`) and rounds the elements with
:mod:`driftcli.jit`'s own kernels, the very code :func:`~driftcli.quantize` runs:

- power-of-two block scales (MX: ``floor``, ``ceil``, ``even``, ``ceil-amax``, with headroom),
  each rule written as a threshold on amax's significand (:func:`rule_threshold`; the tests
  compare every rule on every format with :data:`driftcli.scaling.FAST_RULES`);
- two-level scales (NVFP4), the float32 operations of
  :func:`driftcli.scaling.plan_two_level_scales` in their order.

Anything else (float64 operands, per-tensor and per-channel scales, tiles, scale arithmetic
presets, a scaled grid that leaves float32's range, no numba) returns None and the caller
runs :func:`~driftcli.quantize`. :func:`use_fast_casts` switches the path off, so that a run
can be compared with the general one (``tests/test_fastcast.py`` trains 20 steps both ways).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from functools import cache
from typing import Any

import numpy as np
import torch

from driftcli import compiling, jit
from driftcli import rounding as fast
from driftcli.cast import Cast
from driftcli.modes import DEFAULT_SR_BITS, Granularity, Overflow, Rounding, ScaleRule
from driftcli.scaling import ScalePlan, pow2_range, to_blocks

Tensor = torch.Tensor

_FLOAT32_TINY = 2.0**-126
_VECTOR_ROUNDINGS = (Rounding.RNE, Rounding.SR)
"""The rounding modes of :func:`driftcli.arith.castkernels.pow2_round_kernel` (the others
round power-of-two blocks with :func:`driftcli.jit.round_bits`)."""
_EMPTY = np.empty(0, dtype=np.int32)
_enabled = os.environ.get("DRIFT_FAST_CAST", "auto") != "never"


def fast_casts_enabled() -> bool:
    """Whether :func:`fast_cast` runs (``DRIFT_FAST_CAST=never`` turns it off)."""
    return _enabled


@contextmanager
def use_fast_casts(enabled: bool) -> Iterator[None]:
    """Run the block with the fused path on or off (the general path gives the same bits)."""
    global _enabled
    was = _enabled
    _enabled = enabled
    try:
        yield
    finally:
        _enabled = was


def _fraction_bits(value: float) -> int | None:
    """The 23 fraction bits of a significand in [1, 2], or None when it has more (then the
    comparison is left to the general path); 2 gives ``2**23``, above every fraction."""
    f = (Fraction(value) - 1) * (1 << 23)
    return int(f) if f.denominator == 1 and 0 <= f <= (1 << 23) else None


def rule_threshold(plan: ScalePlan) -> tuple[int, bool] | None:
    """A power-of-two rule as ``(threshold, strict)``: its exponent is ``floor(log2 amax) -
    emax``, plus one where amax's significand (as 23 fraction bits) is above the threshold
    (``strict``) or at least it. None for a rule written otherwise."""
    rule = plan.rule
    if rule is ScaleRule.FLOOR:
        return 1 << 23, True  # never above: no 23-bit fraction exceeds it
    if rule is ScaleRule.CEIL_AMAX:
        return 0, True  # any significand above 1
    threshold = {ScaleRule.CEIL: (plan.elem_max_significand, True),
                 ScaleRule.EVEN: (plan.even_threshold, False)}.get(rule)
    if threshold is None:
        return None
    bits = _fraction_bits(threshold[0])
    return None if bits is None else (bits, threshold[1])


@cache
def _pow2_rule(c: Cast) -> np.ndarray | None:
    """The kernel's rule vector of a cast (module docs), or None."""
    plan = ScalePlan.of(c.format, c.scaling)
    found = rule_threshold(plan)
    if found is None:
        return None
    low, high = pow2_range(c.scaling.scale_format)  # type: ignore[arg-type]
    return np.array([plan.elem_emax, found[0], int(found[1]), plan.headroom, low, high],
                    dtype=np.int64)


@cache
def _two_level_consts(c: Cast) -> tuple[np.ndarray, np.ndarray]:
    """The float32 constants and the scale rounding's parameters of a two-level cast."""
    plan = ScalePlan.of(c.format, c.scaling)
    consts = np.array([plan.elem_max, plan.two_level_max, plan.smallest, plan.largest,
                       _FLOAT32_TINY], dtype=np.float32)
    q = fast.jit_params(src=fast.source_of(torch.float32),
                        tgt=plan.scale_target,  # type: ignore[arg-type]
                        rounding=Rounding.RNE, overflow=Overflow.IEEE, sr_bits=DEFAULT_SR_BITS)
    return consts, np.array(q, dtype=np.int64)


def _kernels() -> Any:
    import driftcli.arith.castkernels as code  # numba, on first use only

    return code


def applies(x: Tensor, c: Cast) -> bool:
    """Whether :func:`fast_cast` takes ``x`` under ``c`` (module docs)."""
    s = c.scaling
    return (_enabled and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.numel() > 0 and s.granularity is Granularity.BLOCK and s.arithmetic.exact
            and s.rule is not None
            and (s.rule is ScaleRule.TWO_LEVEL or (s.rule.power_of_two
                                                   and _pow2_rule(c) is not None))
            and not compiling.forced() and jit.usable(x))


def fast_cast(x: Tensor, c: Cast, axis: int, random_bits: Tensor | None,
              sr_bits: int = DEFAULT_SR_BITS) -> Tensor | None:
    """``quantize(x, c, axis=axis, random_bits=random_bits)`` by the fused path, bit for bit,
    or None where the path does not apply (then call :func:`~driftcli.quantize`). ``x`` is a
    float32 tensor that does not require grad; ``random_bits`` are checked by the caller."""
    if not applies(x, c):
        return None
    s = c.scaling
    blocks, back = to_blocks(x, s, axis)
    blocks = blocks.contiguous()
    bits = None if random_bits is None else to_blocks(random_bits, s, axis)[0].contiguous()
    rows, cols = blocks.shape
    view = blocks.view(torch.int32).reshape(-1).numpy()
    bad = np.empty(rows, dtype=np.bool_)
    p = fast.jit_params(src=fast.source_of(torch.float32), tgt=fast.target_of(c.format),
                        rounding=c.rounding, overflow=c.overflow, sr_bits=sr_bits)
    code = _kernels()
    if s.rule is ScaleRule.TWO_LEVEL:
        consts, q = _two_level_consts(c)
        divisor = np.empty(rows, dtype=np.float32)
        code.two_level_scales(view, cols, divisor, bad, consts, q)
        out = jit.round_divided(blocks, torch.from_numpy(divisor), bits, p,
                                torch.from_numpy(bad))
        return back(out).to(x.dtype)
    rule = _pow2_rule(c)
    ks = np.empty(rows, dtype=np.int64)
    kmin, kmax = code.pow2_scales(view, cols, ks, bad, rule)
    fmt = c.format
    # a scaled grid beyond float32's range: the general path rounds it in float64
    if (kmin != code.NONE and kmin + fmt.qmin < -149) or kmax + fmt.emax >= 128:
        return None
    tgt = fast.target_of(fmt)
    if c.rounding not in _VECTOR_ROUNDINGS or not (tgt.signed and tgt.has_zero):
        out = jit.round_bits(blocks, None, bits, torch.from_numpy(ks)[:, None], p,
                             torch.from_numpy(bad))
        return back(out).to(x.dtype)
    kernel = code.pow2_round_kernel(p[13], p[14], bits is not None)
    draws = _EMPTY if bits is None else bits.to(torch.int32).reshape(-1).numpy()
    rounded = np.empty_like(view)
    jit.spread(kernel, rows, cols, view, draws, ks, bad, cols, rounded, p)
    return back(torch.from_numpy(rounded).view(torch.float32).view(rows, cols)).to(x.dtype)
