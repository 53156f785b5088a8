"""Capture: record every matmul operand of a model's forward and backward into a drift dump.

::

    with capture(model, "dump.safetensors") as cap:
        model(batch).sum().backward()
    cap.names   # ("fc1/activation", "fc1/weight", "fc1/gradient", ...)

A ``torch.overrides.TorchFunctionMode`` sees every call of a function in the table of
intercepted matmuls, :data:`driftcli.arith.intercept.MATMULS`, the one the arithmetic mode
routes through a policy: ``F.linear`` (so every ``nn.Linear``), ``torch.matmul`` / ``@``,
``torch.mm``, ``torch.bmm``, ``torch.mv``, ``torch.addmm``, ``torch.baddbmm``, ``torch.einsum``
and ``F.scaled_dot_product_attention``. Each call's products are found by the route the mode
casts them with, so a dump's operands are the operands a policy casts: most calls multiply
two of their own arguments, which are copied; an einsum is recorded as its batched matmul and
an sdpa call as its two matmuls (``q·kᵀ`` and ``p·v``), computed beside the call. A hook on
the call's output copies the gradient that flows into each product. Forward pre/post hooks on
every submodule keep a stack of the modules running, so each operand knows its layer.
Nothing the model computes is changed: the mode calls each function exactly as the model did
and the gradient hooks return ``None``. The functions the table refuses are counted, unrecorded.

The dump is one safetensors file whose metadata key ``drift.dump`` holds JSON
``{"version": 1, "tensors": {name: {"role", "layer", "operand", "step"}}}``
(:mod:`driftcli.io.dumps`); see ``docs/capture.md`` for the names and the operand strings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from driftcli.arith.intercept import OUTSIDE, ROOT, Intercepted, UnsupportedMatmulError, lookup
from driftcli.choices import parse_choice
from driftcli.errors import DriftError
from driftcli.io.dumps import DUMP_KEY, DUMP_VERSION, ROLES, DumpEntry, Role

Tensor = torch.Tensor


# y = x·Wᵀ with W stored (out, in), as F.linear does: dgrad dX = dY·W, wgrad dW = dYᵀ·X.
_LINEAR_OPERANDS = ("forward.lhs wgrad.rhs", "forward.rhs dgrad.rhs", "dgrad.lhs wgrad.lhs")
# C = A·B: dgrad (the lhs's gradient) dA = dC·Bᵀ, wgrad (the rhs's gradient) dB = Aᵀ·dC.
_MATMUL_OPERANDS = ("forward.lhs wgrad.lhs", "forward.rhs dgrad.rhs", "dgrad.lhs wgrad.rhs")


@dataclasses.dataclass(frozen=True)
class _Product:
    """One product a call makes: its two operands and, where capture computed it beside the
    call, its result (whose gradient the call's backward does not reach)."""

    lhs: Any
    rhs: Any
    out: Tensor | None


class _Products:
    """Capture's :class:`~driftcli.arith.intercept.ProductSink`: it notes the products a route
    makes and casts nothing.

    For a route that multiplies two of the call's arguments, the first ``passthrough`` names
    them and the call runs as written. A decomposed route (``decomposed``) runs beside the
    call, each product plain, so the products are those the mode would cast."""

    def __init__(self, decomposed: bool) -> None:
        self.decomposed = decomposed
        self.found: list[_Product] = []

    def passthrough(self, a: Any, b: Any, name: str,
                    products: tuple[str, ...] | None = None) -> bool:
        """Whether the call runs as written: yes, and ``a`` and ``b`` are its operands, unless
        the route decomposes it."""
        if self.decomposed:
            return False
        self.found.append(_Product(a, b, None))
        return True

    def note_plain(self, name: str, reason: str) -> None:
        """Nothing to note: a call run as written for the route's own reason makes no
        product."""

    def product(self, a: Tensor, b: Tensor, name: str) -> Tensor:
        """``a @ b`` as torch computes it, noted."""
        out = torch.matmul(a, b)
        self.found.append(_Product(a, b, out))
        return out


def _not_run(*args: Any, **kwargs: Any) -> None:
    """Stands in for the function a route calls as written: capture has called it already."""
    return None


@contextlib.contextmanager
def _beside(grad: bool) -> Iterator[None]:
    """Where a decomposed call runs beside the real one: out of sight of every mode (an outer
    arithmetic mode would count its products as the model's), recording autograd only where
    its products' gradients are wanted."""
    with torch._C.DisableTorchFunction(), torch.set_grad_enabled(grad):
        yield


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now.

    Matmuls run then (a custom Function's Python backward, checkpoint recomputation) are not
    forward operands, so they are left out rather than recorded as new forward calls.
    """
    return torch._C._current_graph_task_id() != -1


def _snapshot(t: torch.Tensor, device: torch.device | str | None = "cpu") -> torch.Tensor:
    """A detached, contiguous copy in the tensor's own dtype, immune to later in-place ops: on
    the CPU, or on the tensor's own device for ``device=None`` (a capture kept in memory)."""
    return t.detach().resolve_conj().resolve_neg().to(
        t.device if device is None else device, memory_format=torch.contiguous_format,
        copy=True)


@dataclasses.dataclass
class _Frame:
    """One running call of a module: its layer name, call index and matmuls so far."""

    layer: str
    call: int
    matmuls: int = 0


@dataclasses.dataclass
class _Record:
    """One recorded operand (or output gradient) before it has its final name."""

    layer: str
    call: int
    index: int
    label: str
    role: Role
    operand: str
    tensors: list[torch.Tensor]
    transposed: bool = False


class _CaptureMode(TorchFunctionMode):
    """Passes every call through unchanged and tells the capture about the matmuls."""

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self._capture = capture

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        entry = lookup(func)
        if entry is not None:
            self._capture._call(entry, args, kwargs, out)
        return out


class Capture:
    """A context manager recording matmul operands into a drift dump; made by ``capture()``.

    After a clean exit, ``names`` lists the tensors written (in the order they were recorded),
    ``entries`` maps each name to its ``DumpEntry``, and ``unrecorded`` counts calls to
    matmul-like functions whose operands are not in the dump.
    """

    def __init__(self, model: nn.Module, path: Path | None, roles: frozenset[Role],
                 step: int | None) -> None:
        self.model = model
        self.path = path
        self.roles = roles
        self.step = step
        self.names: tuple[str, ...] = ()
        self.entries: Mapping[str, DumpEntry] = MappingProxyType({})
        self.unrecorded: Mapping[str, int] = MappingProxyType({})
        self.tensors: Mapping[str, torch.Tensor] = MappingProxyType({})
        self.transposed: frozenset[str] = frozenset()
        self._device: str | None = "cpu" if path is not None else None
        self._records: list[_Record] = []
        self._stack: list[_Frame] = []
        self._outside = _Frame(OUTSIDE, 0)
        self._calls: Counter[str] = Counter()
        self._unrecorded: Counter[str] = Counter()
        self._params: dict[int, torch.Tensor] = {}
        self._weights_seen: set[tuple[Any, ...]] = set()
        self._handles: list[RemovableHandle] = []
        self._mode: _CaptureMode | None = None
        self._used = False

    # -- context manager -------------------------------------------------------------------

    def __enter__(self) -> Capture:
        if self._used:
            raise DriftError("a capture can be entered only once; call capture() again")
        if self.path is not None and self.path.is_dir():
            raise DriftError(f"capture path {self.path} is a directory; give a file name "
                             "such as dump.safetensors")
        self._used = True
        self._params = {id(p): p for p in self.model.parameters()}
        for qualified, module in self.model.named_modules():
            layer = qualified or ROOT
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(layer)))
            # always_call: the stack is popped even when a forward raises
            self._handles.append(module.register_forward_hook(self._post_hook(), always_call=True))
        self._mode = _CaptureMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(exc_type, exc, tb)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
        if exc_type is not None:
            self._records.clear()  # a failed step leaves no dump behind
            return
        self._write()

    # -- hooks -------------------------------------------------------------------------------

    def _pre_hook(self, layer: str) -> Callable[[nn.Module, Any], None]:
        def push(module: nn.Module, args: Any) -> None:
            if _in_backward():
                return
            self._stack.append(_Frame(layer, self._calls[layer]))
            self._calls[layer] += 1
        return push

    def _post_hook(self) -> Callable[[nn.Module, Any, Any], None]:
        def pop(module: nn.Module, args: Any, output: Any) -> None:
            if not _in_backward() and self._stack:
                self._stack.pop()
        return pop

    def _role(self, t: Any) -> Role:
        if isinstance(t, torch.Tensor) and (
                id(t) in self._params or (t._base is not None and id(t._base) in self._params)):
            return Role.WEIGHT
        return Role.ACTIVATION

    def _call(self, entry: Intercepted, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              out: Any) -> None:
        """Record the operands of the products of one call the model just ran (``out`` is
        its result), and hook the gradients that flow into them."""
        if entry.route is None:
            self._unrecorded[entry.name] += 1
            return
        if _in_backward():
            return
        grads = Role.GRADIENT in self.roles and isinstance(out, Tensor) and out.requires_grad
        found = _Products(entry.decomposed)
        try:
            with _beside(grads) if entry.decomposed else contextlib.nullcontext():
                side = entry.route(found, entry.name, _not_run, *args, **kwargs)
        except UnsupportedMatmulError:  # a call the mode refuses (dropout, out=): not its casts
            self._unrecorded[entry.name] += 1
            return
        operands = _LINEAR_OPERANDS if entry.linear else _MATMUL_OPERANDS
        frame = self._stack[-1] if self._stack else self._outside
        pending: list[tuple[Tensor, _Record]] = []
        for product in found.found:
            gradient = self._product(frame, product.lhs, product.rhs, operands, entry.linear)
            if not grads or (product.out is not None and not product.out.requires_grad):
                continue
            self._records.append(gradient)  # each gradient next to its product
            if product.out is None:
                self._hook(out, gradient)
            else:
                pending.append((product.out, gradient))
        if pending:
            self._hook_beside(out, side, pending)

    def _product(self, frame: _Frame, lhs: Any, rhs: Any,
                 operands: tuple[str, str, str], linear: bool = False) -> _Record:
        """Record the two operands of one product; its gradient's record, still empty (kept
        only where a gradient is hooked into it)."""
        index = frame.matmuls
        frame.matmuls += 1
        pair = (lhs, rhs)
        roles = tuple(self._role(t) for t in pair)
        # name by role where that tells the two apart, else by side (q @ k.T: lhs, rhs)
        labels = (roles[0].value, roles[1].value) if roles[0] != roles[1] else ("lhs", "rhs")
        for t, role, label, operand in zip(pair, roles, labels, operands, strict=False):
            if role not in self.roles or not isinstance(t, torch.Tensor):
                continue
            if role is Role.WEIGHT:
                base = t if t._base is None else t._base
                key = (frame.layer, id(base), t.shape, t.stride(), t.storage_offset())
                if key in self._weights_seen:
                    continue
                self._weights_seen.add(key)
            self._records.append(_Record(frame.layer, frame.call, index, label, role, operand,
                                         [_snapshot(t, self._device)],
                                         transposed=operand == operands[1] and linear))
        return _Record(frame.layer, frame.call, index, "gradient", Role.GRADIENT, operands[2], [])

    def _hook(self, out: Tensor, record: _Record) -> None:
        """Copy the gradient reaching ``out``, the product itself, into ``record``."""

        def keep(grad: Tensor) -> None:
            record.tensors.append(_snapshot(grad, self._device))

        self._handles.append(out.register_hook(keep))

    def _hook_beside(self, out: Tensor, side: Tensor,
                     pending: list[tuple[Tensor, _Record]]) -> None:
        """Copy the gradients of products computed beside the call: when the gradient of its
        output ``out`` arrives, carry it back through ``side`` (the same function of the same
        arguments, decomposed) to each product."""
        products = [p for p, _ in pending]

        def keep(grad: Tensor) -> None:
            with torch._C.DisableTorchFunction():
                # retain_graph: another backward over the model's graph comes here again
                got = torch.autograd.grad(side, products, grad, retain_graph=True,
                                          allow_unused=True)
            for (_, record), g in zip(pending, got, strict=True):
                if g is not None:
                    record.tensors.append(_snapshot(g, self._device))

        self._handles.append(out.register_hook(keep))

    # -- writing -----------------------------------------------------------------------------

    def _named(self) -> list[tuple[str, _Record, torch.Tensor]]:
        """Final names: call index and matmul index appear only where a layer needs them."""
        calls = Counter({**self._calls, OUTSIDE: 1})
        most_matmuls: Counter[str] = Counter()
        for r in self._records:
            most_matmuls[r.layer] = max(most_matmuls[r.layer], r.index + 1)

        def name(r: _Record, label: str, with_call: bool) -> str:
            head = f"{r.layer}#{r.call}" if with_call else r.layer
            return f"{head}/{r.index}/{label}" if most_matmuls[r.layer] > 1 else f"{head}/{label}"

        named: list[tuple[str, _Record, torch.Tensor]] = []
        for r in self._records:
            labels = [r.label] if len(r.tensors) == 1 else [
                f"{r.label}.{i}" for i in range(len(r.tensors))]  # one per backward pass
            # a weight is recorded once per layer, so it needs no call index
            with_call = calls[r.layer] > 1 and r.role is not Role.WEIGHT
            named.extend((name(r, label, with_call), r, t)
                         for label, t in zip(labels, r.tensors, strict=True))
        # Different weights at the same place in different calls (data-dependent control flow)
        # would share a name; those get their call index too. Full names are always unique.
        counts = Counter(n for n, _, _ in named)
        return [(name(r, n.rsplit("/", 1)[1], True) if counts[n] > 1 else n, r, t)
                for n, r, t in named]

    def _write(self) -> None:
        named = self._named()
        self._records.clear()
        entries = {n: DumpEntry(r.role, r.layer, r.operand, self.step) for n, r, _ in named}
        meta = {"version": DUMP_VERSION, "tensors": {n: e.to_json() for n, e in entries.items()}}
        tensors = {n: t for n, _, t in named}
        self.names = tuple(entries)
        self.entries = MappingProxyType(entries)
        self.unrecorded = MappingProxyType(dict(self._unrecorded))
        if self.path is None:  # kept in memory, on the operands' own devices
            self.tensors = MappingProxyType(tensors)
            self.transposed = frozenset(n for n, r, _ in named if r.transposed)
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp), metadata={DUMP_KEY: json.dumps(meta), "format": "pt"})
            os.replace(tmp, self.path)
        except OSError as exc:
            raise DriftError(f"cannot write the capture to {self.path}: {exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
        if self._unrecorded:
            calls = ", ".join(f"{f} ×{n}" for f, n in sorted(self._unrecorded.items()))
            warnings.warn(f"capture did not record the operands of {calls}: drift cannot see "
                          "their products, or a policy refuses the call (see docs/capture.md)",
                          stacklevel=3)


def capture(model: nn.Module, path: str | os.PathLike[str] | None, *,
            roles: Iterable[str | Role] | str = ROLES, step: int | None = None) -> Capture:
    """Record every matmul operand of ``model``'s forward and backward into a drift dump.

    Use as ``with capture(model, path) as cap: model(x).sum().backward()``. On a clean exit
    the dump is written to ``path`` atomically (a temporary name, then a rename); if the body
    raises, nothing is written. With ``path=None`` nothing is written: the tensors stay in
    memory, on their own devices, in ``tensors`` (name -> tensor), and ``transposed`` names
    the weights a product multiplies transposed (``F.linear``'s). ``roles`` selects which of
    ``activation``, ``gradient`` and ``weight`` are recorded; ``step`` is stored with every
    tensor. The model's outputs and gradients are bit for bit what they are without the
    capture.
    """
    if not isinstance(model, nn.Module):
        raise DriftError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise DriftError(f"capture step must be a non-negative int or None, got {step!r}")
    chosen = [roles] if isinstance(roles, str) else list(roles)
    if not chosen:
        raise DriftError("capture roles is empty; choose from activation, gradient, weight")
    parsed = frozenset(parse_choice(Role, r, "capture role") for r in chosen)
    return Capture(model, None if path is None else Path(path), parsed, step)
