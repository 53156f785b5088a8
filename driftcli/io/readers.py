"""Named tensors from checkpoints and dumps, read one tensor (or a few rows) at a time.

:func:`open_inputs` lists what a set of paths holds without reading tensor data:
safetensors files (single, or sharded through ``*.safetensors.index.json``),
PyTorch ``.pt`` / ``.pth`` / ``.bin`` state dicts (``weights_only`` only), NumPy
``.npz`` / ``.npy``, and folders of any of these. Each listed tensor is a
:class:`TensorRef` whose :meth:`TensorRef.read` copies rows ``[start, stop)`` of
dim 0 into a fresh tensor, so memory stays bounded by the rows asked for.

Every header is checked before anything is read from it (safetensors as strictly as the
safetensors library; ``.npy`` / ``.npz`` shapes against the bytes really there), so no
buffer is ever sized from an unverified shape. Failures are kept as local as the file's
layout allows: a missing path raises at once; a file that cannot be opened, or whose
layout is in doubt (a corrupt header, offsets that overlap or leave gaps, a refused
pickle), becomes one entry of :attr:`Inputs.errors` and the other files are still listed;
one entry that is wrong inside a sound layout (an unknown dtype code, a shape that does not
match its bytes) is an entry naming that tensor, and its neighbours are listed. A file that
shrinks after it was listed makes ``read`` raise :class:`ReadError`. The formats, these
rules and the drift dump metadata are described in ``docs/inputs.md``.
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
import tokenize
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol

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
# Bits per element of the codes torch has no element type for; with the table above, these
# are every code safetensors defines (its crate's Dtype::bitsize).
_SAFETENSORS_SUB_BYTE = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}

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
        file truncated since it was listed: the listing checked it then).

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


class InputError(NamedTuple):
    """A file, or one tensor of it, that cannot be read."""

    source: str
    message: str
    """One line naming what is wrong (and the tensor, where it is one)."""
    tensor: str | None = None
    """The tensor it is about; None when it is the whole file."""


@dataclass(frozen=True)
class Inputs:
    """What :func:`open_inputs` found under its paths."""

    files: tuple[Path, ...]
    """Every tensor or index file opened, including those listed in ``errors``."""
    tensors: tuple[TensorRef, ...]
    """Selected tensors, float and non-float, in path order, then file order."""
    errors: tuple[InputError, ...]
    """Each file, or tensor of one, that could not be read."""
    excluded: int
    """Tensors dropped by ``include`` / ``exclude`` (readable or not)."""


@dataclass(frozen=True)
class _Problem:
    """Something in one file that cannot be read: the file's metadata, or one tensor."""

    message: str
    tensor: str | None = None
    """The tensor it is about: reported only where that tensor is selected (by include /
    exclude, and by an index for its shard), like the tensor itself."""


# --- reading bytes --------------------------------------------------------------------------


def _element_type(ref: TensorRef) -> torch.dtype:
    dtype = _torch_dtype(ref.dtype)
    if dtype is None:
        raise ReadError(f"{ref.source}: tensor {ref.name} is stored as {ref.dtype}, which torch "
                        "has no element type for; drift cannot read it")
    return dtype


def _row_shape(ref: TensorRef, start: int, stop: int) -> tuple[int, ...]:
    return (stop - start, *ref.shape[1:]) if ref.shape else ()


def _truncated(source: str, name: str, begin: int, end: int, size: int) -> str:
    return (f"{source}: tensor {name} needs bytes {begin}..{end} but the file has {size} bytes "
            "(truncated?); re-save or re-download it")


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
        # the listing checked ``length`` against the shape and the file; here the file is
        # checked again (it may have shrunk since), before any buffer is made
        dtype = _element_type(ref)
        row = math.prod(ref.shape[1:]) * dtype.itemsize
        end = self.offset + self.length
        try:
            # positioned reads, not mmap: a file truncated under a mapping kills the process
            # with SIGBUS, and no mapping outlives the call
            with open(self.path, "rb", buffering=0) as fh:
                size = os.fstat(fh.fileno()).st_size
                if end > size:
                    raise ReadError(_truncated(ref.source, ref.name, self.offset, end, size))
                buf = _byte_buffer((stop - start) * row, into)
                fh.seek(self.offset + start * row)
                got = _fill(fh, buf)
        except OSError as exc:
            raise ReadError(f"{ref.source}: cannot read tensor {ref.name}: "
                            f"{exc.strerror or exc}") from exc
        if got < buf.numel():  # the file shrank after the size check
            raise ReadError(_truncated(ref.source, ref.name, self.offset, end, size))
        return _typed(buf, dtype, _row_shape(ref, start, stop), self.swap)


# --- safetensors ----------------------------------------------------------------------------


def _corrupt(path: Path, detail: str) -> ReadError:
    return ReadError(f"corrupt safetensors header in {path}: {detail}; re-save or re-download it")


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _shown(x: Any) -> str:
    """A JSON value for a one-line message, cut short (a corrupt header can hold anything)."""
    text = json.dumps(x)
    return text if len(text) <= 80 else text[:77] + "..."


# The safetensors crate reads its header with serde_json into typed fields. Python's json
# module accepts more; these hooks refuse what serde refuses, so both read a file alike.
_FIELDS = ("__metadata__", "dtype", "shape", "data_offsets")
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):  # a repeated tensor name is allowed (the last one counts)
        keys = [k for k, _ in pairs]
        twice = [k for k in _FIELDS if keys.count(k) > 1]
        if twice:
            raise ValueError(f"key {twice[0]!r} appears twice in one object")
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    x = float(text)
    if math.isinf(x):
        raise ValueError(f"number {text} is out of range")
    return x


def _integer(text: str) -> int | float:
    # serde reads -0 as a float, which is refused where a count is due
    return -0.0 if text == "-0" else int(text)


def _header_json(path: Path, raw: bytes) -> dict[str, Any]:
    """The header bytes as safetensors reads them: UTF-8 (never another encoding guessed
    from the bytes), strict JSON (no NaN, no number out of range, no field named twice, no
    half surrogate pair), one object; spaces before and after it are padding."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _corrupt(path, f"the header is not UTF-8 (byte {exc.start} of it: "
                             f"{exc.reason})") from exc
    try:
        header = json.loads(text, object_pairs_hook=_json_object, parse_constant=_no_constant,
                            parse_float=_finite, parse_int=_integer)
        if _SURROGATE.search(text):  # rare: only then is the (costlier) check made
            json.dumps(header, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:  # a ValueError too, so caught first
        raise _corrupt(path, "a string of the header holds half of a UTF-16 surrogate "
                             "pair") from exc
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise _corrupt(path, f"the header is not JSON ({_first_line(exc)})") from exc
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    return header


@dataclass(frozen=True)
class _SafetensorsHeader:
    """A safetensors file's header as read, before any of its entries is checked."""

    entries: dict[str, Any]
    """The header's JSON object."""
    data_start: int
    """Where the data starts in the file."""
    size: int
    """The file's size."""
    padding: int
    """Whitespace bytes that end the header: up to as many data bytes would look the same
    there, had the header length been that much too long."""


def _safetensors_header(path: Path) -> _SafetensorsHeader:
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
    padding = len(raw) - len(raw.rstrip(b" \t\n\r"))  # JSON's whitespace
    return _SafetensorsHeader(_header_json(path, raw), 8 + n, size, padding)


def _data_offsets(path: Path, name: str, entry: Any) -> tuple[int, int]:
    """An entry's ``data_offsets``; raises for an entry without two byte counts (where its
    bytes are, and so where every other tensor's are, is unknown)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise _corrupt(path, f"entry {name!r} needs dtype, shape and data_offsets "
                             f"[begin, end], not {_shown(entry)}")
    return offsets[0], offsets[1]


def _check_layout(path: Path, ordered: list[tuple[str, tuple[int, int]]],
                  head: _SafetensorsHeader) -> None:
    """Raise unless the byte ranges (in offset order) tile the data as the format requires:
    the first at 0, each where the one before ends, the last at the end of the file.

    A file only shorter than that reads as truncated, and is refused only where a header
    length too long would look the same (the shortfall no more than the whitespace that
    ends the header, which would then be data). Anything else puts every tensor in doubt:
    a header length off, an overlap, a gap shift or cut every tensor after it."""
    data_bytes = head.size - head.data_start
    at, before = 0, None
    for name, (begin, end) in ordered:
        if end < begin:
            raise _corrupt(path, f"tensor {name!r} has data_offsets [{begin}, {end}], which "
                                 "end before they begin")
        if begin > at:
            raise _corrupt(path, f"bytes {at}..{begin} of the data belong to no tensor (a "
                                 f"gap before tensor {name!r})")
        if begin < at:
            raise _corrupt(path, f"tensor {name!r} (data_offsets [{begin}, {end}]) overlaps "
                                 f"tensor {before!r}, which ends at {at}")
        at, before = end, name
    if data_bytes < at <= data_bytes + head.padding:
        raise _corrupt(path, f"the tensors need {at} bytes of data but the file holds "
                             f"{data_bytes} after a header that ends in {head.padding} spaces "
                             "(truncated, or a header length too long)")
    if at < data_bytes:
        raise _corrupt(path, f"the file holds {data_bytes} bytes of data after the header but "
                             f"the tensors' data_offsets cover {at} (a wrong header length, or "
                             "bytes appended)")


def _safetensors_bits(code: Any) -> int | None:
    """Bits per element of a safetensors dtype code; None for a code it does not define."""
    if not isinstance(code, str):
        return None
    if code in _SAFETENSORS_SUB_BYTE:
        return _SAFETENSORS_SUB_BYTE[code]
    name = _SAFETENSORS_DTYPES.get(code)
    dtype = None if name is None else _torch_dtype(name)
    return None if dtype is None else 8 * dtype.itemsize


def _elements(shape: list[int], most: int) -> int | None:
    """``prod(shape)``, or None once it passes ``most``: a corrupt shape never becomes a
    huge product (nor a slow one, over millions of entries)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > most:
            return None
    return n


def _entry_problem(entry: dict[str, Any], span: int) -> str | None:
    """What is wrong with one entry whose byte range is sound: its dtype code or its shape
    (which must need exactly the ``span`` bytes it has); None when nothing is."""
    code, shape = entry.get("dtype"), entry.get("shape")
    bits = _safetensors_bits(code)
    if bits is None:
        return f"has dtype code {_shown(code)}, which safetensors does not define"
    if not (isinstance(shape, list) and all(map(_is_count, shape))):
        return f"has shape {_shown(shape)}, not a list of non-negative integers"
    n = _elements(shape, 8 * span)
    need = None if n is None else n * bits
    if need is not None and need % 8:
        return f"has shape {_shown(shape)} of {code}, which is not a whole number of bytes"
    if need != 8 * span:
        needs = f"more than {span}" if need is None else str(need // 8)
        return f"has {span} data bytes but shape {_shown(shape)} of {code} needs {needs}"
    return None


def _dump_fields(path: Path, meta: dict[str, str] | None,
                 names: set[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per-tensor role/layer/operand/step of a drift dump, and problems with its metadata."""
    if not meta or DUMP_KEY not in meta:
        return {}, []
    without = "; its tensors are listed without role, layer, operand and step"
    try:
        dump = json.loads(meta[DUMP_KEY])
    except (TypeError, ValueError, RecursionError) as exc:
        return {}, [f"drift dump metadata in {path} is not JSON ({_first_line(exc)}){without}"]
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


def _safetensors_refs(path: Path) -> tuple[list[TensorRef], list[_Problem]]:
    """The tensors of a safetensors file in data order, and problems with its entries and
    metadata. The file as a whole is refused (raises) where its header or byte layout is
    wrong; one entry's wrong dtype code or shape inside a sound layout, or its bytes cut
    off by a truncation, is a problem for that tensor only."""
    head = _safetensors_header(path)
    header, data_start = head.entries, head.data_start
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise _corrupt(path, "__metadata__ is not an object of strings")
    spans = {name: _data_offsets(path, name, e) for name, e in header.items()}
    ordered = sorted(spans.items(), key=lambda kv: (kv[1], kv[0]))
    _check_layout(path, ordered, head)
    fields, notes = _dump_fields(path, meta, set(header))
    problems = [_Problem(note) for note in notes]
    refs = []
    for name, (begin, end) in ordered:
        why = _entry_problem(header[name], end - begin)
        if why is not None:
            problems.append(_Problem(f"{path}: tensor {name!r} {why}; the file is corrupt, "
                                     "re-save or re-download it", name))
            continue
        if data_start + end > head.size:  # truncated: listed, its bytes would not be there
            problems.append(_Problem(_truncated(str(path), name, data_start + begin,
                                                data_start + end, head.size), name))
            continue
        code = header[name]["dtype"]
        reader = _ByteRange(path, data_start + begin, end - begin, swap=sys.byteorder == "big")
        refs.append(TensorRef(str(path), name, _SAFETENSORS_DTYPES.get(code, code),
                              tuple(header[name]["shape"]), **fields.get(name, {}),
                              _reader=reader, _nbytes=end - begin))
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
    except (ValueError, RecursionError) as exc:
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


def _torch_zip(path: Path) -> bool:
    """Whether ``path`` is a torch file of the zip format (torch >= 1.6), as torch tells
    (by its first bytes); raises where that archive is truncated or damaged, so torch is
    never handed one: its directory must read, and each member must lie inside the file."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != b"PK\x03\x04":
                return False
            size = os.fstat(fh.fileno()).st_size
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.header_offset + info.compress_size > size:
                    raise zipfile.BadZipFile(f"member {info.filename} runs past the end of "
                                             f"the file ({size} bytes)")
    except OSError as exc:
        raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except _ZIP_ERRORS as exc:
        raise ReadError(f"{path} is a truncated or damaged zip archive ({_first_line(exc)}); "
                        "re-save it with torch.save or re-download it") from exc
    return True


def _load_torch(path: Path) -> dict[str, torch.Tensor]:
    # mmap needs the zip format; older files are loaded whole
    mmap = _torch_zip(path)
    try:
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


def _torch_refs(path: Path) -> tuple[list[TensorRef], list[_Problem]]:
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
    try:
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(fh)
        else:
            raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported")
    except (SyntaxError, tokenize.TokenError, RecursionError) as exc:
        # numpy parses the header as a Python literal and lets these through
        raise ValueError(f"the header does not parse ({_first_line(exc)})") from exc
    if not all(map(_is_count, shape)):  # numpy checks only that they are ints
        raise ValueError(f"shape {shape} is not a tuple of non-negative integers")
    return _NpyHeader(dtype, tuple(shape), fortran, fh.tell())


def _npy_nbytes(head: _NpyHeader) -> int:
    return math.prod(head.shape) * head.dtype.itemsize


def _numpy_dtype_name(dtype: np.dtype[Any]) -> str:
    return _NUMPY_DTYPES.get((dtype.kind, dtype.itemsize), dtype.name)


def _npy_ref(source: str, name: str, head: _NpyHeader, reader: _Reader) -> TensorRef:
    return TensorRef(source, name, _numpy_dtype_name(head.dtype), head.shape, _reader=reader,
                     _nbytes=_npy_nbytes(head))


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


def _npy_refs(path: Path) -> tuple[list[TensorRef], list[_Problem]]:
    try:
        with open(path, "rb") as fh:
            head = _npy_header(fh)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        # numpy's messages can run over lines
        raise ReadError(f"corrupt .npy header in {path} ({' '.join(str(exc).split())}); "
                        "re-save it with numpy.save") from exc
    if head.dtype.hasobject:
        raise ReadError(_refuse_objects(str(path)))
    nbytes = _npy_nbytes(head)
    if head.offset + nbytes > size:  # numpy, too, accepts bytes after the data
        return [], [_Problem(_truncated(str(path), path.stem, head.offset,
                                        head.offset + nbytes, size), path.stem)]
    reader: _Reader = (_NpyFortran(path) if head.fortran
                       else _ByteRange(path, head.offset, nbytes, not head.dtype.isnative))
    return [_npy_ref(str(path), path.stem, head, reader)], []


# zipfile raises RuntimeError for an encrypted member, and its NotImplementedError for a
# method or zip version it lacks
_ZIP_ERRORS = (OSError, EOFError, ValueError, RuntimeError, zipfile.BadZipFile, zlib.error)


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


# deflate's largest expansion: one 258-byte match per two bits at best
_DEFLATE_MOST = 1032


def _member_problem(info: zipfile.ZipInfo, archive: int) -> str | None:
    """What makes an archive member's sizes impossible, before any of it is read: the sizes
    bound what reading it can produce, so they bound every buffer made for it."""
    if info.header_offset + info.compress_size > archive:
        return f"runs past the end of the archive ({archive} bytes; truncated?)"
    if info.compress_type == zipfile.ZIP_STORED:
        if info.file_size != info.compress_size:
            return (f"is stored uncompressed, yet claims {info.file_size} bytes in "
                    f"{info.compress_size}")
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        if info.file_size > _DEFLATE_MOST * info.compress_size:
            return (f"claims {info.file_size} bytes, more than its {info.compress_size} "
                    "deflated bytes can hold")
    else:
        return (f"is compressed with zip method {info.compress_type}; numpy.savez writes "
                "stored or deflated members")
    return None


def _npz_member(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo,
                archive: int) -> TensorRef | _Problem:
    """One member of an ``.npz`` archive, listed, or what is wrong with it."""
    name = info.filename.removesuffix(".npy")

    def problem(what: str) -> _Problem:
        return _Problem(f"{path}: member {info.filename} {what}; re-save it with numpy.savez",
                        name)

    if not info.filename.endswith(".npy"):
        # np.savez writes nothing else; a name damaged in the directory looks like this too
        return problem("is not an .npy array")
    sizes = _member_problem(info, archive)
    if sizes is not None:
        return problem(sizes)
    try:
        with zf.open(info) as fh:
            head = _npy_header(fh)
    except _ZIP_ERRORS as exc:
        return problem(f"has no readable .npy header ({_first_line(exc)})")
    if head.dtype.hasobject:
        return _Problem(_refuse_objects(f"{path}: member {info.filename}"), name)
    need = head.offset + _npy_nbytes(head)
    if need > info.file_size:
        return problem(f"holds {info.file_size} bytes, but its header's shape "
                       f"{list(head.shape)} needs {need}")
    return _npy_ref(str(path), name, head, _NpzMember(path, info.filename))


def _npz_refs(path: Path) -> tuple[list[TensorRef], list[_Problem]]:
    refs, problems = [], []
    try:
        archive = path.stat().st_size
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                # members are found through the archive's directory, each on its own: one
                # damaged member leaves the others in no doubt
                got = _npz_member(path, zf, info, archive)
                if isinstance(got, TensorRef):
                    refs.append(got)
                else:
                    problems.append(got)
    except _ZIP_ERRORS as exc:
        raise ReadError(f"cannot read {path} as .npz ({_first_line(exc)}); re-save it with "
                        "numpy.savez") from exc
    return refs, problems


# --- paths, folders and selection -----------------------------------------------------------


def _is_index(path: Path) -> bool:
    return path.name.lower().endswith(INDEX_SUFFIX)


def _is_tensor_file(path: Path) -> bool:
    return _is_index(path) or path.name.lower().endswith(TENSOR_SUFFIXES)


_Opener = Callable[[Path], tuple[list[TensorRef], list[_Problem]]]


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
        self.errors: list[tuple[str, _Problem]] = []

    def fail(self, source: Path, message: str) -> None:
        self.errors.append((str(source), _Problem(message)))

    def first_time(self, path: Path) -> bool:
        key = path.resolve()
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def open(self, path: Path, only: set[str] | None = None) -> set[str] | None:
        """List ``path``'s tensors (those named in ``only`` when given); the names it holds,
        readable or not, or None if it fails as a whole."""
        if not self.first_time(path):
            return set()
        self.files.append(path)
        try:
            refs, problems = _opener(path)(path)
        except ReadError as exc:
            self.fail(path, str(exc))
            return None
        if only is not None:
            refs = [r for r in refs if r.name in only]
            problems = [p for p in problems if p.tensor is None or p.tensor in only]
        self.errors.extend((str(path), p) for p in problems)
        self.tensors.extend(refs)
        return {r.name for r in refs} | {p.tensor for p in problems if p.tensor is not None}

    def open_index(self, index: _Index) -> None:
        if not self.first_time(index.path):
            return
        self.files.append(index.path)
        for shard, names in index.shards.items():
            if not shard.is_file():
                self.fail(index.path, f"{index.path} lists shard {shard.name}, which does not "
                                      "exist; download the missing shard")
                continue
            if shard.resolve() in self.seen:
                continue  # already read, as a file given on its own or through another index
            held = self.open(shard, only=names)
            if held is None:
                continue  # the shard's own error is recorded
            missing = sorted(names - held)
            if missing:
                self.fail(index.path, f"{index.path} puts {len(missing)} tensor(s) in "
                                      f"{shard.name}, which does not hold them (first: "
                                      f"{missing[0]}); re-download the checkpoint")


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
                collector.fail(f, str(exc))
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
    # a problem with one tensor goes where the tensor would: into the errors, or excluded
    shown = [(source, p) for source, p in collector.errors
             if p.tensor is None or _selected(p.tensor, include, exclude)]
    dropped = len(collector.errors) - len(shown)
    return Inputs(files=tuple(collector.files), tensors=tuple(kept),
                  errors=tuple(InputError(source, p.message, p.tensor) for source, p in shown),
                  excluded=len(collector.tensors) - len(kept) + dropped)
