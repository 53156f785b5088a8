"""Block-FMA accumulation against real tensor cores: every recording of
``../shared/data/hw-tensor-cores/`` reproduced bit for bit by its GPU's preset."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from functools import cache
from pathlib import Path

import pytest
import torch

from driftcli.arith.blockfma import FMAUnit
from driftcli.arith.tensorcores import CORES, Recordings, TensorCore, dot, read_recordings
from driftcli.casts.rounding import round_to_format
from driftcli.errors import DriftError
from driftcli.records.modes import Rounding

HW = Path(__file__).resolve().parents[2] / "shared" / "data" / "hw-tensor-cores"
requires_recordings = pytest.mark.skipif(
    not HW.exists(), reason="../shared/data/hw-tensor-cores not present (fresh clone outside "
                            "the workspace)")
FOLDERS = sorted(f"{g.name}/{f.name}" for g in HW.iterdir() if g.is_dir()
                 for f in g.iterdir() if f.is_dir()) if HW.exists() else []
SHORT = {"fp16": "fp16", "bf16": "bf16", "tf32": "tf32", "E4M3": "e4m3", "E5M2": "e5m2"}


@cache
def _recordings(folder: str) -> Recordings:
    return read_recordings(HW / folder)


def _harness_c(r: Recordings, out: str) -> torch.Tensor:
    """The c each instruction saw: the recording harness rounded it to fp16 for an fp16
    result, and H100's FP8 WGMMA runs (float32 result) used c = 0 (the data's README)."""
    if out == "fp16":
        return round_to_format(r.c, "float16").double()
    if r.gpu == "H100" and r.inputs.startswith("E"):
        return torch.zeros_like(r.c)
    return r.c


def _reproduced(r: Recordings, out: str, unit: TensorCore) -> int:
    got = dot(r.a, r.b, _harness_c(r, out), unit).float().view(torch.int32)
    return int((got == r.d[out].float().view(torch.int32)).sum())


@requires_recordings
@pytest.mark.parametrize("folder", FOLDERS)
def test_every_recording_is_reproduced_bit_for_bit_by_its_preset(folder: str) -> None:
    r = _recordings(folder)
    assert r.d and r.a.shape[0] == 5000
    for out in r.d:
        unit = CORES[f"{r.gpu.lower()}_{SHORT[r.inputs]}_f{out[2:]}"]
        assert _reproduced(r, out, unit) == 5000, (folder, out)


@requires_recordings
@pytest.mark.parametrize(("folder", "unit_change", "change"), [
    ("H100/E4M3", {"kept_bits": 14}, {}),  # the planted fault: one alignment bit too many
    ("H100/E4M3", {"kept_bits": 12}, {}),
    ("H100/fp16", {"kept_bits": 24}, {}),
    ("A100/bf16", {"size": 4}, {}),
    ("Ada/E5M2", {}, {"rounding": Rounding.RNE}),
])
def test_a_model_one_parameter_off_is_caught_by_the_recordings(folder: str, unit_change: dict,
                                                                change: dict) -> None:
    r = _recordings(folder)
    core = CORES[f"{r.gpu.lower()}_{SHORT[r.inputs]}_f32"]
    core = dataclasses.replace(core, unit=dataclasses.replace(core.unit, **unit_change),
                               **change)
    assert _reproduced(r, "fp32", core) < 4900


def _exact_block(a: list[Fraction], b: list[Fraction], c: Fraction, kept: int, emin: int
                 ) -> Fraction:
    """One block by hand, in rationals: terms cut toward zero to 2**(E - kept)."""
    def exp_of(x: Fraction) -> int:
        e = x.numerator.bit_length() - x.denominator.bit_length()
        return e if Fraction(2) ** e <= x else e - 1

    def exp(x: Fraction) -> int:
        return max(exp_of(x), emin)
    exps = [exp(abs(x)) + exp(abs(y)) for x, y in zip(a, b, strict=True) if x and y]
    if c:
        exps.append(max(exp_of(abs(c)), -126))  # c's exponent: a float32's
    top = max(exps)
    unit = Fraction(2) ** (top - kept)

    def cut(t: Fraction) -> Fraction:
        q = abs(t) / unit
        return (q.numerator // q.denominator) * unit * (1 if t >= 0 else -1)
    return sum((cut(x * y) for x, y in zip(a, b, strict=True)), cut(c))


def test_one_block_is_the_cut_terms_summed_and_rounded_once() -> None:
    gen = torch.Generator().manual_seed(4)
    a = round_to_format(torch.randn(400, 16, generator=gen), "float8_e4m3fn").double()
    b = round_to_format(torch.randn(400, 16, generator=gen) * 3, "float8_e4m3fn").double()
    a[::7, 3] = 2.0**-9  # a subnormal input: its exponent is the format's smallest, -6
    c = round_to_format(torch.randn(400, generator=gen), "e8m13").double()
    c[::18] *= 2.0**8  # rows where c holds the largest exponent, and rows where it is tiny
    c[9::18] *= 2.0**-12
    unit = TensorCore("float8_e4m3fn", FMAUnit(16, 13), "e8m13", Rounding.RTZ)
    got = dot(a, b, c, unit)
    for i in range(0, 400, 9):
        exact = _exact_block([Fraction(v) for v in a[i].tolist()],
                             [Fraction(v) for v in b[i].tolist()], Fraction(c[i].item()), 13, -6)
        want = round_to_format(torch.tensor([float(exact)], dtype=torch.float64), "e8m13",
                               rounding="rtz")
        assert float(exact) == exact  # the cut sum is exact in float64
        assert got[i].item() == want.item(), i


def test_blocks_chain_in_order_and_specials_follow_ieee() -> None:
    a = torch.tensor([[1.0, 3 * 2.0**-24, -1.0, 3 * 2.0**-24]], dtype=torch.float64)
    b = torch.ones(1, 4, dtype=torch.float64)
    zero = torch.zeros(1)

    def unit(fma: int, kept: int) -> TensorCore:
        return TensorCore("bfloat16", FMAUnit(fma, kept), "float32", Rounding.RNE)
    # kept 23 bits below 2**0: each 3 * 2**-24 is cut to 2**-23, in one block or in two
    assert dot(a, b, zero, unit(4, 23)).item() == 2.0**-22
    assert dot(a, b, zero, unit(2, 23)).item() == 2.0**-22
    # kept 40: one block holds the exact sum, 6 * 2**-24
    assert dot(a, b, zero, unit(4, 40)).item() == 6 * 2.0**-24
    # two blocks of 2: the first rounds 1 + 3 * 2**-24 to 1 + 2**-22 (a tie, to even), the
    # second adds -1 + 3 * 2**-24 to that: 7 * 2**-24
    assert dot(a, b, zero, unit(2, 40)).item() == 7 * 2.0**-24
    # an empty block (zero products, c = 0) adds nothing, whatever min_exp says
    sparse = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    for name in ("v100_fp16_f32", "h100_fp16_f32"):
        assert dot(sparse, sparse, zero, CORES[name]).item() == 5.0, name
    assert dot(sparse, sparse, torch.tensor([-0.0]), CORES["v100_fp16_f32"]).item() == 5.0
    with pytest.raises(DriftError, match="53 bits"):
        FMAUnit(32, 45)
    nan_c = dot(a, b, torch.tensor([float("nan")]), unit(2, 23))
    assert nan_c.isnan().all()
    inf = torch.tensor([[float("inf"), 1.0], [float("inf"), float("-inf")]], dtype=torch.float64)
    out = dot(inf, torch.ones(2, 2, dtype=torch.float64), torch.zeros(2), unit(2, 23))
    assert out[0].item() == float("inf") and out[1].isnan()


def test_a_unit_that_cannot_exist_is_refused() -> None:
    with pytest.raises(DriftError, match="multiple of 4"):
        FMAUnit(6, 25, interleave=2)
    with pytest.raises(DriftError, match="at least 1"):
        FMAUnit(0, 25)
    with pytest.raises(DriftError, match="rows x K"):
        dot(torch.ones(2, 3), torch.ones(2, 4), torch.zeros(2), CORES["h100_fp16_f32"])


def test_every_preset_names_its_source() -> None:
    assert len(CORES) >= 30
    for name, unit in CORES.items():
        assert "MATLAB-tensor-core" in unit.source or "DeepSeek-V3" in unit.source, name
        unit.input_format  # a real format  # noqa: B018


def test_missing_recordings_are_named(tmp_path: Path) -> None:
    (tmp_path / "X100" / "fp16").mkdir(parents=True)
    with pytest.raises(DriftError, match=r"a_X100_fp16\.txt\.gz"):
        read_recordings(tmp_path / "X100" / "fp16")


@requires_recordings
def test_the_14_bit_reading_of_hoppers_fp8_unit_misses_the_recordings() -> None:
    """DeepSeek-V3's "about 14 bits" read as 14 fraction bits: the recordings say 13."""
    r = _recordings("H100/E4M3")
    assert _reproduced(r, "fp32", CORES["h100_e4m3_f32"]) == 5000
    assert _reproduced(r, "fp32", CORES["h100_e4m3_f32_14bit"]) < 4900
