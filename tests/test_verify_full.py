"""The full verify-formats run: every code, every pair, every block cast of every scale rule,
every matmul cell, 0 disagreements (its run time: docs/verify-formats.md). One test per format,
each a run of ``drift verify-formats -f FORMAT``, so that the suite's workers share the plan
(its units are independent per format: the whole run is their concatenation)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from driftcli import FORMATS
from driftcli.cli import app
from driftcli.io.tables import read_table
from driftcli.records.formats import get_format
from driftcli.verify import (
    MATMUL_ACCUMULATORS,
    PAIR_SAMPLE_16,
    Plan,
    element_formats,
    matmul_specs,
)

FULL_PLAN_VALUES = {
    "float32": 418_612,
    "bfloat16": 9_241_840,
    "float16": 9_069_808,
    "float8_e5m2": 6_922_427,
    "float8_e4m3fn": 8_596_573,
    "float8_e4m3fnuz": 6_840_139,
    "float8_e5m2fnuz": 6_840_139,
    "float6_e3m2fn": 1_816_819,
    "float6_e2m3fn": 1_816_819,
    "float4_e2m1fn": 1_860_755,
    "float4_e1m2": 1_388_848,
    "float5_e1m3": 1_509_816,
    "float8_e1m6": 6_953_240,
    "float8_e8m0fnu": 5_689_056,
    "ue5m3": 5_689_056,
    "ue4m3": 1_534_048,
    "int8": 6_840_331,
    "int4": 1_330_651,
    "binary8p3se": 6_839_947,
    "binary8p4se": 6_839_947,
    "binary4p2sf": 1_333_771,
    "hifloat8": 6_839_947,
    "e8m13": 418_384,
}
"""Values the full plan checks per format (``n_checked`` summed over its cells)."""


def test_the_full_plan_covers_every_format_with_its_stated_size() -> None:
    # the full plan's size, as README.md and docs/verify-formats.md give it: a format added
    # without its count here fails, and the total moves with it
    assert list(FULL_PLAN_VALUES) == [f.name for f in element_formats()]
    assert sum(FULL_PLAN_VALUES.values()) == 106_630_973


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FULL_PLAN_VALUES))
def test_full_verify_formats_has_no_disagreement(name: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["verify-formats", "--out", str(tmp_path), "-f", name,
                                      "-j", "1"])
    assert result.exit_code == 0, result.output
    df, prov = read_table(tmp_path / "verify-formats.parquet")
    assert prov["plan"] == "full"
    summary = df[df.kind == "summary"]
    assert int(summary.n_failed.sum()) == 0 and (df.kind == "summary").all()
    assert set(summary.format) == {name}
    assert int(summary.n_checked.sum()) == FULL_PLAN_VALUES[name]
    fmt = get_format(name)
    if name in FORMATS and fmt.bits <= 8:
        pairs = summary[summary.check.str.startswith("pairs")]
        for op in ("product", "sum"):
            for mode in ("rne", "rna", "rtz", "rup", "rdown"):
                cells = pairs[(pairs.operation == op) & (pairs.rounding == mode)]
                assert len(cells) == 2  # both overflow policies
                # every pair of codes: 65,536 for 8-bit formats, 4**bits below that
                assert (cells.n_checked == 4**fmt.bits).all(), (op, mode)
            sr = pairs[(pairs.operation == op) & (pairs.rounding == "sr")]
            assert (sr.n_checked == 16 * 4**fmt.bits).all()  # every draw of 4 random bits
    if name in ("bfloat16", "float16"):
        main = summary[(summary.rounding == "rne") & (summary.overflow == "saturate")
                       & (summary.operation == "product")]
        assert int(main.n_checked.sum()) > PAIR_SAMPLE_16  # the seeded pairs and the boundary's
    # simulated matmuls: one cell per spec, every output element of every case compared
    cells = summary[summary.check == "matmul"]
    if name not in MATMUL_ACCUMULATORS:
        assert cells.empty
        return
    assert len(cells) == len(matmul_specs(fmt, Plan()))
    assert set(cells.rounding) == {"rne", "rtz"} and set(cells.overflow) == {"ieee"}
    # 46 specs x 82 output elements (6 random cases, tiny, huge, constructed), 78 block-FMA
    # specs x 82 for the accumulators a tensor core's unit keeps (all but float8_e5m2);
    # float32 adds 4 native specs x 57 (the 6 integer cases)
    fma = 0 if name == "float8_e5m2" else 78
    native = 4 if name == "float32" else 0
    assert len(cells) == 46 + fma + native
    assert int(cells.n_checked.sum()) == 82 * (46 + fma) + 57 * native
    orders = {op.split("order=")[1].split(",")[0] for op in cells.operation}
    expected = {"sequential", "pairwise", "chunked:16", "chunked:64"}
    if fma:
        expected |= {"blockfma", "blockfma:32", "blockfma:64"}
    if native:
        expected |= {"native"}
    assert orders == expected
