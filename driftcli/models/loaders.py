"""Model checkpoints that measurements run: a small registry of loaders, and token batches.

A loader recognises a checkpoint path and returns a :class:`CausalLM`: the module (in eval
mode, so dropout is off), how to get its logits from token ids, and its tokenizer. Two kinds:

- ``hf``: a Hugging Face causal-LM folder (``config.json`` beside the weights; needs the
  optional extra ``hf``: ``pip install "driftcli[hf]"``, i.e. ``transformers``);
- ``drift``: a checkpoint written by ``drift train`` (one ``.safetensors`` file whose metadata
  holds the model config, :mod:`driftcli.models.checkpoint`), with the byte-level tokenizer.
  Any other ``.safetensors`` file is refused with a message saying what the file lacks.

Batches are int64 token ids of shape ``(windows, tokens)``: from a text file tokenized with the
checkpoint's tokenizer (:func:`text_batch`), or from a safetensors file holding an integer
tensor ``input_ids`` of shape ``(tokens,)`` or ``(windows, tokens)`` (:func:`load_batch`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from driftcli.errors import DriftError
from driftcli.models.checkpoint import load_checkpoint
from driftcli.models.nets import ByteTokenizer

Tensor = torch.Tensor
Logits = Callable[[nn.Module, Tensor], Tensor]
"""``(model, input_ids of shape (windows, tokens)) -> logits (windows, tokens, vocab)``."""


class CheckpointError(DriftError):
    """A checkpoint or batch that cannot be loaded."""


@dataclass(frozen=True)
class CausalLM:
    """A loaded causal language model."""

    model: nn.Module
    kind: str
    """The loader that read it (``hf``, ...)."""
    logits: Logits
    tokenize: Callable[[str], list[int]] | None
    """Text to token ids (with the tokenizer's own special tokens); None without one."""
    files: tuple[Path, ...]
    """The files read, for provenance."""


@dataclass(frozen=True)
class CheckpointKind:
    """One kind of checkpoint: how to recognise it and how to load it."""

    name: str
    detect: Callable[[Path], bool]
    load: Callable[[Path], CausalLM]
    description: str


# --- Hugging Face ------------------------------------------------------------------------------

def _is_hf(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _hf_logits(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, use_cache=False).logits


def _load_hf(path: Path) -> CausalLM:
    if importlib.util.find_spec("transformers") is None:
        raise CheckpointError(f"{path} is a Hugging Face model folder, which needs the optional "
                              "extra: pip install 'driftcli[hf]' (transformers)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        # sdpa: the mode decomposes F.scaled_dot_product_attention itself, and the float64
        # reference then runs its softmax in float64 (the eager kernel's is float32)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     attn_implementation="sdpa")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot load {path} as a Hugging Face causal LM: "
                              f"{str(err).splitlines()[0]}") from None
    model.eval()
    tokenize = None
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tok = None  # a folder without a tokenizer still takes --batch
    if tok is not None:
        def tokenize(text: str) -> list[int]:
            return list(tok(text)["input_ids"])
    files = tuple(sorted(p for p in path.iterdir() if p.is_file()))
    return CausalLM(model, "hf", _hf_logits, tokenize, files)


# --- drift's own models ------------------------------------------------------------------------

def _is_safetensors(path: Path) -> bool:
    # every .safetensors file: the loader says why one is not a drift model
    return path.is_file() and path.suffix == ".safetensors"


def _drift_logits(model: nn.Module, ids: Tensor) -> Tensor:
    return model(ids)


def _load_drift(path: Path) -> CausalLM:
    try:
        ck = load_checkpoint(path)
    except DriftError as err:
        raise CheckpointError(str(err)) from None
    return CausalLM(ck.model, "drift", _drift_logits, ByteTokenizer.encode, (path,))


KINDS: list[CheckpointKind] = [
    CheckpointKind("hf", _is_hf, _load_hf,
                   "a Hugging Face causal-LM folder (config.json; needs driftcli[hf])"),
    CheckpointKind("drift", _is_safetensors, _load_drift,
                   "a drift model checkpoint (step-*.safetensors from drift train)"),
]
"""Every checkpoint kind, tried in order."""


def load_causal_lm(path: str | Path) -> CausalLM:
    """Load a checkpoint with the first kind that recognises it."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist; give a model folder or a drift "
                              "checkpoint file")
    for kind in KINDS:
        if kind.detect(p):
            return kind.load(p)
    known = "; ".join(k.description for k in KINDS)
    raise CheckpointError(f"{p} is not a checkpoint drift can load; it reads {known}")


# --- batches -----------------------------------------------------------------------------------

def load_batch(path: str | Path) -> Tensor:
    """The ``input_ids`` tensor of a safetensors file, as int64 ``(windows, tokens)``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    try:
        tensors = load_file(str(p))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"cannot read batch {p}: {err}; give a safetensors file with an "
                              "integer tensor input_ids") from None
    if "input_ids" not in tensors:
        raise CheckpointError(f"batch {p} has no tensor input_ids (it has "
                              f"{', '.join(sorted(tensors)) or 'none'}); save the token ids "
                              "under that name")
    ids = tensors["input_ids"]
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() not in (1, 2):
        raise CheckpointError(f"batch {p}: input_ids must be an integer tensor of shape (tokens,) "
                              f"or (windows, tokens), not {ids.dtype} {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.shape[-1] < 2:
        raise CheckpointError(f"batch {p}: input_ids has {ids.shape[-1]} token(s) per window; "
                              "next-token prediction needs at least 2")
    return ids


def text_batch(lm: CausalLM, text: str, tokens: int, windows: int = 1,
               source: str = "text") -> Tensor:
    """``windows`` consecutive windows of ``tokens`` token ids from the start of ``text``."""
    if lm.tokenize is None:
        raise CheckpointError(f"checkpoint has no tokenizer for {source}; pass token ids with "
                              "--batch FILE instead")
    if tokens < 2 or windows < 1:
        raise CheckpointError(f"windows of {tokens} token(s), {windows} of them: need at "
                              "least 2 tokens and 1 window")
    ids = lm.tokenize(text)
    need = tokens * windows
    if len(ids) < need:
        raise CheckpointError(f"{source} has {len(ids)} tokens, fewer than {windows} window(s) "
                              f"of {tokens}; give more text or lower --tokens / --windows")
    return torch.tensor(ids[:need], dtype=torch.int64).reshape(windows, tokens)


def next_token_loss(logits: Logits) -> Callable[[nn.Module, Tensor], Tensor]:
    """The mean next-token cross-entropy of a causal LM on a batch of token ids."""
    def loss(model: nn.Module, ids: Tensor) -> Tensor:
        out = logits(model, ids)
        return torch.nn.functional.cross_entropy(
            out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))

    return loss
