"""The small reference models ``drift train``, ``drift probe`` and ``drift dump`` use: a tanh MLP
language model and a small transformer, byte-level, with checkpoints that rebuild them alone::

    from driftcli.models import MLPConfig, TrainConfig, train, load_checkpoint

    result = train(TrainConfig(MLPConfig(hidden=64), policy="mxfp8_e4m3", steps=100),
                   "runs/mx", text="input.txt")
    ck = load_checkpoint(result.checkpoints[-1])     # ck.model, ck.config, ck.state
"""

from driftcli.lazy import exports

_API = {
    **dict.fromkeys(("DriftCheckpoint", "is_drift_checkpoint", "load_checkpoint",
                     "save_checkpoint"), "driftcli.models.checkpoint"),
    **dict.fromkeys(("VOCAB", "Activation", "MLPConfig", "ModelConfig", "ModelKind",
                     "OptimizerKind", "Schedule", "TransformerConfig"),
                    "driftcli.models.config"),
    **dict.fromkeys(("ByteTokenizer", "build_model", "count_parameters", "next_byte_loss"),
                    "driftcli.models.nets"),
    **dict.fromkeys(("TrainConfig", "TrainResult", "TrainRow", "train"),
                    "driftcli.models.training"),
}
"""Each name and its module, imported on first use (the configs need no torch)."""

__getattr__ = exports(globals(), _API)
__all__ = sorted(_API)
