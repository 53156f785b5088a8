"""The small reference models ``drift train``, ``drift probe`` and ``drift dump`` use: a tanh MLP
language model and a small transformer, byte-level, with checkpoints that rebuild them alone::

    from driftcli.models import MLPConfig, build_model, load_checkpoint

    model = build_model(MLPConfig(hidden=64))
    ck = load_checkpoint("runs/mx/step-000100.safetensors")   # ck.model, ck.config, ck.state

Training runs of them are :mod:`driftcli.runs`.
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
}
"""Each name and its module, imported on first use (the configs need no torch)."""

__getattr__ = exports(globals(), _API)
__all__ = sorted(_API)
