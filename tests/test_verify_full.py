"""The full verify-formats run: every code, every pair, 0 disagreements (about 3 min on 2 cores)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from driftcli import FORMATS
from driftcli.cli import app
from driftcli.io.tables import read_table


def test_full_verify_formats_has_no_disagreement(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["verify-formats", "--out", str(tmp_path), "-j", "2"])
    assert result.exit_code == 0, result.output
    df, prov = read_table(tmp_path / "verify-formats.parquet")
    assert prov["plan"] == "full"
    summary = df[df.kind == "summary"]
    assert int(summary.n_failed.sum()) == 0 and (df.kind == "summary").all()
    assert set(summary.format) == set(FORMATS)
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
