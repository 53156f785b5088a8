"""The small reference models ``drift train``, ``drift probe`` and ``drift dump`` use: a tanh MLP
language model and a small transformer, byte-level, with checkpoints that rebuild them alone::

    from driftcli.models import MLPConfig, TrainConfig, train, load_checkpoint

    result = train(TrainConfig(MLPConfig(hidden=64), policy="mxfp8_e4m3", steps=100),
                   "runs/mx", text="input.txt")
    ck = load_checkpoint(result.checkpoints[-1])     # ck.model, ck.config, ck.state
"""

from driftcli.models.checkpoint import (
    DriftCheckpoint,
    is_drift_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from driftcli.models.nets import (
    VOCAB,
    Activation,
    ByteTokenizer,
    MLPConfig,
    ModelConfig,
    ModelKind,
    TransformerConfig,
    build_model,
    count_parameters,
    next_byte_loss,
)
from driftcli.models.training import (
    OptimizerKind,
    Schedule,
    TrainConfig,
    TrainResult,
    TrainRow,
    train,
)

__all__ = [
    "VOCAB",
    "Activation",
    "ByteTokenizer",
    "DriftCheckpoint",
    "MLPConfig",
    "ModelConfig",
    "ModelKind",
    "OptimizerKind",
    "Schedule",
    "TrainConfig",
    "TrainResult",
    "TrainRow",
    "TransformerConfig",
    "build_model",
    "count_parameters",
    "is_drift_checkpoint",
    "load_checkpoint",
    "next_byte_loss",
    "save_checkpoint",
    "train",
]
