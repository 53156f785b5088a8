"""HiFloat8, the tapered kind: every code against the paper's layout (encoded here a second
way), the conformance with a transcription of Huawei's cast on every code and every float32
rounding boundary, both back-ends bit-equal, and verify-formats catching planted faults."""

from __future__ import annotations

import itertools
import struct
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kernel_paths import kernel_path
from test_p3109 import _failures
from typer.testing import CliRunner

from driftcli import FORMATS, oracle
from driftcli.casts import codec, rounding
from driftcli.cli import app
from driftcli.io.tables import read_table
from driftcli.records.formats import Exact, Format, FormatKind, Kind, get_format
from driftcli.records.modes import Overflow, Rounding
from driftcli.verify import codes as codes_suite

HIF8 = FORMATS["hifloat8"]
MAX_CODE, INF_CODE, NAN_CODE = 0x6E, 0x6F, 0x80


def _paper_code(exponent: int, fraction: int) -> int:
    """The magnitude code of ``(1 + fraction / 2**M) * 2**exponent`` laid out as the HiFloat8
    paper (arXiv 2409.16626, Table 1) draws it: dot field, then the exponent as sign and
    magnitude with the magnitude's top bit implicit, then M fraction bits; M = 3 for
    ``|E| <= 3``, 2 for 4..7, 1 for 8..15."""
    size, sign = abs(exponent), int(exponent < 0)
    if size == 0:
        return 0b0001 << 3 | fraction
    if size == 1:
        return 0b001 << 4 | sign << 3 | fraction
    if size <= 3:
        return 0b01 << 5 | sign << 4 | (size - 2) << 3 | fraction
    if size <= 7:
        return 0b10 << 5 | sign << 4 | (size - 4) << 2 | fraction
    return 0b11 << 5 | sign << 4 | (size - 8) << 1 | fraction


def _paper_width(size: int) -> int:
    return 3 if size <= 3 else 2 if size <= 7 else 1


def _paper_values() -> dict[int, Fraction]:
    """Every positive finite magnitude code and its value, from the paper's layout: the
    normals of |E| <= 15 (E = 15 with fraction 1 is +inf), the denormals 2**(m - 23)."""
    table = {m: Fraction(2) ** (m - 23) for m in range(1, 8)}
    for exponent in range(-15, 16):
        width = _paper_width(abs(exponent))
        for fraction in range(1 << width):
            value = (1 + Fraction(fraction, 1 << width)) * Fraction(2) ** exponent
            table[_paper_code(exponent, fraction)] = value
    del table[INF_CODE]
    return table


def test_every_code_matches_the_papers_layout() -> None:
    paper = _paper_values()
    assert len(paper) == 126 and max(paper.values()) == 2**15
    for code, value in HIF8.values():
        magnitude = code & 0x7F
        if code == NAN_CODE:
            assert value.kind is Kind.NAN
        elif magnitude == INF_CODE:
            assert value == Exact(Kind.INF, code > 0x7F)
        elif magnitude == 0:
            assert value == Exact.of(0)
        else:
            assert value == Exact(Kind.FINITE, code > 0x7F, paper[magnitude]), hex(code)


def test_the_record_says_what_the_paper_says() -> None:
    assert HIF8.kind is FormatKind.TAPERED and HIF8.bits == 8 and not HIF8.has_neg_zero
    assert (HIF8.max, HIF8.min, HIF8.smallest_subnormal) == (2**15, -(2**15), Fraction(1, 2**22))
    assert (HIF8.smallest_normal, HIF8.emin, HIF8.emax, HIF8.qmin, HIF8.qmax) == (
        Fraction(1, 2**15), -15, 15, -22, 14)
    assert HIF8.eps == Fraction(1, 8) and HIF8.inf_code == INF_CODE
    assert [HIF8.mbits_at(e) for e in (-30, -22, -16, -15, -8, -7, -4, -3, 0, 3, 4, 8, 15, 40)] \
        == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 2, 1, 1, 1]
    assert get_format("hifloat8") is HIF8
    # every value is a float16's (2**-22 on its subnormal grid), not an E4M3's or E5M2's; it
    # holds E2M1's but not E4M3's (448 would need 3 mantissa bits at 2**8, where it has 1)
    assert [FORMATS[n].contains(HIF8) for n in ("float32", "bfloat16", "float16",
                                                "float8_e4m3fn", "float8_e5m2")] == [
        True, True, True, False, False]
    assert HIF8.contains(FORMATS["float4_e2m1fn"]) and not HIF8.contains(FORMATS["float8_e4m3fn"])
    assert rounding.round_to_format(torch.tensor([1.0], dtype=torch.float16), HIF8).dtype \
        == torch.float16


def _round(x: float, mode: Rounding, policy: Overflow) -> tuple[str, float]:
    exact = oracle.rounding.round_exact(HIF8, Exact(Kind.INF, x < 0) if abs(x) == float("inf")
                               else Exact.of(Fraction(x)), mode, policy)
    got = rounding.round_to_format(torch.tensor([x]), HIF8, rounding=mode, overflow=policy)
    return str(exact), float(got[0])


@pytest.mark.parametrize("path", ["torch", "jit"])
@pytest.mark.parametrize(("x", "mode", "policy", "want"), [
    # the tie between the denormals 2**-17 (code 6) and 2**-16 (code 7): even code, or away
    (1.5 * 2**-17, Rounding.RNE, Overflow.SATURATE, 2.0**-17),
    (1.5 * 2**-17, Rounding.RNA, Overflow.SATURATE, 2.0**-16),
    # 2**-16 (code 7) | 2**-15 (0x7E): the even code is the larger
    (1.5 * 2**-16, Rounding.RNE, Overflow.SATURATE, 2.0**-15),
    # below the smallest denormal: half of it is the tie with 0 (even)
    (2.0**-23, Rounding.RNE, Overflow.SATURATE, 0.0),
    (2.0**-23, Rounding.RNA, Overflow.SATURATE, 2.0**-22),
    (-(2.0**-24), Rounding.RDOWN, Overflow.SATURATE, -(2.0**-22)),
    # 3 mantissa bits at 1, 2 at 16, 1 at 256: the spacing tapers
    (1.0625, Rounding.RNE, Overflow.SATURATE, 1.0),
    (1.0625, Rounding.RNA, Overflow.SATURATE, 1.125),
    (17.0, Rounding.RTZ, Overflow.SATURATE, 16.0),
    (17.0, Rounding.RUP, Overflow.SATURATE, 20.0),
    (300.0, Rounding.RNE, Overflow.SATURATE, 256.0),
    (330.0, Rounding.RNE, Overflow.SATURATE, 384.0),
    # overflow: 2**15 is the largest finite; 1.25 * 2**15 is the tie with the inf code's place
    (40960.0, Rounding.RNE, Overflow.IEEE, 32768.0),
    (40960.0, Rounding.RNA, Overflow.IEEE, float("inf")),
    (1e6, Rounding.RNE, Overflow.SATURATE, 32768.0),
    (-1e6, Rounding.RTZ, Overflow.IEEE, -32768.0),
    (float("-inf"), Rounding.RNE, Overflow.SATURATE, -32768.0),
    (float("inf"), Rounding.RNE, Overflow.IEEE, float("inf")),
    # no -0: the sign of a zero result is lost
    (-(2.0**-30), Rounding.RNE, Overflow.SATURATE, 0.0),
])
def test_rounding_modes_and_specials(path: str, x: float, mode: Rounding, policy: Overflow,
                                     want: float) -> None:
    with kernel_path(path):
        exact, got = _round(x, mode, policy)
    assert exact == (str(Exact.of(Fraction(want))) if abs(want) != float("inf")
                     else ("-inf" if want < 0 else "+inf"))
    assert got == want and str(got)[0] == str(want)[0]


def test_both_back_ends_give_the_same_bits() -> None:
    """2**17 float32s (every top half-word with the low half-word 0, which holds every tie of
    an 8-bit grid, and 0x5555) under every deterministic mode and both policies."""
    hi = torch.arange(1 << 16, dtype=torch.int32) << 16
    x = torch.cat([hi, hi | 0x5555]).view(torch.float32)
    for mode in (Rounding.RNE, Rounding.RNA, Rounding.RTZ, Rounding.RUP, Rounding.RDOWN):
        for policy in Overflow:
            outs = []
            for path in ("torch", "jit"):
                with kernel_path(path):
                    outs.append(rounding.round_to_format(x, HIF8, rounding=mode, overflow=policy))
            assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))


def test_codes_round_trip_through_the_codec() -> None:
    codes = torch.arange(256)
    values = codec.decode(codes, HIF8)
    assert torch.equal(codec.encode(values, HIF8), codes)
    assert codec.nan_code(HIF8) == NAN_CODE and values[INF_CODE] == float("inf")


# --- conformance: a transcription of Huawei's cast --------------------------------------------
#
# Huawei's float32 -> HiFloat8 cast, AMCT's amct_pytorch/experimental/hifloat8/hifloat8_cast.cpp
# (hicann/amct, commit 30e0b5c12f2b2b697cb316f349d2aed4f0e65f29: FpNToHiF8, lines 183-239, and
# RoundHiF8, lines 168-180), written again from what it does: ±0 -> 0x00; NaN -> 0x80; ±inf ->
# ±0x6F; an exponent below -23 -> 0x00 (no sign), exactly -23 -> ±2**-22; an exponent of 15 or
# more -> ±0x6E (saturates); the denormal binades -22..-16 go up one code when the first
# fraction bit is set (7 + 1 is 2**-15, 0x7E); elsewhere the fraction keeps M bits and the next
# bit rounds up, a carry past the binade moving to the next exponent (ties away from zero).


def _huawei_cast(x: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    sign, exp_field, frac = bits >> 31, (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exp_field == 0xFF:
        return NAN_CODE if frac else sign << 7 | INF_CODE
    if exp_field == 0:  # zero, or a float32 subnormal (far below 2**-23)
        return 0
    exponent = exp_field - 127
    if exponent < -23:
        return 0
    if exponent == -23:
        return sign << 7 | 0x01
    if exponent >= 15:
        return sign << 7 | MAX_CODE
    if exponent < -15:
        code = exponent + 23 + (frac >> 22)
        return sign << 7 | (0x7E if code >= 8 else code)
    width = _paper_width(abs(exponent))
    top = frac >> (23 - width - 1)  # the kept bits and the round bit
    if top == (1 << (width + 1)) - 1:  # rounds up past the binade
        exponent, fraction = exponent + 1, 0
    else:
        fraction = (top + 1) >> 1
    return sign << 7 | _paper_code(exponent, fraction)


def _boundaries() -> torch.Tensor:
    """Every positive value, the midpoints between neighbours, and the float32s either side of
    each; past the top, below the bottom; then all of them negated, and the specials."""
    values = sorted({float(v.mag) for _, v in HIF8.values() if v.kind is Kind.FINITE})
    points = [*values, 1.25 * 2**15, 2.0**16, 3.0e38, 2.0**-23, 2.0**-24, 1e-45]
    points += [(a + b) / 2 for a, b in itertools.pairwise(values)]
    mids = torch.tensor(points, dtype=torch.float32)
    up, down = torch.full_like(mids, float("inf")), torch.zeros_like(mids)
    x = torch.cat([mids, torch.nextafter(mids, up), torch.nextafter(mids, down)])
    return torch.cat([x, -x, torch.tensor([0.0, -0.0, float("inf"), float("-inf"),
                                           float("nan")])])


@pytest.mark.parametrize("path", ["torch", "jit"])
def test_huaweis_cast_is_rna_with_saturation_but_for_infinities(path: str) -> None:
    """Huawei's cast against drift's ``rna``/``saturate`` on every code's value and every
    float32 rounding boundary: the same code everywhere but ±inf, which Huawei keeps (0x6F,
    0xEF) where drift's saturate clamps them to ±max (drift's ``ieee`` keeps them, and sends
    a finite overflow to ±inf, where Huawei saturates)."""
    x = _boundaries()
    assert len(x) == 1559  # docs/formats.md#hifloat8
    want = torch.tensor([_huawei_cast(v) for v in x.tolist()])
    with kernel_path(path):
        got = codec.encode(rounding.round_to_format(x, HIF8, rounding=Rounding.RNA,
                                                    overflow=Overflow.SATURATE), HIF8)
    differ = x[want != got].tolist()
    assert sorted(differ) == [float("-inf"), float("inf")]
    assert want[x.isinf()].tolist() == [INF_CODE, 0x80 | INF_CODE]
    # every code's own value is a fixed point of the cast
    values = codec.decode(torch.arange(256), HIF8)
    finite = values.isfinite()
    assert [_huawei_cast(v) for v in values[finite].tolist()] == \
        torch.arange(256)[finite].tolist()


def test_the_transcription_would_see_a_planted_fault() -> None:
    """The transcription rounding a denormal with RNE's rule (the tie 1.5 * 2**-17 staying at
    the even code 6): the comparison reports it."""
    x = torch.tensor([1.5 * 2**-17])
    drift_code = int(codec.encode(rounding.round_to_format(x, HIF8, rounding=Rounding.RNE),
                                  HIF8)[0])
    assert drift_code == 6 and _huawei_cast(float(x[0])) == 7


# --- verify-formats ------------------------------------------------------------------------


def test_a_planted_wrong_decoded_value_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The codec reading 0x7E (2**-15, the smallest normal) as 2**-16, the denormal below it:
    the codes suite reports that one code (its decoding, and its round trip in each of the 12
    cells of mode and policy), and nothing on another format."""
    real = codec.decode

    def wrong(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
        out = real(codes, fmt)
        if get_format(fmt).kind is FormatKind.TAPERED:
            out = torch.where(codes == 0x7E, 2.0**-16, out)
        return out

    monkeypatch.setattr(codes_suite, "codec", SimpleNamespace(
        decode=wrong, encode=codec.encode, nan_code=codec.nan_code))
    found = _failures("hifloat8", "float4_e2m1fn")
    assert found == {("hifloat8", "decode"): 1, ("hifloat8", "roundtrip"): 12}


@pytest.mark.parametrize("path", ["torch", "jit"])
def test_a_planted_wrong_rounding_boundary_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                     path: str) -> None:
    """The kernel on one back-end rounding binade 4 (16..32) with 3 mantissa bits, the width of
    binade 3, not 2: its boundaries move to the finer grid; the pairs suite fails there, on
    hifloat8 only."""
    planted = rounding.Target.of(HIF8)
    index = 4 - planted.emin
    widths = (*planted.widths[:index], 3, *planted.widths[index + 1:])
    lo, hi = rounding.taper_masks(planted.mbits, widths)
    name = "_kernel" if path == "torch" else "jit_params"
    real = getattr(rounding, name)

    def wrong(*args: object, **kw: object) -> object:
        if kw["tgt"] == planted:
            kw["tgt"] = replace(planted, widths=widths, taper_lo=lo, taper_hi=hi)
        return real(*args, **kw)

    monkeypatch.setattr(rounding, name, wrong)
    with kernel_path(path):
        found = _failures("hifloat8", "float4_e2m1fn")
    assert {f for f, _ in found} == {"hifloat8"}
    assert found.get(("hifloat8", "product"), 0) > 0


@pytest.mark.slow
def test_verify_formats_passes_on_hifloat8(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["verify-formats", "--out", str(tmp_path), "-j", "1",
                                      "--quick", "-f", "hifloat8"])
    df = read_table(tmp_path / "verify-formats.parquet")[0]
    summary = df[df.kind == "summary"]
    assert result.exit_code == 0 and int(summary.n_failed.sum()) == 0
    assert set(summary.format) == {"hifloat8"} and int(summary.n_checked.sum()) == 180_906
