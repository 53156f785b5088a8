"""drift calibrate: simulated backends with hidden parameters recovered exactly, every recording
folder fitted, a backend outside the family said to be so, the command and its table."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from driftcli.arith.blockfma import NO_FLOOR
from driftcli.arith.matmul import MatmulSpec, parse_matmul_spec
from driftcli.cli import app
from driftcli.measures import calibrate as cb
from driftcli.records.formats import Format

HW = Path(__file__).resolve().parents[2] / "shared" / "data" / "hw-tensor-cores"

HIDDEN = (
    # published units without recordings (those with: every one, below)
    "tc=b200_e4m3_f32", "tc=h100_bf16_f32",
    # group sizes 1 to 64, kept bits 9 to 30, accumulators from 8 to 23 fraction bits
    "lhs=bf16,rhs=bf16,acc=e8m12:rne,order=blockfma:256,fma=8:14",
    "lhs=fp16,rhs=fp16,acc=float16:rtz,order=blockfma,fma=4:12",
    "lhs=bf16,rhs=bf16,acc=e8m12:rne,order=blockfma,fma=4:20:i1",
    "lhs=bf16,rhs=bf16,acc=e8m16:rtz,order=blockfma:64,fma=16:20:i2",
    "lhs=bf16,rhs=bf16,acc=float32:rtz,order=blockfma:512,fma=32:24",
    "lhs=float8_e5m2,rhs=float8_e5m2,acc=e8m10:rne,order=blockfma,fma=64:16",
    "acc=float32:rtz,order=blockfma,fma=1:30",
    "lhs=bf16,rhs=bf16,acc=e8m8:rtz,order=blockfma,fma=8:9",
    "lhs=fp16,rhs=fp16,acc=e8m14:rne,order=blockfma:128,fma=16:16:i1",
    "lhs=float8_e4m3fn,rhs=float8_e4m3fn,acc=float16:rne,order=blockfma,fma=16:13",
    # one rounding per addition
    "order=sequential", "order=chunked:256",
    "lhs=bf16,rhs=bf16,acc=bfloat16:rne,order=pairwise",
    "lhs=fp16,rhs=fp16,acc=float16:rtz,order=sequential",
)


def _bottom(fmt: Format) -> int:
    tiny = fmt.smallest_positive
    return tiny.numerator.bit_length() - tiny.denominator.bit_length()


def _observable(hidden: MatmulSpec, got: MatmulSpec, inputs: Format) -> None:
    """The inferred model is the hidden one in every parameter the backend can show: the
    order, promotion, accumulator and its rounding, and the unit; its exponent floor only
    where a product of the input format can lie below it."""
    assert (got.order, got.chunk, got.accumulator, got.acc_rounding) == (
        hidden.order, hidden.chunk, hidden.accumulator, hidden.acc_rounding)
    assert (got.lhs is None) == (hidden.lhs is None)
    if hidden.unit is None:
        assert got.unit is None
        return
    assert got.unit is not None
    assert (got.unit.size, got.unit.kept_bits, got.unit.interleave) == (
        hidden.unit.size, hidden.unit.kept_bits, hidden.unit.interleave)
    floor_seen = hidden.unit.min_exp > 2 * _bottom(inputs)
    assert got.unit.min_exp == (hidden.unit.min_exp if floor_seen else NO_FLOOR)


@pytest.mark.parametrize("hidden", HIDDEN)
def test_a_simulated_backend_is_recovered_exactly(hidden: str) -> None:
    be = cb.backend(f"drift:{hidden}")
    inf = cb.infer(be, max_k=1024)
    assert inf.survivors >= 1 and inf.probe_share == 1.0
    got = inf.model.spec(be.inputs, be.output)
    _observable(parse_matmul_spec(hidden), got, be.inputs)
    checks = cb.check(be, inf.model, ks=(16, 1024), dists=("normal", "cancel"))
    assert all(c.reproduced == c.outputs == 512 for c in checks)


def test_twenty_backends_at_least() -> None:
    """The hidden specs here and the presets of every recorded GPU below."""
    assert len(set(HIDDEN)) + sum(len(list((HW / f).glob("d_*"))) for f in RECORDED) >= 20


RECORDED = sorted(f"{g.name}/{f.name}" for g in HW.iterdir() if g.is_dir()
                  for f in g.iterdir() if f.is_dir())
SHORT = {"fp16": "fp16", "bf16": "bf16", "tf32": "tf32", "E4M3": "e4m3", "E5M2": "e5m2"}


@pytest.mark.parametrize("folder", RECORDED)
def test_a_recorded_gpus_preset_is_recovered_and_reproduces_its_recordings(folder: str) -> None:
    """Every preset of a GPU with recordings, calibrated as a drift backend: the inferred
    model (not the preset) replays that GPU's recordings bit for bit."""
    from driftcli.arith.tensorcores import TensorCore, dot, read_recordings
    from driftcli.casts.rounding import round_to_format

    r = read_recordings(HW / folder)
    for out in r.d:
        name = f"{r.gpu.lower()}_{SHORT[r.inputs]}_f{out[2:]}"
        be = cb.backend(f"drift:tc={name}")
        inf = cb.infer(be, max_k=1024)
        assert inf.survivors >= 1, name
        m = inf.model
        assert m.unit is not None, name
        core = TensorCore(be.inputs.name, m.unit, m.acc.name, m.rounding)
        c = r.c
        if out == "fp16":  # the harness fed c rounded to fp16
            c = round_to_format(r.c, "float16").double()
        elif r.gpu == "H100" and r.inputs.startswith("E"):  # WGMMA with c = 0
            c = torch.zeros_like(r.c)
        got = cb.output_cast(dot(r.a, r.b, c, core), cb.FLOAT32 if out == "fp32" else
                             cb.FORMATS["float16"])
        assert bool(cb.same_bits(got, r.d[out]).all()), name


def test_a_backend_outside_the_family_is_said_to_be() -> None:
    """Groups of three products: no size of the family. The best model is reported with its
    share, which is below one, and the checks say by how much it misses."""
    rows = cb.calibrate("drift:lhs=bf16,rhs=bf16,acc=e8m10:rtz,order=blockfma,fma=3:11",
                        max_k=128)
    probes = rows[0]
    assert probes.kind == "probes" and not probes.fits and probes.survivors == 0
    assert 0.5 < probes.share < 1.0
    assert any(r.reproduced < r.outputs for r in rows if r.kind == "check")


def test_every_recording_folder_is_fitted() -> None:
    rows = cb.calibrate_recordings(HW)
    assert len(rows) == 22  # every GPU x input x result format
    for r in rows:
        assert r.fits and r.reproduced == r.outputs == 5000, r.backend
    fp8 = {r.backend: r for r in rows}["H100/E4M3 -> fp32"]
    # the harness's WGMMA runs used c = 0, and the unit is Hopper's 13-bit one
    assert fp8.c_mode == "zero" and (fp8.fma_size, fp8.kept_bits, fp8.accumulator,
                                     fp8.acc_rounding) == (32, 13, "e8m13", "rtz")
    a100 = {r.backend: r for r in rows}["A100/bf16 -> fp32"]
    assert (a100.fma_size, a100.kept_bits, a100.accumulator) == (8, 24, "float32")


def test_the_command_writes_the_table_and_the_report_reads_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["calibrate", "-b", "drift:tc=a100_bf16_f32",
                                      "--max-k", "128", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "fma=8:24" in result.output and "reproduces every one of the probes" in result.output
    table = pq.read_table(tmp_path / "calibrate.parquet").to_pylist()
    assert [r["kind"] for r in table] == ["probes", "check", "check", "check", "check", "check",
                                          "check"]
    assert all(r["share"] == 1.0 for r in table)
    report = CliRunner().invoke(app, ["report", str(tmp_path / "calibrate.parquet")])
    assert report.exit_code == 0 and "calibrate" in report.output


def test_a_cpu_backend_is_calibrated_and_its_fit_checked() -> None:
    """torch's float32 matmul here: whatever it turns out to be (it differs between CPUs and
    BLAS libraries), the rows say whether a model gave every probe and what share of random
    outputs it reproduces (both between 0 and 1, one check per K and distribution)."""
    rows = cb.calibrate("torch:cpu:float32", max_k=128)
    assert rows[0].kind == "probes" and 0 < rows[0].share <= 1
    checks = [r for r in rows if r.kind == "check"]
    assert [(r.k, r.dist) for r in checks] == [(k, d) for k in (16, 128)
                                               for d in cb.CHECK_DISTS]
    assert all(0 <= r.share <= 1 and r.outputs == 512 for r in checks)


@pytest.mark.parametrize(("name", "match"), [
    ("tpu:v5", "unknown backend"),
    ("torch:cpu:int8", "no torch dtype"),
    ("torch:cpu:float8_e4m3fn", "GPU only"),
    ("drift:lhs=mxfp8_e4m3,rhs=mxfp8_e4m3", "is scaled"),
    ("drift:lhs=bf16,rhs=fp16", "different formats"),
    ("drift:order=wobbly", "wobbly"),
])
def test_bad_backends_name_the_fix(name: str, match: str) -> None:
    with pytest.raises(cb.CalibrateError, match=match):
        cb.backend(name)


def test_cuda_backends_exist_only_where_a_gpu_does() -> None:
    if torch.cuda.is_available():
        assert cb.backend("torch:cuda:bfloat16").output.name == "bfloat16"
        return
    with pytest.raises(cb.CalibrateError, match="no CUDA device"):
        cb.backend("torch:cuda:bfloat16")


def test_the_command_needs_a_backend_or_recordings(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "give --backend" in result.output
