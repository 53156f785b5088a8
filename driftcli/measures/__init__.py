"""Measurements: one module per measurement, each with one row type; this registry maps a
command name to its measure."""

from driftcli.measures import cast_diff, clip_rate, error_bias, underflow_rate
from driftcli.measures.common import Measure

MEASURES: dict[str, Measure] = {
    m.MEASURE.name: m.MEASURE for m in (clip_rate, underflow_rate, error_bias, cast_diff)
}

__all__ = ["MEASURES", "Measure"]
