"""drift train, drift dump and drift probe end to end on tiny models and a text written here:
deterministic runs (same table, byte-identical checkpoints), divergence recorded and stopped,
operand rates measured by the clip-rate and underflow-rate code, dumps with every matmul
operand, and one-line errors (probe rows: test_probe.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
import typer.main
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from driftcli.arith.policy import get_policy
from driftcli.cli import app
from driftcli.io.tables import read_table
from driftcli.measures.probe_attention import AttentionRow
from driftcli.models import (
    MLPConfig,
    TransformerConfig,
    build_model,
    count_parameters,
    load_checkpoint,
)
from driftcli.models.nets import count_matmuls
from driftcli.runs import TrainConfig, TrainRow, train
from driftcli.runs.dump import dump_operands
from driftcli.runs.probe import ProbeRow, probe
from driftcli.runs.training import operand_rates

runner = CliRunner()

VERSE = ("the king and queen of a far country went walking by the sea at night, and spoke of "
         "what the morning would bring; the fool laughed, the soldier wept, the old man slept "
         "under a tree whose leaves were silver in the moon")
TINY = ["--hidden", "16", "--layers", "1", "--context", "8", "--batch", "8"]
"""A ~6k-parameter MLP: a step takes milliseconds."""


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 30 kB of English-like verse made here (nothing from the corpus is committed)."""
    rng = random.Random(0)
    words = VERSE.split()
    lines = []
    for _ in range(900):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 9)))
        lines.append(line[0].upper() + line[1:] + rng.choice([",", ".", ";", "!", "?"]))
    path = tmp_path_factory.mktemp("text") / "verse.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def drift(*args: str | Path) -> tuple[int, str, str]:
    """Run a drift command; (exit code, stdout, stderr)."""
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def trained(run: Path, text: Path, *extra: str) -> Path:
    code, _, err = drift("train", "--out", run, "--text", text, "-q", *TINY, *extra)
    assert code == 0, err
    return run


# --- train -------------------------------------------------------------------------------------

def test_same_seed_same_run_bit_for_bit(text: Path, tmp_path: Path) -> None:
    args = ("--steps", "12", "--checkpoint-every", "6", "--log-every", "4", "--eval-every", "6",
            "--policy", "mxfp8_e4m3:sr", "--seed", "3")
    a = trained(tmp_path / "a" / "run", text, *args)
    b = trained(tmp_path / "b" / "run", text, *args)
    fa, prov = read_table(a / "train.parquet")
    fb, _ = read_table(b / "train.parquet")
    pd.testing.assert_frame_equal(fa, fb)
    names = sorted(p.name for p in a.glob("step-*.safetensors"))
    assert names == ["step-000000.safetensors", "step-000006.safetensors",
                     "step-000012.safetensors"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # the table is what the options asked for
    assert fa.step.tolist() == list(range(1, 13)) and not fa.diverged.any()
    logged = fa[fa.clip_rate_activation.notna()].step.tolist()
    assert logged == [1, 4, 8, 12]
    assert fa[fa.val_loss.notna()].step.tolist() == [6, 12]
    assert (fa.grad_norm > 0).all() and (fa.update_norm > 0).all() and (fa.lr == 3e-3).all()
    assert prov["diverged_at"] is None and prov["train"]["policy"] == "mxfp8_e4m3:sr"
    # the loss goes down on this repetitive text, and another seed gives another run
    assert fa.loss.iloc[-1] < fa.loss.iloc[0] - 0.2
    c = trained(tmp_path / "c" / "run", text, *args[:-1], "4")
    assert not read_table(c / "train.parquet")[0].loss.equals(fa.loss)


def test_checkpoint_state_rebuilds_the_run(text: Path, tmp_path: Path) -> None:
    run = trained(tmp_path / "run", text, "--steps", "5", "--schedule", "cosine", "--warmup",
                  "2", "--lr", "0.01")
    ck = load_checkpoint(run / "step-000005.safetensors")
    assert ck.step == 5 and ck.config == MLPConfig(context=8, embed=16, hidden=16, layers=1)
    assert ck.state["policy"] == "exact" and ck.state["train"]["schedule"] == "cosine"
    assert ck.state["text"]["source"] == str(text)
    assert ck.state["text"]["path"] == str(text.resolve())
    frame, _ = read_table(run / "train.parquet")
    # warm-up 0.005, 0.01, then half a cosine down to a tenth of the rate at the last step
    assert frame.lr.tolist()[:2] == [0.005, 0.01] and frame.lr.iloc[-1] == pytest.approx(1e-3)
    assert ck.state["lr"] == frame.lr.iloc[-1]
    assert set(ck.optimizer) == {"exp_avg", "exp_avg_sq"}
    assert set(ck.optimizer["exp_avg"]) == {n for n, _ in ck.model.named_parameters()}
    run_json = json.loads((run / "run.json").read_text())
    assert run_json["steps_done"] == 5 and run_json["checkpoints"] == ["step-000005.safetensors"]


def test_storage_rounds_the_weights_after_every_step(text: Path, tmp_path: Path) -> None:
    """--storage float16: every checkpoint's weights are float16 values (initialisation
    included) while the AdamW moments stay float32; the setting is recorded where probe and
    health read it and is their default storage. The float32 run of the same settings holds
    weights float16 cannot (the check would catch a storage that rounds nothing)."""
    args = ("--steps", "4", "--checkpoint-every", "2", "--log-every", "0")
    half = trained(tmp_path / "half", text, *args, "--storage", "float16")
    plain = trained(tmp_path / "plain", text, *args)

    def off_grid(t: torch.Tensor) -> int:
        return int((t.half().float() != t).sum())

    for step in (0, 2, 4):
        ck = load_checkpoint(half / f"step-{step:06d}.safetensors")
        assert all(off_grid(p.detach()) == 0 for p in ck.model.parameters()), step
        assert ck.state["train"]["storage"] == "float16"
        theirs = load_checkpoint(plain / f"step-{step:06d}.safetensors")
        assert sum(off_grid(p.detach()) for p in theirs.model.parameters()) > 1000, step
        if step:
            assert sum(off_grid(m) for m in ck.optimizer["exp_avg"].values()) > 1000
    frame, prov = read_table(half / "train.parquet")
    assert prov["train"]["storage"] == "float16" and (frame.update_norm > 0).all()
    assert json.loads((half / "run.json").read_text())["config"]["storage"] == "float16"
    assert {r.storage for r in probe(half, ["exact"])} == {"float16"}
    assert {r.storage for r in probe(plain, ["exact"])} == {"bfloat16"}
    assert {r.storage for r in probe(half, ["exact"], storage="float32")} == {"float32"}
    from driftcli.runs.health import health

    frozen = {r.step: r.frozen_share for r in health(half) if r.parameter == "*"}
    assert frozen[0] is None and all(0 < frozen[s] < 1 for s in (2, 4))  # type: ignore[operator]
    _one_line_error(*drift("train", "--out", tmp_path / "x", "--text", text, "--storage",
                           "float8")[::2], "float8")
    with pytest.raises(ValueError, match="storage format"):
        TrainConfig(storage="float8")  # type: ignore[arg-type]


def test_divergence_is_recorded_and_stops_the_run(text: Path, tmp_path: Path) -> None:
    run = trained(tmp_path / "run", text, "--steps", "40", "--lr", "1000", "--checkpoint-every",
                  "1")
    frame, prov = read_table(run / "train.parquet")
    at = prov["diverged_at"]
    assert at is not None and at < 40
    assert frame.step.tolist() == list(range(1, at + 1))
    assert frame.diverged.tolist() == [False] * (at - 1) + [True]
    last = frame.iloc[-1]
    assert not math.isfinite(last.loss) or last.loss > 4 * frame.loss.iloc[:-1].min()
    assert math.isnan(last.update_norm)  # no update taken
    assert json.loads((run / "run.json").read_text())["diverged_at"] == at
    # the last finite weights are kept; none after the divergence
    steps = sorted(int(p.stem.split("-")[1]) for p in run.glob("step-*.safetensors"))
    assert steps[-1] == at - 1


def test_non_finite_loss_is_a_divergence(text: Path, tmp_path: Path) -> None:
    # lr * weight_decay * w overflows float32 in the first update, so every nonzero weight is
    # ±inf at step 2 (IEEE overflow, the same on every CPU), and sums of infinities of both
    # signs are NaN in any order: the step-2 loss is non-finite by construction. (lr alone,
    # say 1e30, left a finite 1e29 loss on one CPU and NaN on another.)
    result = train(TrainConfig(MLPConfig(context=4, embed=4, hidden=8, layers=1), steps=20,
                               batch=4, optimizer="sgd", lr=1e30, weight_decay=1e30,
                               momentum=0.0),
                   tmp_path / "run", text)
    assert result.diverged_at == 2
    assert result.diverged_at is not None
    assert not math.isfinite(result.rows[-1].loss) and result.rows[-1].grad_norm is None


def test_operand_rates_are_clip_rate_and_underflow_rate_by_role(text: Path,
                                                                tmp_path: Path) -> None:
    """The train table's rates come from the measurement commands' code: on a dump, the
    role-summed counts of drift clip-rate / underflow-rate give the same rates."""
    run = trained(tmp_path / "run", text, "--steps", "3")
    dump = tmp_path / "dump.safetensors"
    dump_operands(run / "step-000003.safetensors", dump, text, windows=4)
    cast = "mxfp8_e4m3"
    rates = operand_rates(dump, get_policy("exact"), measure=get_policy(cast).forward.lhs)
    assert operand_rates(dump, get_policy("exact")) == dict.fromkeys(rates)  # exact casts nothing
    for measure, count, of in (("clip-rate", "clipped", "n_finite"),
                               ("underflow-rate", "underflowed", "n_nonzero")):
        code, _, err = drift(measure, dump, "-c", cast, "--out", tmp_path, "-q")
        assert code == 0, err
        frame, _ = read_table(tmp_path / f"{measure}.parquet")
        frame = frame[frame.tensor != "*"]
        for role, part in frame.groupby("role"):
            expected = part[count].sum() / part[of].sum()
            assert rates[f"{measure.replace('-', '_')}_{role}"] == pytest.approx(expected,
                                                                                 rel=1e-12)
    assert rates["clip_rate_activation"] > 0  # tanh activations near 1 clip under the floor rule


@pytest.mark.parametrize("model", [
    (), ("--model", "transformer", "--activation", "tanh", "--layers", "1", "--d-model", "16",
         "--context", "8")], ids=["mlp", "transformer"])
def test_logging_rates_does_not_change_the_run(text: Path, tmp_path: Path,
                                               model: tuple[str, ...]) -> None:
    """The capture at logged steps (and the transformer's attention probes) leaves the step
    alone: with and without logging, the same losses and identical weights and optimizer
    state."""
    args = ("--steps", "3", "--policy", "mxfp8_e4m3", *model)
    logged = trained(tmp_path / "a" / "run", text, *args, "--log-every", "1")
    silent = trained(tmp_path / "b" / "run", text, *args, "--log-every", "0")
    a, _ = read_table(logged / "train.parquet")
    b, _ = read_table(silent / "train.parquet")
    assert a.clip_rate_weight.notna().all() and b.clip_rate_weight.isna().all()
    assert a.loss.tolist() == b.loss.tolist()
    name = "step-000003.safetensors"  # the config (log_every) differs; the tensors do not
    mine, theirs = load_file(logged / name), load_file(silent / name)
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_measure_cast_logs_rates_in_an_exact_run(text: Path, tmp_path: Path) -> None:
    plain = trained(tmp_path / "plain", text, "--steps", "2", "--log-every", "1")
    watched = trained(tmp_path / "watched", text, "--steps", "2", "--log-every", "1",
                      "--measure-cast", "mxfp8_e4m3")
    p, _ = read_table(plain / "train.parquet")
    w, _ = read_table(watched / "train.parquet")
    assert p.clip_rate_weight.isna().all() and w.clip_rate_weight.notna().all()
    assert p.loss.tolist() == w.loss.tolist()  # watching changes nothing


def test_transformer_trains_under_a_policy(text: Path, tmp_path: Path) -> None:
    result = train(TrainConfig(TransformerConfig(context=8, d_model=16, layers=1, heads=2),
                               policy="mxfp8_e4m3", steps=3, batch=4, log_every=1),
                   tmp_path / "run", text)
    assert result.steps_done == 3 and result.diverged_at is None
    rows = result.rows
    assert all(r.clip_rate_gradient is not None for r in rows)
    assert rows[-1].loss < rows[0].loss


# --- dump --------------------------------------------------------------------------------------

def test_dump_of_the_transformer_has_every_matmul_operand(text: Path, tmp_path: Path) -> None:
    config = TransformerConfig(context=8, d_model=16, layers=2, heads=2)
    result = train(TrainConfig(config, steps=1, batch=4), tmp_path / "run", text)
    dump = tmp_path / "dump.safetensors"
    code, out, err = drift("dump", result.checkpoints[-1], "--text", text, "--out", dump,
                           "--batch", "3", "--json")
    assert code == 0, err
    summary = json.loads(out)
    n = count_matmuls(config)  # 6 per block + the head
    # per matmul: its two operands (weights once per layer) and its output gradient
    assert summary["roles"] == {"activation": 8 * config.layers + 1,
                                "weight": 4 * config.layers + 1, "gradient": n}
    assert summary["tensors"] == 2 * n + n and summary["step"] == 1
    assert summary["batch_shape"] == [3, 9]
    from safetensors import safe_open

    with safe_open(str(dump), framework="pt") as fh:
        meta = json.loads(fh.metadata()["drift.dump"])["tensors"]
        assert fh.get_tensor("blocks.0.attn/0/lhs").shape == (3, 2, 8, 8)  # q
        assert fh.get_tensor("blocks.0.attn/1/lhs").shape == (3, 2, 8, 8)  # p
    assert meta["blocks.1.attn/0/rhs"] == {"role": "activation", "layer": "blocks.1.attn",
                                           "operand": "forward.rhs dgrad.rhs", "step": 1}
    assert {m["operand"] for m in meta.values() if m["role"] == "gradient"} == {
        "dgrad.lhs wgrad.lhs", "dgrad.lhs wgrad.rhs"}
    code, _, err = drift("clip-rate", dump, "-c", "mxfp8_e4m3", "--out", tmp_path, "-q")
    assert code == 0, err
    frame, _ = read_table(tmp_path / "clip-rate.parquet")
    per = frame[frame.tensor != "*"]
    assert len(per) == summary["tensors"]
    assert per.groupby("role").size().to_dict() == summary["roles"]


# --- grad-cosine and probe ---------------------------------------------------------------------

def test_grad_cosine_reads_a_drift_checkpoint(text: Path, tmp_path: Path) -> None:
    run = trained(tmp_path / "run", text, "--steps", "4")
    code, _, err = drift("grad-cosine", run / "step-000004.safetensors", "-p", "exact", "-p",
                         "mxfp8_e4m3", "--text", text, "--tokens", "9", "--windows", "4",
                         "--out", tmp_path, "-q")
    assert code == 0, err
    frame, prov = read_table(tmp_path / "grad-cosine.parquet")
    assert prov["checkpoint_kind"] == "drift"
    exact = frame[frame.policy == "exact"]
    assert len(exact) == 5 + 1 and ((exact.cosine - 1).abs() < 1e-12).all()  # 5 tensors, *
    assert (frame[frame.policy == "mxfp8_e4m3"].cosine < 1).any()


def test_a_run_finds_its_text_from_any_folder(text: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "here"
    here.mkdir()
    (here / "verse.txt").write_bytes(text.read_bytes())
    monkeypatch.chdir(here)
    trained(Path("run"), Path("verse.txt"), "--steps", "2")  # a relative text path
    monkeypatch.chdir(tmp_path)
    assert len(probe(here / "run", ["exact"], windows=2)) == 6
    code, _, err = drift("dump", here / "run" / "step-000002.safetensors", "--out",
                         tmp_path / "d.safetensors", "-q")
    assert code == 0, err
    (here / "verse.txt").write_text("another text entirely " * 100)
    _one_line_error(*drift("probe", here / "run", "-p", "exact")[::2],
                    "has changed since the run", "--text FILE")


# --- bad input ---------------------------------------------------------------------------------

def _one_line_error(code: int, err: str, *parts: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for part in parts:
        assert part in lines[0], lines[0]


def test_bad_input_is_one_line_exit_2(text: Path, tmp_path: Path) -> None:
    plain = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(2, 2)}, str(plain))
    _one_line_error(*drift("dump", plain, "--text", text, "--out", tmp_path / "d.st")[::2],
                    "not a drift model checkpoint")
    _one_line_error(*drift("grad-cosine", plain, "-p", "exact", "--text", text)[::2],
                    "not a drift model checkpoint")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _one_line_error(*drift("train", "--out", tmp_path / "r", "--text", empty, *TINY)[::2],
                    "is empty")
    _one_line_error(*drift("probe", tmp_path, "-p", "exact")[::2], "has no checkpoint")
    run = trained(tmp_path / "run", text, "--steps", "1")
    _one_line_error(*drift("train", "--out", run, "--text", text, *TINY)[::2],
                    "already holds a run", "--overwrite")
    _one_line_error(*drift("train", "--out", tmp_path / "x", "--text", text, "-p", "e4m3x")[::2],
                    "unknown policy 'e4m3x'")
    _one_line_error(*drift("train", "--out", tmp_path / "x", "--text", text, "--context",
                           "5000")[::2], "fewer than one window of 5001")
    _one_line_error(*drift("train", "--model", "transformer", "--d-model", "10", "--heads", "4",
                           "--out", tmp_path / "x", "--text", text)[::2], "multiple of heads")
    _one_line_error(*drift("train", "--heads", "4", "--out", tmp_path / "x", "--text",
                           text)[::2], "--heads set the transformer's shape")


# --- docs --------------------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("command, page, row_type", [
    ("train", "train.md", TrainRow), ("train", "train.md", AttentionRow),
    ("dump", "dump.md", None), ("probe", "probe.md", ProbeRow)])
def test_docs_name_every_option_and_column(command: str, page: str,
                                           row_type: type | None) -> None:
    text = (DOCS / page).read_text()
    assert f"drift {command}" in text
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    for param in click_command.params:
        for opt in param.opts:
            if opt.startswith("--"):
                assert f"`{opt}" in text or f"{opt}" in text.split("```")[1], (opt, page)
    if row_type is not None:
        for f in dataclasses.fields(row_type):
            assert f"| `{f.name}` |" in text, f"{f.name} missing from docs/{page}"


def test_documented_sizes_are_the_models() -> None:
    text = (DOCS / "train.md").read_text()
    for config in (MLPConfig(), TransformerConfig()):
        assert f"{count_parameters(build_model(config)):,}" in text
