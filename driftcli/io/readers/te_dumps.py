"""Transformer Engine ``DumpTensors`` files: ``{layer}_{tensor}_iter_{NNNNNN}.pt``, each a
``torch.save``'d dict whose ``high_precision`` entry is the tensor before quantization.

A dump may also hold ``quantized``, a pickled Transformer Engine object
(``Float8Tensor``, ``MXFP8Tensor``, ...): loading it would run Transformer Engine's code, so
drift never does. The file's pickle is read by drift's own unpickler, which builds tensors
only through torch's tensor-rebuild functions and turns every other class or function the
pickle names into an inert placeholder; the ``quantized`` entry is then refused by name, with
the class it holds, and ``high_precision`` is read. The raw internals a dump may add
(``data``, ``scale_inv``, ``rowwise_data``, ...) are the quantized copy's parts and are not
listed. The layer, the tensor's role and the iteration become the tensor's ``layer``,
``role`` and ``step``, as for a drift dump. See ``docs/inputs.md``.

The format: ``transformer_engine/debug/features/dump_tensors.py`` (``DumpTensors``,
``TensorLogger.save_tensor``) of NVIDIA/TransformerEngine, commit
``a54a743af93c198535636dad47c0c59fee9a1ba8``.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
import threading
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from driftcli.io.readers.core import (
    ZIP_ERRORS,
    FileKind,
    Listing,
    Problem,
    ReadError,
    TensorRef,
    first_line,
    storage_problem,
)

NAME = re.compile(r"^(?P<layer>.+)_(?P<tensor>activation|gradient|weight|output|wgrad|dgrad)"
                  r"_iter_(?P<step>\d{6,})\.pt$")
"""A DumpTensors file name."""
_ROLES = {"activation": "activation", "output": "activation", "weight": "weight",
          "gradient": "gradient", "wgrad": "gradient", "dgrad": "gradient"}


class Refused:
    """What the pickle builds where it names a class or function drift does not run."""

    def __init__(self, name: str) -> None:
        self.refused_name = name

    def __call__(self, *args: object, **kwargs: object) -> Refused:
        return Refused(self.refused_name)

    def __setstate__(self, state: object) -> None:
        pass  # the state is data drift does not use

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        """A pickled list's item (ignored)."""

    def extend(self, values: object) -> None:
        """A pickled list's items (ignored)."""


def _placeholder_class(name: str) -> type:
    """A class for ``name``: NEWOBJ needs a class, REDUCE a callable; both give a Refused."""

    class Placeholder(Refused):
        refused_name = name

        # unpickling the refused class yields the marker of its refusal, not an instance
        def __new__(cls, *args: object, **kwargs: object) -> Refused:  # type: ignore[misc]
            return Refused(name)

        def __init__(self, *args: object, **kwargs: object) -> None:
            Refused.__init__(self, name)

    return Placeholder


def _fake_getattr(obj: object, attr: object) -> Refused:
    """``getattr`` as a pickle uses it (a classmethod reducer): never the real one."""
    base = getattr(obj, "refused_name", None) or type(obj).__name__
    return Refused(f"{base}.{attr}")


@dataclass(frozen=True)
class _StorageType:
    """A storage class as a pickle names it, reduced to its dtype: never callable, so a
    pickle cannot have drift allocate a storage of a size it chose."""

    dtype: torch.dtype


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                backward_hooks: Any = None, metadata: Any = None) -> torch.Tensor:
    """torch's ``_rebuild_tensor_v2`` as data: never ``requires_grad`` and no hooks (a tensor
    saved from training would otherwise have autograd record every cast drift makes)."""
    del requires_grad, backward_hooks
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False,
                                           collections.OrderedDict(), metadata)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                backward_hooks: Any, dtype: Any, metadata: Any = None) -> torch.Tensor:
    """torch's ``_rebuild_tensor_v3`` as data, like :func:`_rebuild_v2`."""
    del requires_grad, backward_hooks
    return torch._utils._rebuild_tensor_v3(storage, offset, size, stride, False,
                                           collections.OrderedDict(), dtype, metadata)


def _allowed(module: str, name: str) -> Any:
    """The torch objects a tensor's pickle needs; None for everything else."""
    if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
        return _rebuild_v2
    if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
        return _rebuild_v3
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    if (module, name) == ("torch.storage", "UntypedStorage"):
        return _StorageType(torch.uint8)
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype) or value is torch.Size:
            return value
        with warnings.catch_warnings():  # a legacy storage class's dtype warns of its age
            warnings.simplefilter("ignore", UserWarning)
            dtype = getattr(value, "dtype", None)
        if name.endswith("Storage") and isinstance(value, type) and isinstance(
                dtype, torch.dtype):
            return _StorageType(dtype)
    return None


class _Unpickler(pickle.Unpickler):
    """Tensors through torch's rebuild functions, storages from the archive, every other
    global a placeholder."""

    def __init__(self, data: bytes, zf: zipfile.ZipFile, prefix: str) -> None:
        super().__init__(io.BytesIO(data))
        self.zf, self.prefix = zf, prefix
        # each storage member read once: torch.save names one storage once per view of it,
        # and a 16 MiB file of views would otherwise be read and copied hundreds of times
        self.members: dict[str, bytearray] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in (("__builtin__", "getattr"), ("builtins", "getattr")):
            return _fake_getattr
        found = _allowed(module, name)
        return found if found is not None else _placeholder_class(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:60]}")
        storage_type, key, _location, numel = pid[1:]
        if not isinstance(storage_type, _StorageType) or not isinstance(numel, int) \
                or numel < 0:
            raise pickle.UnpicklingError("a storage of no known dtype")
        dtype = storage_type.dtype
        member = f"{self.prefix}/data/{key}"
        raw = self.members.get(member)
        if raw is None:
            raw = self.members[member] = bytearray(self.zf.read(member))
        need = numel * dtype.itemsize
        if len(raw) < need:
            raise pickle.UnpicklingError(f"storage {key} needs {need} bytes, holds {len(raw)}")
        # a view of the member's bytes, never a copy: however many references name it
        untyped = torch.frombuffer(raw, dtype=torch.uint8, count=need).untyped_storage() \
            if need else torch.UntypedStorage(0)
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def load_dump(path: Path) -> dict[str, Any]:
    """A DumpTensors file's dict, tensors built, other objects as :class:`Refused`."""
    try:
        with zipfile.ZipFile(path) as zf:
            if any(i.compress_type != zipfile.ZIP_STORED for i in zf.infolist()):
                # torch stores members uncompressed; a compressed one could inflate to
                # any size
                raise ReadError(f"{path} has compressed members, which torch.save never "
                                "writes; re-save it with torch.save")
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                raise ReadError(f"{path} is not a torch zip file (no single data.pkl)")
            prefix = pkl[0].removesuffix("/data.pkl")
            obj = _Unpickler(zf.read(pkl[0]), zf, prefix).load()
    except ReadError:
        raise
    except OSError as exc:
        raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (*ZIP_ERRORS, pickle.UnpicklingError, EOFError, KeyError, IndexError, TypeError,
            AttributeError, RuntimeError, RecursionError, MemoryError) as exc:
        raise ReadError(f"cannot read {path} as a Transformer Engine dump "
                        f"({first_line(exc)}); re-save it or re-run the dump") from exc
    if not isinstance(obj, dict):
        raise ReadError(f"{path} holds a {type(obj).__name__}, not the dict DumpTensors "
                        "writes")
    return obj


class _Cache:
    """The last dump loaded (reads go file by file)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[str, int, int] | None = None
        self._obj: dict[str, Any] = {}

    def load(self, path: Path) -> dict[str, Any]:
        try:
            st = path.stat()
        except OSError as exc:
            raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        with self._lock:
            if key != self._key:
                self._key, self._obj = None, {}
                self._obj = load_dump(path)
                self._key = key
            return self._obj


_DUMPS = _Cache()


@dataclass(frozen=True)
class _Entry:
    path: Path
    key: str

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        del into
        value = dict.get(_DUMPS.load(self.path), self.key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != ref.shape:
            raise ReadError(f"{ref.source}: tensor {ref.name} changed since it was listed")
        return (value[start:stop] if value.dim() else value).clone()


def dump_refs(path: Path) -> Listing:
    """The ``high_precision`` tensor of one DumpTensors file, and a problem naming a
    pickled ``quantized`` entry (refused)."""
    found = NAME.match(path.name)
    obj = _DUMPS.load(path)
    if "high_precision" not in obj and "quantized" not in obj:
        # named like a dump but not one: a state dict, read as any .pt file
        from driftcli.io.readers.pytorch import PYTORCH
        return PYTORCH.list_file(path)
    layer = found.group("layer") if found else path.stem
    kind = found.group("tensor") if found else None
    step = int(found.group("step")) if found else None
    name = f"{layer}.{kind}" if kind else path.stem
    refs, problems = [], []
    # dict.get unbound: a pickled OrderedDict can carry an instance attribute named get
    hp = dict.get(obj, "high_precision")
    why = storage_problem(hp) if isinstance(hp, torch.Tensor) else None
    if why is not None:  # a stride-0 view: 2^36 elements over 4 bytes
        problems.append(Problem(f"{path}: tensor {name} {why}", name))
    elif isinstance(hp, torch.Tensor):
        refs.append(TensorRef(str(path), name, str(hp.dtype).removeprefix("torch."),
                              tuple(hp.shape), role=_ROLES.get(kind or ""), layer=layer,
                              step=step, _reader=_Entry(path, "high_precision")))
    elif hp is not None:
        problems.append(Problem(f"{path}: high_precision is a {type(hp).__name__}, not a "
                                "tensor", name))
    quantized = dict.get(obj, "quantized")
    if isinstance(quantized, Refused):
        problems.append(Problem(
            f"{path}: entry 'quantized' is a pickled {quantized.refused_name}, which drift "
            "does not unpickle (it would run Transformer Engine's code); the high_precision "
            "tensor is read (dump with quantized_tensor: False to leave it out)",
            f"{name}.quantized"))
    if hp is None:
        problems.append(Problem(f"{path}: no 'high_precision' entry (dump with "
                                "high_precision_tensor: True)", name))
    return refs, problems


class _TeKind(FileKind):
    """Recognised by the DumpTensors file name, not by a suffix alone."""

    def recognises(self, path: Path) -> bool:
        """Whether ``path`` is named as a DumpTensors file."""
        return NAME.match(path.name) is not None


TE_DUMPS = _TeKind("Transformer Engine dump", (), dump_refs)
"""Transformer Engine DumpTensors files (before the plain ``.pt`` kind, which would refuse
their pickled ``quantized`` entry as a whole file)."""
