"""drift model checkpoints: one safetensors file that rebuilds the model on its own.

The tensors are the model's ``state_dict`` under its own names (``hidden.0.weight``, ...) and,
when the optimizer keeps state, its buffers under ``optimizer/BUFFER/PARAMETER`` (AdamW's
``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``): measure the weights alone with
``--exclude 'optimizer/*'``. The safetensors metadata holds one key, ``drift.model``, whose
JSON value is ``{"version": 1, "config": {"kind": "mlp", ...}, "state": {...}}``: the model's
config and the training state (step, seed, policy, optimizer and its settings, learning rate,
schedule, batch, text), whatever the writer passes.

Nothing in a checkpoint depends on the time or machine it was written on, so two runs with the
same seed write byte-identical files. (One metadata key, because safetensors writes several in
a hash map's order, which changes from process to process.)

The config is data from the file: before a model is built from it, :func:`check_sizes`
compares the shapes it implies with the weights the file holds (from the header, nothing
read) and its size with the memory available, so a few hundred bytes claiming 50 layers of
200,000 × 200,000 are refused in milliseconds rather than allocated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from driftcli.memory import available_memory
from driftcli.models.config import ModelConfig, ModelError, config_from_json
from driftcli.models.nets import build_model

Tensor = torch.Tensor

MODEL_KEY = "drift.model"
"""The metadata key marking a drift model checkpoint (its config and state as JSON)."""
CHECKPOINT_VERSION = 1
"""The version of the ``drift.model`` JSON; a reader refuses versions it does not know."""
MAX_STEP = 2**53
"""The largest training step a checkpoint may record (any real run's is far below; every
step is a table's int64 value and takes part in float64 arithmetic, exact up to 2^53)."""
OPTIMIZER_PREFIX = "optimizer/"
"""Tensor names starting with this hold the optimizer's buffers."""


class CheckpointFileError(ModelError):
    """A file that is not a readable drift model checkpoint."""


@dataclass(frozen=True)
class DriftCheckpoint:
    """A loaded checkpoint: the rebuilt model (in eval mode) and what the file says."""

    path: Path
    model: nn.Module
    config: ModelConfig
    state: dict[str, Any]
    """The training state written with it (step, seed, policy, optimizer, lr, ...)."""
    optimizer: dict[str, dict[str, Tensor]]
    """Optimizer buffers by buffer name, then parameter name (empty when none were saved)."""

    @property
    def step(self) -> int:
        """The training step the weights are from (0 when the state does not say)."""
        return int(self.state.get("step", 0))


def save_checkpoint(path: str | Path, model: nn.Module, config: ModelConfig,
                    state: Mapping[str, Any],
                    optimizer: Mapping[str, Mapping[str, Tensor]] | None = None) -> Path:
    """Write ``model``'s weights, its ``config``, the training ``state`` (JSON-able) and the
    optimizer's buffers (``{buffer: {parameter: tensor}}``) to ``path``, atomically."""
    from safetensors.torch import save_file

    p = Path(path)
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    for buffer, per_param in (optimizer or {}).items():
        for name, t in per_param.items():
            tensors[f"{OPTIMIZER_PREFIX}{buffer}/{name}"] = t.detach().contiguous().clone()
    meta = {MODEL_KEY: json.dumps({"version": CHECKPOINT_VERSION, "config": config.to_json(),
                                   "state": dict(state)}, sort_keys=True)}
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return p


def read_metadata(path: str | Path) -> dict[str, str]:
    """The safetensors metadata of ``path`` (empty when it has none)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as fh:
            return dict(fh.metadata() or {})
    except (OSError, SafetensorError) as err:
        raise CheckpointFileError(f"cannot read {p} as safetensors: {err}; give a checkpoint "
                                  "written by drift train") from None


def is_drift_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a safetensors file whose metadata marks it a drift model."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        return MODEL_KEY in read_metadata(p)
    except CheckpointFileError:
        return False


def _json(meta: dict[str, str], key: str, path: Path) -> Any:
    try:
        return json.loads(meta[key])
    except (KeyError, json.JSONDecodeError):
        raise CheckpointFileError(f"{path}: metadata {key} is missing or not JSON; the file "
                                  "was not written by drift train") from None


def read_info(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The model config and training state of a drift checkpoint, without reading tensors."""
    p = Path(path)
    return _info(p, read_metadata(p))


def _info(p: Path, meta: dict[str, str]) -> tuple[ModelConfig, dict[str, Any]]:
    if MODEL_KEY not in meta:
        raise CheckpointFileError(f"{p} is a safetensors file but not a drift model checkpoint "
                                  f"(no {MODEL_KEY} metadata); give a step-*.safetensors file "
                                  "written by drift train")
    head = _json(meta, MODEL_KEY, p)
    if not isinstance(head, dict) or head.get("version") != CHECKPOINT_VERSION:
        raise CheckpointFileError(f"{p}: drift model checkpoint version "
                                  f"{head.get('version') if isinstance(head, dict) else head!r}"
                                  f" is not {CHECKPOINT_VERSION}; read it with the drift that "
                                  "wrote it")
    config = config_from_json(head.get("config") or {})
    state = head.get("state") or {}
    if not isinstance(state, dict):
        raise CheckpointFileError(f"{p}: the training state in {MODEL_KEY} is not a JSON object")
    for key in ("step", "optimizer_step"):
        value = state.get(key, 0)
        # bool is an int to Python; a float (1e308) or a huge int is no int64 table value
        if type(value) is not int or not 0 <= value <= MAX_STEP:
            raise CheckpointFileError(
                f"{p}: the training state's {key} {json.dumps(value)[:40]} is not a step "
                f"(a whole number 0..{MAX_STEP}); the file was not written by drift train")
    return config, state


def _planned(config: ModelConfig, p: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each state-dict tensor of ``config``'s model: its shape and bytes, from a model built
    on the meta device (no memory), so the check cannot drift from :func:`build_model`."""
    try:
        with torch.device("meta"):
            meta = build_model(config)
    except (RuntimeError, ValueError, OverflowError) as err:
        raise CheckpointFileError(f"{p}: its {config.kind.value} config {config.to_json()} "
                                  f"describes no model that can be built ({err}); the file "
                                  "was not written by drift train") from None
    return {k: (tuple(t.shape), t.numel() * t.element_size())
            for k, t in meta.state_dict().items()}


def check_sizes(p: Path, config: ModelConfig, memory: int | None = None) -> None:
    """Refuse (:class:`CheckpointFileError`) a checkpoint whose config implies tensors the
    file does not hold, as named and shaped, or a model larger than ``memory`` bytes
    (default :func:`available_memory`), before anything is built or read."""
    from safetensors import SafetensorError, safe_open

    planned = _planned(config, p)
    try:
        with safe_open(str(p), framework="pt") as fh:
            names = fh.keys()  # a safe_open handle is not iterable
            held = {k: tuple(fh.get_slice(k).get_shape()) for k in names
                    if not k.startswith(OPTIMIZER_PREFIX)}
    except (OSError, SafetensorError) as err:
        raise CheckpointFileError(f"cannot read {p} as safetensors: {err}; give a checkpoint "
                                  "written by drift train") from None
    what = f"{p}: the weights do not fit its {config.kind.value} config"
    for name, (shape, _) in planned.items():
        if name not in held:
            raise CheckpointFileError(f"{what} ({name} of shape {list(shape)} is not in the "
                                      "file); the file was not written by drift train, or "
                                      "its metadata was edited")
        if held[name] != shape:
            raise CheckpointFileError(f"{what} ({name}: the config needs {list(shape)}, the "
                                      f"file holds {list(held[name])})")
    extra = sorted(set(held) - set(planned))
    if extra:
        raise CheckpointFileError(f"{what} (the file holds {len(extra)} tensor(s) the config "
                                  f"has no place for, first {extra[0]})")
    need = sum(size for _, size in planned.values())
    have = available_memory() if memory is None else memory
    # the tensors read from the file and the model built from them are held together
    if 2 * need > have:
        raise CheckpointFileError(f"{p}: its {config.kind.value} model takes {need:,} bytes, "
                                  f"and loading holds it twice ({2 * need:,}), more than the "
                                  f"{have:,} bytes of memory available; run on a machine "
                                  "with more memory")


def load_checkpoint(path: str | Path) -> DriftCheckpoint:
    """Rebuild the model of a drift checkpoint (in eval mode) with its state and buffers."""
    from safetensors.torch import load_file

    p = Path(path)
    config, state = _info(p, read_metadata(p))
    check_sizes(p, config)  # the config is the file's word: nothing built or read on it yet
    tensors = load_file(str(p))
    weights = {k: v for k, v in tensors.items() if not k.startswith(OPTIMIZER_PREFIX)}
    optimizer: dict[str, dict[str, Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith(OPTIMIZER_PREFIX):
            buffer, _, name = k.removeprefix(OPTIMIZER_PREFIX).partition("/")
            optimizer.setdefault(buffer, {})[name] = v
    with torch.random.fork_rng(devices=[]):  # building draws an initialisation; keep RNG as is
        model = build_model(config)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if "\n" in str(err) else str(err)
        raise CheckpointFileError(f"{p}: the weights do not fit its {config.kind.value} config "
                                  f"({first})") from None
    model.eval()
    return DriftCheckpoint(p, model, config, state, optimizer)
