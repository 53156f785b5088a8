"""The fast path: agreement with torch's native casts, dtypes, SR, both back-ends."""

from __future__ import annotations

import pytest
import torch

import driftcli as drift
from driftcli import kernels
from driftcli.errors import DriftError
from driftcli.verify import float32_inputs


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())


def _probe_inputs() -> torch.Tensor:
    """Every bfloat16 bit pattern, 2**20 random float32 bit patterns, and e4m3/e5m2 boundaries."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    bf16 = every_bf16.view(torch.bfloat16).float()
    gen = torch.Generator().manual_seed(7)
    random = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen,
                           dtype=torch.int64).to(torch.int32).view(torch.float32)
    edges = [float32_inputs(drift.FORMATS[n], 1) for n in ("float8_e4m3fn", "float8_e5m2")]
    return torch.cat([bf16, random, *edges])


@pytest.mark.parametrize(("dtype", "name", "overflow"), [
    (torch.float8_e4m3fn, "float8_e4m3fn", "saturate"),   # torch saturates, ±inf included
    (torch.float8_e5m2, "float8_e5m2", "ieee"),           # torch overflows to ±inf
    (torch.float8_e4m3fnuz, "float8_e4m3fnuz", "ieee"),   # overflow and inf give NaN
    (torch.float8_e5m2fnuz, "float8_e5m2fnuz", "ieee"),
])
def test_float8_casts_match_torch_bit_for_bit(dtype: torch.dtype, name: str, overflow: str) -> None:
    x = _probe_inputs()
    native = x.to(dtype).float()
    ours = drift.round_to_format(x, name, overflow=overflow)
    same = _same(native, ours)
    assert int((~same).sum()) == 0, x[~same][:8].tolist()
    assert x.numel() > 1_100_000


def test_e8m0_matches_torch_on_positive_normal_floats() -> None:
    """torch's E8M0 cast drops the sign and reads subnormal inputs off raw bits; drift is exact."""
    x = _probe_inputs()
    normal = x[(x > 0) & (x >= 2**-126) & torch.isfinite(x)]
    native = normal.to(torch.float8_e8m0fnu).float()
    ours = drift.round_to_format(normal, "float8_e8m0fnu", overflow="ieee")
    assert bool(_same(native, ours).all())
    # where torch differs: 8.66e-39 lies 1.47 of the way from 2**-127 to 2**-126: nearest is 2**-127
    sub = torch.tensor([1.47 * 2**-127])
    assert sub.to(torch.float8_e8m0fnu).item() == 2**-126
    assert drift.round_to_format(sub, "float8_e8m0fnu").item() == 2**-127


def test_result_dtype_follows_the_input_when_it_holds_the_format() -> None:
    x = torch.randn(64)
    assert drift.round_to_format(x.bfloat16(), "float8_e4m3fn").dtype == torch.bfloat16
    assert drift.round_to_format(x.half(), "float8_e5m2").dtype == torch.float16
    assert drift.round_to_format(x.half(), "bfloat16").dtype == torch.float32
    assert drift.round_to_format(x.double(), "float4_e2m1fn").dtype == torch.float64
    # widening is exact: bf16 input gives the same values as its float32 widening
    b = x.bfloat16()
    assert torch.equal(drift.round_to_format(b, "float8_e4m3fn").float(),
                       drift.round_to_format(b.float(), "float8_e4m3fn"))


def test_float64_inputs_are_rounded_exactly() -> None:
    # 1 + 2**-24 is the tie between 1 and 1 + 2**-23; a float64 tail of 2**-40 lifts it above
    x = torch.tensor([1 + 2**-24 + 2**-40, 1 + 2**-24, -(1 + 2**-24)], dtype=torch.float64)
    got = drift.round_to_format(x, "float32")
    assert got.tolist() == [1 + 2**-23, 1.0, -1.0]


def test_negative_zero_and_nan_on_formats_without_them() -> None:
    x = torch.tensor([-0.0, float("nan"), -1e-9, float("-inf")])
    fp4 = drift.round_to_format(x, "float4_e2m1fn")
    assert torch.signbit(fp4[0]) and fp4[1].isnan() and torch.signbit(fp4[2]) and fp4[3] == -6
    fnuz = drift.round_to_format(x, "float8_e4m3fnuz", overflow="ieee")
    assert not torch.signbit(fnuz[0]) and fnuz[1].isnan() and fnuz[3].isnan()


def test_stochastic_rounding_is_reproducible_and_unbiased() -> None:
    x = torch.full((200_000,), 1 + 3 / 16)  # 3/8 of the way from 1 to 1.125 in e4m3 (quantum 1/8)
    a = drift.stochastic_round(x, "float8_e4m3fn", seed=3)
    b = drift.stochastic_round(x, "float8_e4m3fn", seed=3)
    assert torch.equal(a, b)
    share_up = float((a == 1.25).double().mean())
    assert set(a.unique().tolist()) == {1.125, 1.25}
    assert abs(share_up - 0.5) < 0.01  # f = 1/2 of the way from 1.125 to 1.25
    assert abs(float(a.double().mean()) - (1 + 3 / 16)) < 1e-3


def test_bad_inputs_raise_drift_errors() -> None:
    with pytest.raises(DriftError, match="unknown rounding mode 'nearest'"):
        drift.round_to_format(torch.ones(2), "float16", rounding="nearest")
    with pytest.raises(DriftError, match="needs random_bits"):
        drift.round_to_format(torch.ones(2), "float16", rounding="sr")
    with pytest.raises(DriftError, match=r"dtype torch\.int64"):
        drift.round_to_format(torch.ones(2, dtype=torch.int64), "float16")
    with pytest.raises(DriftError, match="unknown overflow policy"):
        drift.round_to_format(torch.ones(2), "float16", overflow="wrap")


def test_scaled_casts_are_bit_identical_on_both_back_ends() -> None:
    """quantize on numba (block amax, scale rule, cast) against the torch back-end."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(96, 200, generator=gen) * torch.exp2(torch.randint(-30, 30, (96, 1),
                                                                       generator=gen))
    x[3, 7], x[4, 0], x[5] = float("nan"), float("inf"), 0.0
    try:
        for spec in ("mxfp8_e4m3", "mxfp4_e2m1_ceil:sr", "nvfp4", "fp8_e4m3"):
            kernels.set_jit("never")
            reference = drift.quantize(x, spec, seed=1)
            kernels.set_jit("auto")
            fast = drift.quantize(x, spec, seed=1)
            assert torch.equal(reference.view(torch.int32), fast.view(torch.int32)), spec
    finally:
        kernels.set_jit("auto")
