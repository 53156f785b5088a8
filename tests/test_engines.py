"""The execution engines: every engine writes the serial table bit for bit, a dead worker's
unit is retried and counted once, an interrupted run resumes, and the Ray engine without Ray
is one error line."""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli import engines
from driftcli.choices import Engine
from driftcli.cli import app
from driftcli.engines import Execution, Manifest
from driftcli.io.tables import read_table
from driftcli.measures import MEASURES
from driftcli.measures import scan as scan_module
from driftcli.measures.scan import ScanOptions, TensorUnit, scan, scan_unit
from driftcli.models import loaders

ROOT = Path(__file__).resolve().parents[1]
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
    from driftcli.io.readers import open_inputs
    from driftcli.records.castspec import parse_cast

    casts = tuple(parse_cast(c) for c in CASTS)
    found = open_inputs([folder / "a.safetensors"])
    return [TensorUnit(str(folder), ref, casts, ScanOptions(draws=2), True)
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
    kept.put("unit a", [1, 2])
    assert kept.get("unit a") == (True, [1, 2])
    assert kept.get("unit b") == (False, None)  # another unit: not taken for the first
    kept.clear()
    assert not (tmp_path / "m").exists()


RESUME = """
import json, sys
from pathlib import Path
from driftcli.engines import Execution
from driftcli.measures import scan as S
ran, real = [], S.scan_unit
S.scan_unit = lambda unit, *a: ran.append(unit.ref.name) or real(unit, *a)
S.scan([sys.argv[1]], {casts!r}, execution=Execution(resume=Path(sys.argv[2])))
print(json.dumps(ran))
"""


def _resumed_in_a_new_process(path: Path, kept: Path) -> list[str]:
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-c", RESUME.format(casts=CASTS), str(path),
                           str(kept)], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_run_resumed_in_a_new_process_takes_the_finished_units(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Units are found by a key that names what they depend on, not by their pickle (which
    changes once a cast has run, and between processes)."""
    import shutil

    path = tmp_path / "a.safetensors"
    shutil.copy(inputs / "a.safetensors", path)
    kept = tmp_path / "kept"

    def interrupted(unit: TensorUnit, *args: object) -> list:
        if unit.ref.name == "w2":
            raise KeyboardInterrupt
        return scan_unit(unit, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(scan_module, "scan_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scan([path], CASTS, execution=Execution(resume=kept))
    assert _resumed_in_a_new_process(path, kept) == ["w2", "w3", "w4"]
    # the same layout with other values: every kept unit is stale, all run again
    gen = torch.Generator().manual_seed(8)
    save_file({f"w{i}": torch.randn(96, 160, generator=gen) for i in range(5)}, path)
    assert _resumed_in_a_new_process(path, kept) == ["w0", "w1", "w2", "w3", "w4"]


class Refuses:
    """A unit that fails for its input, as a corrupt file does."""

    def __call__(self, unit: object) -> object:
        from driftcli.errors import DriftError

        raise DriftError(f"unit {unit} is bad")


def test_a_unit_s_own_error_comes_back_as_itself_from_ray(ray_cluster: object) -> None:
    import ray.cloudpickle

    from driftcli.errors import DriftError

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with pytest.raises(DriftError) as err:
        engines.run([1, 2], Refuses(), Execution(Engine.RAY, workers=2))
    assert str(err.value) in ("unit 1 is bad", "unit 2 is bad")  # one line, no Ray wrapping


class SlowUnlessFirst:
    """Unit 0 fails at once; every other unit leaves a mark, then takes a while."""

    def __init__(self, marks: Path) -> None:
        self.marks = marks

    def __call__(self, unit: int) -> int:
        import time

        from driftcli.errors import DriftError

        if unit == 0:
            raise DriftError("unit 0 is bad")
        (self.marks / str(unit)).write_text("")
        time.sleep(0.3)
        return unit


def test_the_process_pool_stops_at_the_first_failure(tmp_path: Path) -> None:
    from driftcli.errors import DriftError

    with pytest.raises(DriftError, match="unit 0 is bad"):
        engines.run(list(range(12)), SlowUnlessFirst(tmp_path),
                    Execution(Engine.PROCESSES, workers=2))
    assert len(list(tmp_path.iterdir())) < 11  # the queued units were not run for nothing


def test_the_ray_engine_without_ray_is_one_line_naming_the_extra(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as when not installed
    result = runner.invoke(app, ["clip-rate", str(inputs), "-c", "mxfp8_e4m3", "--engine",
                                 "ray", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output == ("error: --engine ray needs Ray (drift's optional extra ray): "
                             "pip install ray\n")
    assert not (tmp_path / "clip-rate.parquet").exists()


def test_the_install_lines_of_messages_name_extras_and_packages_that_exist() -> None:
    """What a message tells to pip install is the package drift's extra pins: driftcli is
    not on a package index (the README installs drift from its repository)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    told = {"ray": engines.RAY_PACKAGE, "hf": loaders.HF_PACKAGE}
    for extra, package in told.items():
        assert [re.split(r"[<>=!~ \[]", r)[0] for r in extras[extra]] == [package]


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
