"""drift health: the freeze prediction of a float32 run against the exact freeze count of a
run stored in bfloat16, the gradient-to-noise ratio on hand-built gradients either side of √3,
a weight oscillating between two codes, the table, the command and its one-line errors."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import test_train
import torch
from test_train import _one_line_error, drift

from driftcli.io.tables import read_table
from driftcli.models import MLPConfig, load_checkpoint, save_checkpoint
from driftcli.records.castspec import parse_cast
from driftcli.runs import TrainConfig, train
from driftcli.runs.health import (
    GNR_FLOOR,
    HealthError,
    HealthRow,
    first_step,
    frozen,
    gradient_noise,
    health,
    oscillation,
    predicted_frozen,
    ratio,
    weight_cast,
)
from driftcli.runs.optstate import (
    dynamic_map,
    linear_map,
    msamp_exponent,
    msamp_step,
    quantized,
    state_counts,
    state_values,
)
from driftcli.runs.probe import update_lost_exact
from driftcli.runs.training import checkpoint_name

text = test_train.text

SMALL = TrainConfig(MLPConfig(context=8, hidden=16, layers=1), steps=16, batch=8, lr=3e-3,
                    schedule="cosine", checkpoint_every=1, log_every=0, eval_every=0)


BF16 = dataclasses.replace(SMALL, storage="bfloat16")
"""The same run, its weights stored in bfloat16 (``drift train --storage bfloat16``)."""


@pytest.fixture(scope="module")
def runs(text: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A float32 drift run and the same run stored in bfloat16, a checkpoint every step."""
    base = tmp_path_factory.mktemp("health")
    train(SMALL, base / "float32", text)
    train(BF16, base / "bfloat16", text)
    return base / "float32", base / "bfloat16"


# --- freeze ------------------------------------------------------------------------------------

def test_predicted_freeze_is_the_exact_rule_over_one_step() -> None:
    """Over one step the prediction is probe's rule, value by value, against exact rationals:
    weights spread over six binades, updates at and one float32 step either side of half a
    bfloat16 gap, either way."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.rand(4000, generator=gen) * 2 - 1) * torch.exp2(
        torch.randint(-6, 0, (4000,), generator=gen).float())
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().bfloat16().float())) - 7)
    half = ulp / 2 * torch.tensor([1, -1], dtype=torch.float32).repeat(2000)
    nudge = torch.tensor([0.999, 1.0, 1.001, 0.25]).repeat(1000)
    after = w + half * nudge
    got = predicted_frozen(w, after, 1, "bfloat16")
    want = [update_lost_exact(a, float(b) - float(a), "bfloat16")
            for a, b in zip(w.tolist(), after.tolist(), strict=True)]
    assert got.tolist() == want
    assert 0.3 < sum(want) / len(want) < 0.95  # both verdicts occur


def test_frozen_compares_stored_values() -> None:
    before = torch.tensor([1.0, 1.0, -0.0, 1.0, float("nan")])
    after = torch.tensor([1.0 + 2**-9, 1.0 + 2**-7, 0.0, 1.0 + 2**-8, float("nan")])
    # 1 + 2**-8 is a tie in bfloat16 and goes to the even 1.0; NaN equals nothing
    assert frozen(before, after, "bfloat16").tolist() == [True, False, True, True, False]
    assert frozen(before, after, "float32").tolist() == [False, False, True, False, False]


def test_freeze_prediction_against_a_bfloat16_run(runs: tuple[Path, Path]) -> None:
    """The float32 trajectory's half-ulp prediction against what the bfloat16 run did: every
    parameter's share within 0.5 percentage points at every step (measured: 0.24 at most),
    the same first step past one half for every parameter, and the frozen share the exact
    count of unchanged bfloat16 weights."""
    float32, bf16 = runs
    rows = health(bf16, reference=float32, storage="bfloat16", threshold=0.5)
    assert [r.step for r in rows if r.parameter == "*"] == list(range(17))
    later = [r for r in rows if r.step > 0]
    assert all(r.frozen_share is not None and r.predicted_frozen_share is not None
               for r in later)
    worst = max(abs(r.frozen_share - r.predicted_frozen_share) for r in later
                if r.frozen_share is not None and r.predicted_frozen_share is not None)
    assert worst < 0.005
    steps = {r.parameter: (r.freeze_step, r.predicted_freeze_step) for r in rows}
    # measured here: embed 1/1, head 14/14, all parameters 12/12, the hidden layer never. The
    # runs are torch's float32 matmuls and AdamW, whose last bits another CPU may change; a
    # share that crosses one half at a step can then cross a step later or earlier, so the
    # first steps are held to one step, and never-frozen stays never
    recorded = {"embed.weight": 1, "hidden.0.weight": None, "hidden.0.bias": None,
                "head.weight": 14, "head.bias": 14, "*": 12}
    assert set(steps) == set(recorded)
    for name, want in recorded.items():
        actual, predicted = steps[name]
        if want is None:
            assert actual is None and predicted is None, name
        else:
            assert actual is not None and predicted is not None, name
            assert abs(actual - want) <= 1 and abs(predicted - actual) <= 1, (name, steps[name])
    a, b = (dict(load_checkpoint(bf16 / checkpoint_name(s)).model.named_parameters())
            for s in (13, 14))
    kept = {n: int((p.detach() == b[n].detach()).sum()) for n, p in a.items()}
    at14 = {r.parameter: r for r in rows if r.step == 14}
    for name, count in kept.items():
        assert at14[name].frozen_share == count / at14[name].numel, name
    assert at14["*"].frozen_share == sum(kept.values()) / at14["*"].numel
    # the float32 run read in bfloat16 moves more than storage lets the bfloat16 run move: its
    # master weights carry the small updates across rounding boundaries (0.639 against 0.688)
    own = {r.parameter: r for r in health(float32, storage="bfloat16") if r.step == 14}
    assert own["*"].predicted_frozen_share == at14["*"].predicted_frozen_share
    assert own["*"].frozen_share is not None and at14["*"].frozen_share is not None
    assert own["*"].frozen_share < at14["*"].frozen_share - 0.03


def test_first_step() -> None:
    assert first_step([0, 5, 10], [None, 0.4, 0.5], 0.5) == 10
    assert first_step([0, 5], [None, 0.49], 0.5) is None


# --- gradient-to-noise ratio -------------------------------------------------------------------

E2M1 = "float4_e2m1fn:none"
"""FP4 elements without a scale: the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 (either sign)."""


def test_a_gradient_below_the_sqrt3_ratio_is_flagged() -> None:
    """0.2 is below half of E2M1's least subnormal (0.5): round to nearest flushes it, the
    noise is the gradient itself (ratio 1); 1.25 rounds to 1 (a tie, to the even
    significand), noise 0.25 a coordinate (ratio 5). Under stochastic rounding the expected
    squared noise is (g − lo)(hi − g): 0.2·0.3 and 0.25·0.25 a coordinate."""
    small, large = torch.full((64,), 0.2), torch.full((64,), 1.25)
    norm, noise = gradient_noise(small, E2M1)
    assert norm == pytest.approx(1.6) and noise == pytest.approx(1.6)
    low = ratio(norm, noise)
    assert low is not None and low < GNR_FLOOR
    high = ratio(*gradient_noise(large, E2M1))
    assert high == pytest.approx(5.0, rel=1e-12) and high > GNR_FLOOR
    sr_low = ratio(*gradient_noise(small, f"{E2M1}:sr"))
    assert sr_low == pytest.approx(0.2 / math.sqrt(0.2 * 0.3), rel=1e-6)  # 0.8165
    sr_high = ratio(*gradient_noise(large, f"{E2M1}:sr"))
    assert sr_high == pytest.approx(5.0, rel=1e-12)
    assert ratio(*gradient_noise(torch.full((8,), 1.5), E2M1)) == math.inf  # on the grid
    assert ratio(0.0, 0.0) is None


def test_the_sr_expectation_is_the_mean_of_draws() -> None:
    """The expectation against 400 drawn casts of a gradient under MXFP4 with SR (400 copies
    cast at once, each block its own random bits): within 2 % (the draws' own spread is
    about 0.5 %; drift's SR reads a finite number of random bits)."""
    from driftcli.casts.quantization import quantize

    g = torch.randn(4, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, expected = gradient_noise(g, "mxfp4_e2m1:sr")
    copies = g.expand(400, 4, 64).contiguous()
    drawn = quantize(copies, "mxfp4_e2m1:sr", seed=0)
    assert isinstance(drawn, torch.Tensor)
    mean = float((drawn - copies).pow(2).sum()) / 400
    assert math.sqrt(mean) == pytest.approx(expected, rel=0.02)


def test_health_counts_the_ratio_per_parameter_and_over_all(runs: tuple[Path, Path]) -> None:
    float32, _ = runs
    rows = health(float32, grad_cast="mxfp4_e2m1", checkpoints="step-00000[0-2].safetensors")
    assert [r.step for r in rows if r.parameter == "*"] == [0, 1, 2]
    for step in (0, 1, 2):
        mine = [r for r in rows if r.step == step]
        parts, total = mine[:-1], mine[-1]
        assert all(r.gnr is not None and r.gnr_low == (r.gnr < GNR_FLOOR) for r in mine)
        grad = math.sqrt(sum((r.grad_norm or 0.0) ** 2 for r in parts))
        noise = math.sqrt(sum((r.noise_norm or 0.0) ** 2 for r in parts))
        assert total.grad_norm == pytest.approx(grad, rel=1e-12)
        assert total.gnr == pytest.approx(grad / noise, rel=1e-12)
        assert total.frozen_share is None if step == 0 else total.frozen_share is not None


# --- oscillation -------------------------------------------------------------------------------

def test_a_weight_oscillating_between_two_codes() -> None:
    """Element 0 goes 1.24, 1.26, … across E2M1's midpoint 1.25: its code flips 1 ↔ 1.5 at
    every interval, a quantized path of 4 · 0.5 against a master path of 4 · 0.02 (ratio 25).
    Element 1 walks 1.0 → 1.4 (one flip, ratio 1.25); element 2 stays; element 3 moves its
    code once while the master path is 0.02 (ratio 25, but one flip)."""
    series = [[1.24, 1.0, 0.5, 1.24], [1.26, 1.1, 0.5, 1.26], [1.24, 1.2, 0.5, 1.26],
              [1.26, 1.3, 0.5, 1.26], [1.24, 1.4, 0.5, 1.26]]
    w = [torch.tensor(s) for s in series]
    q = [weight_cast(t, parse_cast(E2M1)) for t in w]
    assert q[0].tolist() == [1.0, 1.0, 0.5, 1.0] and q[1].tolist() == [1.5, 1.0, 0.5, 1.5]
    osc = oscillation(w, q)
    assert osc.flips.tolist() == [4, 1, 0, 1]
    assert osc.quantized_path.tolist() == [2.0, 0.5, 0.0, 0.5]
    assert osc.oscillating().tolist() == [True, False, False, True]
    assert osc.oscillating(26.0).tolist() == [False, False, False, False]
    with pytest.raises(HealthError):
        oscillation(w[:1], q[:1])


def test_health_finds_the_oscillating_bias(runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Five checkpoints of the float32 run with head.bias[0] set to 1.24, 1.26, …: one element
    of 256 oscillates under E2M1, flipping at every interval of the window."""
    float32, _ = runs
    run = tmp_path / "run"
    run.mkdir()
    for step in range(5):
        ck = load_checkpoint(float32 / checkpoint_name(step))
        with torch.no_grad():
            ck.model.head.bias.fill_(0.5)
            ck.model.head.bias[0] = 1.24 if step % 2 == 0 else 1.26
        save_checkpoint(run / checkpoint_name(step), ck.model, ck.config, ck.state,
                        ck.optimizer)
    rows = [r for r in health(run, cast=E2M1, window=2) if r.parameter == "head.bias"]
    assert [r.window for r in rows] == [0, 1, 2, 2, 2]
    assert [r.oscillating_share for r in rows] == [None, 1 / 256, 1 / 256, 1 / 256, 1 / 256]
    assert [r.flips_mean for r in rows] == [None, 1 / 256, 2 / 256, 2 / 256, 2 / 256]
    assert rows[0].cast == "float4_e2m1fn:none:rne:saturate"


# --- the command -------------------------------------------------------------------------------

def test_health_command_writes_its_table(runs: tuple[Path, Path], tmp_path: Path) -> None:
    float32, bf16 = runs
    out = tmp_path / "out"
    code, stdout, err = drift("health", bf16, "--reference", float32, "--checkpoints",
                              "step-00001[2-6].safetensors", "--out", out, "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["freeze_steps"]["*"] == {"freeze_step": 13, "predicted_freeze_step": 13}
    assert [r["step"] for r in summary["rows"]] == [12, 13, 14, 15, 16]
    frame, meta = read_table(out / "health.parquet")
    assert len(frame) == 5 * 6 and list(frame["parameter"][:6]) == [
        "embed.weight", "hidden.0.weight", "hidden.0.bias", "head.weight", "head.bias", "*"]
    assert meta["reference"] == str(float32) and meta["storage"] == "bfloat16"
    code, stdout, err = drift("health", bf16, "--checkpoints", "step-00001[2-6].safetensors",
                              "--out", out)
    _one_line_error(code, err, "--overwrite")
    code, stdout, err = drift("health", bf16, "--out", out, "--overwrite", "-q")
    assert code == 0 and stdout == "", err
    assert HealthRow.TABLE == "health"


def test_bad_health_input_is_one_line_exit_2(runs: tuple[Path, Path], tmp_path: Path) -> None:
    float32, bf16 = runs
    short = tmp_path / "short"
    short.mkdir()
    for step in range(3):
        shutil.copy(float32 / checkpoint_name(step), short)
    _one_line_error(*drift("health", bf16, "--reference", short, "--checkpoints",
                           "step-00000[0-3].safetensors", "--out", tmp_path / "a")[::2],
                    "reference", "same steps")
    _one_line_error(*drift("health", bf16, "--threshold", "1.5", "--out", tmp_path / "b")[::2],
                    "threshold")
    _one_line_error(*drift("health", bf16, "--cast", "float5", "--out", tmp_path / "c")[::2],
                    "float5")


def test_every_column_is_documented() -> None:
    from dataclasses import fields

    page = (Path(__file__).resolve().parents[1] / "docs" / "health.md").read_text()
    for f in fields(HealthRow):
        assert f"| `{f.name}` |" in page, f"{f.name} missing from docs/health.md"


# --- optimizer state ---------------------------------------------------------------------------

def test_the_8bit_state_is_torchao_bit_for_bit() -> None:
    """drift's reading of torchao's 8-bit Adam state against torchao's own OptimState8bit
    (torchao 0.18.0, the dev extra): the maps, and the stored values of moments spread over
    35 binades, signed (exp_avg) and unsigned (exp_avg_sq), ties included."""
    from torchao.optim.quant_utils import create_dynamic_map
    from torchao.optim.subclass_8bit import OptimState8bit

    for signed in (True, False):
        assert torch.equal(dynamic_map(signed), torch.tensor(create_dynamic_map(signed=signed)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(
        torch.randint(-30, 5, (64, 1), generator=gen).float())
    qmap = dynamic_map(True)
    x[0, :255] = (qmap[:-1] + qmap[1:]) / 2  # every midpoint of the signed map, under max 1
    x[0, 255] = 1.0
    for signed, t in ((True, x), (False, x.square())):
        state = OptimState8bit.zeros(t.shape, signed, 256)
        state.copy_(t)
        assert torch.equal(state.dequantize(), state_values(t, signed)), signed
    assert quantized(4096) and not quantized(2048) and not quantized(4096 + 128)


BETAS = (0.9, 0.99)


def _state_block() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of 256 moments before and after one Adam step (``m0, m1, v0, v1``): 1.0 with a
    gradient of 1.0, 0.5 with 0.51, 0.5 with 1.5, zeros without gradient."""
    b1, b2 = BETAS
    m0 = torch.zeros(256)
    m0[:3] = torch.tensor([1.0, 0.5, 0.5])
    g = torch.zeros(256)
    g[:3] = torch.tensor([1.0, 0.51, 1.5])
    v0 = torch.zeros(256)
    v0[:3] = 1.0
    return m0, b1 * m0 + (1 - b1) * g, v0, b2 * v0 + (1 - b2) * g * g


def test_an_adam_state_whose_updates_round_back() -> None:
    """A block of 256 first moments: 1.0 (the block's max, its gradient 1.0 keeps it), 0.5 with
    a gradient of 0.51 (the EMA moves it by 0.001, under half the map's spacing of about 0.014
    there: stale), 0.5 with a gradient of 1.5 (moves by 0.1: not stale), zeros without
    gradient (their EMA does not move: not counted). The second moment holds 1e-9 under a
    max of 1: below half the unsigned map's least value (3.25e-7), stored as 0."""
    m0, m1, v0, v1 = _state_block()
    v1[3] = 1e-9
    counts = state_counts(m0, v0, m1, v1, betas=BETAS, eps=1e-8, step=10)
    assert counts.m_moved == 2 and counts.m_stale == 1  # the max and the zeros did not move
    assert counts.v_zero == 1 and counts.v_nonzero == 4
    assert counts.cosine() == pytest.approx(1.0, abs=1e-3)


def test_health_counts_the_state_of_the_tensors_the_layout_quantizes(
        runs: tuple[Path, Path]) -> None:
    float32, _ = runs
    rows = health(float32, state_layout="torchao-8bit",
                  checkpoints="step-00000[0-3].safetensors")
    by = {(r.step, r.parameter): r for r in rows}
    assert by[(1, "*")].m_stale_share is None  # step 0 holds no moments yet
    for name in ("embed.weight", "head.weight"):  # 4,096 values each
        r = by[(2, name)]
        assert r.m_stale_share is not None and r.v_zero_share == 0.0
        assert r.update_cosine is not None and r.update_cosine > 0.999
    assert by[(2, "hidden.0.weight")].m_stale_share is None  # 2,048 values stay float32
    assert by[(2, "*")].update_cosine is not None


@pytest.mark.parametrize("layout", ["torchao-4bit", "torchao-fp8"])
def test_the_4bit_and_fp8_states_are_torchao_bit_for_bit(layout: str) -> None:
    """drift's reading of torchao's 4-bit and FP8 Adam states against torchao's own
    OptimState4bit (blocks of 128) and OptimStateFp8 (blocks of 256), torchao 0.18.0: the
    4-bit maps, and the stored values of moments spread over 35 binades, signed and unsigned,
    with every midpoint of the 4-bit maps (their ties) in a block of maximum 1."""
    from torchao.optim.quant_utils import create_dynamic_map
    from torchao.optim.subclass_4bit import OptimState4bit, get_qmap_unsigned
    from torchao.optim.subclass_fp8 import OptimStateFp8

    assert torch.equal(dynamic_map(True, 3, 4), torch.tensor(create_dynamic_map(True, 3, 4)))
    assert torch.equal(linear_map(), torch.tensor(get_qmap_unsigned()))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(
        torch.randint(-30, 5, (64, 1), generator=gen).float())
    for qmap, row in ((dynamic_map(True, 3, 4), 0), (linear_map(), 1)):
        mids = (qmap[:-1] + qmap[1:]) / 2
        x[row, :128] = 0.0
        x[row, : mids.numel()] = mids
        x[row, 127] = 1.0  # the block's maximum
    for signed, t in ((True, x), (False, x.abs())):
        if layout == "torchao-4bit":
            state = OptimState4bit.zeros(t.shape, signed, 128)
        else:
            state = OptimStateFp8.zeros(t.shape, 256)
        state.copy_(t)
        assert torch.equal(state.dequantize(), state_values(t, signed, layout)), signed
    assert quantized(4096 + 128, "torchao-4bit") and not quantized(4096 + 128, "torchao-fp8")


def test_what_each_layout_does_to_a_small_second_moment_and_a_small_ema_step() -> None:
    """The block of test_an_adam_state_whose_updates_round_back under the other layouts. A
    second moment of 1e-9 under a maximum of 1: torchao's 4-bit map for v has no 0 (its least
    value is 1/16), so nothing is stored as 0; FP8 stores 1e-9 · 448 = 4.5e-7, below half of
    float8_e4m3fn's least subnormal 2^-9, as 0. The moment 0.5 moving by 0.001 is stale in
    both (FP8: 0.5 · 448 = 224 has spacing 16, 16 / 448 = 0.036). The one moving by 0.1 is
    not in FP8, but is in 4-bit: the map's entries either side of 0.5 are 0.4375 and 0.6625,
    0.5 is stored as 0.4375, and the layout's step lerp(0.4375, 1.5, 0.1) = 0.544 stays below
    their midpoint 0.55."""
    m0, m1, v0, v1 = _state_block()
    v1[3] = 1e-9
    four = state_counts(m0, v0, m1, v1, betas=BETAS, eps=1e-8, step=10, layout="torchao-4bit")
    fp8 = state_counts(m0, v0, m1, v1, betas=BETAS, eps=1e-8, step=10, layout="torchao-fp8")
    assert (four.m_moved, four.m_stale, four.v_zero) == (2, 2, 0)
    assert (fp8.m_moved, fp8.m_stale, fp8.v_zero) == (2, 1, 1)
    top = float(v1[:128].max())  # 1.0125, the block's maximum
    assert state_values(v1[:128], False, "torchao-4bit")[3] == pytest.approx(top / 16, rel=1e-6)
    # without the moments one step earlier: no staleness, no cosine
    alone = state_counts(None, None, m1, v1, betas=BETAS, eps=1e-8, step=10,
                         layout="torchao-fp8")
    assert alone.m_moved is None and alone.cosine() is None and alone.v_zero == 1


# --- engines -----------------------------------------------------------------------------------

def test_units_of_any_size_give_the_same_rows(runs: tuple[Path, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The run in units of 3 checkpoints against one unit of all 17: each unit reads the
    window before its first checkpoint, so the freeze, oscillation, gradient and state columns
    of a checkpoint do not depend on where a unit starts (planted: a unit that read no
    history would count no oscillation at its first checkpoint and no freeze)."""
    import driftcli.runs.health as module

    float32, bf16 = runs
    settings = {"reference": float32, "cast": "mxfp4_e2m1", "grad_cast": "mxfp4_e2m1",
                "state_layout": "torchao-fp8", "window": 4}
    monkeypatch.setattr(module, "CHUNK", 1000)
    whole = health(bf16, **settings)
    freeze_only = health(bf16, reference=float32)  # without a cast a unit reads one before
    monkeypatch.setattr(module, "CHUNK", 3)
    assert health(bf16, **settings) == whole
    assert health(bf16, reference=float32) == freeze_only
    by = {(r.step, r.parameter): r for r in whole}
    # checkpoint 3 is the first of the second unit of 3: its columns come from the history
    assert by[(3, "*")].window == 3 and by[(3, "*")].frozen_share is not None
    assert by[(16, "*")].window == 4
    cosine = by[(16, "*")].update_cosine  # FP8 moments, the bfloat16 run's AdamW state
    assert cosine is not None and 0.99 < cosine < 1


@pytest.mark.slow  # two worker processes and two Ray workers load torch: about 20 s of CPU
def test_health_on_every_engine_is_the_serial_table(runs: tuple[Path, Path], tmp_path: Path,
                                                    ray_cluster: object) -> None:
    """drift health in this process, in 2 local processes and on Ray: the same table, bit for
    bit (17 checkpoints: two units, the second reading the first's last window)."""
    import pandas as pd

    float32, _ = runs
    tables = {}
    for engine in ("serial", "processes", "ray"):
        out = tmp_path / engine
        code, _, err = drift("health", float32, "-c", "mxfp4_e2m1", "--grad-cast", "nvfp4:sr",
                             "--state-layout", "torchao-4bit", "--window", "4", "--engine",
                             engine, "--workers", "2", "--out", out, "-q")
        assert code == 0, err
        table, prov = read_table(out / "health.parquet")
        assert prov["engine"] == engine
        tables[engine] = table
    assert len(tables["serial"]) == 17 * 6  # checkpoints x (5 parameters and *)
    for engine in ("processes", "ray"):
        pd.testing.assert_frame_equal(tables["serial"], tables[engine], check_exact=True)


# --- MS-AMP's layout ---------------------------------------------------------------------------

def msamp_transcribed(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """MS-AMP's per-tensor state quantization as its code reads (Azure/MS-AMP at 9746ea8):
    ``ScalingMeta.compute_scaling_factor`` (``msamp/common/tensor/meta.py`` lines 51-55,
    margin 0, the previous scale 1) with ``fp_max`` from ``msamp/common/dtype/floating.py``
    lines 18-45, ``T(m * sf)`` in ``msamp/optim/adamw.cu`` lines 71-72 (``__nv_fp8_e4m3``
    saturates to ±448: a clamp before torch's own cast, which is nearest even; ``__float2half``
    is torch's ``half()``), and the read-back ``code * (1 / sf)`` of line 40. Unlike drift, it
    takes the exponent with a float32 log2."""
    fp_max = 448.0 if fp8 else 65504.0
    amax = x.abs().max()
    exp = torch.floor(torch.log2(fp_max / amax)) - 0
    sf = torch.round(torch.pow(2, torch.abs(exp)))
    sf = torch.where(amax > 0.0, sf, torch.ones(()))
    sf = torch.where(torch.isfinite(amax), sf, torch.ones(()))
    sf = torch.where(exp < 0, 1 / sf, sf)
    y = x * sf
    code = y.clamp(-448, 448).to(torch.float8_e4m3fn).float() if fp8 else y.half().float()
    return code * (1.0 / sf)


def test_the_msamp_state_is_its_transcription_bit_for_bit() -> None:
    """drift's reading of MS-AMP's FP8 first and float16 second moment against the
    transcription above: 120 tensors whose maxima span 2^-100 to 2^60 (signed for exp_avg,
    squares of those for exp_avg_sq), every midpoint of the E4M3 grid under a maximum of 1
    (scale 256), 2,000 float16 midpoints under a maximum of 1 (scale 32768), and zeros. The
    squares of the smallest overflow MS-AMP's float32 scale (docs/health.md, step 3): NaN
    where MS-AMP's arithmetic gives NaN."""
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(300, generator=gen) * 2.0 ** int(e)
               for e in torch.randint(-100, 60, (120,), generator=gen)]
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = torch.cat([(grid[:-1] + grid[1:]) / 2 / 256, torch.tensor([1.0])])
    tensors += [ties, -ties]
    tensors.append(torch.tensor([1e-37, -2e-38, 0.0]))  # 448 / 1e-37 overflows float32
    assert msamp_transcribed(tensors[-1], True).tolist()[:2] == [0.0, 0.0]
    half = (torch.rand(2000, generator=gen) * 0.9 + 0.05).half()
    up = torch.nextafter(half.float(), torch.tensor(2.0)).half()  # the next float16 above
    mids = (half.float() + up.float()) / 2 / 32768
    assert not torch.equal(mids.half().float(), mids)  # ties, not float16 values
    overflowed = 0
    for t in [*tensors, torch.zeros(256)]:
        for x, signed in ((t, True), (t.square(), False)):
            got, want = state_values(x, signed, "ms-amp"), msamp_transcribed(x, signed)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
            overflowed += bool(want.isnan().any())
    assert overflowed > 5  # maxima below 65504 · 2^-128: the scale is inf, the state NaN
    v = torch.cat([mids, torch.tensor([1.0])])
    assert torch.equal(state_values(v, False, "ms-amp"), msamp_transcribed(v, False))
    assert quantized(1, "ms-amp") and quantized(2048 + 3, "ms-amp")  # every tensor


def test_msamp_reads_the_scale_exponent_from_the_bits() -> None:
    """The exponent of the float32 quotient fp_max / amax: 448 / 1 = 448, exponent 8 (scale
    256); 65504 / 1.0125, exponent 15; a quotient one float32 step below 2^9 has exponent 8
    (a correctly rounded float32 log2 of it is 9.0: MS-AMP's floor then gives 9, the case
    docs/health.md names); an amax of 0 or inf keeps the previous scale (None)."""
    assert msamp_exponent(1.0, 448.0) == 8 and msamp_exponent(1.0125, 65504.0) == 15
    below = float(torch.nextafter(torch.tensor(512.0), torch.tensor(0.0)))
    amax = float(torch.tensor(448.0) / torch.tensor(below))
    quotient = float(torch.tensor(448.0) / torch.tensor(amax))
    assert quotient < 512 and msamp_exponent(amax, 448.0) == 8
    assert msamp_exponent(0.0, 448.0) is None and msamp_exponent(math.inf, 448.0) is None
    assert msamp_exponent(2.0**-100, 448.0) == 108  # 448 · 2^100 = 1.75 · 2^108


def test_an_msamp_state_whose_updates_round_back() -> None:
    """The block of test_an_adam_state_whose_updates_round_back as one MS-AMP tensor. m: its
    maximum 1.0 gives the scale 256; 0.5 is 128 on the E4M3 grid (spacing 16 there), the
    EMA step to 0.501 is 128.3: stale; the step to 0.6 is 153.6, stored as 160 (0.625): not
    stale. v: the new maximum 1.0125 gives the scale 2^15; a second moment of 1e-9 is
    3.3e-5 there, a float16 subnormal (not 0); one of 1e-13 is 3.3e-9, below half the least
    float16 subnormal (2^-25): stored as 0."""
    m0, m1, v0, v1 = _state_block()
    assert state_values(m1, True, "ms-amp")[:3].tolist() == [1.0, 0.5, 0.625]
    for tiny, zero in ((1e-9, 0), (1e-13, 1)):
        v = v1.clone()
        v[3] = tiny
        c = state_counts(m0, v0, m1, v, betas=BETAS, eps=1e-8, step=10, layout="ms-amp")
        assert (c.m_moved, c.m_stale, c.v_zero, c.v_nonzero) == (2, 1, zero, 4), tiny
        assert c.cosine() == pytest.approx(1.0, abs=1e-4)
    # planted: the torchao-fp8 reading of the same v (blocks of 256, scale max / 448) zeroes
    # 1e-9, which MS-AMP's float16 keeps
    v = v1.clone()
    v[3] = 1e-9
    assert state_counts(None, None, m1, v, betas=BETAS, eps=1e-8, step=10,
                        layout="torchao-fp8").v_zero == 1


def test_msamp_ema_step_is_float32_products_then_the_sum() -> None:
    """The kernel's β · stored + (1 − β) · g, each product rounded to float32 and then the sum
    (the contraction drift assumes: docs/health.md): against the same in float64 rounded once,
    they differ on some of 10,000 values (so a fused step would be told apart)."""
    gen = torch.Generator().manual_seed(3)
    stored, grad = torch.randn(10_000, generator=gen), torch.randn(10_000, generator=gen)
    got = msamp_step(stored, grad, 0.9)
    b = torch.tensor(0.9, dtype=torch.float32)
    want = (b * stored) + ((1 - b) * grad)
    assert torch.equal(got, want)
    once = (b.double() * stored.double() + (1 - b).double() * grad.double()).float()
    assert int((once != got).sum()) > 0


def test_health_reads_every_tensor_in_the_msamp_layout(runs: tuple[Path, Path]) -> None:
    float32, _ = runs
    rows = health(float32, state_layout="ms-amp", checkpoints="step-00000[0-3].safetensors")
    by = {(r.step, r.parameter): r for r in rows}
    for name in ("embed.weight", "hidden.0.weight", "hidden.0.bias", "head.bias", "*"):
        r = by[(2, name)]  # the biases and the 2,048-value weight too: every tensor
        assert r.state_layout == "ms-amp" and r.m_stale_share is not None, name
        assert r.update_cosine is not None and r.update_cosine > 0.99, name
    assert by[(1, "*")].m_stale_share is None and by[(1, "*")].v_zero_share is not None


def test_msamp_amax_skips_nan_as_the_kernels_fmaxf() -> None:
    """One NaN moment does not move the tensor's scale: 1000 is read back under the scale
    2**-2 its own amax gives (250 on E4M3's grid is 256: 1024), where a NaN amax would have
    given the scale 1 and E4M3 saturates 1000 to 448."""
    with_nan = state_values(torch.tensor([1000.0, math.nan]), True, "ms-amp")
    without = state_values(torch.tensor([1000.0, 0.0]), True, "ms-amp")
    assert float(with_nan[0]) == float(without[0]) == 1024.0
    assert math.isnan(float(with_nan[1]))
