"""``with arithmetic(policy):`` runs any PyTorch model's matmuls under an arithmetic policy.

A ``torch.overrides.TorchFunctionMode`` routes every matmul the model calls to
:func:`~driftcli.arith.autograd.policy_matmul`, which casts both operands of the forward and
of both backward matmuls::

    with driftcli.arithmetic("mxfp8_e4m3") as arith:
        loss = loss_fn(model(batch))
        loss.backward()
    arith.routed     # Counter: calls per function routed through the policy

What is routed: ``F.linear`` (every ``nn.Linear``), ``torch.matmul`` / ``Tensor.matmul`` /
``@``, ``torch.mm``, ``torch.bmm``, ``torch.mv``, ``torch.addmm`` / ``baddbmm`` (``beta·input +
alpha·(a·b)``), ``torch.einsum`` with two operands (mapped to one batched matmul: batch,
free and contracted indices), and ``F.scaled_dot_product_attention`` (decomposed into its two
matmuls: ``q·kᵀ``, the scale, the causal and given masks, the softmax in float32 or wider,
then ``p·v``; dropout must be 0).

What runs as the plain torch op, counted in ``plain``: matmuls inside a module kept in high
precision (the policy's ``keep_high_precision`` regexes on qualified module names; the model's
names come from ``model=`` or, without it, from the outermost module called), products with
a contraction of length 1 (outer products: nothing is accumulated and there is no block to
scale along; rotary embeddings compute their angles this way), non-float operands, and einsums
without a contracted index. Functions that multiply matrices where the mode cannot see inside
(``F.multi_head_attention_forward`` of ``nn.MultiheadAttention``, ``tensordot``, ``bilinear``,
convolutions, ...) raise a :class:`DriftError` unless they run inside a kept module or the
policy simulates nothing: a matmul that silently escaped the policy would make the
measurement a lie.
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from driftcli.arith.autograd import policy_matmul
from driftcli.arith.policy import ArithmeticPolicy, get_policy
from driftcli.errors import DriftError

Tensor = torch.Tensor

ROOT = "<root>"
"""How counts name matmuls the outermost module's own ``forward`` runs."""
OUTSIDE = "<outside>"
"""How counts name matmuls run outside any module."""


class UnsupportedMatmulError(DriftError):
    """A matmul the policy cannot be applied to."""


@dataclasses.dataclass
class _Frame:
    name: str
    kept: bool


def _lookup(table: dict[Any, Any], func: Any) -> Any:
    try:
        return table.get(func)
    except TypeError:  # an unhashable callable
        return None


class ArithmeticMode(TorchFunctionMode):
    """The mode :func:`arithmetic` returns; use it as a context manager.

    ``routed`` counts the calls per function that ran under the policy, ``plain`` those that
    ran as the plain torch op (with the reason), ``matmuls`` the matmuls the policy applied to
    (an sdpa call is two; under a policy that simulates nothing they are the plain op).
    """

    _active: ClassVar[list[str]] = []
    """Names of the policies whose block is running (at most one)."""

    def __init__(self, policy: ArithmeticPolicy, model: nn.Module | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.model = model
        self.routed: Counter[str] = Counter()
        self.plain: Counter[str] = Counter()
        self.matmuls = 0
        self._stack: list[_Frame] = []
        self._names: dict[int, str] = {}
        self._roots: set[int] = set()
        self._handles: list[RemovableHandle] = []

    # -- context --------------------------------------------------------------------------------

    def __enter__(self) -> ArithmeticMode:
        if ArithmeticMode._active:
            # the outer mode would route the inner one's own matmuls: casts on casts
            raise DriftError(f"arithmetic({self.policy.name!r}) entered inside "
                             f"arithmetic({ArithmeticMode._active[-1]!r}); leave the outer "
                             "block first (one policy at a time)")
        ArithmeticMode._active.append(self.policy.name)
        if self.model is not None:
            self._learn_names(self.model)
        self._handles = [register_module_forward_pre_hook(self._push),
                         register_module_forward_hook(self._pop, always_call=True)]
        super().__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            ArithmeticMode._active.pop()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._stack.clear()

    # -- which module is running ----------------------------------------------------------------

    def _learn_names(self, root: nn.Module) -> None:
        self._roots.add(id(root))
        for name, module in root.named_modules():
            self._names.setdefault(id(module), name)

    def _push(self, module: nn.Module, args: Any) -> None:
        if not self._stack and self.model is None and id(module) not in self._roots:
            self._learn_names(module)  # the outermost module called names the others
        name = self._names.get(id(module), type(module).__name__)
        parent_kept = bool(self._stack) and self._stack[-1].kept
        self._stack.append(_Frame(name, parent_kept or self.policy.keeps(name)))

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    @property
    def _kept(self) -> bool:
        return bool(self._stack) and self._stack[-1].kept

    @property
    def current_module(self) -> str:
        """The qualified name of the innermost running module (``<outside>`` if none)."""
        if not self._stack:
            return OUTSIDE
        return self._stack[-1].name or ROOT

    # -- dispatch -------------------------------------------------------------------------------

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        route = _lookup(_ROUTES, func)
        if route is not None:
            name, handler = route
            return handler(self, name, func, *args, **kwargs)
        unsupported = _lookup(_UNSUPPORTED, func)
        if unsupported is not None and not self._kept and not self.policy.exact:
            raise UnsupportedMatmulError(
                f"policy {self.policy.name!r}: {unsupported} runs in module "
                f"{self.current_module!r} and multiplies matrices where drift cannot see "
                "inside; keep that module in high precision (keep_high_precision) or rewrite "
                "it with F.linear, matmul, einsum or F.scaled_dot_product_attention")
        return func(*args, **kwargs)

    def _plain_reason(self, a: Any, b: Any) -> str | None:
        """Why this product runs as the plain torch op, or None when the policy applies."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return "not tensors"
        if not (a.dtype.is_floating_point and b.dtype.is_floating_point) or a.dtype != b.dtype:
            return "not float operands of one dtype"
        if self._kept:
            return "kept in high precision"
        if a.dim() >= 1 and a.shape[-1] == 1:
            return "outer product (K = 1)"
        return None

    def passthrough(self, a: Any, b: Any, name: str) -> bool:
        """Whether a call multiplying ``a`` by ``b`` runs as the model wrote it: for a plain
        reason (counted in ``plain``), or because the policy simulates no role (counted in
        ``routed``: under ``exact`` a linear or matmul is the very torch op)."""
        reason = self._plain_reason(a, b)
        if reason is not None:
            self.plain[f"{name} ({reason})"] += 1
            return True
        if self.policy.exact:
            self.routed[name] += 1
            self.matmuls += 1
            return True
        return False

    def product(self, a: Tensor, b: Tensor, name: str) -> Tensor:
        """``a @ b`` (torch.matmul's shape rules, 1-D operands included) under the policy."""
        if self.passthrough(a, b, name):
            return torch.matmul(a, b)
        if a.dim() == 0 or b.dim() == 0:
            raise UnsupportedMatmulError(f"{name}: a 0-d operand cannot be multiplied as a "
                                         "matrix; use * for a scalar product")
        squeeze = []
        if a.dim() == 1:
            a = a.unsqueeze(0)
            squeeze.append(-2)
        if b.dim() == 1:
            b = b.unsqueeze(-1)
            squeeze.append(-1)
        self.routed[name] += 1
        self.matmuls += 1
        out = policy_matmul(a, b, self.policy, index=self.matmuls - 1)
        for dim in squeeze:
            out = out.squeeze(dim)
        return out


# --- routes -------------------------------------------------------------------------------------

Handler = Callable[..., Any]


def _check_out(name: str, kwargs: dict[str, Any]) -> None:
    if kwargs.get("out") is not None:
        raise UnsupportedMatmulError(f"{name}(..., out=...) is not supported under a policy; "
                                     "assign the result instead")


def _linear(mode: ArithmeticMode, name: str, func: Handler, input: Tensor, weight: Tensor,
            bias: Tensor | None = None) -> Tensor:
    if mode.passthrough(input, weight, name):
        return func(input, weight, bias)
    out = mode.product(input, weight.transpose(-1, -2) if weight.dim() > 1 else weight, name)
    return out if bias is None else out + bias


def _matmul(mode: ArithmeticMode, name: str, func: Handler, input: Tensor, other: Tensor,
            **kwargs: Any) -> Tensor:
    _check_out(name, kwargs)
    if mode.passthrough(input, other, name):
        return func(input, other, **kwargs)
    return mode.product(input, other, name)


def _rmatmul(mode: ArithmeticMode, name: str, func: Handler, input: Tensor,
             other: Tensor) -> Tensor:
    return _matmul(mode, name, lambda a, b: func(b, a), other, input)


def _mm(mode: ArithmeticMode, name: str, func: Handler, input: Tensor, mat2: Tensor,
        **kwargs: Any) -> Tensor:
    _check_out(name, kwargs)
    want = 3 if name == "torch.bmm" else 2
    if any(isinstance(t, Tensor) and t.dim() != want for t in (input, mat2)):
        return func(input, mat2, **kwargs)  # torch reports its own shape error
    return _matmul(mode, name, func, input, mat2)


def _add_product(mode: ArithmeticMode, name: str, func: Handler, input: Tensor, mat1: Tensor,
                 mat2: Tensor, *, beta: float = 1, alpha: float = 1, **kwargs: Any) -> Tensor:
    _check_out(name, kwargs)
    if mode.passthrough(mat1, mat2, name):
        return func(input, mat1, mat2, beta=beta, alpha=alpha)
    prod = mode.product(mat1, mat2, name)
    prod = prod if alpha == 1 else prod * alpha
    return prod + (input if beta == 1 else input * beta) if beta != 0 else prod


def _mv(mode: ArithmeticMode, name: str, func: Handler, input: Tensor, vec: Tensor,
        **kwargs: Any) -> Tensor:
    return _matmul(mode, name, func, input, vec, **kwargs)


def _sdpa(mode: ArithmeticMode, name: str, func: Handler, query: Tensor, key: Tensor,
          value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> Tensor:
    reason = "kept in high precision" if mode._kept else mode._plain_reason(query, key)
    if reason is not None or mode.policy.exact:
        if reason is not None:
            mode.plain[f"{name} ({reason})"] += 1
        else:  # under exact the very torch op runs: its result is the model's own, bit for bit
            mode.routed.update((f"{name}.qk", f"{name}.pv"))
            mode.matmuls += 2
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
    scores = mode.product(query, key.transpose(-2, -1), f"{name}.qk") * factor
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
    return mode.product(probs.to(value.dtype), value, f"{name}.pv")


_LETTERS = string.ascii_letters


def _einsum(mode: ArithmeticMode, name: str, func: Handler, equation: str,
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
    return _einsum_product(mode, name, equation, lambda: func(equation, a, b), a, b, terms,
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


def _einsum_product(mode: ArithmeticMode, name: str, equation: str,
                    as_written: Callable[[], Tensor], a: Tensor, b: Tensor, terms: list[str],
                    out: str) -> Tensor:
    """The einsum as one batched matmul under the policy; ``as_written`` (the einsum itself)
    wherever the policy does not apply, so that ``exact`` is the model's own op."""
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
        mode.plain[f"{name} (no contracted index)"] += 1
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
    if mode.passthrough(lhs, rhs, name):
        return as_written()
    prod = mode.product(lhs, rhs, name)
    sizes = [max(size_a[c], size_b[c]) for c in batch]
    prod = prod.reshape(*sizes, *[size_a[c] for c in a_free], *[size_b[c] for c in b_free])
    have = batch + a_free + b_free
    return prod.permute(*[have.index(c) for c in out])


_ROUTES: dict[Any, tuple[str, Handler]] = {
    F.linear: ("F.linear", _linear),
    torch.matmul: ("torch.matmul", _matmul),
    torch.Tensor.matmul: ("torch.matmul", _matmul),
    torch.Tensor.__matmul__: ("torch.matmul", _matmul),
    torch.Tensor.__rmatmul__: ("torch.matmul", _rmatmul),
    torch.mm: ("torch.mm", _mm),
    torch.Tensor.mm: ("torch.mm", _mm),
    torch.bmm: ("torch.bmm", _mm),
    torch.Tensor.bmm: ("torch.bmm", _mm),
    torch.mv: ("torch.mv", _mv),
    torch.Tensor.mv: ("torch.mv", _mv),
    torch.addmm: ("torch.addmm", _add_product),
    torch.Tensor.addmm: ("torch.addmm", _add_product),
    torch.baddbmm: ("torch.baddbmm", _add_product),
    torch.Tensor.baddbmm: ("torch.baddbmm", _add_product),
    torch.einsum: ("torch.einsum", _einsum),
    F.scaled_dot_product_attention: ("F.scaled_dot_product_attention", _sdpa),
}
"""Every function routed through the policy, with the name counts use."""

_UNSUPPORTED: dict[Any, str] = {
    F.multi_head_attention_forward: "F.multi_head_attention_forward (nn.MultiheadAttention)",
    F.bilinear: "F.bilinear",
    torch.tensordot: "torch.tensordot",
    torch.chain_matmul: "torch.chain_matmul",
    torch.linalg.multi_dot: "torch.linalg.multi_dot",
    torch.addbmm: "torch.addbmm",
    torch.Tensor.addbmm: "torch.addbmm",
    torch.addmv: "torch.addmv",
    torch.Tensor.addmv: "torch.addmv",
    torch.inner: "torch.inner",
    torch.Tensor.inner: "torch.inner",
    torch.dot: "torch.dot",
    torch.Tensor.dot: "torch.dot",
    torch.vdot: "torch.vdot",
    F.conv1d: "F.conv1d",
    F.conv2d: "F.conv2d",
    F.conv3d: "F.conv3d",
    F.conv_transpose1d: "F.conv_transpose1d",
    F.conv_transpose2d: "F.conv_transpose2d",
    F.conv_transpose3d: "F.conv_transpose3d",
}
"""Functions that multiply matrices out of the mode's sight: an error under a policy."""


def arithmetic(policy: ArithmeticPolicy | str, *,
               model: nn.Module | None = None) -> ArithmeticMode:
    """A context manager running every matmul under ``policy`` (a policy, a preset name, a
    cast spec or a .toml path); see the module docs. ``model`` names the modules that
    ``keep_high_precision`` matches (default: the outermost module called in the block)."""
    return ArithmeticMode(get_policy(policy), model)


__all__ = ["ArithmeticMode", "UnsupportedMatmulError", "arithmetic"]
