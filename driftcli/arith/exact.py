"""The exact matmul every simulated matmul is measured against, in torch: each product of
two float32 values is exact in float64, and their sum is carried with a bound on its
error (:func:`gamma`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from driftcli.casts.twosum import two_sum
from driftcli.errors import DriftError

Tensor = torch.Tensor

UNIT_ROUNDOFF = 2.0 ** -53
"""float64's unit roundoff u, in the bound of :func:`exact_matmul`."""


@dataclass(frozen=True)
class ExactProduct:
    """The exact product ``A·B`` as an unevaluated sum ``hi + lo`` of float64 tensors."""

    hi: Tensor
    """The float64 sum of the products, in order (Sum2's ``s``)."""
    lo: Tensor
    """The float64 sum of every rounding error of ``hi`` (Sum2's ``σ``)."""
    bound: Tensor
    """Per output, a bound on ``|hi + lo − exact|``: ``γ(K−1)² · Σ|a_k b_k|``."""

    @property
    def value(self) -> Tensor:
        """``hi + lo`` rounded to float64."""
        return self.hi + self.lo


def gamma(n: int) -> float:
    """Higham's ``γ(n) = n·u / (1 − n·u)`` for float64."""
    nu = n * UNIT_ROUNDOFF
    return nu / (1 - nu)


def _as_float32(x: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise DriftError(f"operand {name} must be a floating-point tensor, not "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    return x.to(torch.float32)


def exact_matmul(a: Tensor, b: Tensor) -> ExactProduct:
    """The exact product of ``a`` (..., M, K) and ``b`` (..., K, N) taken as float32 (as
    :func:`~driftcli.arith.matmul.matmul` takes them), with its error bound.

    Each product ``a_k·b_k`` of two float32 values is exact in float64. The products are summed
    in k order by Sum2 (Ogita, Rump & Oishi, "Accurate sum and dot product", 2005): ``hi`` is
    the float64 running sum and TwoSum yields each addition's rounding error exactly, so
    ``hi + Σ errors`` is the exact sum; ``lo`` is the float64 sum of the errors, off by at most
    ``γ(K−2)·Σ|errors| ≤ γ(K−2)·γ(K−1)·Σ|a_k b_k|``. The bound returned is
    ``γ(K−1)²·Σ|a_k b_k|``, widened by ``1 + 2γ(K)`` because ``Σ|a_k b_k|`` is itself summed in
    float64. Non-finite operands make non-finite outputs; check them before trusting a result.
    """
    a32, b32 = _as_float32(a, "A"), _as_float32(b, "B")
    if a32.dim() < 2 or b32.dim() < 2 or a32.shape[-1] != b32.shape[-2]:
        raise DriftError(f"exact_matmul needs (..., M, K) and (..., K, N) operands, got "
                         f"{tuple(a32.shape)} and {tuple(b32.shape)}")
    batch = torch.broadcast_shapes(a32.shape[:-2], b32.shape[:-2])
    (M, K), N = a32.shape[-2:], b32.shape[-1]
    a64 = a32.double().expand(*batch, M, K)
    bt64 = b32.double().transpose(-1, -2).expand(*batch, N, K)
    hi = torch.zeros((*batch, M, N), dtype=torch.float64, device=a64.device)
    lo = torch.zeros_like(hi)
    abs_sum = torch.zeros_like(hi)
    for k in range(K):
        p = a64[..., :, k, None] * bt64[..., None, :, k]  # exact: 24 x 24 significant bits
        hi, err = two_sum(hi, p)
        lo += err
        abs_sum += p.abs()
    g = gamma(max(K - 1, 0))
    bound = abs_sum * (g * g * (1 + 2 * gamma(K)))
    return ExactProduct(hi, lo, bound)
