"""The fused pass's given-scales step (:mod:`driftcli.casts.given`): every implementation preset
(a scale arithmetic, four over six and row-scaled NVFP4 among them), every format with
micro-exponents and casts reading a Hadamard transform, counted by
:func:`driftcli.measures.stats.fused_stats` against the torch back-end's
:func:`~driftcli.measures.stats.cast_stats`: counts bit for bit, the float64 sums within the
bound of tests/test_fused_rounded.py (its module docstring: under 1e-12 of the sum of the terms'
magnitudes for the piece sizes here).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_fused_rounded import _counts_and_sums
from test_kernels import _tensor

from driftcli import kernels
from driftcli.casts import given
from driftcli.casts.hadamard import transformed
from driftcli.io.readers.memory import Held
from driftcli.measures.scan import ScanOptions, scan
from driftcli.measures.stats import (
    CastStats,
    cast_stats,
    clip_pass_takes,
    finite_amax,
    fused_stats,
)
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Overflow, Rounding
from driftcli.records.presets import PRESETS
from driftcli.records.recipes import IMPLEMENTATION_PRESETS

MICRO = [name for name, (c, _) in PRESETS.items() if c.micro is not None]
RHT = ["nvfp4:rht=te", "te/nvfp4_rht", "te/nvfp4_4over6:rht=random/7", "mxfp4_e2m1:rht=h"]
SPECS = [*IMPLEMENTATION_PRESETS, *MICRO, *RHT]
"""Every cast the given step (or the transform's route) takes: 43 presets, 3 micro formats,
4 transforms."""


def _torch(x: torch.Tensor, spec: str, seed: int | None, rounded: bool,
           axis: int = -1) -> CastStats:
    kernels.set_jit("never")
    try:
        return cast_stats(x, spec, seed=seed, want_values=False, rounded=rounded,
                          axis=axis)[0]
    finally:
        kernels.set_jit("auto")


def _same(spec: str, want: CastStats, got: CastStats) -> None:
    """:func:`test_fused_rounded._counts_and_sums`, where the rounded fields may be None (on
    both sides) and a sum NaN (on both sides: a scale made NaN by an inf in the tensor's amax
    makes every clip's excess NaN on either back-end)."""
    nan = [f for f in want.__dataclass_fields__
           if isinstance(getattr(want, f), float) and math.isnan(getattr(want, f))]
    none = [f for f in want.__dataclass_fields__ if getattr(want, f) is None]
    assert [f for f in nan if math.isnan(getattr(got, f))] == nan, spec
    assert [f for f in none if getattr(got, f) is None] == none, spec
    blank = dict.fromkeys([*nan, *none], 0.0)
    _counts_and_sums(spec, replace(want, **blank), replace(got, **blank))


def _specs(rounding: Rounding) -> list[str]:
    """Every cast of :data:`SPECS` under ``rounding``, each under both overflow policies."""
    out = []
    for spec in SPECS:
        head, _, rht = spec.partition(":rht=")
        tail = f":rht={rht}" if rht else ""
        out += [f"{head}:{rounding.value}:{o.value}{tail}" for o in Overflow]
    return out


def _check(x: torch.Tensor, specs: list[str], rounded: bool) -> dict[int, CastStats]:
    seeds = [300 + i for i in range(len(specs))]
    got = fused_stats(x, specs, rounded=rounded, seeds=seeds)
    assert sorted(got) == list(range(len(specs)))  # every one taken
    for i, st in got.items():
        _same(specs[i], _torch(x, specs[i], seeds[i], rounded), st)
    return got


@pytest.mark.parametrize("rounding", [pytest.param(r, marks=() if r in (Rounding.RNE, Rounding.SR)
                                                   else pytest.mark.slow) for r in Rounding],
                         ids=lambda r: r.value)
def test_every_given_cast_rounds_and_counts_as_the_torch_back_end(rounding: Rounding) -> None:
    """Every preset, micro format and transform under one rounding (stochastic draws seeded as
    cast_stats seeds them) and both overflow policies, rounded and not, with NaN and inf planted
    in one of two tensors (128 x 256: whole tiles of 128): the torch back-end's counts, bit for
    bit."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    specs = _specs(rounding)
    for specials in (False, True):
        x = _tensor(128, 256, seed=7, specials=specials)
        for rounded in (False, True):
            got = _check(x, specs, rounded)
            assert any(st.clipped for st in got.values())
            assert any(st.scale_clamped for st in got.values())
            assert any(st.nonfinite_groups for st in got.values()) == specials
            if rounded:
                assert any(st.underflowed for st in got.values())
                assert any(st.subnormal for st in got.values())


def test_blocks_tiles_and_channels_along_another_axis() -> None:
    """Scale groups along dim 0 of a 3-D tensor (blocks, tiles of the moved layout's last two
    dims, channels, micro-exponents' blocks, a transform): read from their block layout's copy,
    the torch back-end's counts."""
    specs = ["deepseek/v3", "deepseek/v3_weight", "torchao/float8_rowwise", "te/nvfp4_2d",
             "mx6", "te/nvfp4_rht:sr"]
    x = _tensor(256, 384, seed=5, specials=True).view(256, 3, 128)
    seeds = [50 + i for i in range(len(specs))]
    for rounded in (False, True):
        got = fused_stats(x, specs, axis=0, rounded=rounded, seeds=seeds)
        assert sorted(got) == list(range(len(specs)))
        for i, st in got.items():
            _same(specs[i], _torch(x, specs[i], seeds[i], rounded, axis=0), st)


def test_the_given_steps_routes() -> None:
    """Which casts take the given step: a scale arithmetic and micro-exponents; not drift's
    exact arithmetic (the flat route's), a transform (its copy's), padded blocks or tiles, nor
    a dtype other than float32; the scan's check agrees, transforms included."""
    f32 = torch.float32

    def route(spec: str, shape: tuple[int, ...] = (128, 256),
              dtype: torch.dtype = f32) -> given.GivenStep | None:
        return given.given_route(parse_cast(spec), shape, -1, dtype)

    assert route("te/nvfp4") is given.GivenStep.ARITH
    assert route("deepseek/v3_weight") is given.GivenStep.ARITH
    assert route("mx9") is given.GivenStep.MICRO
    assert route("mxfp8_e4m3") is None and route("te/nvfp4_rht") is None
    assert route("torchao/mxfp8", (4, 48)) is None  # 48 is not whole blocks of 32
    assert route("deepseek/v3_weight", (64, 256)) is None  # 64 rows: a part tile
    # along dim 0 of (256, 3, 128): tiles of the moved layout's (128, 256), whole
    assert given.given_route(parse_cast("deepseek/v3_weight"), (256, 3, 128), 0, f32) is \
        given.GivenStep.ARITH
    assert given.given_route(parse_cast("deepseek/v3_weight"), (256, 3, 64), 0, f32) is None
    assert route("te/nvfp4", dtype=torch.float64) is None
    assert clip_pass_takes((128, 256), f32, SPECS)
    assert not clip_pass_takes((64, 256), f32, ["deepseek/v3_weight"])


def test_a_wrong_operand_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted fault: one group's operands off by a factor of two (its clips, roundings and
    errors change) is caught by the comparison."""
    real = given._operands

    def planted(*args: object, **kwargs: object) -> object:
        op, clamped, bad = real(*args, **kwargs)  # type: ignore[arg-type]
        ins = op.ins.copy()
        ins[:4] *= 0.5 if op.mul else 2.0
        return op._replace(ins=ins), clamped, bad

    monkeypatch.setattr(given, "_operands", planted)
    x = _tensor(128, 256, seed=7, specials=False)
    for spec in ("te/nvfp4", "mx6"):
        with pytest.raises(AssertionError):
            _check(x, [spec], rounded=True)


def test_slices_and_threads_give_the_same_bits() -> None:
    """Slices starting on the pass's pieces (rows of 4,096 elements), merged, and one or two
    threads: every count and sum of the given casts the same bits as the whole tensor's."""
    specs = ["te/nvfp4", "torchao/float8_tensorwise", "te/nvfp4_row_4over6", "hifloat4",
             "te/nvfp4_rht"]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(48, 4096, generator=gen) * torch.exp(torch.randn(48, 4096, generator=gen))
    amax = float(x.abs().max())
    rht_amax = {4: finite_amax(transformed(x, parse_cast(specs[4])))}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = fused_stats(x, specs, rounded=True)
        torch.set_num_threads(2)  # 196,608 elements: two threads' slices
        runs = [fused_stats(x, specs, rounded=True)]
        runs.append({i: CastStats.merge([p[i] for p in parts], per_tensor=i == 1)
                     for parts in [[fused_stats(x[a:a + 16], specs, rounded=True,
                                                tensor_amax=amax, rht_amax=rht_amax)
                                    for a in range(0, 48, 16)]] for i in range(len(specs))})
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        for i, spec in enumerate(specs):
            assert run[i] == whole[i], spec


def test_the_scan_counts_given_casts_as_cast_stats() -> None:
    """The scan, in slices, sends the given casts through the pass: its rows are the torch
    back-end's counts of the whole tensor."""
    specs = ["torchao/float8_rowwise", "te/nvfp4_rht", "mx9", "deepseek/v3_weight"]
    x = _tensor(256, 256, seed=3, specials=False)
    got = scan([Held("t", {"w": x})], specs, options=ScanOptions(chunk_elements=128 * 256),
               rounded=True).results
    for i, spec in enumerate(specs):
        want = _torch(x, spec, None, True)
        assert got[i].draws[0].clipped == want.clipped
        _counts_and_sums(spec, want, got[i].draws[0])
    assert math.isfinite(got[0].draws[0].ee or math.nan)


@pytest.mark.parametrize("special", [math.inf, math.nan])
@pytest.mark.parametrize("chunk", [None, 64 * 64])
def test_a_scan_reads_the_tensor_amax_as_each_casts_policy_does(special: float,
                                                                chunk: int | None) -> None:
    """An inf or NaN in one slice makes the tensor's amax inf or NaN for a scale arithmetic
    whose amax lets it through (torchao's ``ieee``, Transformer Engine's ``fmax``): the scan's
    rows, in one slice and in four, are the torch back-end's counts of the whole tensor, and
    drift's own casts beside them keep the finite amax. (Found by review: the scan handed
    every cast the finite amax.)"""
    specs = ["torchao/float8_tensorwise", "te/nvfp4", "te/float8_current", "nvfp4", "fp8_e4m3"]
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(5))
    x[200, 7] = special  # in the last slice of four
    got = scan([Held("t", {"w": x})], specs, rounded=True,
               options=ScanOptions() if chunk is None else
               ScanOptions(chunk_elements=chunk)).results
    for i, spec in enumerate(specs):
        _same(spec, _torch(x, spec, None, True), got[i].draws[0])
    # the policy's amax reached the casts that read it: every element of torchao's lost
    assert got[0].draws[0].lost == x.numel() - 1
