"""clip-rate, underflow-rate, error-bias on a checkpoint with known contents: every count
and rate equals the value worked out by hand from the planted numbers."""

from __future__ import annotations

import hashlib
import json
import math
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli import kernels
from driftcli.casts.quantization import quantize
from driftcli.cli import app
from driftcli.errors import DriftError
from driftcli.io.tables import read_table, schema_of
from driftcli.measures import MEASURES
from driftcli.measures.scan import ScanOptions, row_alignment, scan
from driftcli.measures.stats import CastStats, cast_stats, finite_amax, fused_stats
from driftcli.memory import use_huge_pages
from driftcli.records.castspec import parse_cast

runner = CliRunner()
F32 = np.float32

# mxfp8_e4m3: blocks of 32 along the last axis, scale 2^(floor(log2 amax) - 8), max 448.
# Row 0 of "w": amax 1.9, scale 2^-8, so |x| > 448 * 2^-8 = 1.75 clips: 1.9, 1.8, -1.76.
CLIPPERS = [1.9, 1.8, -1.76]
# Row 1: amax 1.0, scale 2^-8; |x / s| below 2^-10 (half the smallest subnormal 2^-9, the
# tie rounding to even zero) flushes: 1e-7 and 2^-18. 2^-16 lands on the subnormal 2^-8.
TINY = [1e-7, 2.0**-18, 2.0**-16]


def planted() -> dict[str, torch.Tensor]:
    w = torch.full((2, 32), 0.25)
    w[0, :3] = torch.tensor(CLIPPERS)
    w[1] = 0.5
    w[1, 0] = 1.0
    w[1, 1:4] = torch.tensor(TINY)
    w[1, 4] = -0.0
    nan = torch.ones(32)
    nan[0] = math.nan
    return {
        "w": w,
        "half": w[:1].to(torch.bfloat16),  # bf16(1.9) = 1.8984375 still clips
        "nan": nan,
        "zeros": torch.zeros(4, 8),
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(10),
    }


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(planted(), str(path))
    return path


def rows_by(rows: list, cast: str) -> dict[str, object]:
    spec = str(parse_cast(cast))
    return {r.tensor: r for r in rows if r.cast == spec}


def test_clip_rate_by_hand(ckpt: Path) -> None:
    rows = rows_by(MEASURES["clip-rate"].run([ckpt], ["mxfp8_e4m3"]), "mxfp8_e4m3")
    w = rows["w"]
    assert (w.clipped, w.n_finite, w.n_nonfinite, w.n_blocks) == (3, 64, 0, 2)
    assert w.clip_rate == 3 / 64 and w.clipped_blocks == 1 / 2
    stored = [float(F32(v)) for v in CLIPPERS]
    excess = sum(abs(v) - 1.75 for v in stored)
    abs_sum = sum(abs(v) for v in stored) + 29 * 0.25 + 1.0 + sum(float(F32(v)) for v in TINY) \
        + 27 * 0.5
    assert w.clip_mass == pytest.approx(excess / abs_sum, rel=1e-12)
    half = rows["half"]
    assert half.dtype == "bfloat16" and half.clipped == 3 and half.clip_rate == 3 / 32
    nan = rows["nan"]  # a NaN block: nothing in it counts as clipped
    assert (nan.n_finite, nan.n_nonfinite, nan.clipped, nan.clip_rate) == (31, 1, 0, 0.0)
    assert rows["zeros"].clip_rate == 0.0 and rows["scalar"].clipped == 0
    empty = rows["empty"]
    assert empty.numel == 0 and empty.n_finite == 0 and empty.clip_rate is None
    assert "ids" not in rows
    total = rows["*"]
    assert (total.n_tensors, total.n_skipped, total.clipped) == (6, 1, 6)
    assert total.n_finite == 64 + 32 + 31 + 32 + 1 and total.n_nonfinite == 1
    assert total.clip_rate == 6 / total.n_finite
    assert total.n_blocks == 2 + 1 + 1 + 4 + 1 + 0


def test_underflow_rate_by_hand(ckpt: Path) -> None:
    rows = MEASURES["underflow-rate"].run([ckpt], ["mxfp8_e4m3", "fp8_e4m3_unscaled"])
    mx = rows_by(rows, "mxfp8_e4m3")["w"]
    assert (mx.underflowed, mx.n_nonzero, mx.subnormal) == (2, 63, 1)
    assert mx.underflow_rate == 2 / 63 and mx.subnormal_rate == 1 / 63
    bare = rows_by(rows, "fp8_e4m3_unscaled")
    # scale 1: everything at or below 2^-10 flushes, the three tiny values
    assert bare["w"].underflowed == 3 and bare["w"].n_blocks == 1
    assert bare["zeros"].n_nonzero == 0 and bare["zeros"].underflow_rate is None
    assert bare["*"].underflowed == 3 + 0 and bare["*"].scale_clamped == 0


def test_scale_clamping_is_counted(tmp_path: Path) -> None:
    # e8m0 reaches down to 2^-127: a block of 1e-45 (float32 subnormal) needs 2^-157
    x = torch.full((3, 32), 1.0)
    x[1] = 1e-45
    path = tmp_path / "c.safetensors"
    save_file({"x": x}, str(path))
    row = rows_by(MEASURES["underflow-rate"].run([path], ["mxfp8_e4m3"]), "mxfp8_e4m3")["x"]
    assert row.scale_clamped == 1 and row.n_blocks == 3


def test_error_bias_by_hand(tmp_path: Path) -> None:
    # e4m3 spacing in [1, 2) is 1/8: 1.0625 is a tie and rounds to even, 1.0; -3 is exact
    x = [1.0, 1.0625, -3.0, 0.0]
    path = tmp_path / "e.safetensors"
    save_file({"x": torch.tensor(x)}, str(path))
    row = rows_by(MEASURES["error-bias"].run([path], ["fp8_e4m3_unscaled"]),
                  "fp8_e4m3_unscaled")["x"]
    e = [0.0, -0.0625, 0.0, 0.0]
    xx = sum(v * v for v in x)
    ee = sum(v * v for v in e)
    ex = sum(a * b for a, b in zip(e, x, strict=True))
    assert row.rel_error == pytest.approx(math.sqrt(ee / xx), rel=1e-15)
    assert row.sqnr_db == pytest.approx(10 * math.log10(xx / ee), rel=1e-15)
    assert row.bias == ex / xx and row.alignment == pytest.approx(ex / math.sqrt(ee * xx))
    assert row.mean_error == -0.0625 / sum(abs(v) for v in x)
    assert row.draws == 1 and row.expected_bias is None and row.n_lost == 0


def test_error_bias_clipping_makes_bias_negative_and_nan_blocks_are_left_out(ckpt: Path) -> None:
    rows = rows_by(MEASURES["error-bias"].run([ckpt], ["mxfp8_e4m3"]), "mxfp8_e4m3")
    assert rows["w"].bias < 0 < rows["w"].rel_error
    nan = rows["nan"]
    # the lost elements are not in the sums: an infinite error, not none (issue 26)
    assert nan.n_lost == 31 and nan.rel_error == math.inf and nan.sqnr_db == -math.inf
    assert rows["scalar"].rel_error == 0.0 and rows["scalar"].sqnr_db == math.inf
    assert rows["scalar"].alignment is None


def test_stochastic_rounding_separates_expected_bias_from_draw_error(tmp_path: Path) -> None:
    path = tmp_path / "sr.safetensors"
    save_file({"x": torch.full((4096,), 1.0625)}, str(path))
    draws = 64
    rows = MEASURES["error-bias"].run([path], ["fp8_e4m3_unscaled:sr"],
                                      options=ScanOptions(draws=draws, seed=3))
    row = rows_by(rows, "fp8_e4m3_unscaled:sr")["x"]
    # each element rounds to 1 or 1.125 with probability 1/2: |e| = 1/16 everywhere
    assert row.draws == draws
    assert row.rel_error == pytest.approx(0.0625 / 1.0625, rel=1e-12)
    # the mean of N draws: per-element std (1/16)/sqrt(N); bias of the mean ~ 1/sqrt(N·n)
    assert abs(row.expected_bias) < 5 * 0.0625 / 1.0625 / math.sqrt(draws * 4096)
    assert row.expected_rel_error < 3 * row.rel_error / math.sqrt(draws)
    assert abs(row.alignment) < 0.1


def test_slices_add_up_to_the_whole_tensor() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-8, 3, 96)
    x[3, 5] = math.nan
    for spec in ["fp8_e4m3", "mxfp8_e4m3", "nvfp4", "nvfp4_2d", "float8_e4m3fn:channel"]:
        c = parse_cast(spec)
        whole, _ = cast_stats(x, c)
        parts = [cast_stats(x[i:i + 16], c, tensor_amax=finite_amax(x))[0]
                 for i in range(0, 64, 16)]
        merged = CastStats.merge(parts, c.scaling.granularity.value == "tensor")
        for f in whole.__dataclass_fields__:
            assert getattr(merged, f) == pytest.approx(getattr(whole, f), rel=1e-12), (spec, f)


def test_one_slice_merges_as_the_exact_additions_would() -> None:
    """A tensor of one slice skips the exact additions: every field the same bits as adding
    it to a slice of nothing, its partials summing to its sums, for the fused pass's stats
    (partials) and the per-cast path's (floats, NaN blocks), a tensor scale's groups at most 1."""
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-8, 3, 96)
    x[3, 5] = math.nan
    nothing = CastStats.merge([], False)
    specs = ["fp8_e4m3", "mxfp8_e4m3", "nvfp4", "float8_e4m3fn:channel"]
    got = [*fused_stats(x, specs, rounded=True).values(),
           *(cast_stats(x, spec)[0] for spec in specs)]
    for st in got:
        for per_tensor in (False, True):
            alone = CastStats.merge([st], per_tensor)
            added = CastStats.merge([st, nothing], per_tensor)
            assert repr(alone) == repr(added)
            for f, p in (alone.partials or {}).items():
                assert math.fsum(p) == getattr(alone, f) or math.isnan(getattr(alone, f))


@pytest.mark.parametrize(("switch", "given", "on", "left"), [
    ("always [madvise] never\n", None, True, "1"),
    ("[always] madvise never\n", None, True, "1"),
    ("always madvise [never]\n", None, False, None),
    (None, None, False, None),  # no such file: not Linux, or no huge pages
    ("always [madvise] never\n", "0", False, "0"),  # the user's choice stands
    ("always madvise [never]\n", "1", True, "1"),
])
def test_huge_pages_are_asked_for_only_where_offered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, switch: str | None, given: str | None,
        on: bool, left: str | None) -> None:
    path = tmp_path / "enabled"
    if switch is not None:
        path.write_text(switch)
    if given is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", given)
    assert use_huge_pages(path) is on
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == left


def test_large_tensors_are_read_in_aligned_slices(tmp_path: Path) -> None:
    torch.manual_seed(1)
    x = torch.randn(48, 64)
    path = tmp_path / "big.safetensors"
    save_file({"x": x}, str(path))
    casts = ["fp8_e4m3", "mxfp8_e4m3", "nvfp4_2d", "nvfp4"]
    for axis, held in ((-1, 0), (0, 0), (-1, 1 << 20)):
        small = scan([path], casts, options=ScanOptions(chunk_elements=256, axis=axis,
                                                        whole_bytes=held))
        whole = scan([path], casts, options=ScanOptions(axis=axis))
        for a, b in zip(small.results, whole.results, strict=True):
            for f in a.draws[0].__dataclass_fields__:
                assert getattr(a.draws[0], f) == pytest.approx(getattr(b.draws[0], f),
                                                               rel=1e-12), (a.cast, f)
    assert row_alignment((48, 64), parse_cast("nvfp4_2d"), -1) == 16
    assert row_alignment((48, 64), parse_cast("mxfp8_e4m3"), 0) == 32
    assert row_alignment((48, 64), parse_cast("float8_e4m3fn:channel"), 0) is None


@pytest.mark.parametrize("mode", ["never", "auto"])
@pytest.mark.parametrize("rounded", [False, True])
def test_channels_along_the_first_axis_are_cut_along_the_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rounded: bool, mode: str) -> None:
    """A channel spanning dim 0 cannot be cut there: a held tensor is cut along its last
    dim (tiles kept whole), so its transposed copy is made one slice at a time."""
    from driftcli.measures import scan as scan_mod

    monkeypatch.setattr(kernels.jit, "_jit_mode", mode)  # torch's back-end, or numba's

    torch.manual_seed(2)
    x = torch.randn(48, 64) * torch.logspace(-6, 4, 64)
    x[7, 9] = math.nan
    path = tmp_path / "x.safetensors"
    save_file({"x": x}, str(path))
    casts = ["float8_e4m3fn:channel", "fp8_e4m3", "nvfp4_2d", "mxfp8_e4m3"]
    shapes: list[tuple[int, ...]] = []

    def counted(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        shapes.append(tuple(t.shape))
        return cast_stats(t, *args, **kwargs)  # type: ignore[arg-type]

    def counted_fused(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        got = fused_stats(t, *args, **kwargs)  # type: ignore[arg-type]
        shapes.extend(tuple(t.shape) for _ in got)  # each cast the fused pass counted
        return got

    monkeypatch.setattr(scan_mod, "cast_stats", counted)
    monkeypatch.setattr(scan_mod, "fused_stats", counted_fused)
    cut = scan([path], casts, rounded=rounded,
               options=ScanOptions(chunk_elements=256, axis=0))
    assert set(shapes) == {(48, 16)} and len(shapes) == 4 * len(casts)
    shapes.clear()
    whole = scan([path], casts, rounded=rounded, options=ScanOptions(axis=0))
    assert set(shapes) == {(48, 64)}
    for a, b in zip(cut.results, whole.results, strict=True):
        for f in a.draws[0].__dataclass_fields__:
            got, want = getattr(a.draws[0], f), getattr(b.draws[0], f)
            assert got == (want if want is None else pytest.approx(want, rel=1e-12)), \
                (a.cast, f)
    assert cut.results[0].draws[0].groups == 64
    assert cut.results[0].draws[0].nonfinite_groups == 0  # a channel scale: not a block's
    # one tile spans the last dim: no cut is possible there either
    narrow = tmp_path / "narrow.safetensors"
    save_file({"x": x[:, :16].contiguous()}, str(narrow))
    shapes.clear()
    one = scan([narrow], casts, rounded=rounded, options=ScanOptions(chunk_elements=256, axis=0))
    assert set(shapes) == {(48, 16)}
    assert [r.draws for r in one.results] == \
        [r.draws for r in scan([narrow], casts, rounded=rounded,
                               options=ScanOptions(axis=0)).results]
    # too large to hold: read whole, as one slice
    shapes.clear()
    scan([path], casts[:1], rounded=rounded,
         options=ScanOptions(chunk_elements=256, axis=0, whole_bytes=1024))
    assert shapes == [(48, 64)]


def test_cli_writes_three_tables_with_schema_and_provenance(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for name in ("clip-rate", "underflow-rate", "error-bias"):
        result = runner.invoke(app, [name, str(ckpt), "--cast", "mxfp8_e4m3", "-c", "nvfp4",
                                     "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert f"{name}.parquet" in result.output
        path = out / f"{name}.parquet"
        m = MEASURES[name]
        table = pq.read_table(path)
        assert table.schema.remove_metadata() == schema_of(m.row_type).remove_metadata()
        assert all(table.schema.field(f).metadata[b"doc"] for f in table.schema.names)
        df, prov = read_table(path)
        assert len(df) == 2 * 7  # 6 float tensors + the all-tensors row, per cast
        assert prov["inputs"][0]["path"] == str(ckpt)
        assert prov["inputs"][0]["size"] == ckpt.stat().st_size
        assert prov["inputs"][0]["sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
        assert prov["casts"] == ["mxfp8_e4m3", "nvfp4"] and prov["axis"] == -1
    df, _ = read_table(out / "clip-rate.parquet")
    w = df[(df.tensor == "w") & (df.cast == str(parse_cast("mxfp8_e4m3")))].iloc[0]
    assert w["clipped"] == 3 and w["shape"] == "[2, 32]"


def test_the_scan_names_its_files_before_it_reads_a_tensor(ckpt: Path) -> None:
    events: list[tuple[str, object]] = []
    s = scan([ckpt.parent], ["fp8_e4m3"], on_open=lambda files: events.append(("open", files)),
             progress=lambda done, total, name: events.append(("tensor", name)))
    assert events[0] == ("open", s.files) and s.files == [ckpt]
    assert [kind for kind, _ in events[1:]] == ["tensor"] * (len(events) - 1) != []


def test_progress_counts_bytes_within_a_tensor(tmp_path: Path) -> None:
    """A tensor read in slices moves the bar slice by slice, not only when it is done."""
    path = tmp_path / "one.safetensors"
    save_file({"big": torch.randn(64, 32), "small": torch.randn(3)}, path)
    seen: list[tuple[int, int, str]] = []
    scan([path], ["mxfp8_e4m3", "fp8_e4m3"], options=ScanOptions(chunk_elements=16 * 32),
         progress=lambda done, total, name: seen.append((done, total, name)))
    big = [done for done, _, name in seen if name == "big"]
    assert big[:4] == [16 * 32 * 4 * k for k in (1, 2, 3, 4)]  # four slices of 16 rows
    assert seen[-1] == (64 * 32 * 4 + 3 * 4,) * 2 + ("small",)
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)


def test_cli_json_summary_names_the_worst(ckpt: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["clip-rate", str(ckpt), "-c", "mxfp8_e4m3", "--json",
                                 "--out", str(tmp_path)])
    summary = json.loads(result.output)
    cast = summary["casts"][0]
    assert cast["worst"][0]["tensor"] in ("half", "w") and cast["worst"][0]["clip_rate"] == 3 / 32
    assert cast["skipped"] == 1 and summary["table"].endswith("clip-rate.parquet")


def test_a_corrupt_tensor_is_reported_and_the_others_measured(ckpt: Path,
                                                              tmp_path: Path) -> None:
    data = ckpt.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])  # the last tensor's bytes are gone
    out = tmp_path / "out"
    result = runner.invoke(app, ["clip-rate", str(cut), "-c", "mxfp8_e4m3", "--out", str(out)])
    assert result.exit_code == 2
    df, _ = read_table(out / "clip-rate.parquet")
    bad = df[df.error.notna() & (df.tensor != "*")]
    good = df[df.error.isna() & (df.tensor != "*")]
    assert len(bad) >= 1 and len(good) >= 1
    assert bad.clip_rate.isna().all() and good.clip_rate.notna().any()
    assert "could not be read" in result.output


@pytest.mark.parametrize("args", [
    ["missing.safetensors", "-c", "mxfp8_e4m3"],
    ["{ckpt}", "-c", "mxfp9"],
    ["{ckpt}"],
])
def test_bad_input_is_one_line_exit_2(ckpt: Path, tmp_path: Path, args: list[str]) -> None:
    argv = ["clip-rate", *(a.format(ckpt=ckpt) for a in args), "--out", str(tmp_path / "o")]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert not (tmp_path / "o" / "clip-rate.parquet").exists()


@pytest.mark.parametrize(("spec", "low"), [("fp8_e4m3", -30), ("mxfp8_e4m3", -30),
                                           ("nvfp4", -30), ("mxfp6_e3m2:sr:ieee", -30),
                                           ("float8_e4m3fn:block32:float32:floor", -38),
                                           ("float8_e4m3fn", -12), ("float8_e5m2:sr:ieee", -12),
                                           ("bfloat16", -45), ("int8", -3),
                                           ("float4_e2m1fn:rtz", -3),
                                           ("float8_e4m3fn:channel", -12),
                                           ("int8:channel:float32:amax", -30),
                                           ("float8_e5m2:channel:float8_e8m0fnu:floor:sr", -30)])
def test_the_fused_numba_pass_equals_the_torch_masks(spec: str, low: int) -> None:

    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(96, 160, generator=gen) * torch.logspace(low, 6, 160)
    x[:4] *= 2.0**-100  # scaled grids below float32's smallest subnormal, where a scale allows
    x[5, 7], x[9, 0], x[11, 3] = math.nan, math.inf, 0.0
    try:
        kernels.set_jit("never")
        eager, q_eager = cast_stats(x, spec, seed=2)
        kernels.set_jit("auto")
        fused, q_fused = cast_stats(x, spec, seed=2)
    finally:
        kernels.set_jit("auto")
    assert q_eager is not None and q_fused is not None
    assert torch.equal(q_eager.view(torch.int32), q_fused.view(torch.int32))
    assert eager.underflowed > 0 and eager.nonfinite == 2
    # amax scaling leaves nothing to clip, and nothing here reaches bfloat16's max
    assert eager.clipped > 0 or spec in ("fp8_e4m3", "bfloat16")
    for f in eager.__dataclass_fields__:
        a, b = getattr(eager, f), getattr(fused, f)
        assert (a == b) if isinstance(a, int) else b == pytest.approx(a, rel=1e-12), f


@pytest.mark.parametrize("spec", ["fp8_e4m3", "mxfp8_e4m3", "nvfp4", "mxfp6_e3m2:sr:ieee",
                                  "mxint8", "float8_e4m3fn:tensor:float8_e8m0fnu:floor",
                                  "float8_e4m3fn:block32:float32:floor", "float8_e4m3fn",
                                  "float8_e5m2:ieee", "int8", "float4_e2m1fn",
                                  "float8_e4m3fn:channel", "int8:channel:float32:amax"])
@pytest.mark.parametrize("backend", ["never", "auto"])
def test_counting_without_rounding_gives_the_same_clip_counts(spec: str,
                                                              backend: str) -> None:

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-30, 6, 128)
    x[:2] *= 2.0**-100
    # int8's range is not symmetric: 127.5 * 2**k clips, -127.5 * 2**k does not
    x[10, :32] = 0.5
    x[10, 0] = 127.5 / 64
    x[11, :32] = -0.5
    x[11, 0] = -127.5 / 64
    x[20, 127], x[21, 127] = 1.95 * 2.0**30, -1.8 * 2.0**30  # clip under a floor tensor scale
    x[5, 7], x[9, 0], x[12, 3], x[13, 100] = math.nan, math.inf, -math.inf, 0.0
    kernels.set_jit("never")
    try:
        full, _ = cast_stats(x, spec, seed=2)
        kernels.set_jit(backend)
        clip, values = cast_stats(x, spec, want_values=False, rounded=False)
    finally:
        kernels.set_jit("auto")
    assert values is None
    assert full.nonfinite == 3
    assert full.clipped > 0 or spec == "fp8_e4m3"  # amax scaling leaves nothing to clip
    for f in full.__dataclass_fields__:
        a, b = getattr(full, f), getattr(clip, f)
        if f in ("nonzero", "underflowed", "subnormal", "lost", "xx", "ee", "ex", "e_sum"):
            assert b is None, f
        else:
            assert (a == b) if isinstance(a, int) else b == pytest.approx(a, rel=1e-12), f


@pytest.mark.parametrize("spec", ["fp8_e4m3", "mxfp8_e4m3", "nvfp4", "nvfp4_2d", "mxint8",
                                  "float8_e4m3fn:tensor:float8_e8m0fnu:floor"])
@pytest.mark.parametrize("rounded", [True, False])
def test_casts_sharing_slice_facts_count_the_same(spec: str, rounded: bool) -> None:
    from driftcli.measures.stats import slice_facts

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(48, 96, generator=gen) * torch.exp(2 * torch.randn(48, 96, generator=gen))
    x[3, 17], x[30, 64], x[31, 5] = math.nan, math.inf, -math.inf  # 48*96 is no 4096s
    x[40, 95] = 1.95 * 2.0**20
    kernels.set_jit("never")
    try:
        alone, _ = cast_stats(x, spec, seed=3, want_values=False, rounded=rounded)
        kernels.set_jit("auto")
        facts = slice_facts(x, 16)
        shared, _ = cast_stats(x, spec, seed=3, want_values=False, rounded=rounded,
                               facts=facts)
    finally:
        kernels.set_jit("auto")
    derived = facts.group_amax(x, parse_cast(spec), -1)
    assert (derived is None) == (spec == "nvfp4_2d")  # tiles are not runs of the flat tensor
    assert facts.finite == 48 * 96 - 3
    assert alone.clipped > 0 or spec == "fp8_e4m3"  # amax scaling leaves nothing to clip
    for f in alone.__dataclass_fields__:
        a, b = getattr(alone, f), getattr(shared, f)
        assert (a == b) if isinstance(a, int) or a is None else \
            b == pytest.approx(a, rel=1e-12), f


def test_clip_excess_far_beyond_a_clamped_scale_is_summed_exactly() -> None:

    # an E5M2 power-of-two scale stops at 2**15: values near 1e14 clip by a factor of 1e7,
    # where |x| - M·s is no longer exact in float32 and the float64 sum must take over
    gen = torch.Generator().manual_seed(8)
    x = torch.full((64, 64), 0.5)  # these rows do not clip
    x[:8] = torch.randn(8, 64, generator=gen) * 1e14
    spec = "float8_e4m3fn:block32:float8_e5m2:floor"
    kernels.set_jit("never")
    try:
        eager, _ = cast_stats(x, spec, want_values=False, rounded=False)
        kernels.set_jit("auto")
        fused, _ = cast_stats(x, spec, want_values=False, rounded=False)
    finally:
        kernels.set_jit("auto")
    assert eager.clipped == fused.clipped > 400 and eager.scale_clamped == 16
    exact = sum(abs(Fraction(v)) - 448 * 2**15 for v in x[:8].reshape(-1).tolist()
                if abs(v) > 448 * 2**15)
    assert eager.clip_excess == pytest.approx(float(exact), rel=1e-15)
    assert fused.clip_excess == pytest.approx(float(exact), rel=1e-15)


def test_the_asymmetric_int8_range_is_settled_element_by_element() -> None:
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = 127.5, -127.5  # the scale is 1 in both blocks (floor rule, emax 6)
    for mode in ("never", "auto"):

        kernels.set_jit(mode)
        try:
            st, _ = cast_stats(x, "mxint8", want_values=False, rounded=False)
        finally:
            kernels.set_jit("auto")
        assert (st.clipped, st.clipped_groups) == (1, 1), mode
        assert st.clip_excess == 0.5


def test_values_come_back_only_when_wanted() -> None:

    x = torch.linspace(-3, 3, 64).reshape(2, 32)
    kernels.set_jit("never")  # the eager path: the fused one never makes them unasked
    try:
        wanted, q = cast_stats(x, "mxfp8_e4m3")
        unwanted, none = cast_stats(x, "mxfp8_e4m3", want_values=False)
    finally:
        kernels.set_jit("auto")
    assert none is None and wanted == unwanted
    assert q is not None and torch.equal(q, quantize(x, "mxfp8_e4m3"))


def test_values_need_the_rounding() -> None:
    with pytest.raises(DriftError, match="want_values=False"):
        cast_stats(torch.ones(4), "mxfp8_e4m3", rounded=False)




ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(MEASURES))
def test_every_column_is_documented(name: str) -> None:
    from dataclasses import fields

    page = (ROOT / "docs" / f"{name}.md").read_text()
    shared = (ROOT / "docs" / "measurements.md").read_text()
    assert f"drift {name}" in page
    for f in fields(MEASURES[name].row_type):
        assert f"| `{f.name}` |" in page + shared, f"{f.name} missing from docs/{name}.md"


def test_the_demo_checkpoint_shows_what_the_docs_say(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "example.safetensors"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_checkpoint.py"), str(path)],
                   check=True, capture_output=True)
    casts = ["fp8_e4m3", "mxfp8_e4m3", "mxfp8_e4m3_ceil", "nvfp4"]
    clip = MEASURES["clip-rate"].run([path], casts)
    under = MEASURES["underflow-rate"].run([path], casts)
    tanh = rows_by(clip, "mxfp8_e4m3")["activations.tanh"]
    assert 0.55 < tanh.clip_rate < 0.65  # floor: the block max sits under 1.0, 0.875 is the top
    assert rows_by(clip, "mxfp8_e4m3_ceil")["activations.tanh"].clip_rate == 0.0
    assert rows_by(clip, "fp8_e4m3")["*"].clipped == 0
    assert rows_by(under, "nvfp4")["gradients.layers.1"].underflow_rate > 0.5
    assert rows_by(under, "mxfp8_e4m3")["gradients.layers.1"].underflow_rate < 0.01
    assert rows_by(clip, "nvfp4")["*"].n_skipped == 1


class _Custom:
    """A class a weights-only load refuses."""

    def __init__(self) -> None:
        self.w = torch.ones(2)


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(4, 32)}, str(good))
    data = good.read_bytes()
    pickled = tmp_path / "model.pt"
    torch.save({"obj": _Custom()}, pickled)
    header = tmp_path / "header.safetensors"
    header.write_bytes(len(b"{not json").to_bytes(8, "little") + b"{not json")
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(data[:-64])
    empty = tmp_path / "empty"
    empty.mkdir()
    return {"pickle": pickled, "header": header, "truncated": truncated, "empty": empty,
            "missing": tmp_path / "nope.safetensors"}


@pytest.mark.parametrize(("kind", "says"), [
    ("pickle", "unpickling"), ("header", "header"), ("truncated", "truncated"),
    ("empty", "no tensor files"), ("missing", "nope.safetensors")])
def test_bad_inputs_are_exit_2_with_one_error_line(tmp_path: Path, kind: str, says: str) -> None:
    path = _bad_inputs(tmp_path)[kind]
    result = runner.invoke(app, ["clip-rate", str(path), "-c", "mxfp8_e4m3", "--out",
                                 str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and says in errors[0], errors
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["clip-rate", "cast-diff"])
def test_rows_without_totals_are_the_per_tensor_rows(name: str) -> None:
    """``rows(totals=False)`` (the monitor's) leaves out the rows over all tensors, a comparing
    measure's too (cast-diff's came back all the same)."""
    from driftcli.io.readers.memory import Held
    from driftcli.measures.common import ALL_TENSORS

    m = MEASURES[name]
    held = Held("src", {"a": torch.randn(8, 64, generator=torch.Generator().manual_seed(3)),
                        "b": torch.ones(4, 32)})
    found = scan([held], ["mxfp8_e4m3", "nvfp4"], options=m.scan_options(None))
    every = m.rows(found)
    assert any(r.tensor == ALL_TENSORS for r in every)
    per_tensor = m.rows(found, totals=False)
    assert per_tensor and per_tensor == [r for r in every if r.tensor != ALL_TENSORS]
