"""round_nearest (rounding to nearest even in float32 operations, driftcli.kernels.jitcode) gives
round_lean's bits wherever nearest_fits admits the grid: over every float32 bit pattern for the
roundings of the default casts (slow), over every exponent field and every cut's neighbourhood
for every format, overflow policy and the edges of the scale exponents' range (fast); the
checker catches a planted fault, and nearest_fits refuses grids on which the two differ."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from numba import njit

from driftcli.casts import rounding
from driftcli.kernels.jitcode import nearest_fits, round_lean, round_nearest, row_limits
from driftcli.records.formats import FORMATS
from driftcli.records.modes import Overflow, Rounding
from tests.test_fastcast import sweep_bits


def _params(name: str, overflow: Overflow, mode: Rounding = Rounding.RNE) -> tuple[int, ...]:
    return rounding.jit_params(src=rounding.source_of(torch.float32),
                               tgt=rounding.target_of(FORMATS[name]), rounding=mode,
                               overflow=overflow, sr_bits=8)


@njit(nogil=True, error_model="numpy")
def _limits(k: int, p: Any) -> Any:
    return row_limits(k, p)


@njit(nogil=True, error_model="numpy")
def _fits(k: int, p: Any) -> bool:
    return nearest_fits(row_limits(k, p), p)


@njit(nogil=True, error_model="numpy")
def _differ_range(start: int, stop: int, lim: Any, p: Any, want_p: Any) -> tuple[int, int]:
    """How many bit patterns in ``start..stop`` (int32 values) round_nearest under ``p`` and
    round_lean under ``want_p`` give different bits for, and the first of them (-1: none)."""
    count = 0
    first = stop
    for b in range(start, stop):
        differs = round_nearest(b, lim, p) != round_lean(b, 0, lim, want_p)
        count += int(differs)
        first = min(first, b if differs else stop)
    return count, first if count else -1


@njit(nogil=True, error_model="numpy")
def _differ_at(bits: Any, lim: Any, p: Any, want_p: Any) -> tuple[int, int]:
    """:func:`_differ_range` over the bit patterns ``bits``: the count and the first index."""
    count = 0
    first = -1
    for i in range(bits.size):
        differs = round_nearest(bits[i], lim, p) != round_lean(bits[i], 0, lim, want_p)
        count += int(differs)
        if differs and first < 0:
            first = i
    return count, first


def _edge_ks(p: tuple[int, ...]) -> list[int]:
    """The scale exponents at both ends of the range whose grid nearest_fits admits, and
    around 0."""
    ks = [k for k in range(-300, 300) if _fits(k, p)]
    return sorted({*ks[:4], *ks[-4:], *(k for k in ks if -2 <= k <= 2)})


FAST_FORMATS = [n for n in FORMATS if n != "float32"]


@pytest.mark.parametrize("overflow", [Overflow.SATURATE, Overflow.IEEE])
@pytest.mark.parametrize("name", FAST_FORMATS)
def test_round_nearest_is_round_lean_on_every_cut(name: str, overflow: Overflow) -> None:
    """Every exponent field with the mantissas around every cut, both signs, inf and NaN,
    on the grids nearest_fits admits at both ends of the scale exponents' range and near 0."""
    p = _params(name, overflow)
    bits = np.concatenate([sweep_bits(), np.array([0x7F800000, -0x800000, 0x7FC00000,
                                                   0x7F800001, -1, 0], dtype=np.int32)])
    ks = _edge_ks(p)
    if not ks:  # tapered, or a grid reaching float32's largest binades at every exponent
        # whose normals are float32 normals: nearest_fits admits none of its grids
        assert name in {"hifloat8", "bfloat16", "float8_e8m0fnu"}
        return
    for k in ks:
        count, first = _differ_at(bits, _limits(k, p), p, p)
        assert count == 0, f"k={k}: {count} differ, first input {bits[first]:#x}"


def test_the_checker_catches_a_planted_fault() -> None:
    """Compared against truncation instead of its own rounding, the checker finds the
    differences (every value that rounds up), on a sample and on a range."""
    p = _params("float8_e4m3fn", Overflow.SATURATE)
    rtz = _params("float8_e4m3fn", Overflow.SATURATE, Rounding.RTZ)
    lim = _limits(0, p)
    count, first = _differ_at(sweep_bits(), lim, p, rtz)
    assert count > 1000 and first >= 0
    # 1 + 2**-4 + 2**-23 (0x3F800000 | 0x080001) rounds up to 1.125 on e4m3's grid, not down
    count, first = _differ_range(0x3F880000, 0x3F880002, lim, p, rtz)
    assert (count, first) == (1, 0x3F880001)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float4_e2m1fn", "float8_e5m2"])
def test_nearest_fits_refuses_grids_where_the_steps_differ(name: str) -> None:
    """Below float32's normals (a subnormal input's binade then matters) and beyond its range,
    round_nearest's steps give other bits than round_lean: nearest_fits refuses those grids."""
    p = _params(name, Overflow.SATURATE)
    fmt = FORMATS[name]
    low = -126 - fmt.emin - 3  # the grid's normals start three binades below float32's
    assert not _fits(low, p)
    count, _ = _differ_at(sweep_bits(), _limits(low, p), p, p)
    assert count > 0
    assert not _fits(110, p)
    count, _ = _differ_at(sweep_bits(), _limits(110, p), p, p)
    assert count > 0


# the roundings the default demo casts take (fp8_e4m3, mxfp8_e4m3, nvfp4): E4M3 and E2M1
# elements, saturating, and NVFP4's E4M3 block scale, IEEE overflow, each at scale exponent 0
EVERY_PATTERN = [("float8_e4m3fn", Overflow.SATURATE, 0), ("float4_e2m1fn", Overflow.SATURATE, 0),
                 ("float8_e4m3fn", Overflow.IEEE, 0)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overflow", "k"), EVERY_PATTERN)
def test_round_nearest_is_round_lean_on_every_float32(name: str, overflow: Overflow,
                                                      k: int) -> None:
    """All 2**32 float32 bit patterns (about 35 s of one core each; all three passed at
    the commit that added round_nearest, 0 of 2**32 differing)."""
    p = _params(name, overflow)
    assert _fits(k, p)
    count, first = _differ_range(-(1 << 31), 1 << 31, _limits(k, p), p, p)
    assert count == 0, f"{count} differ, first input {first:#x}"
