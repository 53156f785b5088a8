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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from driftcli.io.readers.core import ZIP_ERRORS, FileKind, Listing, ReadError, TensorRef, first_line

_REFUSED_PICKLE = ("needs arbitrary unpickling{what}, which drift refuses (it can run code); "
                   "re-save it as a state dict of tensors (torch.save(model.state_dict(), ...)) "
                   "or as safetensors")


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
    except ZIP_ERRORS as exc:
        raise ReadError(f"{path} is a truncated or damaged zip archive ({first_line(exc)}); "
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
            why = detail.group(1).strip() if detail else first_line(exc)
            raise ReadError(f"cannot read {path} as a PyTorch file ({why}); re-save it with "
                            "torch.save or as safetensors") from exc
        found = re.search(r"GLOBAL (\S+)", text)
        what = f" (it holds {found.group(1)})" if found else ""
        raise ReadError(f"{path} " + _REFUSED_PICKLE.format(what=what)) from exc
    except _LOAD_ERRORS as exc:
        raise ReadError(f"cannot read {path} as a PyTorch file ({first_line(exc)}); "
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
                            f"({first_line(exc)})") from exc


def torch_refs(path: Path) -> Listing:
    """The tensors of a state dict, loaded once (a file that cannot be loaded raises)."""
    refs = [TensorRef(str(path), name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                      _reader=_TorchEntry(path, name))
            for name, t in _TORCH_FILES.load(path).items()]
    return refs, []


PYTORCH = FileKind("pytorch", (".pt", ".pth", ".bin"), torch_refs)
"""PyTorch files as ``torch.save`` writes them (and older, non-zip ones)."""
