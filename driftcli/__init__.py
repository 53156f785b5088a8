"""drift: measure what low-precision formats, scaling and rounding do to real tensors.

The public API::

    import driftcli as drift
    drift.FORMATS["float8_e4m3fn"]                       # a Format
    drift.round_to_format(x, "float8_e4m3fn", rounding="rne", overflow="saturate")
    c = drift.parse_cast("mxfp8_e4m3")                   # a Cast from a preset or spec string
    q = drift.quantize(x, c)                              # dequantized, same shape and dtype
    info = drift.quantize(x, c, return_info=True)        # plus masks and scales
    with drift.arithmetic("mxfp8_e4m3"):                 # every matmul's operands cast,
        loss = model(batch); loss.backward()              # forward and backward
    with drift.capture(model, "dump.safetensors"):       # record every matmul operand
        model(batch).sum().backward()
    df = drift.measure(model, ["mxfp8_e4m3", "nvfp4"])  # clip-rate's rows, as a DataFrame
    with drift.monitor(model, ["mxfp8_e4m3"], out="mon") as mon:  # live, in training
        ...; mon.step()
"""

from driftcli._version import __version__
from driftcli.lazy import exports

_API = {
    "FORMATS": "driftcli.records.formats",
    "Format": "driftcli.records.formats",
    "get_format": "driftcli.records.formats",
    "PRESETS": "driftcli.records.presets",
    "Cast": "driftcli.records.cast",
    "parse_cast": "driftcli.records.castspec",
    "Overflow": "driftcli.records.modes",
    "Rounding": "driftcli.records.modes",
    "DriftError": "driftcli.errors",
    "quantize": "driftcli.casts.quantization",
    "add": "driftcli.casts.rounding",
    "multiply": "driftcli.casts.rounding",
    "round_to_format": "driftcli.casts.rounding",
    "stochastic_round": "driftcli.casts.rounding",
    "MatmulSpec": "driftcli.arith.matmul",
    "matmul": "driftcli.arith.matmul",
    "arithmetic": "driftcli.arith.mode",
    "ArithmeticPolicy": "driftcli.arith.policy",
    "BackwardState": "driftcli.arith.policy",
    "get_policy": "driftcli.arith.policy",
    "policy_from_toml": "driftcli.arith.policy",
    "capture": "driftcli.io.capture",
    "grad_cosine": "driftcli.measures.grad_cosine",
    "measure": "driftcli.api",
    "monitor": "driftcli.live.monitor",
}
"""Each public name and its module, imported on first use (see :mod:`driftcli.lazy`)."""

__getattr__ = exports(globals(), _API)
__all__ = ["__version__", *sorted(_API)]
