"""Parquet tables: schema from the row type, provenance, atomic writes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO, ClassVar

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


@dataclasses.dataclass(frozen=True)
class _Every:
    TABLE: ClassVar[str] = "every"
    KEYS: ClassVar[tuple[str, ...]] = ("name",)
    HEADLINE: ClassVar[str] = "x"
    HIGHER_IS_WORSE: ClassVar[bool] = True
    name: str
    label: str | None
    n: int
    m: int | None
    x: float
    y: float | None
    ok: bool
    maybe: bool | None


def test_every_column_kind_is_written_as_pyarrow_would_convert_it(tmp_path: Path) -> None:
    # drift builds its columns from buffers (no pandas import); pyarrow's own conversion of
    # the same rows is the reference, nulls, empty and non-ASCII strings, extremes included
    rows = [_Every("a", None, -(2**63), None, float("-inf"), None, True, None),
            _Every("", "τ·x", 2**63 - 1, 7, float("nan"), -0.0, False, False),
            _Every("ü" * 40, "", 0, -1, 5e-324, 1.5, True, True)]
    path = write_table(tmp_path / "every.parquet", _Every, rows, {})
    names = [f.name for f in dataclasses.fields(_Every)]
    want = pa.table({n: [getattr(r, n) for r in rows] for n in names}, schema=schema_of(_Every))
    got = pq.read_table(path)
    assert got.schema.remove_metadata().equals(want.schema.remove_metadata(),
                                               check_metadata=True)
    assert repr(got.to_pydict()) == repr(want.to_pydict())  # repr: NaN equal, -0.0 distinct
    assert [got.column("m").null_count, got.column("label").null_count] == [1, 1]
    empty = pq.read_table(write_table(tmp_path / "none.parquet", _Every, [], {}))
    assert empty.num_rows == 0 and empty.schema.names == names
    for bad in (_Every("a", None, 2**63, None, 0.0, None, True, None),  # beyond int64
                _Every("a", None, 1, 2.5, 0.0, None, True, None),
                _Every("a", None, 1, None, 0.0, None, "False", None),
                _Every(b"a", None, 1, None, 0.0, None, True, None)):
        with pytest.raises(pa.ArrowTypeError):
            write_table(tmp_path / "bad.parquet", _Every, [bad], {})
    assert not (tmp_path / "bad.parquet").exists()


def test_writing_a_table_does_not_import_pandas(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from driftcli.io.tables import write_table; "
            "from driftcli.verify import VerifyRow; "
            "rows = [VerifyRow('summary', 'int4', 'codes', 'decode', '-', '-', 16, 0, None, "
            f"None, None)]; write_table(Path({str(tmp_path / 't.parquet')!r}), VerifyRow, "
            "rows, {}); print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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

    def interrupted(table: pa.Table, where: BinaryIO, **kw: object) -> None:
        where.write(b"PAR1 half a file")  # the writer dies mid-file (of its temporary file)
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_table(path, VerifyRow, rows, {"run": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]
    assert path.read_bytes() == before  # the earlier table is intact, no temp file left
