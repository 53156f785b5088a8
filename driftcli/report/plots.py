"""The HTML report's figures, drawn with matplotlib and returned as PNG bytes.

Which figures a table gets follows from its layout and columns, never from its name:

- a table with an item column (``tensor``, ``parameter``) and one value per item gets its
  headline by item, one series per group (clip rate by tensor for each cast, gradient cosine
  by parameter for each policy), and the same for each column of ``BY_ITEM_EXTRA`` it has;
- a table with both columns of a ``Scatter`` gets that scatter (error size against bias: one
  point per tensor and cast);
- a table with more than one ``step`` gets its measured columns against step;
- any other table gets its headline per group as bars.

Axes carry the column name and unit; a scale is logarithmic (symmetric-log where values are
zero or negative) when the nonzero values span more than ``DECADES`` decades.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from driftcli.report.load import ALL_ROWS, Table
from driftcli.report.summary import STEP, Layout, layout

DPI = 100
DECADES = 2.0
"""Nonzero magnitudes spanning more than this many decades (5th to 95th percentile) get a
log scale."""
MAX_LABELLED = 60
"""Items named on the axis; beyond this, items are plotted by index and the worst named."""
NAMED_WORST = 5
MAX_SERIES = 10
MAX_STEP_PANELS = 6
BY_ITEM_EXTRA = ("retention",)
"""Columns besides the headline plotted by item where a table has them and they are not its
headline (the gradient tables' retention, for one)."""
MARKERS = "os^Dv<>pP*"


@dataclass(frozen=True)
class Scatter:
    """One column against another, one point per row, where a table has both."""

    x: str
    y: str
    title: str
    caption: str


SCATTERS = (
    Scatter("bias", "rel_error", "error size against bias",
            "One point per tensor and cast (× marks the all-tensors row). Far from the "
            "vertical line the error points along the tensor: a bias that accumulates; high "
            "up near it, a large error that points nowhere in particular."),
)


@dataclass(frozen=True)
class Plot:
    """One figure: a title, the alt text, a caption and the PNG."""

    title: str
    alt: str
    caption: str
    png: bytes


def unit(table: Table, column: str) -> str:
    """The unit shown on an axis, from the column's name and type."""
    if column.endswith("_db"):
        return "dB"
    if table.kinds.get(column) == "int":
        return "count"
    if column.endswith("_rate") or column.startswith("share"):
        return "fraction"
    if column in (STEP,):
        return ""
    doc = table.docs.get(column, "")
    return "ratio" if ("/" in doc or "cosine" in doc.lower()) else ""


def axis_label(table: Table, column: str) -> str:
    """``clip_rate [fraction]``."""
    u = unit(table, column)
    return f"{column} [{u}]" if u else column


def _scale(values: Sequence[float]) -> tuple[str, dict[str, Any]]:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    nz = np.abs(v[v != 0])
    # the span between the 5th and 95th percentile magnitudes: a Gaussian spread around 0
    # (bias) stays linear, rates spread over decades go logarithmic
    if nz.size < 2 or math.log10(np.percentile(nz, 95, method="higher")
                                 / np.percentile(nz, 5, method="lower")) <= DECADES:
        return "linear", {}
    if (v > 0).all():
        return "log", {}
    # linear within the smallest tenth of the magnitudes: a spread around 0 stays one cloud
    # instead of splitting into two far-apart logarithmic tails
    return "symlog", {"linthresh": float(np.percentile(nz, 10, method="lower"))}


def _apply_scale(ax: Any, which: str, values: Sequence[float]) -> str:
    kind, kw = _scale(values)
    (ax.set_xscale if which == "x" else ax.set_yscale)(kind, **kw)
    if kind == "symlog":
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if min(finite) >= 0:  # no empty negative half for rates that are often exactly 0
            (ax.set_xlim if which == "x" else ax.set_ylim)(-kw["linthresh"] / 2, None)
        if which == "x":
            ax.tick_params(axis="x", labelrotation=40)
    return kind


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # lazily: only --html pays for matplotlib

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _series(frame: pd.DataFrame, lay: Layout, drop: Sequence[str] = ()) -> list[
        tuple[str, pd.DataFrame]]:
    """Rows split into series by the group columns that vary, labelled by their values."""
    cols = [c for c in lay.groups if c not in drop and frame[c].nunique(dropna=False) > 1]
    if not cols:
        return [("", frame)]
    labels = frame[cols].astype(object).map(str).agg(" ".join, axis=1)
    return [(label, frame[labels == label]) for label in dict.fromkeys(labels)]


LONG_LABEL = 28
"""Series labels longer than this put the legend under the plot, not beside it."""


def _legend(ax: Any, title: str) -> None:
    _, labels = ax.get_legend_handles_labels()
    if not labels:
        return
    if max(len(label) for label in labels) > LONG_LABEL:  # long cast specs: keep the plot wide
        ax.figure.legend(title=title or None, loc="outside lower center", fontsize="small",
                         title_fontsize="small", frameon=False)
    else:
        ax.legend(title=title or None, loc="upper left", bbox_to_anchor=(1.01, 1),
                  fontsize="small", title_fontsize="small", frameon=False)


def _label(row: pd.Series, columns: Sequence[str]) -> str:
    """``mxfp8_e4m3: `` — the values of the group columns that vary, to name a row's series."""
    values = [str(row[c]) for c in columns if row[c] is not None]
    return " ".join(values) + ": " if values else ""


def _legend_title(frame: pd.DataFrame, lay: Layout, drop: Sequence[str] = ()) -> str:
    return " ".join(c for c in lay.groups if c not in drop
                    and frame[c].nunique(dropna=False) > 1)


def _numeric(frame: pd.DataFrame, column: str) -> pd.Series:
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


def by_item(table: Table, column: str) -> Plot | None:
    """``column`` by item (tensor, parameter), one series per group; None with no values."""
    lay = layout(table)
    item = lay.item
    if item is None:
        return None
    frame = table.display_frame()
    rows = frame[frame[item].astype(object) != ALL_ROWS]
    aggregates = frame[frame[item].astype(object) == ALL_ROWS]
    values = _numeric(rows, column)
    if values.notna().sum() == 0:
        return None
    rows, values = rows[values.notna()], values[values.notna()]  # unmeasured rows: no point
    items = list(dict.fromkeys(rows[item].astype(str)))
    series = _series(frame, lay)
    shown = series[:MAX_SERIES]
    labelled = len(items) <= MAX_LABELLED
    more = ""
    height = 1.6 + 0.24 * len(items) if labelled else 4.5
    fig, ax = _figure(9.5, min(max(height, 3.2), 40))
    pos = {name: i for i, name in enumerate(items)}
    value_axis = "x" if labelled else "y"
    for n, (label, part) in enumerate(shown):
        part_rows = part[part[item].astype(object) != ALL_ROWS]
        v = _numeric(part_rows, column)
        part_rows, v = part_rows[v.notna()], v[v.notna()]
        where = [pos[str(x)] for x in part_rows[item]]
        color = f"C{n % 10}"
        kw = {"marker": MARKERS[n % len(MARKERS)], "color": color, "alpha": 0.8, "s": 22,
              "label": label or column}
        if labelled:
            ax.scatter(v, where, **kw)
        else:
            ax.scatter(where, v, **kw)
        agg = _numeric(part[part[item].astype(object) == ALL_ROWS], column).dropna()
        if not agg.empty:
            line = ax.axvline if labelled else ax.axhline
            line(float(agg.iloc[0]), color=color, linestyle="--", linewidth=1, alpha=0.7)
    kind = _apply_scale(ax, value_axis, list(values.dropna()))
    if labelled:
        ax.set_yticks(range(len(items)), items, fontsize=7 if len(items) > 30 else 8)
        ax.invert_yaxis()  # file order, top to bottom
        ax.set_xlabel(axis_label(table, column))
        ax.set_ylabel(item)
        ax.grid(axis="x", alpha=0.3)
    else:
        ax.set_xlabel(f"{item} index (file order; the {NAMED_WORST} worst are numbered)")
        ax.set_ylabel(axis_label(table, column))
        ax.grid(axis="y", alpha=0.3)
        # numbered rings, names in the caption: names written on a dense plot overlap
        worst = rows.assign(_v=values).sort_values(
            "_v", ascending=not table.higher_is_worse, kind="stable").head(NAMED_WORST)
        for n, (_, r) in enumerate(worst.iterrows(), 1):
            where = (pos[str(r[item])], r["_v"])
            ax.scatter(*where, s=90, facecolors="none", edgecolors="black", linewidths=1)
            ax.annotate(str(n), where, fontsize=8, fontweight="bold", xytext=(5, -3),
                        textcoords="offset points")
        vary = [c for c in lay.groups if frame[c].nunique(dropna=False) > 1]
        named = "; ".join(f"{n} {r[item]} ({_label(r, vary)}{r['_v']:.3g})"
                          for n, (_, r) in enumerate(worst.iterrows(), 1))
        more = f" Worst: {named}." + more
    ax.set_title(f"{table.name}: {column} by {item}")
    _legend(ax, _legend_title(frame, lay))
    if len(series) > MAX_SERIES:
        more += f" Showing the first {MAX_SERIES} of {len(series)} series."
    dashed = (f" Dashed lines: the all-{item}s row ({ALL_ROWS}) of each series."
              if not aggregates.empty else "")
    scale = f" {kind} scale." if kind != "linear" else ""
    doc = table.docs.get(column, "")
    return Plot(f"{table.name}: {column} by {item}",
                f"{column} of each {item} in {table.name}, one series per "
                f"{_legend_title(frame, lay) or 'table'}",
                f"{column}: {doc}.{dashed}{scale}{more}".replace("..", "."), _png(fig))


def scatter(table: Table, spec: Scatter) -> Plot | None:
    """``spec.y`` against ``spec.x``, one point per row, one colour per group."""
    lay = layout(table)
    frame = table.display_frame()
    xs, ys = _numeric(frame, spec.x), _numeric(frame, spec.y)
    ok = xs.notna() & ys.notna() & np.isfinite(xs) & np.isfinite(ys)
    if not ok.any():
        return None
    series = _series(frame, lay)
    fig, ax = _figure(8.5, 5.5)
    for n, (label, part) in enumerate(series[:MAX_SERIES]):
        px, py = _numeric(part, spec.x), _numeric(part, spec.y)
        is_agg = (part[lay.item].astype(object) == ALL_ROWS) if lay.item else pd.Series(
            False, index=part.index)
        color = f"C{n % 10}"
        ax.scatter(px[~is_agg], py[~is_agg], color=color, alpha=0.75, s=24,
                   marker=MARKERS[n % len(MARKERS)], label=label or spec.y)
        if is_agg.any():
            ax.scatter(px[is_agg], py[is_agg], color=color, marker="X", s=90,
                       edgecolors="black", linewidths=0.6)
    ax.axvline(0, color="grey", linewidth=0.8)
    xkind = _apply_scale(ax, "x", list(xs[ok]))
    ykind = _apply_scale(ax, "y", list(ys[ok]))
    ax.set_xlabel(axis_label(table, spec.x) + "  (← shrinks the tensor · grows it →)")
    ax.set_ylabel(axis_label(table, spec.y))
    ax.set_title(f"{table.name}: {spec.title}")
    ax.grid(alpha=0.3)
    _legend(ax, _legend_title(frame, lay))
    scales = "; ".join(f"{a} axis {k}" for a, k in (("x", xkind), ("y", ykind)) if k != "linear")
    return Plot(f"{table.name}: {spec.title}",
                f"{spec.y} against {spec.x} in {table.name}, one point per row",
                spec.caption + (f" Scales: {scales}." if scales else ""), _png(fig))


def by_step(table: Table) -> list[Plot]:
    """Each measured column against step (headline first), one line per group; only the
    aggregate rows where the table has them."""
    lay = layout(table)
    frame = table.display_frame()
    if lay.has_aggregate and lay.item is not None:
        frame = frame[frame[lay.item].astype(object) == ALL_ROWS]
    measured = [c for c in table.columns if c not in table.keys and c != STEP
                and pd.api.types.is_numeric_dtype(frame[c].dtype)
                and not pd.api.types.is_bool_dtype(frame[c].dtype)
                and _numeric(frame, c).notna().any()]
    measured.sort(key=lambda c: c != table.headline)  # stable: headline first
    plots = []
    drop = (STEP,)
    series = _series(frame, lay, drop)
    title = _legend_title(frame, lay, drop)
    for column in measured[:MAX_STEP_PANELS]:
        fig, ax = _figure(8.5, 4.2)
        for n, (label, part) in enumerate(series[:MAX_SERIES]):
            part = part.sort_values(STEP)
            ax.plot(_numeric(part, STEP), _numeric(part, column), marker=".",
                    color=f"C{n % 10}", label=label or column)
        kind = _apply_scale(ax, "y", list(_numeric(frame, column).dropna()))
        ax.set_xlabel("step")
        ax.set_ylabel(axis_label(table, column))
        ax.set_title(f"{table.name}: {column} against step")
        ax.grid(alpha=0.3)
        _legend(ax, title)
        doc = table.docs.get(column, "")
        plots.append(Plot(f"{table.name}: {column} against step",
                          f"{column} at each step of {table.name}, one line per "
                          f"{title or 'table'}",
                          f"{column}: {doc}." + (f" {kind} scale." if kind != "linear" else ""),
                          _png(fig)))
    return plots


def by_group(table: Table) -> Plot | None:
    """The headline per group as bars: the total for a count, the worst value otherwise."""
    lay = layout(table)
    frame = table.display_frame()
    head = table.headline
    values = _numeric(frame, head)
    if values.notna().sum() == 0:
        return None
    count = table.kinds.get(head) == "int"
    if lay.groups:
        labels = frame[list(lay.groups)].astype(object).map(str).agg(" ".join, axis=1)
    else:
        labels = pd.Series(table.name, index=frame.index)
    grouped = values.groupby(labels, sort=False)
    worst = grouped.max() if table.higher_is_worse else grouped.min()
    bars = grouped.sum() if count else worst
    what = f"total {head}" if count else f"{'max' if table.higher_is_worse else 'min'} {head}"
    fig, ax = _figure(max(5.0, 0.6 * len(bars) + 2), 4.0)
    ax.bar(range(len(bars)), bars.to_numpy(), color="C0")
    ax.set_xticks(range(len(bars)), [str(i) for i in bars.index], rotation=30, ha="right")
    if (bars == 0).all():
        ax.set_ylim(0, 1)
    else:
        _apply_scale(ax, "y", list(bars))
    ax.set_xlabel(" ".join(lay.groups) or "table")
    ax.set_ylabel(f"{what} [{unit(table, head) or 'value'}]")
    ax.set_title(f"{table.name}: {what} by {' '.join(lay.groups) or 'table'}")
    ax.grid(axis="y", alpha=0.3)
    doc = table.docs.get(head, "")
    return Plot(f"{table.name}: {what} by {' '.join(lay.groups) or 'table'}",
                f"bar chart of {what} for each {' '.join(lay.groups) or 'table'} of "
                f"{table.name}", f"{head}: {doc}.", _png(fig))


def figures(table: Table) -> list[Plot]:
    """Every figure ``table`` gets (see the module docstring)."""
    lay = layout(table)
    stepped = STEP in table.columns and table.frame[STEP].nunique() > 1
    plots: list[Plot | None] = []
    if stepped:
        plots += by_step(table)
    elif lay.item is not None:
        extra = [c for c in BY_ITEM_EXTRA if c in table.columns and c != table.headline]
        plots += [by_item(table, c) for c in (table.headline, *extra)]
    plots += [scatter(table, s) for s in SCATTERS if s.x in table.columns
              and s.y in table.columns]
    if not stepped and lay.item is None:
        plots.append(by_group(table))
    return [p for p in plots if p is not None]
