"""The figures of ``drift.monitor``'s tables on the report's page (docs/monitor.md#the-report):
per cast, a layer × step heatmap of the table's headline and its time series per layer, each
layer's value the worst over its operands and directions at that step (the highest, for a
headline where higher is worse). The tables themselves are read by
:func:`driftcli.report.load.load`, their parts joined, so ``--fail-on`` rules see every row."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pandas as pd

from driftcli.report.load import Table
from driftcli.report.plots import COLOURS, DPI, Note, Plot

PREFIX = "monitor-"
"""The monitor's tables are named ``monitor-MEASUREMENT``."""
MAX_LAYERS = 60
"""Rows of one heatmap: the layers beyond are left out (and said)."""
MAX_LINES = 8
"""Layers drawn as lines against step: those with the worst values."""
MAX_CASTS = 6
"""Casts drawn per table."""


def is_monitor(table: Table) -> bool:
    """Whether ``table`` is one of ``drift.monitor``'s."""
    return table.name.startswith(PREFIX) and "step" in table.columns


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # lazily: only --html pays for matplotlib

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def layer_steps(frame: pd.DataFrame, column: str, worse_high: bool) -> pd.DataFrame:
    """Layers (in the order they ran) × steps (ascending): each cell the worst ``column``
    over the layer's operands and directions at that step; NaN where nothing was measured."""
    values = pd.to_numeric(frame[column], errors="coerce")
    part = frame.assign(_v=values)
    grid = part.pivot_table(index="layer", columns="step", values="_v",
                            aggfunc="max" if worse_high else "min", sort=False)
    return grid.reindex(index=list(dict.fromkeys(part["layer"])), columns=sorted(grid.columns))


def _heatmap(grid: pd.DataFrame, title: str, label: str) -> Any:
    values = grid.to_numpy(dtype=float)
    fig, ax = _figure(8.5, max(2.5, 0.28 * len(grid.index) + 1.5))
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest",
                      cmap="viridis")
    step = max(1, len(grid.columns) // 16)
    ax.set_xticks(range(0, len(grid.columns), step), [str(c) for c in grid.columns[::step]])
    ax.set_yticks(range(len(grid.index)), [str(v) for v in grid.index])
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=label)
    return fig


def _lines(grid: pd.DataFrame, title: str, label: str, worse_high: bool) -> tuple[Any, str]:
    worst = grid.max(axis=1) if worse_high else -grid.min(axis=1)
    chosen = list(worst.dropna().sort_values(ascending=False, kind="stable").index[:MAX_LINES])
    fig, ax = _figure(8.5, 4.2)
    for n, layer in enumerate(chosen):
        row = grid.loc[layer].dropna()
        ax.plot([int(s) for s in row.index], row.to_numpy(dtype=float), marker="o",
                markersize=3, color=COLOURS[n % len(COLOURS)], label=str(layer))
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if chosen:
        ax.legend(fontsize=8, loc="best")
    left = len(worst.dropna()) - len(chosen)
    return fig, f" The {len(chosen)} layers with the worst values; {left} more." if left else ""


def monitor_maps(table: Table) -> list[Plot | Note]:
    """Per cast of a monitor table: its headline as a layer × step heatmap and as time series
    per layer."""
    if not is_monitor(table):
        return []
    frame = table.display_frame()
    if "error" in frame:
        frame = frame[frame["error"].isna()]
    head, worse = table.headline, table.higher_is_worse
    if frame.empty or head not in frame:
        return [Note(f"{table.name}: by layer and step", "No operand was measured.")]
    casts: list[Any] = list(dict.fromkeys(frame["cast"])) if "cast" in frame else [None]
    doc = table.docs.get(head, "")
    how = "highest" if worse else "lowest"
    out: list[Plot | Note] = []
    for cast in casts[:MAX_CASTS]:
        part = frame if cast is None else frame[frame["cast"] == cast]
        grid = layer_steps(part, head, worse)
        under = "" if cast is None else f" under {cast}"
        cut = ""
        if len(grid.index) > MAX_LAYERS:
            grid, cut = grid.iloc[:MAX_LAYERS], f" The first {MAX_LAYERS} of {len(grid)} layers."
        title = f"{table.name}: {head} by layer and step{under}"
        out.append(Plot(title, f"heatmap of {head} per layer and step{under}",
                        f"Each cell the {how} {head} over the layer's operands and directions "
                        f"at that step; blank: not sampled. {head}: {doc}." + cut,
                        _png(_heatmap(grid, title, head))))
        title = f"{table.name}: {head} per layer over the run{under}"
        fig, left = _lines(grid, title, head, worse)
        out.append(Plot(title, f"line chart of {head} against step, one line per layer{under}",
                        f"Each point the {how} {head} over the layer's operands and "
                        f"directions.{left}", _png(fig)))
    if len(casts) > MAX_CASTS:
        out.append(Note(f"{table.name}: more casts", f"{len(casts) - MAX_CASTS} more, not drawn."))
    return out
