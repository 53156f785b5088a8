"""NumPy files: ``.npy`` arrays and ``.npz`` archives of them, read without ``allow_pickle``.

Each header is checked against the bytes really there before any buffer is sized from it; in
an ``.npz`` each member is judged on its own, through the archive's directory, so one damaged
member leaves the others readable. An object array is refused, as a pickle is.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import stat
import threading
import tokenize
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from driftcli.io.readers.core import (
    MAX_ENTRIES,
    ZIP_ERRORS,
    ByteRange,
    FileKind,
    Listing,
    Problem,
    Reader,
    ReadError,
    TensorRef,
    byte_buffer,
    element_type,
    fill,
    first_line,
    is_count,
    open_regular,
    row_shape,
    truncated,
    typed,
)

# numpy (kind, itemsize) -> torch dtype name; anything else keeps numpy's own name.
_NUMPY_DTYPES = {
    ("f", 2): "float16", ("f", 4): "float32", ("f", 8): "float64",
    ("i", 1): "int8", ("i", 2): "int16", ("i", 4): "int32", ("i", 8): "int64",
    ("u", 1): "uint8", ("u", 2): "uint16", ("u", 4): "uint32", ("u", 8): "uint64",
    ("b", 1): "bool", ("c", 8): "complex64", ("c", 16): "complex128",
}



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
        raise ValueError(f"the header does not parse ({first_line(exc)})") from exc
    if not all(map(is_count, shape)):  # numpy checks only that they are ints
        raise ValueError(f"shape {shape} is not a tuple of non-negative integers")
    return _NpyHeader(dtype, tuple(shape), fortran, fh.tell())


def _npy_nbytes(head: _NpyHeader) -> int:
    return math.prod(head.shape) * head.dtype.itemsize


def _numpy_dtype_name(dtype: np.dtype[Any]) -> str:
    return _NUMPY_DTYPES.get((dtype.kind, dtype.itemsize), dtype.name)


def _npy_ref(source: str, name: str, head: _NpyHeader, reader: Reader) -> TensorRef:
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
        dtype = element_type(ref)
        try:
            mapped = np.load(self.path, mmap_mode="r", allow_pickle=False)
            # a real copy: ascontiguousarray would hand back the mapped rows themselves
            part = np.array(mapped[start:stop], order="C", copy=True)
            del mapped  # close the mapping now, not when the collector runs
        except (OSError, ValueError) as exc:
            raise ReadError(f"{ref.source}: cannot read tensor {ref.name} "
                            f"({first_line(exc)})") from exc
        buf = torch.from_numpy(part.reshape(-1).view(np.uint8))
        return typed(buf, dtype, row_shape(ref, start, stop), not part.dtype.isnative)


def npy_refs(path: Path) -> Listing:
    """The one array of an ``.npy`` file (a file whose header is wrong raises)."""
    try:
        with open_regular(path) as fh:
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
        return [], [Problem(truncated(str(path), path.stem, head.offset,
                                        head.offset + nbytes, size), path.stem)]
    reader: Reader = (_NpyFortran(path) if head.fortran
                       else ByteRange(path, head.offset, nbytes, not head.dtype.isnative))
    return [_npy_ref(str(path), path.stem, head, reader)], []


class _OpenMember:
    """The ``.npz`` member read last, left open where that read ended.

    A deflated member can only be inflated from its start; seeking it inflates and discards
    up to the offset. Opened afresh for every slice, a member read in ``n`` slices was
    inflated ``n`` times over (a 1 GiB member cost 98 s against 15 s as safetensors). The
    scan reads a tensor's rows in order, so it goes on from where it stopped: each member is
    inflated once a pass, streaming. One slot, like the ``.pt`` cache: one open archive at a
    time; a read further back rewinds (a second pass for an amax)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._key: tuple[str, str, int, int, int] | None = None
        self._zf: zipfile.ZipFile | None = None
        self._fh: IO[bytes] | None = None
        self._head: _NpyHeader | None = None

    def close(self) -> None:
        """Drop the open member (after an error, or before another is opened)."""
        for f in (self._fh, self._zf):
            if f is not None:
                with contextlib.suppress(*ZIP_ERRORS):
                    f.close()
        self._key, self._zf, self._fh, self._head = None, None, None, None

    def stream(self, path: Path, member: str) -> tuple[IO[bytes], _NpyHeader]:
        """The open member and its header, opened now where the slot holds another member
        or the archive was rewritten since (its size, mtime or inode changed)."""
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # replaced by a FIFO or device since listed
            raise OSError(f"{path} is not a regular file any more")
        key = (str(path), member, st.st_size, st.st_mtime_ns, st.st_ino)
        if key != self._key or self._fh is None or self._head is None:
            self.close()
            self._zf = zipfile.ZipFile(path)
            self._fh = self._zf.open(member)
            self._head = _npy_header(self._fh)
            self._key = key
        return self._fh, self._head


_OPEN_MEMBER = _OpenMember()
atexit.register(_OPEN_MEMBER.close)  # a member left part-read is closed, not collected


@dataclass(frozen=True)
class _NpzMember:
    """An array inside an ``.npz`` archive (stored or deflated), streamed."""

    path: Path
    member: str

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        dtype = element_type(ref)
        slot = _OPEN_MEMBER
        with slot.lock:
            try:
                fh, head = slot.stream(self.path, self.member)
                if head.shape != ref.shape:
                    raise ReadError(f"{ref.source}: tensor {ref.name} changed since drift "
                                    "listed it (the file was rewritten); run again")
                if head.fortran:  # rare; rows are scattered, so read the member whole
                    fh.seek(0)  # read_array reads the header too
                    whole = np.lib.format.read_array(fh, allow_pickle=False)
                    part = np.array(whole[start:stop], order="C", copy=True)
                    buf = torch.from_numpy(part.reshape(-1).view(np.uint8))
                else:
                    row = math.prod(ref.shape[1:]) * dtype.itemsize
                    # forward from where the last read ended: only the rows between are
                    # inflated (and discarded); backward rewinds to the member's start
                    fh.seek(head.offset + start * row)
                    buf = byte_buffer((stop - start) * row, into)
                    if fill(fh, buf) < buf.numel():
                        raise ReadError(f"{ref.source}: member {self.member} ends before the "
                                        f"{ref.nbytes} bytes of tensor {ref.name} (truncated?); "
                                        "re-save it with numpy.savez")
                if head.fortran or stop == (ref.shape[0] if ref.shape else 1):
                    slot.close()  # read to the end: nothing to go on from
            except ZIP_ERRORS as exc:
                slot.close()
                raise ReadError(f"{ref.source}: cannot read tensor {ref.name} "
                                f"({first_line(exc)})") from exc
            except ReadError:
                slot.close()
                raise
        return typed(buf, dtype, row_shape(ref, start, stop), not head.dtype.isnative)


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
                archive: int) -> TensorRef | Problem:
    """One member of an ``.npz`` archive, listed, or what is wrong with it."""
    name = info.filename.removesuffix(".npy")

    def problem(what: str) -> Problem:
        return Problem(f"{path}: member {info.filename} {what}; re-save it with numpy.savez",
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
    except ZIP_ERRORS as exc:
        return problem(f"has no readable .npy header ({first_line(exc)})")
    if head.dtype.hasobject:
        return Problem(_refuse_objects(f"{path}: member {info.filename}"), name)
    need = head.offset + _npy_nbytes(head)
    if need > info.file_size:
        return problem(f"holds {info.file_size} bytes, but its header's shape "
                       f"{list(head.shape)} needs {need}")
    return _npy_ref(str(path), name, head, _NpzMember(path, info.filename))


def npz_refs(path: Path) -> Listing:
    """The arrays of an ``.npz`` archive (an archive whose directory is unreadable raises)."""
    refs, problems = [], []
    try:
        archive = path.stat().st_size
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            if len(infos) > MAX_ENTRIES:  # each member's header costs a read: stop early
                problems.append(Problem(
                    f"{path} holds {len(infos):,} members, over drift's limit of "
                    f"{MAX_ENTRIES:,} tensors a file, so {len(infos) - MAX_ENTRIES:,} (first: "
                    f"{infos[MAX_ENTRIES].filename}) are not read; split the archive"))
            for info in infos[:MAX_ENTRIES]:
                # members are found through the archive's directory, each on its own: one
                # damaged member leaves the others in no doubt
                got = _npz_member(path, zf, info, archive)
                if isinstance(got, TensorRef):
                    refs.append(got)
                else:
                    problems.append(got)
    except ZIP_ERRORS as exc:
        raise ReadError(f"cannot read {path} as .npz ({first_line(exc)}); re-save it with "
                        "numpy.savez") from exc
    return refs, problems


NPY = FileKind("npy", (".npy",), npy_refs)
"""NumPy arrays as ``numpy.save`` writes them."""
NPZ = FileKind("npz", (".npz",), npz_refs)
"""NumPy archives as ``numpy.savez`` and ``savez_compressed`` write them."""
