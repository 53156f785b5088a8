"""The format registry against docs/formats.md's table, and the custom-format grammar."""

from __future__ import annotations

from fractions import Fraction

import pytest

from driftcli import FORMATS, get_format
from driftcli.errors import DriftError, FormatSpecError, UnknownFormatError
from driftcli.records.formats import Kind, NanEncoding

# (E, M, bias, max finite, has inf, NaN encoding, has -0): docs/formats.md, row by row
TABLE = {
    "float32": (8, 23, 127, Fraction((2**24 - 1) * 2**104), True, NanEncoding.IEEE, True),
    "bfloat16": (8, 7, 127, Fraction(255 * 2**120), True, NanEncoding.IEEE, True),
    "float16": (5, 10, 15, Fraction(65504), True, NanEncoding.IEEE, True),
    "float8_e5m2": (5, 2, 15, Fraction(57344), True, NanEncoding.IEEE, True),
    "float8_e4m3fn": (4, 3, 7, Fraction(448), False, NanEncoding.TOP, True),
    "float8_e4m3fnuz": (4, 3, 8, Fraction(240), False, NanEncoding.NEG_ZERO, False),
    "float8_e5m2fnuz": (5, 2, 16, Fraction(57344), False, NanEncoding.NEG_ZERO, False),
    "float6_e3m2fn": (3, 2, 3, Fraction(28), False, NanEncoding.NONE, True),
    "float6_e2m3fn": (2, 3, 1, Fraction(15, 2), False, NanEncoding.NONE, True),
    "float4_e2m1fn": (2, 1, 1, Fraction(6), False, NanEncoding.NONE, True),
    # HiFloat4's element (docs/formats.md#hifloat4): S1E1M2, a uniform grid of quarters
    "float4_e1m2": (1, 2, 1, Fraction(7, 4), False, NanEncoding.NONE, True),
    # MX6's and MX9's elements (docs/formats.md#mx6-and-mx9)
    "float5_e1m3": (1, 3, 1, Fraction(15, 8), False, NanEncoding.NONE, True),
    "float8_e1m6": (1, 6, 1, Fraction(127, 64), False, NanEncoding.NONE, True),
    "float8_e8m0fnu": (8, 0, 127, Fraction(2**127), False, NanEncoding.TOP, False),
    # the block scales after OCP (docs/formats.md#ue5m3-and-ue4m3): unsigned, NaN at the top
    "ue5m3": (5, 3, 15, Fraction(114688), False, NanEncoding.TOP, False),
    "ue4m3": (4, 3, 7, Fraction(448), False, NanEncoding.TOP, False),
    # IEEE P3109 (docs/formats.md#ieee-p3109): max finite from the P3109 public repository's
    # value tables (Value Tables/Hexadecimal/K8, K4 at 26df0d0), code 0x7E (0xFD unsigned)
    "binary8p3se": (5, 2, 16, Fraction(49152), True, NanEncoding.NEG_ZERO, False),
    "binary8p4se": (4, 3, 8, Fraction(224), True, NanEncoding.NEG_ZERO, False),
    "binary4p2sf": (2, 1, 2, Fraction(3), False, NanEncoding.NEG_ZERO, False),
    # HiFloat8 (docs/formats.md#hifloat8): tapered, E and M its widest fields, no bias of its
    # own; max 2**15 (0x6E), ±inf 0x6F/0xEF, NaN 0x80
    "hifloat8": (4, 3, 0, Fraction(2**15), True, NanEncoding.NEG_ZERO, False),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_float_formats_match_the_design_table(name: str) -> None:
    ebits, mbits, bias, top, inf, nan, neg_zero = TABLE[name]
    f = FORMATS[name]
    assert (f.ebits, f.mbits, f.bias, f.max, f.has_inf, f.nan, f.has_neg_zero) == (
        ebits, mbits, bias, top, inf, nan, neg_zero)


def test_every_registered_format_is_in_the_table_or_an_integer() -> None:
    assert set(FORMATS) == set(TABLE) | {"int8", "int4"}


def test_integers_are_twos_complement() -> None:
    assert (FORMATS["int8"].max, FORMATS["int8"].min) == (127, -128)
    assert (FORMATS["int4"].max, FORMATS["int4"].min) == (7, -8)
    values = [v.value for _, v in FORMATS["int8"].values()]
    assert sorted(values) == list(range(-128, 128))


def test_e8m0_has_no_zero_and_spans_2_to_the_plus_minus_127() -> None:
    f = FORMATS["float8_e8m0fnu"]
    values = f.values()
    assert values[0][1].mag == Fraction(1, 2**127) and values[254][1].mag == 2**127
    assert values[255][1].kind is Kind.NAN
    assert all(v.mag != 0 for _, v in values[:255]) and not f.has_zero


@pytest.mark.parametrize("name", [n for n in FORMATS if FORMATS[n].bits <= 16])
def test_value_counts(name: str) -> None:
    """Finite, infinite and NaN codes add up to 2**bits, with the counts each encoding implies."""
    f = FORMATS[name]
    kinds = [v.kind for _, v in f.values()]
    n_nan, n_inf = kinds.count(Kind.NAN), kinds.count(Kind.INF)
    expected_nan = {NanEncoding.NONE: 0, NanEncoding.NEG_ZERO: 1,
                    NanEncoding.TOP: 2 if f.signed else 1,
                    NanEncoding.IEEE: 2 * (2**f.mbits - 1)}[f.nan]
    assert n_nan == expected_nan
    assert n_inf == (1 + f.signed if f.has_inf else 0)  # an unsigned format has no -inf


def test_finfo_properties_of_e4m3fn() -> None:
    f = FORMATS["float8_e4m3fn"]
    assert (f.smallest_normal, f.smallest_subnormal, f.eps, f.emax, f.emin) == (
        Fraction(1, 64), Fraction(1, 512), Fraction(1, 8), 8, -6)


def test_custom_formats() -> None:
    e8m13 = FORMATS["e8m13"]
    assert (e8m13.bits, e8m13.bias, e8m13.has_inf, e8m13.nan) == (22, 127, True, NanEncoding.IEEE)
    assert FORMATS["e5m10"].max == FORMATS["float16"].max
    biased = get_format("e5m2b16")
    assert biased.name == "e5m2b16" and biased.bias == 16
    assert get_format("e3m4b3").name == "e3m4"  # the default bias is not spelled out...
    # ...unless the widths are a standard format's: then the bias says it is the custom one
    assert get_format("e5m2b15").name == "e5m2b15"


@pytest.mark.parametrize(("name", "standard"), [
    ("e4m3", "float8_e4m3fn or float8_e4m3fnuz"), ("e5m2", "float8_e5m2 or float8_e5m2fnuz"),
    ("e3m2", "float6_e3m2fn"), ("e2m3", "float6_e2m3fn"), ("e2m1", "float4_e2m1fn")])
def test_custom_names_of_standard_widths_are_refused_naming_both(name: str,
                                                                 standard: str) -> None:
    """``e4m3`` alone would silently be an IEEE-like float (inf, max 240), not the OCP
    float8_e4m3fn a user means (max 448): it is refused, naming both spellings."""
    ebits = int(name[1])
    bias = (1 << (ebits - 1)) - 1
    with pytest.raises(FormatSpecError, match=f"'{name}' is ambiguous") as err:
        get_format(name)
    assert f"({standard})" in str(err.value) and f"spelled {name}b{bias}" in str(err.value)
    custom = get_format(f"{name}b{bias}")
    assert custom.has_inf and custom.name == f"{name}b{bias}"
    assert get_format(f"{name}b{bias}") == FORMATS[custom.name]  # the name round-trips


@pytest.mark.parametrize("spec", ["e9m3", "e1m3", "e4m0", "e4m24", "e8m7b200", "e8m7b100"])
def test_impossible_custom_formats_raise_a_clear_error(spec: str) -> None:
    with pytest.raises(FormatSpecError, match=f"custom format '{spec}' is impossible"):
        get_format(spec)


def test_unknown_format_names_close_matches() -> None:
    with pytest.raises(UnknownFormatError) as err:
        get_format("float8_e4m3")
    assert "unknown format 'float8_e4m3'" in str(err.value)
    assert "float8_e4m3fn" in str(err.value)
    assert isinstance(err.value, DriftError)


def test_contains() -> None:
    bf16, f16, f32 = FORMATS["bfloat16"], FORMATS["float16"], FORMATS["float32"]
    e4m3 = FORMATS["float8_e4m3fn"]
    assert bf16.contains(e4m3) and f16.contains(e4m3) and f32.contains(bf16)
    assert not bf16.contains(f16) and not f16.contains(bf16)
    assert bf16.contains(FORMATS["float8_e8m0fnu"]) and not f16.contains(FORMATS["float8_e8m0fnu"])
    assert bf16.contains(FORMATS["int8"]) and not FORMATS["float8_e4m3fn"].contains(FORMATS["int8"])
