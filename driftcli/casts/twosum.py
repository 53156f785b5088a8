"""Knuth's TwoSum on tensors: ``s = fl(a + b)`` and its rounding error ``r`` exactly
(``a + b = s + r`` whenever ``s`` is finite), in any IEEE binary format and any rounding
to nearest. The rounding of a sum once onto a narrower format
(:func:`driftcli.casts.rounding.add`, a simulated accumulator's step) reads ``r`` as the
sticky bit below ``s``; the matmul reference sums products with it.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def two_sum(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(s, r)``: ``s = fl(a + b)`` and its exact error ``r = a + b - s`` (Knuth's TwoSum; six
    operations, no branch, so it vectorizes and compiles)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)
