"""Named tensors from checkpoints and dumps, read one tensor (or a few rows) at a time.

:func:`open_inputs` lists what a set of paths holds without reading tensor data:
safetensors files (single, or sharded through ``*.safetensors.index.json``),
PyTorch ``.pt`` / ``.pth`` / ``.bin`` state dicts (``weights_only`` only), NumPy
``.npz`` / ``.npy``, and folders of any of these. Each listed tensor is a
:class:`TensorRef` whose :meth:`TensorRef.read` copies rows ``[start, stop)`` of
dim 0 into a fresh tensor, so memory stays bounded by the rows asked for.

Failures are kept as local as the file allows: a missing path raises at once; a
file that cannot be opened (corrupt header, refused pickle) becomes one entry of
:attr:`Inputs.errors` and the other files are still listed; a tensor whose data
is missing or inconsistent is still listed and its ``read`` raises
:class:`ReadError`. The formats and the drift dump metadata are described in
``docs/inputs.md``.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import pickle
import re
import struct
import sys
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import torch

from driftcli.errors import DriftError

DUMP_KEY = "drift.dump"
"""The ``__metadata__`` key of a safetensors file that marks it as a drift dump."""
DUMP_VERSION = 1
"""The dump metadata version this module reads and the capture API writes."""
ROLES = ("activation", "weight", "gradient")
"""The values of a dump tensor's ``role``."""

TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".npz", ".npy")
"""File name endings read as tensor files (case-insensitive)."""
INDEX_SUFFIX = ".safetensors.index.json"
"""The ending of a sharded safetensors checkpoint's index."""

_ACCEPTED = "(.safetensors, .safetensors.index.json, .pt, .pth, .bin, .npz, .npy)"
# safetensors' own reader refuses larger headers; a corrupt length must not become a huge read.
_MAX_HEADER = 100_000_000

# safetensors dtype codes -> torch dtype names. Codes with no torch element type (the
# sub-byte F4 / F6 codes, packed several values per byte) keep the file's own code.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
}

# numpy (kind, itemsize) -> torch dtype name; anything else keeps numpy's own name.
_NUMPY_DTYPES = {
    ("f", 2): "float16", ("f", 4): "float32", ("f", 8): "float64",
    ("i", 1): "int8", ("i", 2): "int16", ("i", 4): "int32", ("i", 8): "int64",
    ("u", 1): "uint8", ("u", 2): "uint16", ("u", 4): "uint32", ("u", 8): "uint64",
    ("b", 1): "bool", ("c", 8): "complex64", ("c", 16): "complex128",
}

# Canonical names only (str(torch.float) is "torch.float32"), so "float" or "half" in a
# file never passes for a torch dtype.
_TORCH_DTYPES = {str(d).removeprefix("torch."): d
                 for d in vars(torch).values() if isinstance(d, torch.dtype)}

_REFUSED_PICKLE = ("needs arbitrary unpickling{what}, which drift refuses (it can run code); "
                   "re-save it as a state dict of tensors (torch.save(model.state_dict(), ...)) "
                   "or as safetensors")


class ReadError(DriftError):
    """One input or one tensor cannot be read: missing, corrupt, truncated or refused."""


def _torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype named ``name`` ("bfloat16"), or None for a name torch lacks."""
    return _TORCH_DTYPES.get(name)


def _first_line(exc: BaseException) -> str:
    """A library exception as one line (torch's messages run over several)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _Reader(Protocol):
    """Where a tensor's bytes are; copies rows ``[start, stop)`` into a fresh tensor, or into
    the front of ``into`` (a uint8 buffer) where it reads bytes and ``into`` is large enough."""

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor: ...


def _byte_buffer(n: int, into: torch.Tensor | None) -> torch.Tensor:
    """``n`` bytes to read into: the front of ``into`` when it holds them (memory already
    mapped and touched reads about five times faster than fresh pages), else new."""
    if into is not None and into.dtype == torch.uint8 and into.numel() >= n:
        return into[:n]
    return torch.empty(n, dtype=torch.uint8)


@dataclass(frozen=True)
class TensorRef:
    """One named tensor of one file, listed but not read.

    ``dtype`` is the stored dtype as torch names it without ``torch.`` (``float32``,
    ``bfloat16``, ``float8_e4m3fn``, ``int64``, ``bool``); a stored dtype torch has no
    element type for keeps the file's own name (safetensors ``F4``, numpy ``float128``).
    ``role``, ``layer``, ``operand`` and ``step`` come from a drift dump's metadata and
    are None for every other file.
    """

    source: str
    """Path of the file holding the tensor, as given or found under a given folder."""
    name: str
    """Tensor name; nested ``.pt`` containers are flattened to dotted names."""
    dtype: str
    shape: tuple[int, ...]
    role: str | None = None
    """``activation``, ``weight`` or ``gradient`` (drift dumps only)."""
    layer: str | None = None
    operand: str | None = None
    step: int | None = None
    _reader: _Reader | None = field(default=None, compare=False, repr=False)
    _nbytes: int | None = field(default=None, compare=False, repr=False)
    """Stored bytes, for a dtype torch cannot size."""

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored data."""
        dtype = _torch_dtype(self.dtype)
        if dtype is not None:
            return self.numel * dtype.itemsize
        if self._nbytes is None:
            raise ValueError(f"tensor {self.name}: the size of dtype {self.dtype} is unknown")
        return self._nbytes

    @property
    def is_float(self) -> bool:
        """Whether the stored dtype is floating point (bfloat16, float16, float8 types...)."""
        dtype = _torch_dtype(self.dtype)
        return dtype is not None and dtype.is_floating_point

    def read(self, start: int = 0, stop: int | None = None, *,
             into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) along dim 0 (the whole tensor for 0-d), in the stored dtype, as a
        tensor that owns its memory (not a view into a file mapping that stays open). Raises
        ReadError naming the file and tensor when the data is missing or corrupt (e.g. a
        truncated file, byte offsets inconsistent with shape and dtype).

        ``start`` and ``stop`` follow Python slicing: negative values count from the end and
        bounds past the end are clipped, so ``t.read(a, b)`` equals ``full[a:b]``. ``into``
        is a uint8 buffer to reuse: where the bytes fit, the result is a view of its front
        (valid until the buffer is read into again).
        """
        if self._reader is None:
            raise ReadError(f"{self.source}: tensor {self.name} was not listed by "
                            "open_inputs, so drift does not know where its data is")
        if self.shape:
            start, stop, _ = slice(start, stop).indices(self.shape[0])
            stop = max(start, stop)
        else:
            start, stop = 0, 1
        return self._reader.read(self, start, stop, into)


@dataclass(frozen=True)
class Inputs:
    """What :func:`open_inputs` found under its paths."""

    files: tuple[Path, ...]
    """Every tensor or index file opened, including those listed in ``errors``."""
    tensors: tuple[TensorRef, ...]
    """Selected tensors, float and non-float, in path order, then file order."""
    errors: tuple[tuple[str, str], ...]
    """``(source, one-line message)`` per file (or part of one) that could not be read."""
    excluded: int
    """Tensors dropped by ``include`` / ``exclude``."""


# --- reading bytes --------------------------------------------------------------------------


def _element_type(ref: TensorRef) -> torch.dtype:
    dtype = _torch_dtype(ref.dtype)
    if dtype is None:
        raise ReadError(f"{ref.source}: tensor {ref.name} is stored as {ref.dtype}, which torch "
                        "has no element type for; drift cannot read it")
    return dtype


def _row_shape(ref: TensorRef, start: int, stop: int) -> tuple[int, ...]:
    return (stop - start, *ref.shape[1:]) if ref.shape else ()


def _truncated(ref: TensorRef, begin: int, end: int, size: int) -> ReadError:
    return ReadError(f"{ref.source}: tensor {ref.name} needs bytes {begin}..{end} but the file "
                     f"has {size} bytes (truncated?); re-save or re-download it")


def _fill(fh: IO[bytes], buf: torch.Tensor) -> int:
    """Read into the uint8 tensor ``buf`` until it is full or the stream ends; bytes read."""
    view = memoryview(buf.numpy()).cast("B")
    got = 0
    while got < len(view):
        # one read() may return less than asked (Linux caps it near 2 GiB), so loop
        n = fh.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            break
        got += n
    return got


def _typed(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
           swap: bool) -> torch.Tensor:
    """Raw bytes as ``dtype`` in native byte order, shaped ``shape``."""
    if swap and dtype.itemsize > 1:
        buf = buf.view(-1, dtype.itemsize).flip(1).reshape(-1)
    return buf.view(dtype).reshape(shape)


@dataclass(frozen=True)
class _ByteRange:
    """A tensor stored row-major at ``offset`` of a plain file (safetensors, ``.npy``)."""

    path: Path
    offset: int
    length: int
    swap: bool = False

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        dtype = _element_type(ref)
        need = ref.numel * dtype.itemsize
        if need != self.length:
            raise ReadError(f"{ref.source}: tensor {ref.name} has {self.length} data bytes but "
                            f"shape {list(ref.shape)} of {ref.dtype} needs {need}; the file is "
                            "corrupt, re-save or re-download it")
        row = math.prod(ref.shape[1:]) * dtype.itemsize
        buf = _byte_buffer((stop - start) * row, into)
        try:
            # positioned reads, not mmap: a file truncated under a mapping kills the process
            # with SIGBUS, and no mapping outlives the call
            with open(self.path, "rb", buffering=0) as fh:
                size = os.fstat(fh.fileno()).st_size
                if self.offset + self.length > size:
                    raise _truncated(ref, self.offset, self.offset + self.length, size)
                fh.seek(self.offset + start * row)
                got = _fill(fh, buf)
        except OSError as exc:
            raise ReadError(f"{ref.source}: cannot read tensor {ref.name}: "
                            f"{exc.strerror or exc}") from exc
        if got < buf.numel():  # the file shrank after the size check
            raise _truncated(ref, self.offset, self.offset + self.length, size)
        return _typed(buf, dtype, _row_shape(ref, start, stop), self.swap)


# --- safetensors ----------------------------------------------------------------------------


def _corrupt(path: Path, detail: str) -> ReadError:
    return ReadError(f"corrupt safetensors header in {path}: {detail}; re-save or re-download it")


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, f"the file has {size} bytes, too few for the 8-byte length")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8:
                raise _corrupt(path, f"header length {n} runs past the end of the file "
                                     f"({size} bytes)")
            if n > _MAX_HEADER:
                raise _corrupt(path, f"header length {n} is over the {_MAX_HEADER}-byte limit")
            raw = fh.read(n)
    except OSError as exc:
        raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise _corrupt(path, f"the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    return header, 8 + n


def _dump_fields(path: Path, meta: dict[str, str] | None,
                 names: set[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per-tensor role/layer/operand/step of a drift dump, and problems with its metadata."""
    if not meta or DUMP_KEY not in meta:
        return {}, []
    without = "; its tensors are listed without role, layer, operand and step"
    try:
        dump = json.loads(meta[DUMP_KEY])
    except (TypeError, ValueError) as exc:
        return {}, [f"drift dump metadata in {path} is not JSON ({exc}){without}"]
    if not isinstance(dump, dict) or dump.get("version") != DUMP_VERSION:
        version = dump.get("version") if isinstance(dump, dict) else None
        return {}, [f"drift dump metadata in {path} has version {version!r}; this drift reads "
                    f"version {DUMP_VERSION}{without}"]
    entries = dump.get("tensors")
    if not isinstance(entries, dict):
        return {}, [f"drift dump metadata in {path} has no 'tensors' object{without}"]
    fields: dict[str, dict[str, Any]] = {}
    for name, e in entries.items():
        bad = (not isinstance(e, dict) or e.get("role") not in ROLES
               or not all(isinstance(e.get(k), str | None) for k in ("layer", "operand"))
               or not (e.get("step") is None or _is_count(e.get("step"))))
        if bad:
            return {}, [f"drift dump metadata in {path}: tensor {name!r} needs role in "
                        f"{'/'.join(ROLES)}, string layer and operand and an int or null "
                        f"step, not {json.dumps(e)}{without}"]
        fields[name] = {k: e.get(k) for k in ("role", "layer", "operand", "step")}
    problems = []
    absent = sorted(set(fields) - names)
    if absent:
        problems.append(f"drift dump metadata in {path} describes {len(absent)} tensor(s) the "
                        f"file does not hold (first: {absent[0]})")
    return fields, problems


def _safetensors_refs(path: Path) -> tuple[list[TensorRef], list[str]]:
    """The tensors of a safetensors file in data order, and problems with its metadata."""
    header, data_start = _safetensors_header(path)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise _corrupt(path, "__metadata__ is not an object of strings")
    entries = []
    for name, e in header.items():
        ok = (isinstance(e, dict) and isinstance(e.get("dtype"), str)
              and isinstance(e.get("shape"), list) and all(map(_is_count, e["shape"]))
              and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
              and all(map(_is_count, e["data_offsets"]))
              and e["data_offsets"][0] <= e["data_offsets"][1])
        if not ok:
            raise _corrupt(path, f"entry {name!r} needs dtype, shape and data_offsets "
                                 f"[begin, end], not {json.dumps(e)}")
        entries.append((e["data_offsets"][0], name, e))
    fields, problems = _dump_fields(path, meta, set(header))
    refs = []
    for begin, name, e in sorted(entries, key=lambda t: (t[0], t[1])):
        end = e["data_offsets"][1]
        reader = _ByteRange(path, data_start + begin, end - begin, swap=sys.byteorder == "big")
        refs.append(TensorRef(str(path), name, _SAFETENSORS_DTYPES.get(e["dtype"], e["dtype"]),
                              tuple(e["shape"]), **fields.get(name, {}), _reader=reader,
                              _nbytes=end - begin))
    return refs, problems


@dataclass(frozen=True)
class _Index:
    """A sharded checkpoint's index: which shard holds which tensor."""

    path: Path
    shards: dict[Path, set[str]]
    """Shard path (as found) -> the tensor names the index puts there, in sorted shard order."""


def _read_index(path: Path) -> _Index:
    try:
        index = json.loads(path.read_bytes())
    except OSError as exc:
        raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ReadError(f"corrupt safetensors index {path}: not JSON ({exc}); re-download it, "
                        "or give the shard files themselves") from exc
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(wmap, dict) and all(isinstance(v, str) for v in wmap.values())):
        raise ReadError(f"corrupt safetensors index {path}: no 'weight_map' of tensor name -> "
                        "shard file; re-download it, or give the shard files themselves")
    shards: dict[Path, set[str]] = {}
    for name, shard in wmap.items():
        shards.setdefault(path.parent / shard, set()).add(name)
    return _Index(path, dict(sorted(shards.items())))


# --- PyTorch files --------------------------------------------------------------------------


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Tensors of nested dicts / lists / tuples under dotted names; other leaves are skipped."""
    if isinstance(obj, torch.Tensor):
        out.setdefault(prefix, obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    # numbers, strings, None (an epoch counter, a config) are not tensors


# What torch.load raises on a file that is not a (readable) torch file: it hands the bytes to
# a zip reader or an unpickler, and garbage can fail inside either in many ways.
_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, IndexError,
                ValueError, TypeError, AttributeError, OSError, zipfile.BadZipFile)
_NEEDS_CODE = re.compile(r"unsupported global|allowed global|unrecognized function",
                         re.IGNORECASE)
_WEIGHTS_ONLY_DETAIL = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")


class _TorchCache:
    """The flattened tensors of the last ``.pt`` file loaded.

    One slot: reads go file by file, so this loads each file once, and only one file's
    mapping is open at a time (a non-zip legacy file is loaded whole, so one at a time
    matters there).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[str, int, int] | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        try:
            stat = path.stat()
        except OSError as exc:
            raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        with self._lock:
            if key != self._key:
                self._key, self._tensors = None, {}  # drop the old mapping before the new one
                self._tensors = _load_torch(path)
                self._key = key
            return self._tensors


def _load_torch(path: Path) -> dict[str, torch.Tensor]:
    # mmap needs the zip format of torch >= 1.6; older files are loaded whole
    try:
        mmap = zipfile.is_zipfile(path)
        obj = torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        # torch wraps every weights-only failure alike; only a reference to a class or
        # function means the file needs code run, the rest (bad opcodes) is a damaged file
        if not _NEEDS_CODE.search(text):
            detail = _WEIGHTS_ONLY_DETAIL.search(text)
            why = detail.group(1).strip() if detail else _first_line(exc)
            raise ReadError(f"cannot read {path} as a PyTorch file ({why}); re-save it with "
                            "torch.save or as safetensors") from exc
        found = re.search(r"GLOBAL (\S+)", text)
        what = f" (it holds {found.group(1)})" if found else ""
        raise ReadError(f"{path} " + _REFUSED_PICKLE.format(what=what)) from exc
    except _LOAD_ERRORS as exc:
        raise ReadError(f"cannot read {path} as a PyTorch file ({_first_line(exc)}); "
                        "re-save it with torch.save or as safetensors") from exc
    out: dict[str, torch.Tensor] = {}
    _flatten(obj, "", out)
    if "" in out:  # the file holds one bare tensor: name it like an .npy file
        out[path.stem] = out.pop("")
    return out


_TORCH_FILES = _TorchCache()


@dataclass(frozen=True)
class _TorchEntry:
    """A tensor of a ``.pt`` state dict, found again by name in the (cached) loaded file."""

    path: Path
    key: str

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        t = _TORCH_FILES.load(self.path).get(self.key)
        if t is None or str(t.dtype).removeprefix("torch.") != ref.dtype or (
                tuple(t.shape) != ref.shape):
            raise ReadError(f"{ref.source}: tensor {ref.name} changed since drift listed it "
                            "(the file was rewritten); run again")
        try:
            part = t[start:stop] if ref.shape else t
            # contiguous copy of just these rows: it owns its memory and keeps no mapping
            return part.clone(memory_format=torch.contiguous_format)
        except RuntimeError as exc:  # e.g. a sparse or quantized layout that cannot slice
            raise ReadError(f"{ref.source}: cannot read tensor {ref.name} "
                            f"({_first_line(exc)})") from exc


def _torch_refs(path: Path) -> tuple[list[TensorRef], list[str]]:
    refs = [TensorRef(str(path), name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                      _reader=_TorchEntry(path, name))
            for name, t in _TORCH_FILES.load(path).items()]
    return refs, []


# --- NumPy files ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _NpyHeader:
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran: bool
    offset: int
    """Where the data starts in the stream."""


def _npy_header(fh: IO[bytes]) -> _NpyHeader:
    """Parse an ``.npy`` header (raises ValueError on a bad one)."""
    fmt = np.lib.format
    version = fmt.read_magic(fh)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(fh)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(fh)
    else:
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported")
    return _NpyHeader(dtype, tuple(shape), fortran, fh.tell())


def _numpy_dtype_name(dtype: np.dtype[Any]) -> str:
    return _NUMPY_DTYPES.get((dtype.kind, dtype.itemsize), dtype.name)


def _npy_ref(source: str, name: str, head: _NpyHeader, reader: _Reader) -> TensorRef:
    return TensorRef(source, name, _numpy_dtype_name(head.dtype), head.shape, _reader=reader,
                     _nbytes=math.prod(head.shape) * head.dtype.itemsize)


def _refuse_objects(what: str) -> str:
    return (f"{what} holds Python objects, which need arbitrary unpickling; drift refuses "
            "them (it can run code); save numeric arrays instead")


@dataclass(frozen=True)
class _NpyFortran:
    """A column-major ``.npy`` array: rows are not contiguous, so copy them via numpy."""

    path: Path

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        dtype = _element_type(ref)
        try:
            mapped = np.load(self.path, mmap_mode="r", allow_pickle=False)
            # a real copy: ascontiguousarray would hand back the mapped rows themselves
            part = np.array(mapped[start:stop], order="C", copy=True)
            del mapped  # close the mapping now, not when the collector runs
        except (OSError, ValueError) as exc:
            raise ReadError(f"{ref.source}: cannot read tensor {ref.name} "
                            f"({_first_line(exc)})") from exc
        buf = torch.from_numpy(part.reshape(-1).view(np.uint8))
        return _typed(buf, dtype, _row_shape(ref, start, stop), not part.dtype.isnative)


def _npy_refs(path: Path) -> tuple[list[TensorRef], list[str]]:
    try:
        with open(path, "rb") as fh:
            head = _npy_header(fh)
    except OSError as exc:
        raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ReadError(f"corrupt .npy header in {path} ({exc}); re-save it with "
                        "numpy.save") from exc
    if head.dtype.hasobject:
        raise ReadError(_refuse_objects(str(path)))
    nbytes = math.prod(head.shape) * head.dtype.itemsize
    reader: _Reader = (_NpyFortran(path) if head.fortran
                       else _ByteRange(path, head.offset, nbytes, not head.dtype.isnative))
    return [_npy_ref(str(path), path.stem, head, reader)], []


_ZIP_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


@dataclass(frozen=True)
class _NpzMember:
    """An array inside an ``.npz`` archive (stored or deflated), streamed from its start."""

    path: Path
    member: str

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        dtype = _element_type(ref)
        try:
            with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as fh:
                head = _npy_header(fh)
                if head.shape != ref.shape:
                    raise ReadError(f"{ref.source}: tensor {ref.name} changed since drift "
                                    "listed it (the file was rewritten); run again")
                if head.fortran:  # rare; rows are scattered, so read the member whole
                    whole = np.lib.format.read_array(fh, allow_pickle=False)
                    part = np.array(whole[start:stop], order="C", copy=True)
                    buf = torch.from_numpy(part.reshape(-1).view(np.uint8))
                else:
                    row = math.prod(ref.shape[1:]) * dtype.itemsize
                    # seeking a deflated member decompresses and discards up to the offset,
                    # in bounded chunks
                    fh.seek(head.offset + start * row)
                    buf = _byte_buffer((stop - start) * row, into)
                    if _fill(fh, buf) < buf.numel():
                        raise ReadError(f"{ref.source}: member {self.member} ends before the "
                                        f"{ref.nbytes} bytes of tensor {ref.name} (truncated?); "
                                        "re-save it with numpy.savez")
        except _ZIP_ERRORS as exc:
            raise ReadError(f"{ref.source}: cannot read tensor {ref.name} "
                            f"({_first_line(exc)})") from exc
        return _typed(buf, dtype, _row_shape(ref, start, stop), not head.dtype.isnative)


def _npz_refs(path: Path) -> tuple[list[TensorRef], list[str]]:
    refs, problems = [], []
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue  # np.savez writes only .npy members
                name = info.filename.removesuffix(".npy")
                try:
                    with zf.open(info) as fh:
                        head = _npy_header(fh)
                except _ZIP_ERRORS as exc:
                    problems.append(f"{path}: member {info.filename} has no readable .npy "
                                    f"header ({_first_line(exc)}); re-save it with numpy.savez")
                    continue
                if head.dtype.hasobject:
                    problems.append(_refuse_objects(f"{path}: member {info.filename}"))
                    continue
                refs.append(_npy_ref(str(path), name, head, _NpzMember(path, info.filename)))
    except _ZIP_ERRORS as exc:
        raise ReadError(f"cannot read {path} as .npz ({_first_line(exc)}); re-save it with "
                        "numpy.savez") from exc
    return refs, problems


# --- paths, folders and selection -----------------------------------------------------------


def _is_index(path: Path) -> bool:
    return path.name.lower().endswith(INDEX_SUFFIX)


def _is_tensor_file(path: Path) -> bool:
    return _is_index(path) or path.name.lower().endswith(TENSOR_SUFFIXES)


_Opener = Callable[[Path], tuple[list[TensorRef], list[str]]]


def _opener(path: Path) -> _Opener:
    name = path.name.lower()
    if name.endswith(".safetensors"):
        return _safetensors_refs
    if name.endswith(".npz"):
        return _npz_refs
    if name.endswith(".npy"):
        return _npy_refs
    return _torch_refs


def _walk(folder: Path) -> list[Path]:
    """Tensor and index files under ``folder``, recursively, sorted by relative path."""
    found = [Path(root) / name
             for root, _dirs, names in os.walk(folder)
             for name in names if _is_tensor_file(Path(name))]
    return sorted(found, key=lambda p: p.relative_to(folder).parts)


def _expand(path: Path) -> list[Path]:
    """The tensor and index files a given path stands for; raises for an unusable path."""
    if path.is_dir():
        files = _walk(path)
        if not files:
            raise ReadError(f"no tensor files {_ACCEPTED} under {path}; point drift at a "
                            "checkpoint, a dump or a folder holding them")
        return files
    if not path.exists():
        raise ReadError(f"{path} does not exist; check the path")
    if not _is_tensor_file(path):
        raise ReadError(f"{path} is not a tensor file: drift reads {_ACCEPTED} files and "
                        "folders holding them")
    return [path]


class _Collector:
    """Opens files once each (by resolved path), gathering tensors and errors."""

    def __init__(self) -> None:
        self.seen: set[Path] = set()
        self.files: list[Path] = []
        self.tensors: list[TensorRef] = []
        self.errors: list[tuple[str, str]] = []

    def first_time(self, path: Path) -> bool:
        key = path.resolve()
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def open(self, path: Path, only: set[str] | None = None) -> list[TensorRef] | None:
        """List ``path``'s tensors (those named in ``only`` when given); None if it fails."""
        if not self.first_time(path):
            return []
        self.files.append(path)
        try:
            refs, problems = _opener(path)(path)
        except ReadError as exc:
            self.errors.append((str(path), str(exc)))
            return None
        self.errors.extend((str(path), p) for p in problems)
        if only is not None:
            refs = [r for r in refs if r.name in only]
        self.tensors.extend(refs)
        return refs

    def open_index(self, index: _Index) -> None:
        if not self.first_time(index.path):
            return
        self.files.append(index.path)
        for shard, names in index.shards.items():
            if not shard.is_file():
                self.errors.append((str(index.path), f"{index.path} lists shard {shard.name}, "
                                    "which does not exist; download the missing shard"))
                continue
            if shard.resolve() in self.seen:
                continue  # already read, as a file given on its own or through another index
            refs = self.open(shard, only=names)
            if refs is None:
                continue  # the shard's own error is recorded
            missing = sorted(names - {r.name for r in refs})
            if missing:
                self.errors.append((str(index.path), f"{index.path} puts {len(missing)} "
                                    f"tensor(s) in {shard.name}, which does not hold them "
                                    f"(first: {missing[0]}); re-download the checkpoint"))


def _plan(files: Iterable[Path], collector: _Collector) -> list[Path | _Index]:
    """Files in order, indexes parsed, and shards named by a readable index left out (they
    are read through the index, at its place)."""
    items: list[Path | _Index] = []
    shards: set[Path] = set()
    for f in files:
        if not _is_index(f):
            items.append(f)
            continue
        try:
            index = _read_index(f)
        except ReadError as exc:
            # its shards are still read as plain files, unless another index names them
            if collector.first_time(f):
                collector.files.append(f)
                collector.errors.append((str(f), str(exc)))
            continue
        items.append(index)
        shards.update(s.resolve() for s in index.shards)
    return [i for i in items if isinstance(i, _Index) or i.resolve() not in shards]


def _selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    return ((not include or any(fnmatch.fnmatchcase(name, g) for g in include))
            and not any(fnmatch.fnmatchcase(name, g) for g in exclude))


def open_inputs(paths: Sequence[str | Path], include: Sequence[str] = (),
                exclude: Sequence[str] = ()) -> Inputs:
    """List the named tensors of ``paths`` (files and folders) without reading their data.

    A tensor is kept when its name matches any ``include`` glob (or there are none) and
    no ``exclude`` glob (``fnmatch.fnmatchcase``). Raises :class:`ReadError` at once for a
    path that does not exist, a folder without tensor files, or a file of another kind;
    a file that exists but cannot be opened goes to :attr:`Inputs.errors` instead.
    """
    if not paths:
        raise ReadError("no inputs given; name checkpoint or dump files, or folders holding "
                        "them")
    expanded = [_expand(Path(p)) for p in paths]  # every path checked before any is read
    collector = _Collector()
    for files in expanded:
        for item in _plan(files, collector):
            if isinstance(item, _Index):
                collector.open_index(item)
            else:
                collector.open(item)
    kept = [r for r in collector.tensors if _selected(r.name, include, exclude)]
    return Inputs(files=tuple(collector.files), tensors=tuple(kept),
                  errors=tuple(collector.errors), excluded=len(collector.tensors) - len(kept))
