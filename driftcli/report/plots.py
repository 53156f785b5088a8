"""The HTML report's figures, drawn with matplotlib and returned as PNG bytes.

Which figures a table gets follows from its layout and columns, never from its name:

- a table with an item column (``tensor``, ``parameter``) and one value per item gets its
  headline by item, one series per group (clip rate by tensor for each cast, gradient cosine
  by parameter for each policy), and the same for each column of ``BY_ITEM_EXTRA`` it has;
- a table with both columns of a ``Scatter`` gets that scatter (error size against bias: one
  point per tensor and cast);
- a table with more than one ``step`` key gets its measured columns against step; where it also
  has a ``layer`` key column with more than ``MAX_LAYER_LINES`` layers (a line per layer would
  be unreadable), each measured column is a layer × step heatmap instead, one per series of
  the other group columns (a cast, a policy);
- any other table gets its headline per group as bars.

Axes carry the column name and unit; a scale is logarithmic (symmetric-log where values are
zero or negative) when the nonzero values span more than ``DECADES`` decades.

What a reader of one page should never have to guess:

- a name (cast, policy) has one colour and marker on the whole page (:class:`Palette`);
- no series hides another. By item, the series sit side by side within each item's row, as in
  a grouped dot plot: the value axis stays exact and every marker is seen, even where casts
  agree (two MX scale rules often give the same blocks). In a scatter, a point drawn where an
  earlier series already has one is an open ring around it, larger for each such series;
  lines (and the dashed all-rows lines) that coincide are drawn with interleaved dashes, so
  each colour shows. A series whose values equal an earlier one's everywhere says so in the
  legend and the caption ("same values as ...");
- the axes leave ``PAD`` of their span (in the axis's own scale) beyond the extreme values,
  so a marker there is drawn whole, not cut by the frame;
- what would draw nothing is said in a sentence (a :class:`Note`) instead: columns constant
  over a run's steps (its seed, a fixed learning rate), a bar chart whose bars are all 0.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np
import pandas as pd

from driftcli.report.display import fmt
from driftcli.report.load import ALL_ROWS, Table
from driftcli.report.summary import STEP, Layout, layout, plain

DPI = 100
DECADES = 2.0
"""Nonzero magnitudes spanning more than this many decades (5th to 95th percentile) get a
log scale."""
MAX_LABELLED = 60
"""Items named on the axis; beyond this, items are plotted against their size (:data:`SIZE`,
or their index in the file where a table has no size) and the worst named."""
SIZE = "numel"
"""The column of an item's size: its elements."""
NAMED_WORST = 5
MAX_SERIES = 10
MAX_STEP_PANELS = 6
LAYER = "layer"
MAX_LAYER_LINES = 4
"""Layers drawn as lines against step; beyond, a layer × step heatmap."""
BY_ITEM_EXTRA = ("retention",)
"""Columns besides the headline plotted by item where a table has them and they are not its
headline (the gradient tables' retention, for one)."""
BAR_LABEL = 32
"""Longest group label written under a bar; longer ones number the bars of a horizontal chart
and are named in its caption."""
MARKERS = "os^Dv<>pP*"
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
"""matplotlib's tab10, written out so a user's matplotlibrc cannot change the page."""
ALPHA = 0.8
"""Marker opacity: a dense cloud of one series still shows where it is thickest."""
PAD = 0.05
"""Share of an axis's span (in its scale: decades on a log axis) left beyond the extremes."""
DODGE = 0.7
"""Share of an item's row that its series share out, side by side."""
MARKER_PT = 22.0
"""Marker area in points² (about 6.5 pixels across at ``DPI``)."""


@dataclass(frozen=True)
class Style:
    """How one name (a cast, a policy) is drawn wherever it appears."""

    colour: str
    marker: str


class Palette:
    """One :class:`Style` per name across a page, given in the order names first appear:
    ``mxfp8_e4m3`` is the same colour and marker in every section. Beyond ten names the
    colours repeat with other markers."""

    def __init__(self) -> None:
        self._styles: dict[str, Style] = {}

    def __getitem__(self, name: str) -> Style:
        if name not in self._styles:
            n = len(self._styles)
            self._styles[name] = Style(COLOURS[n % len(COLOURS)],
                                       MARKERS[(n + n // len(COLOURS)) % len(MARKERS)])
        return self._styles[name]


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


@dataclass(frozen=True)
class Note:
    """A sentence in place of a figure that would show nothing."""

    title: str
    text: str


@dataclass(frozen=True)
class Tally:
    """A count headline and the count it is out of, by column: where the headline is 0 in
    every row, the page says "0 ``noun`` in N ``of``" instead of drawing bars of 0."""

    count: str
    total: str
    noun: str
    of: str


TALLIES = (Tally("n_failed", "n_checked", "disagreements", "values"),)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def as_text(draw: Callable[_P, _R]) -> Callable[_P, _R]:
    """``draw`` with every text of its figures drawn as written, never parsed as math:
    tensor names and cast specs are data (``a$\\foo$b`` made matplotlib's math parser raise,
    ``$x^{2}$`` was drawn as x squared). Tick labels are made when a figure is saved, so the
    setting holds until ``draw`` returns."""

    @functools.wraps(draw)
    def drawn(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        import matplotlib

        with matplotlib.rc_context({"text.parse_math": False}):
            return draw(*args, **kwargs)

    return drawn


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


def _apply_scale(ax: Any, which: str, values: Sequence[float], also: Sequence[float] = (),
                 pad: bool = True) -> str:
    """The scale ``values`` call for; with ``pad``, limits that hold them and ``also``."""
    kind, kw = _scale(values)
    (ax.set_xscale if which == "x" else ax.set_yscale)(kind, **kw)
    if kind == "symlog" and which == "x":
        ax.tick_params(axis="x", labelrotation=40)
    if pad:
        _pad(ax, which, [*values, *also])
    return kind


def _pad(ax: Any, which: str, values: Sequence[float]) -> None:
    """Limits ``PAD`` of the span beyond the extreme values, in the axis's scale: whole
    markers at both ends, and rates that are often exactly 0 get no empty negative half."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0 or v.min() == v.max():
        return  # matplotlib centres a single value
    axis = ax.xaxis if which == "x" else ax.yaxis
    scale = axis.get_transform()
    lo, hi = scale.transform(np.array([[v.min()], [v.max()]]))[:, 0]
    pad = PAD * (hi - lo)
    low, high = scale.inverted().transform(np.array([[lo - pad], [hi + pad]]))[:, 0]
    (ax.set_xlim if which == "x" else ax.set_ylim)(low, high)


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # lazily: only --html pays for matplotlib

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


@dataclass(frozen=True)
class _Series:
    """The rows of one series, with its legend label and its name on the page."""

    label: str
    """The values of the group columns that vary ('' where none does)."""
    name: str
    """The name its :class:`Style` is looked up by: the label, or where no group column
    varies, the value of the last one (the one cast of a table)."""
    rows: pd.DataFrame


def _varying(frame: pd.DataFrame, lay: Layout, drop: Sequence[str] = ()) -> list[str]:
    return [c for c in lay.groups if c not in drop and frame[c].nunique(dropna=False) > 1]


def _row_labels(frame: pd.DataFrame, columns: Sequence[str]) -> pd.Series:
    return frame[list(columns)].astype(object).map(str).agg(" ".join, axis=1)


def _series(frame: pd.DataFrame, lay: Layout, drop: Sequence[str] = ()) -> list[_Series]:
    """Rows split into series by the group columns that vary, labelled by their values."""
    cols = _varying(frame, lay, drop)
    if not cols:
        fixed = [c for c in lay.groups if c not in drop]
        name = str(frame[fixed[-1]].iloc[0]) if fixed and len(frame) else ""
        return [_Series("", name, frame)]
    labels = _row_labels(frame, cols)
    return [_Series(label, label, frame[labels == label]) for label in dict.fromkeys(labels)]


def _twins(points: Sequence[object | None]) -> list[int | None]:
    """For each series' points (None: it has none), the first earlier series with exactly
    the same points, or None."""
    return [next((j for j in range(i) if p is not None and points[j] == p), None)
            for i, p in enumerate(points)]


def _named(shown: Sequence[_Series], twins: Sequence[int | None], fallback: str) -> list[str]:
    """Legend labels, with "(same values as ...)" where a series repeats an earlier one."""
    return [(s.label or fallback)
            + (f" (same values as {shown[t].label})" if t is not None else "")
            for s, t in zip(shown, twins, strict=True)]


def _same(shown: Sequence[_Series], twins: Sequence[int | None]) -> str:
    return "".join(f" {s.label}: same values as {shown[t].label}."
                   for s, t in zip(shown, twins, strict=True) if t is not None)


DASH = 3.0
"""Dash length in points of lines drawn on top of each other, interleaved."""


def _dashes(k: int, m: int) -> tuple[float, tuple[float, float]]:
    """The k-th of m lines on the same place: its dashes fill the others' gaps."""
    return (DASH * k, (DASH, DASH * (m - 1)))


def _coinciding(keys: Sequence[object]) -> list[tuple[int, int]]:
    """For each line, (its place among the lines with the same key, how many there are)."""
    groups: dict[object, list[int]] = {}
    for n, key in enumerate(keys):
        groups.setdefault(key, []).append(n)
    return [(groups[key].index(n), len(groups[key])) for n, key in enumerate(keys)]


LONG_LABEL = 28
"""Series labels longer than this put the legend under the plot, not beside it."""


def _below(labels: Sequence[str]) -> bool:
    """Whether the legend goes under the plot: long cast specs would make the plot narrow."""
    return max(map(len, labels), default=0) > LONG_LABEL


def _legend(ax: Any, title: str) -> None:
    _, labels = ax.get_legend_handles_labels()
    if not labels:
        return
    if _below(labels):
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
    return " ".join(_varying(frame, lay, drop))


def _numeric(frame: pd.DataFrame, column: str) -> pd.Series:
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


@as_text
def by_item(table: Table, column: str, palette: Palette | None = None) -> Plot | None:
    """``column`` by item (tensor, parameter), one series per group side by side in each
    item's row; None with no values."""
    palette = Palette() if palette is None else palette
    lay = layout(table)
    item = lay.item
    if item is None:
        return None
    frame = table.display_frame()
    is_agg = frame[item].astype(object) == ALL_ROWS
    rows, aggregates = frame[~is_agg], frame[is_agg]
    values = _numeric(rows, column)
    if values.notna().sum() == 0:
        return None
    rows, values = rows[values.notna()], values[values.notna()]  # unmeasured rows: no point
    items = list(dict.fromkeys(rows[item].astype(str)))
    pos = {name: i for i, name in enumerate(items)}
    series = _series(frame, lay)
    shown = series[:MAX_SERIES]
    offset = [(n - (len(shown) - 1) / 2) * DODGE / len(shown) for n in range(len(shown))]
    drawn, points = [], []
    for s in shown:
        agg_rows = s.rows[item].astype(object) == ALL_ROWS
        part = s.rows[~agg_rows]
        v = _numeric(part, column)
        part, v = part[v.notna()], v[v.notna()]
        agg = _numeric(s.rows[agg_rows], column).dropna()
        total = float(agg.iloc[0]) if not agg.empty else None
        drawn.append(([pos[str(x)] for x in part[item]], list(v), total,
                      list(_numeric(part, SIZE)) if SIZE in part.columns else []))
        pairs = tuple(sorted(zip(part[item].astype(str), v, strict=True)))
        points.append((pairs, total) if pairs or total is not None else None)
    twins = _twins(points)
    labels = _named(shown, twins, column)
    labelled = len(items) <= MAX_LABELLED
    # beyond MAX_LABELLED, items lie along their size where every one has it: a tensor's
    # index in the file says nothing about it, its element count says how much it weighs
    sized = (not labelled and SIZE in rows.columns
             and bool((_numeric(rows, SIZE) > 0).all()))
    more = ""
    # each series its own place in a row, a marker and a gap wide (MARKER_PT is 6.5 px
    # across): taller rows for more series; a legend under the plot takes its own height
    row = max(0.24, 0.12 * len(shown))
    height = 1.6 + row * len(items) if labelled else 4.5
    height += 0.3 + 0.17 * len(shown) if _below(labels) else 0
    fig, ax = _figure(9.5, min(max(height, 3.2), 40))
    value_axis = "x" if labelled else "y"
    lines = _coinciding([total for _, _, total, _ in drawn])
    for n, (s, (where, v, total, sizes)) in enumerate(zip(shown, drawn, strict=True)):
        style = palette[s.name]
        kw = {"marker": style.marker, "color": style.colour, "alpha": ALPHA, "s": MARKER_PT,
              "label": labels[n]}
        at = sizes if sized else [w + offset[n] for w in where]
        if labelled:
            ax.scatter(v, at, **kw)
        else:
            ax.scatter(at, v, **kw)
        if total is not None:
            k, m = lines[n]
            line = ax.axvline if labelled else ax.axhline
            line(total, color=style.colour, linewidth=1, alpha=0.7,
                 linestyle="--" if m == 1 else _dashes(k, m))
    totals = [t for _, _, t, _ in drawn if t is not None]
    kind = _apply_scale(ax, value_axis, list(values), also=totals)
    if labelled:
        ax.set_yticks(range(len(items)), items, fontsize=7 if len(items) > 30 else 8)
        ax.set_ylim(len(items) - 0.5, -0.5)  # one row per item, in file order top to bottom
        ax.set_xlabel(axis_label(table, column))
        ax.set_ylabel(item)
        ax.grid(axis="x", alpha=0.3)
    elif sized:
        ax.set_xscale("log")
        _pad(ax, "x", list(_numeric(rows, SIZE)))
        ax.set_xlabel(f"{SIZE} [count] (elements of each {item}; the {NAMED_WORST} worst are "
                      "numbered)")
    else:
        _pad(ax, "x", [-DODGE / 2, len(items) - 1 + DODGE / 2])
        ax.set_xlabel(f"{item} index (file order; the {NAMED_WORST} worst are numbered)")
    if not labelled:
        ax.set_ylabel(axis_label(table, column))
        ax.grid(axis="y", alpha=0.3)
        # numbered rings, names in the caption: names written on a dense plot overlap
        vary = _varying(frame, lay)
        row_series = (_row_labels(rows, vary) if vary
                      else pd.Series("", index=rows.index))
        place = {s.label: offset[n] for n, s in enumerate(shown)}
        worst = rows.assign(_v=values, _s=row_series).sort_values(
            "_v", ascending=not table.higher_is_worse, kind="stable").head(NAMED_WORST)
        for n, (_, r) in enumerate(worst.iterrows(), 1):
            ring = ((float(r[SIZE]) if sized else pos[str(r[item])] + place.get(r["_s"], 0.0)),
                    r["_v"])
            ax.scatter(*ring, s=90, facecolors="none", edgecolors="black", linewidths=1)
            ax.annotate(str(n), ring, fontsize=8, fontweight="bold", xytext=(5, -3),
                        textcoords="offset points")
        named = "; ".join(f"{n} {r[item]} ({_label(r, vary)}{r['_v']:.3g})"
                          for n, (_, r) in enumerate(worst.iterrows(), 1))
        more = f" Worst: {named}." + more
    ax.set_title(f"{table.name}: {column} by {item}")
    _legend(ax, _legend_title(frame, lay))
    infinite = rows.assign(_v=values)[np.isinf(values.to_numpy(dtype=float))]
    if not infinite.empty:  # no axis holds them: say so, never drop a lost tensor silently
        vary = _varying(frame, lay)
        listed = "; ".join(f"{r[item]} ({_label(r, vary)}{r['_v']:.3g})"
                           for _, r in infinite.head(NAMED_WORST).iterrows())
        extra = len(infinite) - NAMED_WORST
        more += (f" Not drawn, infinite: {listed}"
                 + (f" and {extra} more" if extra > 0 else "") + ".")
    if len(series) > MAX_SERIES:
        more += f" Showing the first {MAX_SERIES} of {len(series)} series."
    dashed = (f" Dashed lines: the all-{item}s row ({ALL_ROWS}) of each series."
              if not aggregates.empty else "")
    scale = f" {kind} scale." if kind != "linear" else ""
    doc = table.docs.get(column, "")
    return Plot(f"{table.name}: {column} by {item}",
                f"{column} of each {item} in {table.name}, one series per "
                f"{_legend_title(frame, lay) or 'table'}",
                f"{column}: {doc}.{dashed}{scale}{_same(shown, twins)}{more}".replace("..", "."),
                _png(fig))


RING = 2.5
"""Area factor of the open ring drawn around a point an earlier series already has there."""


@as_text
def scatter(table: Table, spec: Scatter, palette: Palette | None = None) -> Plot | None:
    """``spec.y`` against ``spec.x``, one point per row, one colour per group."""
    palette = Palette() if palette is None else palette
    lay = layout(table)
    frame = table.display_frame()
    xs, ys = _numeric(frame, spec.x), _numeric(frame, spec.y)
    ok = xs.notna() & ys.notna() & np.isfinite(xs) & np.isfinite(ys)
    if not ok.any():
        return None
    shown = _series(frame, lay)[:MAX_SERIES]
    parts = []  # per series: (its rows' points, False), (its all-rows points, True)
    for s in shown:
        px, py = _numeric(s.rows, spec.x), _numeric(s.rows, spec.y)
        fine = np.isfinite(px) & np.isfinite(py)
        is_agg = ((s.rows[lay.item].astype(object) == ALL_ROWS) if lay.item
                  else pd.Series(False, index=s.rows.index))
        parts.append([(list(zip(px[mask], py[mask], strict=True)), agg)
                      for mask, agg in ((fine & ~is_agg, False), (fine & is_agg, True))])
    twins = _twins([tuple(sorted((p, agg) for pts, agg in part for p in pts)) or None
                    for part in parts])
    labels = _named(shown, twins, spec.y)
    fig, ax = _figure(8.5, 5.5)
    seen: dict[tuple[float, float], int] = {}
    for s, part, label in zip(shown, parts, labels, strict=True):
        style = palette[s.name]
        for pts, agg in part:
            marker, size = ("X", 90.0) if agg else (style.marker, 24.0)
            fresh = [p for p in pts if p not in seen]
            again = [p for p in pts if p in seen]
            rings = [size * RING ** seen[p] for p in again]
            for p in pts:
                seen[p] = seen.get(p, 0) + 1
            name = None if agg else label
            if fresh:
                edge = {"edgecolors": "black", "linewidths": 0.6} if agg else {}
                ax.scatter(*zip(*fresh, strict=True), color=style.colour, alpha=0.75, s=size,
                           marker=marker, label=name, **edge)
                name = None
            if again:  # an open ring around the point an earlier series drew here
                ax.scatter(*zip(*again, strict=True), s=rings, marker=marker,
                           facecolors="none", edgecolors=style.colour, linewidths=1.2,
                           label=name)
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
                spec.caption + (f" Scales: {scales}." if scales else "") + _same(shown, twins),
                _png(fig))


def _constant(shown: Sequence[_Series], column: str) -> bool:
    """Whether ``column`` has one value throughout each series (and more than one step)."""
    values = [s.rows[column].dropna() for s in shown]
    return (all(v.nunique() <= 1 for v in values) and any(len(v) > 1 for v in values))


def _constants(shown: Sequence[_Series], columns: Sequence[str]) -> str:
    """``seed = 0, lr = 0.003 (bf16), 0.01 (fp8)``."""
    said = []
    for c in columns:
        per = [(s.label, plain(s.rows[c].dropna().iloc[0])) for s in shown
               if s.rows[c].notna().any()]
        if len({v for _, v in per}) == 1:
            said.append(f"{c} = {fmt(per[0][1])}")
        else:
            said.append(f"{c} = " + ", ".join(f"{fmt(v)} ({label})" for label, v in per))
    return ", ".join(said)


@as_text
def by_step(table: Table, palette: Palette | None = None) -> list[Plot | Note]:
    """Each measured column against step (headline first), one line per group; only the
    aggregate rows where the table has them. Columns constant at every step (a run's seed)
    are named in a note, not drawn."""
    palette = Palette() if palette is None else palette
    lay = layout(table)
    frame = table.display_frame()
    if lay.has_aggregate and lay.item is not None:
        frame = frame[frame[lay.item].astype(object) == ALL_ROWS]
    measured = [c for c in table.columns if c not in table.keys and c != STEP
                and pd.api.types.is_numeric_dtype(frame[c].dtype)
                and not pd.api.types.is_bool_dtype(frame[c].dtype)
                and _numeric(frame, c).notna().any()]
    measured.sort(key=lambda c: c != table.headline)  # stable: headline first
    drop = (STEP,)
    shown = _series(frame, lay, drop)[:MAX_SERIES]
    flat = [c for c in measured if _constant(shown, c)]
    title = _legend_title(frame, lay, drop)
    plots: list[Plot | Note] = []
    for column in [c for c in measured if c not in flat][:MAX_STEP_PANELS]:
        lines = []
        for s in shown:
            part = s.rows.sort_values(STEP)
            y = _numeric(part, column)
            keep = y.notna()  # a value every few steps (validation loss): one joined line
            lines.append((tuple(_numeric(part, STEP)[keep]), tuple(y[keep])))
        twins = _twins([line if line[1] else None for line in lines])
        labels = _named(shown, twins, column)
        same = _coinciding([n if t is None else t for n, t in enumerate(twins)])
        fig, ax = _figure(8.5, 4.2)
        for n, (s, (x, y)) in enumerate(zip(shown, lines, strict=True)):
            k, m = same[n]
            ax.plot(x, y, marker="." if k == 0 else "None", color=palette[s.name].colour,
                    linestyle="-" if m == 1 else _dashes(k, m), label=labels[n])
        _pad(ax, "x", [v for x, _ in lines for v in x])
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
                          f"{column}: {doc}." + (f" {kind} scale." if kind != "linear" else "")
                          + _same(shown, twins), _png(fig)))
    if flat:
        plots.append(Note(f"{table.name}: constant columns",
                          f"Constant at every step, not plotted: {_constants(shown, flat)}."))
    return plots


@as_text
def by_layer_step(table: Table) -> list[Plot | Note]:
    """Each measured column as a layer × step heatmap (layers in the table's order, steps
    ascending), one per series of the other group columns; cells without a value stay blank.
    Columns constant everywhere are named in a note, not drawn."""
    lay = layout(table)
    frame = table.display_frame()
    measured = [c for c in table.columns if c not in table.keys
                and pd.api.types.is_numeric_dtype(frame[c].dtype)
                and not pd.api.types.is_bool_dtype(frame[c].dtype)
                and _numeric(frame, c).notna().any()]
    measured.sort(key=lambda c: c != table.headline)
    drop = (STEP, LAYER)
    shown = _series(frame, lay, drop)[:MAX_SERIES]
    flat = [c for c in measured if _numeric(frame, c).dropna().nunique() <= 1]
    plots: list[Plot | Note] = []
    panels = [(c, s) for c in measured if c not in flat for s in shown]
    for column, series in panels[:MAX_STEP_PANELS * max(1, len(shown))]:
        grid = series.rows.pivot_table(index=LAYER, columns=STEP, values=column,
                                       aggfunc="first", sort=False)
        grid = grid.reindex(index=list(dict.fromkeys(series.rows[LAYER])),
                            columns=sorted(grid.columns))
        values = grid.to_numpy(dtype=float)
        fig, ax = _figure(8.5, max(2.5, 0.28 * len(grid.index) + 1.5))
        kind, kw = _scale(list(values[np.isfinite(values)]))
        norm = None
        if kind != "linear":
            from matplotlib.colors import LogNorm, SymLogNorm

            norm = LogNorm() if kind == "log" else SymLogNorm(kw["linthresh"])
        image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest",
                          norm=norm, cmap="viridis")
        steps = list(grid.columns)
        ticks = sorted({0, len(steps) - 1, *range(0, len(steps), max(1, len(steps) // 8))})
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        ax.set_yticks(range(len(grid.index)), [str(v) for v in grid.index])
        ax.set_xlabel("step")
        ax.set_ylabel(LAYER)
        where = f" ({series.label})" if series.label else ""
        ax.set_title(f"{table.name}: {column}{where} by layer and step")
        fig.colorbar(image, ax=ax, label=axis_label(table, column))
        doc = table.docs.get(column, "")
        plots.append(Plot(f"{table.name}: {column}{where} by layer and step",
                          f"heatmap of {column} with one row per layer and one column per "
                          f"step{where}",
                          f"{column}: {doc}." + (f" {kind} colour scale." if kind != "linear"
                                                 else ""), _png(fig)))
    if flat:
        said = ", ".join(f"{c} = {fmt(plain(_numeric(frame, c).dropna().iloc[0]))}"
                         for c in flat)
        plots.append(Note(f"{table.name}: constant columns",
                          f"Constant at every layer and step, not plotted: {said}."))
    return plots


def _nothing(table: Table, frame: pd.DataFrame, what: str, groups: str) -> Note:
    """The sentence for a bar chart whose bars would all be 0."""
    head = table.headline
    for tally in TALLIES:
        if tally.count == head and tally.total in table.columns:
            total = int(_numeric(frame[frame[head].notna()], tally.total).sum())
            return Note(f"{table.name}: {tally.noun}",
                        f"0 {tally.noun} in {total:,} {tally.of}: {head} is 0 in every row.")
    return Note(f"{table.name}: {what}", f"{what} is 0 for every {groups}: nothing to plot.")


@as_text
def by_group(table: Table) -> Plot | Note | None:
    """The headline per group as bars: the total for a count, the worst value otherwise;
    a :class:`Note` where every bar would be 0."""
    lay = layout(table)
    frame = table.display_frame()
    head = table.headline
    values = _numeric(frame, head)
    if values.notna().sum() == 0:
        return None
    count = table.kinds.get(head) == "int"
    if lay.groups:
        labels = _row_labels(frame, lay.groups)
    else:
        labels = pd.Series(table.name, index=frame.index)
    grouped = values.groupby(labels, sort=False)
    worst = grouped.max() if table.higher_is_worse else grouped.min()
    bars = grouped.sum() if count else worst
    what = f"total {head}" if count else f"{'max' if table.higher_is_worse else 'min'} {head}"
    groups = " ".join(lay.groups) or "table"
    if (bars == 0).all():
        return _nothing(table, frame, what, groups)
    names = [str(i) for i in bars.index]
    doc = table.docs.get(head, "")
    title = f"{table.name}: {what} by {groups}"
    ylabel = f"{what} [{unit(table, head) or 'value'}]"
    if max(len(n) for n in names) > BAR_LABEL:
        # long labels (accum-error's matmul specs) would squeeze the axes to nothing: number
        # the bars, top down, and name them in the caption
        fig, ax = _figure(7.0, max(2.5, 0.35 * len(bars) + 1.5))
        ax.barh(range(len(bars)), bars.to_numpy(), color=COLOURS[0])
        ax.set_yticks(range(len(bars)), [str(k + 1) for k in range(len(bars))])
        ax.invert_yaxis()
        _apply_scale(ax, "x", list(bars), pad=False)
        ax.set_ylabel(f"{groups} (numbered, see the caption)")
        ax.set_xlabel(ylabel)
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
        key = "; ".join(f"{k + 1}: {n}" for k, n in enumerate(names))
        return Plot(title, f"horizontal bar chart of {what} for each {groups} of {table.name}",
                    f"{key}. {head}: {doc}.", _png(fig))
    fig, ax = _figure(max(5.0, 0.6 * len(bars) + 2), 4.0)
    ax.bar(range(len(bars)), bars.to_numpy(), color=COLOURS[0])
    ax.set_xticks(range(len(bars)), names, rotation=30, ha="right")
    _apply_scale(ax, "y", list(bars), pad=False)  # bars stand on 0
    ax.set_xlabel(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return Plot(title, f"bar chart of {what} for each {groups} of {table.name}",
                f"{head}: {doc}.", _png(fig))


@as_text
def figures(table: Table, palette: Palette | None = None) -> list[Plot | Note]:
    """Every figure ``table`` gets (see the module docstring), its series styled by
    ``palette`` (pass one palette for every table of a page)."""
    palette = Palette() if palette is None else palette
    lay = layout(table)
    # a per-step table declares step a key; a dump's tensors carry theirs as a column, and
    # are drawn by tensor, a series per step (summary.BREAKDOWN)
    stepped = STEP in table.keys and table.frame[STEP].nunique() > 1
    plots: list[Plot | Note | None] = []
    layered = (stepped and LAYER in table.keys
               and table.frame[LAYER].nunique() > MAX_LAYER_LINES)
    if layered:
        plots += by_layer_step(table)
    elif stepped:
        plots += by_step(table, palette)
    elif lay.item is not None:
        extra = [c for c in BY_ITEM_EXTRA if c in table.columns and c != table.headline]
        plots += [by_item(table, c, palette) for c in (table.headline, *extra)]
    plots += [scatter(table, s, palette) for s in SCATTERS if s.x in table.columns
              and s.y in table.columns]
    if not stepped and lay.item is None:
        plots.append(by_group(table))
    return [p for p in plots if p is not None]
