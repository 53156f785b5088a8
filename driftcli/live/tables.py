"""The tables of :func:`driftcli.live.monitor.monitor`: one per measurement, each row one
operand of one sampled step in one direction (and under one cast), and how a monitor folder
is read back (docs/monitor.md#tables-durable-as-the-run-goes)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from driftcli.errors import DriftError
from driftcli.io.tables import column, read_table, schema_of
from driftcli.measures.block_stats import BlockStatsRow
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.measures.error_bias import ErrorBiasRow
from driftcli.measures.underflow_rate import UnderflowRateRow

MANIFEST = "monitor.json"
"""The file that makes a folder a monitor folder: what was monitored, written at the start."""


class Direction(StrEnum):
    """Which matmul of the training step reads the operand, and so along which axis a policy
    casts it (docs/monitor.md#directions)."""

    FORWARD = "forward"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


class Measurement(StrEnum):
    """What the monitor measures: the per-cast measurements of the commands, and plain
    statistics of the operand itself (no cast)."""

    CLIP_RATE = "clip-rate"
    UNDERFLOW_RATE = "underflow-rate"
    ERROR_BIAS = "error-bias"
    BLOCK_STATS = "block-stats"
    STATS = "stats"


_DIRECTION_DOC = "Matmul reading the operand: forward, dgrad or wgrad (cast along its contraction)"


@dataclass(frozen=True)
class MonitorClipRateRow(ClipRateRow):
    """clip-rate of one operand, in one direction, at one step, under one cast."""

    TABLE: ClassVar[str] = "monitor-clip-rate"
    KEYS: ClassVar[tuple[str, ...]] = ("step", "tensor", "direction", "cast")

    direction: str = column(_DIRECTION_DOC)


@dataclass(frozen=True)
class MonitorUnderflowRateRow(UnderflowRateRow):
    """underflow-rate of one operand, in one direction, at one step, under one cast."""

    TABLE: ClassVar[str] = "monitor-underflow-rate"
    KEYS: ClassVar[tuple[str, ...]] = ("step", "tensor", "direction", "cast")

    direction: str = column(_DIRECTION_DOC)


@dataclass(frozen=True)
class MonitorErrorBiasRow(ErrorBiasRow):
    """error-bias of one operand, in one direction, at one step, under one cast."""

    TABLE: ClassVar[str] = "monitor-error-bias"
    KEYS: ClassVar[tuple[str, ...]] = ("step", "tensor", "direction", "cast")

    direction: str = column(_DIRECTION_DOC)


@dataclass(frozen=True, kw_only=True)  # after block-stats' defaulted cast_name
class MonitorBlockStatsRow(BlockStatsRow):
    """block-stats of one operand, in one direction, at one step, under one cast: its blocks
    run along that matmul's contraction axis."""

    TABLE: ClassVar[str] = "monitor-block-stats"
    KEYS: ClassVar[tuple[str, ...]] = ("step", "tensor", "direction", "cast")

    direction: str = column(_DIRECTION_DOC + "; the blocks run along it (block-stats' rows of "
                            "the operand turned so that axis is last)")
    role: str = column("The operand: activation, weight or gradient")
    operand: str = column("The matmul side it feeds, pass.side (forward.lhs)")
    step: int = column("Training step")


STATS_BLOCK = 32
"""The block of the blockwise dynamic range in the stats table (MX's)."""


@dataclass(frozen=True)
class MonitorStatsRow:
    """Plain statistics of one operand, in one direction, at one step: no cast."""

    TABLE: ClassVar[str] = "monitor-stats"
    KEYS: ClassVar[tuple[str, ...]] = ("step", "tensor", "direction")
    HEADLINE: ClassVar[str] = "dynamic_range"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    source: str = column("The monitor's name")
    tensor: str = column("Operand name, as drift capture names it (fc1/activation)")
    role: str = column("The operand: activation, weight or gradient")
    layer: str = column("Layer (module) running the matmul")
    operand: str = column("The matmul side it feeds, pass.side (forward.lhs)")
    step: int = column("Training step")
    direction: str = column(_DIRECTION_DOC)
    dtype: str = column("Stored dtype")
    shape: str = column("Shape as a JSON list, as the direction reads it")
    numel: int = column("Elements")
    n_nonfinite: int = column("Elements that are NaN or ±inf")
    amax: float | None = column("Largest finite magnitude; null with no finite element")
    amin: float | None = column("Smallest nonzero finite magnitude; null with none")
    dynamic_range: int | None = column("floor(log2 amax) - floor(log2 amin), from the bits "
                                       "(binades)")
    block: int = column("Elements per block of the blockwise range, along the direction's "
                        "contraction axis")
    block_range_median: int | None = column(
        "Lower median over the finite blocks holding a nonzero value of each block's dynamic "
        "range (binades); null when the axis is not a multiple of block")
    block_range_max: int | None = column("Largest dynamic range of a block (binades)")


ROW_TYPES: dict[Measurement, type[Any]] = {
    Measurement.CLIP_RATE: MonitorClipRateRow,
    Measurement.UNDERFLOW_RATE: MonitorUnderflowRateRow,
    Measurement.ERROR_BIAS: MonitorErrorBiasRow,
    Measurement.BLOCK_STATS: MonitorBlockStatsRow,
    Measurement.STATS: MonitorStatsRow,
}
"""Each measurement's table."""


def table_parts(folder: Path) -> list[Path]:
    """A table's parts in step order (a part being written has a temporary name)."""
    return sorted(folder.glob("part-*.parquet"))


def row_columns(row: Any) -> dict[str, Any]:
    """A row's columns (``dataclasses.asdict`` deep-copies every value: slower, and no row
    holds a container)."""
    return {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}


def rows_frame(row_type: type[Any], rows: list[Any]) -> Any:
    """Rows as the table reads back: the table's schema, then pandas."""
    import pyarrow as pa

    return pa.Table.from_pylist([row_columns(r) for r in rows],
                                schema=schema_of(row_type)).to_pandas()


def read_monitor(folder: str | Path) -> dict[str, Any]:
    """Every table of a monitor folder, by measurement, as pandas DataFrames (the parts
    concatenated in step order); a part still being written when the run stopped is not
    there, every earlier one is."""
    import pandas as pd

    root = Path(folder)
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise DriftError(f"{root} is not a monitor folder (no {MANIFEST}); give the out= "
                         "folder of drift.monitor")
    tables = json.loads(manifest.read_text(encoding="utf-8"))["tables"]
    out: dict[str, Any] = {}
    for m, table in tables.items():
        frames = [read_table(p)[0] for p in table_parts(root / table)]
        out[m] = (pd.concat(frames, ignore_index=True) if frames
                  else rows_frame(ROW_TYPES[Measurement(m)], []))
    return out
