"""Both kernel back-ends give the same bits: torch's ops and numba's machine code, over every
format, rounding mode and overflow policy, scaled casts of every preset, sums with a residual,
and float64 sources; and numba's path is there without a C++ compiler, and stays out of the way
without numba."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_paths import kernel_path

import driftcli as drift
from driftcli.casts import rounding
from driftcli.casts.scaling import block_stats
from driftcli.kernels import jit
from driftcli.records.modes import Overflow, Rounding
from driftcli.records.presets import PRESETS
from driftcli.verify import float32_inputs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _float32_cases() -> torch.Tensor:
    """Every bfloat16 bit pattern (every sign, binade, subnormal, inf and NaN of float32's
    range at 8 bits of precision), 2**18 random float32 bit patterns, and every rounding
    boundary of every format of at most 16 bits."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gen = torch.Generator().manual_seed(3)
    random = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen,
                           dtype=torch.int64).to(torch.int32).view(torch.float32)
    edges = [float32_inputs(f, 1, n_tiny=256) for f in drift.FORMATS.values() if f.bits <= 16]
    return torch.cat([every_bf16.view(torch.bfloat16).float(), random, *edges])


def _float64_cases() -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    random = torch.randint(-(2**63), 2**63 - 1, (1 << 16,), generator=gen,
                           dtype=torch.int64).view(torch.float64)
    return torch.cat([random, _float32_cases()[:: 7].double()])


X32 = _float32_cases()
X64 = _float64_cases()
CELLS = [(fmt, mode, policy) for fmt in drift.FORMATS for mode in Rounding for policy in Overflow]


def _round_on(path: str, x: torch.Tensor, fmt: str, mode: Rounding, policy: Overflow,
              sr_bits: int = 8) -> torch.Tensor:
    random = rounding.draw_random_bits(x.shape, 9, sr_bits) if mode is Rounding.SR else None
    with kernel_path(path):
        return drift.round_to_format(x, fmt, rounding=mode, overflow=policy,
                                     random_bits=random, sr_bits=sr_bits)


@pytest.mark.slow
def test_every_format_mode_and_policy_agrees_with_torch() -> None:
    """The numba kernels against torch's eager kernel: the lean float32 one on every cell of
    every format, the general one (float64 inputs) on every format and every mode."""
    compared = 0
    cells64 = [(fmt, Rounding.RNE, Overflow.SATURATE) for fmt in drift.FORMATS]
    cells64 += [("float8_e4m3fnuz", mode, Overflow.IEEE) for mode in Rounding]
    for x, cells in ((X32, CELLS), (X64, cells64)):
        for fmt, mode, policy in cells:
            want = _round_on("torch", x, fmt, mode, policy)
            got = _round_on("jit", x, fmt, mode, policy)
            assert torch.equal(_bits(want), _bits(got)), (x.dtype, fmt, mode, policy)
            compared += x.numel()
    assert compared > len(CELLS) * 1_000_000


@pytest.mark.parametrize("sr_bits", [1, 23, 30])
def test_stochastic_rounding_agrees_at_every_width(sr_bits: int) -> None:
    for fmt in ("float8_e4m3fn", "float4_e2m1fn", "bfloat16", "float8_e8m0fnu", "int4"):
        for x in (X32, X64[:4096]):
            want = _round_on("torch", x, fmt, Rounding.SR, Overflow.IEEE, sr_bits)
            got = _round_on("jit", x, fmt, Rounding.SR, Overflow.IEEE, sr_bits)
            assert torch.equal(_bits(want), _bits(got)), (fmt, x.dtype, sr_bits)


def test_float64_sums_agree_on_both_back_ends() -> None:
    """``add`` on float64 work: a format's bit counts against float64's 52 fraction bits."""
    x = torch.cat([X64[: 1 << 14], torch.randn(3001, dtype=torch.float64)])
    a, b = x[: 1 << 12], x[1 << 12 : 1 << 13]
    outs = []
    for path in ("torch", "jit"):
        with kernel_path(path):
            outs.append(drift.add(a, b, "float8_e4m3fn", rounding="rtz", overflow="ieee"))
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))


def test_sums_with_a_residual_agree() -> None:
    """``add`` rounds a float64 sum and its exact error (a sticky residual) in one step."""
    gen = torch.Generator().manual_seed(8)
    a = X64[: 1 << 15]
    b = -a * (1 + torch.randn(a.shape, generator=gen, dtype=torch.float64) * 2.0**-30)
    b[::3] = torch.randn(b[::3].shape, generator=gen, dtype=torch.float64) * 1e-20
    for fmt in ("float32", "bfloat16", "float8_e4m3fn", "float4_e2m1fn"):
        for mode in (Rounding.RNE, Rounding.RTZ, Rounding.RUP, Rounding.RDOWN, Rounding.RNA):
            outs = []
            for path in ("torch", "jit"):
                with kernel_path(path):
                    outs.append(drift.add(a, b, fmt, rounding=mode, overflow="ieee"))
            assert torch.equal(_bits(outs[0]), _bits(outs[1])), (fmt, mode)


def _scaled_cases() -> torch.Tensor:
    """Rows 32 elements wide across float32's whole range: NaN, inf and all-zero blocks,
    blocks whose scale clamps at either end, and blocks whose grid leaves float32's range."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(512, 96, generator=gen) * torch.exp2(
        torch.randint(-150, 128, (512, 1), generator=gen).float()).clamp(max=2.0**127)
    x[:64] = X32[: 64 * 96].reshape(64, 96)
    x[70, 5], x[71, 40], x[72] = float("nan"), float("-inf"), 0.0
    x[73] = 2.0**-149
    x[74] = 3.0e38
    return x


@pytest.mark.parametrize("spec", sorted(PRESETS))
def test_every_preset_agrees_on_both_paths(spec: str) -> None:
    """Values, scales and clip masks of every preset, deterministic and stochastic, on torch's
    kernels and numba's (quantize on both back-ends: test_rounding.py)."""
    x = _scaled_cases()
    for s in dict.fromkeys((spec, f"{spec}:sr")):
        runs = []
        for path in ("torch", "jit"):
            with kernel_path(path):
                runs.append((drift.quantize(x, s, seed=2),
                             drift.quantize(x, s, seed=2, return_info=True)))
        (want, want_info), (got, info) = runs
        assert torch.equal(_bits(want), _bits(got)), s
        assert torch.equal(_bits(want_info.scales), _bits(info.scales)), s
        assert torch.equal(want_info.clipped, info.clipped), s
        assert torch.equal(want_info.underflowed, info.underflowed), s


def test_per_channel_and_other_axes_agree() -> None:
    x = _scaled_cases()
    for spec in ("float8_e4m3fn:channel:float32:amax", "float8_e5m2:tensor:float32:amax-rne",
                 "mxfp8_e4m3", "nvfp4_2d"):
        for axis in (0, 1):
            outs = []
            for path in ("torch", "jit"):
                with kernel_path(path):
                    outs.append(drift.quantize(x, spec, axis=axis))
            assert torch.equal(_bits(outs[0]), _bits(outs[1])), (spec, axis)


def test_float64_tensors_take_the_general_kernel() -> None:
    x = _scaled_cases().double() * 2.0**-900
    for spec in ("mxfp8_e4m3", "nvfp4", "fp8_e4m3"):
        outs = []
        for path in ("torch", "jit"):
            with kernel_path(path):
                outs.append(drift.quantize(x, spec))
        assert outs[0].dtype == torch.float64
        assert torch.equal(_bits(outs[0]), _bits(outs[1])), spec


def test_block_amax_reads_what_block_stats_reads() -> None:
    blocks = _scaled_cases().reshape(-1, 32)
    amax, bad = jit.block_amax(blocks)
    stats = block_stats(blocks)
    assert torch.equal(_bits(amax), _bits(stats.amax)) and torch.equal(bad, stats.nonfinite)
    assert bool(bad[210]) and bool(bad[214]) and not bool(bad[216])  # NaN, -inf, zeros


def test_threads_split_the_work_without_changing_it() -> None:
    x = torch.randn(1 << 20) * 50
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(drift.quantize(x, "mxfp6_e2m3"))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(_bits(outs[0]), _bits(o)) for o in outs[1:])


NO_NUMBA = """
import sys
sys.modules["numba"] = None  # import numba raises ImportError
import torch, driftcli as drift
from driftcli.kernels import jit
x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 30
print(jit.jit_unavailable())
print(drift.quantize(x, "mxfp8_e4m3").view(torch.int32).sum().item())
"""

WITHOUT_COMPILER = """
import shutil, torch, driftcli as drift
from driftcli.kernels import jit
x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 30
print(shutil.which("c++") or shutil.which("g++") or "no C++ compiler")
print(jit.jit_unavailable())
print(drift.quantize(x, "mxfp8_e4m3").view(torch.int32).sum().item())
"""


def _python(code: str, **env: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, **env})
    return proc.stdout.strip().splitlines()


def test_without_numba_the_torch_kernels_give_the_same_bits() -> None:
    reason, total = _python(NO_NUMBA)
    assert reason.startswith("numba is not importable") and "pip install numba" in reason
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 30
    assert int(total) == drift.quantize(x, "mxfp8_e4m3").view(torch.int32).sum().item()


def test_without_a_cpp_compiler_numba_still_runs() -> None:
    """numba brings its own LLVM: no c++ on PATH and no CXX changes nothing."""
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    bin_dir = os.path.dirname(sys.executable)
    no_cc, none, total = subprocess.run(
        [sys.executable, "-c", WITHOUT_COMPILER], capture_output=True, text=True, check=True,
        env={**env, "PATH": bin_dir}).stdout.strip().splitlines()
    assert no_cc.startswith("no C++ compiler") and none == "None"
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 30
    assert int(total) == drift.quantize(x, "mxfp8_e4m3").view(torch.int32).sum().item()


def test_a_bad_jit_mode_is_refused() -> None:
    with pytest.raises(drift.DriftError, match="unknown jit mode 'fast'"):
        jit.set_jit("fast")


CACHED = """
import torch, driftcli as drift
import driftcli.kernels.jitcode as code
drift.round_to_format(torch.randn(100), "float8_e5m2")
stats = code.flat_kernel(0, 0, True, False, False, False, False).stats
print(drift.__file__, sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
"""


def test_a_copy_of_drift_elsewhere_loads_the_kernels_another_compiled(tmp_path: Path) -> None:
    """The machine code is cached by the kernels' source, not by its folder: a new checkout or
    environment of the same drift compiles nothing."""
    import shutil

    import driftcli

    cache = tmp_path / "cache"
    first = _python(CACHED, NUMBA_CACHE_DIR=str(cache))[-1].split()
    copy = tmp_path / "copy"
    shutil.copytree(Path(driftcli.__file__).parent, copy / "driftcli",
                    ignore=shutil.ignore_patterns("__pycache__"))
    second = subprocess.run(  # from tmp_path: `python -c` puts its folder first on sys.path
        [sys.executable, "-c", CACHED], capture_output=True, text=True, check=True,
        cwd=tmp_path, env={**os.environ, "NUMBA_CACHE_DIR": str(cache),
                           "PYTHONPATH": str(copy)}).stdout.strip().splitlines()[-1].split()
    assert first[1:] == ["0", "1"]  # compiled here
    assert second[0].startswith(str(copy)) and second[1:] == ["1", "0"]  # loaded, not compiled
