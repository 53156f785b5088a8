"""Attention probes: every column computed by hand on constructed attention (a P with known
clipped and underflowing entries, chosen gradients), on drift's own attention layer, and in
drift train and drift probe tables."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from driftcli.measures.probe_attention import NO_CAST, AttentionRecorder, measured_casts
from driftcli.models import TransformerConfig, build_model
from driftcli.models.nets import AttentionTensors, next_byte_loss, watch_attention
from driftcli.records.castspec import parse_cast
from driftcli.runs import TrainConfig, train
from driftcli.runs.probe import ATTENTION_PROBE_FILE, probe_attention
from driftcli.runs.training import ATTENTION_FILE

MX8 = parse_cast("mxfp8_e4m3")

# A P of one window, one head, 8 queries and 8 keys (one block of 8 along the keys per row,
# padded to 32 by zeros that change nothing). Under MXFP8's floor rule a row's scale is
# 2**(floor(log2 amax) - 8) and E4M3's largest value is 448 = 1.75 * 2**8, so an entry clips
# when it exceeds 1.75 * 2**floor(log2 amax); E4M3's smallest subnormal is 2**-9, so an entry
# below half of it times the scale, 2**(floor(log2 amax) - 18), rounds to zero.
P_ROWS = [
    [1.0],                      # amax 1, binade 0: 1 < 1.75, nothing clips
    [0.9, 0.1],                 # binade -1: 0.9 > 0.875 clips; 0.1 does not
    [0.5, 0.25, 0.25],          # exact powers of two: nothing clips
    [0.96, 0.04 - 1e-7, 1e-7, 0.0],   # 0.96 clips; 1e-7 < 2**-19 underflows
    [0.25, 0.25, 0.25, 0.125, 0.125],  # nothing clips
    [0.45, 0.45, 0.1 - 3e-7, 1e-7, 1e-7, 1e-7],  # binade -2 (0.45): 1.75/4 = 0.4375 < 0.45:
                                                 # both clip; three 1e-7 < 2**-20 underflow
    [0.6, 0.3, 0.1],            # 0.6 < 0.875: nothing clips
    [0.125] * 8,                # nothing clips
]
CLIPPED = 1 + 1 + 2
UNDERFLOWED = 1 + 3
NONZERO = sum(1 for row in P_ROWS for p in row if p != 0)
ELEMENTS = 8 * 8
MASS_HIGH = (1.0 + 0.9 + 0.5 + 0.96 + 0.6) / 8  # entries >= 0.5, over 8 rows of mass 1


def constructed() -> tuple[AttentionTensors, torch.Tensor, torch.Tensor]:
    """The tensors of a constructed attention call, ``pv`` and ``qk`` leaves that take
    gradients; the scores are 0.5 * (query - key) on the kept positions."""
    probs = torch.zeros(1, 1, 8, 8)
    for t, row in enumerate(P_ROWS):
        probs[0, 0, t, :len(row)] = torch.tensor(row)
    idx = torch.arange(8.0)
    qk = (2.0 * (idx[:, None] - idx[None, :]))[None, None].clone().requires_grad_(True)
    scores = qk * 0.25
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    pv = torch.zeros(1, 1, 8, 32, requires_grad=True)
    return AttentionTensors(qk, scores, keep, probs, pv), pv, qk


def test_constructed_attention_by_hand() -> None:
    tensors, pv, qk = constructed()
    recorder = AttentionRecorder([MX8])
    recorder("blocks.0.attn", tensors)
    # dY of P·v: one row of 32 (one block) holding 1.0 and 0.9 clips the 0.9 (binade -1's
    # threshold is 0.875, not reached by 1.0's binade): rows are blocked along the head width
    d_pv = torch.zeros(1, 1, 8, 32)
    d_pv[0, 0, 0, 0] = 0.95       # amax 0.95: binade -1, 0.95 > 0.875 clips
    d_pv[0, 0, 0, 1] = 1e-9       # 1e-9 < 2**(-1 - 18): underflows
    d_pv[0, 0, 1, :4] = torch.tensor([3.0, 1.0, 0.5, 0.25])  # 3 = 1.5 * 2: nothing clips
    # dY of q·kᵀ: blocked along the keys (8 per row): 7.5 in binade 2 (threshold 7) clips
    d_qk = torch.zeros(1, 1, 8, 8)
    d_qk[0, 0, 2, :3] = torch.tensor([7.5, -7.25, 1.0])  # both magnitudes above 7 clip
    (pv * d_pv).sum().backward()
    (qk * d_qk).sum().backward()
    (row,) = recorder.rows("run", 5, "train", "mxfp8_e4m3")
    assert (row.run, row.step, row.batch, row.policy, row.layer, row.cast) == (
        "run", 5, "train", "mxfp8_e4m3", "blocks.0.attn", str(MX8))
    # the largest kept logit: query 7 against key 0, 0.25 * 2 * 7
    assert row.logit_max == 3.5
    assert row.p_mass_high == pytest.approx(MASS_HIGH, rel=1e-7)  # float32 entries
    assert row.p_clip_rate == CLIPPED / ELEMENTS
    assert row.p_underflow_rate == UNDERFLOWED / NONZERO
    assert row.dy_pv_clip_rate == 1 / (8 * 32)
    assert row.dy_pv_underflow_rate == 1 / 6
    assert row.dy_qk_clip_rate == 2 / 64
    assert row.dy_qk_underflow_rate == 0


def test_without_a_cast_or_a_backward() -> None:
    tensors, _, _ = constructed()
    recorder = AttentionRecorder([])
    recorder("a", tensors)
    (row,) = recorder.rows("run", 1, "probe", "exact")
    assert row.cast == NO_CAST and row.logit_max == 3.5
    assert row.p_clip_rate is None and row.dy_qk_underflow_rate is None
    recorder = AttentionRecorder([MX8, parse_cast("mxfp8_e4m3_floor+1")])
    recorder("a", tensors)  # no backward: the dY rates stay null
    rows = recorder.rows("run", 1, "probe", "p")
    assert [r.p_clip_rate for r in rows] == [CLIPPED / ELEMENTS, 0.0]  # one binade more
    assert all(r.dy_pv_clip_rate is None for r in rows)


def test_measured_casts() -> None:
    sr = parse_cast("mxfp4_e2m1:sr")
    assert measured_casts(MX8, MX8) == (MX8,)
    assert measured_casts(MX8, None) == (MX8,)
    assert measured_casts(None, sr) == (sr,)
    assert measured_casts(MX8, sr) == (MX8, sr)
    assert measured_casts(None, None) == ()
    assert measured_casts(MX8, MX8, (sr, sr)) == (sr,)


def test_drift_attention_layer_against_its_own_arithmetic() -> None:
    """On TransformerLM's attention, the watched tensors are the layer's own: the logit and
    the mass recomputed from q and k in float64, and the counts on P equal to a cast of P."""
    torch.manual_seed(0)
    model = build_model(TransformerConfig(context=8, d_model=16, layers=1, heads=2))
    ids = torch.randint(0, 256, (3, 8))
    attn = model.blocks[0].attn
    with torch.no_grad():
        x = model.blocks[0].ln1(model.embed(ids) + model.pos.weight[:8]).double()
        q, k, _ = (z.view(3, 8, 2, 8).transpose(1, 2)
                   for z in (x @ attn.qkv.weight.double().T + attn.qkv.bias.double()).split(
                       16, dim=-1))
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    want_max = float(logits.abs().masked_select(keep.expand_as(logits)).max())
    probs = torch.softmax(logits.masked_fill(~keep, -math.inf), dim=-1)
    want_mass = float(probs[probs >= 0.5].sum() / probs.sum())
    recorder = AttentionRecorder([MX8])
    with watch_attention(model, recorder):
        next_byte_loss(model, torch.cat([ids, ids[:, :1]], dim=1)).backward()
    (row,) = recorder.rows("r", 0, "probe", "exact")
    assert row.layer == "blocks.0.attn"
    # float32 against float64 arithmetic: relative differences of a few float32 ulps
    assert row.logit_max == pytest.approx(want_max, rel=1e-5)
    assert row.p_mass_high == pytest.approx(want_mass, abs=1e-6)
    assert row.dy_pv_clip_rate is not None and row.dy_qk_clip_rate is not None
    assert attn.watch is None  # the block leaves the layer as it was


def test_the_watch_changes_nothing() -> None:
    torch.manual_seed(0)
    model = build_model(TransformerConfig(context=8, d_model=16, layers=2, heads=2))
    ids = torch.randint(0, 256, (2, 9))
    plain = next_byte_loss(model, ids)
    plain.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with watch_attention(model, AttentionRecorder([MX8])):
        watched = next_byte_loss(model, ids)
        watched.backward()
    assert torch.equal(plain, watched)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))


# --- in drift train and drift probe ------------------------------------------------------------

@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "t.txt"
    path.write_text("what light through yonder window breaks? it is the east, and juliet "
                    "is the sun.\n" * 80)
    return path


def test_train_and_probe_write_attention_tables(text: Path, tmp_path: Path) -> None:
    config = TrainConfig(TransformerConfig(context=16, d_model=32, layers=2, heads=2),
                         policy="mxfp8_e4m3", steps=6, batch=4, log_every=3,
                         checkpoint_every=3)
    result = train(config, tmp_path / "run", text)
    got = pd.read_parquet(tmp_path / "run" / ATTENTION_FILE)
    assert list(zip(got.step, got.layer, strict=True)) == [
        (s, f"blocks.{n}.attn") for s in (1, 3, 6) for n in (0, 1)]
    assert set(got.cast) == {str(MX8)} and set(got.batch) == {"train"}
    assert got.p_clip_rate.notna().all() and got.dy_qk_underflow_rate.notna().all()
    assert len(result.attention) == 6
    rows = probe_attention(tmp_path / "run", ["exact", "nvfp4"], text=text)
    assert [(r.step, r.policy, r.cast) for r in rows[:4]] == [
        (0, "exact", NO_CAST), (0, "exact", NO_CAST),
        (0, "nvfp4", str(parse_cast("nvfp4"))), (0, "nvfp4", str(parse_cast("nvfp4")))]
    assert len(rows) == 3 * 2 * 2
    # an exact run with a measured cast still counts under it; an MLP has no attention
    exact = train(TrainConfig(TransformerConfig(context=16, d_model=32, layers=1, heads=2),
                              steps=2, batch=4, log_every=1, measure_cast="mxfp4_e2m1"),
                  tmp_path / "exact", text)
    assert {r.cast for r in exact.attention} == {str(parse_cast("mxfp4_e2m1"))}
    mlp = train(TrainConfig(steps=2, batch=4, log_every=1, policy="mxfp8_e4m3"),
                tmp_path / "mlp", text)
    assert mlp.attention == () and not (tmp_path / "mlp" / ATTENTION_FILE).exists()
    assert not (tmp_path / "mlp" / ATTENTION_PROBE_FILE).exists()
