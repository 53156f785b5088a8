"""The exact oracle: IEEE 754's sign-of-zero rules and rounding definitions, value by value."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driftcli import FORMATS
from driftcli.oracle.quantization import cast_block
from driftcli.oracle.rounding import (
    RoundingCell,
    binade,
    product,
    round_cells,
    round_exact,
    rounds_away,
    total,
)
from driftcli.oracle.scaling import pow2_scale_exponent
from driftcli.records.formats import NAN, Exact, Format, Kind
from driftcli.records.modes import Overflow, Rounding, ScaleRule

POS0, NEG0 = Exact.of(0), Exact.of(0, negative_zero=True)
THREE, MINUS_THREE = Exact.of(3), Exact.of(-3)
E4M3 = FORMATS["float8_e4m3fn"]
FP4, F32, E8M0 = FORMATS["float4_e2m1fn"], FORMATS["float32"], FORMATS["float8_e8m0fnu"]


def test_products_take_the_xor_sign_even_at_zero() -> None:
    """The seed study's first bug: a reference that lost the sign of (+0)·(−3)."""
    assert product(POS0, MINUS_THREE) == NEG0
    assert product(NEG0, MINUS_THREE) == POS0
    assert product(NEG0, THREE) == NEG0
    assert product(NEG0, NEG0) == POS0
    assert product(POS0, Exact(Kind.INF, True)).kind is Kind.NAN


@pytest.mark.parametrize("mode", list(Rounding))
def test_exact_zero_sums(mode: Rounding) -> None:
    """IEEE 754 §6.3: x + (−x) and (+0) + (−0) are +0, except −0 when rounding toward −inf."""
    signed = mode is Rounding.RDOWN
    assert total(THREE, MINUS_THREE, mode) == Exact.of(0, negative_zero=signed)
    assert total(POS0, NEG0, mode) == Exact.of(0, negative_zero=signed)
    assert total(NEG0, NEG0, mode) == NEG0
    assert total(POS0, POS0, mode) == POS0


def test_rounding_keeps_the_sign_of_zero_and_of_underflow() -> None:
    assert round_exact(E4M3, NEG0) == NEG0
    assert round_exact(E4M3, Exact.of(Fraction(-1, 4096))) == NEG0  # underflows to −0
    fnuz = FORMATS["float8_e4m3fnuz"]
    assert round_exact(fnuz, NEG0) == POS0  # no −0 code
    assert round_exact(FORMATS["int8"], Exact.of(Fraction(-1, 3))) == POS0


@pytest.mark.parametrize(("value", "mode", "expected"), [
    # ties between 16 (significand 8, even) and 18 (9, odd) at quantum 2: 17 is the tie
    (17, Rounding.RNE, 16), (17, Rounding.RNA, 18), (19, Rounding.RNE, 20),
    (Fraction(33, 2), Rounding.RTZ, 16), (Fraction(33, 2), Rounding.RUP, 18),
    (Fraction(-33, 2), Rounding.RUP, -16), (Fraction(-33, 2), Rounding.RDOWN, -18),
])
def test_round_to_nearest_and_directed(value: Fraction, mode: Rounding, expected: int) -> None:
    assert round_exact(E4M3, Exact.of(value), mode).value == expected


def test_overflow_policies() -> None:
    big = Exact.of(1000)
    assert round_exact(E4M3, big, overflow=Overflow.SATURATE).value == 448
    assert round_exact(E4M3, big, overflow=Overflow.IEEE).kind is Kind.NAN
    e5m2 = FORMATS["float8_e5m2"]
    assert round_exact(e5m2, Exact.of(10**6), overflow=Overflow.IEEE) == Exact(Kind.INF)
    # IEEE: toward-zero directed modes give ±max, not inf
    assert round_exact(e5m2, Exact.of(10**6), Rounding.RTZ, Overflow.IEEE).value == 57344
    assert round_exact(e5m2, Exact.of(-(10**6)), Rounding.RUP, Overflow.IEEE).value == -57344
    assert round_exact(e5m2, Exact.of(-(10**6)), Rounding.RDOWN, Overflow.IEEE) == Exact(
        Kind.INF, True)
    # an exact inf is not an overflow of the mode: it stays inf under ieee whatever the mode
    assert round_exact(e5m2, Exact(Kind.INF), Rounding.RTZ, Overflow.IEEE) == Exact(Kind.INF)
    assert round_exact(e5m2, Exact(Kind.INF), Rounding.RTZ, Overflow.SATURATE).value == 57344
    # 464 is the tie between 448 and the (absent) 480: ties to even keep it in range
    assert round_exact(E4M3, Exact.of(464), overflow=Overflow.IEEE).value == 448


def test_formats_without_nan_or_zero() -> None:
    fp4 = FORMATS["float4_e2m1fn"]
    assert round_exact(fp4, NAN).kind is Kind.NAN  # recorded as non-finite, never 0 or max
    assert round_exact(fp4, Exact(Kind.INF, True), overflow=Overflow.IEEE).value == -6
    e8m0 = FORMATS["float8_e8m0fnu"]
    assert round_exact(e8m0, POS0).mag == Fraction(1, 2**127)
    assert round_exact(e8m0, Exact.of(3)).value == 4  # every significand is 1 (odd): ties go up
    assert round_exact(e8m0, Exact.of(-3), overflow=Overflow.IEEE).kind is Kind.NAN
    assert round_exact(e8m0, Exact.of(-3), overflow=Overflow.SATURATE).mag == Fraction(1, 2**127)


def test_stochastic_rounding_counts_draws_exactly() -> None:
    """With k bits, a value 5/16 of the way up rounds up for exactly 5 of the 16 draws."""
    value = Exact.of(16 + Fraction(2 * 5, 16))  # quantum 2 at 16: f = 5/16
    ups = [round_exact(E4M3, value, Rounding.SR, random=r, sr_bits=4).value for r in range(16)]
    assert ups.count(18) == 5 and ups.count(16) == 11


@given(st.fractions(min_value=Fraction(1, 10**9), max_value=10**9))
def test_binade_brackets(mag: Fraction) -> None:
    e = binade(mag)
    assert Fraction(2) ** e <= mag < Fraction(2) ** (e + 1)


@given(st.fractions(min_value=-500, max_value=500), st.sampled_from(list(Rounding)),
       st.integers(0, 2**16 - 1))
def test_results_are_values_of_the_format_and_neighbours_of_the_input(
        value: Fraction, mode: Rounding, r: int) -> None:
    grid = sorted({v.value for _, v in E4M3.values() if v.kind is Kind.FINITE})
    got = round_exact(E4M3, Exact.of(value), mode, random=r)
    assert got.value in grid
    below = max([g for g in grid if g <= value], default=grid[0])
    above = min([g for g in grid if g >= value], default=grid[-1])
    assert below <= got.value <= above
    if mode is Rounding.RTZ:
        assert abs(got.value) <= abs(value)


@pytest.mark.parametrize(("amax", "floor", "ceil", "even"), [
    (Fraction(4), 0, 0, 0),
    (Fraction(5), 0, 0, 0),  # 6 · 2**0 holds it; even rounds it to 6 (quantum 2): binade 2
    (Fraction(13, 2), 0, 1, 0),  # floor clips it, ceil does not; even rounds it to 6
    (Fraction(7), 0, 1, 1),  # even rounds it (ties away) to 8: the next binade
    (Fraction(1, 3), -4, -4, -4),  # binade -2; 6 · 2**-4 = 3/8 holds it
    (Fraction(9, 20), -4, -3, -3),  # 3/8 does not; even rounds it to 1/2
])
def test_power_of_two_rules_on_fp4_blocks(amax: Fraction, floor: int, ceil: int,
                                           even: int) -> None:
    """Each rule's exponent, looked up by its member: FP4's max is 6, emax_elem 2, 1 mantissa
    bit (design: floor(log2 amax) − 2; the smallest k with 6 · 2**k ≥ amax; floor of amax
    rounded to 2 significant bits)."""
    for rule, k in ((ScaleRule.FLOOR, floor), (ScaleRule.CEIL, ceil), (ScaleRule.EVEN, even)):
        assert pow2_scale_exponent(amax, FP4, rule, 0, -127, 127) == (k, False), rule
        scale = cast_block([Exact.of(amax)], FP4, E8M0, rule, 0, True, F32, scale_only=True)[1]
        assert scale == Exact.of(Fraction(2) ** k), rule


@pytest.mark.parametrize(("amax", "k"), [
    (Fraction(447), 0),  # significand 447/256 < 7/4: floor's binade
    (Fraction(448), 1),  # 7/4 exactly: up, though E4M3's max holds it (floor, ceil, even: 0)
    (Fraction(480), 1),  # even keeps it (E4M3 holds 1.875 · 256): 0; ceil: 1
    (Fraction(7, 4) * Fraction(1, 2**20), -27),  # the threshold in every binade
])
def test_even_e2m1_rounds_amax_at_seven_quarters(amax: Fraction, k: int) -> None:
    """compressed-tensors' MX scale (generate_mx_scales: amax's bits plus a quarter of the
    leading mantissa bit, the mantissa masked off, then floor - emax) on E4M3 blocks, where
    it is neither floor, ceil nor even; on FP4 it is even."""
    rule = ScaleRule.EVEN_E2M1
    assert pow2_scale_exponent(amax, E4M3, rule, 0, -127, 127) == (k, False)
    scale = cast_block([Exact.of(amax)], E4M3, E8M0, rule, 0, True, F32, scale_only=True)[1]
    assert scale == Exact.of(Fraction(2) ** k)
    assert amax / Fraction(2) ** k < E4M3.max  # nothing clips on E4M3 (M = 1.75 · 2**8)
    for x in (Fraction(5), Fraction(13, 2), Fraction(7), Fraction(9, 20)):
        assert pow2_scale_exponent(x, FP4, rule, 0, -127, 127) == \
            pow2_scale_exponent(x, FP4, ScaleRule.EVEN, 0, -127, 127)


def test_headroom_zero_blocks_and_clamping_are_shared_by_power_of_two_rules() -> None:
    assert pow2_scale_exponent(Fraction(7), FP4, ScaleRule.FLOOR, 2, -127, 127) == (2, False)
    assert pow2_scale_exponent(Fraction(7), FP4, ScaleRule.CEIL, 0, -127, 0) == (0, True)
    assert pow2_scale_exponent(Fraction(1, 3), FP4, ScaleRule.FLOOR, 0, -3, 8) == (-3, True)
    assert pow2_scale_exponent(Fraction(0), FP4, ScaleRule.CEIL, 0, -127, 127) == (-127, False)


@pytest.mark.parametrize(("rule", "scale_format", "amax", "tensor_amax", "divisor"), [
    (ScaleRule.AMAX, F32, Fraction(3), None, Fraction(1, 2)),  # fl32(3 / 6), exact
    (ScaleRule.AMAX_RNE, E8M0, Fraction(8, 5), None, Fraction(1, 4)),  # 4/15 to nearest
    (ScaleRule.AMAX_UP, E8M0, Fraction(8, 5), None, Fraction(1, 2)),  # 4/15 up
    (ScaleRule.AMAX_UP, E8M0, Fraction(0), None, Fraction(1, 2**127)),  # all zero: smallest
    # NVFP4: S = fl32(2688 / (448 · 6)) = 1, block scale 3/6 = 0.5 in E4M3, divisor 0.5
    (ScaleRule.TWO_LEVEL, E4M3, Fraction(3), Fraction(2688), Fraction(1, 2)),
    # S = 336 / 2688 = 1/8: block scale fl32(fl32(3/6) / S) = 4, divisor fl32(4 · 1/8)
    (ScaleRule.TWO_LEVEL, E4M3, Fraction(3), Fraction(336), Fraction(1, 2)),
    (ScaleRule.TWO_LEVEL, E4M3, Fraction(0), Fraction(0), Fraction(1, 512)),  # S = 1
])
def test_divisor_rules_on_fp4_blocks(rule: ScaleRule, scale_format: Format, amax: Fraction,
                                     tensor_amax: Fraction | None, divisor: Fraction) -> None:
    """The real-valued and two-level rules' divisors (scaling.md's formulas), by member."""
    _, scale, clamped = cast_block([Exact.of(amax)], FP4, scale_format, rule, 0, True, F32,
                                   tensor_amax=tensor_amax, scale_only=True)
    assert scale == Exact.of(divisor) and not clamped


# --- round_cells: one value under many cells, its bracket found once -------------------------

CELL_FORMATS = ["float8_e4m3fn", "float4_e2m1fn", "int8", "hifloat8", "binary8p3se",
                "float8_e8m0fnu"]


def _cell_values(fmt: Format, seed: int = 7) -> list[Exact]:
    """Every code's value, every midpoint of neighbouring magnitudes (both signs), specials,
    values past the range and seeded random rationals of both signs."""
    values = [v for _, v in fmt.values()]
    mags = sorted({v.mag for v in values if v.kind is Kind.FINITE})
    mids = [(a + b) / 2 for a, b in itertools.pairwise(mags)]
    rng = random.Random(seed)
    rand = [Fraction(rng.randrange(1, 1 << 20), 1 << 20) * fmt.max * rng.choice((1, 2, 3))
            for _ in range(200)]
    rand += [Fraction(rng.randrange(1, 1 << 12), rng.randrange(1, 1 << 30)) for _ in range(100)]
    extra = [Exact.of(m) for m in mids + rand] + [Exact.of(-m) for m in mids + rand]
    return values + extra + [Exact.of(0), Exact.of(0, negative_zero=True), NAN,
                             Exact(Kind.INF, False), Exact(Kind.INF, True)]


def _every_cell() -> list[RoundingCell]:
    cells: list[RoundingCell] = []
    for mode in Rounding:
        for policy in Overflow:
            if mode is not Rounding.SR:
                cells.append((mode, policy, 0, 16))
                continue
            for sr_bits in (1, 4, 16):
                top = (1 << sr_bits) - 1
                cells += [(mode, policy, r, sr_bits) for r in sorted({0, 1, top // 2, top})]
    return cells


def _disagreements(fmt: Format, values: list[Exact], cells: Sequence[RoundingCell],
                   multi: Callable[[Format, Exact, Sequence[RoundingCell]], list[Exact]]
                   ) -> list[tuple[Exact, RoundingCell]]:
    """Where ``multi``'s rounding of a value under all cells differs from round_exact's
    under each cell alone (the sign of zero included: Exact compares it)."""
    bad = []
    for v in values:
        together = multi(fmt, v, cells)
        assert len(together) == len(cells)
        bad += [(v, c) for c, got in zip(cells, together, strict=True)
                if got != round_exact(fmt, v, *c)]
    return bad


@pytest.mark.parametrize("name", CELL_FORMATS)
def test_round_cells_is_round_exact_cell_by_cell(name: str) -> None:
    fmt = FORMATS[name]
    values = _cell_values(fmt)
    cells = _every_cell()
    assert len(cells) == 10 + 2 * (2 + 4 + 4) and len(values) > 300
    assert _disagreements(fmt, values, cells, round_cells) == []
    # the cells do tell the values apart: off the grid, some cells go down and some up
    assert sum(len(set(round_cells(fmt, v, cells))) == 2 for v in values) > 300


def test_round_cells_check_catches_a_result_shared_across_cells() -> None:
    """A planted fault: reusing the first cell's rounding for every cell."""
    def first_for_all(fmt: Format, x: Exact, cells: Sequence[RoundingCell]) -> list[Exact]:
        return round_cells(fmt, x, cells[:1]) * len(cells)

    bad = _disagreements(E4M3, _cell_values(E4M3)[:300], _every_cell(), first_for_all)
    assert len(bad) > 100


def test_sr_rounds_away_at_the_integer_threshold() -> None:
    """floor(f * 2**bits) + r >= 2**bits, at the draws either side of the threshold."""
    f = Fraction(5, 16)  # 0.0101b: with 4 bits the threshold draw is 16 - 5 = 11
    assert not rounds_away(Rounding.SR, f, False, False, 10, 4)
    assert rounds_away(Rounding.SR, f, False, False, 11, 4)
    f = Fraction(1, 3)  # floor(2**4 / 3) = 5: truncated, so 10 stays down
    assert not rounds_away(Rounding.SR, f, False, True, 10, 4)
    assert rounds_away(Rounding.SR, f, False, True, 11, 4)
    assert not rounds_away(Rounding.SR, Fraction(0), False, False, 15, 4)


def test_format_hash_is_cached_and_equal_formats_share_it() -> None:
    """Format's explicit, cached __hash__ (the oracle's caches key on it) agrees with ==."""
    twin = replace(E4M3)
    assert twin == E4M3 and twin is not E4M3 and hash(twin) == hash(E4M3)
    assert {E4M3: 1}[twin] == 1
    assert replace(E4M3, name="other") != E4M3
    assert "_hash" in vars(E4M3)  # computed once, kept on the instance
