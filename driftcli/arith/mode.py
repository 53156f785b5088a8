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
then ``p·v``; dropout must be 0). The functions, and how each call becomes products, are the
table :data:`driftcli.arith.intercept.MATMULS`, which capture reads too: the operands it
records are those the policy casts. The mode is the table's casting
:class:`~driftcli.arith.intercept.ProductSink`.

Inside a module one of the policy's ``overrides`` matches (and below it) the matmuls run under
that override's cast instead (:class:`~driftcli.arith.policy.ModuleOverride`).

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
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from driftcli.arith.autograd import policy_matmul
from driftcli.arith.intercept import (
    OUTSIDE,
    ROOT,
    UnsupportedMatmulError,
    lookup,
    matmul_kind,
)
from driftcli.arith.policy import ArithmeticPolicy, get_policy
from driftcli.errors import DriftError

Tensor = torch.Tensor



@dataclasses.dataclass
class _Frame:
    name: str
    kept: bool
    policy: ArithmeticPolicy
    """The policy the module's matmuls run under: the mode's, or an override's."""


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
        self._params: set[int] = set()
        self._roots: set[int] = set()
        self._handles: list[RemovableHandle] = []
        self._overridden = {id(o): policy.overridden(o) for o in policy.overrides}

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
        self._params.update(id(p) for p in root.parameters())

    def _is_parameter(self, t: Any) -> bool:
        """Whether ``t`` is a parameter of the model, or a view of one (``weight.T``)."""
        return isinstance(t, Tensor) and (
            id(t) in self._params or (t._base is not None and id(t._base) in self._params))

    def _push(self, module: nn.Module, args: Any) -> None:
        if not self._stack and self.model is None and id(module) not in self._roots:
            self._learn_names(module)  # the outermost module called names the others
        name = self._names.get(id(module), type(module).__name__)
        parent = self._stack[-1] if self._stack else None
        override = self.policy.override(name)
        # an override applies below the module it matches, until one below matches another
        policy = (self._overridden[id(override)] if override is not None
                  else self.policy if parent is None else parent.policy)
        kept = (parent is not None and parent.kept) or self.policy.keeps(name)
        self._stack.append(_Frame(name, kept, policy))

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    @property
    def _kept(self) -> bool:
        return bool(self._stack) and self._stack[-1].kept

    @property
    def current_policy(self) -> ArithmeticPolicy:
        """The policy of the innermost running module: the mode's, or an override's."""
        return self._stack[-1].policy if self._stack else self.policy

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
        entry = lookup(func)
        if entry is None:
            return func(*args, **kwargs)
        if entry.route is not None:
            return entry.route(self, entry.name, func, *args, **kwargs)
        if not self._kept and not self.current_policy.exact:
            raise UnsupportedMatmulError(
                f"policy {self.policy.name!r}: {entry.name} runs in module "
                f"{self.current_module!r} and multiplies matrices where drift cannot see "
                "inside; keep that module in high precision (keep_high_precision) or rewrite "
                "it with F.linear, matmul, einsum or F.scaled_dot_product_attention")
        return func(*args, **kwargs)

    def _plain_reason(self, a: Any, b: Any, name: str) -> str | None:
        """Why this product runs as the plain torch op, or None when the policy applies."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return "not tensors"
        if not (a.dtype.is_floating_point and b.dtype.is_floating_point) or a.dtype != b.dtype:
            return "not float operands of one dtype"
        if self._kept:
            return "kept in high precision"
        if self.policy.keep_matmuls:
            kind = matmul_kind(name, a, b, self._is_parameter)
            if self.policy.keeps_kind(kind):  # overrides share the policy's kept kinds
                return f"{kind.value} matmul kept in high precision"
        if a.dim() >= 1 and a.shape[-1] == 1:
            return "outer product (K = 1)"
        return None

    def passthrough(self, a: Any, b: Any, name: str,
                    products: tuple[str, ...] | None = None) -> bool:
        """Whether a call multiplying ``a`` by ``b`` runs as the model wrote it: for a plain
        reason (counted in ``plain``), or because the policy simulates no role (counted in
        ``routed``, once per product: under ``exact`` a linear or matmul is the very torch
        op)."""
        reason = self._plain_reason(a, b, name)
        if reason is not None:
            self.note_plain(name, reason)
            return True
        if self.current_policy.exact:
            counted = products or (name,)
            self.routed.update(counted)
            self.matmuls += len(counted)
            return True
        return False

    def note_plain(self, name: str, reason: str) -> None:
        """Count a call of ``name`` run as the plain torch op, with the reason."""
        self.plain[f"{name} ({reason})"] += 1

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
        out = policy_matmul(a, b, self.current_policy, index=self.matmuls - 1)
        for dim in squeeze:
            out = out.squeeze(dim)
        return out


def arithmetic(policy: ArithmeticPolicy | str, *,
               model: nn.Module | None = None) -> ArithmeticMode:
    """A context manager running every matmul under ``policy`` (a policy, a preset name, a
    cast spec or a .toml path); see the module docs. ``model`` names the modules that
    ``keep_high_precision`` matches (default: the outermost module called in the block)."""
    return ArithmeticMode(get_policy(policy), model)


__all__ = ["ArithmeticMode", "UnsupportedMatmulError", "arithmetic"]
