"""The heatmaps of ``drift block-stats``' tables on the report's page: from ``block-scales``,
per cast and direction, tensors (layers where a dump names them) × scale exponent, each cell
the share of the tensor's blocks whose scale is 2**exponent's binade; from ``block-stats``,
tensors × cast and direction, each cell the share of blocks that clip."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from driftcli.report.load import Table
from driftcli.report.plots import DPI, Note, Plot, as_text

MAX_TENSORS = 60
"""Rows of one heatmap: beyond this, the worst tensors by the measurement are kept (and it
is said)."""
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
    # upright labels one column (0.35 inch) apart, each a line high: never overlapping,
    # however long a cast's spec is
    step = max(1, len(grid.columns) // 32)
    ax.set_xticks(range(0, len(grid.columns), step),
                  [str(c) for c in grid.columns[::step]], rotation=90)
    ax.set_yticks(range(len(grid.index)), [str(v) for v in grid.index])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tensor")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=label)
    return fig


def _worst(grid: pd.DataFrame, score: pd.Series, what: str) -> tuple[pd.DataFrame, str]:
    """``grid`` whole, or beyond :data:`MAX_TENSORS` rows the rows of the highest ``score``
    (the measurement, never the name), worst first, with the sentence that says so."""
    if len(grid.index) <= MAX_TENSORS:
        return grid, ""
    ranked = score.reindex(grid.index).fillna(-np.inf).sort_values(ascending=False,
                                                                   kind="stable")
    return (grid.loc[ranked.index[:MAX_TENSORS]],
            f" The {MAX_TENSORS} of {len(grid.index)} tensors with the largest {what}, worst "
            "first.")


GAP = 4
"""Absent binades after which an exponent axis breaks: an all-zero block's scale sits at the
scale format's floor (E8M0's -127), far below the others, and an axis from there up would
leave each tensor's blocks a sliver."""
BREAK = "⋯"
"""The column where an exponent axis skips binades that hold no block."""


def exponent_axis(present: Sequence[int]) -> tuple[list[int | str], list[str]]:
    """The columns of an exponent axis over the exponents ``present``: each run of them (no
    more than :data:`GAP` binades apart) whole, a :data:`BREAK` between runs; and the ranges
    skipped (``"-126 to -10"``)."""
    runs: list[list[int]] = []
    for e in sorted(set(present)):
        if runs and e - runs[-1][1] <= GAP:
            runs[-1][1] = e
        else:
            runs.append([e, e])
    columns: list[int | str] = []
    skipped = []
    for n, (lo, hi) in enumerate(runs):
        if n:
            columns.append(BREAK)
            skipped.append(f"{runs[n - 1][1] + 1} to {lo - 1}")
        columns += range(lo, hi + 1)
    return columns, skipped


@as_text
def exponent_maps(table: Table) -> list[Plot | Note]:
    """Per cast and direction of a ``block-scales`` table: tensors × scale exponent, over the
    exponents present; beyond :data:`MAX_TENSORS`, the tensors whose scales spread widest."""
    frame = table.display_frame()
    frame = frame.assign(_row=_rows(frame))
    out: list[Plot | Note] = []
    pairs = list(dict.fromkeys(zip(frame["cast"], frame["direction"], strict=True)))
    for cast, direction in pairs[:MAX_MAPS]:
        part = frame[(frame["cast"] == cast) & (frame["direction"] == direction)]
        counts = part.pivot_table(index="_row", columns="scale_exponent", values="blocks",
                                  aggfunc="sum", sort=False)
        columns, skipped = exponent_axis([int(e) for e in part["scale_exponent"]])
        counts = counts.reindex(index=list(dict.fromkeys(part["_row"])), columns=columns)
        shares = counts.div(counts.sum(axis=1), axis=0)
        exps = part.groupby("_row", sort=False)["scale_exponent"]
        shares, cut = _worst(shares, exps.max() - exps.min(), "spread of scale exponents")
        gaps = "".join(f" {g}: no blocks, skipped ({BREAK})." for g in skipped)
        title = f"{table.name}: scale exponents under {cast} ({direction})"
        fig = _heatmap(shares, title, "floor(log2 scale)", "share of the tensor's blocks")
        out.append(Plot(title, f"heatmap of the share of each tensor's blocks per scale exponent "
                               f"under {cast}, blocks along {direction}",
                        "Each row one tensor; blank cells hold no block." + gaps + cut,
                        _png(fig)))
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
    grid, cut = _worst(grid, grid.max(axis=1), "share of clipping blocks in any cast")
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
