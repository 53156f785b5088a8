"""Capture: record every matmul operand of a model's forward and backward into a drift dump.

::

    with capture(model, "dump.safetensors") as cap:
        model(batch).sum().backward()
    cap.names   # ("fc1/activation", "fc1/weight", "fc1/gradient", ...)

A ``torch.overrides.TorchFunctionMode`` sees every ``F.linear`` (so every ``nn.Linear``),
``torch.matmul`` / ``@``, ``torch.mm``, ``torch.bmm``, ``torch.addmm``, ``torch.baddbmm`` and
``torch.addbmm``, and copies its two operands; a hook on the product's output copies the
gradient that flows into it. Forward pre/post hooks on every submodule keep a stack of the
modules running, so each operand knows its layer. Nothing the model computes is changed: the
mode calls each function exactly as the model did and the gradient hooks return ``None``.

The dump is one safetensors file whose metadata key ``drift.dump`` holds JSON
``{"version": 1, "tensors": {name: {"role", "layer", "operand", "step"}}}``; see
``docs/capture.md`` for the names and the operand strings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from driftcli.errors import DriftError
from driftcli.modes import parse_choice

DUMP_KEY = "drift.dump"
"""The safetensors metadata key holding a dump's JSON description."""
DUMP_VERSION = 1
"""The version of that JSON; a reader refuses versions it does not know."""
ROOT = "<root>"
"""The layer name of matmuls the model's own ``forward`` runs (its qualified name is ``""``)."""
OUTSIDE = "<outside>"
"""The layer name of matmuls run inside the ``with`` but outside any module of the model."""


class Role(StrEnum):
    """What a captured tensor is to the training step."""

    ACTIVATION = "activation"
    """An operand that is not a parameter of the model (an input, a hidden state, q or k)."""
    WEIGHT = "weight"
    """A parameter of the model (or a view of one, such as ``W.T``), recorded once per layer."""
    GRADIENT = "gradient"
    """The gradient flowing into a matmul's output during backward (dY)."""


ALL_ROLES: tuple[Role, ...] = tuple(Role)
"""Every role: what ``capture`` records by default."""


@dataclasses.dataclass(frozen=True)
class DumpEntry:
    """The metadata of one tensor in a drift dump."""

    role: Role
    """Activation, weight or gradient."""
    layer: str
    """Qualified module name (``blocks.0.attn``), or ``<root>`` / ``<outside>``."""
    operand: str
    """Space-separated ``pass.side`` tokens naming which matmul operands the tensor feeds:
    pass is ``forward``, ``dgrad`` or ``wgrad``, side ``lhs`` or ``rhs`` (design §6)."""
    step: int | None
    """The training step given to ``capture``, or ``None``."""

    def to_json(self) -> dict[str, Any]:
        """This entry as the JSON object stored in the dump's metadata."""
        return {"role": self.role.value, "layer": self.layer, "operand": self.operand,
                "step": self.step}


@dataclasses.dataclass(frozen=True)
class _MatmulKind:
    """Where a function's two matmul operands sit and which backward matmuls they feed."""

    lhs: tuple[int, str]
    """Position and keyword name of the left operand."""
    rhs: tuple[int, str]
    """Position and keyword name of the right operand."""
    operands: tuple[str, str, str]
    """Operand strings of the lhs, the rhs and the output gradient."""


# y = x·Wᵀ with W stored (out, in), as F.linear does: dgrad dX = dY·W, wgrad dW = dYᵀ·X.
_LINEAR_OPERANDS = ("forward.lhs wgrad.rhs", "forward.rhs dgrad.rhs", "dgrad.lhs wgrad.lhs")
# C = A·B: dgrad (the lhs's gradient) dA = dC·Bᵀ, wgrad (the rhs's gradient) dB = Aᵀ·dC.
_MATMUL_OPERANDS = ("forward.lhs wgrad.lhs", "forward.rhs dgrad.rhs", "dgrad.lhs wgrad.rhs")

_LINEAR = _MatmulKind((0, "input"), (1, "weight"), _LINEAR_OPERANDS)
_PLAIN = _MatmulKind((0, "input"), (1, "other"), _MATMUL_OPERANDS)
_MM = _MatmulKind((0, "input"), (1, "mat2"), _MATMUL_OPERANDS)
_ADDMM = _MatmulKind((1, "mat1"), (2, "mat2"), _MATMUL_OPERANDS)
_BATCHED_ADD = _MatmulKind((1, "batch1"), (2, "batch2"), _MATMUL_OPERANDS)

_MATMULS: dict[Callable[..., Any], _MatmulKind] = {
    F.linear: _LINEAR,
    torch.matmul: _PLAIN,
    torch.Tensor.matmul: _PLAIN,
    torch.Tensor.__matmul__: _PLAIN,  # `a @ b` reaches the mode as Tensor.matmul today
    torch.mm: _MM,
    torch.Tensor.mm: _MM,
    torch.bmm: _MM,
    torch.Tensor.bmm: _MM,
    torch.addmm: _ADDMM,
    torch.Tensor.addmm: _ADDMM,
    torch.baddbmm: _BATCHED_ADD,
    torch.Tensor.baddbmm: _BATCHED_ADD,
    torch.addbmm: _BATCHED_ADD,
    torch.Tensor.addbmm: _BATCHED_ADD,
}

# Functions that multiply matrices but whose operands capture does not record. Python-level
# ones (multi_head_attention_forward, einsum, tensordot) run their inner matmuls with the mode
# switched off, so those are invisible too; each call is counted and reported at exit.
_UNRECORDED: dict[Callable[..., Any], str] = {
    F.scaled_dot_product_attention: "torch.nn.functional.scaled_dot_product_attention",
    F.multi_head_attention_forward: "torch.nn.functional.multi_head_attention_forward",
    F.bilinear: "torch.nn.functional.bilinear",
    torch.einsum: "torch.einsum",
    torch.tensordot: "torch.tensordot",
    torch.mv: "torch.mv",
    torch.Tensor.mv: "torch.Tensor.mv",
    torch.addmv: "torch.addmv",
    torch.chain_matmul: "torch.chain_matmul",
    torch.linalg.multi_dot: "torch.linalg.multi_dot",
}


def _lookup(table: Mapping[Any, Any], func: Any) -> Any:
    """``table.get(func)``, tolerating the odd unhashable callable a mode may be handed."""
    try:
        return table.get(func)
    except TypeError:
        return None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now.

    Matmuls run then (a custom Function's Python backward, checkpoint recomputation) are not
    forward operands, so they are left out rather than recorded as new forward calls.
    """
    return torch._C._current_graph_task_id() != -1


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous CPU copy in the tensor's own dtype, immune to later in-place ops."""
    return t.detach().resolve_conj().resolve_neg().to(
        "cpu", memory_format=torch.contiguous_format, copy=True)


def _argument(args: tuple[Any, ...], kwargs: Mapping[str, Any], where: tuple[int, str]) -> Any:
    position, keyword = where
    return args[position] if position < len(args) else kwargs.get(keyword)


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
        kind = _lookup(_MATMULS, func)
        if kind is not None:
            self._capture._matmul(kind, args, kwargs, out)
        elif (name := _lookup(_UNRECORDED, func)) is not None:
            self._capture._unrecorded[name] += 1
        return out


class Capture:
    """A context manager recording matmul operands into a drift dump; made by ``capture()``.

    After a clean exit, ``names`` lists the tensors written (in the order they were recorded),
    ``entries`` maps each name to its ``DumpEntry``, and ``unrecorded`` counts calls to
    matmul-like functions whose operands are not in the dump.
    """

    def __init__(self, model: nn.Module, path: Path, roles: frozenset[Role],
                 step: int | None) -> None:
        self.model = model
        self.path = path
        self.roles = roles
        self.step = step
        self.names: tuple[str, ...] = ()
        self.entries: Mapping[str, DumpEntry] = MappingProxyType({})
        self.unrecorded: Mapping[str, int] = MappingProxyType({})
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
        if self.path.is_dir():
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

    def _matmul(self, kind: _MatmulKind, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                out: Any) -> None:
        """Record the operands of one matmul the model just ran, and hook its output."""
        if _in_backward():
            return
        frame = self._stack[-1] if self._stack else self._outside
        index = frame.matmuls
        frame.matmuls += 1
        operands = (_argument(args, kwargs, kind.lhs), _argument(args, kwargs, kind.rhs))
        roles = tuple(self._role(t) for t in operands)
        # name by role where that tells the two apart, else by side (q @ k.T: lhs, rhs)
        labels = (roles[0].value, roles[1].value) if roles[0] != roles[1] else ("lhs", "rhs")
        for t, role, label, operand in zip(operands, roles, labels, kind.operands, strict=False):
            if role not in self.roles or not isinstance(t, torch.Tensor):
                continue
            if role is Role.WEIGHT:
                base = t if t._base is None else t._base
                key = (frame.layer, id(base), t.shape, t.stride(), t.storage_offset())
                if key in self._weights_seen:
                    continue
                self._weights_seen.add(key)
            self._records.append(_Record(frame.layer, frame.call, index, label, role, operand,
                                         [_snapshot(t)]))
        if Role.GRADIENT in self.roles and isinstance(out, torch.Tensor) and out.requires_grad:
            record = _Record(frame.layer, frame.call, index, "gradient", Role.GRADIENT,
                             kind.operands[2], [])
            self._records.append(record)

            def keep(grad: torch.Tensor) -> None:
                record.tensors.append(_snapshot(grad))

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
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp), metadata={DUMP_KEY: json.dumps(meta), "format": "pt"})
            os.replace(tmp, self.path)
        except OSError as exc:
            raise DriftError(f"cannot write the capture to {self.path}: {exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
        self.names = tuple(entries)
        self.entries = MappingProxyType(entries)
        self.unrecorded = MappingProxyType(dict(self._unrecorded))
        if self._unrecorded:
            calls = ", ".join(f"{f} ×{n}" for f, n in sorted(self._unrecorded.items()))
            warnings.warn(f"capture did not record the operands of {calls}; only F.linear, "
                          "matmul/@, mm, bmm, addmm, baddbmm and addbmm are recorded",
                          stacklevel=3)


def capture(model: nn.Module, path: str | os.PathLike[str], *,
            roles: Iterable[str | Role] | str = ALL_ROLES, step: int | None = None) -> Capture:
    """Record every matmul operand of ``model``'s forward and backward into a drift dump.

    Use as ``with capture(model, path) as cap: model(x).sum().backward()``. On a clean exit
    the dump is written to ``path`` atomically (a temporary name, then a rename); if the body
    raises, nothing is written. ``roles`` selects which of ``activation``, ``gradient`` and
    ``weight`` are recorded; ``step`` is stored with every tensor. The model's outputs and
    gradients are bit for bit what they are without the capture.
    """
    if not isinstance(model, nn.Module):
        raise DriftError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise DriftError(f"capture step must be a non-negative int or None, got {step!r}")
    chosen = [roles] if isinstance(roles, str) else list(roles)
    if not chosen:
        raise DriftError("capture roles is empty; choose from activation, gradient, weight")
    parsed = frozenset(parse_choice(Role, r, "capture role") for r in chosen)
    return Capture(model, Path(path), parsed, step)
