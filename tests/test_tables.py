"""Parquet tables: schema from the row type, provenance, atomic writes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from driftcli.errors import DriftError
from driftcli.io.tables import (
    file_identity,
    identify_in_background,
    provenance,
    read_table,
    schema_of,
    write_table,
)
from driftcli.verify import VerifyRow


def test_schema_carries_docs_and_table_facts() -> None:
    schema = schema_of(VerifyRow)
    assert schema.field("n_failed").metadata[b"doc"].startswith(b"values where")
    assert schema.field("operands").nullable and not schema.field("n_checked").nullable
    assert schema.metadata[b"drift.table"] == b"verify-formats"
    assert json.loads(schema.metadata[b"drift.higher_is_worse"]) is True


def test_roundtrip_with_provenance(tmp_path: Path) -> None:
    source = tmp_path / "input.bin"
    source.write_bytes(b"abc")
    rows = [VerifyRow("summary", "int4", "codes", "decode", "-", "-", 16, 0, None, None, None)]
    path = write_table(tmp_path / "out" / "verify-formats.parquet", VerifyRow, rows,
                       provenance([source], seed=5))
    df, prov = read_table(path)
    assert df.to_dict("records")[0]["n_checked"] == 16
    assert prov["seed"] == 5 and prov["drift_version"]
    assert prov["inputs"][0]["sha256"] == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")  # sha256("abc")
    assert [p.name for p in path.parent.iterdir()] == ["verify-formats.parquet"]  # no temp left


def test_identities_worked_out_in_the_background_are_the_plain_ones(tmp_path: Path) -> None:
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for i, p in enumerate(paths):
        p.write_bytes(bytes(range(256)) * (3000 + i))  # several reads of 1 MiB each
    got = identify_in_background(paths)()
    assert got == [file_identity(p) for p in paths]
    assert got[1]["sha256"] == hashlib.sha256(paths[1].read_bytes()).hexdigest()
    fast = identify_in_background(paths, fast_hash=True)()
    assert fast == [file_identity(p, fast_hash=True) for p in paths]
    assert "sha256" not in fast[0] and fast[0]["size"] == 256 * 3000
    assert provenance(paths, identities=got)["inputs"] == got
    missing = identify_in_background([paths[0], tmp_path / "gone.bin"])
    with pytest.raises(FileNotFoundError, match=r"gone\.bin"):
        missing()


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    bad = [VerifyRow("summary", "int4", "codes", "decode", "-", "-", "many", 0, None, None, None)]
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        write_table(tmp_path / "t.parquet", VerifyRow, bad, {})
    assert list(tmp_path.iterdir()) == []


def test_non_drift_parquet_is_named(tmp_path: Path) -> None:
    pq.write_table(pa.table({"a": [1]}), tmp_path / "other.parquet")
    with pytest.raises(DriftError, match="not a drift table"):
        read_table(tmp_path / "other.parquet")


def test_an_interrupted_write_leaves_neither_a_partial_file_nor_the_old_one_damaged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [VerifyRow("summary", "int4", "codes", "decode", "-", "-", 16, 0, None, None, None)]
    path = write_table(tmp_path / "t.parquet", VerifyRow, rows, {"run": 1})
    before = path.read_bytes()

    def interrupted(table: pa.Table, where: Path, **kw: object) -> None:
        Path(where).write_bytes(b"PAR1 half a file")  # the writer dies mid-file
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_table(path, VerifyRow, rows, {"run": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]
    assert path.read_bytes() == before  # the earlier table is intact, no temp file left
