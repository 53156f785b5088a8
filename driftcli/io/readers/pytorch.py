"""PyTorch ``.pt`` / ``.pth`` / ``.bin`` files: state dicts loaded with ``weights_only`` only.

A file that needs arbitrary unpickling (a pickled class) is refused: unpickling can run any
code the file's author chose. Nested containers are flattened to dotted names; the last file
loaded stays memory-mapped between reads, so each file is loaded once.
"""

from __future__ import annotations

import os
import pickle
import re
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from driftcli.io.readers.core import (
    ZIP_ERRORS,
    FileKind,
    Listing,
    Problem,
    Reader,
    ReadError,
    TensorRef,
    first_line,
    open_regular,
    storage_problem,
)

_REFUSED_PICKLE = ("needs arbitrary unpickling{what}, which drift refuses (it can run code); "
                   "re-save it as a state dict of tensors (torch.save(model.state_dict(), ...)) "
                   "or as safetensors")


@dataclass
class _Flat:
    """A state dict's tensors under dotted names, and the names two tensors flatten to."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)
    """Each name's keys in the file, as a subscript (``['a']['b']``), for messages."""
    clashes: dict[str, list[str]] = field(default_factory=dict)
    """Name -> the keys of every tensor that flattens to it (two or more)."""


MAX_DEPTH = 100
"""Containers a state dict may nest (a model's are a few deep): past it the file is refused
with one line, never a ``RecursionError`` that loses the run."""


class _TooDeep(Exception):
    """A state dict nested deeper than :data:`MAX_DEPTH`."""


def _flatten(obj: Any, prefix: str, keys: str, out: _Flat, depth: int = 0) -> None:
    """Tensors of nested dicts / lists / tuples under dotted names; other leaves are skipped.
    ``{"a.b": t1, "a": {"b": t2}}`` gives two tensors one name: neither can be told apart
    from the other, so the name goes to ``clashes`` (never one silently dropped)."""
    if depth > MAX_DEPTH:
        raise _TooDeep
    if isinstance(obj, torch.Tensor):
        if prefix in out.clashes:
            out.clashes[prefix].append(keys)
        elif prefix in out.tensors:
            out.clashes[prefix] = [out.where.pop(prefix), keys]
            del out.tensors[prefix]
        else:
            out.tensors[prefix], out.where[prefix] = obj, keys
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), f"{keys}[{k!r}]", out,
                     depth + 1)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), f"{keys}[{i}]", out, depth + 1)
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
        self._flat = _Flat()

    def load(self, path: Path) -> _Flat:
        try:
            stat = path.stat()
        except OSError as exc:
            raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        with self._lock:
            if key != self._key:
                self._key, self._flat = None, _Flat()  # drop the old mapping before the new one
                self._flat = _load_torch(path)
                self._key = key
            return self._flat


def _torch_zip(path: Path) -> bool:
    """Whether ``path`` is a torch file of the zip format (torch >= 1.6), as torch tells
    (by its first bytes); raises where that archive is truncated or damaged, so torch is
    never handed one: its directory must read, and each member must lie inside the file."""
    try:
        with open_regular(path) as fh:
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
    except ZIP_ERRORS as exc:
        raise ReadError(f"{path} is a truncated or damaged zip archive ({first_line(exc)}); "
                        "re-save it with torch.save or re-download it") from exc
    return True


_MAX_SCANNED_PICKLE = 64 << 20
"""A zip member ``data.pkl`` larger than this is not scanned for torchao's classes (a state
dict's pickle is kilobytes to a few megabytes; torch.load still refuses what it must)."""


def _torchao_global(path: Path) -> str | None:
    """The first torchao class the file's pickle names (``module.Class``), read from its
    opcodes without running any (``pickletools.genops`` only parses). torch's weights-only
    loader accepts torchao's tensor classes once torchao is imported in the process (it adds
    them to torch's safe globals), so the refusal cannot wait for torch to raise: a user's
    notebook with torchao imported would otherwise build torchao's objects from the file."""
    import pickletools

    try:
        with zipfile.ZipFile(path) as zf:
            member = next((i for i in zf.infolist() if i.filename.endswith("/data.pkl")
                           or i.filename == "data.pkl"), None)
            if member is None or member.file_size > _MAX_SCANNED_PICKLE:
                return None
            data = zf.read(member)
    except (OSError, *ZIP_ERRORS):
        return None
    strings: list[str] = []
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name == "GLOBAL" and isinstance(arg, str):
                module, _, name = arg.partition(" ")
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                module, name = strings[-2], strings[-1]
            else:
                if isinstance(arg, str):
                    strings.append(arg)
                continue
            if module == "torchao" or module.startswith("torchao."):
                return f"{module}.{name}"
    except (ValueError, EOFError):  # a damaged pickle: torch.load says so
        return None
    return None


def _torchao_refusal(path: Path, what: str) -> str:
    # a state dict of torchao tensors is what torch.save(model.state_dict()) wrote: that
    # advice would send the user round in a circle
    return (f"{path} needs arbitrary unpickling{what}, which drift refuses (it can run code): "
            "its weights are torchao quantized tensors; save them dequantized ({k: "
            "v.dequantize() for each torchao tensor}) with torch.save or safetensors save_file")


def _load_torch(path: Path) -> _Flat:
    # mmap needs the zip format; older files are loaded whole
    mmap = _torch_zip(path)
    if mmap and (held := _torchao_global(path)) is not None:
        raise ReadError(_torchao_refusal(path, f" (it holds {held})"))
    try:
        obj = torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        # torch wraps every weights-only failure alike; only a reference to a class or
        # function means the file needs code run, the rest (bad opcodes) is a damaged file
        if not _NEEDS_CODE.search(text):
            detail = _WEIGHTS_ONLY_DETAIL.search(text)
            why = detail.group(1).strip() if detail else first_line(exc)
            raise ReadError(f"cannot read {path} as a PyTorch file ({why}); re-save it with "
                            "torch.save or as safetensors") from exc
        found = re.search(r"GLOBAL (\S+)", text)
        what = f" (it holds {found.group(1)})" if found else ""
        if found and found.group(1).startswith("torchao"):
            raise ReadError(_torchao_refusal(path, what)) from exc
        raise ReadError(f"{path} " + _REFUSED_PICKLE.format(what=what)) from exc
    except RecursionError:
        raise ReadError(_too_deep(path)) from None
    except _LOAD_ERRORS as exc:
        raise ReadError(f"cannot read {path} as a PyTorch file ({first_line(exc)}); "
                        "re-save it with torch.save or as safetensors") from exc
    return flatten(obj, path.stem, path)


def flatten(obj: Any, bare: str, where: Path | str | None = None) -> _Flat:
    """The tensors of a state dict (nested dicts, lists and tuples) under dotted names; a bare
    tensor is named ``bare`` (a file's stem, like an ``.npy`` file's). Nesting past
    :data:`MAX_DEPTH` is a :class:`ReadError` naming ``where`` (default ``bare``)."""
    out = _Flat()
    try:
        _flatten(obj, "", "", out)
    except (_TooDeep, RecursionError):
        raise ReadError(_too_deep(where if where is not None else bare)) from None
    if "" in out.tensors:  # the file holds one bare tensor: name it like an .npy file
        out.tensors[bare] = out.tensors.pop("")
    return out


def _too_deep(path: Path | str) -> str:
    return (f"{path} nests containers more than {MAX_DEPTH} deep, which no state dict does; "
            "drift refuses it (re-save the tensors as a flat state dict or as safetensors)")


_TORCH_FILES = _TorchCache()


@dataclass(frozen=True)
class _TorchEntry:
    """A tensor of a ``.pt`` state dict, found again by name in the (cached) loaded file."""

    path: Path
    key: str

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        t = _TORCH_FILES.load(self.path).tensors.get(self.key)
        if t is None or str(t.dtype).removeprefix("torch.") != ref.dtype or (
                tuple(t.shape) != ref.shape):
            raise ReadError(f"{ref.source}: tensor {ref.name} changed since drift listed it "
                            "(the file was rewritten); run again")
        # contiguous copy of just these rows: it owns its memory and keeps no mapping
        return rows(t, ref, start, stop, copy=True)


def rows(t: torch.Tensor, ref: TensorRef, start: int, stop: int, copy: bool) -> torch.Tensor:
    """Rows ``[start, stop)`` of a loaded tensor (all of a 0-d one), contiguous: a copy, or
    without ``copy`` a view where ``t`` is contiguous. Raises :class:`ReadError` for a layout
    that cannot be sliced (sparse, quantized)."""
    try:
        part = t[start:stop] if ref.shape else t
        return part.clone(memory_format=torch.contiguous_format) if copy else \
            part.contiguous()
    except RuntimeError as exc:
        raise ReadError(f"{ref.source}: cannot read tensor {ref.name} "
                        f"({first_line(exc)})") from exc


SHARED_MOST = 4
"""How many times over a file's tensors may cover one storage: tied weights are one storage
under two names, and a flat buffer's views cover it once; 100,000 names for one large
storage would be its bytes measured 100,000 times."""


def _shared_problem(t: torch.Tensor, covered: dict[tuple[int, int], int]) -> str | None:
    """Why one more view of a storage the file's earlier tensors already cover
    :data:`SHARED_MOST` times over is refused; else None, and its bytes are counted."""
    if t.layout is not torch.strided or t.numel() == 0:
        return None
    try:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
    except RuntimeError:
        return None
    total = covered.get(key, 0) + t.numel() * t.element_size()
    if total > SHARED_MOST * key[1]:
        return (f"is one more view of a storage of {key[1]:,} bytes that the file's tensors "
                f"before it already cover {covered.get(key, 0) / key[1]:.3g} times: drift "
                f"measures a storage at most {SHARED_MOST} times over, so its work stays "
                "bounded by the file's bytes; save a copy of it (t.clone())")
    covered[key] = total
    return None


def torch_refs(path: Path) -> Listing:
    """The tensors of a state dict, loaded once (a file that cannot be loaded raises); a
    view larger than its storage, one more view of a storage covered :data:`SHARED_MOST`
    times already, and two tensors whose dotted names are the same, are problems naming
    them."""
    return listing(str(path), _TORCH_FILES.load(path), lambda name: _TorchEntry(path, name))


def _no_rows(t: torch.Tensor) -> str | None:
    """Why a tensor has no rows drift can read (no data, or no strided layout), with what to
    give instead; None for a plain tensor. A state dict in memory can hold any of these, and
    reading one failed with torch's own many-line message or crashed."""
    if t.is_nested:
        return "is a nested tensor; give its parts (t.unbind()) as tensors of their own"
    if t.is_meta:
        return ("is on the meta device: it has no data (a model built on meta and never "
                "loaded); load its weights first")
    if t.layout is not torch.strided and not t.is_quantized:
        return f"is stored as {str(t.layout).removeprefix('torch.')}; give t.to_dense()"
    return None


def listing(source: str, flat: _Flat, reader: Callable[[str], Reader]) -> Listing:
    """The tensors of a flattened state dict held by ``source`` (a file, or a state dict in
    memory), each read through ``reader(name)``, and the problems :func:`torch_refs` names."""
    refs, problems = [], []
    covered: dict[tuple[int, int], int] = {}
    for name, t in flat.tensors.items():
        why = _no_rows(t) or storage_problem(t) or _shared_problem(t, covered)
        if why is not None:
            problems.append(Problem(f"{source}: tensor {name} {why}", name))
            continue
        refs.append(TensorRef(source, name, str(t.dtype).removeprefix("torch."),
                              tuple(t.shape), _reader=reader(name)))
    for name, keys in flat.clashes.items():
        problems.append(Problem(
            f"{source}: tensors {' and '.join(keys)} both flatten to the name {name}, so drift "
            "cannot tell them apart and measures neither; rename one (nested keys are joined "
            "with '.')", name))
    return refs, problems


PYTORCH = FileKind("pytorch", (".pt", ".pth", ".bin"), torch_refs)
"""PyTorch files as ``torch.save`` writes them (and older, non-zip ones)."""
