"""The user's cast names (issue 45, point 6): every table keeps the canonical spec in ``cast``
and adds ``cast_name``, the name the user gave (the spec where none was given), from
``drift.measure`` and the commands through the scan into the rows; DataFrames, reports and
``--fail-on`` rules accept either; tables written before the column still load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from test_report import PROV, report, runner, tensor_row

from driftcli import measure
from driftcli.cli import app
from driftcli.io.tables import write_table
from driftcli.measures.block_stats import BlockStatsRow
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.records.castspec import parse_cast
from driftcli.report import Options, make_report, markdown
from driftcli.report.load import load

NV, MX = str(parse_cast("nvfp4")), str(parse_cast("mxfp8_e4m3"))


def test_a_dataframe_keeps_the_spec_and_the_name_given() -> None:
    x = torch.linspace(-500, 500, 4096).reshape(16, 256)
    df = measure({"w": x}, ["nvfp4", MX])
    assert NV != "nvfp4"
    assert set(df.cast) == {NV, MX}
    assert df.loc[df.cast == NV, "cast_name"].tolist() == ["nvfp4", "nvfp4"]  # w and *
    assert df.loc[df.cast == MX, "cast_name"].tolist() == [MX, MX]  # given as its spec
    picked = df[df.cast_name == "nvfp4"]
    assert len(picked) == 2 and set(picked.cast) == {NV}


def measured(tmp_path: Path, command: str, *tables: str) -> Path:
    """``drift COMMAND`` on one weight under nvfp4 and mxfp8_e4m3's spec; each of ``tables``
    it writes holds both casts' specs and their names."""
    from safetensors.torch import save_file

    save_file({"w": torch.linspace(-500, 500, 4096).reshape(16, 256)},
              str(tmp_path / "m.safetensors"))
    out = tmp_path / "out"
    done = runner.invoke(app, [command, str(tmp_path / "m.safetensors"), "-c", "nvfp4",
                               "-c", MX, "--out", str(out), "--quiet"])
    assert done.exit_code == 0, done.output
    for name in tables:
        stored = pq.read_table(out / f"{name}.parquet").to_pandas()
        assert dict(zip(stored.cast, stored.cast_name, strict=True)) == {NV: "nvfp4", MX: MX}
    return out


def test_a_table_carries_cast_name_and_rules_select_by_either(tmp_path: Path) -> None:
    out = measured(tmp_path, "clip-rate", "clip-rate")
    (table,) = load([out]).tables
    assert set(table.frame[table.frame.cast_name == "nvfp4"].cast) == {NV}
    for rule in ("cast_name == 'nvfp4' and clip_rate >= 0", "cast == 'nvfp4' and clip_rate >= 0",
                 f"cast == '{NV}' and clip_rate >= 0"):
        rep = make_report([out], Options(rules=(rule,)))
        assert [v.n_rows for v in rep.violations] == [2], rule  # w and *, nvfp4's only
    result = report(str(out), "--fail-on", "cast_name == 'nvfp5' and clip_rate > 0")
    assert result.exit_code == 2 and "nvfp4" in result.output, result.output


def written_before(path: Path, row_type: type, rows: list[Any]) -> Path:
    """``rows`` as a table written before cast_name: without the column, nvfp4's name in its
    provenance."""
    write_table(path, row_type, rows, {**PROV, "names": {"cast": {NV: "nvfp4"}}})
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(["cast_name"]).replace_schema_metadata(
        table.schema.metadata), path)
    return path


def test_tables_without_cast_name_still_load(tmp_path: Path) -> None:
    """A table written before the column: cast_name is the name its provenance recorded, else
    the spec; its schema is accepted."""
    rows = [tensor_row(ClipRateRow, t, c, clip_rate=0.1 * (k + 1), clipped=1, n_blocks=10,
                       cast_name=c)
            for k, c in enumerate((NV, MX)) for t in ("w", "*")]
    path = written_before(tmp_path / "clip-rate.parquet", ClipRateRow, rows)
    (table,) = load([path]).tables
    assert dict(zip(table.frame.cast, table.frame.cast_name, strict=True)) == {NV: "nvfp4",
                                                                              MX: MX}
    assert list(table.frame.columns).index("cast_name") == list(
        table.frame.columns).index("cast") + 1
    rep = make_report([path], Options(rules=("cast_name == 'nvfp4' and clip_rate > 0.05",)))
    assert [v.n_rows for v in rep.violations] == [2]  # w and *, nvfp4's only


def test_block_stats_tables_carry_cast_name(tmp_path: Path) -> None:
    out = measured(tmp_path, "block-stats", "block-stats", "block-scales")
    text = markdown.render(make_report([out / "block-stats.parquet"], Options()))
    assert "| nvfp4 |" in text and f"| {NV} |" not in text


def test_rows_named_by_their_cast_say_the_name_given(tmp_path: Path) -> None:
    """Two files: block-stats' groups are the files, and each worst row is named by its cast
    and direction, the cast as the user typed it."""
    from safetensors.torch import save_file

    files = []
    for n in (1, 2):
        files.append(str(tmp_path / f"m{n}.safetensors"))
        save_file({"w": torch.linspace(-500, 500, 4096).reshape(16, 256) * n}, files[-1])
    done = runner.invoke(app, ["block-stats", *files, "-c", "nvfp4", "-c", MX,
                               "--out", str(tmp_path / "out"), "--quiet"])
    assert done.exit_code == 0, done.output
    text = markdown.render(make_report([tmp_path / "out" / "block-stats.parquet"], Options()))
    worst = [line for line in text.splitlines() if "m1.safetensors" in line]
    assert worst and "nvfp4 rows" in worst[0] and NV not in worst[0], worst


def test_every_table_with_a_cast_gets_its_name(tmp_path: Path) -> None:
    """A table whose rows hold the spec alone (an older block-stats') gets cast_name on
    reading, from the names its provenance recorded."""
    rows = [BlockStatsRow("m.safetensors", "w", None, None, None, c, "float4_e2m1fn", "e4m3",
                          "block", 16, "rows", 10, 0, 0, k, k / 10, 0, 0, 0, 0, 0, 0, 2, 0, 0,
                          0.0, None) for k, c in enumerate((NV, MX))]
    path = written_before(tmp_path / "block-stats.parquet", BlockStatsRow, rows)
    (table,) = load([path]).tables
    assert table.frame.cast_name.tolist() == ["nvfp4", MX]
    text = markdown.render(make_report([path], Options()))
    assert "| nvfp4 |" in text and f"| {NV} |" not in text


@pytest.mark.parametrize("given", ["nvfp4", NV])
def test_a_table_without_provenance_names_shows_its_cast_name(tmp_path: Path,
                                                              given: str) -> None:
    rows = [tensor_row(ClipRateRow, t, NV, clip_rate=0.1, clipped=1, n_blocks=10,
                       cast_name=given) for t in ("w", "*")]
    path = write_table(tmp_path / "clip-rate.parquet", ClipRateRow, rows, PROV)
    text = markdown.render(make_report([path], Options()))
    assert f"cast={given}" in text


def test_append_to_a_table_written_before_cast_name(tmp_path: Path) -> None:
    """--append merges into a table written before the column (it was refused as "not a
    clip-rate table of this drift version's columns"): its rows get their names from its
    provenance, the new rows theirs."""
    from safetensors.torch import save_file

    save_file({"w": torch.linspace(-500, 500, 4096).reshape(16, 256)},
              str(tmp_path / "m.safetensors"))
    rows = [tensor_row(ClipRateRow, t, NV, clip_rate=0.1, clipped=1, n_blocks=10,
                       cast_name=NV) for t in ("w", "*")]
    out = tmp_path / "out"
    out.mkdir()
    written_before(out / "clip-rate.parquet", ClipRateRow, rows)
    done = runner.invoke(app, ["clip-rate", str(tmp_path / "m.safetensors"), "-c", "fp8_e4m3",
                               "--out", str(out), "--append", "--quiet"])
    assert done.exit_code == 0, done.output
    stored = pq.read_table(out / "clip-rate.parquet").to_pandas()
    assert sorted(zip(stored.cast_name, stored.tensor, strict=True)) == [
        ("fp8_e4m3", "*"), ("fp8_e4m3", "w"), ("nvfp4", "*"), ("nvfp4", "w")]


def test_append_to_a_table_it_cannot_merge_into_is_refused_before_the_scan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the refusal came after the whole scan, its units left behind for a --resume that would
    # be refused again
    from safetensors.torch import save_file

    import driftcli.measures.scan as scan_module

    save_file({"w": torch.ones(16, 256)}, str(tmp_path / "m.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    rows = [tensor_row(ClipRateRow, "w", NV, clip_rate=0.1, clipped=1, n_blocks=10,
                       cast_name=NV)]
    write_table(out / "underflow-rate.parquet", ClipRateRow, rows, PROV)  # another measure's

    def no_scan(*args: object, **kwargs: object) -> None:
        raise AssertionError("scanned before refusing the table")

    monkeypatch.setattr(scan_module, "scan", no_scan)
    done = runner.invoke(app, ["underflow-rate", str(tmp_path / "m.safetensors"), "-c", "nvfp4",
                               "--out", str(out), "--append", "--quiet"])
    assert done.exit_code == 2 and "is not a underflow-rate table" in done.output, done.output
