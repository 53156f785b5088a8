"""Paths to tensors: folders walked, each file listed once by its kind, sharded checkpoints
read through their index, and the include / exclude selection (:func:`open_inputs`)."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from driftcli.io.readers.core import (
    FileKind,
    InputError,
    Inputs,
    Listing,
    Problem,
    ReadError,
    TensorRef,
    not_regular,
    open_regular,
    shown,
    within_bounds,
)
from driftcli.io.readers.npy import NPY, NPZ
from driftcli.io.readers.pytorch import PYTORCH
from driftcli.io.readers.quantized import assemble
from driftcli.io.readers.quantized_weight import Layout
from driftcli.io.readers.safetensors import INDEX_SUFFIX, SAFETENSORS, Index, is_index, read_index
from driftcli.io.readers.te_dumps import TE_DUMPS

_ZIP = b"PK\x03\x04"
_PICKLE = b"\x80"
"""How torch.save's files begin: a zip archive (torch >= 1.6), or a pickle of protocol 2 or
later (the legacy format)."""


def _first_bytes(path: Path) -> bytes:
    try:
        with open_regular(path) as fh:
            return fh.read(4)
    except OSError as exc:
        raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _torch_file(path: Path) -> Listing:
    """A ``.pt``/``.pth``/``.bin`` file, handed to torch only when it begins as torch.save's
    files do: another ``.bin`` (raw weights, a GGML file, a tokenizer's data) would reach the
    unpickler and fail with its opcode ("Unsupported operand 94")."""
    head = _first_bytes(path)
    if not head.startswith((_ZIP, _PICKLE)):
        raise ReadError(f"{path} is not a PyTorch file (it does not begin as a file torch.save "
                        f"writes: {head.hex(' ') or 'empty'}); drift reads {path.suffix} files "
                        "only as torch state dicts; convert the weights to safetensors")
    return PYTORCH.list_file(path)


def _torch_ckpt(path: Path) -> Listing:
    """A ``.ckpt`` is read when torch.save wrote it (PyTorch Lightning's checkpoints), as a
    zip archive like a ``.pt``; other programs' ``.ckpt`` (TensorFlow's) are refused."""
    head = _first_bytes(path)
    if not head.startswith(_ZIP):
        raise ReadError(f"{path} is not a torch zip file: drift reads a .ckpt only as torch.save "
                        "writes it (PyTorch Lightning's checkpoints); convert other checkpoints "
                        "(TensorFlow's) to safetensors")
    return PYTORCH.list_file(path)


TORCH = dataclasses.replace(PYTORCH, list_file=_torch_file)
CKPT = FileKind("torch checkpoint", (".ckpt",), _torch_ckpt)

KINDS: list[FileKind] = [SAFETENSORS, TE_DUMPS, TORCH, CKPT, NPZ, NPY]
"""Every kind of tensor file drift reads, in the order messages name them: a new kind is one
module and one entry here."""

FOREIGN = {
    ".gguf": "a GGUF file (llama.cpp's format), which drift does not read; convert it to "
             "safetensors first, e.g. with transformers (pip install gguf): "
             "AutoModelForCausalLM.from_pretrained(FOLDER, gguf_file=NAME).save_pretrained(OUT), "
             "which dequantizes its weights",
    ".onnx": "an ONNX model, which drift does not read; save the framework's state dict as "
             "safetensors instead",
    ".h5": "an HDF5 (Keras) file, which drift does not read; save the weights as safetensors "
           "instead",
    ".keras": "a Keras model, which drift does not read; save the weights as safetensors instead",
}
"""Files drift does not read but a user may point it at, by ending: what to do instead."""


def _foreign(path: Path) -> str | None:
    return next((why for end, why in FOREIGN.items() if path.name.lower().endswith(end)), None)


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


_SHARD = re.compile(r"-\d+-of-\d+$")


def _family(path: Path) -> str:
    """The checkpoint a weights file belongs to in its folder, whatever its format:
    ``model.safetensors``, ``model-00001-of-00002.safetensors``, ``pytorch_model.bin`` and
    ``pytorch_model-00001-of-00002.bin`` are all ``model`` (Hugging Face's names)."""
    name = path.name.lower()
    stem = name.removesuffix(INDEX_SUFFIX) if is_index(path) else name.rsplit(".", 1)[0]
    return _SHARD.sub("", stem).removeprefix("pytorch_")


def _twins(found: list[Path]) -> list[tuple[Path, Path]]:
    """Torch files of a folder that hold again the weights of a safetensors checkpoint beside
    them (Hugging Face folders keep both ``model.safetensors`` and ``pytorch_model.bin``):
    (the torch file, left unread; the safetensors file or index read instead). Only a torch
    file under Hugging Face's own name (``pytorch_…``) is taken for a copy: ``model.pt``
    beside ``model.safetensors`` may hold other weights, and both are read."""
    kept: dict[tuple[Path, str], Path] = {}
    for p in found:
        if is_index(p) or SAFETENSORS.recognises(p):
            kept.setdefault((p.parent, _family(p)), p)
    return [(p, kept[(p.parent, _family(p))]) for p in found
            if TORCH.recognises(p) and p.name.lower().startswith("pytorch_")
            and (p.parent, _family(p)) in kept]


def _walk(folder: Path) -> tuple[list[Path], list[Path], list[tuple[Path, Path]]]:
    """Tensor and index files under ``folder``, recursively, sorted by relative path; those of
    them skipped as :data:`NOT_WEIGHTS`; and those skipped as a safetensors file's twin."""
    found = sorted((Path(root) / name
                    for root, _dirs, names in os.walk(folder)
                    for name in names if _is_tensor_file(Path(name))),
                   key=lambda p: p.relative_to(folder).parts)
    weights = [p for p in found if not not_weights(p)]
    twins = _twins(weights)
    left = {p for p, _ in twins}
    return ([p for p in weights if p not in left], [p for p in found if not_weights(p)], twins)


def _expand(path: Path) -> tuple[list[Path], list[Path], list[tuple[Path, Path]]]:
    """The tensor and index files a given path stands for, those skipped, and the twins
    skipped (see :func:`_twins`); raises for an unusable path."""
    if path.is_dir():
        files, skipped, twins = _walk(path)
        if not files:
            only = (f" (only {', '.join(p.name for p in skipped)}, which hold no weights)"
                    if skipped else "")
            foreign = sorted(Path(root) / name for root, _dirs, names in os.walk(path)
                             for name in names if _foreign(Path(name)))
            if foreign:
                only += f"; {foreign[0]} is {_foreign(foreign[0])}"
            raise ReadError(f"no tensor files {_accepted()} under {path}{only}; point drift "
                            "at a checkpoint, a dump or a folder holding them")
        return files, skipped, twins
    if not path.exists():
        raise ReadError(f"{path} does not exist; check the path")
    why = _foreign(path)
    if why is not None:
        raise ReadError(f"{path} is {why}")
    if not _is_tensor_file(path):
        raise ReadError(f"{path} is not a tensor file: drift reads {_accepted()} files and "
                        "folders holding them")
    return [path], [], []


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
    for p in paths:  # pathlib reads "" as ".": an unset variable would measure the folder
        if isinstance(p, str) and not p.strip():
            raise ReadError(f"an input path is empty ({p!r}); give a checkpoint, a dump or a "
                            "folder (an unset variable such as \"$CHECKPOINT\" expands to "
                            "an empty one)")
    expanded = [_expand(Path(p)) for p in paths]  # every path checked before any is read
    collector = _Collector()
    for files, _skipped, _twins in expanded:
        for item in _plan(files, collector):
            if isinstance(item, Index):
                collector.open_index(item)
            else:
                collector.open(item)
    inputs = gathered(collector.tensors, collector.errors, collector.files, include, exclude,
                      layout, tuple(dict.fromkeys(f for _files, skipped, _ in expanded
                                                  for f in skipped)))
    return dataclasses.replace(
        inputs, duplicates=tuple(dict.fromkeys(t for *_, twins in expanded for t in twins)))


def gathered(found: Sequence[TensorRef], problems: Sequence[tuple[str, Problem]],
             files: Sequence[Path], include: Sequence[str], exclude: Sequence[str],
             layout: Layout | str | None, skipped: tuple[Path, ...] = (),
             configs: bool = True) -> Inputs:
    """What a listing found (tensors, and problems with the file or folder they are about)
    as :class:`Inputs`: quantized weights assembled (``configs``: reading each folder's
    config), names shown, ``include`` / ``exclude`` applied."""
    unreadable = {(Path(source).parent, p.tensor) for source, p in problems
                  if p.tensor is not None}
    assembled, more, notices = assemble(found, unreadable, layout, configs)
    # names are data: a file name that is not UTF-8 (or a pickled name with a lone
    # surrogate) is shown escaped in every source, name and message, so that it prints and
    # goes into a table; each reader keeps the real path to open
    tensors = [r if r.source.isascii() and r.name.isascii() else
               dataclasses.replace(r, source=shown(r.source), name=shown(r.name))
               for r in assembled]
    errors = [(shown(source), Problem(shown(p.message),
                                      None if p.tensor is None else shown(p.tensor)))
              for source, p in [*problems, *more]]
    kept = [r for r in tensors if _selected(r.name, include, exclude)]
    # a problem with one tensor goes where the tensor would: into the errors, or excluded
    reported = [(source, p) for source, p in errors
                if p.tensor is None or _selected(p.tensor, include, exclude)]
    dropped = len(errors) - len(reported)
    return Inputs(files=tuple(files), tensors=tuple(kept),
                  errors=tuple(InputError(source, p.message, p.tensor)
                               for source, p in reported),
                  excluded=len(tensors) - len(kept) + dropped, skipped=skipped,
                  notices=tuple(shown(n) for n in notices))


_QUANTIZED_CODES = ("int8", "uint8", "int16", "int32")
"""Integer dtypes pre-quantized weights store their codes in (int4 codes packed in int32)."""


def unmeasured(inputs: Sequence[Inputs], shown_names: int = 5) -> list[str]:
    """Lines naming the tensors a measurement leaves out because they are not floating point
    (with their count), the first that looks like a pre-quantized weight (integer codes with
    two or more dimensions) pointing at ``drift inspect``; and one line per folder of torch
    files left unread beside the same weights in safetensors."""
    refs = [r for i in inputs for r in i.tensors if not r.is_float]
    lines = []
    if refs:
        word = ("integer" if all(r.dtype.startswith(("int", "uint")) for r in refs)
                else "non-floating-point")
        named = ", ".join(f"{r.name} ({r.dtype})" for r in refs[:shown_names])
        more = f", and {len(refs) - shown_names} more" if len(refs) > shown_names else ""
        line = f"skipped {len(refs)} {word} tensor(s), not measured: {named}{more}"
        codes = next((r for r in refs if r.dtype in _QUANTIZED_CODES and len(r.shape) >= 2),
                     None)
        if codes is not None:
            line += (f"; {codes.name} looks quantized ({codes.dtype} codes): drift inspect "
                     f"{codes.source} shows what a pre-quantized checkpoint holds")
        lines.append(line)
    return lines + [line for i in inputs for line in twins_skipped(i)]


def twins_skipped(inputs: Inputs) -> list[str]:
    """One line per file read in place of torch files holding the same weights (see
    :func:`_twins`), naming what was left unread: every command that reads folders says it."""
    by_twin: dict[Path, list[Path]] = {}
    for left, read in inputs.duplicates:
        by_twin.setdefault(read, []).append(left)
    return [f"skipped {', '.join(shown(p) for p in unread)}: the same weights as {shown(read)}, "
            "which was read (safetensors preferred)" for read, unread in by_twin.items()]
