"""Matmuls that cast both operands in the forward and in both backward matmuls.

``policy_matmul(a, b, policy)`` is ``a @ b`` (``a`` of shape ``(..., M, K)``, ``b`` of shape
``(..., K, N)``, leading dimensions broadcast) as an autograd function whose three matmuls
each follow their role's :class:`~driftcli.arith.matmul.MatmulSpec`:

- forward ``C = A·B``: A cast along K (its last axis), B along K (its second-to-last);
- dgrad ``dA = dC·Bᵀ``: dC cast along N (its last axis), Bᵀ along N;
- wgrad ``dB = Aᵀ·dC``: Aᵀ cast along M, dC along M.

Where an operand was broadcast over leading dimensions (a weight shared by every sequence of
a batch), its gradient sums over them: those dimensions join the contraction, so the tokens of
every sequence form one long contraction axis along which blocks run, as a linear layer's
wgrad over a ``(batch·tokens, features)`` activation does on real hardware.

What the backward reads for A and B is the policy's :class:`BackwardState`. The gradient that
comes back is the product of the cast operands; it is never the cast of an uncast product.

Arithmetic of one simulated matmul, for operands of any float dtype: each operand is cast from
its own values (float64 operands are cast from their float64 values, so nothing is rounded
twice), then the dequantized values are taken as float32 (exact for every element format of
at most 24 significant bits under a power-of-two scale: every MX format and plain casts; a
float32 tensor scale, as in ``fp8_e4m3`` or NVFP4, makes the dequantized value one float32
rounding of the exact product, as a float32 kernel epilogue would). ``native`` order is then
``torch.matmul`` in float32; other orders go through :func:`driftcli.arith.matmul.accumulate`
(the operands as cast, with the casts' block scales under ``scale=block``: nothing is cast
twice). The output cast, if any, follows; the result
takes the operands' dtype. A role whose spec is None is ``torch.matmul`` in the operands' own
dtype.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, cast

import torch

from driftcli.arith.matmul import MatmulSpec, ScaleApplication, accumulate
from driftcli.arith.policy import ArithmeticPolicy, BackwardState, Role
from driftcli.casts.quantization import QuantInfo, quantize
from driftcli.casts.rounding import draw_random_bits
from driftcli.errors import DriftError
from driftcli.records.cast import Cast
from driftcli.records.modes import DEFAULT_SR_BITS, Rounding

Tensor = torch.Tensor

_EXACT_DTYPES = (torch.float32, torch.float64)
"""Dtypes a cast reads directly; narrower floats are widened to float32 first (exactly)."""


class Slot(IntEnum):
    """Which cast of one matmul call a random draw is for (one seed each)."""

    FORWARD_LHS = 0
    FORWARD_RHS = 1
    FORWARD_OUT = 2
    DGRAD_LHS = 3
    DGRAD_RHS = 4
    DGRAD_OUT = 5
    WGRAD_LHS = 6
    WGRAD_RHS = 7
    WGRAD_OUT = 8


def derive_seed(seed: int, index: int, slot: Slot) -> int:
    """The seed of one cast: a hash of the policy seed, the call's index and the slot, so
    every cast of a step draws independent bits and a rerun draws the same ones."""
    digest = hashlib.blake2b(f"{seed}:{index}:{int(slot)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class MatmulCall:
    """One intercepted matmul: the policy it runs under and its index in the step."""

    policy: ArithmeticPolicy
    index: int = 0

    def seed(self, slot: Slot) -> int:
        """The seed of the cast in ``slot``."""
        return derive_seed(self.policy.seed, self.index, slot)


def _bits(c: Cast | None, shape: torch.Size, seed: int, device: torch.device) -> Tensor | None:
    """Random bits for a stochastic cast (None for every other cast)."""
    if c is None or c.rounding is not Rounding.SR:
        return None
    return draw_random_bits(shape, seed, DEFAULT_SR_BITS, device)


def cast_operand(x: Tensor, c: Cast | None, axis: int, bits: Tensor | None) -> Tensor:
    """``x`` cast along ``axis`` (dequantized values; float32 for half-precision input)."""
    return cast_with_scales(x, c, axis, bits, want_scales=False)[0]


def cast_with_scales(x: Tensor, c: Cast | None, axis: int, bits: Tensor | None, *,
                     want_scales: bool) -> tuple[Tensor, Tensor | None]:
    """``x`` cast along ``axis`` (as :func:`cast_operand`) and, with ``want_scales``, the
    cast's per-block scales (what :func:`~driftcli.arith.matmul.accumulate` needs under
    ``scale=block``; None without a cast)."""
    if c is None:
        return x, None
    # detached: a tensor that requires grad is refused by the numba kernels (an autograd
    # function's inputs keep requires_grad inside its forward) and would take torch's kernel
    work = x.detach() if x.dtype in _EXACT_DTYPES else x.detach().float()
    if want_scales:
        info = cast(QuantInfo, quantize(work, c, axis=axis, random_bits=bits, return_info=True))
        return info.values, info.scales
    return cast(Tensor, quantize(work, c, axis=axis, random_bits=bits)), None


def simulated_product(qa: Tensor, qb: Tensor, spec: MatmulSpec, out_seed: int, *,
                      lhs_scales: Tensor | None = None,
                      rhs_scales: Tensor | None = None) -> Tensor:
    """``qa·qb`` of operands already cast by ``spec``'s casts (with their block scales under
    ``scale=block``): the accumulation and output cast of ``spec`` (float32 result; see the
    module docs)."""
    a32, b32 = qa.float(), qb.float()
    # the spec fixes the arithmetic: an autocast region around the model must not lower it
    with torch.autocast(a32.device.type, enabled=False):
        c = accumulate(a32, b32, spec, lhs_scales=lhs_scales, rhs_scales=rhs_scales)
    if spec.out is not None:
        c = cast_operand(c, spec.out, -1, _bits(spec.out, c.shape, out_seed, c.device))
    return c


def _blocked(spec: MatmulSpec) -> bool:
    """Whether ``spec``'s accumulation reads its operands' block scales."""
    return spec.scale_application is ScaleApplication.BLOCK


def role_product(lhs: Tensor, rhs: Tensor, spec: MatmulSpec | None, *, lhs_bits: Tensor | None,
                 rhs_bits: Tensor | None, out_seed: int, dtype: torch.dtype) -> Tensor:
    """One role's matmul ``lhs·rhs``: each side cast along the contraction axis, then
    accumulated; ``torch.matmul`` when ``spec`` is None."""
    if spec is None:
        return torch.matmul(lhs.to(dtype), rhs.to(dtype))
    qa, sa = cast_with_scales(lhs, spec.lhs, -1, lhs_bits, want_scales=_blocked(spec))
    qb, sb = cast_with_scales(rhs, spec.rhs, -2, rhs_bits, want_scales=_blocked(spec))
    return simulated_product(qa, qb, spec, out_seed, lhs_scales=sa, rhs_scales=sb).to(dtype)


# --- layouts of the backward operands ---------------------------------------------------------

def _reduced(shape: torch.Size, batch: torch.Size) -> tuple[int, ...]:
    """The leading dimensions of ``batch`` over which an operand of ``shape`` was broadcast."""
    own = shape[:-2]
    offset = len(batch) - len(own)
    return tuple(i for i, size in enumerate(batch)
                 if size != 1 and (i < offset or own[i - offset] == 1))


def _fold(t: Tensor, batch: torch.Size, reduce: tuple[int, ...], lhs: bool) -> Tensor:
    """Move the ``reduce`` dimensions into the contraction axis.

    ``t`` is ``(..., rows, cols)``; as the left operand its contraction axis is the last, as
    the right operand the second-to-last. Both operands flatten (reduced dims, axis) in the
    same order, so the folded product sums over the reduced dimensions too.
    """
    if not reduce:
        return t
    t = t.expand(*batch, *t.shape[-2:])
    nb = len(batch)
    keep = [i for i in range(nb) if i not in reduce]
    kept_sizes = [batch[i] for i in keep]
    folded = math.prod(batch[i] for i in reduce)
    rows, cols = t.shape[-2:]
    if lhs:
        t = t.permute(*keep, nb, *reduce, nb + 1)
        return t.reshape(*kept_sizes, rows, folded * cols)
    t = t.permute(*keep, *reduce, nb, nb + 1)
    return t.reshape(*kept_sizes, folded * rows, cols)


class PolicyMatmul(torch.autograd.Function):
    """``a @ b`` whose forward, dgrad and wgrad matmuls follow a policy (module docs)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, call: MatmulCall) -> Tensor:
        policy = call.policy
        spec = policy.forward
        dtype = a.dtype
        if spec is None:
            qa, qb = a, b
            out = torch.matmul(a, b)
        else:
            qa, sa = cast_with_scales(
                a, spec.lhs, -1, _bits(spec.lhs, a.shape, call.seed(Slot.FORWARD_LHS), a.device),
                want_scales=_blocked(spec))
            qb, sb = cast_with_scales(
                b, spec.rhs, -2, _bits(spec.rhs, b.shape, call.seed(Slot.FORWARD_RHS), b.device),
                want_scales=_blocked(spec))
            out = simulated_product(qa, qb, spec, call.seed(Slot.FORWARD_OUT), lhs_scales=sa,
                                    rhs_scales=sb).to(dtype)
        saved = BackwardState.SAVED_CAST  # per operand: a hybrid recipe recasts one only
        ctx.save_for_backward(qa if policy.operand_state(True) is saved else a,
                              qb if policy.operand_state(False) is saved else b)
        ctx.call = call
        ctx.shapes = (a.shape, b.shape)
        return out

    @staticmethod
    def backward(ctx: Any, dc: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a, b = ctx.saved_tensors
        call: MatmulCall = ctx.call
        a_shape, b_shape = ctx.shapes
        # our own matmuls must not reach a TorchFunctionMode (the arithmetic mode included)
        with torch._C.DisableTorchFunction():
            da = (_backward(call, Role.DGRAD, dc, b, a_shape) if ctx.needs_input_grad[0]
                  else None)
            db = (_backward(call, Role.WGRAD, dc, a, b_shape) if ctx.needs_input_grad[1]
                  else None)
        return da, db, None


def _forward_bits_seed(call: MatmulCall, forward_slot: Slot, own_slot: Slot) -> int:
    """Recast reuses the forward's random bits for the same element; fresh-sr draws anew."""
    lhs = forward_slot is Slot.FORWARD_LHS
    fresh = call.policy.operand_state(lhs) is BackwardState.FRESH_SR
    return call.seed(own_slot if fresh else forward_slot)


def _backward(call: MatmulCall, role: Role, dc: Tensor, saved: Tensor,
              shape: torch.Size) -> Tensor:
    """The gradient of the operand of ``shape`` from the other, ``saved``, one: ``dA = dC·Bᵀ``
    (dgrad, ``saved`` is B) or ``dB = Aᵀ·dC`` (wgrad, ``saved`` is A), summed over the
    dimensions that operand was broadcast over. ``dC`` is cast with fresh random bits; the
    saved operand reuses the forward's (see :func:`_forward_bits_seed`)."""
    spec = call.policy.spec(role)
    slots = ROLE_SLOTS[role]
    grad_first = role is Role.DGRAD  # dC is the left operand of the dgrad, the right of the wgrad
    batch = dc.shape[:-2]
    reduce = _reduced(shape, batch)
    other = saved.transpose(-1, -2)
    pair = (dc, other) if grad_first else (other, dc)
    folded = (_fold(pair[0], batch, reduce, lhs=True), _fold(pair[1], batch, reduce, lhs=False))
    bits: list[Tensor | None] = [None, None]
    if spec is not None:
        casts = (spec.lhs, spec.rhs)
        mine, theirs = (0, 1) if grad_first else (1, 0)
        bits[mine] = _bits(casts[mine], folded[mine].shape, call.seed(slots[mine]), dc.device)
        forward = Slot.FORWARD_RHS if grad_first else Slot.FORWARD_LHS
        raw = _bits(casts[theirs], saved.shape, _forward_bits_seed(call, forward, slots[theirs]),
                    saved.device)
        bits[theirs] = None if raw is None else _fold(raw.transpose(-1, -2), batch, reduce,
                                                      lhs=not grad_first)
    out = role_product(folded[0], folded[1], spec, lhs_bits=bits[0], rhs_bits=bits[1],
                       out_seed=call.seed(slots[2]), dtype=dc.dtype)
    return out.reshape(shape)


def policy_matmul(a: Tensor, b: Tensor, policy: ArithmeticPolicy, *, index: int = 0) -> Tensor:
    """``a @ b`` under ``policy`` in forward and backward (``a``: ``(..., M, K)``, ``b``:
    ``(..., K, N)``, both floating point of one dtype, leading dimensions broadcast).

    ``index`` tells this call apart from the others of a step when stochastic casts draw
    their random bits (the arithmetic mode numbers every matmul it routes).
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point or t.dim() < 2:
            raise DriftError(f"policy_matmul operand {name} must be a floating-point tensor "
                             f"with at least two dimensions, not {getattr(t, 'dtype', t)!r} "
                             f"of shape {tuple(getattr(t, 'shape', ()))}")
    if a.dtype != b.dtype:
        raise DriftError(f"policy_matmul operands have dtypes {a.dtype} and {b.dtype}; convert "
                         "one so both match, as torch.matmul requires")
    if a.shape[-1] != b.shape[-2]:
        raise DriftError(f"policy_matmul shapes {tuple(a.shape)} and {tuple(b.shape)} do not "
                         f"agree along K ({a.shape[-1]} != {b.shape[-2]})")
    return cast(Tensor, PolicyMatmul.apply(a, b, MatmulCall(policy, index)))


ROLE_SLOTS = {Role.FORWARD: (Slot.FORWARD_LHS, Slot.FORWARD_RHS, Slot.FORWARD_OUT),
              Role.DGRAD: (Slot.DGRAD_LHS, Slot.DGRAD_RHS, Slot.DGRAD_OUT),
              Role.WGRAD: (Slot.WGRAD_LHS, Slot.WGRAD_RHS, Slot.WGRAD_OUT)}
"""The slots of each role's lhs, rhs and output casts."""
