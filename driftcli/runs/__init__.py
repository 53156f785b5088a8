"""Runs of the reference models: training under a policy (``drift train``), one step's matmul
operands dumped (``drift dump``), and other arithmetic probed at a run's checkpoints
(``drift probe``). This layer runs models and measures them, so it sits above both::

    from driftcli.models import MLPConfig
    from driftcli.runs import TrainConfig, train

    result = train(TrainConfig(MLPConfig(hidden=64), policy="mxfp8_e4m3", steps=100),
                   "runs/mx", text="input.txt")
"""

from driftcli.lazy import exports

_API = {
    **dict.fromkeys(("TrainConfig", "TrainResult", "TrainRow", "train"),
                    "driftcli.runs.training"),
    "dump_operands": "driftcli.runs.dump",
    "ProbeRow": "driftcli.runs.probe",
}
"""Each name and its module, imported on first use."""

__getattr__ = exports(globals(), _API)
__all__ = sorted(_API)
