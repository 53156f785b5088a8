"""Four over six's values in one numba pass (:func:`driftcli.casts.fouroversix.fused_values`, the
path ``quantize(x, "te/nvfp4_4over6")`` takes without ``return_info``): bit for bit the general
steps (``four_over_six_scales`` and the element pass, which tests/test_fouroversix.py and
tests/test_recipes_kernels.py hold to the oracle and to the reference transcription), its
float32 rounding bit for bit ``round_lean``, what it leaves to the general steps, and a
planted fault the comparison catches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from numba import njit
from recipe_data import tensors

import driftcli as drift
from driftcli.casts import fouroversix, rounding
from driftcli.kernels import jit
from driftcli.kernels.fourcode import nearest_saturated
from driftcli.kernels.jitcode import row_limits
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS, Kind
from driftcli.records.modes import DEFAULT_SR_BITS, Overflow, Rounding
from driftcli.verify.recipes import four_over_six_cases, four_over_six_tile_case

FOUR_OVER_SIX = ["te/nvfp4_4over6", "te/nvfp4_4over6_mse", "te/nvfp4_4over6_fast",
                 "te/nvfp4_4over6_mse_fast", "te/nvfp4_2d_4over6", "te/nvfp4_row_4over6",
                 "te/nvfp4_row_4over6_mse"]
TILE = "float4_e2m1fn:tile16:float8_e4m3fn:two-level:rne:saturate:amax=fmax,two=te-4over6-"
ROW = "float4_e2m1fn:block16:float8_e4m3fn:two-level:rne:saturate:amax=fmax,two=te-row-4over6-"
OTHER_ORDERS = [TILE + "mse-fp16", ROW + "mae-fp16"]
"""Error paths no preset names: on tiles the squares and the fast path (the preset is MAE),
row-scaled the fast path (the presets cover MAE and MSE). Each is a kernel of its own to
compile, some seconds: the other two such orders differ from these by one flag."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _params(name: str) -> tuple[int, ...]:
    return rounding.jit_params(src=rounding.source_of(torch.float32),
                               tgt=rounding.target_of(FORMATS[name]), rounding=Rounding.RNE,
                               overflow=Overflow.SATURATE, sr_bits=DEFAULT_SR_BITS)


@njit(cache=False)
def _nearest_all(x: Any, q: Any, out: Any) -> None:
    p = (q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], q[12],
         q[13], q[14], q[15])
    lim = row_limits(0, p)
    biggest = np.int32(lim[2]).view(np.float32)
    for i in range(x.size):
        out[i] = nearest_saturated(x[i], lim[0], lim[1] + p[3] + 1, p[3], biggest)


def _around_the_grid(name: str) -> torch.Tensor:
    """Every value of the format and every midpoint between neighbours, scaled by powers of
    two from 2**-140 to 2**100 (the multipliers reach both), 3 ulps either side, both signs;
    float32 subnormals, zeros, infinities, the largest float32, and random bit patterns."""
    grid = torch.tensor(sorted({float(v.mag) for _, v in FORMATS[name].values()
                                if v.kind is Kind.FINITE}), dtype=torch.float64)
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid[-1:] * 1.25])
    scaled = (points[:, None] * torch.exp2(torch.arange(-140, 101).double())).flatten().float()
    bits = scaled[torch.isfinite(scaled)].view(torch.int32)
    near = (bits[:, None] + torch.arange(-3, 4, dtype=torch.int32)).flatten().view(torch.float32)
    gen = torch.Generator().manual_seed(5)
    noise = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), generator=gen,
                          dtype=torch.int64).to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, float("inf"), 3.4028234663852886e38, 1e-45, 1.1754942e-38])
    out = torch.cat([near, noise, special, torch.randn(4096) * 1e-40])
    out = out[~torch.isnan(out)]
    return torch.cat([out, -out])


@pytest.mark.parametrize("name", ["float4_e2m1fn", "float8_e4m3fn"])
def test_nearest_saturated_is_round_lean_bit_for_bit(name: str) -> None:
    """The fused pass rounds its candidates (E2M1) by float32 additions: on every grid value
    and tie of the format across float32's binades, 3 ulps around each, and random bits, it
    gives round_lean's bits (the flat element kernel's), negative zeros and saturation
    included."""
    p = _params(name)
    assert jit.nearest_saturates(p)
    x = _around_the_grid(name)
    out = np.empty(x.numel(), dtype=np.float32)
    _nearest_all(x.numpy(), np.asarray(p, dtype=np.int64), out)
    want = jit.round_bits(x, None, None, None, p)
    assert x.numel() > 500_000
    assert torch.equal(_bits(torch.from_numpy(out)), _bits(want))
    # not every grid qualifies: round_lean rounds the others
    assert not jit.nearest_saturates(rounding.jit_params(
        src=rounding.source_of(torch.float32), tgt=rounding.target_of(FORMATS[name]),
        rounding=Rounding.RTZ, overflow=Overflow.SATURATE, sr_bits=DEFAULT_SR_BITS))


def _inputs(name: str) -> list[torch.Tensor]:
    """Boundary-built tensors (without their NaN rows: blocks with NaN or inf take the general
    steps), the blocks whose choice ties or hangs on the order of the error sums, heavy tails,
    float32 subnormals, values near float32's max, zeros of both signs."""
    gen = torch.Generator().manual_seed(3)
    normal = torch.randn(64, 256, generator=gen)
    out = [x for i, x in enumerate(tensors(name, seed=16)) if i % 16 == 0]
    out = [torch.where(torch.isfinite(x), x, 0.0) for x in out]
    spread = normal * torch.exp2(torch.randint(-20, 20, (64, 1), generator=gen).float())
    return out + four_over_six_cases() + [
        normal * torch.exp(3 * torch.randn(64, 256, generator=gen)), normal * 1e-41,
        normal * 3e37, torch.zeros(4, 32), torch.full((4, 32), -0.0), spread,
        four_over_six_tile_case(keep=None), torch.randn(40, 56, generator=gen)]


@pytest.mark.parametrize("name", FOUR_OVER_SIX + OTHER_ORDERS)
def test_the_fused_pass_is_the_general_steps_bit_for_bit(name: str) -> None:
    c = parse_cast(name)
    compared = 0
    # the orders no preset names: the constructed blocks, the order-parting tiles, rows
    # binades apart, and partial tiles (the presets' boundary tensors are the same data)
    for x in (_inputs(name) if name in FOUR_OVER_SIX else _inputs("te/nvfp4_4over6")[-3:]):
        fused = fouroversix.fused_values(x, c, -1)
        assert fused is not None
        general = drift.quantize(x, name, return_info=True).values  # type: ignore[union-attr]
        assert torch.equal(_bits(fused), _bits(general)), name
        assert torch.equal(_bits(drift.quantize(x, name)), _bits(fused))  # quantize takes it
        compared += x.numel()
    assert compared > (100_000 if name in FOUR_OVER_SIX else 20_000)
    # along another axis, and block axes that are not whole blocks (padded, then cut back)
    x = torch.randn(32, 48)
    by_col = drift.quantize(x, name, axis=0)
    assert torch.equal(_bits(by_col), _bits(drift.quantize(x.T.contiguous(), name).T))
    for shape, axis in (((5, 20), -1), ((7, 3, 33), 1), ((9,), 0), ((3, 40), 0)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 7
        fused = fouroversix.fused_values(x, c, axis)
        general = drift.quantize(x, name, axis=axis, return_info=True).values  # type: ignore[union-attr]
        assert fused is not None and fused.stride() == general.stride()
        assert torch.equal(_bits(fused), _bits(general)), (name, shape, axis)


def test_what_the_fused_pass_leaves_to_the_general_steps() -> None:
    c = parse_cast("te/nvfp4_4over6")
    x = torch.randn(4, 32)
    assert fouroversix.fused_values(x, c, -1) is not None
    nan = x.clone()
    nan[1, 3] = float("nan")  # the amax policy's NaN and inf: the general steps
    assert fouroversix.fused_values(nan, c, -1) is None
    assert fouroversix.fused_values(x.double(), c, -1) is None
    assert fouroversix.fused_values(x, parse_cast("te/nvfp4"), -1) is None
    jit.set_jit("never")
    try:
        assert fouroversix.fused_values(x, c, -1) is None
    finally:
        jit.set_jit("auto")
    # NaN and inf blocks still come out as the general steps make them
    got = drift.quantize(nan, c)
    assert torch.equal(_bits(got), _bits(drift.quantize(nan, c, return_info=True).values))


def test_a_planted_reversed_error_sum_in_the_fused_pass_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The errors summed from the last element (each block's elements reversed on the way in
    and its values on the way out): the codes are the same, the sums' last bits are not, and
    the blocks whose choice hangs on the order part the two paths."""
    honest = jit.four_over_six_values

    def reversed_sum(blocks: torch.Tensor, *rest: Any) -> torch.Tensor:
        return honest(blocks.flip(1).contiguous(), *rest).flip(1)

    monkeypatch.setattr(jit, "four_over_six_values", reversed_sum)
    parted = 0
    for name in ("te/nvfp4_4over6", "te/nvfp4_4over6_fast"):
        for x in four_over_six_cases():
            fused = fouroversix.fused_values(x, parse_cast(name), -1)
            general = drift.quantize(x, name, return_info=True).values  # type: ignore[union-attr]
            assert fused is not None
            parted += int((_bits(fused) != _bits(general)).sum())
    assert parted > 0


def test_a_planted_one_chain_tile_sum_in_the_fused_pass_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused pass told a tile is one run (``runs=1``): its error one chain of 256
    additions in place of 16 row sums added by halves. The codes are the same, and the tiles
    whose choice hangs on the order of the sum part the fused pass from the general steps."""
    honest = jit.four_over_six_values

    def one_chain(*args: Any) -> torch.Tensor:
        return honest(*args[:8], 1)

    x = four_over_six_tile_case(keep=None)
    c = parse_cast("te/nvfp4_2d_4over6")
    general = drift.quantize(x, c, return_info=True).values  # type: ignore[union-attr]
    assert torch.equal(_bits(drift.quantize(x, c)), _bits(general))
    monkeypatch.setattr(jit, "four_over_six_values", one_chain)
    fused = fouroversix.fused_values(x, c, -1)
    assert fused is not None
    assert int((_bits(fused) != _bits(general)).sum()) > 0
