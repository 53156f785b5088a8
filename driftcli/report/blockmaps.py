"""The heatmaps of ``drift block-stats``' tables on the report's page: from ``block-scales``,
per cast and direction, tensors (layers where a dump names them) × scale exponent, each cell
the share of the tensor's blocks whose scale is 2**exponent's binade; from ``block-stats``,
tensors × cast and direction, each cell the share of blocks that clip."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pandas as pd

from driftcli.report.load import Table
from driftcli.report.plots import DPI, Note, Plot, as_text

MAX_TENSORS = 60
"""Rows of one heatmap: the first tensors of the table beyond this are left out (and said)."""
MAX_MAPS = 8
"""Scale-exponent heatmaps on one page (casts × directions)."""


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # lazily: only --html pays for matplotlib

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _rows(frame: pd.DataFrame) -> pd.Series:
    """Each row's heatmap row: its layer where a dump named one, else its tensor."""
    layer = frame["layer"] if "layer" in frame else pd.Series(None, index=frame.index)
    return layer.where(layer.notna(), frame["tensor"]).astype(str)


def _heatmap(grid: pd.DataFrame, title: str, xlabel: str, label: str) -> Any:
    values = grid.to_numpy(dtype=float)
    fig, ax = _figure(max(6.0, 0.35 * len(grid.columns) + 3.5),
                      max(2.5, 0.28 * len(grid.index) + 1.5))
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest",
                      cmap="viridis", vmin=0.0, vmax=1.0)
    step = max(1, len(grid.columns) // 16)
    ax.set_xticks(range(0, len(grid.columns), step),
                  [str(c) for c in grid.columns[::step]], rotation=30, ha="right")
    ax.set_yticks(range(len(grid.index)), [str(v) for v in grid.index])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tensor")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=label)
    return fig


def _cut(grid: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    if len(grid.index) <= MAX_TENSORS:
        return grid, ""
    return grid.iloc[:MAX_TENSORS], f" The first {MAX_TENSORS} of {len(grid.index)} tensors."


@as_text
def exponent_maps(table: Table) -> list[Plot | Note]:
    """Per cast and direction of a ``block-scales`` table: tensors × scale exponent."""
    frame = table.display_frame()
    frame = frame.assign(_row=_rows(frame))
    out: list[Plot | Note] = []
    pairs = list(dict.fromkeys(zip(frame["cast"], frame["direction"], strict=True)))
    for cast, direction in pairs[:MAX_MAPS]:
        part = frame[(frame["cast"] == cast) & (frame["direction"] == direction)]
        counts = part.pivot_table(index="_row", columns="scale_exponent", values="blocks",
                                  aggfunc="sum", sort=False)
        counts = counts.reindex(index=list(dict.fromkeys(part["_row"])),
                                columns=range(int(part["scale_exponent"].min()),
                                              int(part["scale_exponent"].max()) + 1))
        shares = counts.div(counts.sum(axis=1), axis=0)
        shares, cut = _cut(shares)
        title = f"{table.name}: scale exponents under {cast} ({direction})"
        fig = _heatmap(shares, title, "floor(log2 scale)", "share of the tensor's blocks")
        out.append(Plot(title, f"heatmap of the share of each tensor's blocks per scale exponent "
                               f"under {cast}, blocks along {direction}",
                        "Each row one tensor; blank cells hold no block." + cut, _png(fig)))
    if len(pairs) > MAX_MAPS:
        out.append(Note(f"{table.name}: more casts",
                        f"{len(pairs) - MAX_MAPS} more cast and direction pairs, not drawn."))
    return out


@as_text
def clip_map(table: Table) -> Plot | Note:
    """Tensors × (cast, direction) of a ``block-stats`` table: the share of blocks that clip."""
    frame = table.display_frame()
    frame = frame[frame["error"].isna()] if "error" in frame else frame
    if frame.empty:
        return Note(f"{table.name}: clipped blocks", "No tensor was measured.")
    frame = frame.assign(_row=_rows(frame), _col=frame["cast"].astype(str) + " " +
                         frame["direction"].astype(str))
    grid = frame.pivot_table(index="_row", columns="_col", values="clipped_block_share",
                             aggfunc="first", sort=False)
    grid = grid.reindex(index=list(dict.fromkeys(frame["_row"])),
                        columns=list(dict.fromkeys(frame["_col"])))
    grid, cut = _cut(grid)
    title = f"{table.name}: share of blocks that clip, by tensor"
    fig = _heatmap(grid, title, "cast and direction", "clipped_block_share")
    return Plot(title, "heatmap of the share of clipping blocks per tensor, cast and direction",
                "clipped_block_share: clipped_blocks / n_blocks." + cut, _png(fig))


@as_text
def block_maps(table: Table) -> list[Plot | Note]:
    """The heatmaps ``table`` gets: none unless it is one of block-stats' tables."""
    if table.name == "block-scales":
        return exponent_maps(table)
    if table.name == "block-stats":
        return [clip_map(table)]
    return []
