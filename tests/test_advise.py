"""drift advise: the ranking finds a planted fragile layer, the budget holds, the policy file
round-trips and the bad inputs are one line."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import policy_from_toml
from driftcli.cli import app
from driftcli.errors import ChoiceError
from driftcli.measures.advise import Advice, AdviseError, advise
from driftcli.models import MLPConfig
from driftcli.models.checkpoint import save_checkpoint
from driftcli.models.nets import MLPLM, next_byte_loss
from driftcli.records.presets import PRESETS

runner = CliRunner()
CONFIG = MLPConfig(context=8, embed=8, hidden=32, layers=3)
LAYERS = ("head", "hidden.0", "hidden.1", "hidden.2")
CAST = "fp8_e4m3"  # one float32 scale per tensor: a single huge weight sets it for every other
OUTLIER = 1e6
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the park. One day, she saw a big, red ball under a tree.")


def model(planted: bool) -> MLPLM:
    """The tanh MLP at a seeded initialisation, its embedding frozen. Planted: one weight of
    hidden.0 is OUTLIER, on an embedding feature that is 0 for every byte, so the exact model
    and its gradient are the same (the frozen embedding takes no gradient through it) but the
    per-tensor scale of fp8_e4m3 sends every other weight of hidden.0 below E4M3's least
    subnormal (about 0.1 · 448 / 1e6 < 2⁻⁹)."""
    torch.manual_seed(0)
    m = MLPLM(CONFIG)
    with torch.no_grad():
        m.embed.weight[:, 3] = 0  # feature 3 of every byte; input 3 of hidden.0 reads it
        first = m.hidden[0]
        assert isinstance(first, torch.nn.Linear)
        if planted:
            first.weight[0, 3] = OUTLIER
    m.embed.requires_grad_(False)
    return m


def batches() -> list[torch.Tensor]:
    ids = torch.tensor(list(STORY.encode())[: 4 * 17]).reshape(4, 17)
    return list(ids.reshape(2, 2, 17))


@cache
def advised(planted: bool, budget: float) -> Advice:
    return advise(model(planted), batches(), next_byte_loss, CAST, budget=budget)


def test_the_planted_fragile_layer_ranks_first() -> None:
    plain, planted = advised(False, 0.15), advised(True, 0.15)
    assert [r.rank for r in planted.rows] == [1, 2, 3, 4]
    assert sorted(r.layer for r in planted.rows) == list(LAYERS)
    first, second = planted.rows[:2]
    assert first.layer == "hidden.0" and first.score > 5 * second.score
    before = next(r for r in plain.rows if r.layer == "hidden.0")
    assert first.score > 5 * before.score  # the outlier, not the layer's place, makes it first
    # the exact model is the same: the outlier multiplies an input that is always 0
    assert first.loss_exact == pytest.approx(before.loss_exact, rel=1e-12)
    # cast alone, hidden.0's own gradient keeps about 0.95 of its direction (0.9992 unplanted)
    assert first.layer_cosine is not None and before.layer_cosine is not None
    assert first.layer_cosine < 0.97 < 0.999 < before.layer_cosine
    assert first.batches == 2 and math.isfinite(first.loss_delta)
    # the flushed weight is read by the forward (and the dgrad), not by the wgrad (X and dY)
    assert first.forward_rel_error is not None and first.wgrad_rel_error is not None
    assert first.forward_rel_error > 10 * first.wgrad_rel_error
    assert first.forward_retention is not None and first.forward_retention < 0.9
    # hidden.0's dgrad feeds only the frozen embedding: no parameter's gradient moves
    assert first.dgrad_rel_error == 0 and first.dgrad_retention == 1


@pytest.mark.parametrize("budget", [0.0, 0.1, 0.2, 0.3, 1.0])
def test_the_budget_is_kept_and_no_layer_left_out_would_fit(budget: float) -> None:
    a = advised(True, budget)
    total = sum(r.work for r in a.rows)  # no layer of the MLP holds another
    assert a.total_work == total == sum(r.work for r in a.rows if r.kept) + sum(
        r.work for r in a.rows if not r.kept)
    assert a.kept_work == sum(r.work for r in a.rows if r.kept) <= budget * total
    for r in a.rows:
        if not r.kept:  # every layer left out would overrun the budget
            assert a.kept_work + r.work > budget * total
    # works are the layers' multiply-adds: 4 windows · 16 bytes · fan-in · fan-out per forward
    widths = {"hidden.0": (64, 32), "hidden.1": (32, 32), "hidden.2": (32, 32),
              "head": (32, 256)}
    for r in a.rows:
        assert r.work == 2 * 16 * widths[r.layer][0] * widths[r.layer][1]
    # the first ranked, hidden.0, is 2048 / 12288 = 1/6 of the work: kept from that budget on
    assert a.rows[0].layer == "hidden.0" and a.rows[0].kept is (budget >= 1 / 6)
    assert all(r.kept for r in a.rows) is (budget == 1.0)


def test_the_policy_file_round_trips_and_keeps_the_kept_layers_in_bf16(tmp_path: Path) -> None:
    a = advised(True, 0.2)
    read = policy_from_toml(a.write_policy(tmp_path / "advise.toml"))
    assert read == a.policy and read.name == f"{CAST}+advised"
    kept = [r.layer for r in a.rows if r.kept]
    assert kept == ["hidden.0"]
    bf16 = PRESETS["bf16"][0]
    for r in a.rows:
        o = read.override(r.layer)
        assert (o is not None and o.cast == bf16) is r.kept
    assert not read.keep_high_precision  # kept means bfloat16, not the model's dtype
    # under it every F.linear is routed, none plain (tests/test_policy_override.py checks
    # that an overridden module's operands are bfloat16's rounding, every role, exactly)
    m = model(True)
    with arithmetic(read, model=m) as arith:
        next_byte_loss(m, batches()[0]).backward()
    assert arith.routed["F.linear"] == len(LAYERS) and not arith.plain
    assert "# drift advise: fp8_e4m3 with the most sensitive layers kept in bf16" in a.toml


def test_the_controls_keep_the_last_layers_or_a_random_draw_within_the_budget() -> None:
    plain = model(False)
    last = advise(plain, batches()[:1], next_byte_loss, CAST, budget=0.2, choose="last")
    # last first: head (2/3 of the work) does not fit, hidden.2 (1/12) and hidden.1 (1/12) do,
    # then hidden.0 (1/6) would pass 0.2
    assert sorted(r.layer for r in last.rows if r.kept) == ["hidden.1", "hidden.2"]
    assert last.policy.name == f"{CAST}+last" and last.kept_share == pytest.approx(1 / 6)
    draws = {seed: advise(plain, batches()[:1], next_byte_loss, CAST, budget=0.2,
                          choose="random", choose_seed=seed) for seed in range(4)}
    kept = {seed: tuple(r.layer for r in a.rows if r.kept) for seed, a in draws.items()}
    assert len(set(kept.values())) > 1  # the seed draws
    for a in draws.values():  # the same rows, measured and ranked alike
        assert [r.score for r in a.rows] == [r.score for r in last.rows]
        assert a.kept_work <= 0.2 * a.total_work
        assert all(a.kept_work + r.work > 0.2 * a.total_work for r in a.rows if not r.kept)
    again = advise(plain, batches()[:1], next_byte_loss, CAST, budget=0.2, choose="random",
                   choose_seed=1)
    assert tuple(r.layer for r in again.rows if r.kept) == kept[1]
    with pytest.raises(ChoiceError, match="choose"):
        advise(plain, batches()[:1], next_byte_loss, CAST, choose="first")


def _checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    ck = save_checkpoint(tmp_path / "step-000000.safetensors", model(True), CONFIG, {"step": 0})
    story = tmp_path / "story.txt"
    story.write_text(STORY, encoding="utf-8")
    return ck, story


def test_the_command_writes_a_table_and_a_policy_grad_cosine_takes(tmp_path: Path) -> None:
    from driftcli.io.tables import read_table

    ck, story = _checkpoint(tmp_path)
    out = tmp_path / "out"
    res = runner.invoke(app, ["advise", str(ck), "-c", CAST, "--budget", "0.2", "--text",
                              str(story), "--tokens", "17", "--windows", "2", "--batches", "2",
                              "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    table, prov = read_table(out / "advise.parquet")
    rows = table.to_dict("records")
    assert rows[0]["layer"] == "hidden.0" and rows[0]["kept"] and prov["budget"] == 0.2
    assert [r["rank"] for r in rows] == [1, 2, 3, 4]
    res = runner.invoke(app, ["grad-cosine", str(ck), "-p", str(out / "advise.toml"), "-p",
                              CAST, "--text", str(story), "--tokens", "17", "--out",
                              str(tmp_path / "gc"), "--quiet"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0 and "advise" in res.output, res.output


@pytest.mark.parametrize(("args", "says"), [
    (["--budget", "1.5"], "budget 1.5 is not a share of the matmul work in [0, 1]"),
    (["--budget", "-0.1"], "budget -0.1 is not a share"),
    (["-c", "mxfp9_e4m3"], "unknown policy 'mxfp9_e4m3'"),
    (["--choose", "first"], "unknown --choose 'first' (choose from score, last, random)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    ck, story = _checkpoint(tmp_path)
    res = runner.invoke(app, ["advise", str(ck), "-c", CAST, *args, "--text", str(story),
                              "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], res.output
    assert not (tmp_path / "out").exists()


def test_the_library_refuses_a_cast_that_casts_nothing() -> None:
    with pytest.raises(AdviseError, match="casts nothing"):
        advise(model(False), batches(), next_byte_loss, "exact")
    with pytest.raises(AdviseError, match="budget"):
        advise(model(False), batches(), next_byte_loss, CAST, budget=True)


def test_a_layer_holding_others_counts_their_work_and_keeps_them() -> None:
    from driftcli.models import TransformerConfig
    from driftcli.models.nets import build_model

    torch.manual_seed(0)
    d, t, b = 16, 8, 2
    m = build_model(TransformerConfig(d_model=d, layers=1, context=t, heads=2))
    ids = torch.tensor(list(STORY.encode())[: 2 * b * (t + 1)]).reshape(2, b, t + 1)
    a = advise(m, list(ids), next_byte_loss, "mxfp8_e4m3", budget=1.0)
    work = {r.layer: r.work for r in a.rows}
    rows = b * t  # tokens of a batch: the forward's M
    assert work["blocks.0.attn.qkv"] == rows * d * 3 * d
    assert work["blocks.0.attn.proj"] == rows * d * d
    # the attention module's own q·kᵀ and P·v (t × t × d each per window), and the two inside
    assert work["blocks.0.attn"] == 2 * b * t * t * d + work["blocks.0.attn.qkv"] + work[
        "blocks.0.attn.proj"]
    top = ("blocks.0.attn", "blocks.0.mlp.fc", "blocks.0.mlp.out", "head")
    assert a.total_work == sum(work[n] for n in top) == a.kept_work
    assert all(r.kept for r in a.rows)
    # one pattern per layer not inside a kept one: the layers inside ranked below it are not named
    attn = next(r.rank for r in a.rows if r.layer == "blocks.0.attn")
    inside = [r for r in a.rows if r.layer.startswith("blocks.0.attn.")]
    assert len(a.policy.overrides) == 4 + sum(r.rank < attn for r in inside)


def test_drift_train_runs_under_the_advised_policy(tmp_path: Path) -> None:
    from driftcli.runs import TrainConfig, train

    path = advised(True, 0.2).write_policy(tmp_path / "advise.toml")
    story = tmp_path / "story.txt"
    story.write_text(STORY * 8, encoding="utf-8")
    result = train(TrainConfig(CONFIG, policy=str(path), steps=2, batch=4, eval_windows=2,
                               log_every=0), tmp_path / "run", story)
    assert len(result.rows) == 2 and result.diverged_at is None
    assert all(math.isfinite(r.loss) for r in result.rows)
