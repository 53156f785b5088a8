"""What a command does with its output before and after the work: an --out it cannot write
is found before any work, a run that measured nothing writes nothing (an earlier table
stays) and leaves no empty folder, and an input with nothing to measure is an error."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.measures import scan as scan_module
from driftcli.measures.scan import NothingToMeasure, scan

runner = CliRunner()


def _writable(folder: str) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.safetensors"
    save_file({"w": torch.randn(4, 32), "steps": torch.arange(3)}, path)
    return path


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return path


@pytest.fixture
def no_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan must not start: the output is checked first."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the scan ran before --out was checked")

    monkeypatch.setattr(scan_module, "scan", refuse)


def test_out_naming_a_file_is_refused_before_any_work(good: Path, tmp_path: Path,
                                                      no_scan: None) -> None:
    file = tmp_path / "taken"
    file.write_text("mine")
    result = runner.invoke(app, ["clip-rate", str(good), "-c", "mxfp8_e4m3", "--out", str(file)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: --out {file} is a file; --out names a folder " \
                                    "(the tables go in it)"
    assert file.read_text() == "mine"


def test_out_below_a_file_is_refused_before_any_work(good: Path, tmp_path: Path,
                                                     no_scan: None) -> None:
    file = tmp_path / "taken"
    file.write_text("mine")
    result = runner.invoke(app, ["error-bias", str(good), "-c", "nvfp4", "--out",
                                 str(file / "deeper")])
    assert result.exit_code == 2 and f"{file} is a file" in result.output
    assert "choose another --out" in result.output


@pytest.mark.skipif(_writable("/sys"), reason="/sys is writable here: no unwritable folder to "
                    "try (root ignores permission bits)")
def test_an_unwritable_out_is_refused_before_any_work(good: Path, no_scan: None) -> None:
    result = runner.invoke(app, ["underflow-rate", str(good), "-c", "nvfp4", "--out",
                                 "/sys/drift-out"])
    assert result.exit_code == 2
    line = result.output.strip()
    assert line.startswith("error: --out /sys/drift-out: cannot write in /sys (")
    assert line.endswith("choose a --out you can write to") and "\n" not in line
    assert "Errno" not in line and ".tmp" not in line


def test_a_run_that_measures_nothing_keeps_the_earlier_table(good: Path, broken: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert runner.invoke(app, ["clip-rate", str(good), "-c", "mxfp8_e4m3", "--out", str(out),
                               "-q"]).exit_code == 0
    table = out / "clip-rate.parquet"
    before = table.read_bytes()
    result = runner.invoke(app, ["clip-rate", str(broken), "-c", "mxfp8_e4m3", "--out",
                                 str(out), "-q", "--overwrite"])
    assert result.exit_code == 2
    assert "error: nothing could be measured: 1 tensor(s) or file(s) failed" in result.output
    assert f"no table written; {table} from an earlier run is kept" in result.output
    assert "the others were measured" not in result.output
    assert table.read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["clip-rate.parquet"]  # no temporary left


def test_a_failed_run_leaves_no_empty_folder(broken: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "out"
    result = runner.invoke(app, ["clip-rate", str(broken), "-c", "nvfp4", "--out", str(out)])
    assert result.exit_code == 2 and "no table written" in result.output
    assert "earlier run" not in result.output
    assert not (tmp_path / "new").exists()


def test_no_floating_point_tensors_is_exit_2_naming_what_was_skipped(tmp_path: Path) -> None:
    ints = tmp_path / "ints.safetensors"
    save_file({"ids": torch.arange(5), "mask": torch.ones(3, dtype=torch.bool),
               "pos": torch.arange(4)}, ints)
    out = tmp_path / "out"
    result = runner.invoke(app, ["clip-rate", str(ints), "-c", "mxfp8_e4m3", "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: no floating-point tensors in {ints} (3 skipped: dtypes bool, int64); drift "
        "measures float tensors only")
    assert not out.exists()


def test_an_input_with_nothing_to_measure_beside_others_is_an_error_row(
        good: Path, tmp_path: Path) -> None:
    ints = tmp_path / "ints.safetensors"
    save_file({"ids": torch.arange(5)}, ints)
    s = scan([good, ints], ["mxfp8_e4m3"])
    measured = [r for r in s.results if r.error is None]
    assert [r.ref.name for r in measured if r.ref] == ["w"]
    assert [r.error for r in s.errors] == [
        f"no floating-point tensors in {ints} (1 skipped: dtypes int64); drift measures float "
        "tensors only"]
    with pytest.raises(NothingToMeasure, match="--include/--exclude left out all 2"):
        scan([good], ["mxfp8_e4m3"], include=["nothing*"])
