"""The one table of matmul functions drift intercepts, and how each call becomes products.

Two ``torch.overrides.TorchFunctionMode`` read :data:`MATMULS`: the arithmetic mode
(:mod:`driftcli.arith.mode`), which runs every product of a routed call under a policy, and
capture (:mod:`driftcli.io.capture`), which records the operands of those same products into
a dump. So a dump's operands are the operands a policy casts, and a function added here is
cast and recorded alike.

Each routed function has a *route*: ``route(sink, name, func, *args, **kwargs)`` finds the
products the call makes and hands them to a :class:`ProductSink`. It first asks
``sink.passthrough(lhs, rhs, name)`` whether the call runs as the model wrote it (then it
calls ``func`` itself); otherwise it makes each product with ``sink.product``. Most routes
multiply two of the call's own arguments (``F.linear``'s input and weight, ``addmm``'s two
matrices). Two decompose: ``torch.einsum`` with two operands becomes one batched matmul
(batch, free and contracted indices laid out as ``(batch..., M, K) @ (batch..., K, N)``), and
``F.scaled_dot_product_attention`` becomes ``q·kᵀ``, the scale, the causal and given masks, the
softmax in float32 or wider, then ``p·v``.

A function whose route is None multiplies matrices where a mode cannot see inside
(``F.multi_head_attention_forward`` of ``nn.MultiheadAttention``, ``tensordot``, convolutions,
...): the arithmetic mode refuses it under a policy, and capture counts it as unrecorded.
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from driftcli.errors import DriftError

Tensor = torch.Tensor

ROOT = "<root>"
"""How the arithmetic mode and capture name the module of matmuls the outermost module's own
``forward`` runs (its qualified name is ``""``)."""
OUTSIDE = "<outside>"
"""How they name matmuls run inside the ``with`` block but outside any module."""


class UnsupportedMatmulError(DriftError):
    """A matmul the policy cannot be applied to."""


class MatmulKind(StrEnum):
    """What a product multiplies, as the interception sees it: the kinds a policy can keep in
    high precision (``keep_matmuls``)."""

    LINEAR = "linear"
    """A weight times an activation: every ``F.linear`` (``nn.Linear``), and any other product
    one of whose operands is a parameter of the model (or a view of one)."""
    ATTENTION = "attention"
    """Two activations: both products of ``F.scaled_dot_product_attention`` (``q·kᵀ`` and
    ``P·v``), and any other product with no parameter among its operands (attention written
    with explicit matmuls, as drift's transformer and most models do)."""


def matmul_kind(name: str, a: Any, b: Any, is_parameter: Callable[[Any], bool]) -> MatmulKind:
    """The :class:`MatmulKind` of the product of ``a`` and ``b`` that the call ``name`` makes
    (the names of :data:`MATMULS`; sdpa's products end ``.qk`` and ``.pv``)."""
    if name.startswith("F.scaled_dot_product_attention"):
        return MatmulKind.ATTENTION
    if name == "F.linear" or is_parameter(a) or is_parameter(b):
        return MatmulKind.LINEAR
    return MatmulKind.ATTENTION


class ProductSink(Protocol):
    """What a route hands its products to: the arithmetic mode (which casts them) or capture
    (which records them)."""

    def passthrough(self, a: Any, b: Any, name: str,
                    products: tuple[str, ...] | None = None) -> bool:
        """Whether the call multiplying ``a`` by ``b`` runs as the model wrote it; the route
        then calls the function itself. ``products`` names the products of a call that makes
        more than one (sdpa's ``.qk`` and ``.pv``); by default the call is one, ``name``."""
        ...

    def note_plain(self, name: str, reason: str) -> None:
        """The route runs the call as written for a reason of its own (no contracted index)."""
        ...

    def product(self, a: Tensor, b: Tensor, name: str) -> Tensor:
        """``a @ b`` with ``torch.matmul``'s shape rules: one product of the call."""
        ...


Route = Callable[..., Any]
"""``route(sink, name, func, *args, **kwargs)``: the call ``func(*args, **kwargs)`` made of
products on ``sink`` (module docs)."""


@dataclasses.dataclass(frozen=True)
class Intercepted:
    """One intercepted function: how counts name it and how its calls become products."""

    name: str
    """How counts and messages name it (``torch.matmul`` for all its spellings)."""
    route: Route | None
    """How a call becomes products; None for a function that multiplies matrices out of the
    modes' sight (refused under a policy, unrecorded by capture)."""
    linear: bool = False
    """Whether the right operand is stored ``(N, K)`` and multiplied transposed, as
    ``F.linear``'s weight: its backward operands differ (``docs/capture.md``)."""
    decomposed: bool = False
    """Whether the route multiplies tensors it derives from the arguments (einsum's batched
    layout, sdpa's ``q·kᵀ`` and ``p·v``) rather than two of the arguments themselves."""


# --- routes -------------------------------------------------------------------------------------

def _check_out(name: str, kwargs: dict[str, Any]) -> None:
    if kwargs.get("out") is not None:
        raise UnsupportedMatmulError(f"{name}(..., out=...) is not supported under a policy; "
                                     "assign the result instead")


def _linear(sink: ProductSink, name: str, func: Route, input: Tensor, weight: Tensor,
            bias: Tensor | None = None) -> Tensor:
    if sink.passthrough(input, weight, name):
        return func(input, weight, bias)
    out = sink.product(input, weight.transpose(-1, -2) if weight.dim() > 1 else weight, name)
    return out if bias is None else out + bias


def _matmul(sink: ProductSink, name: str, func: Route, input: Tensor, other: Tensor,
            **kwargs: Any) -> Tensor:
    _check_out(name, kwargs)
    if sink.passthrough(input, other, name):
        return func(input, other, **kwargs)
    return sink.product(input, other, name)


def _rmatmul(sink: ProductSink, name: str, func: Route, input: Tensor,
             other: Tensor) -> Tensor:
    return _matmul(sink, name, lambda a, b: func(b, a), other, input)


def _mm(sink: ProductSink, name: str, func: Route, input: Tensor, mat2: Tensor,
        **kwargs: Any) -> Tensor:
    _check_out(name, kwargs)
    want = 3 if name == "torch.bmm" else 2
    if any(isinstance(t, Tensor) and t.dim() != want for t in (input, mat2)):
        return func(input, mat2, **kwargs)  # torch reports its own shape error
    return _matmul(sink, name, func, input, mat2)


def _add_product(sink: ProductSink, name: str, func: Route, input: Tensor, mat1: Tensor,
                 mat2: Tensor, *, beta: float = 1, alpha: float = 1, **kwargs: Any) -> Tensor:
    _check_out(name, kwargs)
    if sink.passthrough(mat1, mat2, name):
        return func(input, mat1, mat2, beta=beta, alpha=alpha)
    prod = sink.product(mat1, mat2, name)
    prod = prod if alpha == 1 else prod * alpha
    return prod + (input if beta == 1 else input * beta) if beta != 0 else prod


def _mv(sink: ProductSink, name: str, func: Route, input: Tensor, vec: Tensor,
        **kwargs: Any) -> Tensor:
    return _matmul(sink, name, func, input, vec, **kwargs)


def _sdpa(sink: ProductSink, name: str, func: Route, query: Tensor, key: Tensor,
          value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> Tensor:
    if sink.passthrough(query, key, name, products=(f"{name}.qk", f"{name}.pv")):
        return func(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if dropout_p:
        raise UnsupportedMatmulError(
            f"{name}: dropout_p={dropout_p} under a policy; drift measures the deterministic "
            "step, so put the model in eval() or pass dropout_p=0")
    L, S = query.shape[-2], key.shape[-2]
    factor = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scores = sink.product(query, key.transpose(-2, -1), f"{name}.qk") * factor
    # the softmax runs in float32, or in the scores' dtype where that is wider
    work = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(work)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.to(work)
    probs = torch.softmax(scores, dim=-1)
    # a row masked everywhere attends to nothing (torch's math kernel gives zeros too)
    probs = torch.where(torch.isneginf(scores).all(dim=-1, keepdim=True),
                        torch.zeros((), dtype=work, device=probs.device), probs)
    return sink.product(probs.to(value.dtype), value, f"{name}.pv")


_LETTERS = string.ascii_letters


def _einsum(sink: ProductSink, name: str, func: Route, equation: str,
            *operands: Any) -> Tensor:
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or not all(isinstance(t, Tensor) for t in operands):
        raise UnsupportedMatmulError(
            "torch.einsum in sublist form (einsum(a, [0, 1], b, [1, 2])) is not supported "
            "under a policy; write the equation as a string, e.g. 'ij,jk->ik'")
    if len(operands) == 1:
        return func(equation, *operands)  # a single operand: no product to simulate
    if len(operands) > 2:
        raise UnsupportedMatmulError(
            f"torch.einsum({equation!r}) with {len(operands)} operands is not supported under "
            "a policy (the order of its matmuls is torch's choice); split it into two-operand "
            "einsums")
    a, b = operands
    terms, out = _parse_einsum(equation, a.dim(), b.dim())
    return _einsum_product(sink, name, equation, lambda: func(equation, a, b), a, b, terms,
                           out)


def _parse_einsum(equation: str, ndim_a: int, ndim_b: int) -> tuple[list[str], str]:
    """The two input terms and the output term with every ellipsis spelled out in letters."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    bad = UnsupportedMatmulError
    if len(terms) != 2:
        raise bad(f"einsum {equation!r}: the equation names {len(terms)} operands, not 2")
    used = set(eq) - set(".,->")
    if not used <= set(_LETTERS):
        raise bad(f"einsum {equation!r}: indices must be letters a-z, A-Z")
    spare = [c for c in _LETTERS if c not in used]
    widths = []
    for term, ndim in zip(terms, (ndim_a, ndim_b), strict=True):
        named = len(term.replace("...", ""))
        if "..." in term:
            widths.append(ndim - named)
        elif named != ndim:
            raise bad(f"einsum {equation!r}: term {term!r} names {named} dimensions of an "
                      f"operand with {ndim}")
        else:
            widths.append(0)
    n_ell = max(widths)
    if min(widths) < 0:
        raise bad(f"einsum {equation!r}: more indices than dimensions")
    ell = "".join(spare[:n_ell])
    terms = [t.replace("...", ell[n_ell - w:]) for t, w in zip(terms, widths, strict=True)]
    if not arrow:  # implicit output: the ellipsis, then the letters seen once, sorted
        joined = "".join(terms)
        once = sorted((c for c in set(joined) if joined.count(c) == 1 and c not in ell),
                      key=_LETTERS.index)
        out = ell + "".join(once)
    else:
        out = out.replace("...", ell)
    for term in [*terms, out]:
        if len(set(term)) != len(term):
            raise bad(f"einsum {equation!r}: a repeated index within one term (a diagonal) is "
                      "not supported under a policy; take torch.diagonal first")
    if not set(out) <= set("".join(terms)):
        raise bad(f"einsum {equation!r}: the output names an index no input has")
    return terms, out


def _einsum_product(sink: ProductSink, name: str, equation: str,
                    as_written: Callable[[], Tensor], a: Tensor, b: Tensor, terms: list[str],
                    out: str) -> Tensor:
    """The einsum as one batched matmul on ``sink``; ``as_written`` (the einsum itself)
    wherever the sink passes it through, so that ``exact`` is the model's own op."""
    ta, tb = terms
    # indices only one operand has and the output lacks are summed over first
    a_sum = [i for i, c in enumerate(ta) if c not in tb and c not in out]
    b_sum = [i for i, c in enumerate(tb) if c not in ta and c not in out]
    if a_sum:
        a = a.sum(dim=a_sum)
        ta = "".join(c for i, c in enumerate(ta) if i not in a_sum)
    if b_sum:
        b = b.sum(dim=b_sum)
        tb = "".join(c for i, c in enumerate(tb) if i not in b_sum)
    contract = [c for c in ta if c in tb and c not in out]
    if not contract:
        sink.note_plain(name, "no contracted index")
        return as_written()
    batch = [c for c in out if c in ta and c in tb]
    a_free = [c for c in ta if c not in tb]
    b_free = [c for c in tb if c not in ta]
    size_a = dict(zip(ta, a.shape, strict=True))
    size_b = dict(zip(tb, b.shape, strict=True))
    for c in contract:
        if size_a[c] != size_b[c]:
            raise UnsupportedMatmulError(
                f"einsum {equation!r}: contracted index {c!r} has sizes {size_a[c]} and "
                f"{size_b[c]}")
    K = math.prod(size_a[c] for c in contract)
    M = math.prod(size_a[c] for c in a_free)
    N = math.prod(size_b[c] for c in b_free)
    lhs = a.permute(*[ta.index(c) for c in batch + a_free + contract]).reshape(
        *[size_a[c] for c in batch], M, K)
    rhs = b.permute(*[tb.index(c) for c in batch + contract + b_free]).reshape(
        *[size_b[c] for c in batch], K, N)
    if sink.passthrough(lhs, rhs, name):
        return as_written()
    prod = sink.product(lhs, rhs, name)
    sizes = [max(size_a[c], size_b[c]) for c in batch]
    prod = prod.reshape(*sizes, *[size_a[c] for c in a_free], *[size_b[c] for c in b_free])
    have = batch + a_free + b_free
    return prod.permute(*[have.index(c) for c in out])


# --- the table ----------------------------------------------------------------------------------

_LINEAR = Intercepted("F.linear", _linear, linear=True)
_MATMUL = Intercepted("torch.matmul", _matmul)
_MM = Intercepted("torch.mm", _mm)
_BMM = Intercepted("torch.bmm", _mm)
_MV = Intercepted("torch.mv", _mv)
_ADDMM = Intercepted("torch.addmm", _add_product)
_BADDBMM = Intercepted("torch.baddbmm", _add_product)


def _refused(name: str) -> Intercepted:
    return Intercepted(name, None)


MATMULS: dict[Any, Intercepted] = {
    F.linear: _LINEAR,
    torch.matmul: _MATMUL,
    torch.Tensor.matmul: _MATMUL,
    torch.Tensor.__matmul__: _MATMUL,
    torch.Tensor.__rmatmul__: Intercepted("torch.matmul", _rmatmul),
    torch.mm: _MM,
    torch.Tensor.mm: _MM,
    torch.bmm: _BMM,
    torch.Tensor.bmm: _BMM,
    torch.mv: _MV,
    torch.Tensor.mv: _MV,
    torch.addmm: _ADDMM,
    torch.Tensor.addmm: _ADDMM,
    torch.baddbmm: _BADDBMM,
    torch.Tensor.baddbmm: _BADDBMM,
    torch.einsum: Intercepted("torch.einsum", _einsum, decomposed=True),
    F.scaled_dot_product_attention: Intercepted("F.scaled_dot_product_attention", _sdpa,
                                                decomposed=True),
    F.multi_head_attention_forward: _refused(
        "F.multi_head_attention_forward (nn.MultiheadAttention)"),
    F.bilinear: _refused("F.bilinear"),
    torch.tensordot: _refused("torch.tensordot"),
    torch.chain_matmul: _refused("torch.chain_matmul"),
    torch.linalg.multi_dot: _refused("torch.linalg.multi_dot"),
    torch.addbmm: _refused("torch.addbmm"),
    torch.Tensor.addbmm: _refused("torch.addbmm"),
    torch.addmv: _refused("torch.addmv"),
    torch.Tensor.addmv: _refused("torch.addmv"),
    torch.inner: _refused("torch.inner"),
    torch.Tensor.inner: _refused("torch.inner"),
    torch.dot: _refused("torch.dot"),
    torch.Tensor.dot: _refused("torch.dot"),
    torch.vdot: _refused("torch.vdot"),
    F.conv1d: _refused("F.conv1d"),
    F.conv2d: _refused("F.conv2d"),
    F.conv3d: _refused("F.conv3d"),
    F.conv_transpose1d: _refused("F.conv_transpose1d"),
    F.conv_transpose2d: _refused("F.conv_transpose2d"),
    F.conv_transpose3d: _refused("F.conv_transpose3d"),
}
"""Every function drift intercepts, routed or refused (module docs)."""


def lookup(func: Any) -> Intercepted | None:
    """The table's entry for ``func``, or None (also for the odd unhashable callable a mode
    may be handed)."""
    try:
        return MATMULS.get(func)
    except TypeError:
        return None
