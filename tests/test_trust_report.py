"""Results a user can trust (issue 26, items 2, 3 and 7): CI rules that cannot pass silently,
headlines that show lost elements, bias and the exact clip rate, and output that keeps what
tells rows apart."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.tables import column, write_table
from driftcli.measures.clip_rate import ClipRateRow
from driftcli.measures.common import ALL_TENSORS
from driftcli.records.castspec import parse_cast

runner = CliRunner()
NVFP4 = str(parse_cast("nvfp4"))
MXFP8 = str(parse_cast("mxfp8_e4m3"))
MXFP8_CEIL = str(parse_cast("mxfp8_e4m3_ceil"))


def report(*args: str) -> Any:
    return runner.invoke(app, ["report", *args])


def row(row_type: type, tensor: str, cast: str, **own: Any) -> Any:
    """A row with the shared columns filled in and the rest null."""
    base = {f.name: None for f in dataclasses.fields(row_type)}
    base.update(source="m.safetensors", tensor=tensor, cast=cast, cast_name=cast, format="f",
                granularity="block", block=16, rounding="rne", n_tensors=1, n_skipped=0)
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


# --- item 3: overflow, bias and the exact clip rate in every headline -----------------------

def overflow_checkpoint(folder: Path) -> Path:
    """``over``: 16 of its 32 float32 values (1e5) overflow float16's 65504; ``w``: Gaussian."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    gen = np.random.default_rng(0)
    over = np.concatenate([np.full(16, 1e5), gen.standard_normal(16)]).astype(np.float32)
    path = folder / "m.safetensors"
    save_file({"over": torch.from_numpy(over),
               "w": torch.from_numpy(gen.standard_normal((32, 64)).astype(np.float32))}, path)
    return path


def test_an_element_lost_to_inf_makes_rel_error_inf_and_ranks_worst(tmp_path: Path) -> None:
    import math

    from driftcli.measures import MEASURES

    rows = {r.tensor: r for r in MEASURES["error-bias"].run([overflow_checkpoint(tmp_path)],
                                                            ["fp16"])}
    over, w, agg = rows["over"], rows["w"], rows[ALL_TENSORS]
    assert over.n_lost == 16 and agg.n_lost == 16 and w.n_lost == 0
    assert over.rel_error == math.inf and over.sqnr_db == -math.inf  # was 0: ranked best
    assert agg.rel_error == math.inf
    assert 0 < w.rel_error < 5e-4 and math.isfinite(w.sqnr_db)  # fp16 rounding of N(0, 1)
    # the direction of the error is still that of the elements kept
    assert over.bias is not None and abs(over.bias) < 1e-3


def test_the_json_summary_of_a_lost_element_is_strict_json(tmp_path: Path) -> None:
    """A tensor whose rel_error is inf: ``--json`` writes it as the report does ("inf"), not
    as ``Infinity``, which JSON parsers refuse."""
    import json

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    result = runner.invoke(app, ["error-bias", str(overflow_checkpoint(tmp_path)), "-c", "fp16",
                                 "--json", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "Infinity" not in result.output
    summary = json.loads(result.output, parse_constant=refuse)
    assert "inf" in json.dumps(summary)


def test_summaries_show_loss_bias_alignment_and_the_exact_clip_rate(tmp_path: Path) -> None:
    import json

    path = overflow_checkpoint(tmp_path)
    out = tmp_path / "out"
    got = runner.invoke(app, ["error-bias", str(path), "-c", "fp16", "-c", "nvfp4", "--out",
                              str(out), "--json"])
    assert got.exit_code == 0, got.output
    summary = json.loads(got.stdout)
    assert summary["beside"] == ["bias", "alignment", "n_lost"]
    fp16 = next(c for c in summary["casts"] if c["cast"] == "fp16")
    assert fp16["n_lost"] == 16 and fp16["rel_error"] == "inf"  # strict JSON, as report --json
    assert fp16["worst"][0]["tensor"] == "over"
    assert fp16["bias"] < 0 and -1 < fp16["alignment"] < 0
    printed = runner.invoke(app, ["error-bias", str(path), "-c", "fp16", "--out",
                                  str(tmp_path / "printed")])
    head = next(line for line in printed.output.splitlines() if "rel_error" in line
                and "┃" in line)
    assert [c.strip() for c in head.strip("┃ ").split("┃")] == [
        "cast", "tensors", "rel_error", "bias", "alignment", "n_lost", "worst tensors"]
    assert "over inf" in printed.output

    got = runner.invoke(app, ["clip-rate", str(path), "-c", "nvfp4", "-c", "mxfp8_e4m3",
                              "--out", str(out), "--json"])
    casts = {c["cast"]: c for c in json.loads(got.stdout)["casts"]}
    # NVFP4's two-level scale clips only through the rounding of its block scales; MX's floor
    # rule clips in exact arithmetic too
    assert casts["nvfp4"]["clip_rate"] > 0.01 and casts["nvfp4"]["exact_clip_rate"] == 0
    assert casts["mxfp8_e4m3"]["exact_clip_rate"] == casts["mxfp8_e4m3"]["clip_rate"] > 0

    result = report(str(out), "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    assert "exact_clip_rate (*)" in result.output and "n_lost (*)" in result.output
    assert ("lost to inf/NaN: 16 element(s) in 1 tensor under cast=fp16 (over 16); rel_error is "
            "inf where any element was lost") in result.output
    data = json.loads((tmp_path / "r.json").read_text())
    eb = next(t for t in data["tables"] if t["table"] == "error-bias")
    assert [g["lost"] for g in eb["groups"]] == [[{"name": "over", "n_lost": 16}], []]


# --- item 7: output that keeps what tells rows apart ----------------------------------------

def test_drift_version() -> None:
    from driftcli import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"drift {__version__}\n"


LONG = "model.layers.0.self_attention.query_key_value.weight_with_a_long_name"


def test_a_narrow_terminal_wraps_but_never_cuts_names_or_numbers(tmp_path: Path) -> None:
    rows = [row(ClipRateRow, t, c, clip_rate=v, exact_clip_rate=v / 2, clipped=1)
            for c, per in CLIP.items() for t, v in per.items()]
    rows = [dataclasses.replace(r, tensor=f"{LONG}.{r.tensor}") if r.tensor != ALL_TENSORS
            else r for r in rows]
    write_table(tmp_path / "clip-rate.parquet", ClipRateRow, rows,
                prov({NVFP4: "nvfp4", MXFP8: "mxfp8_e4m3", MXFP8_CEIL: "mxfp8_e4m3_ceil"}))
    narrow = runner.invoke(app, ["report", str(tmp_path)], env={"COLUMNS": "90"})
    assert narrow.exit_code == 0, narrow.output
    table = [line for line in narrow.output.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 90  # the terminal's, not 160
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in table
             if line.startswith("│")]
    assert [c[0] for c in cells] == ["nvfp4", "mxfp8_e4m3", "mxfp8_e4m3_ceil"]
    assert cells[0][2:4] == ["0.03", "0.015"]  # all tensors (*), exact_clip_rate (*)
    # the worst rows did not fit beside the numbers: named under the table, whole
    assert f"  worst tensors (cast=nvfp4): {LONG}.a.w 0.034\n" in narrow.output
    wide = runner.invoke(app, ["report", str(tmp_path)], env={"COLUMNS": "250"})
    assert max(len(line) for line in wide.output.splitlines() if line[:1] == "┏") > 160
    assert f"│ {LONG}.a.w 0.034 " in wide.output
    assert "worst tensors (cast" not in wide.output


def test_the_measure_summary_keeps_cast_names_whole(tmp_path: Path) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    gen = np.random.default_rng(1)
    long = LONG
    save_file({f"{long}.{i}": torch.from_numpy(gen.standard_normal((4, 64)).astype(np.float32))
               for i in range(3)}, tmp_path / "m.safetensors")
    result = runner.invoke(app, ["clip-rate", str(tmp_path / "m.safetensors"), "-c",
                                 "mxfp8_e4m3", "-c", "mxfp8_e4m3_ceil", "--out",
                                 str(tmp_path / "out")], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = [line.split("│")[1].strip() for line in result.output.splitlines()
            if line.startswith("│")]
    assert [r for r in rows if r] == ["mxfp8_e4m3", "mxfp8_e4m3_ceil"]
    assert max(len(line) for line in result.output.splitlines() if line[:1] in "┏│") <= 80
    assert f"worst tensors under mxfp8_e4m3: {long}." in result.output


def test_markdown_escapes_html_in_names(tmp_path: Path) -> None:
    rows = [row(ClipRateRow, t, MXFP8, clip_rate=v, clipped=1)
            for t, v in (("<img src=x onerror=alert(1)>", 0.5), ("a&b", 0.4), ("c", 0.2),
                         (ALL_TENSORS, 0.3))]
    write_table(tmp_path / "clip-rate.parquet", ClipRateRow, rows, prov({MXFP8: "<b>mx</b>"}))
    md = tmp_path / "r.md"
    result = report(str(tmp_path), "--markdown", str(md), "--fail-on", "clip_rate > 0.1")
    assert result.exit_code == 1, result.output
    text = md.read_text()
    assert "<img" not in text and "<b>" not in text
    assert "| &lt;img src=x onerror=alert(1)&gt; 0.5, a&amp;b 0.4 |" in text  # worst rows
    assert "tensor=&lt;img src=x onerror=alert(1)&gt; cast=&lt;b&gt;mx&lt;/b&gt;" in text
    assert "names: &lt;b&gt;mx&lt;/b&gt; = " in text


def test_markdown_appends_to_the_job_summary_and_with_append(tmp_path: Path) -> None:
    clip_table(tmp_path / "run")
    summary = tmp_path / "step-summary.md"
    summary.write_text("## an earlier step\n", encoding="utf-8")
    env = {"GITHUB_STEP_SUMMARY": str(summary)}
    for _ in range(2):
        result = runner.invoke(app, ["report", str(tmp_path / "run"), "--markdown",
                                     str(summary)], env=env)
        assert result.exit_code == 0, result.output
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("## an earlier step\n\n# drift report\n")
    assert text.count("# drift report\n") == 2
    other = tmp_path / "other.md"
    other.write_text("kept\n", encoding="utf-8")
    report(str(tmp_path / "run"), "--markdown", str(other), "--append")
    assert other.read_text(encoding="utf-8").startswith("kept\n\n# drift report")
    report(str(tmp_path / "run"), "--markdown", str(other))  # not the job summary: replaced
    assert other.read_text(encoding="utf-8").startswith("# drift report")
    bad = report(str(tmp_path / "run"), "--append")
    assert bad.exit_code == 2 and "needs --markdown FILE" in bad.output


def test_every_preset_registry_is_listed_by_a_command() -> None:
    import json

    from driftcli.arith.policy import POLICIES
    from driftcli.arith.tensorcores import CORES

    got = runner.invoke(app, ["formats", "--tensor-cores", "--json"])
    assert got.exit_code == 0, got.output
    cores = {r["preset"]: r for r in json.loads(got.stdout)}
    assert set(cores) == set(CORES)
    h100 = cores["h100_e4m3_f32"]
    assert (h100["use"], h100["group"], h100["kept_bits"], h100["result"]) == (
        "tc=h100_e4m3_f32", 32, 13, "e8m13")
    got = runner.invoke(app, ["formats", "--policies", "--json"])
    listed = json.loads(got.stdout)
    assert {r["preset"] for r in listed if r["registry"] in ("policy", "recipe policy")} == \
        set(POLICIES)
    examples = {r["preset"]: r for r in listed if r["registry"] == "example policy"}
    assert examples["h100_fp8"]["use"] == "--policy examples/policies/h100_fp8.toml"
    assert examples["h100_fp8"]["meaning"].startswith("Hopper's FP8 tensor core")
    printed = runner.invoke(app, ["formats", "--tensor-cores", "--policies"],
                            env={"COLUMNS": "200"})
    assert "│ h100_e4m3_f32 " in printed.output and "│ mxfp8_e4m3 " in printed.output
    presets = runner.invoke(app, ["formats", "--presets"])
    assert "drift formats --tensor-cores" in presets.output
    assert "drift formats --policies" in presets.output


@dataclasses.dataclass(frozen=True)
class AccumLike:
    """A table grouped by long matmul specs, as accum-error's are."""

    TABLE: typing.ClassVar[str] = "accum-test"
    KEYS: typing.ClassVar[tuple[str, ...]] = ("spec", "k")
    HEADLINE: typing.ClassVar[str] = "rel_error"
    HIGHER_IS_WORSE: typing.ClassVar[bool] = True

    spec: str = column("matmul spec")
    k: int = column("contraction length")
    rel_error: float | None = column("‖C - exact‖ / ‖exact‖")


def test_long_bar_labels_become_a_caption_and_a_horizontal_chart(tmp_path: Path) -> None:
    import warnings

    from driftcli.report.load import load
    from driftcli.report.plots import Plot, figures

    specs = [f"lhs=float8_e4m3fn:block32:float8_e8m0fnu:floor,rhs={'x' * 150},acc={a}"
             for a in ("float32", "e8m13", "float16")]
    rows = [AccumLike(s, k, 1e-3 * (n + 1) * k) for n, s in enumerate(specs) for k in (64, 256)]
    write_table(tmp_path / "accum-test.parquet", AccumLike, rows, prov(None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a squeezed layout warns; nothing may
        plots = figures(load([tmp_path]).tables[0])
    bars = [p for p in plots if isinstance(p, Plot)]
    assert len(bars) == 1 and bars[0].alt.startswith("horizontal bar chart of max rel_error")
    assert bars[0].caption.startswith(f"1: {specs[0]}; 2: {specs[1]}; 3: {specs[2]}. rel_error")
    page = tmp_path / "page.html"
    result = runner.invoke(app, ["report", str(tmp_path), "--html", str(page)])
    assert result.exit_code == 0 and "warning" not in result.output, result.output
    assert f"3: {specs[2]}" in page.read_text(encoding="utf-8")


def test_baseline_changes_name_casts_as_the_report_shows_them(tmp_path: Path) -> None:
    clip_table(tmp_path / "base")
    worse = {c: {t: v * 2 for t, v in per.items()} for c, per in CLIP.items()}
    rows = [row(ClipRateRow, t, c, clip_rate=v, exact_clip_rate=v / 2, clipped=1)
            for c, per in worse.items() for t, v in per.items()]
    (tmp_path / "now").mkdir()
    write_table(tmp_path / "now" / "clip-rate.parquet", ClipRateRow, rows,
                prov({NVFP4: "nvfp4", MXFP8: "mxfp8_e4m3", MXFP8_CEIL: "mxfp8_e4m3_ceil"}))
    result = report(str(tmp_path / "now"), "--baseline", str(tmp_path / "base"),
                    "--fail-on-regression", "50")
    assert result.exit_code == 1, result.output
    assert "regression m.safetensors a.w nvfp4: 0.034 → 0.068 (+100%)" in result.output
    assert NVFP4 not in result.output.split("baseline ")[-1].split("names:")[0]


def test_formats_cast_explains_a_tensor_core_preset() -> None:
    got = runner.invoke(app, ["formats", "--cast", "tc=h100_e4m3_f32", "--cast", "nvfp4"])
    assert got.exit_code == 0, got.output
    assert got.output.startswith(
        "tc=h100_e4m3_f32 = tensor core: float8_e4m3fn operands, groups of 32 products, 13 bits "
        "kept, each group rounded (rtz) into e8m13 (a matmul spec part, not a cast; ")
    assert f"nvfp4 = {NVFP4}\n" in got.output
    bad = runner.invoke(app, ["formats", "--cast", "tc=h100_e4m3"])
    assert bad.exit_code == 2 and "did you mean h100_e4m3_f32" in bad.output
    assert "drift formats --tensor-cores" in bad.output


def test_the_html_plot_names_tensors_whose_error_is_infinite(tmp_path: Path) -> None:
    import math

    from driftcli.measures.error_bias import ErrorBiasRow
    from driftcli.report.load import load
    from driftcli.report.plots import Plot, figures

    fp16 = str(parse_cast("fp16"))
    values = {fp16: {"over": math.inf, "w": 2e-4, ALL_TENSORS: math.inf},
              NVFP4: {"over": 1e-6, "w": 0.09, ALL_TENSORS: 0.05}}
    rows = [row(ErrorBiasRow, t, c, rel_error=v, bias=-1e-3, n_lost=16 if math.isinf(v) else 0,
                draws=1) for c, per in values.items() for t, v in per.items()]
    write_table(tmp_path / "error-bias.parquet", ErrorBiasRow, rows,
                prov({fp16: "fp16", NVFP4: "nvfp4"}))
    plot = next(p for p in figures(load([tmp_path]).tables[0])
                if isinstance(p, Plot) and p.title == "error-bias: rel_error by tensor")
    assert plot.caption.endswith(" Not drawn, infinite: over (fp16: inf).")
