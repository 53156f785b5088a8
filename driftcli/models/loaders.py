"""Model checkpoints that measurements run: a small registry of loaders, and token batches.

A loader recognises a checkpoint path and returns a :class:`CausalLM`: the module (in eval
mode, so dropout is off), how to get its logits from token ids, and its tokenizer. Two kinds:

- ``hf``: a Hugging Face causal-LM folder (``config.json`` beside the weights; needs the
  optional extra ``hf``, i.e. ``transformers``: README.md, "Install");
- ``drift``: a checkpoint written by ``drift train`` (one ``.safetensors`` file whose metadata
  holds the model config, :mod:`driftcli.models.checkpoint`), with the byte-level tokenizer.
  Any other ``.safetensors`` file is refused with a message saying what the file lacks.

Batches are int64 token ids of shape ``(windows, tokens)``: from a text file tokenized with the
checkpoint's tokenizer (:func:`text_batch`), or from a safetensors file holding an integer
tensor ``input_ids`` of shape ``(tokens,)`` or ``(windows, tokens)`` (:func:`load_batch`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from driftcli.errors import DriftError
from driftcli.io.readers.quantized import read_config as read_quant_config
from driftcli.io.readers.quantized_weight import Layout
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


HF_PACKAGE = "transformers"
"""The package drift's optional extra ``hf`` installs (pyproject.toml): what an error says to
install, whatever way drift itself was installed."""
SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
"""The sizes a Hugging Face ``config.json`` must give (under its model type's own names:
``n_embd`` for GPT-2's ``hidden_size``): transformers fills a missing one from the model
type's default, a 7B model for ``llama``."""

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def available_memory() -> int | None:
    """Bytes this process can still allocate: the least of the memory Linux calls available,
    the cgroup's limit less its use, and the address-space limit; None where none is known."""
    import resource

    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append(soft)
    return min(found) if found else None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _hf_config(path: Path) -> dict[str, Any]:
    """``config.json`` as a JSON object, refused (one line) where it cannot be a causal LM
    drift can load: not JSON, quantized weights, no model type, an architecture that is not
    a causal LM, sizes missing."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where = path / "config.json"
    try:
        data = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {where}: {err}; give a Hugging Face model folder "
                              "with a valid config.json") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{where} is not a JSON object; give a Hugging Face model folder")
    quant = data.get("quantization_config")
    declared = read_quant_config(path)
    if (quant is not None or declared is not None) and (declared is None
                                                         or declared.layout is None):
        method = (quant.get("quant_method", "?") if isinstance(quant, dict)
                  else "hf_quant_config.json")
        raise CheckpointError(
            f"{path} holds quantized weights (quantization_config, quant_method {method}) in a "
            f"layout drift does not read (it reads {', '.join(Layout)}); give the unquantized "
            "model's folder to run the model")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        what = ("no model_type" if model_type is None else f"model_type {model_type!r}, "
                f"which transformers {transformers.__version__} does not know")
        raise CheckpointError(f"{where} has {what}; drift loads Hugging Face causal LMs "
                              "(llama, gpt2, mistral, ...)")
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    archs = data.get("architectures") or []
    if not isinstance(archs, list):
        archs = []
    named = [a for a in archs if isinstance(a, str)]
    if causal is None or (named and not any(a == causal or a.endswith(_CAUSAL_SUFFIXES)
                                            for a in named)):
        what = ", ".join(named) if named else f"model_type {model_type}"
        raise CheckpointError(
            f"{path} is not a causal language model ({what}): grad-cosine, dump and probe "
            "measure next-token prediction, and loading it as one would attach a randomly "
            "initialised LM head; give a causal LM (a ...ForCausalLM architecture)")
    config_class = CONFIG_MAPPING[model_type]
    aliases: dict[str, str] = getattr(config_class, "attribute_map", {}) or {}
    try:
        defaults = config_class()
    except (TypeError, ValueError):  # a config class that needs arguments: no defaults to fear
        defaults = None
    missing = [aliases.get(k, k) for k in SIZE_KEYS
               if hasattr(defaults, k) and k not in data and aliases.get(k, k) not in data]
    if missing:
        raise CheckpointError(
            f"{where} does not give {', '.join(missing)}: transformers would fill "
            f"{'it' if len(missing) == 1 else 'them'} from {model_type}'s defaults (a "
            "different, usually far larger model); give the config.json the model was "
            "saved with")
    return data


def _plain_config(path: Path) -> Any:
    """The folder's transformers config without its ``quantization_config``: drift
    dequantizes the weights itself (:func:`_load_quantized`), so the model is built plain."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def estimate_memory(path: Path, float64_copies: int) -> tuple[int, int]:
    """The parameter count of the Hugging Face model in ``path`` (built on the meta device
    from its config: no weights read, no memory taken) and the bytes a measurement holds:
    the model as loaded plus ``float64_copies`` float64 tensors of every parameter."""
    from transformers import AutoModelForCausalLM

    try:
        config = _plain_config(path)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError,
            NotImplementedError, RuntimeError) as err:  # what a model's own config code raises
        raise CheckpointError(f"cannot build {path}'s model from its config.json: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                              ) from None
    n = sum(p.numel() for p in meta.parameters())
    loaded = next(meta.parameters()).element_size() if n else 4
    return n, n * (loaded + 8 * float64_copies)


def _check_memory(path: Path, float64_copies: int, available: int | None) -> None:
    n, need = estimate_memory(path, float64_copies)
    if available is not None and need > available:
        raise CheckpointError(
            f"{path} has {n:,} parameters: holding it as loaded and {float64_copies} float64 "
            f"cop{'y' if float64_copies == 1 else 'ies'} takes about {_gib(need)}, more than "
            f"the {_gib(available)} available; run it on a machine with more memory, or "
            "measure a smaller model")


def _fresh_weights(path: Path, info: dict[str, Any]) -> None:
    """Refuse a load that left parameters at their random initialisation (names them)."""
    fresh = sorted(set(info.get("missing_keys") or ()) | {
        m[0] if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys") or ()})
    if fresh:
        first = ", ".join(fresh[:3])
        more = f" and {len(fresh) - 3} more" if len(fresh) > 3 else ""
        raise CheckpointError(
            f"{path}: {len(fresh)} weight(s) are not in the folder (or have another shape) and "
            f"would be initialised at random: {first}{more}; give the complete checkpoint of "
            "a causal LM")


def _load_quantized(path: Path) -> nn.Module:
    """The model of a pre-quantized folder in float32, each quantized weight dequantized
    exactly as the scans read it (the product of code and scales rounded once to float32,
    ``docs/inputs.md``), the other tensors as stored (widened exactly). Refused, naming
    the tensor, where a weight cannot be dequantized or the tensors do not fit the model."""
    from transformers import AutoModelForCausalLM

    from driftcli.io.readers import open_inputs

    try:
        inputs = open_inputs([path])
    except DriftError as err:
        raise CheckpointError(str(err)) from None
    if inputs.errors:
        e = inputs.errors[0]
        more = f" (and {len(inputs.errors) - 1} more)" if len(inputs.errors) > 1 else ""
        raise CheckpointError(f"{e.message}{more}; the model needs every weight")
    try:
        with torch.random.fork_rng(devices=[]):  # its initial draw is overwritten: RNG as is
            model = AutoModelForCausalLM.from_config(
                _plain_config(path), attn_implementation="sdpa", dtype=torch.float32)
    except (OSError, ValueError, TypeError, ImportError) as err:
        raise CheckpointError(f"cannot build {path}'s model from its config.json: "
                              f"{str(err).splitlines()[0]}") from None
    own = model.state_dict()
    state: dict[str, Tensor] = {}
    for ref in inputs.tensors:
        if ref.name in own and tuple(own[ref.name].shape) != ref.shape:
            raise CheckpointError(f"{ref.source}: tensor {ref.name} has shape "
                                  f"{list(ref.shape)}, the model's config needs "
                                  f"{list(own[ref.name].shape)}; give the config.json the "
                                  "checkpoint was saved with")
        try:
            state[ref.name] = ref.read()
        except DriftError as err:  # a NaN scale is found when the weight is read
            raise CheckpointError(f"{err}; the model needs every weight") from None
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected",
                                              None) or ()]
    extra = sorted(k for k in set(state) - set(own) if not any(p.search(k) for p in ignored))
    if extra:
        raise CheckpointError(f"{path} holds {len(extra)} tensor(s) its model has no place "
                              f"for, first {extra[0]}; give the config.json the checkpoint "
                              "was saved with")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    model.tie_weights()  # a tied head is not stored: it shares the embedding loaded above
    loaded = {own_t.data_ptr() for k, own_t in model.state_dict().items() if k in state}
    fresh = sorted(k for k, t in model.state_dict().items()
                   if k not in state and t.data_ptr() not in loaded)
    _fresh_weights(path, {"missing_keys": fresh})
    return model


def _load_hf(path: Path, float64_copies: int = 0, available: int | None = None) -> CausalLM:
    if importlib.util.find_spec("transformers") is None:
        raise CheckpointError(f"{path} is a Hugging Face model folder, which needs "
                              f"transformers (drift's optional extra hf): pip install {HF_PACKAGE}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # every check reads config.json only: a wrong model is refused before any weight is read
    _hf_config(path)
    _check_memory(path, float64_copies, available_memory() if available is None else available)
    if read_quant_config(path) is not None:  # a layout drift reads (_hf_config refused others)
        model = _load_quantized(path)
    else:
        try:
            # sdpa: the mode decomposes F.scaled_dot_product_attention itself, and the float64
            # reference then runs its softmax in float64 (the eager kernel's is float32)
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, attn_implementation="sdpa",
                output_loading_info=True)
            model, info = loaded
        except (OSError, ValueError, ImportError) as err:
            raise CheckpointError(f"cannot load {path} as a Hugging Face causal LM: "
                                  f"{str(err).splitlines()[0]}") from None
        _fresh_weights(path, info)
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
                   "a Hugging Face causal-LM folder (config.json; needs transformers)"),
    CheckpointKind("drift", _is_safetensors, _load_drift,
                   "a drift model checkpoint (step-*.safetensors from drift train)"),
]
"""Every checkpoint kind, tried in order."""


def load_causal_lm(path: str | Path, *, float64_copies: int = 0) -> CausalLM:
    """Load a checkpoint with the first kind that recognises it.

    A Hugging Face folder is checked from its ``config.json`` before any weight is read: a
    quantized model, an architecture that is not a causal LM, a config without its sizes,
    and a model whose memory (as loaded, plus ``float64_copies`` float64 copies of every
    parameter: what the caller will hold) exceeds :func:`available_memory` are refused, as
    is a load that would leave any weight at its random initialisation."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist; give a model folder or a drift "
                              "checkpoint file")
    if _is_hf(p):
        return _load_hf(p, float64_copies)
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
