"""drift report across runs: baselines that match inputs by path, file name or not at all and
refuse to compare nothing; stale tables (inputs changed since) and tables from different
runs; rows whose headline is undefined (an all-zero tensor has no underflow rate)."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_report import CLIP, PROV, ROOT, clip_rows, report, runner, tensor_row, write_run

from driftcli.cli import app
from driftcli.io.tables import file_identity, write_table
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.measures.error_bias import ErrorBiasRow


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "out")


# --- baselines ------------------------------------------------------------------------------


def with_source(folder: Path, source: str, clip: dict[str, dict[str, float]] = CLIP) -> Path:
    """A clip-rate table whose rows name ``source`` as their input (a run in its folder)."""
    rows = [tensor_row(ClipRateRow, r.tensor, r.cast, source=source, clip_rate=r.clip_rate,
                       clipped=r.clipped, n_blocks=r.n_blocks) for r in clip_rows(clip)]
    write_table(folder / "clip-rate.parquet", ClipRateRow, rows, PROV)
    return folder


def worse_clip() -> dict[str, dict[str, float]]:
    worse = {c: dict(per) for c, per in CLIP.items()}
    worse["mxfp8_e4m3"]["layers.0.w"] = 0.004  # +100%
    return worse


def test_a_baseline_that_matches_nothing_is_exit_2_with_the_reason(tmp_path: Path) -> None:
    """Two runs in different folders: by path nothing matches. That was "OK: no regression
    beyond 5%" and exit 0; it is exit 2 saying which key differs and what would match."""
    base = with_source(tmp_path / "base", "week48/model.safetensors")
    now = with_source(tmp_path / "now", "week49/model.safetensors", worse_clip())
    result = report(str(now), "--baseline", str(base), "--fail-on-regression", "5",
                    "--match-by", "path")
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"error: nothing compared: no row of clip-rate matches baseline {base} with --match-by "
        "path (source is week49/model.safetensors here but week48/model.safetensors in the "
        "baseline); --match-by name matches 8 row(s)\n")
    # the default matches by file name: the planted regression is found
    found = report(str(now), "--baseline", str(base), "--fail-on-regression", "5")
    assert found.exit_code == 1, found.output
    assert "clip-rate clip_rate: 8 row(s) matched, 1 changed by more than 1%" in found.output
    assert ("regression week49/model.safetensors layers.0.w mxfp8_e4m3: 0.002 → 0.004 (+100%)"
            in found.output)
    assert f"baseline {base} (inputs matched by name)" in found.output


def test_match_by_tensor_for_checkpoints_named_apart(tmp_path: Path) -> None:
    base = with_source(tmp_path / "base", "ckpt-48.safetensors")
    now = with_source(tmp_path / "now", "ckpt-49.safetensors", worse_clip())
    by_name = report(str(now), "--baseline", str(base))
    assert by_name.exit_code == 2
    assert ("(file name is ckpt-49.safetensors here but ckpt-48.safetensors in the "
            "baseline); --match-by tensor matches 8 row(s)") in by_name.output
    js = tmp_path / "r.json"
    by_tensor = report(str(now), "--baseline", str(base), "--match-by", "tensor",
                       "--fail-on-regression", "50", "--json", str(js))
    assert by_tensor.exit_code == 1, by_tensor.output
    assert "FAILED: 1 regression(s) beyond 50%" in by_tensor.output
    data = json.loads(js.read_text())["baseline"]
    assert data["match_by"] == "tensor" and data["tables"][0]["matched"] == 8
    assert [c["key"] for c in data["tables"][0]["changes"]] == [
        {"source": "ckpt-49.safetensors", "tensor": "layers.0.w", "cast": "mxfp8_e4m3"}]


def test_a_matching_that_cannot_tell_two_inputs_apart_is_refused(tmp_path: Path) -> None:
    """Two inputs with one file name in one run: by name their rows would share a key."""
    base, now = tmp_path / "base", tmp_path / "now"
    for folder in (base, now):
        rows = [tensor_row(ClipRateRow, "w", "mxfp8_e4m3", source=s, clip_rate=0.01)
                for s in ("a/model.safetensors", "b/model.safetensors")]
        write_table(folder / "clip-rate.parquet", ClipRateRow, rows, PROV)
    result = report(str(now), "--baseline", str(base))
    assert result.exit_code == 2
    assert result.output.startswith(
        "error: --match-by name: this run's clip-rate rows source=a/model.safetensors "
        "tensor=w cast=mxfp8_e4m3 and source=b/model.safetensors tensor=w cast=mxfp8_e4m3 "
        "cannot be told apart; use --match-by path")
    assert report(str(now), "--baseline", str(base), "--match-by", "path").exit_code == 0
    tensor = report(str(now), "--baseline", str(base), "--match-by", "tensor")
    assert tensor.exit_code == 2 and "use --match-by name or path" in tensor.output


def test_one_table_that_matches_nothing_fails_the_comparison(tmp_path: Path) -> None:
    """clip-rate matches; error-bias was measured under other casts: nothing of it is
    compared, which would pass any threshold unread."""
    base = write_run(tmp_path / "base", broken=False)
    now = write_run(tmp_path / "now", broken=False)
    write_table(now / "sub" / "error-bias.parquet", ErrorBiasRow,
                [tensor_row(ErrorBiasRow, t, "bf16", rel_error=0.01) for t in ("w", "*")], PROV)
    result = report(str(now), "--baseline", str(base))
    assert result.exit_code == 2
    assert result.output.startswith(
        f"error: nothing compared: no row of error-bias matches baseline {base} with "
        "--match-by name (cast is bf16 here but mxfp8_e4m3 or fp8_e4m3 in the baseline); "
        "measure both runs with the same inputs and casts")


def test_docs_baseline_error_example_is_what_the_cli_prints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (ROOT / "docs" / "report.md").read_text()
    (args, message), = re.findall(r"\$ drift report (week49-out .*)\n(error: nothing .*)", doc)
    with_source(tmp_path / "week48-out", "week48/model.safetensors")
    with_source(tmp_path / "week49-out", "week49/model.safetensors")
    monkeypatch.chdir(tmp_path)
    result = report(*args.split())
    # the row count is this fixture's (the page's own run is checked by test_doc_outputs)
    count = re.compile(r"matches \d+ row")
    assert result.exit_code == 2
    assert count.sub("matches N row", result.output) == count.sub("matches N row", message) + "\n"


def test_match_by_modes_compare_the_input_column_as_documented() -> None:
    from driftcli.report.options import MatchBy

    assert [m.value for m in MatchBy] == ["path", "name", "tensor"]
    src = "runs/week49/model.safetensors"
    assert MatchBy.PATH.compared("source", src) == src
    assert MatchBy.NAME.compared("source", src) == "model.safetensors"
    assert MatchBy.NAME.compared("checkpoint", "C:\\ckpt\\m.pt") == "m.pt"
    assert MatchBy.TENSOR.compared("source", src) is None
    assert MatchBy.TENSOR.compared("tensor", "w") == "w"  # only the input is let go
    assert MatchBy.NAME.compared("cast", "a/b") == "a/b"


# --- stale tables ---------------------------------------------------------------------------


def recorded(path: Path, fast_hash: bool = False, **prov: Any) -> dict[str, Any]:
    return {**PROV, "inputs": [file_identity(path, fast_hash)], **prov}


def table_about(folder: Path, prov: dict[str, Any], name: str = "clip-rate") -> Path:
    return write_table(folder / f"{name}.parquet", ClipRateRow, clip_rows(), prov)


def utc(seconds: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="seconds")


def set_times(path: Path, seconds: float) -> None:
    os.utime(path, (seconds, seconds))


def test_check_inputs_by_size_then_sha256_hashing_only_what_was_written_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from driftcli.report.load import InputState, check_inputs, read

    load_mod = importlib.import_module("driftcli.report.load")  # the package's load() shadows it

    data = tmp_path / "m.bin"
    data.write_bytes(b"a" * 4096)
    hashed: list[Path] = []
    real = load_mod.file_identity

    def counting(path: Path, fast_hash: bool = False) -> dict[str, Any]:
        if not fast_hash:
            hashed.append(path)
        return real(path, fast_hash)

    monkeypatch.setattr(load_mod, "file_identity", counting)
    later = time.time() + 3600  # a table written after the file was last changed
    t = read(table_about(tmp_path, recorded(data, utc=utc(later))))
    assert check_inputs(t) == (load_mod.InputCheck(str(data), InputState.SAME),)
    assert hashed == []  # not written to since the table: not read again

    # the same bytes rewritten after the table: hashed, and the same
    t = read(table_about(tmp_path, recorded(data, utc=utc(time.time() - 3600))))
    hashes: load_mod.Hashes = {}
    assert check_inputs(t, hashes)[0].state is InputState.SAME and len(hashed) == 1
    assert check_inputs(t, hashes)[0].hashed and len(hashed) == 1  # once a report

    # other bytes of the same size, with the old mtime put back (cp -p): ctime gives it away
    before = data.stat().st_mtime
    data.write_bytes(b"b" * 4096)
    set_times(data, before - 7200)
    got = check_inputs(t)[0]
    assert (got.state, got.why, got.hashed) == (InputState.CHANGED, "sha256 differs", True)

    data.write_bytes(b"b" * 10)
    assert check_inputs(t)[0].why == "size 10 bytes, was 4,096"
    data.unlink()
    assert check_inputs(t)[0].state is InputState.MISSING


def test_check_inputs_by_mtime_for_fast_hash_tables(tmp_path: Path) -> None:
    from driftcli.report.load import InputState, check_inputs, read

    data = tmp_path / "m.bin"
    data.write_bytes(b"a" * 100)
    set_times(data, 1_700_000_000)
    t = read(table_about(tmp_path, recorded(data, fast_hash=True)))
    assert check_inputs(t)[0].state is InputState.SAME
    set_times(data, 1_700_000_001)
    got = check_inputs(t)[0]
    assert got.state is InputState.CHANGED and got.why == (
        "modified 2023-11-14T22:13:21+00:00, was 2023-11-14T22:13:20+00:00")
    unhashed = {**PROV, "inputs": [{"path": str(data), "size": 100}, str(data)]}
    assert check_inputs(read(table_about(tmp_path, unhashed))) == ()  # nothing to compare


def test_a_stale_table_is_marked_in_every_output(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A real measurement, then its input overwritten with other values of the same size
    (the demo rewriting a dump): the table is stale in the terminal, Markdown, JSON and HTML."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "m.safetensors"
    save_file({"w": torch.linspace(-1, 1, 512).reshape(4, 128)}, str(model))
    out = tmp_path / "out"
    argv = ["clip-rate", str(model), "-c", "fp8_e4m3", "--out", str(out), "--quiet"]
    monkeypatch.setattr(sys, "argv", ["drift", *argv])  # what provenance records
    done = runner.invoke(app, argv)
    assert done.exit_code == 0, done.output
    fresh = report(str(out))
    assert fresh.exit_code == 0, fresh.output
    assert "[STALE]" not in fresh.output and "stale:" not in fresh.output

    size = model.stat().st_size
    save_file({"w": torch.linspace(-2, 2, 512).reshape(4, 128)}, str(model))
    assert model.stat().st_size == size
    md, js, page = tmp_path / "r.md", tmp_path / "r.json", tmp_path / "r.html"
    result = report(str(out), "--markdown", str(md), "--json", str(js), "--html", str(page))
    assert result.exit_code == 0, result.output  # a warning, not a failure
    assert "clip-rate: clip_rate (higher is worse) [STALE]" in result.output
    assert (f"  stale: {model} is not the file this table measured (sha256 differs); re-run "
            f"drift {' '.join(argv)}") in result.output
    assert (f"stale: 1 table(s) whose inputs changed since they were written: "
            f"{out / 'clip-rate.parquet'}") in result.output
    text = md.read_text()
    assert "## clip-rate: clip_rate (higher is worse) [STALE]" in text
    assert f"- :warning: stale: {model} is not the file this table measured" in text
    html = page.read_text()
    assert "clip-rate: clip_rate (higher is worse) [STALE]</h2>" in html
    assert (f'<li class="error">stale: {model} is not the file this table measured '
            "(sha256 differs)") in html
    assert (f'<ul class="error"><li>stale: 1 table(s) whose inputs changed since they were '
            f"written: {out / 'clip-rate.parquet'}</li>") in html
    data = json.loads(js.read_text())
    assert data["stale"] == [str(out / "clip-rate.parquet")]
    assert data["tables"][0]["stale"] is True
    assert data["tables"][0]["inputs_checked"] == [
        {"path": str(model), "state": "changed", "why": "sha256 differs"}]


def test_inputs_not_here_are_said_to_be_unchecked(run: Path) -> None:
    result = report(str(run))
    assert result.exit_code == 0
    assert "not checked for changes (not found here): model.safetensors" in result.output
    assert "STALE" not in result.output


# --- tables from different runs -------------------------------------------------------------


def test_tables_from_different_runs_are_said_to_be(tmp_path: Path) -> None:
    """An accum-error-like table from three days ago about a dump the demo has overwritten
    since, from another commit, beside two fresh tables: three findings, one line each."""
    from driftcli.report.model import Mix, make_report

    now = time.time()
    dump = tmp_path / "dump.safetensors"
    dump.write_bytes(b"x" * 64)
    old = recorded(dump, git_commit="aaaaaaaaaaaaaaaa", utc=utc(now - 3 * 86400))
    dump.write_bytes(b"y" * 64)
    new = recorded(dump, utc=utc(now - 600))
    out = tmp_path / "out"
    write_table(out / "clip-rate.parquet", ClipRateRow, clip_rows(), new)
    write_table(out / "error-bias.parquet", ErrorBiasRow,
                [tensor_row(ErrorBiasRow, "w", "bf16", rel_error=0.1)],
                {**new, "utc": utc(now - 300)})
    write_table(out / "accum" / "clip-rate.parquet", ClipRateRow, clip_rows(), old)
    rep = make_report([out])
    assert [m.kind for m in rep.mixed] == [Mix.BUILDS, Mix.INPUTS, Mix.TIMES]
    old_sha = old["inputs"][0]["sha256"][:12]
    new_sha = new["inputs"][0]["sha256"][:12]
    first = str(out / "accum" / "clip-rate.parquet")
    second = str(out / "clip-rate.parquet")
    md, js, page = tmp_path / "r.md", tmp_path / "r.json", tmp_path / "r.html"
    result = report(str(out), "--markdown", str(md), "--json", str(js), "--html", str(page))
    assert result.exit_code == 0, result.output
    lines = [
        f"mixed runs: tables written by 2 drift builds: drift 0.1.0 (aaaaaaaaaa): {first}; "
        f"drift 0.1.0 (0123456789): {second}, error-bias",
        f"mixed runs: {dump} was 2 different files: sha256 {old_sha}: {first}; "
        f"sha256 {new_sha}: {second}, error-bias",
        f"mixed runs: tables written 3.0 days apart: {old['utc']}: {first}; "
        f"{new['utc']}: {second}, error-bias",
    ]
    for line in lines:
        assert line in result.output
        assert f"- :warning: {line}" in md.read_text()
    assert [m["line"] for m in json.loads(js.read_text())["mixed_runs"]] == lines
    # and the old table is stale: its dump is not the file it measured
    assert f"stale: 1 table(s) whose inputs changed since they were written: {first}" in (
        result.output)


def test_tables_of_one_run_are_not_mixed(run: Path) -> None:
    from driftcli.report.model import make_report

    assert make_report([run]).mixed == ()
    assert "mixed runs" not in report(str(run)).output


# --- rows without a headline ----------------------------------------------------------------


def test_a_tensor_without_a_headline_is_named_not_silently_uncounted(tmp_path: Path) -> None:
    """An all-zero tensor (all-MiniLM-L6-v2's pooler.dense.bias) has no underflow rate and no
    rel_error: the measurement counts it among its tensors, the report's rows do not, and
    the report says which tensor and why."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "m.safetensors"
    save_file({"w": torch.linspace(-1, 1, 256).reshape(2, 128),
               "v": torch.linspace(-3, 1, 256).reshape(2, 128),
               "pooler.bias": torch.zeros(128)}, str(model))
    out = tmp_path / "out"
    for m in ("underflow-rate", "error-bias"):
        done = runner.invoke(app, [m, str(model), "-c", "fp8_e4m3", "-c", "bf16", "--out",
                                   str(out), "--quiet"])
        assert done.exit_code == 0, done.output
    js = tmp_path / "r.json"
    result = report(str(out), "--json", str(js))
    assert result.exit_code == 0, result.output
    for headline, why in (("underflow_rate", " (no nonzero elements)"), ("rel_error", "")):
        for cast in ("fp8_e4m3", "bf16"):
            assert (f"no {headline} for 1 tensor under cast={cast}, not counted in rows: "
                    f"pooler.bias{why}") in result.output
    data = json.loads(js.read_text())
    for table in data["tables"]:
        for g in table["groups"]:
            assert g["aggregate"]["n_tensors"] == 3 and g["rows"] == 2  # 3 = 2 + 1 named
            assert [v["name"] for v in g["no_value"]] == ["pooler.bias"]
