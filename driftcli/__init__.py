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
"""

from driftcli.arith.matmul import MatmulSpec, matmul
from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import ArithmeticPolicy, BackwardState, get_policy, policy_from_toml
from driftcli.cast import PRESETS, Cast, parse_cast, quantize
from driftcli.errors import DriftError
from driftcli.formats import FORMATS, Format, get_format
from driftcli.io.capture import capture
from driftcli.measures.grad_cosine import grad_cosine
from driftcli.modes import Overflow, Rounding
from driftcli.rounding import add, multiply, round_to_format, stochastic_round

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "PRESETS",
    "ArithmeticPolicy",
    "BackwardState",
    "Cast",
    "DriftError",
    "Format",
    "MatmulSpec",
    "Overflow",
    "Rounding",
    "__version__",
    "add",
    "arithmetic",
    "capture",
    "get_format",
    "get_policy",
    "grad_cosine",
    "matmul",
    "multiply",
    "parse_cast",
    "policy_from_toml",
    "quantize",
    "round_to_format",
    "stochastic_round",
]
