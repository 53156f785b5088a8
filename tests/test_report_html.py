"""drift report --html: the page, its figures, and what a reader sees on them.

The figures are checked three ways: by the artists matplotlib drew (captured before they
become PNG bytes), by the pixels of the PNGs the page embeds, and in a headless browser.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from test_report import (
    PROV,
    GradCosineLike,
    TrainLike,
    report,
    tensor_row,
    write_grad,
    write_run,
    write_train,
)

from driftcli.io.tables import column, write_table
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.measures.error_bias import ErrorBiasRow
from driftcli.measures.underflow_rate import UnderflowRateRow
from driftcli.report import Options, make_report, plots
from driftcli.report import html as report_html
from driftcli.report.load import load
from driftcli.verify import VerifyRow

IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]+)" '
                 r'title="([^"]+)">')
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
"""matplotlib's tab10, the first six: the colours the page gives its series, in order."""


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "out")


def full_run(folder: Path) -> Path:
    write_run(folder)
    write_grad(folder)
    write_train(folder)
    return folder


def expected_titles() -> list[str]:
    return ["clip-rate: clip_rate by tensor", "grad-cosine-test: cosine by parameter",
            "grad-cosine-test: retention by parameter", "train-test: loss against step",
            "train-test: grad_norm against step", "underflow-rate: underflow_rate by tensor",
            "error-bias: rel_error by tensor", "error-bias: error size against bias"]


def check_self_contained(page: str) -> list[tuple[bytes, str, str]]:
    """No external reference anywhere; returns the embedded images."""
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", page, re.I)
    assert not re.search(r"<(link|script|iframe|object|embed)\b", page, re.I)
    assert "url(" not in page and "@import" not in page
    assert "default-src 'none'" in page  # the browser itself refuses any other load
    return [(base64.b64decode(m[1]), m[2], m[3]) for m in IMG.finditer(page)]


# --- a page with what the screenshot of issue 19 showed -------------------------------------
# four casts, two of them (floor+1, ceil) equal on every tensor; clip rates from 0 to 0.72 over
# four decades (a symmetric-log axis with its largest marker at the edge); policies in another
# order than the casts; a one-cast table; a training run with a constant seed and lr; a
# verify-formats table without a single disagreement

CASTS = ("fp8_e4m3", "mxfp8_e4m3", "floor+1", "ceil")
TWINS = ("floor+1", "ceil")
"""Casts with the same values in every table."""
TENSORS = ("t0", "t1", "t2")
SAME = {"t0": 0.0, "t1": 0.0002, "t2": 0.0, "*": 5e-05}
CLIP = {"fp8_e4m3": {"t0": 0.0, "t1": 6e-05, "t2": 0.0, "*": 4.7e-06},
        "mxfp8_e4m3": {"t0": 0.72, "t1": 0.008, "t2": 0.0105, "*": 0.11},
        "floor+1": SAME, "ceil": SAME}
ERRBIAS = {"fp8_e4m3": {"t0": (0.017, 0.0044), "t1": (0.026, -0.001), "t2": (0.025, 0.002),
                        "*": (0.023, 0.0004)},
           "mxfp8_e4m3": {"t0": (0.10, -0.09), "t1": (0.037, -0.01), "t2": (0.03, -0.007),
                          "*": (0.07, -0.03)},
           "floor+1": {"t0": (0.015, 0.0042), "t1": (0.027, -0.0009), "t2": (0.026, 0.003),
                       "*": (0.0226, 0.0002)}}
ERRBIAS["ceil"] = ERRBIAS["floor+1"]
POLICIES = ("exact", "mxfp8_e4m3", "fp8_e4m3")
COSINE = {"exact": {"w1": 1.0, "w2": 1.0, "*": 1.0},
          "mxfp8_e4m3": {"w1": 0.93, "w2": 0.95, "*": 0.94},
          "fp8_e4m3": {"w1": 0.994, "w2": 0.996, "*": 0.995}}
ONE_CAST = "ceil"
"""The only cast of the underflow-rate table."""
RUN = "run1"
SEED, LR = 7, 0.003
VERIFIED = {("float8_e4m3fn", "decode"): 256, ("float8_e4m3fn", "roundtrip"): 256,
            ("float4_e2m1fn", "decode"): 16, ("float4_e2m1fn", "roundtrip"): 16}


@dataclass(frozen=True)
class RunLike:
    """A training run's table: the run's settings in every row, metrics per step."""

    TABLE: ClassVar[str] = "train-run-test"
    KEYS: ClassVar[tuple[str, ...]] = ("run", "step")
    HEADLINE: ClassVar[str] = "loss"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    run: str = column("run name")
    step: int = column("training step")
    seed: int = column("the run's seed")
    lr: float = column("learning rate")
    loss: float = column("training loss in nats")
    val_loss: float | None = column("validation loss, every 5 steps")


def planted_run(folder: Path) -> Path:
    rows = [tensor_row(ClipRateRow, t, c, clip_rate=v, clipped=round(v * 1000), n_blocks=10)
            for c in CASTS for t, v in CLIP[c].items()]
    write_table(folder / "clip-rate.parquet", ClipRateRow, rows, PROV)
    write_table(folder / "error-bias.parquet", ErrorBiasRow,
                [tensor_row(ErrorBiasRow, t, c, rel_error=e, bias=b, draws=1)
                 for c in CASTS for t, (e, b) in ERRBIAS[c].items()], PROV)
    write_table(folder / "grad-cosine-test.parquet", GradCosineLike,
                [GradCosineLike("ckpt.safetensors", p, name, v, v * 0.99)
                 for p in POLICIES for name, v in COSINE[p].items()], PROV)
    write_table(folder / "underflow-rate.parquet", UnderflowRateRow,
                [tensor_row(UnderflowRateRow, t, ONE_CAST, underflow_rate=0.01 * (i + 1),
                            n_nonzero=1000) for i, t in enumerate((*TENSORS, "*"))], PROV)
    write_table(folder / "train-run-test.parquet", RunLike,
                [RunLike(RUN, s, SEED, LR, 4.0 * math.exp(-s / 8),
                         3.0 - s / 20 if s % 5 == 0 else None) for s in range(1, 21)], PROV)
    write_table(folder / "verify-formats.parquet", VerifyRow,
                [VerifyRow("summary", f, "codes", op, "-", "-", n, 0, None, None, None)
                 for (f, op), n in VERIFIED.items()], PROV)
    return folder


SERIES = {"clip-rate": CASTS, "error-bias": CASTS, "grad-cosine-test": POLICIES,
          "underflow-rate": (ONE_CAST,), "train-run-test": (RUN,)}
"""The series each planted table's figures show, in the order they are drawn."""


@pytest.fixture()
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every figure drawn while the fixture is active, by its axes title."""
    figures: dict[str, Any] = {}
    encode = plots._png

    def keep(fig: Any) -> bytes:
        figures[fig.axes[0].get_title()] = fig
        return encode(fig)

    monkeypatch.setattr(plots, "_png", keep)
    return figures


def render(*folders: Path) -> str:
    return report_html.render(make_report(list(folders), Options()))


def pixels(fig: Any) -> np.ndarray:
    """The figure as drawn, RGB in [0, 1], row 0 at the top (as display y counts up)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].astype(float) / 255


def inside(fig: Any, image: np.ndarray) -> np.ndarray:
    """The pixels strictly inside the first axes' frame: the plot, without legend or labels."""
    box = fig.axes[0].bbox
    top, bottom = image.shape[0] - box.y1, image.shape[0] - box.y0
    return image[math.ceil(top) + 2:math.floor(bottom) - 2,
                 math.ceil(box.x0) + 2:math.floor(box.x1) - 2]


def of_colour(image: np.ndarray, colour: Any) -> int:
    """Pixels drawn in ``colour``, opaque or blended with white (markers and lines are drawn
    with alpha 0.7 to 1): the pixel lies on the segment from white to the colour, near it."""
    from matplotlib.colors import to_rgb

    c = np.asarray(to_rgb(colour)) - 1
    p = image.reshape(-1, 3) - 1
    t = p @ c / (c @ c)
    off = np.abs(p - t[:, None] * c).max(axis=1)
    return int(((t > 0.6) & (t < 1.05) & (off < 0.05)).sum())


def series_colours(ax: Any) -> dict[str, str]:
    """Legend label (without its note in parentheses) -> the colour its artists are drawn in."""
    from matplotlib.colors import to_hex

    found: dict[str, set[str]] = {}
    for artist in [*ax.collections, *ax.lines]:
        label = artist.get_label()
        if label.startswith("_"):
            continue
        if hasattr(artist, "get_color") and not hasattr(artist, "get_offsets"):
            colours = [artist.get_color()]
        else:
            faces = artist.get_facecolor()
            colours = [faces[0] if len(faces) and faces[0][3] > 0 else artist.get_edgecolor()[0]]
        found.setdefault(label.split(" (")[0], set()).update(to_hex(c) for c in colours)
    assert all(len(c) == 1 for c in found.values()), found
    return {label: next(iter(c)) for label, c in found.items()}


def markers(ax: Any) -> Iterator[tuple[float, float, float, float]]:
    """(x, y, half width, half height) in display pixels of every marker the axes draw."""
    for coll in ax.collections:
        offsets = coll.get_offset_transform().transform(coll.get_offsets())
        paths, scales = coll.get_paths(), coll.get_transforms()
        if not len(paths) or not len(offsets):
            continue
        edge = max(coll.get_linewidths(), default=0) * ax.figure.dpi / 72 / 2
        for i, (x, y) in enumerate(offsets):
            m = scales[i % len(scales)][:2, :2] if len(scales) else np.eye(2)
            v = paths[i % len(paths)].vertices @ m.T
            yield x, y, np.abs(v[:, 0]).max() + edge, np.abs(v[:, 1]).max() + edge
    for line in ax.lines:
        if line.get_marker() in (None, "None", "", " "):
            continue
        r = line.get_markersize() * ax.figure.dpi / 72 / 2
        for x, y in line.get_transform().transform(line.get_xydata()):
            yield x, y, r, r


# --- the figures ---------------------------------------------------------------------------

def test_coincident_series_are_all_visible(tmp_path: Path, drawn: dict[str, Any]) -> None:
    """floor+1 and ceil have the same values: both must show in the plot, not one on top of
    the other, and the legend says they coincide."""
    planted_run(tmp_path / "out")
    rows = [TrainLike(p, s, 4.0 * math.exp(-s / 50), 1.0 / (s + 1))
            for p in TWINS for s in range(0, 200, 20)]
    write_table(tmp_path / "out" / "train-test.parquet", TrainLike, rows, PROV)
    page = render(tmp_path / "out")
    for title in ("clip-rate: clip_rate by tensor", "error-bias: rel_error by tensor",
                  "error-bias: error size against bias", "train-test: loss against step"):
        fig = drawn[title]
        ax = fig.axes[0]
        colours = series_colours(ax)
        plot = inside(fig, pixels(fig))
        seen = {c: of_colour(plot, colours[c]) for c in TWINS}
        # each twin shows about as much as the other; the one drawn first is not covered
        assert min(seen.values()) >= 0.3 * max(seen.values()) and min(seen.values()) > 20, (
            title, seen)
        labels = [t.get_text() for t in (ax.get_legend() or fig.legends[0]).get_texts()]
        assert "ceil (same values as floor+1)" in labels, (title, labels)
        assert "floor+1" in labels
    assert "ceil: same values as floor+1." in page


def test_one_colour_per_cast_across_the_page(tmp_path: Path, drawn: dict[str, Any]) -> None:
    """A cast or policy has one colour (and marker) in every section; different ones differ."""
    render(planted_run(tmp_path / "out"))
    by_name: dict[str, set[str]] = {}
    for title, fig in drawn.items():
        table = title.split(":")[0]
        if table not in SERIES:
            continue
        colours = series_colours(fig.axes[0])
        names = SERIES[table]
        if len(names) == 1:  # a single series is labelled by its column, coloured by its name
            assert len(colours) == 1, (title, colours)
            colours = {names[0]: next(iter(colours.values()))}
        assert set(colours) == set(names), (title, colours)
        for name, colour in colours.items():
            by_name.setdefault(name, set()).add(colour)
    assert set(by_name) == {*CASTS, *POLICIES, RUN}
    assert all(len(c) == 1 for c in by_name.values()), by_name
    assert len({c for cs in by_name.values() for c in cs}) == len(by_name)  # all distinct


def test_markers_at_the_extremes_are_whole(tmp_path: Path, drawn: dict[str, Any]) -> None:
    """Every marker of every figure lies wholly inside its axes, whatever the scale; beyond
    60 tensors too (plotted by index, the worst ringed)."""
    out = planted_run(tmp_path / "out")
    write_train(out)
    many = {c: {f"t{i}": (i % 7) * 10.0 ** -(i % 5) for i in range(70)} | {"*": 0.1}
            for c in CASTS[:2]}
    write_table(tmp_path / "many" / "clip-rate.parquet", ClipRateRow,
                [tensor_row(ClipRateRow, t, c, clip_rate=v, clipped=1, n_blocks=10)
                 for c in many for t, v in many[c].items()], PROV)
    for folder, figures in ((out, 10), (tmp_path / "many", 1)):
        drawn.clear()
        render(folder)
        assert len(drawn) == figures, list(drawn)
        for title, fig in drawn.items():
            pixels(fig)  # lays the figure out, as saving it does
            ax = fig.axes[0]
            box = ax.bbox
            points = list(markers(ax))
            assert points, title
            for x, y, w, h in points:
                assert box.x0 <= x - w and x + w <= box.x1, (title, x, w, box)
                assert box.y0 <= y - h and y + h <= box.y1, (title, y, h, box)


def test_constant_columns_are_not_plotted(tmp_path: Path, drawn: dict[str, Any]) -> None:
    page = render(planted_run(tmp_path / "out"))
    titles = [t for _, _, t in check_self_contained(page)]
    assert "train-run-test: loss against step" in titles
    assert "train-run-test: val_loss against step" in titles
    assert not [t for t in titles if re.search(r"(seed|lr) against step", t)], titles
    assert f"Constant at every step, not plotted: seed = {SEED}, lr = {LR}." in page
    # val_loss has a value every 5 steps: its points are joined, not left as dots
    (line,) = drawn["train-run-test: val_loss against step"].axes[0].lines
    assert list(line.get_xdata()) == [5, 10, 15, 20]


def test_a_count_that_is_0_everywhere_is_a_sentence_not_an_empty_chart(
        tmp_path: Path) -> None:
    page = render(planted_run(tmp_path / "out"))
    titles = [t for _, _, t in check_self_contained(page)]
    assert not [t for t in titles if t.startswith("verify-formats")], titles
    n = sum(VERIFIED.values())
    assert f"0 disagreements in {n:,} values" in page
    # one disagreement: the chart is back
    rows = [VerifyRow("summary", f, "codes", op, "-", "-", n, int(op == "decode"), None, None,
                      None) for (f, op), n in VERIFIED.items()]
    write_table(tmp_path / "bad" / "verify-formats.parquet", VerifyRow, rows, PROV)
    page = render(tmp_path / "bad")
    titles = [t for _, _, t in check_self_contained(page)]
    assert [t for t in titles if t.startswith("verify-formats")], titles
    assert "0 disagreements" not in page


# --- the page --------------------------------------------------------------------------------

def test_html_is_self_contained_with_every_plot(tmp_path: Path) -> None:
    from PIL import Image

    out = full_run(tmp_path / "out")
    page_path = tmp_path / "report.html"
    result = report(str(out), "--html", str(page_path), "--fail-on", "clip_rate > 0.01")
    assert result.exit_code == 1
    page = page_path.read_text()
    images = check_self_contained(page)
    titles = [t for _, _, t in images]
    assert sorted(titles) == sorted(expected_titles())
    for png, alt, _ in images:
        img = Image.open(io.BytesIO(png))
        assert img.format == "PNG" and img.width > 300 and img.height > 200
        assert len(alt) > 20
        gray = np.asarray(img.convert("L"))
        assert gray.std() > 5  # something is drawn, not a blank canvas
    assert "Broken rules" in page and "clip_rate &gt; 0.01" in page
    assert "<th>worst tensors</th>" in page and "layers.1.w 0.05" in page


def test_plots_only_for_tables_present(run: Path, tmp_path: Path) -> None:
    page_path = tmp_path / "r.html"
    assert report(str(run / "clip-rate.parquet"), "--html", str(page_path)).exit_code == 0
    titles = [t for _, _, t in check_self_contained(page_path.read_text())]
    assert titles == ["clip-rate: clip_rate by tensor"]


def test_plot_scales_follow_the_values(run: Path) -> None:
    from driftcli.report.plots import _scale, axis_label

    assert _scale([1e-6, 0.5, 0.0]) == ("symlog", {"linthresh": 1e-6})
    assert _scale([1e-6, 0.5]) == ("log", {})
    assert _scale([0.1, 0.5, 0.0]) == ("linear", {})
    assert _scale([-0.3, 1e-7, 0.0]) == ("symlog", {"linthresh": 1e-7})
    rng = np.random.default_rng(0)
    assert _scale(list(rng.normal(0, 1e-3, 1000)))[0] == "linear"  # a bias cloud around 0
    assert _scale(list(10 ** rng.uniform(-6, -1, 1000)))[0] == "log"  # rates over decades
    assert _scale([*10 ** rng.uniform(-6, -1, 1000), 0.0])[0] == "symlog"
    table = load([run / "clip-rate.parquet"]).tables[0]
    assert axis_label(table, "clip_rate") == "clip_rate [fraction]"
    assert axis_label(table, "clipped") == "clipped [count]"


# --- in a browser ----------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def frame(gray: np.ndarray) -> tuple[int, int]:
    """The columns of the left and right edges of a figure's axes frame: the two columns
    with the longest runs of dark pixels (of ``gray.T``: the top and bottom rows)."""
    dark = gray < 0.35
    runs = np.zeros(dark.shape[1], dtype=int)
    current = np.zeros(dark.shape[1], dtype=int)
    for row in dark:
        current = np.where(row, current + 1, 0)
        runs = np.maximum(runs, current)
    left, right = sorted(np.argsort(runs)[-2:])  # the spines are about a pixel wide:
    if runs[left + 1] == runs[left]:             # keep the inner column of each
        left += 1
    if runs[right - 1] == runs[right]:
        right -= 1
    assert right - left > 100 and runs[left] > 100, (left, right, runs[left])
    return int(left), int(right)


def screenshot(page: Path, folder: Path, height: int = 4000) -> tuple[Path, Path]:
    """The page as headless Chromium shows it, 1200 × ``height`` CSS pixels at one device
    pixel each, with the network blocked; the screenshot and the browser's network log."""
    shot, netlog = folder / "shot.png", folder / "net.json"
    proc = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={folder / 'profile'}",
         "--host-resolver-rules=MAP * ~NOTFOUND",  # block the network: nothing may resolve
         f"--log-net-log={netlog}", f"--window-size=1200,{height}", "--hide-scrollbars",
         "--force-device-scale-factor=1", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return shot, netlog


NO_BROWSER = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium "
    "chromium-driver); the checks without a browser still run")


@NO_BROWSER
def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    """The page as a browser shows it, and on its figures the points of issue 19: every cast
    visible where two coincide, one colour per cast on the whole page, markers at the
    extremes whole, no constant columns plotted, no empty chart of zeros."""
    from PIL import Image

    out = planted_run(tmp_path / "out")
    page = tmp_path / "report.html"
    assert report(str(out), "--html", str(page)).exit_code == 0
    shot, netlog = screenshot(page, tmp_path)
    img = Image.open(shot)
    assert img.size == (1200, 4000)
    gray = np.asarray(img.convert("L"))
    assert gray.std() > 10  # the page drew text and plots
    assert (gray < 128).mean() > 0.005
    # every request the page itself made (its network isolation key is the file:// origin)
    log = json.loads(netlog.read_text())
    names = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    requested = [e["params"]["url"] for e in log["events"]
                 if names.get(e["type"]) == "URL_REQUEST_START_JOB"
                 and "file://" in str(e.get("params", {}).get("network_isolation_key", ""))]
    assert all(u.startswith(("file:", "data:")) for u in requested), requested
    # the screenshot shows the plots: colour pixels from the markers and series
    rgb = np.asarray(img.convert("RGB")).astype(int)
    saturated = (rgb.max(axis=2) - rgb.min(axis=2)) > 80
    assert saturated.sum() > 2000

    # the figures the browser shows, as the page embeds them
    text = page.read_text()
    images = check_self_contained(text)
    titles = [t for _, _, t in images]
    assert not [t for t in titles if re.search(r"(seed|lr) against step", t)], titles
    assert not [t for t in titles if t.startswith("verify-formats")], titles
    assert f"0 disagreements in {sum(VERIFIED.values()):,} values" in text
    palette: dict[str, str] = {}  # the colours in the order the page first draws each name
    for _, _, title in images:
        for name in SERIES[title.split(":")[0]]:
            palette.setdefault(name, TAB10[len(palette) % len(TAB10)])
    assert len(palette) <= len(TAB10)
    by_item = 0
    for png, _, title in images:
        drawn = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(float) / 255
        shown = SERIES[title.split(":")[0]]
        count = {name: of_colour(drawn, colour) for name, colour in palette.items()}
        for name in palette:  # each series in its page colour, and no other name's colour
            assert (count[name] > 15) == (name in shown), (title, name, count)
        if set(TWINS) <= set(shown) and " by " in title:
            by_item += 1
            left, right = frame(drawn.mean(axis=2))
            top, bottom = frame(drawn.mean(axis=2).T)
            plot = drawn[top + 2:bottom - 1, left + 2:right - 1]  # no legend
            twins = [of_colour(plot, palette[t]) for t in TWINS]
            assert min(twins) >= 0.3 * max(twins), (title, twins)  # neither hides the other
            edges = drawn[:, [left + 1, left + 2, right - 2, right - 1]]
            colourful = (edges.max(axis=2) - edges.min(axis=2)) > 0.3
            assert not colourful.any(), (title, "a marker touches the frame")
    assert by_item == 2
