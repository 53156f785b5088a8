"""Real model folders: training-state files skipped, model checks before loading (issue 26,
items 5 and 6)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.readers import open_inputs

runner = CliRunner()


def _fine_tune(folder: Path) -> Path:
    """An HF-style fine-tune folder: weights plus the files a Trainer writes beside them."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({"w.weight": torch.randn(8, 32, generator=g) * 100,
               "w.bias": torch.randn(8, generator=g)}, folder / "model.safetensors")
    torch.save(argparse.Namespace(lr=1e-3), folder / "training_args.bin")  # a pickled class
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    torch.save({"last_epoch": 3}, folder / "scheduler.pt")
    torch.save({"python": 1.0}, folder / "rng_state_0.pth")
    (folder / "trainer_state.json").write_text("{}")
    return folder


def test_training_state_files_are_skipped_and_listed(tmp_path: Path) -> None:
    folder = _fine_tune(tmp_path / "ft")
    inputs = open_inputs([folder])
    assert [p.name for p in inputs.skipped] == [
        "optimizer.pt", "rng_state_0.pth", "scheduler.pt", "training_args.bin"]
    assert inputs.errors == ()
    assert sorted(r.name for r in inputs.tensors) == ["w.bias", "w.weight"]
    # named on its own, a training-state file is read as asked (here: refused, a pickle)
    named = open_inputs([folder / "training_args.bin"])
    assert named.skipped == () and len(named.errors) == 1


def test_fine_tune_folder_exits_0(tmp_path: Path) -> None:
    folder = _fine_tune(tmp_path / "ft")
    result = runner.invoke(app, ["clip-rate", str(folder), "-c", "mxfp8_e4m3",
                                 "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert [Path(f).name for f in summary["skipped_files"]] == [
        "optimizer.pt", "rng_state_0.pth", "scheduler.pt", "training_args.bin"]
    assert summary["errors"] == []
    assert summary["casts"][0]["tensors"] == 2


def test_folder_of_training_state_only_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    torch.save({"state": {}}, folder / "optimizer.pt")
    result = runner.invoke(app, ["clip-rate", str(folder), "-c", "mxfp8_e4m3",
                                 "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "only optimizer.pt, which hold no weights" in result.output


@pytest.fixture(autouse=True)
def _no_cwd_output(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
