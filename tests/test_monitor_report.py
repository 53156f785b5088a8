"""drift report on a monitor folder: the parts read as one table per measurement, layer x step
heatmaps and time series per cast, and --fail-on over every step."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_monitor import TwoLayer, run
from test_report_html import screenshot
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.report.load import load

runner = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _plant(s: int, model: TwoLayer) -> None:
    """One weight of the first block's up projection at 5000 for step 4 only."""
    if s in (4, 5):
        up = model.blocks[0].up
        assert isinstance(up, torch.nn.Linear)
        with torch.no_grad():
            up.weight[3, 7] = 5000.0 if s == 4 else 0.01


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("monrep") / "mon"
    run(8, monitor={"casts": ["mxfp8_e4m3", "nvfp4"], "every": 2, "out": out,
                    "measurements": ["clip-rate", "stats"], "flush_every": 2}, before=_plant)
    return out


def test_the_parts_are_read_as_one_table_each(folder: Path) -> None:
    parts = sorted(p.name for p in (folder / "monitor-stats").iterdir())
    assert parts == ["part-000000000.parquet", "part-000000004.parquet"]  # two steps each
    tables = {t.name: t for t in load([folder]).tables}
    assert set(tables) == {"monitor-clip-rate", "monitor-stats"}
    assert sorted(tables["monitor-stats"].frame.step.unique()) == [0, 2, 4, 6]
    assert tables["monitor-stats"].path == folder / "monitor-stats"
    manifest = json.loads((folder / "monitor.json").read_text())
    assert manifest["every"] == 2 and manifest["tables"]["stats"] == "monitor-stats"


def test_fail_on_finds_the_planted_step(folder: Path, tmp_path: Path) -> None:
    rule = "monitor-stats: amax > 1000 and role == 'weight'"
    res = runner.invoke(app, ["report", str(folder), "--fail-on", rule, "--json",
                              str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output
    got = json.loads((tmp_path / "r.json").read_text())
    broken = got["violations"]
    assert len(broken) == 1 and broken[0]["rows"] == 2  # forward and dgrad of one weight
    rows = broken[0]["shown"]
    assert {r["step"] for r in rows} == {4} and {r["tensor"] for r in rows} == {
        "blocks.0.up/weight"}
    ok = runner.invoke(app, ["report", str(folder), "--fail-on",
                             "monitor-stats: amax > 1e6"])
    assert ok.exit_code == 0, ok.output


def _pngs(page: str) -> dict[str, np.ndarray]:
    found = re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="[^"]*" title="([^"]+)"',
                       page)
    return {title: np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
            for data, title in found}


def test_the_page_draws_heatmaps_and_time_series_per_cast(folder: Path, tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    res = runner.invoke(app, ["report", str(folder), "--html", str(page)])
    assert res.exit_code == 0, res.output
    figs = _pngs(page.read_text())
    titles = sorted(figs)
    assert len(titles) == 6  # clip-rate: 2 casts x 2 figures; stats: 2 figures
    assert sum("by layer and step under nvfp4" in t for t in titles) == 1  # the name given
    assert sum("per layer over the run" in t for t in titles) == 3
    heat = figs["monitor-stats: dynamic_range by layer and step"]
    # the planted weight widens blocks.0.up's range at step 4 alone: viridis' yellow (the top
    # of the scale) appears on the map
    yellow = (heat[..., 0] > 230) & (heat[..., 1] > 210) & (heat[..., 2] < 80)
    assert yellow.sum() > 50


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get "
                    "install chromium); the pixel checks of the PNGs above still run")
def test_the_page_is_readable_in_headless_chromium(folder: Path, tmp_path: Path) -> None:
    page = tmp_path / "r.html"  # one table's folder of parts: its heatmap within the window
    assert runner.invoke(app, ["report", str(folder / "monitor-stats"), "--html",
                               str(page)]).exit_code == 0
    shot, _ = screenshot(page, tmp_path, height=6000)
    rgb = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    yellow = (rgb[..., 0] > 230) & (rgb[..., 1] > 210) & (rgb[..., 2] < 80)
    assert yellow.sum() > 50  # the heatmap's planted cell, drawn by the browser
