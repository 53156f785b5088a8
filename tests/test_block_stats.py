"""drift block-stats: each statistic on hand-built tensors against counts made by hand (plain
Python, ``math.frexp``), the clipped blocks against clip-rate's element masks, both back-ends
and the process engine giving equal tables, and the command's tables."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file
from test_report_html import screenshot
from typer.testing import CliRunner

from driftcli import kernels
from driftcli.casts.route import _two_level_numba, block_ranges, key_counts
from driftcli.casts.scaling import ScalePlan, plan_two_level_scales
from driftcli.choices import Engine
from driftcli.cli import app
from driftcli.engines import Execution
from driftcli.errors import DriftError
from driftcli.io.readers import open_inputs
from driftcli.io.tables import read_table
from driftcli.measures.block_stats import (
    BlockScaleRow,
    BlockStatsRow,
    Direction,
    _fused,
    _groups,
    block_stats,
    direction_stats,
    directions,
    element_span,
)
from driftcli.measures.stats import cast_stats
from driftcli.records.castspec import parse_cast

runner = CliRunner()


def _binade(v: float) -> int:
    """floor(log2 |v|) by frexp: v = m * 2**e with 0.5 <= m < 1."""
    return math.frexp(v)[1] - 1


@pytest.fixture(params=["auto", "never"])
def backend(request: pytest.FixtureRequest) -> object:
    kernels.set_jit(request.param)
    yield request.param
    kernels.set_jit("auto")


def test_element_spans_are_counted_from_the_formats_ends() -> None:
    # E4M3: 448 = 1.75 * 2**8 down to 2**-9; E2M1: 6 = 1.5 * 2**2 down to 0.5;
    # E5M2: 57344 = 1.75 * 2**15 down to 2**-16
    assert element_span(parse_cast("mxfp8_e4m3").format) == 17
    assert element_span(parse_cast("nvfp4").format) == 3
    assert element_span(parse_cast("mxfp8_e5m2").format) == 31


def test_a_block_pinned_at_the_minimum_scale(backend: object) -> None:
    # row 0: 32 values of 2**-140: floor(log2 amax) - 8 = -148 is below E8M0's 2**-127, so the
    # scale is clamped to the minimum (code 0); rows 1-3: amax 1.0, scale 2**-8 (code 119)
    x = torch.ones(4, 32)
    x[0] = 2.0 ** -140
    cols, hist = direction_stats(x, parse_cast("mxfp8_e4m3"), Direction.ROWS)
    assert cols["scale_at_min"] == 1
    assert cols["scale_at_max"] == 0 and cols["scale_subnormal"] == 0
    assert hist == {0: (-127, 1), 119: (-8, 3)}
    assert (cols["scale_exponent_min"], cols["scale_exponent_max"], cols["scale_spread"]) == \
        (-127, -8, 119)
    assert cols["clipped_blocks"] == 0 and cols["n_blocks"] == 4


def test_a_column_spanning_30_binades(backend: object) -> None:
    # column 0 holds 2**0 .. 2**-30 (and 2**-30 again in row 31); every other element is 1
    x = torch.ones(32, 32)
    col = [2.0 ** -min(i, 30) for i in range(32)]
    x[:, 0] = torch.tensor(col)
    c = parse_cast("mxfp8_e4m3")
    span = 17
    rows, _ = direction_stats(x, c, Direction.ROWS)
    columns, _ = direction_stats(x, c, Direction.COLUMNS)
    # by hand: each row's range is 0 - floor(log2 min(x_row)); column 0's is 30, the others' 0
    row_ranges = [_binade(1.0) - _binade(min(1.0, v)) for v in col]
    assert rows["range_max"] == max(row_ranges) == 30
    assert rows["range_median"] == sorted(row_ranges)[(len(row_ranges) - 1) // 2]
    assert rows["range_over_span"] == sum(r > span for r in row_ranges) / 32 == 14 / 32
    assert columns["range_max"] == 30
    assert columns["range_median"] == 0
    assert columns["range_over_span"] == 1 / 32


def test_nvfp4_scales_in_the_e4m3_subnormals(backend: object) -> None:
    # tensor amax 2688 = 448 * 6: the float32 tensor scale is exactly 1, so a block's E4M3
    # scale is its amax / 6 rounded: 448 (the max), 2**-8 and 2**-9 (subnormals; 2**-9 the
    # smallest), 2**-6 (the smallest normal), and one all-zero block
    amaxes = [2688.0, 6 * 2.0 ** -8, 6 * 2.0 ** -9, 6 * 2.0 ** -6, 0.0]
    x = torch.zeros(1, 16 * len(amaxes))
    for i, a in enumerate(amaxes):
        x[0, 16 * i] = a
        x[0, 16 * i + 1] = a / 2
    cols, hist = direction_stats(x, parse_cast("nvfp4"), Direction.ROWS)
    assert cols["scale_subnormal"] == 2
    assert cols["scale_at_min"] == 1
    assert cols["scale_at_max"] == 1
    assert cols["zero_blocks"] == 1
    # E4M3 codes: 448 = 0x7E; 2**-9 is code 1, 2**-8 code 2, 2**-6 code 8; the zero block
    # takes the smallest scale too
    assert hist == {0x7E: (8, 1), 1: (-9, 2), 2: (-8, 1), 8: (-6, 1)}
    # each live block's range is 1 binade (a and a/2)
    assert cols["range_max"] == 1 and cols["range_over_span"] == 0.0


def test_the_range_pass_on_both_back_ends_sees_nan_inf_zero_and_subnormals() -> None:
    blocks = torch.tensor([[0.0, 0.0, 0.0, 0.0],
                           [1e-45, -3.0, 0.0, 2.0],
                           [float("nan"), 5.0, -1e-3, 0.0],
                           [float("-inf"), 0.0, 0.0, 0.0]])
    want_top = torch.tensor([0.0, 3.0, 5.0, 0.0])
    want_low = torch.tensor([math.inf, 1e-45, 1e-3, math.inf])
    want_bad = torch.tensor([False, False, True, True])
    for mode in ("auto", "never"):
        kernels.set_jit(mode)
        try:
            top, low, _, bad = block_ranges(blocks)
        finally:
            kernels.set_jit("auto")
        assert torch.equal(top, want_top) and torch.equal(low, want_low)
        assert torch.equal(bad, want_bad)


CASTS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "mxint8", "nvfp4", "fp8_e4m3",
         "float8_e4m3fn:channel:float32:amax", "float4_e2m1fn:tile16:float8_e4m3fn:two-level",
         "mxfp8_e4m3_ceil"]


def _sample() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 64, generator=g) * torch.logspace(-6, 3, 64)
    x[5, 7] = float("nan")
    x[40:42, :32] = 0.0
    x[60, 3] = 1e-40  # a float32 subnormal
    return x


@pytest.mark.parametrize("spec", CASTS)
def test_clipped_blocks_are_clip_rates_clipped_groups(spec: str) -> None:
    """An independent count: clip-rate's element masks, blocks along each axis (also where
    the last band of a column is a partial block)."""
    c = parse_cast(spec)
    for x, d in [(x, d) for x in (_sample(), _sample()[:70, :48].contiguous())
                 for d in (Direction.ROWS, Direction.COLUMNS)]:
        if c.scaling.granularity.value in ("tensor", "tile") and d is Direction.COLUMNS:
            continue
        cols, _ = direction_stats(x, c, d)
        st, _ = cast_stats(x, c, axis=0 if d is Direction.COLUMNS else -1, want_values=False,
                           rounded=False)
        assert cols["n_blocks"] == st.groups
        assert cols["clipped_blocks"] == st.clipped_groups, (spec, d)
        assert cols["nonfinite_blocks"] == (st.nonfinite_groups if c.scaling.blocked else
                                            cols["nonfinite_blocks"])


@pytest.mark.parametrize("spec", CASTS)
def test_both_back_ends_give_equal_columns_and_histograms(spec: str) -> None:
    c = parse_cast(spec)
    got = {}
    for mode in ("auto", "never"):
        kernels.set_jit(mode)
        try:
            got[mode] = [direction_stats(x, c, d) for x in (_sample(), _sample()[:70, :48])
                         for d in directions(c, x.dim())]
        except DriftError:
            got[mode] = None
        finally:
            kernels.set_jit("auto")
    assert got["auto"] == got["never"]


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_e8m0_scales_of_a_rounded_amax_rule_are_counted_down_to_the_smallest(mode: str) -> None:
    """amax-up into E8M0 (a cast verify-formats checks): a zero block's scale is E8M0's
    smallest, 2**-127, a float32 subnormal whose float32 bits lost it (the histogram
    crashed: "value 0.0 is not a value of float8_e8m0fnu")."""
    c = parse_cast("float4_e2m1fn:block32:float8_e8m0fnu:amax-up")
    x = torch.ones(4, 64)
    x[1, :32] = 0.0
    x[2, 32:] = 2.0**-120  # amax / 6 = 2**-122.58, up: 2**-122
    kernels.set_jit(mode)
    try:
        cols, hist = direction_stats(x, c, Direction.ROWS)
    finally:
        kernels.set_jit("auto")
    # E8M0's code is the exponent + 127; 1 / 6 rounds up to 2**-2
    assert hist == {0: (-127, 1), 5: (-122, 1), 125: (-2, 6)}
    assert (cols["zero_blocks"], cols["scale_exponent_min"]) == (1, -122)


def test_a_planted_clip_is_seen_in_its_direction_only() -> None:
    # every block amax 1.0 under mxfp8_e4m3's floor rule: scale 2**-8, M * s = 1.75; one
    # element of 1.9 in a row whose amax is 1.9 would set its own scale, so plant it where
    # it is the block's amax: 1.9 has floor(log2) 0 as 1.0 does, and 1.9 > 1.75 clips
    x = torch.ones(32, 64)
    x[3, 40] = 1.9
    c = parse_cast("mxfp8_e4m3")
    rows, _ = direction_stats(x, c, Direction.ROWS)
    columns, _ = direction_stats(x, c, Direction.COLUMNS)
    assert rows["clipped_blocks"] == 1 and columns["clipped_blocks"] == 1
    clean, _ = direction_stats(torch.ones(32, 64), c, Direction.ROWS)
    assert clean["clipped_blocks"] == 0


def test_an_unscaled_cast_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    save_file({"w": torch.ones(4, 32)}, str(path))
    with pytest.raises(DriftError, match="has no scales"):
        block_stats([path], ["bf16"])


def test_tables_are_equal_from_kept_units_and_on_the_process_engine(tmp_path: Path) -> None:
    """What an engine does to a unit: pickle it to a worker, record its rows and read them
    back (--resume). The units pickle, and rows read back from the kept units (the JSON
    record every engine's results go through) equal the serial run's; one worker process
    gives the same tables (one worker: each spawn costs a torch import)."""
    import pickle

    from driftcli.measures.block_stats import BlockUnit, block_unit

    path = tmp_path / "a.safetensors"
    save_file({"w": _sample(), "v": torch.linspace(-3, 3, 96).reshape(3, 32).contiguous()},
              str(path))
    casts = ["mxfp8_e4m3", "nvfp4"]
    serial = block_stats([path], casts)
    kept = tmp_path / "kept"
    first = block_stats([path], casts, execution=Execution(resume=kept))
    again = block_stats([path], casts, execution=Execution(resume=kept))  # read back
    assert serial.rows == first.rows == again.rows
    assert serial.scales == first.scales == again.scales
    unit = BlockUnit(str(path), open_inputs([path]).tensors[0],
                     tuple(parse_cast(c) for c in casts))
    assert block_unit(pickle.loads(pickle.dumps(unit))) == block_unit(unit)
    procs = block_stats([path], casts, execution=Execution(Engine.PROCESSES, workers=1))
    assert procs.rows == serial.rows and procs.scales == serial.scales
    assert {(r.tensor, r.direction) for r in serial.rows} == \
        {("w", "rows"), ("w", "columns"), ("v", "rows"), ("v", "columns")}
    assert sum(r.blocks for r in serial.scales if r.tensor == "v" and r.direction == "rows"
               and r.cast == serial.rows[0].cast) == 3


def test_the_command_writes_both_tables_with_provenance(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    x = torch.ones(4, 32)
    x[0] = 2.0 ** -140
    save_file({"w": x, "i": torch.arange(4)}, str(path))
    out = tmp_path / "out"
    result = runner.invoke(app, ["block-stats", str(path), "-c", "mxfp8_e4m3", "--out",
                                 str(out), "--json"])
    assert result.exit_code == 0, result.output
    stats = pq.read_table(out / f"{BlockStatsRow.TABLE}.parquet")
    scales = pq.read_table(out / f"{BlockScaleRow.TABLE}.parquet")
    for table in ("block-stats", "block-scales"):
        _, prov = read_table(out / f"{table}.parquet")
        assert [Path(i["path"]).name for i in prov["inputs"]] == ["a.safetensors"]
        assert prov["casts"] == ["mxfp8_e4m3"]
    got = stats.to_pylist()
    assert [(r["direction"], r["scale_at_min"], r["n_blocks"]) for r in got] == \
        [("rows", 1, 4), ("columns", 0, 32)]  # 32 columns of 4, each padded to a block
    assert sorted((r["direction"], r["scale_code"], r["blocks"]) for r in scales.to_pylist()) \
        == [("columns", 119, 32), ("rows", 0, 1), ("rows", 119, 3)]
    again = runner.invoke(app, ["block-stats", str(path), "-c", "mxfp8_e4m3", "--out",
                                str(out)])
    assert again.exit_code == 2 and "exists" in again.output


def test_a_scale_arithmetic_cast_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    save_file({"w": torch.ones(4, 32)}, str(path))
    result = runner.invoke(app, ["block-stats", str(path), "-c", "torchao/nvfp4", "--out",
                                 str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "scale arithmetic" in result.output


def test_fraction_spans_match_the_bits() -> None:
    # the element span is floor(log2) of exact rationals; the bits of the float agree
    f = parse_cast("nvfp4").format
    assert _binade(float(f.max)) - _binade(float(f.smallest_positive)) == element_span(f)
    assert Fraction(float(f.max)) == f.max


def test_the_reports_heatmaps_show_the_planted_exponents_and_clips(tmp_path: Path) -> None:
    """The html report embeds a tensors x scale-exponent heatmap per cast and direction and a
    tensors x clipped-share one; their cells are coloured where the blocks are: a tensor
    whose every block has one scale fills one cell with the colour map's top (yellow)."""
    import base64
    import io
    import re

    import numpy as np
    from PIL import Image

    path = tmp_path / "a.safetensors"
    clip = torch.ones(8, 64)
    clip[:, ::32] = 1.9  # every row block clips (1.9 > 1.75 * 2**0 under scale 2**-8)
    save_file({"flat": torch.ones(8, 64), "clip": clip}, str(path))
    out = tmp_path / "out"
    assert runner.invoke(app, ["block-stats", str(path), "-c", "mxfp8_e4m3", "--out", str(out),
                               "-q"]).exit_code == 0
    page = tmp_path / "r.html"
    result = runner.invoke(app, ["report", str(out / "block-stats.parquet"),
                                 str(out / "block-scales.parquet"), "--html", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    images = {alt: base64.b64decode(png) for png, alt in
              re.findall(r'src="data:image/png;base64,([^"]+)"[^>]*alt="([^"]+)"', text)}
    maps = [a for a in images if a.startswith("heatmap")]
    assert len(maps) == 3, list(images)  # clips; exponents along rows and along columns

    def yellow(png: bytes) -> int:
        rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
        return int(((rgb[..., 0] > 230) & (rgb[..., 1] > 210) & (rgb[..., 2] < 80)).sum())

    rows_map = next(images[a] for a in maps if "exponent" in a and a.endswith("rows"))
    clip_map = next(images[a] for a in maps if "clipping" in a)
    assert yellow(rows_map) > 500  # both tensors' blocks all at 2**-8: full cells
    assert yellow(clip_map) > 500  # the clip tensor's row blocks all clip
    empty = torch.ones(8, 64)  # and a tensor with no clip draws no yellow on the clip map
    save_file({"flat": empty}, str(path))
    again = tmp_path / "again"
    runner.invoke(app, ["block-stats", str(path), "-c", "mxfp8_e4m3", "--out", str(again), "-q"])
    runner.invoke(app, ["report", str(again / "block-stats.parquet"), "--html", str(page)])
    text = page.read_text()
    got = {alt: base64.b64decode(png) for png, alt in
           re.findall(r'src="data:image/png;base64,([^"]+)"[^>]*alt="([^"]+)"', text)}
    # (the colour bar's top end is a few yellow pixels on every map)
    assert yellow(next(v for a, v in got.items() if "clipping" in a)) < 50


def test_fail_on_gates_on_block_stats_columns(tmp_path: Path) -> None:
    """The planted fault (a block pinned at E8M0's minimum) breaks a gate on scale_at_min;
    the same gate holds on the clean tensor."""
    for name, pinned, code in (("planted", True, 1), ("clean", False, 0)):
        path = tmp_path / f"{name}.safetensors"
        x = torch.ones(4, 32)
        if pinned:
            x[0] = 2.0 ** -140
        save_file({"w": x}, str(path))
        out = tmp_path / name
        assert runner.invoke(app, ["block-stats", str(path), "-c", "mxfp8_e4m3", "--out",
                                   str(out), "-q"]).exit_code == 0
        result = runner.invoke(app, ["report", str(out / "block-stats.parquet"), "--fail-on",
                                     "block-stats:scale_at_min > 0"])
        assert result.exit_code == code, result.output
        assert ("FAIL" in result.output) == pinned


def test_an_empty_tensor_and_an_unreadable_file_give_rows_not_crashes(tmp_path: Path) -> None:
    good = tmp_path / "in" / "a.safetensors"
    good.parent.mkdir()
    save_file({"empty": torch.zeros(0, 32), "w": torch.ones(2, 32, dtype=torch.float64)},
              str(good))
    (tmp_path / "in" / "b.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    found = block_stats([good.parent], ["mxfp8_e4m3", "fp8_e4m3"])
    empty = [r for r in found.rows if r.tensor == "empty"]
    assert [(r.direction, r.n_blocks, r.range_max) for r in empty] == \
        [("rows", 0, None), ("columns", 0, None), ("tensor", 0, None)]
    bad = [r for r in found.rows if r.error is not None]
    assert len(bad) == 2 and all(r.source.endswith("b.safetensors") for r in bad)
    # a float64 tensor's float32 tensor scale: counted under the nearest float32's code
    tensor_row = next(r for r in found.scales if r.tensor == "w" and r.direction == "tensor")
    assert (tensor_row.scale_exponent, tensor_row.blocks) == (-9, 1)
    result = runner.invoke(app, ["block-stats", str(good.parent), "-c", "mxfp8_e4m3",
                                 "--out", str(tmp_path / "o"), "-q"])
    assert result.exit_code == 2 and "b.safetensors" in result.output
    assert (tmp_path / "o" / "block-stats.parquet").exists()  # the others were measured


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get "
                    "install chromium); the pixel checks of the PNGs above still run")
def test_the_heatmaps_are_readable_in_headless_chromium(tmp_path: Path) -> None:
    """The report page as a browser draws it: the block-stats heatmaps show (the colour map's
    yellow cells of the planted tensor, where every block has one scale and clips)."""

    import numpy as np
    from PIL import Image

    path = tmp_path / "a.safetensors"
    clip = torch.ones(8, 64)
    clip[:, ::32] = 1.9
    save_file({"clip": clip}, str(path))
    out = tmp_path / "out"
    assert runner.invoke(app, ["block-stats", str(path), "-c", "mxfp8_e4m3", "--out", str(out),
                               "-q"]).exit_code == 0
    page = tmp_path / "r.html"
    assert runner.invoke(app, ["report", str(out / "block-stats.parquet"),
                               str(out / "block-scales.parquet"), "--html",
                               str(page)]).exit_code == 0
    shot, _ = screenshot(page, tmp_path)
    rgb = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    yellow = (rgb[..., 0] > 230) & (rgb[..., 1] > 210) & (rgb[..., 2] < 80)
    assert yellow.sum() > 1500  # full cells on the clip map and the exponent maps


def test_key_counts_back_ends_agree_and_skip_the_masked_groups() -> None:
    keys = torch.tensor([5, -3, 5, 7, 100, -3, 5], dtype=torch.int64)
    finite = torch.tensor([True, True, True, True, False, True, True])
    got = {}
    for mode in ("auto", "never"):
        kernels.set_jit(mode)
        try:
            low, counts = key_counts(keys, finite)
            _, none = key_counts(keys, torch.zeros_like(finite))
        finally:
            kernels.set_jit("auto")
        got[mode] = (low, counts.tolist(), none.numel())
    # keys -3 (twice), 5 (three times), 7; the masked 100 widens nothing
    expected = [2] + [0] * 7 + [3, 0, 1]
    assert got["auto"] == got["never"] == (-3, expected, 0)


def test_two_level_scales_by_the_kernel_equal_the_torch_plan() -> None:
    # amaxes over 80 binades around tensor amaxes from 2**-140 to 2**120 (block scales
    # clamped at both ends of E4M3), and all-zero groups: the block scale read back from the
    # kernel's divisor is the torch plan's, bit for bit, wherever the fast path answers
    c = parse_cast("nvfp4")
    plan = ScalePlan.of(c.format, c.scaling)
    gen = torch.Generator().manual_seed(3)
    answered = 0
    for w in range(-140, 121, 13):
        amax = (torch.randn(2000, generator=gen).abs() *
                torch.exp(torch.randn(2000, generator=gen) * 8) * 2.0 ** w).float()
        amax[~torch.isfinite(amax)] = 3e38
        amax[::97] = 0
        top = amax.max()
        fast = _two_level_numba(amax, c)
        if fast is None:
            continue
        answered += 1
        two = plan_two_level_scales(amax, top, plan.divisors(amax), plan)
        assert torch.equal(fast[0], two.block_scale.double()), w
        assert torch.equal(fast[1], two.block_scale.view(torch.int32)), w
        assert torch.equal(fast[2], two.divisor), w
    assert answered >= 15


def test_two_level_falls_back_to_torch_below_float32_normals() -> None:
    # a tensor amax in float32's subnormals: the tensor scale is float32's tiny, every
    # divisor below it, so the divisor cannot give the block scale back; the torch plan runs
    x = torch.full((32, 32), 2.0 ** -140)
    x[0, 0] = 2.0 ** -135
    c = parse_cast("nvfp4")
    amax = x.reshape(-1, 16).amax(dim=1)
    assert _two_level_numba(amax, c) is None
    got = {}
    for mode in ("auto", "never"):
        kernels.set_jit(mode)
        try:
            got[mode] = direction_stats(x, c, Direction.ROWS)
        finally:
            kernels.set_jit("auto")
    assert got["auto"] == got["never"]
    assert got["auto"][0]["scale_subnormal"] == 64


@pytest.mark.parametrize("spec", ["mxfp8_e4m3", "mxfp4_e2m1", "mxfp8_e4m3_ceil", "nvfp4"])
def test_the_fused_pass_answers_for_the_block_casts(spec: str) -> None:
    # so that test_both_back_ends_give_equal_columns_and_histograms holds the one-pass
    # summary (numba) against the torch steps for these casts, not the unfused numba path
    c = parse_cast(spec)
    sf = c.scaling.scale_format
    assert sf is not None
    for d in (Direction.ROWS, Direction.COLUMNS):
        _, (amax, _, span, bad) = _groups(_sample(), c, d)
        ends = (float(sf.max), float(sf.smallest_normal) if sf.has_subnormals else 0.0,
                float(sf.smallest_positive))
        fused = _fused(amax, span, bad, True, c, sf, ends, element_span(c.format))
        assert fused is not None
        (counts, _, _), codes = fused
        assert counts[2] == 1  # the NaN's group
        assert sum(n for _, n in codes.values()) == amax.numel() - 1


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_merged_ranges_equal_the_ranges_read_from_the_elements(mode: str) -> None:
    """Groups of 48 and 32 (and one tensor group) made of the facts of groups of 16 and 8,
    on each back-end, equal the groups read from the elements: also where a run holds a
    partial group (48 and 70 are not multiples of 32) and where a line's last group is short
    of the run's length (a partial run)."""
    from driftcli.casts.route import group_ranges, merge_ranges
    from driftcli.records.cast import Scaling
    from driftcli.records.modes import Granularity

    def block(k: int) -> Scaling:  # mxfp8_e4m3's scaling in blocks of k
        return replace(parse_cast("mxfp8_e4m3").scaling, block=k)

    kernels.set_jit(mode)
    try:
        for two in (_sample(), _sample()[:70, :40].contiguous()):
            for along in (-1, 0):
                lines = two.shape[1 if along == 0 else 0]
                for short, long in ((16, 32), (8, 32), (16, 48), (8, 16)):
                    top, low, _, bad = group_ranges(two, block(short), along, keep=False)[1]
                    want = group_ranges(two, block(long), along, keep=False)[1]
                    got = merge_ranges(top, low, bad, lines, long // short)
                    for g, w in zip(got, want, strict=True):
                        assert torch.equal(g, w), (mode, two.shape, along, short, long)
                    whole = merge_ranges(top, low, bad, 1, top.numel())
                    one = group_ranges(two, replace(block(1), granularity=Granularity.TENSOR,
                                                    block=0), -1, keep=False)[1]
                    for g, w in zip(whole, one, strict=True):
                        assert torch.equal(g, w)
    finally:
        kernels.set_jit("auto")


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_a_tensors_casts_sharing_their_reads_give_each_casts_own_columns(mode: str) -> None:
    """block_unit reads a tensor's shortest groups once and makes the longer groups and the
    tensor scale's of them (merge_ranges): every cast's columns and histogram equal those it
    gets alone."""
    from driftcli.measures.block_stats import BlockUnit, block_unit

    x = _sample()[:70, :48].contiguous()
    casts = tuple(parse_cast(c) for c in CASTS)

    class Ref:  # the reader's tensor, already in memory
        source, name, layer, dtype, shape = "mem", "x", None, "F32", (70, 48)

        def read(self) -> torch.Tensor:
            return x

    kernels.set_jit(mode)
    try:
        rows, hist = block_unit(BlockUnit("mem", Ref(), casts))  # type: ignore[arg-type]
        alone = [(c, d, *direction_stats(x, c, d)) for c in casts
                 for d in directions(c, x.dim())]
    finally:
        kernels.set_jit("auto")
    assert len(rows) == len(alone) == 16
    for row, (c, d, cols, codes) in zip(rows, alone, strict=True):
        assert (row.cast, row.direction) == (str(c), d.value)
        assert {k: getattr(row, k) for k in cols} == cols, (str(c), d)
        assert {(h.scale_code, h.scale_exponent, h.blocks) for h in hist
                if (h.cast, h.direction) == (str(c), d.value)} == \
            {(k, e, n) for k, (e, n) in codes.items()}
