"""``drift dequantize``: a pre-quantized checkpoint written back as a plain one, each
quantized weight as the exact product of its codes and scales rounded once to the output
dtype, every other tensor copied as stored.

The output is streamed tensor by tensor (the header is known before any data: every shape
and dtype is), so memory stays at one tensor. Each input file becomes one output file of the
same name (a sharded checkpoint keeps its shards and gets a new index). The output follows
the tables' rules: an existing one is replaced only with ``overwrite`` (and a folder only
where drift dequantize wrote it), an input is never the target, a second run into the same
``out`` refuses (the lock), and the whole output is committed at once: a file written beside
and renamed, a folder written beside and swapped in, so a weight that cannot be dequantized
(a NaN scale, a product past the dtype's range), a full disk or a kill leaves the earlier
output as it was. ``docs/dequantize.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from driftcli.errors import DriftError
from driftcli.io.outputs import OutputError, check_writable
from driftcli.io.readers import ReadError, TensorRef, open_inputs
from driftcli.io.readers.collect import twins_skipped
from driftcli.io.readers.quantized_weight import (
    OUT_DTYPES,
    Layout,
    Order,
    spec_of,
    with_options,
)
from driftcli.io.readers.safetensors import INDEX_SUFFIX, header_metadata
from driftcli.io.tables import WriteError, atomic_write, fsync_folder, table_lock, write_text

_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
          "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
          "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
          "float8_e8m0fnu": "F8_E8M0", "int64": "I64", "int32": "I32", "int16": "I16",
          "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
          "bool": "BOOL", "complex64": "C64"}
"""torch dtype names -> safetensors dtype codes."""
META_KEY = "drift.dequantized"
"""The output's ``__metadata__`` key: the layout, dtype and order each weight was read with."""


class DequantizeError(DriftError):
    """Weights that could not be dequantized: the output is not written."""


@dataclass(frozen=True)
class Dequantized:
    """What :func:`dequantize` wrote."""

    files: tuple[Path, ...]
    """Output files, the index last where there is one."""
    weights: int
    """Quantized weights dequantized."""
    copied: int
    """Tensors copied as stored."""
    notices: tuple[str, ...] = ()
    """Configs naming a quantization drift does not know (their weights read by name), and
    torch files left unread beside the same weights in safetensors (no output of theirs)."""


def _out_names(sources: list[str], out: Path) -> dict[str, str]:
    """Each input file's output file name: ``out``'s own for a one-file input written to a
    ``.safetensors`` name, else the input's name as ``.safetensors`` (one per input file,
    which two inputs may not share: one would overwrite the other)."""
    if len(sources) == 1 and out.name.endswith(".safetensors"):
        return {sources[0]: out.name}
    if out.name.endswith(".safetensors"):
        raise DequantizeError(f"the input has {len(sources)} files; give --out a folder to "
                              "write one dequantized file per input file")
    names: dict[str, str] = {}
    taken: dict[str, str] = {}
    for source in sources:
        name = Path(source).name
        name = name if name.endswith(".safetensors") else Path(name).stem + ".safetensors"
        if name.lower() in taken:  # (case-insensitive: one file on macOS and Windows)
            raise DequantizeError(f"the inputs {taken[name.lower()]} and {source} would both "
                                  f"be written as {name}; dequantize them one at a time, each "
                                  "to its own --out")
        taken[name.lower()] = source
        names[source] = name
    return names


def _header(refs: list[TensorRef], meta: dict[str, str]) -> tuple[bytes, list[int]]:
    entries: dict[str, object] = {"__metadata__": meta}
    at, sizes = 0, []
    for ref in refs:
        size = ref.numel * torch_dtype_size(ref.dtype)
        entries[ref.name] = {"dtype": _CODES[ref.dtype], "shape": list(ref.shape),
                             "data_offsets": [at, at + size]}
        sizes.append(size)
        at += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw, sizes


def torch_dtype_size(name: str) -> int:
    """Bytes per element of a torch dtype name."""
    return getattr(torch, name).itemsize


def _write_file(fh: IO[bytes], refs: list[TensorRef], meta: dict[str, str],
                errors: list[str]) -> None:
    head, sizes = _header(refs, meta)
    fh.write(head)
    for ref, size in zip(refs, sizes, strict=True):
        if errors:  # the output will not be kept: only look for the other bad weights
            if spec_of(ref) is not None:
                _try(ref, errors)
            continue
        data = _try(ref, errors)
        if data is None:
            continue
        # flat first: a 0-d tensor cannot be viewed as bytes, and every rank is the same bytes
        raw = data.contiguous().reshape(-1).view(torch.uint8)
        if raw.numel() != size:  # cannot happen for a listed ref; never write a bad layout
            raise DequantizeError(f"tensor {ref.name} read {raw.numel()} bytes, not {size}")
        fh.write(raw.numpy().data)  # the array's own buffer: no copy


def _try(ref: TensorRef, errors: list[str]) -> torch.Tensor | None:
    """``ref`` read, or None with the reason in ``errors``: a weight that does not read, or
    that dequantizes to infinities or NaNs from finite scales (a product past the output
    dtype's range, NaN codes), which a plain checkpoint must not hold in silence."""
    try:
        data = ref.read()
    except ReadError as exc:
        errors.append(str(exc))
        return None
    if spec_of(ref) is not None:
        bad = ~torch.isfinite(data)
        if bool(bad.any()):
            nans = int(data.isnan().sum())
            errors.append(f"{ref.source}: weight {ref.name} dequantizes to "
                          f"{int(bad.sum()) - nans} infinite and {nans} NaN value(s) in "
                          f"{ref.dtype} from finite scales (a product past {ref.dtype}'s "
                          "range, or NaN codes); re-export the checkpoint, or give a wider "
                          "--dtype")
            return None
    return data


def dequantize(paths: Sequence[str | Path], out: str | Path, *, dtype: str = "float32",
               layout: Layout | str | None = None, order: Order | str = Order.EXACT,
               include: Sequence[str] = (), exclude: Sequence[str] = (),
               overwrite: bool = False) -> Dequantized:
    """Write the checkpoint(s) at ``paths`` to ``out`` with every quantized weight
    dequantized to ``dtype`` (float32, bfloat16 or float16) and every other tensor copied.

    ``out`` is a ``.safetensors`` file for a one-file input, else a folder that gets one
    file per input file (and an index where the input had one). An existing ``out`` is
    replaced only with ``overwrite`` (a folder only where it holds nothing but an earlier
    dequantize output); an input is never replaced. Raises :class:`DequantizeError` naming
    the first bad weight (and how many there are) where any tensor cannot be read or
    dequantizes to a non-finite value, :class:`~driftcli.io.outputs.OutputError` for an
    output it may not write, and :class:`~driftcli.io.tables.WriteError` naming the file
    where the disk is full; in each case nothing was written and an earlier ``out`` is as
    it was.
    """
    if dtype not in OUT_DTYPES:
        raise DequantizeError(f"--dtype {dtype!r} is not an output dtype; use one of "
                              f"{', '.join(OUT_DTYPES)}")
    try:
        order = Order(order)
    except ValueError:
        raise DequantizeError(f"--order {order!r} is not one of "
                              f"{', '.join(Order)}") from None
    out = Path(out)
    inputs = open_inputs(paths, include, exclude, layout=layout)
    if inputs.errors:
        first = inputs.errors[0]
        raise DequantizeError(f"{len(inputs.errors)} tensor(s) or file(s) cannot be read, "
                              f"first {first.message}; nothing was written")
    by_source: dict[str, list[TensorRef]] = {}
    for ref in inputs.tensors:
        if ref.dtype not in _CODES:
            raise DequantizeError(f"{ref.source}: tensor {ref.name} is stored as {ref.dtype}, "
                                  "which drift cannot copy; leave it out with --exclude")
        by_source.setdefault(ref.source, []).append(with_options(ref, dtype, order))
    if not by_source:
        raise DequantizeError("no tensors selected; check --include / --exclude")
    names = _out_names(list(by_source), out)
    one_file = len(by_source) == 1 and out.name.endswith(".safetensors")
    check_writable(out, folder=not one_file)
    _not_an_input(out, inputs.files)
    with table_lock(out):
        earlier = _replaceable(out, overwrite, one_file)
        _remove_stale(out)
        meta = {source: {"format": "pt", META_KEY: json.dumps(
            {r.name: {"layout": str(s.layout), "dtype": dtype, "order": str(order)}
             for r in refs if (s := spec_of(r)) is not None})} for source, refs in
            by_source.items()}
        sharded = any(f.name.endswith(INDEX_SUFFIX) for f in inputs.files) and len(names) > 1
        if one_file:  # written beside and renamed over out (a full disk: WriteError)
            (source, refs), = by_source.items()
            atomic_write(out, lambda fh: _stream(fh, refs, meta[source]))
        else:
            _write_folder(out, by_source, names, meta, sharded, earlier)
    written = [out] if one_file else [out / n for n in names.values()]
    if sharded:
        written.append(out / "model.safetensors.index.json")
    weights = sum(spec_of(r) is not None for refs in by_source.values() for r in refs)
    return Dequantized(tuple(written), weights, len(inputs.tensors) - weights,
                       (*inputs.notices, *twins_skipped(inputs)))


def _not_an_input(out: Path, files: Sequence[Path]) -> None:
    """Refuse an ``out`` that is one of the input files, or a folder that holds one (the
    swap would replace it): whatever --overwrite says, the input is never the target."""
    targets = {out.absolute(), out.resolve()}
    for f in files:
        for p in {f.absolute(), f.resolve()}:
            if p in targets or any(t in p.parents for t in targets):
                what = "is an input" if p in targets else "holds an input"
                raise OutputError(f"--out {out} {what} of this run ({f}); drift dequantize "
                                  "never writes over its input: choose another --out")


def _replaceable(out: Path, overwrite: bool, one_file: bool) -> bool:
    """Whether an earlier output is at ``out`` (an empty folder is none); raise unless it
    may be replaced: only with ``overwrite``, and a folder only where every file in it is
    one drift dequantize writes (it is replaced whole)."""
    if not os.path.lexists(out) or (not one_file and out.is_dir() and not out.is_symlink()
                                    and not any(out.iterdir())):
        return False
    if not overwrite:
        raise OutputError(f"{out} exists; give --overwrite to replace it (an earlier "
                          "dequantize output), or another --out")
    if one_file:
        return True
    if out.is_symlink():
        raise OutputError(f"--out {out} is a symbolic link; drift never replaces a folder "
                          "through a link: give the folder itself")
    for entry in sorted(out.iterdir()):
        if not _ours(entry):
            raise OutputError(f"--out {out} holds {entry.name}, which drift dequantize did "
                              "not write; --overwrite replaces only an earlier dequantize "
                              "output, as a whole: choose another --out")
    return True


def _ours(entry: Path) -> bool:
    """Whether ``entry`` is a file drift dequantize writes: its index, or a safetensors file
    whose metadata records the dequantization."""
    if entry.is_symlink() or not entry.is_file():
        return False
    if entry.name == "model.safetensors.index.json":
        return True
    if not entry.name.endswith(".safetensors"):
        return False
    try:
        meta = header_metadata(entry)
    except ReadError:
        return False
    return isinstance(meta, dict) and META_KEY in meta


def _stale(out: Path) -> Iterator[Path]:
    """Temporaries a killed run left beside ``out``: ``.{name}.*.tmp`` files and folders."""
    parent = out.parent
    if not parent.is_dir():
        return
    prefix = f".{out.name}."
    for entry in parent.iterdir():
        if entry.name.startswith(prefix) and entry.name.endswith(".tmp"):
            yield entry


def _remove_stale(out: Path) -> None:
    """Remove what :func:`_stale` finds; called under the lock, so no live run owns them."""
    for entry in list(_stale(out)):
        _remove(entry)


def _remove(entry: Path) -> None:
    with contextlib.suppress(OSError):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _stream(fh: IO[bytes], refs: list[TensorRef], meta: dict[str, str]) -> None:
    """One output file written to ``fh``; raises :class:`DequantizeError` (after the other
    weights were read, to count the bad ones) where a weight cannot be dequantized."""
    errors: list[str] = []
    _write_file(fh, refs, meta, errors)
    _refuse(errors)


def _refuse(errors: list[str]) -> None:
    if errors:
        raise DequantizeError(f"{len(errors)} weight(s) cannot be dequantized, first "
                              f"{errors[0]}; nothing was written")


def _write_folder(out: Path, by_source: dict[str, list[TensorRef]], names: dict[str, str],
                  meta: dict[str, dict[str, str]], sharded: bool, earlier: bool) -> None:
    """A folder output: every file written in a new folder beside ``out``, then that folder
    swapped in for ``out`` at once. A write that fails (a full disk) is a
    :class:`~driftcli.io.tables.WriteError` naming the file, and ``out`` is as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    name = out
    try:
        os.mkdir(tmp)  # (the mode a plain mkdir gives: what out will have)
        errors: list[str] = []
        for source, refs in by_source.items():
            name = out / names[source]
            with open(tmp / names[source], "xb") as fh:
                _write_file(fh, refs, meta[source], errors)
                fh.flush()
                os.fsync(fh.fileno())
        _refuse(errors)
        if sharded:
            name = out / "model.safetensors.index.json"
            wmap = {r.name: names[s] for s, refs in by_source.items() for r in refs}
            total = sum(r.numel * torch_dtype_size(r.dtype) for refs in by_source.values()
                        for r in refs)
            write_text(tmp / name.name,
                       json.dumps({"metadata": {"total_size": total}, "weight_map": wmap},
                                  indent=2))
        fsync_folder(tmp)
        name = out
        if os.path.lexists(out):
            _swap(tmp, out)
        else:
            os.rename(tmp, out)
        fsync_folder(out.parent)
    except OSError as err:
        why = err.strerror or str(err)
        if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            why += " (the disk or the file size limit is full)"
        kept = f"the earlier {out} is kept as it was" if earlier else "nothing was written"
        raise WriteError(f"cannot write {name}: {why}; {kept}") from None
    finally:
        _remove(tmp)  # after a swap, the earlier output


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folder entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap(new: Path, out: Path) -> None:
    """Put the folder ``new`` in place of the folder ``out``, which ends up at ``new``'s
    name (removed by the caller): in one step where the system can swap two entries, else
    ``out`` renamed aside, then ``new`` in (a kill between the two leaves both beside,
    under temporary names)."""
    if not stat.S_ISDIR(os.lstat(out).st_mode):
        raise OutputError(f"--out {out} is not a folder; choose another --out")
    if _exchange(new, out):
        return
    aside = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    os.rename(out, aside)
    os.rename(new, out)
    os.rename(aside, new)
