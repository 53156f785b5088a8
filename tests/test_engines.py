"""The execution engines: every engine writes the serial table bit for bit, a dead worker's
unit is retried and counted once, an interrupted run resumes, and the Ray engine without Ray
is one error line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli import engines
from driftcli.cli import app
from driftcli.engines import Execution, Manifest
from driftcli.io.tables import read_table
from driftcli.measures import MEASURES
from driftcli.measures import scan as scan_module
from driftcli.measures.scan import ScanOptions, TensorUnit, scan, scan_unit
from driftcli.modes import Engine

runner = CliRunner()
CASTS = ["fp8_e4m3", "mxfp8_e4m3", "nvfp4", "mxfp4_e2m1:sr"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two files of tensors of several sizes and scales (so casts clip and underflow), one of
    them broken: its error row must come back from every engine the same."""
    folder = tmp_path_factory.mktemp("engines")
    gen = torch.Generator().manual_seed(7)
    save_file({f"w{i}": torch.randn(96, 160, generator=gen) * 10.0 ** (i - 3)
               for i in range(5)}, folder / "a.safetensors")
    save_file({"v": torch.randn(40, 64, generator=gen).to(torch.bfloat16),
               "ids": torch.arange(4)}, folder / "b.safetensors")
    (folder / "c.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    return folder


def _table(command: str, folder: Path, out: Path, *extra: str) -> pd.DataFrame:
    argv = [command, str(folder), *(a for c in CASTS for a in ("-c", c)), "--out", str(out),
            "-q", *extra]
    if command == "error-bias":
        argv += ["--draws", "3", "--seed", "5"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output  # the broken file is reported...
    assert "the others were measured into" in result.output  # ...and the rest measured
    frame, prov = read_table(out / f"{command}.parquet")
    engine = extra[extra.index("--engine") + 1] if "--engine" in extra else "serial"
    assert prov["engine"] == engine
    assert not list(out.glob(".*.units"))  # the finished units are cleared with the table
    return frame


@pytest.mark.parametrize("command", ["clip-rate", "underflow-rate", "error-bias"])
def test_every_engine_writes_the_serial_table(command: str, inputs: Path, tmp_path: Path,
                                              ray_cluster: object) -> None:
    serial = _table(command, inputs, tmp_path / "serial")
    for engine in ("processes", "ray"):
        other = _table(command, inputs, tmp_path / engine, "--engine", engine, "--workers", "2")
        # the same rows in the same order, every integer count and float64 sum bit for bit
        pd.testing.assert_frame_equal(serial, other, check_exact=True)
    assert len(serial) == len(CASTS) * (1 + 6 + 1)  # the broken file, 6 float tensors, "*"


class DiesOnce:
    """A scan unit whose worker process dies the first time it runs ``victim``."""

    def __init__(self, marker: Path, victim: str) -> None:
        self.marker, self.victim = marker, victim

    def __call__(self, unit: TensorUnit) -> list:
        if unit.ref.name == self.victim and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(1)  # the process dies, as a killed worker does
        return scan_unit(unit)


def _units(folder: Path) -> list[TensorUnit]:
    from driftcli.cast import parse_cast
    from driftcli.io.readers import open_inputs

    casts = tuple(parse_cast(c) for c in CASTS)
    found = open_inputs([folder / "a.safetensors"])
    return [TensorUnit(str(folder), ref, casts, ScanOptions(draws=2), 0, True)
            for ref in found.tensors]


def test_a_dead_worker_is_retried_and_its_unit_counted_once(inputs: Path, tmp_path: Path,
                                                             ray_cluster: object) -> None:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers lack tests/
    units = _units(inputs)
    want = engines.run(units, scan_unit)
    marker = tmp_path / "died"
    got = engines.run(units, DiesOnce(marker, "w2"), Execution(Engine.RAY, workers=2))
    assert marker.exists()  # a worker really died under the unit...
    assert got == want  # ...which ran again: every unit's results once, in order


def test_an_interrupted_scan_resumes_from_its_finished_units(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    units_dir = tmp_path / "units"
    ran: list[str] = []

    def interrupted(unit: TensorUnit, *args: object) -> list:
        if unit.ref.name == "w3":
            raise KeyboardInterrupt  # the driver stopped here
        ran.append(unit.ref.name)
        return scan_unit(unit, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(scan_module, "scan_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scan([inputs / "a.safetensors"], CASTS, execution=Execution(resume=units_dir))
    assert ran == ["w0", "w1", "w2"] and len(list(units_dir.iterdir())) == 3
    ran.clear()
    monkeypatch.setattr(scan_module, "scan_unit",
                        lambda unit, *a: ran.append(unit.ref.name) or scan_unit(unit, *a))
    resumed = scan([inputs / "a.safetensors"], CASTS, execution=Execution(resume=units_dir))
    assert ran == ["w3", "w4"]  # only what the first run did not finish
    monkeypatch.setattr(scan_module, "scan_unit", scan_unit)
    fresh = scan([inputs / "a.safetensors"], CASTS)
    rows = MEASURES["error-bias"].rows
    assert rows(resumed) == rows(fresh)


def test_a_manifest_takes_only_the_unit_it_kept(tmp_path: Path) -> None:
    kept = Manifest(tmp_path / "m")
    kept.put(("a", 1), [1, 2])
    assert kept.get(("a", 1)) == (True, [1, 2])
    assert kept.get(("a", 2)) == (False, None)  # another unit: not taken for the first
    kept.clear()
    assert not (tmp_path / "m").exists()


def test_the_ray_engine_without_ray_is_one_line_naming_the_extra(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as when not installed
    result = runner.invoke(app, ["clip-rate", str(inputs), "-c", "mxfp8_e4m3", "--engine",
                                 "ray", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output == "error: --engine ray needs Ray: pip install 'driftcli[ray]'\n"
    assert not (tmp_path / "clip-rate.parquet").exists()


def test_a_ray_address_nothing_answers_at_is_one_line_at_once(inputs: Path,
                                                               tmp_path: Path) -> None:
    """Ray retries an unreachable address for minutes, printing all the while: drift asks the
    port first (in a fresh process: this one's Ray is connected already)."""
    import subprocess

    pytest.importorskip("ray", reason="the Ray engine's tests need driftcli[ray]")
    proc = subprocess.run([sys.executable, "-m", "driftcli", "clip-rate", str(inputs), "-c",
                           "mxfp8_e4m3", "--engine", "ray", "--ray-address", "127.0.0.1:1",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --ray-address 127.0.0.1:1: no Ray cluster answers "
                                  "there (") and proc.stderr.count("\n") == 1


def test_accum_error_on_every_engine_is_the_serial_table(tmp_path: Path,
                                                         ray_cluster: object) -> None:
    tables = {}
    for engine in ("serial", "processes", "ray"):
        out = tmp_path / engine
        result = runner.invoke(app, ["accum-error", "--shape", "8x96x8", "--shape", "4x200x6",
                                     "--dist", "normal", "--dist", "lognormal", "--acc",
                                     "bfloat16", "--acc", "float32:rtz", "--order",
                                     "pairwise", "--cast", "mxfp8_e4m3:sr", "--out", str(out),
                                     "-q", "--engine", engine, "--workers", "2"])
        assert result.exit_code == 0, result.output
        tables[engine], prov = read_table(out / "accum-error.parquet")
        assert prov["engine"] == engine
    assert len(tables["serial"]) == 2 * 2 * 2  # matmuls x specs
    for engine in ("processes", "ray"):
        pd.testing.assert_frame_equal(tables["serial"], tables[engine], check_exact=True)


class KillsItsWorker:
    """A unit whose process dies every time (a worker killed, or out of memory)."""

    def __call__(self, unit: TensorUnit) -> list:
        os._exit(1)


def test_a_dead_local_worker_is_one_error_naming_resume(inputs: Path, tmp_path: Path) -> None:
    units = _units(inputs)
    with pytest.raises(engines.EngineError, match=r"a worker process died .*--resume"):
        engines.run(units, KillsItsWorker(),
                    Execution(Engine.PROCESSES, workers=2, resume=tmp_path / "kept"))
