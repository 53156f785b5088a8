"""drift: measure what low-precision formats, scaling and rounding do to real tensors.

The public API::

    import driftcli as drift
    drift.FORMATS["float8_e4m3fn"]                       # a Format
    drift.round_to_format(x, "float8_e4m3fn", rounding="rne", overflow="saturate")
"""

from driftcli.errors import DriftError
from driftcli.formats import FORMATS, Format, get_format
from driftcli.modes import Overflow, Rounding
from driftcli.rounding import add, multiply, round_to_format, stochastic_round

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "DriftError",
    "Format",
    "Overflow",
    "Rounding",
    "__version__",
    "add",
    "get_format",
    "multiply",
    "round_to_format",
    "stochastic_round",
]
