"""The readers' core: the listed tensor (:class:`TensorRef`), what a listing finds
(:class:`Inputs`), the interface each kind of file provides (:class:`FileKind`), and reading
a byte range.

A kind module (safetensors, PyTorch, NumPy) lists one file as :class:`TensorRef` values, each
holding a :class:`Reader` that knows where the tensor's bytes are, and :class:`Problem` values
for what it cannot list; :mod:`driftcli.io.readers.collect` walks the paths and asks each file's
kind.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, NamedTuple, Protocol, cast

import torch

from driftcli.errors import DriftError

# Canonical names only (str(torch.float) is "torch.float32"), so "float" or "half" in a
# file never passes for a torch dtype.
_TORCH_DTYPES = {str(d).removeprefix("torch."): d
                 for d in vars(torch).values() if isinstance(d, torch.dtype)}

# zipfile raises RuntimeError for an encrypted member, and its NotImplementedError for a
# method or zip version it lacks
ZIP_ERRORS = (OSError, EOFError, ValueError, RuntimeError, zipfile.BadZipFile, zlib.error)
"""What reading a zip archive (an ``.npz``, a zip-format ``.pt``) can raise on a damaged one."""


class ReadError(DriftError):
    """One input or one tensor cannot be read: missing, corrupt, truncated or refused."""


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype named ``name`` ("bfloat16"), or None for a name torch lacks."""
    return _TORCH_DTYPES.get(name)


def shown(text: str | Path) -> str:
    """A path or name as text that prints and encodes anywhere (a terminal, a Parquet
    column, JSON): bytes of a file name that are not UTF-8 (which Python holds as surrogate
    escapes) become ``\\xNN``, and a lone surrogate from a pickled name ``\\udXXX``; valid
    text is unchanged. The file itself is still opened by its real name."""
    s = str(text)
    try:
        raw = s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte (a pickled str)
        raw = s.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def not_regular(path: Path) -> str | None:
    """Why ``path`` must not be opened, found by ``stat`` alone (following symbolic links): a
    FIFO, a device or a socket can block ``open`` or a read forever, or never end (/dev/zero);
    None for a regular file, or one ``stat`` cannot reach (opening it then says why)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else
            "a folder" if stat.S_ISDIR(mode) else "not a regular file")
    link = " (through a symbolic link)" if path.is_symlink() else ""
    return (f"{path} is {kind}{link}, not a regular file: drift reads only regular files "
            "(a pipe or a device can block or never end); copy the data into a file")


def open_regular(path: Path, buffering: int = -1) -> BinaryIO:
    """``path`` opened for reading, only if it is a regular file (else ``OSError``): opened
    without blocking and checked with ``fstat`` on what was opened, so a FIFO or device put in
    its place after the listing's ``stat`` is refused, never waited on or read."""
    nonblocking = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, os.O_RDONLY | nonblocking)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a pipe or a device can block or "
                                        "never end)", str(path))
        if nonblocking:
            os.set_blocking(fd, True)
        return open(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def first_line(exc: BaseException) -> str:
    """A library exception as one line (torch's messages run over several)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Reader(Protocol):
    """Where a tensor's bytes are; copies rows ``[start, stop)`` into a fresh tensor, or into
    the front of ``into`` (a uint8 buffer) where it reads bytes and ``into`` is large enough."""

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor: ...


def byte_buffer(n: int, into: torch.Tensor | None) -> torch.Tensor:
    """``n`` bytes to read into: the front of ``into`` when it holds them (pages already
    mapped and touched read faster than fresh ones), else new."""
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
    _reader: Reader | None = field(default=None, compare=False, repr=False)
    _nbytes: int | None = field(default=None, compare=False, repr=False)
    """Stored bytes, for a dtype torch cannot size."""

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored data."""
        dtype = torch_dtype(self.dtype)
        if dtype is not None:
            return self.numel * dtype.itemsize
        if self._nbytes is None:
            raise ValueError(f"tensor {self.name}: the size of dtype {self.dtype} is unknown")
        return self._nbytes

    @property
    def is_float(self) -> bool:
        """Whether the stored dtype is floating point (bfloat16, float16, float8 types...)."""
        dtype = torch_dtype(self.dtype)
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
    skipped: tuple[Path, ...] = ()
    """Files found in a folder that are known not to hold weights (``training_args.bin``,
    optimizer and scheduler state, RNG state), left unread."""
    notices: tuple[str, ...] = ()
    """One line each: a checkpoint's config names a quantization drift does not know (its
    weights are read by their names)."""
    duplicates: tuple[tuple[Path, Path], ...] = ()
    """Torch files found in a folder beside a safetensors checkpoint of the same weights
    (``pytorch_model.bin`` beside ``model.safetensors``), left unread: (the torch file, the
    safetensors file or index read instead)."""


@dataclass(frozen=True)
class Problem:
    """Something in one file that cannot be read: the file's metadata, or one tensor."""

    message: str
    tensor: str | None = None
    """The tensor it is about: reported only where that tensor is selected (by include /
    exclude, and by an index for its shard), like the tensor itself."""


# --- reading bytes --------------------------------------------------------------------------


def is_count(x: object) -> bool:
    """Whether ``x`` is a non-negative int (and not a bool), as a size or offset must be."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def element_type(ref: TensorRef) -> torch.dtype:
    """The torch dtype ``ref`` is stored in; raises where torch has none for it."""
    dtype = torch_dtype(ref.dtype)
    if dtype is None:
        raise ReadError(f"{ref.source}: tensor {ref.name} is stored as {ref.dtype}, which torch "
                        "has no element type for; drift cannot read it")
    return dtype


def row_shape(ref: TensorRef, start: int, stop: int) -> tuple[int, ...]:
    """The shape of rows ``[start, stop)`` of ``ref`` (a 0-d tensor is read whole)."""
    return (stop - start, *ref.shape[1:]) if ref.shape else ()


def truncated(source: str, name: str, begin: int, end: int, size: int) -> str:
    """The message for a tensor whose bytes ``begin..end`` run past a file of ``size`` bytes."""
    return (f"{source}: tensor {name} needs bytes {begin}..{end} but the file has {size} bytes "
            "(truncated?); re-save or re-download it")


class _ReadsInto(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def fill(fh: IO[bytes], buf: torch.Tensor) -> int:
    """Read into the uint8 tensor ``buf`` until it is full or the stream ends; bytes read."""
    view = buf.numpy().data.cast("B")
    got = 0
    while got < len(view):
        # one read() may return less than asked (Linux caps it near 2 GiB), so loop
        # every stream drift reads is a buffered file or a zip member: both read into a
        # buffer, which typing.IO does not declare
        n = cast(_ReadsInto, fh).readinto(view[got:])
        if not n:
            break
        got += n
    return got


def typed(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
          swap: bool) -> torch.Tensor:
    """Raw bytes as ``dtype`` in native byte order, shaped ``shape``."""
    if swap and dtype.itemsize > 1:
        buf = buf.view(-1, dtype.itemsize).flip(1).reshape(-1)
    return buf.view(dtype).reshape(shape)


@dataclass(frozen=True)
class ByteRange:
    """A tensor stored row-major at ``offset`` of a plain file (safetensors, ``.npy``)."""

    path: Path
    offset: int
    length: int
    swap: bool = False

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        # the listing checked ``length`` against the shape and the file; here the file is
        # checked again (it may have shrunk since), before any buffer is made
        dtype = element_type(ref)
        row = math.prod(ref.shape[1:]) * dtype.itemsize
        end = self.offset + self.length
        try:
            # positioned reads, not mmap: a file truncated under a mapping kills the process
            # with SIGBUS, and no mapping outlives the call
            with open_regular(self.path, buffering=0) as fh:
                size = os.fstat(fh.fileno()).st_size
                if end > size:
                    raise ReadError(truncated(ref.source, ref.name, self.offset, end, size))
                buf = byte_buffer((stop - start) * row, into)
                fh.seek(self.offset + start * row)
                got = fill(fh, buf)
        except OSError as exc:
            raise ReadError(f"{ref.source}: cannot read tensor {ref.name}: "
                            f"{exc.strerror or exc}") from exc
        if got < buf.numel():  # the file shrank after the size check
            raise ReadError(truncated(ref.source, ref.name, self.offset, end, size))
        return typed(buf, dtype, row_shape(ref, start, stop), self.swap)


# --- what one file may cost -------------------------------------------------------------------


def storage_problem(t: torch.Tensor) -> str | None:
    """Why a loaded tensor's elements are not all bytes of the file: a view whose strides
    repeat elements (a stride of 0, or rows that overlap) can claim 2^36 elements over 4
    bytes, and measuring it would take hours; None for a tensor within its storage."""
    if t.layout is not torch.strided or t.numel() == 0:
        return None  # a sparse or quantized layout: reading it says whether drift can
    need = t.numel() * t.element_size()
    try:
        have = t.untyped_storage().nbytes()
    except RuntimeError:
        return None
    if need <= have:
        return None
    return (f"has {t.numel():,} elements (shape {list(t.shape)}, strides {list(t.stride())}) "
            f"over a storage of {have:,} bytes: a view that repeats elements (a stride of 0 or "
            "rows that overlap), so its size is not bounded by the file's bytes and drift "
            "refuses it; save a copy of it (t.contiguous())")


MAX_ENTRIES = 100_000
"""Tensors one file may hold. Every tensor costs a measurement fixed work (a few ms) beside
its elements, and a 100 MB safetensors header can name 1.5 million tensors: hours bought with
a small file. Real single files hold thousands (sharded checkpoints hundreds a shard)."""

MAX_EMPTY = 1_000
"""Tensors with no elements one file may hold: they give a measurement nothing to count, and
20,000 of them in 1.3 MB took 94 s."""


def within_bounds(path: Path, refs: list[TensorRef]) -> Listing:
    """``refs`` (in file order) cut to the first :data:`MAX_ENTRIES` tensors and, of those, the
    first :data:`MAX_EMPTY` empty ones, with one problem for the file naming what was left
    out (the rest is measured)."""
    kept: list[TensorRef] = []
    left: list[str] = []
    empty = 0
    for r in refs:
        is_empty = 0 in r.shape
        if len(kept) >= MAX_ENTRIES or (is_empty and empty >= MAX_EMPTY):
            left.append(r.name)
            continue
        empty += is_empty
        kept.append(r)
    if not left:
        return kept, []
    n_empty = sum(0 in r.shape for r in refs)
    return kept, [Problem(
        f"{path} holds {len(refs):,} tensors, {n_empty:,} of them with no elements: over "
        f"drift's limits of {MAX_ENTRIES:,} tensors and {MAX_EMPTY:,} empty ones a file, so "
        f"{len(left):,} (first: {left[0]}) are not measured; split the file, or leave out "
        "the empty tensors")]


# --- the interface of a kind of file -----------------------------------------------------------

Listing = tuple[list[TensorRef], list[Problem]]
"""What listing one file gives: its tensors, and the problems with single entries of it."""


@dataclass(frozen=True)
class FileKind:
    """One kind of tensor file: how drift recognises it, and how it lists what one holds."""

    name: str
    suffixes: tuple[str, ...]
    """File name endings of this kind, lower case (names are matched case-insensitively)."""
    list_file: Callable[[Path], Listing]
    """The tensors of one file, in file order, and the problems with single entries; raises
    :class:`ReadError` where the file as a whole cannot be read."""

    def recognises(self, path: Path) -> bool:
        """Whether ``path`` is named as a file of this kind."""
        return path.name.lower().endswith(self.suffixes)
