"""quantize's route, decided once by :func:`driftcli.casts.route.cast_route` (issue 41): the
route it gives for a table of casts and tensors on each back-end, and ``quantize`` following
the record it is handed (a step swapped in the record changes the kernel that runs; a step
broken where the record does not lead changes nothing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kernel_paths import kernel_path

from driftcli.casts import quantization
from driftcli.casts.quantization import QuantInfo, quantize
from driftcli.casts.route import Backend, BlockStep, CastRoute, ValuesStep, cast_route
from driftcli.kernels import jit
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Rounding

V, B = ValuesStep, BlockStep
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

ROUTES = [
    # cast, dtype, shape, axis: the values step on numba, the block step
    ("mxfp8_e4m3", F32, (4, 64), -1, V.POW2_ROWS, B.POW2),
    ("mxfp8_e4m3", F32, (64, 4), 0, V.POW2_ROWS, B.POW2),
    ("mxfp8_e4m3", F32, (5, 37), -1, V.POW2_ROWS, B.POW2),  # a partial block, padded
    ("mxfp8_e4m3", BF16, (4, 64), -1, None, B.POW2),  # the one-pass kernels read float32
    ("mxfp8_e4m3", F64, (4, 64), 0, None, B.POW2),
    ("mxfp8_e4m3", F32, (0, 32), -1, None, B.UNSCALED),  # no element, nothing to scale
    ("mxint8", F32, (3, 33), 0, V.POW2_ROWS, B.POW2),
    ("nvfp4", F32, (4, 64), -1, V.TWO_LEVEL, B.DIVIDED),
    ("nvfp4", F32, (7, 10), 0, V.TWO_LEVEL, B.DIVIDED),
    ("nvfp4", BF16, (4, 64), -1, None, B.DIVIDED),
    ("nvfp4_2d", F32, (32, 32), -1, None, B.DIVIDED),  # tiles: the general steps
    ("fp8_e4m3", F32, (4, 64), -1, None, B.DIVIDED),  # one scale for the tensor
    ("bf16", F32, (4, 64), -1, None, B.UNSCALED),
    ("bf16", F64, (5, 37), 0, None, B.UNSCALED),
    ("hifloat4", F32, (4, 64), -1, V.MICRO, B.MICRO),
    ("hifloat4", F32, (5, 37), 0, V.MICRO, B.MICRO),
    ("mx9", BF16, (4, 64), -1, None, B.MICRO),
    ("te/nvfp4_4over6", F32, (4, 64), -1, V.FOUR_OVER_SIX, B.ARITH),
    ("te/nvfp4_4over6", F64, (4, 64), -1, None, B.ARITH),
    ("te/nvfp4_row", F32, (4, 64), -1, None, B.ARITH),
    ("deepseek/v3", F32, (5, 200), 0, None, B.ARITH),
    ("torchao/float8_rowwise", BF16, (4, 64), -1, None, B.ARITH),
]


@pytest.mark.parametrize("backend", ["torch", "jit"])
@pytest.mark.parametrize(("spec", "dtype", "shape", "axis", "values", "blocks"), ROUTES)
def test_the_route_of_a_cast_and_a_tensor(spec: str, dtype: torch.dtype,
                                          shape: tuple[int, ...], axis: int,
                                          values: ValuesStep | None, blocks: BlockStep,
                                          backend: str) -> None:
    x = torch.zeros(shape, dtype=dtype)
    with kernel_path(backend):
        got = cast_route(parse_cast(spec), x, axis)
    numba = backend == "jit"
    assert got == CastRoute(values if numba else None, blocks,
                            Backend.NUMBA if numba else Backend.TORCH)


def test_the_rounding_picks_the_power_of_two_rows_kernel_and_a_gradient_picks_torch() -> None:
    c = parse_cast("mxfp8_e4m3")
    x = torch.zeros(4, 64)
    with kernel_path("jit"):
        assert cast_route(dataclasses.replace(c, rounding=Rounding.SR), x).values is V.POW2_ROWS
        assert cast_route(dataclasses.replace(c, rounding=Rounding.RTZ), x).values is V.POW2_BITS
        # numba's kernels refuse a tensor that needs a gradient: the torch back-end casts it
        assert cast_route(c, x.requires_grad_()) == CastRoute(None, B.POW2, Backend.TORCH)


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of ``module.name``, which still runs."""
    real: Callable[..., Any] = getattr(module, name)
    calls: list[int] = []

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def _handed(monkeypatch: pytest.MonkeyPatch, **change: Any) -> None:
    """Hand ``quantize`` the route :func:`cast_route` decides, with ``change`` made to it."""
    monkeypatch.setattr(quantization, "cast_route",
                        lambda *a: dataclasses.replace(cast_route(*a), **change))


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(6, 64, generator=g) * torch.logspace(-8, 8, 64)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


KERNELS = ("pow2_block_scales", "round_pow2_rows", "round_bits", "two_level_block_scales",
           "round_divided", "micro_cast", "block_amax", "four_over_six_values")
"""The numba kernels of the values steps (and of the block steps after them)."""


@pytest.mark.parametrize(("spec", "step", "ran"), [
    ("mxfp8_e4m3", V.POW2_ROWS, {"pow2_block_scales", "round_pow2_rows"}),
    ("mxfp8_e4m3", V.POW2_BITS, {"pow2_block_scales", "round_bits"}),
    ("nvfp4", V.TWO_LEVEL, {"two_level_block_scales", "round_divided"}),
    ("hifloat4", V.MICRO, {"micro_cast"}),
    ("te/nvfp4_4over6", V.FOUR_OVER_SIX, {"block_amax", "four_over_six_values"}),
])
def test_quantize_takes_the_values_step_of_its_route(spec: str, step: ValuesStep, ran: set[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels of the step the record names run, and only they, and their values are the
    block steps' bit for bit; handed no values step, quantize casts by the block steps.
    ``mxfp8_e4m3`` is decided the rows kernel (round to nearest even): handed ``round_bits``
    instead, it takes that."""
    x = _data()
    with kernel_path("jit"):
        want = quantize(x, spec, return_info=True)
        assert isinstance(want, QuantInfo)
        calls = {name: _spy(monkeypatch, jit, name) for name in KERNELS}
        _handed(monkeypatch, values=step)
        got = quantize(x, spec)
        assert isinstance(got, torch.Tensor) and _same(got, want.values)
        assert {name for name, n in calls.items() if n} == ran
        for n in calls.values():
            n.clear()
        _handed(monkeypatch, values=None)
        assert _same(quantize(x, spec), want.values)  # type: ignore[arg-type]
        assert {name for name, n in calls.items() if n} != ran


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values, NaN where NaN (whatever its payload), zeros of the same sign."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]) and \
        torch.equal(a[~nan].signbit(), b[~nan].signbit())


@pytest.mark.parametrize("spec", ["mxfp8_e4m3", "nvfp4", "te/nvfp4_row", "fp8_e4m3"])
def test_quantize_takes_the_back_end_of_its_route(spec: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted fault in numba's block amax is caught on the numba route and never met on a
    route handed the torch back-end, whose results are numba's bit for bit."""
    x = _data()
    x[2, 3] = torch.nan
    with kernel_path("jit"):
        want = quantize(x, spec, return_info=True)
        assert isinstance(want, QuantInfo)

        def broken(*_: Any) -> Any:
            raise RuntimeError("the planted block amax ran")

        monkeypatch.setattr(jit, "block_amax", broken)
        with pytest.raises(RuntimeError, match="planted block amax"):
            quantize(x, spec, return_info=True)
        _handed(monkeypatch, backend=Backend.TORCH)
        got = quantize(x, spec, return_info=True)
    assert isinstance(got, QuantInfo)
    for f in dataclasses.fields(QuantInfo):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(a, torch.Tensor):
            assert _identical(a, b), f.name
        else:
            assert a == b or (a != a and b != b), f.name


def test_a_values_step_that_declines_leaves_the_block_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A power-of-two grid beyond float32's range (2**120 times E4M3's 2**8): the rows kernel
    finds the scales and declines, and the block steps round in float64, as with
    ``return_info``."""
    x = torch.tensor([[3e38] * 31 + [1e-45]])
    c = parse_cast("mxfp8_e4m3_floor+1")
    with kernel_path("jit"):
        assert cast_route(c, x).values is V.POW2_ROWS
        info = quantize(x, c, return_info=True)
        assert isinstance(info, QuantInfo)
        scales, rows = (_spy(monkeypatch, jit, n) for n in ("pow2_block_scales",
                                                              "round_pow2_rows"))
        assert _same(quantize(x, c), info.values)  # type: ignore[arg-type]
    assert (len(scales), len(rows)) == (1, 0)
    assert float(info.values[0, 0]) == 3e38 or float(info.scales[0]) == 2.0**120
