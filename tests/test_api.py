"""drift.measure: a tensor, a state dict, a module or a path in memory, the command's rows out
(issue 26, item 9)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import driftcli as drift
from driftcli.cli import app
from driftcli.errors import DriftError
from driftcli.io.tables import read_table

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def _weights() -> dict[str, torch.Tensor]:
    # linspace, not randn: the same values on every CPU
    w = torch.linspace(-3, 3, 64 * 48).reshape(64, 48) ** 3 * 40
    return {"layer.weight": w, "layer.bias": torch.linspace(-1, 1, 64),
            "head.weight": w.T.contiguous() / 1e6, "step": torch.tensor(7)}


def _command(tmp_path: Path, what: str, path: Path, *casts: str,
             extra: tuple[str, ...] = ()) -> pd.DataFrame:
    out = tmp_path / f"out-{what}"
    result = runner.invoke(app, [what, str(path), *[a for c in casts for a in ("-c", c)],
                                 "--out", str(out), "--quiet", *extra])
    assert result.exit_code == 0, result.output
    return read_table(out / f"{what}.parquet")[0]


@pytest.mark.parametrize("what", ["clip-rate", "underflow-rate", "error-bias", "cast-diff"])
def test_a_state_dict_gives_the_commands_rows(tmp_path: Path, what: str) -> None:
    sd = _weights()
    path = tmp_path / "sd.pt"
    torch.save(sd, path)
    casts = ("mxfp8_e4m3", "nvfp4", "fp8_e4m3")
    expected = _command(tmp_path, what, path, *casts)
    expected["source"] = "state_dict"
    got = drift.measure(sd, list(casts), what)
    pd.testing.assert_frame_equal(got, expected)
    assert len(got) == 3 * (3 if what != "cast-diff" else 2) + (3 if what != "cast-diff" else 2)


def test_a_path_gives_the_commands_rows(tmp_path: Path) -> None:
    path = tmp_path / "sd.pt"
    torch.save(_weights(), path)
    expected = _command(tmp_path, "error-bias", path, "mxfp4_e2m1:sr", extra=("--draws", "3"))
    got = drift.measure(str(path), "mxfp4_e2m1:sr", "error-bias", draws=3)
    pd.testing.assert_frame_equal(got, expected)
    assert set(got["draws"]) == {3}


def test_a_tensor_and_a_module(tmp_path: Path) -> None:
    w = _weights()["layer.weight"]
    got = drift.measure(w, "float8_e4m3fn", name="w")
    assert list(got["source"]) == ["w", "w"] and list(got["tensor"]) == ["w", "*"]
    # unscaled, the values above E4M3's 448 clip: a quarter of them
    assert got["clip_rate"].iloc[0] == float((w.abs() > 448).double().mean()) == 782 / 3072
    lin = torch.nn.Linear(48, 64)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(_weights()["layer.bias"])
    rows = drift.measure(lin, "float8_e4m3fn")
    assert list(rows["tensor"]) == ["weight", "bias", "*"]
    assert rows["clip_rate"].iloc[0] == got["clip_rate"].iloc[0]


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(DriftError, match="unknown measurement 'clip_rate'; choose one of "
                                         "clip-rate, underflow-rate, error-bias, cast-diff"):
        drift.measure(torch.ones(4), "fp8_e4m3", "clip_rate")
    with pytest.raises(DriftError, match=r"measure: opt\.0 is a object; give tensors"):
        drift.measure({"opt": [object()]}, "fp8_e4m3")
    with pytest.raises(DriftError, match="unknown format or preset 'fp9_e9m9'"):
        drift.measure(torch.ones(4), "fp9_e9m9")


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/api.md's example, run as it is: every printed line as the page shows it."""
    text = (ROOT / "docs" / "api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```\n+```text\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    scope: dict[str, object] = {}
    for code, shown in blocks:
        exec(compile(code, "docs/api.md", "exec"), scope)
        printed = capsys.readouterr().out
        assert printed.rstrip() == shown.rstrip()


def test_stochastic_draws_follow_the_seed_only() -> None:
    """The draws of an sr cast, seeded by (seed, source name, tensor name), are the same on
    every call with the same seed, and others with another seed."""
    w = _weights()["layer.weight"]
    first = drift.measure(w, "mxfp4_e2m1:sr", "error-bias", draws=2, seed=5)
    again = drift.measure(w, "mxfp4_e2m1:sr", "error-bias", draws=2, seed=5)
    other = drift.measure(w, "mxfp4_e2m1:sr", "error-bias", draws=2, seed=6)
    pd.testing.assert_frame_equal(first, again)
    assert first["rel_error"].iloc[0] != other["rel_error"].iloc[0]


def test_an_axis_some_tensors_lack_skips_and_names_them() -> None:
    sd = _weights()
    got = drift.measure(sd, "float8_e4m3fn", axis=1)
    assert list(got["tensor"]) == ["layer.weight", "head.weight", "*"]
    assert got.attrs["skipped"] == [
        "state_dict layer.bias [64]: --axis 1 is not one of its axes"]
