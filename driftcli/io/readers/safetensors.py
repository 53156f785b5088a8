"""safetensors files: the header read as strictly as the safetensors library, a sharded
checkpoint's index, and the drift dump metadata.

A file is refused as a whole where its header or byte layout is wrong (every tensor could be
read from the wrong place); one entry's wrong dtype code or shape inside a sound layout, or its
bytes cut off by a truncation, is a problem for that tensor only. ``docs/inputs.md`` lists each
rule.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driftcli.io.dumps import DUMP_KEY, DUMP_VERSION, FIELDS, ROLES
from driftcli.io.readers.core import (
    ByteRange,
    FileKind,
    Listing,
    Problem,
    ReadError,
    TensorRef,
    first_line,
    is_count,
    open_regular,
    torch_dtype,
    truncated,
)
from driftcli.io.readers.torchao import torchao_parts

INDEX_SUFFIX = ".safetensors.index.json"
"""The ending of a sharded safetensors checkpoint's index."""

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


def _corrupt(path: Path, detail: str) -> ReadError:
    return ReadError(f"corrupt safetensors header in {path}: {detail}; re-save or re-download it")


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
        raise _corrupt(path, f"the header is not JSON ({first_line(exc)})") from exc
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
        with open_regular(path) as fh:
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


def header_metadata(path: Path) -> dict[str, Any] | None:
    """A safetensors file's ``__metadata__`` (None where it has none), its header read as
    strictly as :func:`safetensors_refs` reads it; raises :class:`ReadError` for a file that
    is not one."""
    meta = _safetensors_header(path).entries.get("__metadata__")
    return meta if isinstance(meta, dict) else None


def _data_offsets(path: Path, name: str, entry: Any) -> tuple[int, int]:
    """An entry's ``data_offsets``; raises for an entry without two byte counts (where its
    bytes are, and so where every other tensor's are, is unknown)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))):
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
    dtype = None if name is None else torch_dtype(name)
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
    if not (isinstance(shape, list) and all(map(is_count, shape))):
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
        return {}, [f"drift dump metadata in {path} is not JSON ({first_line(exc)}){without}"]
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
               or not (e.get("step") is None or is_count(e.get("step"))))
        if bad:
            return {}, [f"drift dump metadata in {path}: tensor {name!r} needs role in "
                        f"{'/'.join(ROLES)}, string layer and operand and an int or null "
                        f"step, not {json.dumps(e)}{without}"]
        fields[name] = {k: e.get(k) for k in FIELDS}
    problems = []
    absent = sorted(set(fields) - names)
    if absent:
        problems.append(f"drift dump metadata in {path} describes {len(absent)} tensor(s) the "
                        f"file does not hold (first: {absent[0]})")
    return fields, problems


def safetensors_refs(path: Path) -> Listing:
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
    problems = [Problem(note) for note in notes]
    # torchao's flattened subclasses: their parts are codes and scale bytes, never weights
    parts, refused = torchao_parts(path, meta, set(header))
    problems += refused
    refs = []
    for name, (begin, end) in ordered:
        if name in parts:
            continue
        why = _entry_problem(header[name], end - begin)
        if why is not None:
            problems.append(Problem(f"{path}: tensor {name!r} {why}; the file is corrupt, "
                                     "re-save or re-download it", name))
            continue
        if data_start + end > head.size:  # truncated: listed, its bytes would not be there
            problems.append(Problem(truncated(str(path), name, data_start + begin,
                                                data_start + end, head.size), name))
            continue
        code = header[name]["dtype"]
        reader = ByteRange(path, data_start + begin, end - begin, swap=sys.byteorder == "big")
        refs.append(TensorRef(str(path), name, _SAFETENSORS_DTYPES.get(code, code),
                              tuple(header[name]["shape"]), **fields.get(name, {}),
                              _reader=reader, _nbytes=end - begin))
    return refs, problems


@dataclass(frozen=True)
class Index:
    """A sharded checkpoint's index: which shard holds which tensor."""

    path: Path
    shards: dict[Path, set[str]]
    """Shard path (as found) -> the tensor names the index puts there, in sorted shard order."""


def is_index(path: Path) -> bool:
    """Whether ``path`` is named as a sharded checkpoint's index."""
    return path.name.lower().endswith(INDEX_SUFFIX)


def read_index(path: Path) -> Index:
    """The index at ``path``, parsed; raises :class:`ReadError` for one that is not an index."""
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
    spelled: dict[Path, Path] = {}  # resolved shard -> the first spelling of it
    for name, shard in wmap.items():
        rel = os.path.normpath(shard)
        if os.path.isabs(rel) or rel == os.pardir or rel.startswith(os.pardir + os.sep):
            raise ReadError(f"corrupt safetensors index {path}: it puts tensor {name!r} in "
                            f"{shard!r}, outside the index's folder; drift reads shards beside "
                            "their index only (re-download it, or give the shard files "
                            "themselves)")
        found = path.parent / rel
        # one file under two spellings (a/../b, a link) is one shard: read once, every name
        first = spelled.setdefault(found.resolve(), found)
        shards.setdefault(first, set()).add(name)
    return Index(path, dict(sorted(shards.items())))


SAFETENSORS = FileKind("safetensors", (".safetensors",), safetensors_refs)
"""safetensors files, drift dumps among them (a sharded checkpoint's index is read by the
collector, which reads each shard through it)."""
