"""Scaled casts: spec grammar, presets, scale rules, edge cases, the seed study's clipping."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

import driftcli as drift
from driftcli.casts.quantization import QuantInfo, quantize
from driftcli.cli import app
from driftcli.errors import CastSpecError
from driftcli.records.cast import Cast, Scaling
from driftcli.records.formats import FORMATS
from driftcli.records.modes import Granularity, Overflow, Rounding, ScaleRule
from driftcli.records.presets import PRESETS
from driftcli.records.recipes import IMPLEMENTATION_PRESETS


def info(x: torch.Tensor, spec: str, **kw: object) -> QuantInfo:
    out = quantize(x, spec, return_info=True, **kw)
    assert isinstance(out, QuantInfo)
    return out


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_its_canonical_spec(name: str) -> None:
    cast = drift.parse_cast(name)
    assert drift.parse_cast(str(cast)) == cast


ELEMENTS = [n for n, f in FORMATS.items() if f.bits <= 8 and f.signed]
SCALES = ["float8_e8m0fnu", "float8_e4m3fn", "float32", "bfloat16"]


@st.composite
def casts(draw: st.DrawFn) -> Cast:
    elem = FORMATS[draw(st.sampled_from(ELEMENTS))]
    rounding = draw(st.sampled_from(list(Rounding)))
    overflow = draw(st.sampled_from(list(Overflow)))
    gran = draw(st.sampled_from(list(Granularity)))
    if gran is Granularity.NONE:
        return Cast(elem, Scaling(), rounding, overflow)
    size = draw(st.integers(1, 64)) if gran in (Granularity.BLOCK, Granularity.TILE) else 0
    rules = [r for r in ScaleRule if r is not ScaleRule.TWO_LEVEL or size]
    rule = draw(st.sampled_from(rules))
    headroom = draw(st.integers(0, 4)) if rule is ScaleRule.FLOOR else 0
    # two-level needs scale max x element max within float32 (tested elsewhere to raise)
    scale = FORMATS[draw(st.sampled_from(
        SCALES[1:2] if rule is ScaleRule.TWO_LEVEL else SCALES))]
    return Cast(elem, Scaling(gran, size, scale, rule, headroom), rounding, overflow)


@given(casts())
def test_any_cast_round_trips(cast: Cast) -> None:
    assert drift.parse_cast(str(cast)) == cast


def test_defaults_and_order_free_parts() -> None:
    assert str(drift.parse_cast("float8_e4m3fn:block32")) == str(PRESETS["mxfp8_e4m3"][0])
    assert drift.parse_cast("float8_e4m3fn:rtz:block32:ieee") == drift.parse_cast(
        "float8_e4m3fn:block32:float8_e8m0fnu:floor:rtz:ieee")
    assert str(drift.parse_cast("float8_e4m3fn:tensor")) == str(PRESETS["fp8_e4m3"][0])
    assert str(drift.parse_cast("float4_e2m1fn:block16:two-level")) == str(PRESETS["nvfp4"][0])


@pytest.mark.parametrize(("spec", "part"), [
    ("float8_e4m3fn:blok32", "'blok32'"), ("float8_e4m3fn:floor", "'floor'"),
    ("float8_e4m3fn:block32:ceil+1", "'ceil+1'"), ("float8_e4m3fn:block32:rne:rtz", "'rtz'"),
    ("fp8_e4m", "'fp8_e4m'"), ("e9m3:block32", "e9m3"), ("float8_e4m3fn:block0", "size"),
])
def test_bad_specs_name_the_bad_part(spec: str, part: str) -> None:
    with pytest.raises(CastSpecError) as err:
        drift.parse_cast(spec)
    assert part in str(err.value) and spec in str(err.value)


def test_two_level_needs_a_scale_format_that_fits() -> None:
    with pytest.raises(CastSpecError, match="fits a float32"):
        drift.parse_cast("float4_e2m1fn:block16:float8_e8m0fnu:two-level")


def test_clipping_and_clamping_read_the_right_limits() -> None:
    """int8 holds -128, so -127.6 is not clipped; a NaN block's scale is not 'clamped'; a block
    scale of 448.00003 that rounds to 448 did not clamp."""
    assert not bool(info(torch.tensor([-127.6, 100.0] + [0.0] * 30), "mxint8").clipped[0])
    assert not bool(info(torch.tensor([float("nan")] + [1e-45] * 31),
                         "mxfp8_e4m3").scale_clamped[0])
    z = torch.full((16,), 0.001)
    z[0] = 0.027575340121984482
    assert not bool(info(z, "nvfp4").scale_clamped[0])
    two = torch.cat([torch.full((16,), 1.0), torch.full((16,), 1e-8)])  # 2nd block: 4.5e-6 < 2**-9
    assert info(two, "nvfp4").scale_clamped.tolist() == [False, True]


def test_bad_specs_exit_2_from_the_cli() -> None:
    result = CliRunner().invoke(app, ["formats", "--cast", "float8_e4m3fn:blok32"])
    assert result.exit_code == 2
    assert result.output.startswith("error: cast spec 'float8_e4m3fn:blok32': unknown part")


def test_presets_listing() -> None:
    result = CliRunner().invoke(app, ["formats", "--presets", "--json"])
    rows = {r["preset"]: r for r in __import__("json").loads(result.output)}
    assert rows["mxfp8_e4m3_floor+1"]["spec"] == (
        "float8_e4m3fn:block32:float8_e8m0fnu:floor+1:rne:saturate")
    assert set(rows) == set(PRESETS) | set(IMPLEMENTATION_PRESETS)
    assert rows["torchao/mxfp8"]["implementation"] == "torchao" and rows["torchao/mxfp8"][
        "source"] == IMPLEMENTATION_PRESETS["torchao/mxfp8"].source


def test_fp4_block_below_8_gets_scale_1_and_clips_to_6() -> None:
    """The float32-log2 shortcut rounds log2(7.9999995) up to 3 and picks 2**1; the bits say 2."""
    below_8 = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0))
    x = torch.zeros(32)
    x[0] = below_8
    assert math.log2(below_8.float().item()) < 3 and torch.log2(below_8).item() == 3.0
    i = info(x, "mxfp4_e2m1")
    assert i.scales.tolist() == [1.0]
    assert i.values[0].item() == 6.0 and bool(i.clipped[0])


def test_seed_study_mechanism_tanh_outputs_clip_under_floor_only() -> None:
    """tanh outputs pile up just under 1.0: under the OCP floor rule a block whose amax is in
    [0.5, 1) gets the scale 2**(-1-8), so every |x| above 448/512 = 0.875 clips."""
    gen = torch.Generator().manual_seed(0)
    x = torch.tanh(3 * torch.randn(256, 1024, generator=gen))
    floor = info(x, "mxfp8_e4m3")
    share = floor.clipped.float().mean().item()
    # tanh(3z) is exactly 1.0 in float32 for |z| > 3: such a block's scale is 2**-8, nothing clips
    blocks = x.reshape(-1, 32)
    bound = torch.where(blocks.abs().amax(dim=1, keepdim=True) < 1, 0.875, 1.75)
    expected = (blocks.abs() > bound).float().mean().item()
    assert share == expected and 0.59 < share < 0.60  # 59.4% of all elements clip
    for fixed in ("mxfp8_e4m3_floor+1", "mxfp8_e4m3_ceil"):
        assert int(info(x, fixed).clipped.sum()) == 0
    # the clipped error is one-way: the cast shrinks the tensor along itself
    e = floor.values - x
    assert (e * x).sum() < 0


def test_zero_nan_and_clamped_blocks() -> None:
    x = torch.randn(4, 32)
    x[0] = 0.0
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3] = 1e-45  # float32 subnormals: floor asks for 2**-149 - 2 < 2**-127
    i = info(x, "mxfp8_e4m3")
    assert torch.equal(i.values[0], torch.zeros(32)) and i.scales[0].item() == 2.0**-127
    assert i.values[1].isnan().all() and i.values[2].isnan().all()
    assert i.nonfinite_blocks.tolist() == [False, True, True, False]
    assert i.scale_clamped.tolist() == [False, False, False, True]
    assert int(i.nonfinite.sum()) == 2 and i.scales[1:3].isnan().all()
    assert i.underflowed[3].all()


def test_partial_blocks_tiles_channels_and_ranks() -> None:
    x = torch.randn(3, 45)
    i = info(x, "mxfp8_e4m3")
    assert i.values.shape == x.shape and i.scales.shape == (6,)
    big = x.clone()
    big[0, 40] = 1000.0  # in the partial block: only that block's scale moves
    j = info(big, "mxfp8_e4m3")
    assert torch.equal(j.values[:, :32], i.values[:, :32])
    assert torch.equal(j.scales[2:], i.scales[2:])
    tiles = info(torch.randn(20, 35), "nvfp4_2d")
    assert tiles.scales.shape == (2 * 3,)
    ch = info(torch.randn(5, 7), "float8_e4m3fn:channel:amax", axis=0)
    assert ch.scales.shape == (7,)
    assert quantize(torch.tensor(3.0), "mxfp8_e4m3").shape == ()
    assert quantize(torch.zeros(0, 5), "nvfp4").shape == (0, 5)
    assert quantize(torch.randn(2, 3, 64), "mxfp4_e2m1", axis=1).shape == (2, 3, 64)


def test_bfloat16_inputs_come_back_as_bfloat16_exactly_widened() -> None:
    x = torch.randn(8, 64).bfloat16()
    q = quantize(x, "mxfp8_e4m3")
    assert q.dtype == torch.bfloat16
    assert torch.equal(q.float(), quantize(x.float(), "mxfp8_e4m3"))


def test_nvfp4_two_level_scales() -> None:
    x = torch.randn(4, 64)
    i = info(x, "nvfp4")
    amax = x.abs().max()
    assert i.tensor_scale == (amax / torch.tensor(2688.0)).item()
    block_amax = x.reshape(-1, 16).abs().amax(dim=1)
    block = drift.round_to_format((block_amax / 6) / torch.tensor(i.tensor_scale),
                                  "float8_e4m3fn")
    assert torch.equal(i.scales.float(), block * torch.tensor(i.tensor_scale))


def test_stochastic_casts_need_bits_and_are_reproducible() -> None:
    x = torch.randn(64)
    with pytest.raises(drift.DriftError, match="seed= or random_bits="):
        quantize(x, "mxfp4_e2m1:sr")
    assert drift.parse_cast("mxfp4_e2m1:sr:ieee") == drift.parse_cast(
        "float4_e2m1fn:block32:float8_e8m0fnu:floor:sr:ieee")
    with pytest.raises(CastSpecError, match="a preset fixes its scaling"):
        drift.parse_cast("mxfp4_e2m1:block16")
    a = quantize(x, "float4_e2m1fn:block32:sr", seed=1)
    assert torch.equal(a, quantize(x, "float4_e2m1fn:block32:sr", seed=1))


@pytest.mark.parametrize(("typed", "first"), [("fp8", "fp8_e4m3"), ("mxfp4", "mxfp4_e2m1"),
                                              ("nvfp", "nvfp4"), ("float8_e4m3", "float8_e4m3fn")])
def test_an_unknown_name_suggests_what_it_begins_first(typed: str, first: str) -> None:
    """``fp8`` is the start of fp8_e4m3: that comes before fp16, which is closer in spelling."""
    with pytest.raises(CastSpecError, match=f"did you mean {first}[,?]"):
        drift.parse_cast(typed)


def test_an_ambiguous_custom_name_is_refused_as_a_cast() -> None:
    result = CliRunner().invoke(app, ["formats", "--cast", "e4m3"])
    assert result.exit_code == 2
    assert "'e4m3' is ambiguous" in result.output and "float8_e4m3fn" in result.output
    assert "e4m3b7" in result.output and len(result.output.strip().splitlines()) == 1


def test_a_librarys_nvfp4_order_is_refused_on_other_formats() -> None:
    """torchao's and Transformer Engine's two-level orders carry NVFP4's constants (6, 448,
    2688) and round the block scale as E4M3: on other formats they would be silently wrong."""
    from driftcli.errors import CastSpecError
    from driftcli.records.castspec import parse_cast

    for spec in ("float8_e4m3fn:block16:float8_e4m3fn:two-level:two=te-4over6-mae",
                 "torchao/nvfp4:ue5m3", "te/nvfp4:ue4m3",
                 "float6_e2m3fn:block16:float8_e4m3fn:two-level:two=te"):
        with pytest.raises(CastSpecError, match="NVFP4 order, written for float4_e2m1fn "
                                                "elements under float8_e4m3fn block scales"):
            parse_cast(spec)
    assert str(parse_cast("nvfp4:ue5m3")).endswith("ue5m3:two-level:rne:saturate")
    assert "two=te-4over6-mae" in str(parse_cast("te/nvfp4_4over6"))
