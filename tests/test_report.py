"""drift report: summaries, Markdown, JSON, --fail-on rules, baselines and the expression
language (fuzzed); the HTML page is tests/test_report_html.py."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.tables import column, schema_of, write_table
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.measures.common import ALL_TENSORS
from driftcli.measures.error_bias import ErrorBiasRow
from driftcli.measures.underflow_rate import UnderflowRateRow
from driftcli.report import ExpressionError, Options, make_report, parse_rule
from driftcli.report import expr as ex
from driftcli.report.load import ALL_ROWS, SchemaError, load, row_types
from driftcli.report.summary import layout, summarize
from driftcli.verify import VerifyRow

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
PROV = {"drift_version": "0.1.0", "git_commit": "0123456789abcdef",
        "utc": "2026-01-02T03:04:05+00:00",
        "command": ["drift", "clip-rate", "model.safetensors", "--cast", "mxfp8_e4m3"],
        "inputs": [{"path": "model.safetensors", "size": 10, "sha256": "ab"}]}
CASTS = ("mxfp8_e4m3", "fp8_e4m3")
TENSORS = ("layers.0.w", "layers.1.w", "embed.w")


# --- tables with known values -------------------------------------------------------------

def tensor_row(row_type: type, tensor: str, cast: str, error: str | None = None,
               **own: Any) -> Any:
    """A row of a per-tensor measurement: the shared columns filled in, the rest null."""
    base = {f.name: None for f in dataclasses.fields(row_type)}
    base.update(source="model.safetensors", tensor=tensor, cast=cast, cast_name=cast,
                format="float8_e4m3fn",
                granularity="block", block=32, rounding="rne", n_tensors=1, n_skipped=0,
                error=error)
    if tensor == ALL_TENSORS:
        base["n_tensors"] = len(TENSORS)
    base.update(own)
    return row_type(**base)


CLIP = {  # cast -> tensor -> clip_rate; '*' is the all-tensors row
    "mxfp8_e4m3": {"layers.0.w": 0.002, "layers.1.w": 0.05, "embed.w": 0.0, "*": 0.004},
    "fp8_e4m3": {"layers.0.w": 0.0, "layers.1.w": 0.0, "embed.w": 0.0, "*": 0.0},
}
UNDERFLOW = {
    "mxfp8_e4m3": {"layers.0.w": 0.01, "layers.1.w": 0.2, "embed.w": 0.03, "*": 0.06},
    "fp8_e4m3": {"layers.0.w": 0.3, "layers.1.w": 0.001, "embed.w": 0.0, "*": 0.1},
}
ERRBIAS = {  # cast -> tensor -> (rel_error, bias)
    "mxfp8_e4m3": {"layers.0.w": (0.03, -1e-5), "layers.1.w": (0.02, -0.004),
                   "embed.w": (0.025, 2e-6), "*": (0.026, -0.001)},
    "fp8_e4m3": {"layers.0.w": (0.4, -0.3), "layers.1.w": (0.0004, 1e-7),
                 "embed.w": (0.03, 0.0), "*": (0.2, -0.1)},
}


def clip_rows(values: dict[str, dict[str, float]] = CLIP) -> list[ClipRateRow]:
    return [tensor_row(ClipRateRow, t, c, clip_rate=v, clipped=int(v * 1000), n_blocks=10)
            for c, per in values.items() for t, v in per.items()]


def write_run(folder: Path, clip: dict[str, dict[str, float]] = CLIP,
              broken: bool = True) -> Path:
    """clip-rate, underflow-rate and error-bias tables under ``folder``; with ``broken`` one
    more tensor could not be read (null metrics, an error)."""
    rows = clip_rows(clip)
    if broken:
        rows.append(tensor_row(ClipRateRow, "bad.w", "mxfp8_e4m3", error="truncated tensor"))
    write_table(folder / "clip-rate.parquet", ClipRateRow, rows, PROV)
    write_table(folder / "underflow-rate.parquet", UnderflowRateRow,
                [tensor_row(UnderflowRateRow, t, c, underflow_rate=v, n_nonzero=1000)
                 for c, per in UNDERFLOW.items() for t, v in per.items()], PROV)
    write_table(folder / "sub" / "error-bias.parquet", ErrorBiasRow,
                [tensor_row(ErrorBiasRow, t, c, rel_error=e, bias=b, draws=1)
                 for c, per in ERRBIAS.items() for t, (e, b) in per.items()], PROV)
    return folder


@dataclass(frozen=True)
class GradCosineLike:
    """A table this drift may not have yet: higher is better, parameter '*' for all."""

    TABLE: ClassVar[str] = "grad-cosine-test"
    KEYS: ClassVar[tuple[str, ...]] = ("checkpoint", "policy", "parameter")
    HEADLINE: ClassVar[str] = "cosine"
    HIGHER_IS_WORSE: ClassVar[bool] = False

    checkpoint: str = column("checkpoint file")
    policy: str = column("arithmetic policy")
    parameter: str = column("parameter name; '*' for all")
    cosine: float | None = column("⟨ĝ, g⟩/(‖ĝ‖‖g‖)")
    retention: float | None = column("⟨ĝ, g⟩/‖g‖²")


@dataclass(frozen=True)
class TrainLike:
    """A per-step table: metrics against step, one series per policy."""

    TABLE: ClassVar[str] = "train-test"
    KEYS: ClassVar[tuple[str, ...]] = ("policy", "step")
    HEADLINE: ClassVar[str] = "loss"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    policy: str = column("arithmetic policy")
    step: int = column("training step")
    loss: float = column("training loss in nats")
    grad_norm: float = column("‖g‖")


COSINE = {"bf16": {"w1": 0.9999, "w2": 0.9995, "*": 0.9997},
          "mxfp8_e4m3": {"w1": 0.97, "w2": 0.995, "*": 0.985}}


def write_grad(folder: Path) -> Path:
    rows = [GradCosineLike("ckpt.safetensors", p, name, v, v * 0.99)
            for p, per in COSINE.items() for name, v in per.items()]
    return write_table(folder / "grad-cosine-test.parquet", GradCosineLike, rows, PROV)


def write_train(folder: Path) -> Path:
    rows = [TrainLike(p, s, 4.0 * math.exp(-s / 50) + (0.1 if p == "fp8" else 0), 1.0 / (s + 1))
            for p in ("bf16", "fp8") for s in range(0, 200, 20)]
    return write_table(folder / "train-test.parquet", TrainLike, rows, PROV)


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "out")


def report(*args: str) -> Any:
    return runner.invoke(app, ["report", *args])


def make_row(row_type: type, **values: Any) -> Any:
    """A row of any row type: the given values, nulls where allowed, else 0 or ''."""
    hints = typing.get_type_hints(row_type)
    filled = {}
    for f in dataclasses.fields(row_type):
        if f.name in values:
            filled[f.name] = values[f.name]
        elif type(None) in typing.get_args(hints[f.name]):
            filled[f.name] = None
        else:
            filled[f.name] = {str: "", int: 0, float: 0.0, bool: False}[hints[f.name]]
    return row_type(**filled)


REAL_COSINE = {"mxfp8_e4m3": {"wte": 0.999, "h.0.mlp.w": 0.981, "h.1.mlp.w": 0.95, "*": 0.97},
               "bf16": {"wte": 1.0, "h.0.mlp.w": 0.9999, "h.1.mlp.w": 0.9998, "*": 0.9999}}


def write_real_grad(folder: Path) -> Path:
    from driftcli.measures.grad_cosine import GradCosineRow

    rows = [make_row(GradCosineRow, checkpoint="tiny-gpt", policy=p, policy_spec=p + " spec",
                     parameter=n, cosine=v, retention=v * 0.98, norm_ratio=1.0, draws=1)
            for p, per in REAL_COSINE.items() for n, v in per.items()]
    return write_table(folder / "grad-cosine.parquet", GradCosineRow, rows, PROV)


# --- reading and schema checks -------------------------------------------------------------

def _declared_row_types() -> dict[str, type]:
    """Every row dataclass a module of the package defines, by its TABLE (every module
    imported: what the registry must list)."""
    import dataclasses
    import importlib
    import pkgutil

    import driftcli

    found: dict[str, type] = {}
    for m in pkgutil.walk_packages(driftcli.__path__, "driftcli."):
        if m.name.endswith("__main__"):
            continue
        module = importlib.import_module(m.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj)
                    and obj.__module__ == module.__name__
                    and isinstance(getattr(obj, "TABLE", None), str)
                    and isinstance(getattr(obj, "KEYS", None), tuple)):
                found[obj.TABLE] = obj
    return found


def test_every_row_type_is_registered() -> None:
    from driftcli.report.load import ROW_TYPES

    declared = _declared_row_types()
    assert row_types() == declared  # every one listed, under its own TABLE, and no other
    assert list(ROW_TYPES) == sorted(ROW_TYPES)
    assert declared["clip-rate"] is ClipRateRow and declared["verify-formats"] is VerifyRow
    assert ALL_ROWS == ALL_TENSORS


def test_a_row_type_left_out_of_the_registry_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import driftcli.report.load as load_mod

    monkeypatch.setattr(load_mod, "ROW_TYPES", {k: v for k, v in load_mod.ROW_TYPES.items()
                                                if k != "inspect"})
    load_mod.row_types.cache_clear()
    try:
        # the registry test's comparison fails on it
        assert row_types() != _declared_row_types() and "inspect" not in row_types()
    finally:
        load_mod.row_types.cache_clear()


def test_folders_recurse_and_non_drift_parquet_is_named_and_skipped(run: Path) -> None:
    pq.write_table(pa.table({"a": [1, 2]}), run / "other.parquet")
    loaded = load([run])
    assert sorted(t.name for t in loaded.tables) == ["clip-rate", "error-bias", "underflow-rate"]
    assert [s.path.name for s in loaded.skipped] == ["other.parquet"]
    result = report(str(run))
    assert result.exit_code == 0
    assert re.search(r"skipped \S*other\.parquet: a Parquet file but not a drift table",
                     result.output)


def test_a_table_from_another_drift_is_refused_with_the_reason(tmp_path: Path) -> None:
    table = pa.Table.from_pylist([dataclasses.asdict(r) for r in clip_rows()],
                                 schema=schema_of(ClipRateRow))
    table = table.drop_columns(["clip_mass"]).append_column(
        "clip_share", pa.array([0.0] * table.num_rows))
    old = dict(table.schema.metadata or {})
    meta = {**schema_of(ClipRateRow).metadata,
            b"drift": json.dumps({**PROV, "drift_version": "0.0.9"}).encode()}
    assert old != meta
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "clip-rate.parquet")
    with pytest.raises(SchemaError, match=r"written by drift 0\.0\.9.*missing clip_mass; "
                       r"unexpected clip_share"):
        load([tmp_path])
    result = report(str(tmp_path))
    assert result.exit_code == 2
    assert "error: " in result.output and "re-run drift clip-rate with this drift" in result.output


def test_no_tables_at_all_is_exit_2(tmp_path: Path) -> None:
    pq.write_table(pa.table({"a": [1]}), tmp_path / "x.parquet")
    result = report(str(tmp_path))
    assert result.exit_code == 2 and "no drift tables in" in result.output


# --- summaries ----------------------------------------------------------------------------

def test_library_report_without_the_cli(run: Path) -> None:
    rep = make_report([run], Options(rules=("clip_rate > 0.01",), worst=1))
    assert rep.failed and [v.n_rows for v in rep.violations] == [1]
    assert dict(rep.violations[0].rows[0])["tensor"] == "layers.1.w"
    clip = next(s for s in rep.summaries if s.name == "clip-rate")
    assert [w.name for w in clip.groups[0].worst] == ["layers.1.w"]  # worst=1
    assert not make_report([run], Options(rules=("clip_rate > 0.5",))).failed


def test_summary_values_per_cast(run: Path) -> None:
    s = summarize(load([run / "clip-rate.parquet"]).tables[0])
    assert s.layout.item == "tensor" and s.layout.groups == ("source", "cast")
    mx, fp8 = s.groups
    assert dict(mx.group)["cast"] == "mxfp8_e4m3"
    assert mx.n_rows == 3 and mx.median == pytest.approx(0.002)
    assert mx.worst_value == pytest.approx(0.05)
    assert [(w.name, w.value) for w in mx.worst] == [("layers.1.w", 0.05), ("layers.0.w", 0.002)]
    assert mx.aggregate_value("clip_rate") == pytest.approx(0.004)
    assert [(f.name, f.error) for f in mx.failed] == [("bad.w", "truncated tensor")]
    assert fp8.worst == () and fp8.worst_value == 0.0  # all equal: nothing named as worst


def test_higher_is_better_reports_the_min_and_lowest_first(tmp_path: Path) -> None:
    write_grad(tmp_path)
    s = summarize(load([tmp_path]).tables[0])
    assert s.layout.item == "parameter" and s.worst_label == "min"
    assert not s.known_row_type
    mx = next(g for g in s.groups if dict(g.group)["policy"] == "mxfp8_e4m3")
    assert mx.worst_value == pytest.approx(0.97)
    assert [w.name for w in mx.worst] == ["w1"]  # w2 is the best: not named as worst
    result = report(str(tmp_path))
    assert result.exit_code == 0
    assert "grad-cosine-test: cosine (higher is better)" in result.output
    assert "min cosine" in result.output and "w1 0.97" in result.output
    assert "no row type for this table" in result.output


def test_grad_cosine_table(tmp_path: Path) -> None:
    write_real_grad(tmp_path)
    table = load([tmp_path]).tables[0]
    assert table.row_type is not None and table.row_type.__name__ == "GradCosineRow"
    s = summarize(table)
    assert s.layout.item == "parameter" and s.layout.groups == ("checkpoint", "policy")
    mx = s.groups[0]
    assert mx.worst_value == pytest.approx(0.95) and mx.median == pytest.approx(0.981)
    assert [w.name for w in mx.worst] == ["h.1.mlp.w", "h.0.mlp.w"]
    assert mx.aggregate_value("cosine") == pytest.approx(0.97)
    rule = 'grad-cosine:cosine < 0.99 and policy == "mxfp8_e4m3"'
    result = report(str(tmp_path), "--fail-on", rule)
    assert result.exit_code == 1
    assert f"FAIL {rule}: 3 row(s) of grad-cosine" in result.output  # h.0, h.1 and '*'
    assert report(str(tmp_path), "--fail-on", 'grad-cosine:cosine < 0.99 and policy == "bf16"'
                  ).exit_code == 0


def test_accum_error_table_is_summarized(tmp_path: Path) -> None:
    from driftcli.measures.accum_error import AccumErrorRow

    rows = [make_row(AccumErrorRow, source="synthetic", matmul=d, spec=spec, m=8, k=k, n=8,
                     rel_error=e)
            for d in ("normal", "halfnormal") for spec, k, e in
            (("acc=bfloat16", 1024, 0.2 if d == "halfnormal" else 0.05),
             ("acc=float32", 1024, 0.004))]
    write_table(tmp_path / "accum-error.parquet", AccumErrorRow, rows, PROV)
    result = report(str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "accum-error: rel_error (higher is worse)" in result.output
    assert "acc=bfloat16 0.2" in result.output  # named by the key that tells rows apart
    assert "for all rows: source=synthetic, m=8, k=1024, n=8" in result.output


def test_printed_summary(run: Path) -> None:
    result = report(str(run))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "clip-rate: clip_rate (higher is worse)" in out
    row = next(line for line in out.splitlines() if "mxfp8_e4m3" in line and "clip" not in line
               and "layers.1.w 0.05" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    # "-": the exact clip rate beside the headline, null in this made-up table
    assert cells == ["mxfp8_e4m3", "3", "0.004", "-", "0.002", "0.05",
                     "layers.1.w 0.05, layers.0.w 0.002"]
    assert "for all rows: source=model.safetensors" in out
    assert "written by drift 0.1.0 (0123456789), 2026-01-02T03:04:05+00:00" in out
    assert "inputs: model.safetensors" in out
    assert "not measured: bad.w (source=model.safetensors cast=mxfp8_e4m3): truncated" in out
    assert "underflow-rate: underflow_rate (higher is worse)" in out
    assert "layers.0.w 0.3, embed.w 0" not in out and "layers.0.w 0.3, layers.1.w 0.001" in out
    assert out.rstrip().endswith("3 table(s) summarized")


def test_markdown(run: Path, tmp_path: Path) -> None:
    md = tmp_path / "summary.md"
    result = report(str(run), "--markdown", str(md))
    assert result.exit_code == 0
    text = md.read_text()
    assert "## clip-rate: clip_rate (higher is worse)" in text
    assert ("| cast | rows | all tensors (*) | exact_clip_rate (*) | median clip_rate | "
            "max clip_rate | worst tensors |" in text)
    assert ("| mxfp8_e4m3 | 3 | 0.004 | - | 0.002 | 0.05 | layers.1.w 0.05, layers.0.w 0.002 |"
            in text)
    assert "| fp8_e4m3 | 3 | 0 | - | 0 | 0 | - |" in text
    assert "- for all rows: source=model.safetensors" in text
    assert "## error-bias: rel_error (higher is worse)" in text
    # bias, alignment and n_lost of the all-tensors row beside the headline
    assert ("| fp8_e4m3 | 3 | 0.2 | -0.1 | - | - | 0.03 | 0.4 | layers.0.w 0.4, embed.w 0.03 |"
            in text)


def test_json(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert report(str(run), "--json", str(out)).exit_code == 0
    data = json.loads(out.read_text())
    assert data["drift_report"] == 1 and data["failed"] is False
    clip = next(t for t in data["tables"] if t["table"] == "clip-rate")
    assert clip["item"] == "tensor" and clip["group_by"] == ["source", "cast"]
    assert clip["provenance"]["inputs"] == ["model.safetensors"]
    mx = clip["groups"][0]
    assert mx["group"] == {"source": "model.safetensors", "cast": "mxfp8_e4m3"}
    assert mx["median"] == pytest.approx(0.002) and mx["worst"] == pytest.approx(0.05)
    assert mx["worst_rows"] == [{"name": "layers.1.w", "value": 0.05},
                                {"name": "layers.0.w", "value": 0.002}]
    assert mx["aggregate"]["clip_rate"] == pytest.approx(0.004)
    assert mx["not_measured"] == [{"name": "bad.w", "error": "truncated tensor"}]


def test_json_is_strict_with_infinities(tmp_path: Path) -> None:
    write_table(tmp_path / "error-bias.parquet", ErrorBiasRow,
                [tensor_row(ErrorBiasRow, "w", "bf16", rel_error=0.0, sqnr_db=math.inf),
                 tensor_row(ErrorBiasRow, "*", "bf16", rel_error=0.0, sqnr_db=math.inf)], PROV)
    out = tmp_path / "r.json"
    assert report(str(tmp_path), "--json", str(out)).exit_code == 0
    text = out.read_text()
    assert "Infinity" not in text
    assert json.loads(text)["tables"][0]["groups"][0]["aggregate"]["sqnr_db"] == "inf"


def make_demo_table(folder: Path) -> Path:
    """What `make demo` leaves: verify-formats.parquet from a quick verify (one format)."""
    from driftcli import verify as v
    from driftcli.io.tables import provenance

    outcomes = v.verify(v.element_formats(["int4"]), v.Plan(quick=True))
    return write_table(folder / "verify-formats.parquet", v.VerifyRow, v.rows(outcomes),
                       provenance(seed=v.SEED, extra={"plan": "quick"}))


def test_report_on_make_demo_output(tmp_path: Path) -> None:
    make_demo_table(tmp_path / "drift-out")
    result = report(str(tmp_path / "drift-out"))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "verify-formats: n_failed (higher is worse)" in out
    assert "for all rows: kind=summary, format=int4" in out
    assert "median n_failed" in out and "max n_failed" in out
    assert "1 table(s) summarized" in out
    s = summarize(load([tmp_path / "drift-out"]).tables[0])
    assert s.layout.groups and all(g.worst_value == 0 for g in s.groups)


# --- --fail-on ------------------------------------------------------------------------------

@pytest.mark.parametrize(("rule", "code", "rows"), [
    ("clip_rate > 0.01", 1, 1),                      # layers.1.w under mxfp8 only
    ("clip_rate > 0.003", 1, 2),                     # ... and the mxfp8 all-tensors row
    ("clip_rate > 0.05", 0, 0),                      # strict: 0.05 itself does not break it
    ("clip_rate >= 0.05", 1, 1),
    ("clip-rate:clip_rate > 0.003 and tensor != \"*\"", 1, 1),
    ("underflow-rate:underflow_rate > 0.25", 1, 1),  # layers.0.w under fp8
    ("underflow_rate > 0.05 and cast == 'fp8_e4m3'", 1, 2),
    ("underflow_rate > 0.05 and not (cast == 'fp8_e4m3' or tensor == '*')", 1, 1),
    ("rel_error > 0.3 or bias < -0.2", 1, 1),
    ("rel_error > 1", 0, 0),
    ("bias < -1e-3 and bias > -0.01", 1, 1),          # layers.1.w under mxfp8 (-0.004)
    ("clip_rate > -inf and n_blocks == 10 and cast == \"fp8_e4m3\" and tensor == 'embed.w'", 1, 1),
])
def test_fail_on_exits_1_exactly_when_a_row_matches(run: Path, rule: str, code: int,
                                                    rows: int) -> None:
    result = report(str(run), "--fail-on", rule)
    assert result.exit_code == code, result.output
    if code:
        assert f"FAIL {rule}: {rows} row(s) of" in result.output
        assert result.output.rstrip().splitlines()[-1].startswith("FAILED: 1 rule(s) broken")
    else:
        assert "FAIL" not in result.output and "OK: 1 rule(s) hold" in result.output


def test_fail_on_names_the_rows_and_writes_them_everywhere(run: Path, tmp_path: Path) -> None:
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    result = report(str(run), "--fail-on", "clip_rate > 0.01", "--fail-on",
                    "underflow-rate:underflow_rate > 0.25", "--markdown", str(md), "--json",
                    str(js))
    assert result.exit_code == 1
    assert ("source=model.safetensors tensor=layers.1.w cast=mxfp8_e4m3 clip_rate=0.05"
            in result.output)
    assert "tensor=layers.0.w cast=fp8_e4m3 underflow_rate=0.3" in result.output
    assert "FAILED: 2 rule(s) broken by 2 row(s)" in result.output
    assert "## Broken rules" in md.read_text() and "**FAILED" in md.read_text()
    data = json.loads(js.read_text())
    assert data["failed"] is True
    assert [(v["rule"], v["rows"]) for v in data["violations"]] == [
        ("clip_rate > 0.01", 1), ("underflow-rate:underflow_rate > 0.25", 1)]
    assert data["violations"][0]["shown"][0]["tensor"] == "layers.1.w"


def test_nulls_never_match_not_even_under_not(run: Path) -> None:
    # bad.w has a null clip_rate: neither the rule nor its negation picks it
    assert report(str(run), "--fail-on", "clip-rate:tensor == 'bad.w' and clip_rate < 1"
                  ).exit_code == 0
    assert report(str(run), "--fail-on", "clip-rate:tensor == 'bad.w' and not clip_rate < 1"
                  ).exit_code == 0
    assert report(str(run), "--fail-on", "clip-rate:tensor == 'bad.w' or clip_rate < 0"
                  ).exit_code == 1  # known true on one side is enough for or


@pytest.mark.parametrize(("rule", "message"), [
    ("clip_rat > 0.01", r"names column 'clip_rat', which every table lacks; did you mean "
                        r"clip_rate, .*\? \(columns: .*clip_mass"),
    ("clip-rate:underflow_rate > 0.1", r"which table clip-rate lacks.*\(columns: source, "),
    ("grad-cosine:cosine < 0.99", r"scoped to 'grad-cosine', but the report has no such "
                                  r"table \(tables: clip-rate, error-bias, underflow-rate\)"),
    ("clip_rate >> 0.01", r"cannot parse rule 'clip_rate >> 0.01' at character 12"),
    ("clip_rate = 0.01", r"use == for equality"),
    ("clip_rate > 0.01 && cast == 'a'", r"use and"),
    ("clip_rate > 'high'", r"compares column 'clip_rate' \(number\) with the value 'high' "
                           r"\(text\)"),
    ("clip_rate > 0.01 and underflow_rate > 0.1", r"no single table has all of"),
    ("(clip_rate > 0.01", r"expected '\)', found end of rule"),
    ("1 < 2", r"names no column"),
])
def test_bad_rules_exit_2_naming_the_choices(run: Path, rule: str, message: str) -> None:
    result = report(str(run), "--fail-on", rule)
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert re.search(message, result.output), result.output


# --- the expression language ----------------------------------------------------------------

def test_parse_tree_and_precedence() -> None:
    r = parse_rule('grad-cosine:cosine < 0.99 and policy == "mxfp8_e4m3" or not x != -1.5e-3')
    assert r.scope == "grad-cosine" and r.columns == ("cosine", "policy", "x")
    assert r.expr == ex.Or(
        ex.And(ex.Compare(ex.CompareOp.LT, ex.Column("cosine"), ex.Literal(0.99)),
               ex.Compare(ex.CompareOp.EQ, ex.Column("policy"), ex.Literal("mxfp8_e4m3"))),
        ex.Not(ex.Compare(ex.CompareOp.NE, ex.Column("x"), ex.Literal(-1.5e-3))))
    assert parse_rule('cast == "a:b\\"c"').scope is None  # a colon inside a string is no scope
    assert parse_rule('cast == "a:b\\"c"').expr.right == ex.Literal('a:b"c')


def test_evaluation_three_valued() -> None:
    frame = pd.DataFrame({"a": [1.0, None, 3.0, np.nan], "s": ["x", "y", None, "x"],
                          "f": [True, False, True, None]})
    def rows(text: str) -> list[int]:
        return list(np.flatnonzero(ex.evaluate(parse_rule(text), frame)))
    assert rows("a > 0") == [0, 2]
    assert rows("not a > 2") == [0]
    assert rows("a > 2 or s == 'y'") == [1, 2]
    assert rows("not (a > 2 and s == 'x')") == [0, 1]  # row 2: unknown and false = false
    assert rows("s < 'y'") == [0, 3]
    assert rows("f == true") == [0, 2]
    assert rows("a <= a") == [0, 2]


def test_no_eval_anywhere() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "driftcli" / "report").glob("*.py"))
    assert not re.search(r"(?<![\w.])(eval|exec|compile)\(", source)
    assert "literal_eval" not in source and "import ast" not in source


TOKENS = ["clip_rate", "cast", "tensor", "x", "and", "or", "not", "(", ")", "<", "<=", ">",
          ">=", "==", "!=", "=", "-", "0.01", "1e-3", "3", '"a"', "'b'", '"', "true", "inf",
          "clip-rate:", ":", " ", "&&", "\\", "1e", ".5", "9" * 400]
FRAME = pd.DataFrame({"clip_rate": [0.0, 0.02, None], "cast": ["a", "b", None],
                      "tensor": ["*", "w", "v"], "x": [True, False, None]})


def _check(text: str) -> None:
    try:
        rule = parse_rule(text)
    except ExpressionError as err:
        assert str(err) and "\n" not in str(err)
        return
    assert isinstance(rule, ex.Rule)
    try:
        mask = ex.evaluate(rule, FRAME)
    except ExpressionError as err:
        assert str(err) and "\n" not in str(err)
        return
    assert mask.dtype == bool and mask.shape == (3,)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=80))
def test_fuzz_any_text_parses_or_raises_expression_error(text: str) -> None:
    _check(text)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(str.join, st.sampled_from([" ", ""]),
                 st.lists(st.sampled_from(TOKENS), max_size=25)))
def test_fuzz_token_soup(text: str) -> None:
    _check(text)


def test_deep_nesting_is_refused_not_a_crash() -> None:
    with pytest.raises(ExpressionError, match="nested deeper than"):
        parse_rule("(" * 3000 + "x > 1" + ")" * 3000)
    with pytest.raises(ExpressionError, match="nested deeper than"):
        parse_rule("not " * 2000 + "x > 1")
    assert parse_rule("(" * 20 + "x > 1" + ")" * 20).columns == ("x",)


def test_bad_rule_on_the_command_line_is_one_line_exit_2(run: Path) -> None:
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "drift"), "report", str(run),
                           "--fail-on", "clip_rate >"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: cannot parse rule 'clip_rate >' at character 12: "
                                  "expected a column, number or quoted string, found end")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# --- baseline -------------------------------------------------------------------------------

def test_baseline_planted_regression(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", broken=False)
    worse = {c: dict(per) for c, per in CLIP.items()}
    worse["mxfp8_e4m3"]["layers.0.w"] = 0.004   # +100%: a regression
    worse["mxfp8_e4m3"]["layers.1.w"] = 0.045   # -10%: an improvement
    worse["fp8_e4m3"]["embed.w"] = 0.001        # from 0: a regression without a percentage
    del worse["fp8_e4m3"]["layers.1.w"]          # missing
    worse["fp8_e4m3"]["lm_head.w"] = 0.0          # new
    now = write_run(tmp_path / "now", clip=worse, broken=False)

    result = report(str(now), "--baseline", str(base), "--fail-on-regression", "50")
    assert result.exit_code == 1, result.output
    out = result.output
    assert ("regression model.safetensors layers.0.w mxfp8_e4m3: 0.002 → 0.004 (+100%)"
            in out)
    assert "regression model.safetensors embed.w fp8_e4m3: 0 → 0.001 (new (was 0))" in out
    assert "improvement model.safetensors layers.1.w mxfp8_e4m3: 0.05 → 0.045 (-10%)" in out
    assert "1 new key(s), not in the baseline:" in out
    assert "source=model.safetensors tensor=lm_head.w cast=fp8_e4m3" in out
    assert "1 missing key(s), in the baseline only:" in out
    assert "tensor=layers.1.w cast=fp8_e4m3" in out
    assert "clip-rate clip_rate: 7 row(s) matched, 3 changed by more than 1%" in out
    assert "FAILED: 2 regression(s) beyond 50%" in out

    # the same comparison without the planted changes: nothing to fail on
    same = report(str(base), "--baseline", str(base), "--fail-on-regression", "0")
    assert same.exit_code == 0 and "OK: no regression beyond 0%" in same.output
    # without a threshold to fail on, changes are listed but the exit is 0
    listed = report(str(now), "--baseline", str(base))
    assert listed.exit_code == 0 and "regression model.safetensors layers.0.w" in listed.output


def test_baseline_regression_percent_threshold(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", broken=False)
    worse = {c: dict(per) for c, per in CLIP.items()}
    worse["mxfp8_e4m3"]["layers.0.w"] = 0.0024  # +20%
    now = write_run(tmp_path / "now", clip=worse, broken=False)
    assert report(str(now), "--baseline", str(base), "--fail-on-regression", "19"
                  ).exit_code == 1
    assert report(str(now), "--baseline", str(base), "--fail-on-regression", "21"
                  ).exit_code == 0


def test_baseline_direction_follows_higher_is_worse(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_grad(tmp_path / "a")
    rows = [GradCosineLike("ckpt.safetensors", p, n, v * (1.01 if n == "w1" else 1), v)
            for p, per in COSINE.items() for n, v in per.items()]
    write_table(tmp_path / "b" / "grad-cosine-test.parquet", GradCosineLike, rows, PROV)
    js = tmp_path / "r.json"
    # cosine went up: an improvement for a higher-is-better headline
    result = report(str(tmp_path / "b"), "--baseline", str(tmp_path / "a"),
                    "--fail-on-regression", "0.1", "--json", str(js))
    assert result.exit_code == 0, result.output
    changes = json.loads(js.read_text())["baseline"]["tables"][0]["changes"]
    assert {c["key"]["parameter"] for c in changes} == {"w1"}
    assert not any(c["regression"] for c in changes)
    # and the other way round it is a regression
    assert report(str(tmp_path / "a"), "--baseline", str(tmp_path / "b"),
                  "--fail-on-regression", "0.1").exit_code == 1


def test_fail_on_regression_needs_a_baseline(run: Path) -> None:
    result = report(str(run), "--fail-on-regression", "5")
    assert result.exit_code == 2 and "needs --baseline" in result.output


def test_baseline_tables_only_one_side_has(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", broken=False)
    (base / "sub" / "error-bias.parquet").unlink()
    now = tmp_path / "now"
    write_table(now / "error-bias.parquet", ErrorBiasRow,
                [tensor_row(ErrorBiasRow, "w", "bf16", rel_error=0.1)], PROV)
    write_table(now / "clip-rate.parquet", ClipRateRow, clip_rows(), PROV)  # one in common
    result = report(str(now), "--baseline", str(base))
    assert result.exit_code == 0, result.output
    assert "tables without a baseline: error-bias" in result.output
    assert "baseline tables this run lacks: underflow-rate" in result.output
    # with no table in common nothing is compared: exit 2, naming both sides' tables
    (now / "clip-rate.parquet").unlink()
    none = report(str(now), "--baseline", str(base))
    assert none.exit_code == 2
    assert none.output.startswith(f"error: baseline {base} has none of this run's tables "
                                  "(this run: error-bias; the baseline: clip-rate, "
                                  "underflow-rate)")


# --- layouts ---------------------------------------------------------------------------------

def test_table_layouts() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_train(folder)
        write_grad(folder)
        tables = {t.name: t for t in load([folder]).tables}
    train = layout(tables["train-test"])
    assert (train.item, train.groups, train.has_aggregate) == ("step", ("policy",), False)
    grad = layout(tables["grad-cosine-test"])
    assert (grad.item, grad.groups, grad.has_aggregate) == (
        "parameter", ("checkpoint", "policy"), True)


# --- docs and examples ----------------------------------------------------------------------

def test_docs_rules_parse_and_commands_exist() -> None:
    doc = (ROOT / "docs" / "report.md").read_text()
    rules = re.findall(r"--fail-on '([^']+)'", doc) + re.findall(r'--fail-on "([^"]+)"', doc)
    bad = set(re.findall(r"\$ drift report \S+ --fail-on '([^']+)'\nerror: ", doc))
    assert len(rules) - len(bad) >= 8 and bad
    for rule in rules:
        if rule not in bad:  # the examples of errors are tested below
            parse_rule(rule)
    for opt in ("--markdown", "--json", "--html", "--fail-on", "--baseline",
                "--fail-on-regression", "--match-by", "--change-threshold", "--worst"):
        assert opt in doc, opt
    for op in ("<", "<=", ">", ">=", "==", "!="):
        assert f"`{op}`" in doc


def test_docs_error_examples_are_what_the_cli_prints(run: Path) -> None:
    doc = (ROOT / "docs" / "report.md").read_text()
    pairs = re.findall(r"\$ drift report \S+ --fail-on '([^']+)'\nerror: (.*)", doc)
    assert len(pairs) == 2
    for rule, message in pairs:
        result = report(str(run), "--fail-on", rule)
        assert result.exit_code == 2
        # to the first ';': what follows lists this run's columns (the page's own run is
        # checked whole by test_doc_outputs)
        assert result.output.startswith("error: " + message.split(";")[0])


def test_ci_examples_use_real_options() -> None:
    ci = ROOT / "examples" / "ci"
    workflow, script = (ci / "drift.yml").read_text(), (ci / "drift.sh").read_text()
    for text in (workflow, script):
        assert "drift report" in text and "--fail-on" in text and "--html" in text
        for cmd in ("clip-rate", "underflow-rate", "error-bias"):
            assert f"drift {cmd}" in text
        for rule in re.findall(r"--fail-on '([^']+)'", text):
            parse_rule(rule)
    assert "$GITHUB_STEP_SUMMARY" in workflow and "upload-artifact" in workflow
    assert subprocess.run(["bash", "-n", str(ci / "drift.sh")], check=False).returncode == 0


def test_ci_script_runs_end_to_end(tmp_path: Path) -> None:
    """The plain CI script: a tiny checkpoint, three measurements, a report that passes."""
    proc = subprocess.run(["bash", str(ROOT / "examples" / "ci" / "drift.sh")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False,
                          env={"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin",
                               "DRIFT_OUT": str(tmp_path / "out")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "report.html").stat().st_size > 10_000
    assert "clip-rate: clip_rate (higher is worse)" in proc.stdout
    assert "OK: 3 rule(s) hold" in proc.stdout


def test_the_report_names_casts_as_they_were_given(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from driftcli.records.castspec import parse_cast

    save_file({"w": torch.linspace(-500, 500, 4096).reshape(16, 256)},
              str(tmp_path / "m.safetensors"))
    nv, mx = str(parse_cast("nvfp4")), str(parse_cast("mxfp8_e4m3"))
    out = tmp_path / "out"
    done = runner.invoke(app, ["clip-rate", str(tmp_path / "m.safetensors"), "-c", "nvfp4",
                               "-c", mx, "--out", str(out), "--quiet"])
    assert done.exit_code == 0, done.output
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    assert report(str(out), "--markdown", str(md), "--json", str(js)).exit_code == 0
    text = md.read_text()
    assert f"- names: nvfp4 = {nv}" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert any(line.startswith("| nvfp4 | 1 |") for line in rows)
    assert any(line.startswith(f"| {mx} | 1 |") for line in rows)  # given as its spec
    assert not any(line.startswith(f"| {nv} |") for line in rows)
    clip = json.loads(js.read_text())["tables"][0]
    assert clip["names"] == {"cast": {nv: "nvfp4"}}  # JSON keeps the values as written
    assert {g["group"]["cast"] for g in clip["groups"]} == {nv, mx}
