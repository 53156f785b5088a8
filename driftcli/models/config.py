"""The reference models' settings: families, shapes and their JSON form, and the choices of a
training run. Nothing here
imports torch (``drift train --help`` reads these)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, ClassVar

from driftcli.choices import parse_choice
from driftcli.errors import DriftError

VOCAB = 256
"""Byte-level vocabulary: every byte value is a token."""
CHECKPOINTS = "step-*.safetensors"
"""The checkpoints of a run, as ``drift train`` names them."""


class ModelError(DriftError, ValueError):
    """A model configuration or input that cannot be used."""


class ModelKind(StrEnum):
    """The reference model families."""

    MLP = "mlp"
    """The tanh MLP language model over a fixed context window."""
    TRANSFORMER = "transformer"
    """A small pre-norm causal transformer."""


class Activation(StrEnum):
    """The nonlinearity of the transformer's MLP."""

    GELU = "gelu"
    TANH = "tanh"


def _positive(name: str, **values: int) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelError(f"{name}: {key} must be a positive integer, not {value!r}")


@dataclass(frozen=True)
class MLPConfig:
    """The tanh MLP language model's shape."""

    context: int = 16
    """Bytes the model sees before the one it predicts."""
    embed: int = 16
    """Embedding width of each byte."""
    hidden: int = 128
    """Width of every hidden tanh layer."""
    layers: int = 2
    """Hidden tanh layers."""
    vocab: int = VOCAB

    kind: ClassVar[ModelKind] = ModelKind.MLP

    def __post_init__(self) -> None:
        _positive("mlp", context=self.context, embed=self.embed, hidden=self.hidden,
                  layers=self.layers, vocab=self.vocab)

    def to_json(self) -> dict[str, Any]:
        """The config as a JSON object, its kind included."""
        return {"kind": self.kind.value, **asdict(self)}


@dataclass(frozen=True)
class TransformerConfig:
    """The small transformer's shape."""

    context: int = 64
    """Longest sequence (positions with an embedding)."""
    d_model: int = 64
    """Residual width."""
    layers: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads; must divide ``d_model``."""
    mlp_ratio: int = 4
    """MLP hidden width over ``d_model``."""
    activation: Activation = Activation.GELU
    vocab: int = VOCAB

    kind: ClassVar[ModelKind] = ModelKind.TRANSFORMER

    def __post_init__(self) -> None:
        _positive("transformer", context=self.context, d_model=self.d_model,
                  layers=self.layers, heads=self.heads, mlp_ratio=self.mlp_ratio,
                  vocab=self.vocab)
        object.__setattr__(self, "activation",
                           parse_choice(Activation, self.activation, "activation"))
        if self.d_model % self.heads:
            raise ModelError(f"transformer: d_model {self.d_model} is not a multiple of heads "
                             f"{self.heads}; choose heads dividing it (e.g. --heads 4)")

    def to_json(self) -> dict[str, Any]:
        """The config as a JSON object, its kind included."""
        return {"kind": self.kind.value, **asdict(self), "activation": self.activation.value}


ModelConfig = MLPConfig | TransformerConfig


def config_from_json(data: dict[str, Any]) -> ModelConfig:
    """A config from :meth:`MLPConfig.to_json` / :meth:`TransformerConfig.to_json` output."""
    fields = dict(data)
    kind = parse_choice(ModelKind, str(fields.pop("kind", "")), "model kind")
    cls: type[MLPConfig] | type[TransformerConfig] = (
        MLPConfig if kind is ModelKind.MLP else TransformerConfig)
    try:
        return cls(**fields)
    except TypeError as err:
        raise ModelError(f"{kind.value} config {data}: {err}") from None


class Schedule(StrEnum):
    """How the learning rate moves over a run (after a linear warm-up from 0)."""

    CONSTANT = "constant"
    """The base rate after the warm-up."""
    COSINE = "cosine"
    """Half a cosine from the base rate down to a tenth of it at the last step."""


class OptimizerKind(StrEnum):
    """The optimizers a run can use."""

    ADAMW = "adamw"
    """torch.optim.AdamW; its moments are saved in every checkpoint."""
    SGD = "sgd"
    """torch.optim.SGD with momentum; the momentum buffer is saved in every checkpoint."""
