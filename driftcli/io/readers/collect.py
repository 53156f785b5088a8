"""Paths to tensors: folders walked, each file listed once by its kind, sharded checkpoints
read through their index, and the include / exclude selection (:func:`open_inputs`)."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from driftcli.io.readers.core import (
    FileKind,
    InputError,
    Inputs,
    Problem,
    ReadError,
    TensorRef,
    not_regular,
    shown,
    within_bounds,
)
from driftcli.io.readers.npy import NPY, NPZ
from driftcli.io.readers.pytorch import PYTORCH
from driftcli.io.readers.quantized import assemble
from driftcli.io.readers.quantized_weight import Layout
from driftcli.io.readers.safetensors import INDEX_SUFFIX, SAFETENSORS, Index, is_index, read_index
from driftcli.io.readers.te_dumps import TE_DUMPS

KINDS: list[FileKind] = [SAFETENSORS, TE_DUMPS, PYTORCH, NPZ, NPY]
"""Every kind of tensor file drift reads, in the order messages name them: a new kind is one
module and one entry here."""


def _accepted() -> str:
    """The file name endings drift reads, for messages (the index beside the safetensors)."""
    endings = [s for kind in KINDS for s in kind.suffixes]
    endings.insert(endings.index(".safetensors") + 1, INDEX_SUFFIX)
    return f"({', '.join(endings)})"


def _is_tensor_file(path: Path) -> bool:
    return is_index(path) or any(kind.recognises(path) for kind in KINDS)


def _kind(path: Path) -> FileKind:
    """The kind of a file already found to be a tensor file (and no index)."""
    return next(kind for kind in KINDS if kind.recognises(path))


NOT_WEIGHTS = ("training_args.bin", "optimizer.pt", "optimizer.bin", "scheduler.pt",
               "scheduler.bin", "scaler.pt", "rng_state*.pth", "*optim_states.pt")
"""Files a training run writes beside the weights that hold no weights (the Hugging Face
Trainer's arguments, optimizer, LR-scheduler, grad-scaler and RNG state; DeepSpeed's
optimizer shards): skipped and listed when found in a folder, read when named on their own.
Several are pickled classes drift would refuse, which would fail a run that measured every
weight. Matched case-insensitively on the file name."""


def not_weights(path: Path) -> bool:
    """Whether ``path``'s name is one of :data:`NOT_WEIGHTS`."""
    name = path.name.lower()
    return any(fnmatch.fnmatchcase(name, g) for g in NOT_WEIGHTS)


def _walk(folder: Path) -> tuple[list[Path], list[Path]]:
    """Tensor and index files under ``folder``, recursively, sorted by relative path; and
    those of them skipped as :data:`NOT_WEIGHTS`."""
    found = sorted((Path(root) / name
                    for root, _dirs, names in os.walk(folder)
                    for name in names if _is_tensor_file(Path(name))),
                   key=lambda p: p.relative_to(folder).parts)
    return [p for p in found if not not_weights(p)], [p for p in found if not_weights(p)]


def _expand(path: Path) -> tuple[list[Path], list[Path]]:
    """The tensor and index files a given path stands for, and those skipped; raises for an
    unusable path."""
    if path.is_dir():
        files, skipped = _walk(path)
        if not files:
            only = (f" (only {', '.join(p.name for p in skipped)}, which hold no weights)"
                    if skipped else "")
            raise ReadError(f"no tensor files {_accepted()} under {path}{only}; point drift "
                            "at a checkpoint, a dump or a folder holding them")
        return files, skipped
    if not path.exists():
        raise ReadError(f"{path} does not exist; check the path")
    if not _is_tensor_file(path):
        raise ReadError(f"{path} is not a tensor file: drift reads {_accepted()} files and "
                        "folders holding them")
    return [path], []


class _Collector:
    """Opens files once each (by resolved path), gathering tensors and errors."""

    def __init__(self) -> None:
        self.seen: set[Path] = set()
        self.files: list[Path] = []
        self.tensors: list[TensorRef] = []
        self.errors: list[tuple[str, Problem]] = []

    def fail(self, source: Path, message: str) -> None:
        self.errors.append((str(source), Problem(message)))

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
        # stat before any open: a FIFO or a device named *.safetensors would block or never
        # end, here and in the provenance hashing of Inputs.files, which it stays out of
        why = not_regular(path)
        if why is not None:
            self.fail(path, why)
            return None
        self.files.append(path)
        try:
            refs, problems = _kind(path).list_file(path)
        except ReadError as exc:
            self.fail(path, str(exc))
            return None
        if only is not None:
            refs = [r for r in refs if r.name in only]
            problems = [p for p in problems if p.tensor is None or p.tensor in only]
        # a small file must not buy hours: every tensor costs a measurement fixed work
        refs, over = within_bounds(path, refs)
        problems = [*problems, *over]
        self.errors.extend((str(path), p) for p in problems)
        self.tensors.extend(refs)
        return {r.name for r in refs} | {p.tensor for p in problems if p.tensor is not None}

    def open_index(self, index: Index) -> None:
        if not self.first_time(index.path):
            return
        self.files.append(index.path)
        for shard, names in index.shards.items():
            if not shard.exists():  # one there but not a regular file: open() says so
                self.fail(index.path, f"{index.path} lists shard {shard.name}, which does not "
                                      "exist; download the missing shard")
                continue
            if shard.resolve() in self.seen:
                continue  # already read, as a file given on its own or through another index
            if not any(kind.recognises(shard) for kind in KINDS):
                self.fail(index.path, f"{index.path} lists shard {shard.name}, which is not a "
                                      f"tensor file {_accepted()}; re-download the index")
                continue
            held = self.open(shard, only=names)
            if held is None:
                continue  # the shard's own error is recorded
            missing = sorted(names - held)
            if missing:
                self.fail(index.path, f"{index.path} puts {len(missing)} tensor(s) in "
                                      f"{shard.name}, which does not hold them (first: "
                                      f"{missing[0]}); re-download the checkpoint")


def _plan(files: Iterable[Path], collector: _Collector) -> list[Path | Index]:
    """Files in order, indexes parsed, and shards named by a readable index left out (they
    are read through the index, at its place)."""
    items: list[Path | Index] = []
    shards: set[Path] = set()
    for f in files:
        if not is_index(f):
            items.append(f)
            continue
        why = not_regular(f)
        if why is not None:
            if collector.first_time(f):
                collector.fail(f, why)
            continue
        try:
            index = read_index(f)
        except ReadError as exc:
            # its shards are still read as plain files, unless another index names them
            if collector.first_time(f):
                collector.files.append(f)
                collector.fail(f, str(exc))
            continue
        items.append(index)
        shards.update(s.resolve() for s in index.shards)
    return [i for i in items if isinstance(i, Index) or i.resolve() not in shards]


def _selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    return ((not include or any(fnmatch.fnmatchcase(name, g) for g in include))
            and not any(fnmatch.fnmatchcase(name, g) for g in exclude))


def open_inputs(paths: Sequence[str | Path], include: Sequence[str] = (),
                exclude: Sequence[str] = (), layout: Layout | str | None = None) -> Inputs:
    """List the named tensors of ``paths`` (files and folders) without reading their data.

    A tensor is kept when its name matches any ``include`` glob (or there are none) and
    no ``exclude`` glob (``fnmatch.fnmatchcase``). Raises :class:`ReadError` at once for a
    path that does not exist, a folder without tensor files, or a file of another kind;
    a file that exists but cannot be opened goes to :attr:`Inputs.errors` instead.
    A pre-quantized weight is one tensor under its own name, its scales never listed
    (:func:`driftcli.io.readers.quantized.assemble`; ``layout`` overrides the layout the
    checkpoint's config or names give).
    """
    if not paths:
        raise ReadError("no inputs given; name checkpoint or dump files, or folders holding "
                        "them")
    expanded = [_expand(Path(p)) for p in paths]  # every path checked before any is read
    collector = _Collector()
    for files, _skipped in expanded:
        for item in _plan(files, collector):
            if isinstance(item, Index):
                collector.open_index(item)
            else:
                collector.open(item)
    unreadable = {(Path(source).parent, p.tensor) for source, p in collector.errors
                  if p.tensor is not None}
    collector.tensors, found = assemble(collector.tensors, unreadable, layout)
    collector.errors.extend(found)
    # names are data: a file name that is not UTF-8 (or a pickled name with a lone
    # surrogate) is shown escaped in every source, name and message, so that it prints and
    # goes into a table; each reader keeps the real path to open
    tensors = [r if r.source.isascii() and r.name.isascii() else
               dataclasses.replace(r, source=shown(r.source), name=shown(r.name))
               for r in collector.tensors]
    errors = [(shown(source), Problem(shown(p.message),
                                      None if p.tensor is None else shown(p.tensor)))
              for source, p in collector.errors]
    kept = [r for r in tensors if _selected(r.name, include, exclude)]
    # a problem with one tensor goes where the tensor would: into the errors, or excluded
    reported = [(source, p) for source, p in errors
                if p.tensor is None or _selected(p.tensor, include, exclude)]
    dropped = len(errors) - len(reported)
    return Inputs(files=tuple(collector.files), tensors=tuple(kept),
                  errors=tuple(InputError(source, p.message, p.tensor)
                               for source, p in reported),
                  excluded=len(tensors) - len(kept) + dropped,
                  skipped=tuple(dict.fromkeys(f for _files, skipped in expanded
                                              for f in skipped)))
