"""grad-cosine and probe on drift's engines: serial, local processes and a local Ray cluster
write the same table bit for bit (a unit is a policy of a checkpoint, or a checkpoint of a
run), the library's in-memory path gives the unit path's rows, units pickle small and name
their inputs by path, a worker's cached checkpoint is reloaded once the file changes, and
``--resume`` takes the units a run kept."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import test_train
from test_train import drift, trained

import driftcli.runs.probe as probe_mod
from driftcli.choices import Engine
from driftcli.engines import Execution
from driftcli.io.tables import read_table
from driftcli.measures import grad_cosine as gc
from driftcli.models.loaders import load_causal_lm, next_token_loss

text = test_train.text  # the same made-up verse, a module fixture here too

POLICIES = ["exact", "mxfp8_e4m3", "mxfp4_e2m1:sr"]
"""A reference, a deterministic cast and a stochastic one (drawn several times in its unit)."""


@pytest.fixture(scope="module")
def run(text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MLP run with checkpoints at steps 0, 2 and 4."""
    return trained(tmp_path_factory.mktemp("runs") / "run", text, "--steps", "4",
                   "--checkpoint-every", "2")


def _bits(values: Any) -> list[Any]:
    """Every float as its hex form: equal lists are equal bit for bit (-0.0, NaN and the last
    bit included), not only to float equality."""
    return [v.hex() if isinstance(v, float) else v for v in values]


def _cells(path: Path) -> list[list[Any]]:
    """A table's rows, bit for bit (:func:`_bits`)."""
    return [_bits(row.values()) for row in pq.read_table(path).to_pylist()]


def _columns(path: Path) -> str:
    """A table's columns with their types (the schema without the provenance)."""
    return str(pq.read_table(path).schema.remove_metadata())


ENGINES = [("processes", ["--engine", "processes", "--workers", "2"]),
           ("ray", ["--engine", "ray", "--workers", "2"])]


@pytest.fixture(params=ENGINES, ids=[e for e, _ in ENGINES])
def engine(request: pytest.FixtureRequest) -> tuple[str, list[str]]:
    name, args = request.param
    if name == "ray":
        request.getfixturevalue("ray_cluster")  # the session's local cluster
    return name, args


def _check_provenance(prov: dict[str, Any], name: str) -> None:
    assert prov["engine"] == name and prov["workers"] == (1 if name == "serial" else 2)
    if name == "ray":
        import ray

        assert prov["ray_version"] == ray.__version__ and prov["ray_nodes"] == 1
    else:
        assert "ray_version" not in prov


# --- grad-cosine -------------------------------------------------------------------------------

def _grad_cosine(run: Path, text: Path, out: Path, *extra: str) -> Path:
    code, _, err = drift("grad-cosine", run / "step-000004.safetensors",
                         *(a for p in POLICIES for a in ("-p", p)), "--draws", "3", "--seed",
                         "5", "--text", text, "--tokens", "9", "--windows", "4", "--out", out,
                         "-q", *extra)
    assert code == 0, err
    return out / "grad-cosine.parquet"


@pytest.fixture(scope="module")
def serial_grad_cosine(run: Path, text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _grad_cosine(run, text, tmp_path_factory.mktemp("serial"))


def test_grad_cosine_is_the_serial_table_on_every_engine(
        run: Path, text: Path, tmp_path: Path, serial_grad_cosine: Path,
        engine: tuple[str, list[str]]) -> None:
    name, args = engine
    path = _grad_cosine(run, text, tmp_path, *args)
    assert _columns(path) == _columns(serial_grad_cosine)
    assert _cells(path) == _cells(serial_grad_cosine)
    _check_provenance(read_table(path)[1], name)
    assert not (tmp_path / ".grad-cosine.parquet.units").exists()  # cleared with the table


def test_grad_cosine_rows_in_policy_order_with_the_draws_inside(
        serial_grad_cosine: Path) -> None:
    frame, prov = read_table(serial_grad_cosine)
    _check_provenance(prov, "serial")
    per_policy = len(frame) // len(POLICIES)
    assert list(frame.policy) == [p for p in POLICIES for _ in range(per_policy)]
    assert list(frame.draws) == [1] * 2 * per_policy + [3] * per_policy
    sr = frame[frame.policy == "mxfp4_e2m1:sr"]
    assert sr.expected_cosine.notna().all() and frame[frame.policy != "mxfp4_e2m1:sr"]\
        .expected_cosine.isna().all()


def test_grad_cosine_resume_takes_the_kept_policies(
        run: Path, text: Path, tmp_path: Path, serial_grad_cosine: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    kept = tmp_path / ".grad-cosine.parquet.units"
    gc.grad_cosine_checkpoint(run / "step-000004.safetensors",
                              gc.BatchSource(text=str(text), tokens=9, windows=4), POLICIES,
                              draws=3, seed=5, execution=Execution(resume=kept))
    assert len(list(kept.iterdir())) == len(POLICIES)  # one per policy

    def fail(unit: gc.PolicyUnit) -> list[gc.GradCosineRow]:
        raise RuntimeError(f"{unit.policy.name} measured again")

    monkeypatch.setattr(gc, "policy_unit", fail)
    path = _grad_cosine(run, text, tmp_path, "--resume")
    assert _cells(path) == _cells(serial_grad_cosine) and not kept.exists()


def test_the_library_in_memory_path_gives_the_unit_rows(run: Path, text: Path) -> None:
    """grad_cosine(model, ...) for a notebook and the units of grad_cosine_checkpoint share
    the exact gradient and the per-policy rows: the same rows, every float equal."""
    ck = run / "step-000004.safetensors"
    source = gc.BatchSource(text=str(text), tokens=9, windows=4)
    lm = load_causal_lm(ck)
    ids = source.ids(lm)
    gc.forget_loaded()
    in_memory = gc.grad_cosine(lm.model, ids, next_token_loss(lm.logits), POLICIES, draws=3,
                               seed=5, checkpoint=str(ck))
    units = gc.grad_cosine_checkpoint(ck, source, POLICIES, draws=3, seed=5)
    assert len(units) == len(in_memory) == 3 * 6  # 5 tensors and '*'
    assert [_bits(dataclasses.astuple(r)) for r in units] == [
        _bits(dataclasses.astuple(r)) for r in in_memory]


def test_a_unit_names_its_checkpoint_and_batch_by_absolute_path(
        run: Path, text: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit carries paths, not the model or the batch: it pickles small, and a worker in
    another folder finds the files."""
    seen: list[gc.PolicyUnit] = []

    def record(unit: gc.PolicyUnit) -> list[gc.GradCosineRow]:
        seen.append(unit)
        return []

    monkeypatch.setattr(gc, "policy_unit", record)
    monkeypatch.chdir(run)
    gc.grad_cosine_checkpoint("step-000004.safetensors",
                              gc.BatchSource(text=os.path.relpath(text, run), tokens=9),
                              POLICIES, draws=3)
    assert [u.policy.name for u in seen] == POLICIES
    assert all(u.draws == 3 for u in seen)
    assert {u.checkpoint for u in seen} == {str(run.resolve() / "step-000004.safetensors")}
    assert {u.name for u in seen} == {"step-000004.safetensors"}  # the rows' name, as given
    assert {u.source.text for u in seen} == {str(text.resolve())}
    # a unit is its policy (about 2 KB pickled) and a few strings; the tiny model's weights alone
    # (a third of the checkpoint file) would outweigh it
    ck_bytes = (run / "step-000004.safetensors").stat().st_size
    assert max(len(pickle.dumps(u)) for u in seen) < min(4096, ck_bytes // 3)


def test_a_worker_keeps_one_checkpoint_until_its_file_changes(run: Path, text: Path) -> None:
    ck, ck0 = run / "step-000002.safetensors", run / "step-000000.safetensors"
    source = gc.BatchSource(text=str(text), tokens=9)
    first = gc.load_input(ck, source)
    assert gc.load_input(ck, source) is first  # the next unit of the checkpoint takes it
    assert gc.load_input(str(ck.resolve()), source.absolute(), str(ck)) is first
    assert gc.load_input(ck0, source) is not first
    assert gc.load_input(ck, source) is not first  # one checkpoint kept, not every one
    again = gc.load_input(ck, source)
    stat = ck.stat()
    try:
        os.utime(ck, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # written again
        assert gc.load_input(ck, source) is not again
    finally:
        os.utime(ck, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        gc.forget_loaded()


# --- probe -------------------------------------------------------------------------------------

def _probe(run: Path, *extra: str) -> Path:
    code, _, err = drift("probe", run, *(a for p in POLICIES for a in ("-p", p)), "--draws",
                         "3", "--batch", "4", "-q", "--overwrite", *extra)
    assert code == 0, err
    return run / "probe.parquet"


@pytest.fixture(scope="module")
def serial_probe(run: Path) -> tuple[str, list[list[Any]]]:
    path = _probe(run)
    _check_provenance(read_table(path)[1], "serial")
    return _columns(path), _cells(path)


def test_probe_is_the_serial_table_on_every_engine(
        run: Path, serial_probe: tuple[str, list[list[Any]]],
        engine: tuple[str, list[str]]) -> None:
    name, args = engine
    path = _probe(run, *args)
    columns, cells = serial_probe
    assert _columns(path) == columns and _cells(path) == cells
    frame, prov = read_table(path)
    _check_provenance(prov, name)
    assert sorted(set(frame.step)) == [0, 2, 4]
    assert list(frame.step) == sorted(frame.step)  # checkpoint by checkpoint, in step order
    assert not (run / ".probe.parquet.units").exists()


def test_probe_resume_takes_the_kept_checkpoints(
        run: Path, serial_probe: tuple[str, list[list[Any]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run interrupted after its units finished: --resume takes them (no checkpoint is
    measured again) and writes the same table; a run without --resume does not take them, and
    leaves them for a later --resume (issue 45)."""
    kept = run / ".probe.parquet.units"

    def interrupted() -> None:
        probe_mod.probe(run, POLICIES, draws=3, windows=4,
                        execution=Execution(Engine.SERIAL, resume=kept))
        assert len(list(kept.iterdir())) == 3  # one per checkpoint

    interrupted()

    def fail(unit: probe_mod.CheckpointUnit) -> list[probe_mod.ProbeRow]:
        raise RuntimeError(f"{unit.path} measured again")

    monkeypatch.setattr(probe_mod, "probe_unit", fail)
    assert _cells(_probe(run, "--resume")) == serial_probe[1]
    assert not kept.exists()  # the table holds them now
    monkeypatch.undo()
    interrupted()
    monkeypatch.setattr(probe_mod, "probe_unit", fail)
    code, _, _ = drift("probe", run, *(a for p in POLICIES for a in ("-p", p)), "--draws", "3",
                       "--batch", "4", "-q", "--overwrite")
    assert code != 0  # a new run: the kept units are not taken
    assert len(list(kept.iterdir())) == 3  # nor thrown away
