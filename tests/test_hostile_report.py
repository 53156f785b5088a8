"""drift report on hostile tables (issue 42, items 9 and 21): a small file whose strings decode
to gigabytes, tensor names that matplotlib would read as math, provenance that is not JSON or
nested past any parser's stack, and nested columns in a table this drift does not know. Each
is one line or a page drawn, never a traceback, and never gigabytes read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_report import PROV, GradCosineLike, make_row, report, tensor_row
from test_report_html import drawn  # noqa: F401 (a fixture: the figures drawn, by title)

from driftcli.errors import DriftError
from driftcli.io.tables import PROVENANCE_KEY, schema_of, write_table
from driftcli.measures.block_stats import BlockStatsRow
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.report import Options, blockmaps, make_report, markdown, plots
from driftcli.report import html as report_html
from driftcli.report.load import load

# --- item 9: a byte budget, checked before any string is decoded -----------------------------

MAX_BYTES_ENV = "DRIFT_REPORT_MAX_BYTES"

LONG = 100_000
"""Characters of the one checkpoint name every row repeats (stored once, in the dictionary)."""
ROWS = 1_000


def write_bomb(path: Path) -> Path:
    """A grad-cosine-like table of ``ROWS`` rows, well within the row budget, whose
    dictionary-encoded checkpoint column decodes to ``ROWS * LONG`` bytes (100 MB) from a file
    of a few kilobytes; the Arrow schema it records says plain strings, so a reader decodes."""
    checkpoint = pa.DictionaryArray.from_arrays(pa.array([0] * ROWS, pa.int32()),
                                                pa.array(["c" * LONG]))
    table = pa.table({"checkpoint": checkpoint, "policy": pa.array(["bf16"] * ROWS),
                      "parameter": pa.array([f"w{i}" for i in range(ROWS)]),
                      "cosine": pa.array([0.5] * ROWS), "retention": pa.array([0.5] * ROWS)})
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, table.schema, store_schema=False) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata(schema_of(GradCosineLike).metadata)
    assert path.stat().st_size < 50_000
    return path


def test_a_table_that_decodes_past_the_byte_budget_is_refused_before_decoding(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = write_bomb(tmp_path / "out" / "grad-cosine-test.parquet")
    monkeypatch.setenv(MAX_BYTES_ENV, "10_000_000")
    before = pa.total_allocated_bytes()
    with pytest.raises(DriftError, match=r"100,\d{3},\d{3} bytes.*beyond the 10,000,000"):
        load([bomb])
    assert pa.total_allocated_bytes() - before < 1_000_000  # nothing decoded is kept
    result = report(str(bomb))
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and MAX_BYTES_ENV in line and str(bomb) in line, line
    # the same table within a budget that holds it is read whole
    monkeypatch.setenv(MAX_BYTES_ENV, "1_000_000_000")
    (table,) = load([bomb]).tables
    assert len(table.frame) == ROWS and len(table.frame["checkpoint"].iloc[-1]) == LONG


def test_the_byte_budget_counts_every_table(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    first = write_bomb(tmp_path / "a" / "grad-cosine-test.parquet")
    second = write_bomb(tmp_path / "b" / "grad-cosine-test.parquet")
    monkeypatch.setenv(MAX_BYTES_ENV, "150_000_000")
    assert len(load([first]).tables) == 1
    with pytest.raises(DriftError, match=r"b/grad-cosine-test.parquet decodes to 100,\d{3},\d{3} "
                       r"bytes, with the 100,\d{3},\d{3} of the tables before it, beyond the "
                       r"150,000,000"):
        load([first, second])


def test_a_byte_budget_that_is_no_number_is_one_line(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = write_bomb(tmp_path / "grad-cosine-test.parquet")
    monkeypatch.setenv(MAX_BYTES_ENV, "lots")
    with pytest.raises(DriftError, match=f"{MAX_BYTES_ENV}='lots' is not a positive"):
        load([bomb])


# --- item 21: names are text, never math; provenance and nested columns never crash ----------

MATHS = ("a$\\foo$b", "$x^{2}$", "layers.0.w")
"""An unparseable mathtext name (matplotlib raised on it), a parseable one (it was drawn as
x squared) and a plain one."""


def test_tensor_names_are_drawn_as_text_never_as_math(
        tmp_path: Path, drawn: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from matplotlib.text import Text

    monkeypatch.setattr(blockmaps, "_png", plots._png)  # the heatmaps too, into ``drawn``
    out = tmp_path / "out"
    write_table(out / "clip-rate.parquet", ClipRateRow,
                [tensor_row(ClipRateRow, t, c, clip_rate=0.01 * (i + 1) * (j + 1), clipped=1,
                            n_blocks=10) for i, t in enumerate((*MATHS, "*"))
                 for j, c in enumerate(("mxfp8_e4m3", "$c$"))], PROV)
    write_table(out / "block-stats.parquet", BlockStatsRow,
                [make_row(BlockStatsRow, source="m.safetensors", tensor=t, cast=c,
                          format="float8_e4m3fn", scale_format="e8m0", granularity="block",
                          block=32, direction="rows", n_blocks=10, clipped_blocks=i,
                          clipped_block_share=i / 10, element_span=17)
                 for i, t in enumerate(MATHS) for c in ("mxfp8_e4m3", "$c$")], PROV)
    page = report_html.render(make_report([out], Options()))
    assert "a$\\foo$b" in page and "$x^{2}$" in page
    texts: dict[str, list[Any]] = {}
    for fig in drawn.values():
        for artist in fig.findobj(Text):
            texts.setdefault(artist.get_text(), []).append(artist)
    for name in (*MATHS[:2], "$c$"):
        shown = [t for text, ts in texts.items() if name in text for t in ts]
        assert shown, (name, sorted(texts))
        # matplotlib's own test of whether it would parse the text as mathtext
        assert all(t._preprocess_math(t.get_text())[1] is False for t in shown), name
    assert "clip-rate: clip_rate by tensor" in drawn
    assert "block-stats: share of blocks that clip, by tensor" in drawn


DEEP = "[" * 100_000


@pytest.mark.parametrize("provenance", [b"not json {", DEEP.encode(), b"\xff\xfe"])
def test_provenance_that_is_not_json_is_one_line(tmp_path: Path, provenance: bytes) -> None:
    path = write_table(tmp_path / "clip-rate.parquet", ClipRateRow,
                       [tensor_row(ClipRateRow, "w", "mxfp8_e4m3", clip_rate=0.5, clipped=1,
                                   n_blocks=2)], PROV)
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[PROVENANCE_KEY] = provenance
    pq.write_table(table.replace_schema_metadata(meta), path)
    text = markdown.render(make_report([path], Options()))
    assert "provenance unreadable" in text and "| 0.5 |" in text, text
    result = report(str(path))
    assert result.exit_code == 0, result.output
    assert result.output.count("provenance unreadable") == 1


def test_table_facts_nested_past_the_stack_are_one_line(tmp_path: Path) -> None:
    path = write_table(tmp_path / "clip-rate.parquet", GradCosineLike,
                       [GradCosineLike("c", "p", "w", 0.5, 0.5)], PROV)
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[b"drift.keys"] = DEEP.encode()
    meta[b"drift.table"] = b"unknown-test"
    pq.write_table(table.replace_schema_metadata(meta), path)
    result = report(str(path))
    assert result.exit_code == 2, result.output
    assert "metadata is damaged" in result.output and "Traceback" not in result.output


def test_nested_columns_of_an_unknown_table_are_left_out_in_one_line(tmp_path: Path) -> None:
    n = 3
    table = pa.table({
        "parameter": pa.array(["w1", "w2", "*"]), "policy": pa.array(["bf16"] * n),
        "cosine": pa.array([0.9, 0.8, 0.85]),
        "point": pa.array([{"x": 1, "y": 2}] * n),
        "tags": pa.array([[("a", 1)]] * n, pa.map_(pa.string(), pa.int64())),
        "shape": pa.array([[1, 2]] * n),
    })
    meta = {b"drift.table": b"nested-test", b"drift.keys": b'["policy", "parameter"]',
            b"drift.headline": b"cosine", b"drift.higher_is_worse": b"false"}
    path = tmp_path / "nested-test.parquet"
    pq.write_table(table.replace_schema_metadata(meta), path)
    rep = make_report([path], Options(rules=("cosine < 0.85",)))
    text = markdown.render(rep)
    assert "w2 0.8" in text
    assert "left out nested columns: point (struct), tags (map), shape (list)" in text
    assert [v.n_rows for v in rep.violations] == [1]
    page = report_html.render(rep)
    assert "nested-test: cosine by parameter" in page
    with pytest.raises(DriftError, match="names column 'point'"):
        make_report([path], Options(rules=("point > 1",)))
