"""drift report on attention probes: a layer × step heatmap per column where a line per layer
would be unreadable, lines where it would not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from driftcli.io.tables import write_table
from driftcli.measures.probe_attention import AttentionRow
from driftcli.report import Options, make_report, plots
from driftcli.report import html as report_html
from driftcli.report.load import read

PROV = {"drift_version": "0.1.0", "utc": "2026-01-02T03:04:05+00:00",
        "command": ["drift", "train"], "inputs": []}
STEPS = (1, 10, 20, 30)


def clip(layer: int, step: int) -> float:
    """A P clip rate that grows with the step, more in deeper layers."""
    return (layer + 1) * step / 1000


def attention(folder: Path, layers: int) -> Path:
    rows = [AttentionRow(run="r", step=s, batch="train", policy="mxfp8_e4m3",
                         layer=f"blocks.{n}.attn", cast="mx", logit_max=1.0 + n + s / 10,
                         p_mass_high=0.05, p_clip_rate=clip(n, s), p_underflow_rate=0.0,
                         dy_pv_clip_rate=0.01, dy_pv_underflow_rate=None,
                         dy_qk_clip_rate=0.02, dy_qk_underflow_rate=None)
            for s in STEPS for n in range(layers)]
    return write_table(folder / "attention.parquet", AttentionRow, rows, PROV)


@pytest.fixture()
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    encode = plots._png

    def keep(fig: Any) -> bytes:
        figures[fig.axes[0].get_title()] = fig
        return encode(fig)

    monkeypatch.setattr(plots, "_png", keep)
    return figures


def test_many_layers_make_a_heatmap_with_the_values(tmp_path: Path,
                                                    drawn: dict[str, Any]) -> None:
    table = read(attention(tmp_path, 12))
    figs = plots.figures(table)
    titles = [f.title for f in figs]
    assert titles[:2] == ["attention: p_clip_rate by layer and step",
                          "attention: logit_max by layer and step"]
    fig = drawn["attention: p_clip_rate by layer and step"]
    ax = fig.axes[0]
    (image,) = ax.images
    grid = np.asarray(image.get_array())
    want = np.array([[clip(n, s) for s in STEPS] for n in range(12)])
    assert np.array_equal(grid, want)  # row n is layer n, column j is step STEPS[j]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"blocks.{n}.attn"
                                                             for n in range(12)]
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(s) for s in STEPS]
    notes = [f for f in figs if isinstance(f, plots.Note)]
    assert "p_mass_high = 0.05" in notes[0].text and "p_underflow_rate = 0" in notes[0].text
    page = report_html.render(make_report([tmp_path], Options()))
    assert "attention: p_clip_rate by layer and step" in page


def test_few_layers_stay_lines(tmp_path: Path, drawn: dict[str, Any]) -> None:
    table = read(attention(tmp_path, 2))
    titles = [f.title for f in plots.figures(table) if isinstance(f, plots.Plot)]
    assert "attention: p_clip_rate against step" in titles
    lines = drawn["attention: p_clip_rate against step"].axes[0].lines
    assert sorted(tuple(line.get_ydata()) for line in lines) == [
        tuple(clip(n, s) for s in STEPS) for n in range(2)]
