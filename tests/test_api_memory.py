"""drift.measure in memory (issue 41, point 1): tensors, state dicts and modules are a source of
the command's scan, read where they lie: no file written, no lock taken, several threads at
once, the command's rows on the same tensors under the same names, stochastic draws included."""

from __future__ import annotations

import importlib.util
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch

import driftcli as drift

# values with a heavy tail (cubed), from linspace: the same on every CPU
W = torch.linspace(-3, 3, 64 * 48).reshape(64, 48) ** 3 * 40
SR = "mxfp4_e2m1:sr"


def _state() -> dict[str, object]:
    return {"layer.weight": W, "layer.bias": torch.linspace(-1, 1, 64),
            "head": {"weight": W.T.contiguous() / 1e6}, "step": 7}


def _file_rows(path: Path, name: str, what: str, casts: list[str], draws: int = 1,
               seed: int = 0) -> pd.DataFrame:
    """The rows of a saved file (the command's: tests/test_api.py compares the two), its path
    replaced by ``name`` as the in-memory rows name their source."""
    frame = drift.measure(path, casts, what, draws=draws, seed=seed)
    frame["source"] = name
    frame["error"] = frame["error"].str.replace(str(path), name)
    return frame


@pytest.mark.parametrize("what", ["underflow-rate", "error-bias"])
def test_a_tensor_a_state_dict_and_a_module_give_the_files_rows(tmp_path: Path,
                                                                what: str) -> None:
    """Each in memory under a name gives the rows of the file NAME.pt holding the same tensors,
    a stochastic cast's draws included: they are seeded by (seed, source name, tensor name),
    not by where the file lies (two folders below)."""
    lin = torch.nn.Linear(48, 64)
    with torch.no_grad():
        lin.weight.copy_(W)
    casts = [SR, "nvfp4", "fp8_e4m3"]
    for x, name, saved in ((W, "w", W), (_state(), "sd", _state()),
                           (lin, "lin", lin.state_dict())):
        path = tmp_path / name / "deeper" / f"{name}.pt"
        path.parent.mkdir(parents=True)
        torch.save(saved, path)
        expected = _file_rows(path, name, what, casts, draws=3, seed=4)
        got = drift.measure(x, casts, what, draws=3, seed=4, name=name)
        pd.testing.assert_frame_equal(got, expected)
    assert list(got["tensor"]) == ["weight"] * 3 + ["bias"] * 3 + ["*"] * 3
    other = drift.measure(W, casts, what, draws=3, seed=4, name="v")
    # another source name is another draw (the deterministic casts are the same)
    assert other.loc[0, "n_finite"] == got.loc[0, "n_finite"]
    if what == "error-bias":
        assert other.loc[0, "rel_error"] != expected.loc[0, "rel_error"]


def test_no_file_is_written_and_no_lock_taken(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary folder stays empty, and neither torch.save nor a file lock is reached:
    each raises here, so a call that took either fails."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("TMPDIR", str(scratch))

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("drift.measure in memory wrote or locked a file")

    monkeypatch.setattr(torch, "save", refused)
    if importlib.util.find_spec("fcntl") is not None:  # Windows has none: nothing to lock
        import fcntl  # the test runs there too, without a skip

        monkeypatch.setattr(fcntl, "flock", refused)
        monkeypatch.setattr(fcntl, "lockf", refused)
    lin = torch.nn.Linear(48, 64)
    for x in (W, _state(), lin):
        for what in ("clip-rate", "error-bias", "cast-diff"):
            casts = ["mxfp4_e2m1", "nvfp4"] if what == "cast-diff" else [SR, "nvfp4"]
            rows = drift.measure(x, casts, what, draws=2)
            assert rows["error"].isna().all() and len(rows) > 0
    assert list(scratch.iterdir()) == []


def test_the_tensors_measured_are_left_as_they_were() -> None:
    """The rows of a contiguous tensor are read as views, not copies: nothing the scan does may
    write to them."""
    big = torch.linspace(-2, 2, 300 * 512).reshape(300, 512) ** 5  # more than one thread slice
    before = big.clone()
    drift.measure({"w": big, "t": big.T}, ["nvfp4", "mxfp8_e4m3", SR, "fp8_e4m3"], "error-bias",
                  draws=2)
    assert torch.equal(big, before)


def test_four_threads_at_once_get_each_their_rows() -> None:
    """Four threads measure four tensors at the same moment (a barrier starts them together):
    each gets the rows it gets alone."""
    tensors = [W * (1 + k) ** 3 for k in range(4)]
    casts = ["nvfp4", SR, "mxfp8_e4m3"]
    alone = [drift.measure(t, casts, "error-bias", draws=2, name=f"t{k}")
             for k, t in enumerate(tensors)]
    start = threading.Barrier(4)

    def one(k: int) -> pd.DataFrame:
        start.wait()
        return drift.measure(tensors[k], casts, "error-bias", draws=2, name=f"t{k}")

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, range(4)))
    for a, b in zip(alone, together, strict=True):
        pd.testing.assert_frame_equal(a, b)
    assert len({round(float(f["rel_error"].iloc[1]), 12) for f in alone}) == 4


@pytest.mark.parametrize("what", ["underflow-rate", "error-bias"])
def test_the_rows_are_the_same_for_any_thread_count(what: str) -> None:
    """The pass splits a large slice across torch's threads (``torch.set_num_threads``); the
    rows, float sums included, are the same bits for 1, 2 and 3 threads."""
    big = torch.linspace(-4, 4, 512 * 512).reshape(512, 512) ** 3  # four thread slices
    was = torch.get_num_threads()
    try:
        frames = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            frames.append(drift.measure({"w": big}, ["nvfp4", SR, "fp8_e4m3"], what, draws=2))
    finally:
        torch.set_num_threads(was)
    for f in frames[1:]:
        pd.testing.assert_frame_equal(f, frames[0], check_exact=True)


def test_a_state_dict_the_file_reader_refuses_parts_of_is_refused_alike(tmp_path: Path) -> None:
    """What the ``.pt`` reader makes an error row of (two keys flattening to one name, a view
    repeating its elements) is the same error row in memory, naming the source as given."""
    sd = {"a.b": W, "a": {"b": W / 2}, "wide": torch.ones(1).expand(64, 64), "ok": W}
    path = tmp_path / "sd.pt"
    torch.save(sd, path)
    expected = _file_rows(path, "sd", "clip-rate", ["nvfp4"])
    got = drift.measure(sd, "nvfp4", name="sd")
    pd.testing.assert_frame_equal(got, expected)
    assert got["error"].notna().sum() == 3  # the clash, the view, and the total's note
    assert list(got["tensor"]) == ["wide", "a.b", "ok", "*"]
    assert got["error"].iloc[0].startswith("sd: tensor wide has 4,096 elements")
    assert got["error"].iloc[1].startswith("sd: tensors ['a.b'] and ['a']['b'] both flatten")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_tensors_without_rows_or_names_are_one_line_each_the_rest_measured() -> None:
    """A state dict in memory can hold what no file read gives: a meta tensor crashed the
    call (NotImplementedError), a nested one too (RuntimeError), a sparse one was torch's
    many-line message; keys 1 and "1" kept one tensor of the two in silence."""
    state = {"meta": torch.empty(4, 32, device="meta"), "sparse": torch.eye(32).to_sparse(),
             "nested": torch.nested.nested_tensor([torch.ones(2, 32), torch.ones(3, 32)]),
             1: torch.ones(4, 32), "1": torch.zeros(4, 32), "ok": W}
    df = drift.measure(state, "mxfp8_e4m3", name="sd")
    errors = dict(zip(df.tensor, df.error, strict=True))
    assert "is on the meta device: it has no data" in errors["meta"]
    assert errors["sparse"] == "sd: tensor sparse is stored as sparse_coo; give t.to_dense()"
    assert "is a nested tensor; give its parts (t.unbind())" in errors["nested"]
    assert "tensors [1] and ['1'] both flatten to the name 1" in errors["1"]
    assert all("\n" not in e for e in errors.values() if isinstance(e, str))
    assert df.loc[df.tensor == "ok", "n_finite"].tolist() == [W.numel()]


def test_a_units_key_holds_the_name_that_seeds_its_draws(tmp_path: Path) -> None:
    """A kept unit is found by its key, which must hold all its results depend on: since the
    draws are seeded by the source name (not the path), units kept by a run seeded otherwise
    would be taken by --resume beside units seeded anew."""
    from driftcli.io.readers import open_inputs
    from driftcli.measures.scan import ScanOptions, TensorUnit
    from driftcli.records.castspec import parse_cast

    torch.save({"w": W}, tmp_path / "m.pt")
    (ref,) = open_inputs([tmp_path / "m.pt"]).tensors
    unit = TensorUnit(str(tmp_path), ref, (parse_cast(SR),), ScanOptions(), True)
    keys = {unit.key(), TensorUnit(str(tmp_path), ref, unit.casts, unit.options, True,
                                   "other").key()}
    assert len(keys) == 2 and unit.key().endswith("|seeds=m")
