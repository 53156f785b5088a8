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
from enum import StrEnum
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

_TENSORS = r"(?P<tensor>activation|gradient|weight|output|wgrad|dgrad)"
NAME = re.compile(rf"^(?P<layer>.+)_{_TENSORS}_iter_(?P<step>\d{{6,}})\.pt$")
"""A DumpTensors file name, the first layout (every step in the rank's folder)."""
IN_STEP = re.compile(rf"^(?P<layer>.+)_{_TENSORS}\.pt$")
"""A DumpTensors file name in a step's folder ``iter_NNNNNN/``, the layout TE releases."""
_STEP_FOLDER = re.compile(r"^iter_(?P<step>\d{6,})$")
_RANK_FOLDER = re.compile(r"^rank_(?P<rank>\d+)$")


@dataclass(frozen=True)
class DumpName:
    """What a DumpTensors path names."""

    layer: str
    """The layer as TE wrote it (TE's release turns its dots into underscores)."""
    tensor: str
    """TE's tensor name: activation, weight, gradient, output, wgrad or dgrad."""
    step: int
    """The iteration."""
    rank: int | None
    """The ``rank_R`` folder the file is in, if any."""

    @property
    def role(self) -> str:
        """activation, weight or gradient (``output`` an activation, wgrad/dgrad gradients)."""
        return _ROLES[self.tensor]


def dump_name(path: Path) -> DumpName | None:
    """The layer, tensor, step and rank a DumpTensors file's path gives, in either layout:
    ``rank_R/LAYER_TENSOR_iter_NNNNNN.pt`` or ``rank_R/iter_NNNNNN/LAYER_TENSOR.pt``."""
    found = NAME.match(path.name)
    folder = path.parent
    if found is None:
        step_folder = _STEP_FOLDER.match(folder.name)
        found = IN_STEP.match(path.name) if step_folder else None
        if found is None or step_folder is None:
            return None
        step, folder = int(step_folder.group("step")), folder.parent
    else:
        step = int(found.group("step"))
    rank = _RANK_FOLDER.match(folder.name)
    return DumpName(found.group("layer"), found.group("tensor"), step,
                    int(rank.group("rank")) if rank else None)

_ROLES = {"activation": "activation", "output": "activation", "weight": "weight",
          "gradient": "gradient", "wgrad": "gradient", "dgrad": "gradient"}


class Refused:
    """What the pickle builds where it names a class or function drift does not run: an
    inert record of the name, the arguments the pickle called it with and the state it set
    (data only: :func:`quantized_parts` reads Transformer Engine's tensors from them)."""

    def __init__(self, name: str, args: tuple[object, ...] = (), state: object = None) -> None:
        self.refused_name = name
        self.refused_args = args
        self.refused_state = state

    def __call__(self, *args: object, **kwargs: object) -> Refused:
        return Refused(self.refused_name, args)

    def __setstate__(self, state: object) -> None:
        self.refused_state = state  # kept as data, never applied

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
            return Refused(name, args)

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
    found = dump_name(path)
    obj = _DUMPS.load(path)
    if "high_precision" not in obj and "quantized" not in obj:
        # named like a dump but not one: a state dict, read as any .pt file
        from driftcli.io.readers.pytorch import PYTORCH
        return PYTORCH.list_file(path)
    layer = found.layer if found else path.stem
    kind = found.tensor if found else None
    step = found.step if found else None
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
        return dump_name(path) is not None


TE_DUMPS = _TeKind("Transformer Engine dump", (), dump_refs)
"""Transformer Engine DumpTensors files (before the plain ``.pt`` kind, which would refuse
their pickled ``quantized`` entry as a whole file)."""


# --- the quantized entry's raw parts -------------------------------------------------------

class TeClass(StrEnum):
    """The quantized tensors drift reads the parts of."""

    FLOAT8 = "Float8Tensor"
    MXFP8 = "MXFP8Tensor"
    NVFP4 = "NVFP4Tensor"


_TE = "transformer_engine."
# each class's reconstructor and the positions of its arguments (TE appends new arguments, so
# a shorter tuple of an older release reads the same), from ``__reduce_ex__`` of
# transformer_engine/pytorch/tensor/{float8,mxfp8,nvfp4}_tensor.py at d0067d0
_ARGS: dict[TeClass, tuple[str, ...]] = {
    TeClass.FLOAT8: ("_data", "_fp8_dtype", "_scale_inv", "dtype", "shape", "_transpose"),
    TeClass.MXFP8: ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                    "_columnwise_scale_inv", "_fp8_dtype", "dtype", "shape", "_quantizer",
                    "_with_gemm_swizzled_scales"),
    TeClass.NVFP4: ("shape", "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                    "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise", "_fp4_dtype",
                    "dtype", "_quantizer", "_with_gemm_swizzled_scales", "_row_scaled_nvfp4",
                    "_nvfp4_use_4over6", "_nvfp4_e4m3_max"),
}
_MAKERS = {
    "float8_tensor._make_float8_tensor_in_reduce_ex": TeClass.FLOAT8,
    "float8_tensor.Float8Tensor._make_in_reduce_ex": TeClass.FLOAT8,
    "mxfp8_tensor._make_mxfp8_tensor_in_reduce_ex": TeClass.MXFP8,
    "mxfp8_tensor.MXFP8Tensor._make_in_reduce_ex": TeClass.MXFP8,
    "nvfp4_tensor._make_nvfp4_tensor_in_reduce_ex": TeClass.NVFP4,
    "nvfp4_tensor.NVFP4Tensor._make_in_reduce_ex": TeClass.NVFP4,
}
"""A ``QuantizedTensor``'s reconstructor (the module-level function, or the classmethod older
releases named), after ``transformer_engine.pytorch.tensor.``."""
_STORAGES = {"float8_tensor_storage.Float8TensorStorage": TeClass.FLOAT8,
             "mxfp8_tensor_storage.MXFP8TensorStorage": TeClass.MXFP8,
             "nvfp4_tensor_storage.NVFP4TensorStorage": TeClass.NVFP4}
"""The storage classes (``quantizer.internal``), pickled as a plain object: the class, then
its ``__dict__``; after ``transformer_engine.pytorch.tensor.storage.``."""
_DTYPES = {7: "float8_e4m3fn", 8: "float8_e5m2", 10: "float4_e2m1fn"}
"""TE's ``DType`` values (``transformer_engine.h``: kFloat8E4M3 7, kFloat8E5M2 8,
kFloat4E2M1 10) as drift's element formats."""


@dataclass(frozen=True)
class QuantizedParts:
    """A pickled Transformer Engine quantized tensor's raw parts, as its kernel wrote them."""

    te_class: TeClass
    """Which class (its storage class reads the same)."""
    element: str
    """The element format (drift's name) TE's ``fp8_dtype``/``fp4_dtype`` tag names."""
    shape: tuple[int, ...] | None
    """The logical shape, where the pickle states it."""
    rowwise_data: torch.Tensor | None
    """uint8 codes in the tensor's layout (NVFP4: two codes a byte, the first in the low
    nibble); a Float8Tensor's ``_data``."""
    rowwise_scale_inv: torch.Tensor | None
    """The rowwise decoding scales: float32 (Float8Tensor, one), E8M0 bytes (MXFP8), E4M3
    bytes (NVFP4), padded as TE allocates them."""
    columnwise_data: torch.Tensor | None
    """The columnwise codes: MXFP8 in the tensor's layout; NVFP4 and a Float8Tensor's
    ``_transpose`` of the transpose."""
    columnwise_scale_inv: torch.Tensor | None
    """The columnwise decoding scales (a Float8Tensor's transpose shares ``_scale_inv``)."""
    amax_rowwise: torch.Tensor | None = None
    """NVFP4: the float32 amax the rowwise tensor scale came from (one, or one a row)."""
    amax_columnwise: torch.Tensor | None = None
    """NVFP4: the columnwise amax."""
    swizzled: bool = False
    """The scales are in cuBLAS's GEMM-swizzled order, not row by row."""
    flags: tuple[tuple[str, object], ...] = ()
    """The quantizer's and the tensor's settings the pickle holds (``with_rht``,
    ``with_2d_quantization``, ``stochastic_rounding``, ``_row_scaled_nvfp4``, ...)."""

    def flag(self, name: str) -> object:
        """A setting by name (None where the pickle does not hold it)."""
        return dict(self.flags).get(name)


def _te_dtype(value: object) -> int | None:
    """TE's ``DType`` tag: the Python ``IntEnum`` and the pybind11 enum pickle as the class
    called with the int; an older pybind11 enum as the class with the int as its state."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, Refused) and value.refused_name.endswith(".DType"):
        for v in (*value.refused_args, value.refused_state):
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            if isinstance(v, tuple) and len(v) == 1 and isinstance(v[0], int):
                return v[0]
    return None


def _state(value: object) -> dict[str, object]:
    """A pickled object's ``__dict__`` (its BUILD state), data only."""
    state = value.refused_state if isinstance(value, Refused) else None
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
        state = state[0]  # (dict, slots)
    return {k: v for k, v in dict.items(state) if isinstance(k, str)} \
        if isinstance(state, dict) else {}


def _fields(value: Refused) -> tuple[TeClass, dict[str, object]] | None:
    name = value.refused_name
    if not name.startswith(_TE):
        return None
    tail = name.removeprefix(_TE + "pytorch.tensor.")
    if tail in _MAKERS:
        te_class = _MAKERS[tail]
        return te_class, dict(zip(_ARGS[te_class], value.refused_args, strict=False))
    if tail.removeprefix("storage.") in _STORAGES:
        return _STORAGES[tail.removeprefix("storage.")], _state(value)
    return None


def quantized_parts(value: object, where: str) -> QuantizedParts:
    """The raw parts of a dump's ``quantized`` entry (as :func:`load_dump` read it: inert
    records, nothing of TE run); a :class:`ReadError` naming ``where`` for anything else."""
    found = _fields(value) if isinstance(value, Refused) else None
    if found is None:
        what = value.refused_name if isinstance(value, Refused) else type(value).__name__
        raise ReadError(f"{where}: entry 'quantized' is a {what}, not a Float8Tensor, "
                        "MXFP8Tensor or NVFP4Tensor of Transformer Engine (or their storage "
                        "classes); only those are compared")
    te_class, f = found
    code = _te_dtype(f.get("_fp4_dtype" if te_class is TeClass.NVFP4 else "_fp8_dtype"))
    element = _DTYPES.get(code) if code is not None else None
    if element is None or (te_class is TeClass.NVFP4) != (element == "float4_e2m1fn"):
        raise ReadError(f"{where}: the {te_class.value}'s element type tag {code} is none "
                        "drift knows for it (7 E4M3, 8 E5M2, 10 E2M1)")

    def tensor(key: str) -> torch.Tensor | None:
        t = f.get(key)
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            what = f"pickled {t.refused_name}" if isinstance(t, Refused) else type(t).__name__
            raise ReadError(f"{where}: the {te_class.value}'s {key} is a {what}, not a tensor")
        return t

    shape = f.get("shape")
    quantizer = _state(f.get("_quantizer"))
    flags = {k: v for k, v in quantizer.items()
             if k in ("with_rht", "with_2d_quantization", "stochastic_rounding",
                      "nvfp4_4over6_err_mode")}
    flags.update({k: f[k] for k in ("_row_scaled_nvfp4", "_nvfp4_use_4over6") if k in f})
    data = tensor("_data") if te_class is TeClass.FLOAT8 else tensor("_rowwise_data")
    scale = tensor("_scale_inv") if te_class is TeClass.FLOAT8 else tensor("_rowwise_scale_inv")
    cdata = tensor("_transpose") if te_class is TeClass.FLOAT8 else tensor("_columnwise_data")
    if te_class is TeClass.FLOAT8 and f.get("_transpose_invalid") is True:
        cdata = None
    cscale = scale if te_class is TeClass.FLOAT8 else tensor("_columnwise_scale_inv")
    if data is None and cdata is None:
        raise ReadError(f"{where}: the {te_class.value} holds neither rowwise nor columnwise "
                        "data")
    return QuantizedParts(
        te_class, element,
        tuple(int(n) for n in shape) if isinstance(shape, (tuple, list)) else None,
        data, scale, cdata, cscale, tensor("_amax_rowwise"), tensor("_amax_columnwise"),
        f.get("_with_gemm_swizzled_scales") is True,
        tuple(sorted(flags.items())))
