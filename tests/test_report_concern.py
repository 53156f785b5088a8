"""drift report in order of concern (issue 45, point 5): the measurements that judge a cast
first and the bookkeeping last, in the terminal, Markdown and HTML; heatmaps of the worst
tensors by their measurement, over the scale exponents present, with labels that never
overlap; many tensors plotted against their size; dumps grouped by step and role."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
from test_report import (
    PROV,
    make_row,
    report,
    tensor_row,
    write_real_grad,
    write_run,
)
from test_report_html import NO_BROWSER, drawn, pixels, screenshot  # noqa: F401 (drawn: a fixture)

from driftcli.io.tables import write_table
from driftcli.measures.block_stats import BlockScaleRow, BlockStatsRow
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.report import Options, blockmaps, make_report, markdown, plots
from driftcli.report import html as report_html
from driftcli.verify import VerifyRow

CONCERN = ["clip-rate", "underflow-rate", "error-bias", "grad-cosine", "block-stats",
           "verify-formats", "block-scales"]
"""The tables :func:`mixed_run` writes, in the order a report shows them."""


def scale_rows(tensors: dict[str, list[int]], cast: str = "mxfp8_e4m3") -> list[BlockScaleRow]:
    """Per tensor, one row per scale exponent it has (a block each, and three at the first)."""
    return [make_row(BlockScaleRow, source="m.safetensors", tensor=t, cast=cast,
                     direction="rows", scale_code=e + 127, scale_exponent=e,
                     blocks=3 if k == 0 else 1)
            for t, exps in tensors.items() for k, e in enumerate(exps)]


def stats_rows(shares: dict[str, float], casts: tuple[str, ...] = ("mxfp8_e4m3",),
               directions: tuple[str, ...] = ("rows",)) -> list[BlockStatsRow]:
    return [make_row(BlockStatsRow, source="m.safetensors", tensor=t, cast=c, direction=d,
                     format="float8_e4m3fn", scale_format="e8m0", granularity="block",
                     block=32, n_blocks=100, clipped_blocks=round(100 * v),
                     clipped_block_share=v, element_span=17)
            for c in casts for d in directions for t, v in shares.items()]


def mixed_run(folder: Path) -> Path:
    """Every kind of table, their files named so that alphabetical order is the worst one:
    the block-scales bookkeeping first, clip-rate in the middle."""
    write_run(folder)  # clip-rate, underflow-rate, sub/error-bias
    write_real_grad(folder)
    write_table(folder / "a-block-scales.parquet", BlockScaleRow,
                scale_rows({"w": [-3, -2]}), PROV)
    write_table(folder / "block-stats.parquet", BlockStatsRow, stats_rows({"w": 0.1}), PROV)
    write_table(folder / "aa-verify.parquet", VerifyRow,
                [VerifyRow("summary", "float8_e4m3fn", "codes", "decode", "-", "-", 256, 0,
                           None, None, None)], PROV)
    return folder


def order(text: str, pattern: str) -> list[str]:
    names = [m[1] for m in re.finditer(pattern, text)]
    return [n for n in names if n in CONCERN]


def test_tables_come_in_order_of_concern_everywhere(tmp_path: Path) -> None:
    out = mixed_run(tmp_path / "out")
    rep = make_report([out], Options())
    assert [s.name for s in rep.summaries] == CONCERN
    assert order(markdown.render(rep), r"(?m)^## ([a-z-]+):") == CONCERN
    assert order(report_html.render(rep), r"<h2>([a-z-]+):") == CONCERN
    result = report(str(out))
    assert result.exit_code == 0, result.output
    assert order(result.output, r"(?m)^\s*([a-z-]+): \w+ \(higher is") == CONCERN


@pytest.fixture()
def maps(drawn: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:  # noqa: F811
    """The figures drawn, heatmaps included, by axes title."""
    monkeypatch.setattr(blockmaps, "_png", plots._png)
    return drawn


def rows_of(fig: Any) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def test_heatmaps_show_the_worst_tensors_by_their_measurement(
        tmp_path: Path, maps: dict[str, Any]) -> None:
    n = blockmaps.MAX_TENSORS + 20
    # alphabetically first are the harmless ones; the worst sit at the end of the table
    shares = {f"t{i:03d}": (0.9 if i >= n - 5 else 0.001 * (i % 7)) for i in range(n)}
    spans = {f"t{i:03d}": ([-30, -2] if i >= n - 5 else [-4, -3]) for i in range(n)}
    write_table(tmp_path / "block-stats.parquet", BlockStatsRow, stats_rows(shares), PROV)
    write_table(tmp_path / "block-scales.parquet", BlockScaleRow, scale_rows(spans), PROV)
    page = report_html.render(make_report([tmp_path], Options()))
    worst = [f"t{i:03d}" for i in range(n - 5, n)]
    clip = maps["block-stats: share of blocks that clip, by tensor"]
    assert rows_of(clip)[:5] == worst and len(rows_of(clip)) == blockmaps.MAX_TENSORS
    (scales,) = [f for t, f in maps.items() if t.startswith("block-scales: scale exponents")]
    assert rows_of(scales)[:5] == worst
    assert f"The {blockmaps.MAX_TENSORS} of {n} tensors with the largest" in page


def test_an_exponent_axis_spans_the_exponents_present(tmp_path: Path,
                                                      maps: dict[str, Any]) -> None:
    # one all-zero block's scale at E8M0's floor, -127, the rest between -9 and -3
    spans = {"a": [-9, -8, -7], "b": [-5, -4, -3], "zero": [-127, -6]}
    write_table(tmp_path / "block-scales.parquet", BlockScaleRow, scale_rows(spans), PROV)
    page = report_html.render(make_report([tmp_path], Options()))
    (fig,) = [f for t, f in maps.items() if "scale exponents" in t]
    image = fig.axes[0].images[0].get_array()
    assert image.shape[1] <= 9, image.shape  # -127, a break, -9..-3: not 125 columns
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert "-127" in ticks and "-9" in ticks and "-3" in ticks, ticks
    assert "-126 to -10: no blocks" in page


@NO_BROWSER
def test_an_exponent_map_is_readable_in_the_browser(tmp_path: Path) -> None:
    """As Chromium shows the page: each cell of the scale-exponent map is wide (on main, 125
    columns from -127 to -3 were shrunk to fit the page, 8 pixels each)."""
    import numpy as np
    from matplotlib import colormaps
    from PIL import Image

    exps = {"a": [-9, -8, -7, -6], "b": [-5, -4, -3], "zero": [-127, -6, -5]}
    rows = [make_row(BlockScaleRow, source="m.safetensors", tensor=t, cast="mxfp8_e4m3",
                     direction="rows", scale_code=e + 127, scale_exponent=e, blocks=k + 1)
            for t, es in exps.items() for k, e in enumerate(es)]
    write_table(tmp_path / "out" / "block-scales.parquet", BlockScaleRow, rows, PROV)
    page = tmp_path / "r.html"
    assert report(str(tmp_path / "out"), "--html", str(page)).exit_code == 0
    shot, _ = screenshot(page, tmp_path)
    rgb = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    shares = {(k + 1) / sum(range(1, len(es) + 1)) for es in exps.values()
              for k in range(len(es))}
    widths = []
    for share in shares:  # every cell has a share of its own in its row, so a colour
        colour = np.round(np.asarray(colormaps["viridis"](share)[:3]) * 255)
        hit = np.abs(rgb - colour).max(axis=2) <= 6
        runs = []  # the longest run of the colour in each row that has it
        for row in hit[hit.sum(axis=1) >= 3]:
            edges = np.flatnonzero(np.diff(np.r_[0, row.astype(int), 0]))
            runs.append(int((edges[1::2] - edges[::2]).max()))
        widths.append(float(np.median(runs)))  # a cell's rows, not the colour bar's one
    assert min(widths) >= 25, widths


def overlaps(labels: list[Any], renderer: Any) -> list[tuple[str, str]]:
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels
             if t.get_visible() and t.get_text()]
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2)
            if ba.overlaps(bb) and ba.intersection(ba, bb).width > 0.5
            and ba.intersection(ba, bb).height > 0.5]


def test_heatmap_labels_never_overlap(tmp_path: Path, maps: dict[str, Any]) -> None:
    casts = ("mxfp8_e4m3", "mxfp8_e4m3_ceil", "nvfp4", "fp8_e4m3", "mxfp4_e2m1")
    shares = {f"model.layers.{i}.mlp.down_proj.weight": 0.01 * i for i in range(12)}
    write_table(tmp_path / "block-stats.parquet", BlockStatsRow,
                stats_rows(shares, casts, ("rows", "columns")), PROV)
    spans = {t: list(range(-40, 10, 1)) for t in list(shares)[:3]}
    write_table(tmp_path / "block-scales.parquet", BlockScaleRow, scale_rows(spans), PROV)
    report_html.render(make_report([tmp_path], Options()))
    heatmaps = {t: f for t, f in maps.items() if "scale exponents" in t or "blocks that clip" in t}
    assert len(heatmaps) == 2
    for title, fig in heatmaps.items():
        pixels(fig)  # lays the figure out, as saving it does
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            assert not overlaps(labels, renderer), (title, overlaps(labels, renderer)[:3])


def test_many_tensors_are_plotted_against_their_size(tmp_path: Path,
                                                     drawn: dict[str, Any]) -> None:  # noqa: F811
    rows = [tensor_row(ClipRateRow, f"t{i}", "mxfp8_e4m3", clip_rate=0.001 * (i % 9),
                       clipped=1, n_blocks=10, numel=64 * (i + 1))
            for i in range(80)]
    rows.append(tensor_row(ClipRateRow, "*", "mxfp8_e4m3", clip_rate=0.004, clipped=80,
                           n_blocks=800, numel=64 * 80 * 81 // 2))
    write_table(tmp_path / "clip-rate.parquet", ClipRateRow, rows, PROV)
    report_html.render(make_report([tmp_path], Options()))
    ax = drawn["clip-rate: clip_rate by tensor"].axes[0]
    assert ax.get_xlabel().startswith("numel"), ax.get_xlabel()
    assert ax.get_xscale() == "log"
    xs = sorted(x for c in ax.collections for x, _ in c.get_offsets()
                if c.get_label() and not c.get_label().startswith("_"))
    assert xs == [64.0 * (i + 1) for i in range(80)]


ROLES = ("activation", "weight", "gradient")


def test_dumps_are_grouped_by_step_and_role(tmp_path: Path) -> None:
    rows = [tensor_row(ClipRateRow, f"s{step}.{role}.{k}", "mxfp8_e4m3", step=step, role=role,
                       clip_rate=(0.1 if role == "gradient" else 0.001) * (step // 100) * (k + 1),
                       clipped=1, n_blocks=10)
            for step in (100, 200) for role in ROLES for k in range(2)]
    rows.append(tensor_row(ClipRateRow, "*", "mxfp8_e4m3", clip_rate=0.02, clipped=12,
                           n_blocks=120))
    write_table(tmp_path / "clip-rate.parquet", ClipRateRow, rows, PROV)
    (summary,) = make_report([tmp_path], Options()).summaries
    groups = {(dict(g.group).get("step"), dict(g.group).get("role")): g
              for g in summary.groups}
    assert set(groups) == {(s, r) for s in (100, 200) for r in ROLES} | {(None, None)}
    assert groups[(200, "gradient")].worst_value == pytest.approx(0.4)
    assert groups[(100, "weight")].n_rows == 2
    assert groups[(None, None)].aggregate_value("clip_rate") == pytest.approx(0.02)
    text = markdown.render(make_report([tmp_path], Options()))
    assert "| 200 | gradient | 2 | - | - | 0.3 | 0.4 | s200.gradient.1 0.4 |" in text, text
    assert "| all | all | 0 | 0.02 | - | - | - | - |" in text, text
    # drawn by tensor, a series per step and role; step is not a per-step table's key here
    page = report_html.render(make_report([tmp_path], Options()))
    titles = re.findall(r'<img [^>]* title="([^"]+)"', page)
    assert titles == ["clip-rate: clip_rate by tensor"], titles
