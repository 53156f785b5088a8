"""Symmetric integers (``int8_sym``, the ``mxint8_sym`` preset): MXINT8 clamped to ±127/64 as
microxcaling does, where drift's ``int8`` keeps −128 as gfloat's OCP INT8 does. The record, the
oracle, both back-ends, the codec and verify-formats, with a planted fault (one back-end letting
−128 through) that verify-formats catches."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from kernel_paths import kernel_path

import driftcli as drift
from driftcli import FORMATS
from driftcli.casts import codec, rounding
from driftcli.errors import FormatSpecError, UnknownFormatError
from driftcli.oracle.rounding import round_exact
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import Exact, Format
from driftcli.records.modes import Overflow, Rounding
from driftcli.records.presets import preset
from driftcli.verify.blocks import check_blocks
from driftcli.verify.codes import check_codes
from driftcli.verify.compare import Plan
from driftcli.verify.driver import verify
from driftcli.verify.pairs import check_pairs

SYM = FORMATS["int8_sym"]


def test_the_record_clamps_at_minus_max() -> None:
    assert (SYM.min, SYM.max, SYM.min_significand, SYM.max_significand) == (-127, 127, 127, 127)
    assert (FORMATS["int8"].min, FORMATS["int8"].min_significand) == (-128, 128)
    assert (FORMATS["int4_sym"].min, FORMATS["int4_sym"].max) == (-7, 7)
    # the code 0x80 still reads as two's complement; the cast never writes it
    assert SYM.decode(0x80) == Exact.of(-128) and float(codec.decode(torch.tensor([0x80]), SYM))
    assert FORMATS["int8"].contains(SYM) and not SYM.contains(FORMATS["int8"])
    # resolved on lookup, not listed (drift formats and the verify plans keep their counts)
    assert "int8_sym" in FORMATS and "int8_sym" not in list(FORMATS)
    assert "float8_e4m3fn_sym" not in FORMATS and "int9_sym" not in FORMATS
    with pytest.raises(UnknownFormatError):
        FORMATS["float8_e4m3fn_sym"]
    with pytest.raises(FormatSpecError, match="only an integer format is symmetric"):
        Format("x", 4, 3, 7, symmetric=True)


# (x, mode, int8's result, int8_sym's result): -128.x and the ties next to -127 go to -128 on
# int8 and saturate to -127 on int8_sym, in every mode and under both overflow policies
CASES = [(-128.0, Rounding.RNE, -128, -127), (-127.5, Rounding.RNE, -128, -127),
         (-127.5, Rounding.RNA, -128, -127), (-127.2, Rounding.RDOWN, -128, -127),
         (-127.2, Rounding.RUP, -127, -127), (-128.6, Rounding.RTZ, -128, -127),
         (-300.0, Rounding.RNE, -128, -127), (127.5, Rounding.RNE, 127, 127),
         (-126.5, Rounding.RNE, -126, -126)]


@pytest.mark.parametrize("path", ["torch", "jit"])
@pytest.mark.parametrize("policy", list(Overflow))
def test_minus_128_saturates_on_both_back_ends_and_the_oracle(path: str,
                                                              policy: Overflow) -> None:
    for name, column in (("int8", 2), ("int8_sym", 3)):
        fmt = FORMATS[name]
        for case in CASES:
            x, mode, want = case[0], case[1], case[column]
            exact = round_exact(fmt, Exact.of(Fraction(x)), mode, policy)
            with kernel_path(path):
                got = rounding.round_to_format(torch.tensor([x]), fmt, rounding=mode,
                                               overflow=policy)
            assert (exact.value, float(got)) == (want, want), (name, case)


@pytest.mark.parametrize("path", ["torch", "jit"])
def test_the_block_cast_never_writes_minus_128(path: str) -> None:
    """A block of amax 1.999 takes the scale 2**-6 (floor rule): -1.999 is -127.94 quanta,
    -128/64 on mxint8 and -127/64 on mxint8_sym; the codes say the same."""
    x = torch.tensor([-1.999, 1.0, 0.5] + [0.0] * 29)
    with kernel_path(path):
        plain, sym = drift.quantize(x, "mxint8"), drift.quantize(x, "mxint8_sym")
    assert (float(plain[0]), float(sym[0])) == (-2.0, -127 / 64)
    assert torch.equal(plain[1:], sym[1:])
    assert int(codec.encode(sym[:1] * 64, SYM)) == 0x81
    c = preset("mxint8_sym")
    assert c is not None and c.format == SYM
    assert str(c) == "int8_sym:block32:float8_e8m0fnu:floor:rne:saturate"
    assert parse_cast(str(c)) == c


def _failures(*names: str, blocks: bool = True) -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for name in names:
        fmt = FORMATS[name]
        plan = Plan(quick=True)
        suites = [*check_codes(fmt, plan), *check_pairs(fmt, plan)]
        for out in [*suites, *(check_blocks(fmt, plan) if blocks and fmt == SYM else ())]:
            if out.n_failed:
                key = (fmt.name, out.check)
                found[key] = found.get(key, 0) + out.n_failed
    return found


def test_verify_formats_passes_on_int8_sym() -> None:
    """The quick plan's codes, pairs and block casts (mxint8_sym among them): 0 disagreements
    (``drift verify-formats --quick -f int8_sym``: 147,438 values)."""
    outcomes = verify([SYM], Plan(quick=True))
    assert sum(o.n_checked for o in outcomes) == 147_438 and len(outcomes) == 53
    assert [o for o in outcomes if o.n_failed] == []
    assert {o.check for o in outcomes} >= {"codes", "pairs (sampled pairs)", "blocks"}


@pytest.mark.parametrize("path", ["torch", "jit"])
def test_a_back_end_letting_minus_128_through_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                        path: str) -> None:
    """One back-end reading int8_sym's negative limit as int8's (128 quanta): the codes, pairs
    and block suites report it, on int8_sym only (int4, checked beside it, stays clean)."""
    planted = rounding.Target.of(SYM)
    name = "_kernel" if path == "torch" else "jit_params"
    real = getattr(rounding, name)

    def wrong(*args: object, **kw: object) -> object:
        if kw["tgt"] == planted:
            kw["tgt"] = replace(planted, min_sig=128)
        return real(*args, **kw)

    monkeypatch.setattr(rounding, name, wrong)
    with kernel_path(path):
        found = _failures("int8_sym", "int4")
    assert {f for f, _ in found} == {"int8_sym"}
    assert {suite for _, suite in found} == {"codes", "pairs (sampled pairs)", "blocks"}
