"""docs/findings.md, "The formats after OCP on stories260K's weights": error-bias and clip-rate
of the section's casts re-run on the checkpoint, and the numbers the section shows checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from driftcli.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "findings.md"
WEIGHTS = ROOT.parent / "shared" / "data" / "models" / "stories260K-hf" / "model.safetensors"
NO_DATA = not WEIGHTS.is_file()

CASTS = ["fp8_e4m3", "hifloat8", "hifloat8:tensor", "binary8p4se:tensor", "mxfp4_e2m1", "nvfp4",
         "binary4p2sf:block32", "hifloat4"]
"""The section's casts, as data: a cast added here joins both scans; its row in :data:`TABLE`
and in the doc follows."""

# cast: (mean rel_error over the 47 tensors, mean bias x 1e3, elements clipped of 260,032:
# each tensor once, a weight's own rows, not the scans' all-tensors rows).
# The weights are fixed and the casts exact; only the float64 sums of each tensor's error may
# take another order on another back-end (about 1e-15 relative), far below the digits shown.
TABLE = {
    "fp8_e4m3": (0.0262, -0.41, 5),
    "hifloat8": (0.0320, -0.61, 0),
    "hifloat8:tensor": (0.1012, -10.97, 0),
    "binary8p4se:tensor": (0.0262, -0.41, 5),
    "mxfp4_e2m1": (0.1151, -23.53, 7073),
    "nvfp4": (0.0986, -3.12, 9238),
    "binary4p2sf:block32": (0.1151, -23.53, 7073),
    "hifloat4": (0.0782, -5.41, 12331),
}
TENSORS, ELEMENTS = 47, 260_032

runner = CliRunner()


def summary(scan: Path) -> dict[str, dict[str, float]]:
    """Per cast (its spec as given): tensors, elements, the mean rel_error and bias over the
    tensors (error-bias) and the elements clipped (clip-rate), from the per-tensor rows."""
    import pandas as pd

    found: dict[str, dict[str, float]] = {}
    bias = pd.read_parquet(scan / "error-bias.parquet")
    clip = pd.read_parquet(scan / "clip-rate.parquet")
    bias, clip = bias[bias.n_tensors == 1], clip[clip.n_tensors == 1]
    for spec, full in zip(CASTS, bias.cast.unique(), strict=True):
        rows, clips = bias[bias.cast == full], clip[clip.cast == full]
        found[spec] = {"tensors": len(rows), "elements": int(rows.numel.sum()),
                       "rel_error": float(rows.rel_error.mean()),
                       "bias": float(rows.bias.mean()), "clipped": int(clips.clipped.sum())}
    return found


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("formats") / "scan"
    casts = [a for c in CASTS for a in ("-c", c)]
    for cmd in ("error-bias", "clip-rate"):
        res = runner.invoke(app, [cmd, str(WEIGHTS), *casts, "--out", str(out), "-q"])
        assert res.exit_code == 0, res.output
    return out


@pytest.mark.slow  # two scans of eight casts over the 47 tensors: about 20 s of one core
@pytest.mark.xfail(NO_DATA, reason=f"needs the shared stories260K weights at {WEIGHTS}",
                   strict=True)
def test_the_scans_give_the_docs_table(scan: Path) -> None:
    got = summary(scan)
    assert list(got) == list(TABLE)
    for cast, (rel_error, bias, clipped) in TABLE.items():
        n = got[cast]
        assert (n["tensors"], n["elements"]) == (TENSORS, ELEMENTS), cast
        assert round(n["rel_error"], 4) == rel_error, (cast, n["rel_error"])
        assert round(n["bias"] * 1e3, 2) == bias, (cast, n["bias"])
        assert n["clipped"] == clipped, (cast, n["clipped"])
    # the verdicts the section draws: unscaled HiFloat8 a fifth worse than scaled E4M3, scaled
    # to its max almost four times worse; binaryKpP on E4M3's and E2M1's grids gives their
    # numbers; NVFP4 below MXFP4
    assert 1.15 < got["hifloat8"]["rel_error"] / got["fp8_e4m3"]["rel_error"] < 1.25
    assert got["hifloat8:tensor"]["rel_error"] > 3.5 * got["fp8_e4m3"]["rel_error"]
    assert got["nvfp4"]["rel_error"] < got["mxfp4_e2m1"]["rel_error"]
    assert got["hifloat4"]["rel_error"] < got["nvfp4"]["rel_error"]  # and clips the most
    assert got["binary4p2sf:block32"] == got["mxfp4_e2m1"]
    assert got["binary8p4se:tensor"] == got["fp8_e4m3"]


def test_the_doc_shows_the_tables_numbers() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## The formats after OCP on stories260K's weights")[1]
    section = section.split("\n## ")[0]
    for cast, (rel_error, bias, clipped) in TABLE.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| `{cast}` |"))
        for number in (f"{rel_error:.4f}", f"{bias:.2f}".replace("-", "−"), f"{clipped:,}"):
            assert number in row, (cast, number, row)
    for cast in CASTS:
        assert f"-c {cast}" in section  # the commands name every cast
