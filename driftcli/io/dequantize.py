"""``drift dequantize``: a pre-quantized checkpoint written back as a plain one, each
quantized weight as the exact product of its codes and scales rounded once to the output
dtype, every other tensor copied as stored.

The output is streamed tensor by tensor (the header is known before any data: every shape
and dtype is), so memory stays at one tensor. Each input file becomes one output file of the
same name (a sharded checkpoint keeps its shards and gets a new index); every file is written
to a temporary name and renamed only once every tensor of every file was read, so a weight
that cannot be dequantized (a NaN scale) leaves nothing behind. ``docs/dequantize.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from driftcli.errors import DriftError
from driftcli.io.readers import ReadError, TensorRef, open_inputs
from driftcli.io.readers.quantized_weight import (
    OUT_DTYPES,
    Layout,
    Order,
    spec_of,
    with_options,
)
from driftcli.io.tables import write_text

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
    """Configs naming a quantization drift does not know (their weights read by name)."""


def _out_paths(sources: list[str], out: Path) -> dict[str, Path]:
    if len(sources) == 1 and out.name.endswith(".safetensors"):
        return {sources[0]: out}
    names = [Path(s).name for s in sources]
    if len(set(names)) < len(names):
        raise DequantizeError(f"the inputs hold two files named alike ({names}); dequantize "
                              "them one folder at a time")
    names = [n if n.endswith(".safetensors") else Path(n).stem + ".safetensors" for n in names]
    if out.name.endswith(".safetensors"):
        raise DequantizeError(f"the input has {len(sources)} files; give --out a folder to "
                              "write one dequantized file per input file")
    return {s: out / n for s, n in zip(sources, names, strict=True)}


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


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _try(ref: TensorRef, errors: list[str]) -> torch.Tensor | None:
    try:
        return ref.read()
    except ReadError as exc:
        errors.append(str(exc))
        return None


def dequantize(paths: Sequence[str | Path], out: str | Path, *, dtype: str = "float32",
               layout: Layout | str | None = None, order: Order | str = Order.EXACT,
               include: Sequence[str] = (), exclude: Sequence[str] = ()) -> Dequantized:
    """Write the checkpoint(s) at ``paths`` to ``out`` with every quantized weight
    dequantized to ``dtype`` (float32, bfloat16 or float16) and every other tensor copied.

    ``out`` is a ``.safetensors`` file for a one-file input, else a folder that gets one
    file per input file (and an index where the input had one). Raises
    :class:`DequantizeError` naming the first bad weight (and how many there are) where
    any tensor cannot be read; nothing is written then.
    """
    if dtype not in OUT_DTYPES:
        raise DequantizeError(f"--dtype {dtype!r} is not an output dtype; use one of "
                              f"{', '.join(OUT_DTYPES)}")
    try:
        order = Order(order)
    except ValueError:
        raise DequantizeError(f"--order {order!r} is not one of "
                              f"{', '.join(Order)}") from None
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
    targets = _out_paths(list(by_source), Path(out))
    errors: list[str] = []
    temps: dict[Path, str] = {}
    try:
        for source, refs in by_source.items():
            target = targets[source]
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                       suffix=".tmp")
            temps[target] = tmp
            meta = {"format": "pt", META_KEY: json.dumps(
                {r.name: {"layout": str(s.layout), "dtype": dtype, "order": str(order)}
                 for r in refs if (s := spec_of(r)) is not None})}
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), 0o666 & ~_umask())  # as a plain open() would make it
                _write_file(fh, refs, meta, errors)
                fh.flush()
                os.fsync(fh.fileno())
        if errors:
            raise DequantizeError(f"{len(errors)} weight(s) cannot be dequantized, first "
                                  f"{errors[0]}; nothing was written")
        index = _index(inputs.files, targets, by_source)
        for target, tmp in temps.items():
            os.replace(tmp, target)
        temps.clear()
    finally:
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    written = list(targets.values())
    if index is not None:
        written.append(index)
    weights = sum(spec_of(r) is not None for refs in by_source.values() for r in refs)
    return Dequantized(tuple(written), weights, len(inputs.tensors) - weights, inputs.notices)


def _index(files: Sequence[Path], targets: dict[str, Path],
           by_source: dict[str, list[TensorRef]]) -> Path | None:
    """Write an index beside sharded output when an input was read through one."""
    if not any(f.name.endswith(".safetensors.index.json") for f in files) or len(targets) < 2:
        return None
    folder = next(iter(targets.values())).parent
    wmap = {r.name: targets[s].name for s, refs in by_source.items() for r in refs}
    total = sum(r.numel * torch_dtype_size(r.dtype) for refs in by_source.values()
                for r in refs)
    return write_text(folder / "model.safetensors.index.json",
                      json.dumps({"metadata": {"total_size": total}, "weight_map": wmap},
                                 indent=2))
