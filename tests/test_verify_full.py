"""The full verify-formats run: every code, every pair, every block cast of every scale rule,
every matmul cell, 0 disagreements (its run time: docs/verify-formats.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from driftcli import FORMATS
from driftcli.cli import app
from driftcli.formats import get_format
from driftcli.io.tables import read_table
from driftcli.verify import MATMUL_ACCUMULATORS, Plan, matmul_specs


@pytest.mark.slow
def test_full_verify_formats_has_no_disagreement(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["verify-formats", "--out", str(tmp_path), "-j", "2"])
    assert result.exit_code == 0, result.output
    df, prov = read_table(tmp_path / "verify-formats.parquet")
    assert prov["plan"] == "full"
    summary = df[df.kind == "summary"]
    assert int(summary.n_failed.sum()) == 0 and (df.kind == "summary").all()
    # the full plan's size, as README.md and docs/verify-formats.md give it
    assert int(summary.n_checked.sum()) == 76_943_306
    assert set(summary.format) == set(FORMATS) | {"e8m13"}  # the custom accumulator joins
    for name, fmt in FORMATS.items():
        if fmt.bits > 8:
            continue
        pairs = summary[(summary.format == name) & summary.check.str.startswith("pairs")]
        for op in ("product", "sum"):
            for mode in ("rne", "rna", "rtz", "rup", "rdown"):
                cells = pairs[(pairs.operation == op) & (pairs.rounding == mode)]
                assert len(cells) == 2  # both overflow policies
                # every pair of codes: 65,536 for 8-bit formats, 4**bits below that
                assert (cells.n_checked == 4**fmt.bits).all(), (name, op, mode)
            sr = pairs[(pairs.operation == op) & (pairs.rounding == "sr")]
            assert (sr.n_checked == 16 * 4**fmt.bits).all()  # every draw of 4 random bits
    for name in ("bfloat16", "float16"):
        main = summary[(summary.format == name) & (summary.rounding == "rne")
                       & (summary.overflow == "saturate") & (summary.operation == "product")]
        assert int(main.n_checked.sum()) >= 1_000_000
    # simulated matmuls: one cell per spec, every output element of every case compared
    matmul = summary[summary.check == "matmul"]
    assert set(matmul.format) == set(MATMUL_ACCUMULATORS)
    for name in MATMUL_ACCUMULATORS:
        cells = matmul[matmul.format == name]
        assert len(cells) == len(matmul_specs(get_format(name), Plan()))
        assert set(cells.rounding) == {"rne", "rtz"} and set(cells.overflow) == {"ieee"}
        # 46 specs x 82 output elements (6 random cases, tiny, huge, constructed), 78 block-FMA
        # specs x 82 for the accumulators a tensor core's unit keeps (all but float8_e5m2);
        # float32 adds 4 native specs x 57 (the 6 integer cases)
        fma = 0 if name == "float8_e5m2" else 78
        native = 4 if name == "float32" else 0
        assert len(cells) == 46 + fma + native, name
        assert int(cells.n_checked.sum()) == 82 * (46 + fma) + 57 * native, name
    orders = {op.split("order=")[1].split(",")[0] for op in matmul.operation}
    assert orders == {"sequential", "pairwise", "chunked:16", "chunked:64", "native",
                      "blockfma", "blockfma:32", "blockfma:64"}
