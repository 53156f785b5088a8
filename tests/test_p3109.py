"""IEEE P3109 ``binaryKpP``: every code of every format of K <= 8 against the interim report's
definition (derived here a second way), the spec names, the overflow modes, both back-ends
bit-equal, and verify-formats catching a planted fault in the new kind."""

from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kernel_paths import kernel_path
from typer.testing import CliRunner

from driftcli import FORMATS, oracle
from driftcli.casts import codec, rounding
from driftcli.cli import app
from driftcli.errors import FormatSpecError
from driftcli.io.tables import read_table
from driftcli.records.formats import Exact, Format, Kind, get_format, p3109
from driftcli.records.modes import Overflow, Rounding
from driftcli.verify import codes as codes_suite
from driftcli.verify.codes import check_codes
from driftcli.verify.compare import Plan
from driftcli.verify.pairs import check_pairs

runner = CliRunner()

# the formats the back-end tests sweep: every signed extended 8-bit one, an unsigned one and
# the 4-bit finite one (three of them are registered; the others resolve by name)
P3109_SWEPT = [*(f"binary8p{p}se" for p in range(1, 8)), "binary8p4ue", "binary4p2sf"]


def _report_value(k: int, p: int, signed: bool, extended: bool, code: int) -> Exact:
    """Code ``code`` of binaryKpP read as the P3109 interim report (2026) defines it, without
    drift's Format: the codes of one sign are the magnitudes in increasing order, the first
    2**(P-1) of them subnormal (spacing 2**(1 - bias - (P - 1))), then each further run of
    2**(P-1) codes one binade; 2**(K-1) is NaN (signed), 2**K - 1 is NaN (unsigned); in the
    extended domain the largest remaining code of each sign is infinite."""
    half = 1 << (k - 1)
    if (signed and code == half) or (not signed and code == (1 << k) - 1):
        return Exact(Kind.NAN)
    negative = signed and code > half
    magnitude = code - half if negative else code
    top = half - 1 if signed else (1 << k) - 2  # the largest magnitude that is not NaN
    if extended and magnitude == top:
        return Exact(Kind.INF, negative)
    bias = 2 ** (k - p) if not signed else (2 ** (k - p - 1) if k - p >= 1 else 0)
    run = 2 ** (p - 1)  # codes per binade
    binade, offset = divmod(magnitude, run)
    if binade == 0:  # subnormal (or zero)
        value = Fraction(offset, run) * Fraction(2) ** (1 - bias)
    else:
        value = (1 + Fraction(offset, run)) * Fraction(2) ** (binade - bias)
    return Exact(Kind.FINITE, negative, value)


def _every_small_format() -> list[tuple[int, int, bool, bool]]:
    return [(k, p, signed, extended) for k in range(2, 9) for signed in (True, False)
            for p in range(1, k + (not signed)) for extended in (True, False)]


def test_every_code_of_every_p3109_format_up_to_8_bits_matches_the_report() -> None:
    """Each (K, P, s/u, e/f) with K = 2..8: drift's decoding and codec both give the report's
    value on every code; 0 differences over all 13,320 codes."""
    compared, differences = 0, []
    for k, p, signed, extended in _every_small_format():
        fmt = p3109(k, p, signed, extended)
        assert fmt.bits == k
        fast_values = codec.decode(torch.arange(1 << k), fmt).tolist()
        for code in range(1 << k):
            want, got = _report_value(k, p, signed, extended, code), fmt.decode(code)
            same_fast = (want.kind is Kind.NAN and fast_values[code] != fast_values[code]) or \
                fast_values[code] == (float(want.value) if want.kind is Kind.FINITE
                                      else -float("inf") if want.negative else float("inf"))
            if (got != want and not (Kind.NAN is got.kind is want.kind)) or not same_fast:
                differences.append((fmt.name, hex(code), str(want), str(got)))
            compared += 1
    assert (compared, differences) == (13320, [])


def test_a_wrong_bias_in_the_second_derivation_would_be_seen() -> None:
    """The comparison above can fail: unsigned formats read with the signed bias differ."""
    fmt = p3109(8, 4, signed=False)
    assert fmt.decode(1).mag == Fraction(1, 2**18)
    assert _report_value(8, 4, True, True, 1).mag == Fraction(1, 2**10)


def test_spec_names_resolve_to_one_format() -> None:
    fmt = get_format("p3109:k8p4se")
    assert get_format("p3109_k8p4se") == fmt == get_format("Binary8p4se") == FORMATS["binary8p4se"]
    assert (fmt.ebits, fmt.mbits, fmt.bias, fmt.max, fmt.inf_code) == (4, 3, 8, 224, 0x7F)
    unsigned = get_format("p3109:k8p3uf")
    assert (unsigned.ebits, unsigned.bias, unsigned.max, unsigned.min) == (6, 32, 3 * 2**30, 0)
    assert "p3109:k8p4se" in FORMATS and "p3109:k8p8se" not in FORMATS


@pytest.mark.parametrize("spec", ["p3109:k8p8se", "p3109:k8p0ue", "p3109:k1p1uf",
                                  "p3109:k17p8se", "p3109:k16p1se"])
def test_impossible_p3109_specs_are_refused_naming_the_fix(spec: str) -> None:
    with pytest.raises(FormatSpecError, match=r"P3109 format 'binary\d+p\d+[su][ef]' is"):
        get_format(spec)
    result = runner.invoke(app, ["formats", "--cast", spec])
    assert result.exit_code == 2 and "binary" in result.output


def test_formats_json_names_the_kind() -> None:
    result = runner.invoke(app, ["formats", "--json"])
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert (rows["binary8p4se"]["kind"], rows["binary8p4se"]["max"]) == ("p3109", "224")
    assert rows["float8_e4m3fnuz"]["kind"] == "ieee-like"
    assert [n for n, r in rows.items() if r["kind"] == "p3109"] == [
        "binary8p3se", "binary8p4se", "binary4p2sf"]


def test_cast_specs_take_the_colon_spelling() -> None:
    result = runner.invoke(app, ["formats", "--cast", "p3109:k8p4se:block32:p3109:k8p1ue:sr"])
    assert result.exit_code == 0
    assert result.output.strip() == ("p3109:k8p4se:block32:p3109:k8p1ue:sr = "
                                     "binary8p4se:block32:binary8p1ue:floor:sr:saturate")


def test_the_signed_finite_8_bit_formats_are_the_fnuz_formats() -> None:
    """binary8p4sf and binary8p3sf decode as E4M3FNUZ and E5M2FNUZ, code for code."""
    for k, p, fnuz in ((8, 4, "float8_e4m3fnuz"), (8, 3, "float8_e5m2fnuz")):
        ours = [str(v) for _, v in p3109(k, p, extended=False).values()]
        assert ours == [str(v) for _, v in FORMATS[fnuz].values()]


def _round(fmt: Format, x: float, mode: Rounding, policy: Overflow) -> tuple[str, float]:
    """The oracle's and the fast path's rounding of one float."""
    exact = oracle.rounding.round_exact(fmt, Exact(Kind.INF, x < 0) if abs(x) == float("inf")
                               else Exact.of(Fraction(x)), mode, policy)
    got = rounding.round_to_format(torch.tensor([x]), fmt, rounding=mode, overflow=policy)
    return str(exact), float(got[0])


@pytest.mark.parametrize(("name", "x", "mode", "policy", "want"), [
    # SatFinite = saturate: finite and infinite overflow clamp to ±max
    ("binary8p4se", 1000.0, Rounding.RNE, Overflow.SATURATE, 224.0),
    ("binary8p4se", float("-inf"), Rounding.RNE, Overflow.SATURATE, -224.0),
    # OvfInf = ieee: beyond max after rounding is ±inf; 232 is the tie 224|240 and stays 224
    ("binary8p4se", 232.0, Rounding.RNE, Overflow.IEEE, 224.0),
    ("binary8p4se", 232.5, Rounding.RNE, Overflow.IEEE, float("inf")),
    ("binary8p4se", -1000.0, Rounding.RTZ, Overflow.IEEE, -224.0),  # as IEEE 754 and gfloat
    ("binary8p4se", float("inf"), Rounding.RTZ, Overflow.IEEE, float("inf")),
    # the finite domain has no inf: OvfInf gives NaN
    ("binary4p2sf", 4.0, Rounding.RNE, Overflow.IEEE, float("nan")),
    ("binary4p2sf", 4.0, Rounding.RNE, Overflow.SATURATE, 3.0),
    # no -0: a negative value that rounds to zero is +0
    ("binary8p4se", -2.0**-12, Rounding.RNE, Overflow.SATURATE, 0.0),
    # unsigned extended: +inf at 0xFE; a negative input is 0 (saturate) or NaN (ieee)
    ("binary8p4ue", 60000.0, Rounding.RNE, Overflow.IEEE, float("inf")),
    ("binary8p4ue", -1.0, Rounding.RNE, Overflow.SATURATE, 0.0),
    ("binary8p4ue", -1.0, Rounding.RNE, Overflow.IEEE, float("nan")),
])
def test_overflow_modes_and_specials(name: str, x: float, mode: Rounding, policy: Overflow,
                                     want: float) -> None:
    exact, got = _round(get_format(name), x, mode, policy)
    assert exact == ("nan" if want != want else str(Exact.of(Fraction(want))) if abs(want)
                     != float("inf") else ("-inf" if want < 0 else "+inf"))
    assert (got != got and want != want) or (got == want and str(got)[0] == str(want)[0])


@pytest.mark.parametrize("name", P3109_SWEPT)
def test_both_back_ends_give_the_same_bits(name: str) -> None:
    """2**17 float32s (every top half-word, with the low half-word 0, which holds the ties of
    an 8-bit grid, and 0x5555) under every deterministic mode and both policies: torch's
    kernel and numba's are bit-equal."""
    hi = torch.arange(1 << 16, dtype=torch.int32) << 16
    x = torch.cat([hi, hi | 0x5555]).view(torch.float32)
    fmt = get_format(name)
    for mode in (Rounding.RNE, Rounding.RNA, Rounding.RTZ, Rounding.RUP, Rounding.RDOWN):
        for policy in Overflow:
            outs = []
            for path in ("torch", "jit"):
                with kernel_path(path):
                    outs.append(rounding.round_to_format(x, fmt, rounding=mode, overflow=policy))
            assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))


@pytest.mark.parametrize("name", P3109_SWEPT)
def test_codes_round_trip_through_the_codec(name: str) -> None:
    fmt = get_format(name)
    codes = torch.arange(1 << fmt.bits)
    values = codec.decode(codes, fmt)
    back = codec.encode(values, fmt)
    nan = codec.nan_code(fmt)
    assert nan is not None and torch.equal(back, torch.where(torch.isnan(values), nan, codes))


@pytest.mark.parametrize("path", ["torch", "jit"])
def test_p1_ties_to_even_follow_the_code(path: str) -> None:
    """binary8p1se: 6 is the tie between 4 (exponent field 66, even) and 8 (67, odd), 3 the tie
    between 2 (65, odd) and 4; gfloat's round_float (round.py lines 114-118 at b142762) gives
    4 and 4. E8M0, without a zero, keeps rounding ties up (3 -> 4, 6 -> 8), as torch does."""
    fmt, e8m0 = get_format("p3109:k8p1se"), FORMATS["float8_e8m0fnu"]
    assert fmt.decode(66).mag == 4 and fmt.decode(67).mag == 8 and fmt.ties_by_code
    with kernel_path(path):
        assert _round(fmt, 6.0, Rounding.RNE, Overflow.SATURATE) == ("4", 4.0)
        assert _round(fmt, -3.0, Rounding.RNE, Overflow.SATURATE) == ("-4", -4.0)
        assert _round(fmt, 2.0**-64, Rounding.RNE, Overflow.SATURATE) == ("0", 0.0)  # 0 is even
        assert _round(e8m0, 6.0, Rounding.RNE, Overflow.SATURATE) == ("8", 8.0)
        # a block-scaled grid (the scaled kernel): 6 * 2**10 under a scale of 2**10
        x = torch.tensor([[6.0 * 2**10] * 32, [3.0 * 2**10] * 32])
        scaled = rounding.round_fused(x, fmt, Rounding.RNE, Overflow.SATURATE,
                                      scale_exp=torch.full(x.shape, 10, dtype=torch.int32))
        assert scaled[:, 0].tolist() == [4.0 * 2**10, 4.0 * 2**10]


def test_verify_formats_passes_on_p3109(tmp_path: Path) -> None:
    """The whole quick plan on the P3109 format at float32's edge (its least value 2**-127 is a
    float32 subnormal)."""
    result = runner.invoke(app, ["verify-formats", "--out", str(tmp_path), "-j", "1",
                                 "--quick", "-f", "p3109:k8p1ue"])
    df = read_table(tmp_path / "verify-formats.parquet")[0]
    summary = df[df.kind == "summary"]
    assert result.exit_code == 0 and int(summary.n_failed.sum()) == 0
    assert set(summary.format) == {"binary8p1ue"} and int(summary.n_checked.sum()) > 100_000


def _failures(*names: str) -> dict[tuple[str, str], int]:
    """The codes and pairs suites (quick) on each format: disagreements by (format, check)."""
    found: dict[tuple[str, str], int] = {}
    for name in names:
        fmt = get_format(name)
        for out in [*check_codes(fmt, Plan(quick=True)), *check_pairs(fmt, Plan(quick=True))]:
            if out.n_failed:
                key = (fmt.name, out.operation)
                found[key] = found.get(key, 0) + out.n_failed
    return found


def test_a_planted_wrong_decoding_of_infinity_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The codec reading binary8p4se's 0x7F and 0xFF as finite ±240 (the fnuz reading): the
    codes suite reports exactly those two codes, and nothing on another format."""
    real = codec.decode

    def fnuz_reading(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
        out = real(codes, fmt)
        if get_format(fmt).name == "binary8p4se":  # the planted fault, for one format only
            out = torch.where(out.isinf(), out.sign() * 240, out)
        return out

    # the suite's decoding only: codec.encode checks its codes with the real one
    monkeypatch.setattr(codes_suite, "codec", SimpleNamespace(
        decode=fnuz_reading, encode=codec.encode, nan_code=codec.nan_code))
    found = _failures("binary8p4se", "binary8p5se")
    assert {f for f, _ in found} == {"binary8p4se"} and found["binary8p4se", "decode"] == 2


@pytest.mark.parametrize("path", ["torch", "jit"])
def test_a_planted_wrong_overflow_boundary_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                     path: str) -> None:
    """The kernel rounding binary8p4se with E4M3FNUZ's max (240: the code below inf taken for
    finite) on one back-end: the suites fail there, on that format only."""
    planted = rounding.Target.of(FORMATS["binary8p4se"])
    wrong_max = rounding.Target.of(FORMATS["float8_e4m3fnuz"])
    name = "_kernel" if path == "torch" else "jit_params"
    real = getattr(rounding, name)

    def wrong(*args: object, **kw: object) -> object:
        if kw["tgt"] == planted:
            kw["tgt"] = replace(planted, max_sig=wrong_max.max_sig, min_sig=wrong_max.min_sig)
        return real(*args, **kw)

    monkeypatch.setattr(rounding, name, wrong)
    with kernel_path(path):
        found = _failures("binary8p4se", "binary8p3se")
    assert {f for f, _ in found} == {"binary8p4se"}
    assert found.get(("binary8p4se", "roundtrip"), 0) > 0  # inf saturates to 240, not 224
