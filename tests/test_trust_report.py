"""Results a user can trust (issue 26, items 2, 3 and 7): CI rules that cannot pass silently,
headlines that show lost elements, bias and the exact clip rate, and output that keeps what
tells rows apart."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from driftcli.cast import parse_cast
from driftcli.cli import app
from driftcli.io.tables import write_table
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.measures.common import ALL_TENSORS

runner = CliRunner()
NVFP4 = str(parse_cast("nvfp4"))
MXFP8 = str(parse_cast("mxfp8_e4m3"))
MXFP8_CEIL = str(parse_cast("mxfp8_e4m3_ceil"))


def report(*args: str) -> Any:
    return runner.invoke(app, ["report", *args])


def row(row_type: type, tensor: str, cast: str, **own: Any) -> Any:
    """A row with the shared columns filled in and the rest null."""
    base = {f.name: None for f in dataclasses.fields(row_type)}
    base.update(source="m.safetensors", tensor=tensor, cast=cast, format="f", granularity="block",
                block=16, rounding="rne", n_tensors=1, n_skipped=0)
    base.update(own)
    return row_type(**base)


def prov(names: dict[str, str] | None) -> dict[str, Any]:
    """Provenance as a measurement writes it; ``names`` maps canonical specs to what the
    user typed after -c."""
    out: dict[str, Any] = {"drift_version": "0.1.0", "utc": "2026-01-02T03:04:05+00:00",
                           "command": ["drift", "clip-rate", "m.safetensors"]}
    if names is not None:
        out["names"] = {"cast": names}
    return out


CLIP = {NVFP4: {"a.w": 0.034, "b.w": 0.02, ALL_TENSORS: 0.03},
        MXFP8: {"a.w": 0.008, "b.w": 0.011, ALL_TENSORS: 0.009},
        MXFP8_CEIL: {"a.w": 0.0, "b.w": 0.0, ALL_TENSORS: 0.0}}


def clip_table(folder: Path, names: dict[str, str] | None = None) -> Path:
    """A clip-rate table as ``drift clip-rate -c nvfp4 -c mxfp8_e4m3 -c mxfp8_e4m3_ceil``
    writes it: canonical specs in the cast column, the presets in provenance."""
    if names is None:
        names = {NVFP4: "nvfp4", MXFP8: "mxfp8_e4m3", MXFP8_CEIL: "mxfp8_e4m3_ceil"}
    rows = [row(ClipRateRow, t, c, clip_rate=v, exact_clip_rate=v / 2, clipped=1)
            for c, per in CLIP.items() for t, v in per.items()]
    write_table(folder / "clip-rate.parquet", ClipRateRow, rows, prov(names))
    return folder


# --- item 2: rules that cannot pass silently ------------------------------------------------

@pytest.mark.parametrize(("rule", "rows"), [
    ("cast == 'nvfp4' and clip_rate > 0.01", 3),        # the preset the report shows
    (f"cast == '{NVFP4}' and clip_rate > 0.01", 3),     # the canonical spec stored
    ("cast == 'mxfp8_e4m3' and clip_rate > 0.01", 1),   # not mxfp8_e4m3_ceil's rows
    ("cast == 'mxfp8_e4m3:rne' and clip_rate > 0.01", 1),  # another spelling of the cast
    ("cast != 'nvfp4' and clip_rate > 0.01", 1),
    ("not cast == 'nvfp4' and clip_rate > 0.01", 1),
])
def test_rules_match_the_cast_names_the_report_shows(tmp_path: Path, rule: str,
                                                     rows: int) -> None:
    result = report(str(clip_table(tmp_path)), "--fail-on", rule)
    assert result.exit_code == 1, result.output
    assert f"FAIL {rule}: {rows} row(s) of clip-rate" in result.output
    if "nvfp4" in rule and "!=" not in rule and "not" not in rule:
        # the broken rows name the cast as the user gave it, not by its canonical spec
        assert "tensor=a.w cast=nvfp4 clip_rate=0.034" in result.output


def test_a_preset_matches_a_table_without_recorded_names(tmp_path: Path) -> None:
    """Tables written with canonical specs on the command line record no names: the rule's
    preset is parsed to its spec."""
    result = report(str(clip_table(tmp_path, names={})), "--fail-on",
                    "cast == 'nvfp4' and clip_rate > 0.01")
    assert result.exit_code == 1, result.output
    assert "3 row(s) of clip-rate" in result.output


def test_a_rule_held_by_its_numbers_still_passes(tmp_path: Path) -> None:
    result = report(str(clip_table(tmp_path)), "--fail-on",
                    "cast == 'mxfp8_e4m3_ceil' and clip_rate > 0")
    assert result.exit_code == 0, result.output
    assert "OK: 1 rule(s) hold" in result.output


@pytest.mark.parametrize(("rule", "message"), [
    ("cast == 'nvfp44' and clip_rate > 0.01",
     r"compares cast with 'nvfp44', which no row of clip-rate has, so the rule could never "
     r"break; did you mean nvfp4\? \(cast values: nvfp4, mxfp8_e4m3, mxfp8_e4m3_ceil\)"),
    ("clip_rate > 0.01 and cast != 'fp8'", r"compares cast with 'fp8'.*cast values: nvfp4"),
    ("clip-rate:tensor == 'c.w' or clip_rate > 0.5",
     r"compares tensor with 'c.w'.*\(tensor values: a\.w, b\.w, \*\)"),
])
def test_a_comparison_that_matches_nothing_is_exit_2(tmp_path: Path, rule: str,
                                                     message: str) -> None:
    result = report(str(clip_table(tmp_path)), "--fail-on", rule)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert re.search(message, result.output), result.output
