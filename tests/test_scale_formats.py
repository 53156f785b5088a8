"""UE5M3 and UE4M3, the block-scale formats after OCP: every code against a transcription of
AMD ALTO's UE5M3 definition, its cast on every float32 rounding boundary, UE4M3 as E4M3 with
the sign ignored, both as the block scale of NVFP4 on each back-end, and a planted fault that
verify-formats catches."""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import replace
from fractions import Fraction
from functools import cache
from pathlib import Path

import pytest
import torch
from kernel_paths import PATHS, kernel_path
from typer.testing import CliRunner

from driftcli import FORMATS
from driftcli.casts import rounding
from driftcli.casts.quantization import quantize
from driftcli.cli import app
from driftcli.errors import CastSpecError
from driftcli.io.tables import read_table
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import Kind
from driftcli.records.modes import Overflow, ScaleRule
from driftcli.verify import Plan, check_cast
from driftcli.verify.blocks import rule_casts

UE5M3, UE4M3, E4M3 = FORMATS["ue5m3"], FORMATS["ue4m3"], FORMATS["float8_e4m3fn"]

# AMD ALTO, alto/kernels/fp4/fp4_common/ue5m3_ops.py at 74e251d (last changed in 1b199cc),
# lines 13-25 (the definition) and 105-180 (f32_to_ue5m3_uint8):
ALTO_BIAS, ALTO_MAX, ALTO_NAN_CODE = 15, Fraction(114688), 0xFF


def alto_decode(code: int) -> Fraction | None:
    """ALTO's table, transcribed: 0x00 is 0, 0x01..0x07 are mant/8 * 2^-14, 0x08..0xFE are
    (1 + mant/8) * 2^(exp - 15), 0xFF is NaN (None here). Written from the text, not from
    driftcli.records.formats."""
    if code == ALTO_NAN_CODE:
        return None
    exp, mant = code >> 3, code & 7
    if exp == 0:
        return Fraction(mant, 8) * Fraction(1, 2**14)
    return (1 + Fraction(mant, 8)) * Fraction(2) ** (exp - ALTO_BIAS)


@cache
def _alto_grid() -> list[Fraction]:
    """The 255 finite codes' values, ascending (code order)."""
    return [v for c in range(255) if (v := alto_decode(c)) is not None]


def alto_cast(x: float) -> Fraction | None:
    """ALTO's f32_to_ue5m3_uint8 then decode, transcribed: NaN, ±inf and anything strictly
    above 114688 give the NaN code; a negative finite value clamps to 0; the rest rounds to
    nearest, ties to even, onto the 255 finite codes."""
    if math.isnan(x) or math.isinf(x) or Fraction(x) > ALTO_MAX:
        return None
    v = max(Fraction(x), Fraction(0))
    grid = _alto_grid()
    i = bisect.bisect_right(grid, v) - 1
    below = grid[i]
    if below == v or i == 254:
        return below
    above = grid[i + 1]
    if v - below != above - v:
        return below if v - below < above - v else above
    return below if i % 2 == 0 else above  # a tie: the even code (its mantissa's last bit)


def _boundaries() -> list[float]:
    """Every UE5M3 value, every midpoint between neighbours, and the float32s on either side of
    each (every float32 rounding boundary of the format), both signs; values past the top;
    zeros, infinities and NaN."""
    values = sorted(v for c in range(255) if (v := alto_decode(c)) is not None)
    points = [*values, *((a + b) / 2 for a, b in itertools.pairwise(values))]
    points += [ALTO_MAX + 2**12, ALTO_MAX + 2**13, Fraction(2**17), Fraction(2**100)]
    f32 = torch.tensor([float(p) for p in points], dtype=torch.float32)
    inf = torch.tensor(float("inf"))
    near = torch.cat([f32, torch.nextafter(f32, inf), torch.nextafter(f32, -inf)])
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    return torch.cat([near, -near, specials]).tolist()


def test_ue5m3_decodes_as_altos_definition_on_every_code() -> None:
    for code, value in UE5M3.values():
        expected = alto_decode(code)
        if expected is None:
            assert value.kind is Kind.NAN, code
        else:
            assert value.kind is Kind.FINITE and not value.negative and value.mag == expected
    assert (UE5M3.max, UE5M3.smallest_normal, UE5M3.smallest_subnormal) == (
        114688, Fraction(1, 2**14), Fraction(1, 2**17))
    assert UE5M3.min == 0 and UE5M3.has_zero and not UE5M3.has_inf


@pytest.mark.parametrize("path", PATHS)
def test_ue5m3_cast_matches_alto_on_every_float32_boundary(path: str) -> None:
    """drift's ue5m3 (rne, saturate) is ALTO's cast on every input but those ALTO sends to
    NaN: values above 114688 (drift saturates to 114688, as NVIDIA's satfinite convert) and
    ±inf (drift: 114688 and 0)."""
    xs = _boundaries()
    with kernel_path(path):
        got = quantize(torch.tensor(xs, dtype=torch.float32), Cast(UE5M3)).tolist()
    differ = []
    for x, g in zip(xs, got, strict=True):
        want = alto_cast(x)
        if (want is None and math.isnan(g)) or (want is not None and g == float(want)):
            continue
        differ.append((x, g))
    assert len(xs) == (255 + 254 + 4) * 3 * 2 + 5  # the sweep is whole
    above = [(x, g) for x, g in differ if 114688 < x < math.inf]
    assert len(above) == len(differ) - 2 and all(g == 114688.0 for _, g in above)
    assert sorted(g for x, g in differ if math.isinf(x)) == [0.0, 114688.0]
    # the values ALTO sends to NaN that drift rounds back to its max: 114688 < x < 118784
    assert {x for x, _ in above} >= {float(torch.nextafter(torch.tensor(114688.0),
                                                           torch.tensor(math.inf)))}


@pytest.mark.parametrize("path", PATHS)
def test_an_unsigned_format_with_a_zero_clamps_negatives_to_zero(path: str) -> None:
    """Negative inputs to UE5M3 and UE4M3 give 0 under saturate (ALTO: "finite negative inputs
    clamp to 0") and NaN under ieee; E8M0, which has no zero, keeps its smallest value."""
    x = torch.tensor([-3.0, -1e-30, -448.0, float("-inf")])
    with kernel_path(path):
        for fmt in (UE5M3, UE4M3):
            assert quantize(x, Cast(fmt)).tolist() == [0.0] * 4
            assert quantize(x, Cast(fmt, overflow=Overflow.IEEE)).isnan().all()
        e8m0 = quantize(x, Cast(FORMATS["float8_e8m0fnu"])).tolist()
    assert e8m0 == [2.0**-127] * 4


def test_ue4m3_is_e4m3_with_the_sign_ignored() -> None:
    """Every byte read by tcgen05's mxf4nvf4 as UE4M3 (bit 7 dropped) is |E4M3| of that byte."""
    assert UE4M3.bits == 7 and UE4M3.max == 448 and UE4M3.min == 0
    for byte in range(256):
        ue, e = UE4M3.decode(byte & 0x7F), E4M3.decode(byte)
        assert ue.kind is e.kind and (ue.kind is Kind.NAN or ue.mag == e.mag), byte
        assert not ue.negative


@pytest.mark.parametrize("path", PATHS)
def test_nvfp4_with_ue4m3_scales_is_nvfp4(path: str) -> None:
    """Block scales are positive, so E4M3 and UE4M3 hold the same ones: the same bits."""
    gen = torch.Generator().manual_seed(29)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-30, 30, (64, 1),
                                                                       generator=gen).float())
    with kernel_path(path):
        assert torch.equal(quantize(x, "nvfp4:ue4m3").view(torch.int32),
                           quantize(x, "nvfp4").view(torch.int32))
        wide = quantize(x, "nvfp4:ue5m3")
    assert not torch.equal(wide, quantize(x, "nvfp4"))  # another scale grid: other values


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale", ["ue5m3", "ue4m3"])
def test_two_level_casts_with_the_new_scales_agree_with_the_oracle(path: str, scale: str) -> None:
    c = next(c for c in rule_casts(FORMATS["float4_e2m1fn"], ScaleRule.TWO_LEVEL)
             if c.scaling.scale_format == FORMATS[scale])
    with kernel_path(path):
        outcomes = list(check_cast(c.format, c, Plan(quick=True)))
    assert [o.check for o in outcomes] == ["blocks", "block scales"]
    assert all(o.n_checked > 1000 and o.n_failed == 0 for o in outcomes)


def test_a_preset_takes_another_scale_format() -> None:
    c = parse_cast("nvfp4:ue5m3:sr")
    assert str(c) == "float4_e2m1fn:block16:ue5m3:two-level:sr:saturate"
    assert parse_cast(str(c)) == c and c.scaling == replace(
        parse_cast("nvfp4").scaling, scale_format=UE5M3)
    with pytest.raises(CastSpecError, match="unscaled: it takes no scale format 'ue5m3'"):
        parse_cast("bf16:ue5m3")
    with pytest.raises(CastSpecError, match="a preset fixes its scaling"):
        parse_cast("nvfp4:block32")


@pytest.mark.parametrize("path", PATHS)
def test_a_planted_ue5m3_without_its_zero_is_caught(tmp_path: Path, path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel told UE5M3 has no zero (E8M0's clamp: 0 and negatives become 2^-17), on one
    back-end: verify-formats fails, on UE5M3 only."""
    planted = rounding.Target.of(UE5M3)
    name = "_kernel" if path == "torch" else "jit_params"
    real = getattr(rounding, name)

    def wrong(*args: object, **kw: object) -> object:
        if kw["tgt"] == planted:
            kw["tgt"] = replace(planted, has_zero=False)
        return real(*args, **kw)

    monkeypatch.setattr(rounding, name, wrong)
    with kernel_path(path):
        result = CliRunner().invoke(app, ["verify-formats", "--out", str(tmp_path), "-j", "1",
                                          "--quick", "-f", "ue5m3", "-f", "ue4m3"])
    assert result.exit_code == 1
    df = read_table(tmp_path / "verify-formats.parquet")[0]
    failing = df[(df.kind == "summary") & (df.n_failed > 0)]
    assert set(failing.format) == {"ue5m3"} and "float32-inputs" in set(failing.check)
