"""Recipe policies (issue 27 item 4): the table against the recipes' facts, transcribed here from
the sources (Transformer Engine d0067d0, torchao 0.18.0, the DeepSeek-V3 report); its checker
catching planted wrong entries; each policy computing what its entry says on one matmul; every
recipe policy under ``drift train`` for 20 steps and under grad-cosine on stories260K; and
``drift formats --policies`` showing each one's roles and source."""

from __future__ import annotations

import importlib.util
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from driftcli import quantize
from driftcli.arith.autograd import policy_matmul
from driftcli.arith.intercept import MatmulKind
from driftcli.arith.policy import (
    POLICIES,
    BackwardState,
    get_policy,
    policy_from_dict,
    policy_from_toml,
)
from driftcli.arith.recipe_policies import (
    RECIPE_BY_NAME,
    RECIPES,
    SLOTS,
    RecipeEntry,
    check_recipe,
    check_recipes,
)
from driftcli.cli import app
from driftcli.errors import DriftError
from driftcli.measures.grad_cosine import ALL_PARAMETERS, grad_cosine
from driftcli.models import TransformerConfig, loaders
from driftcli.models.loaders import next_token_loss
from driftcli.records.castspec import parse_cast
from driftcli.runs import TrainConfig, train

runner = CliRunner()
NAMES = [r.name for r in RECIPES]

# --- the recipes' facts, transcribed from the sources ---------------------------------------
# Per operand: (element format, granularity and block, stochastic rounding). X is the
# activation (forward.lhs, wgrad.lhs), W the weight (forward.rhs, dgrad.rhs), dY the gradient
# (dgrad.lhs, wgrad.rhs); None: not cast (high precision).
FP4_1D, FP4_2D = ("float4_e2m1fn", "block", 16), ("float4_e2m1fn", "tile", 16)
MX8 = ("float8_e4m3fn", "block", 32)
E4M3_1D, E4M3_2D = ("float8_e4m3fn", "block", 128), ("float8_e4m3fn", "tile", 128)


def slots(x: tuple | None, w: tuple | None, dy: tuple | None, *, w_dgrad: tuple | None = None,
          x_wgrad: tuple | None = None) -> dict[str, tuple | None]:
    return {"forward.lhs": x, "forward.rhs": w, "dgrad.lhs": dy,
            "dgrad.rhs": w_dgrad or w, "wgrad.lhs": x_wgrad or x, "wgrad.rhs": dy}


def sr(fact: tuple) -> tuple:
    return (*fact, "sr")


FACTS: dict[str, tuple[dict[str, tuple | None], str, tuple[str, ...]]] = {
    # recipe/__init__.py lines 499-518, 592-609; quantizer_factories.py lines 140-192
    "te/nvfp4_recipe": (slots(FP4_1D, FP4_2D, sr(FP4_1D)), "recast", ("wgrad.lhs", "wgrad.rhs")),
    # recipe/__init__.py lines 336-373
    "te/mxfp8_recipe": (slots(MX8, MX8, MX8), "recast", ()),
    # recipe/__init__.py lines 429-437
    "te/fp8_block_recipe": (slots(E4M3_1D, E4M3_2D, E4M3_1D), "recast", ()),
    # quantizer_factory_zoo.py lines 120-158: the backward in 1-D NVFP4, SR on dY only
    "te/mxfp8_fwd_nvfp4_bwd": (slots(MX8, MX8, sr(FP4_1D), w_dgrad=FP4_1D, x_wgrad=FP4_1D),
                               "recast", ("wgrad.lhs", "wgrad.rhs")),
    # quantizer_factory_zoo.py lines 238-296: row-scaled NVFP4 X, 1-D NVFP4 W, MXFP8 backward
    # from the forward's dequantized values
    "te/nvfp4_row_fwd_mxfp8_bwd": (slots(FP4_1D, FP4_1D, MX8, w_dgrad=MX8, x_wgrad=MX8),
                                   "saved-cast", ()),
    # quantizer_factory_zoo.py lines 83-103
    "te/hp_fwd_mxfp8_bwd": ({**slots(MX8, MX8, MX8), "forward.lhs": None, "forward.rhs": None},
                            "recast", ()),
    # moe_training/config.py lines 165-168, mxfp8_linear.py lines 61-64
    "torchao/mxfp8_recipe": (slots(MX8, MX8, MX8), "recast", ()),
    # nvfp4_training/nvfp4_linear.py lines 103-229
    "torchao/nvfp4_recipe": (slots(FP4_1D, FP4_2D, sr(FP4_1D)), "recast",
                             ("wgrad.lhs", "wgrad.rhs")),
    # DeepSeek-V3 report sections 3.3.2, 3.5.2
    "deepseek/v3_recipe": (slots(E4M3_1D, E4M3_2D, E4M3_1D), "saved-cast", ()),
}


# quantizer_factory_zoo.py lines 144-155: the wgrad's X from the original input
# (columnwise_source="original"), the dgrad's W from the dequantized MXFP8 weight
# ("rowwise_dequantized"); every other recipe reads both operands one way
OPERAND_STATES = {"te/mxfp8_fwd_nvfp4_bwd": ("recast", "saved-cast")}


def fact_of(text: str) -> tuple | None:
    if text == "none":
        return None
    c = parse_cast(text)
    fact = (c.format.name, c.scaling.granularity.value, c.scaling.block)
    return (*fact, "sr") if c.rounding.value == "sr" else fact


def test_the_table_is_the_recipes() -> None:
    assert list(FACTS) == NAMES
    for entry in RECIPES:
        casts, state, rht = FACTS[entry.name]
        assert {s: fact_of(entry.casts[s]) for s in SLOTS} == casts, entry.name
        assert entry.backward_state == state and entry.rht == rht, entry.name
        # no recipe here quantizes attention's matmuls by default (TE: fp8_dpa False)
        assert entry.keep_matmuls == ("attention",), entry.name
    assert check_recipes() == []


def test_the_policies_are_the_table() -> None:
    for entry in RECIPES:
        policy = get_policy(entry.name)
        assert POLICIES[entry.name][0] is policy and policy.name == entry.name
        assert policy.backward_state is BackwardState(entry.backward_state)
        assert (policy.operand_state(True).value, policy.operand_state(False).value) == \
            OPERAND_STATES.get(entry.name, (entry.backward_state,) * 2), entry.name
        assert policy.keep_matmuls == (MatmulKind.ATTENTION,)
        for role in ("forward", "dgrad", "wgrad"):
            spec = getattr(policy, role)
            lhs, rhs = entry.role_casts(role)
            if lhs == rhs == "none":
                assert spec is None
                continue
            assert (spec.lhs, spec.rhs) == (parse_cast(lhs), parse_cast(rhs)), (entry.name, role)
    deepseek = get_policy("deepseek/v3_recipe").forward
    assert (deepseek.order.value, deepseek.chunk, deepseek.accumulator.name) == \
        ("blockfma", 128, "e8m13")
    assert get_policy("deepseek/v3_recipe").keeps("model.lm_head")
    assert get_policy("deepseek/v3_recipe").keeps("model.layers.3.mlp.gate")
    assert not get_policy("deepseek/v3_recipe").keeps("model.layers.3.mlp.gate_proj")
    # a policy file can start from a recipe and change one thing
    mine = policy_from_dict({"preset": "te/nvfp4_recipe", "backward_state": "saved-cast"})
    assert mine.forward == get_policy("te/nvfp4_recipe").forward
    assert mine.backward_state is BackwardState.SAVED_CAST


@pytest.mark.parametrize("fault, caught", [
    ({"casts": {**RECIPE_BY_NAME["te/nvfp4_recipe"].casts, "forward.lhs": "te/nvfp4:sr"}},
     "forward.lhs (X) rounds stochastically"),
    ({"casts": {**RECIPE_BY_NAME["te/nvfp4_recipe"].casts, "dgrad.lhs": "te/mxfp8"}},
     "dY takes"),
    ({"casts": {**RECIPE_BY_NAME["te/nvfp4_recipe"].casts, "forward.lhs": "te/nvfp4:rht=te",
                "forward.rhs": "te/nvfp4:rht=te"}}, "RHT on the forward"),
    ({"casts": {**RECIPE_BY_NAME["te/nvfp4_recipe"].casts, "wgrad.rhs": "te/nvfp4:sr"}},
     "RHT on one of the wgrad's operands only"),
    ({"casts": {**RECIPE_BY_NAME["te/mxfp8_recipe"].casts, "dgrad.rhs": "te/mxfp9"}},
     "does not parse"),
    ({"source": "transformer_engine/common/recipe/__init__.py"}, "cites no lines"),
    ({"sources_by_operand": {"wgrad.lhs": "rowwise"}}, "sources_by_operand wgrad.lhs"),
    ({"sources_by_operand": {"forward.lhs": "original"}}, "sources_by_operand forward.lhs"),
])
def test_the_checker_catches_a_planted_wrong_entry(fault: dict, caught: str) -> None:
    wrong = replace(RECIPE_BY_NAME["te/nvfp4_recipe"], **fault)
    problems = check_recipe(wrong)
    assert len(problems) == 1 and caught in problems[0], problems
    assert any(caught in p for p in check_recipes((*RECIPES[1:], wrong)))


def test_a_name_given_twice_is_caught() -> None:
    assert check_recipes((*RECIPES, RECIPES[0])) == ["recipe policy 'te/nvfp4_recipe' is given "
                                                     "twice"]


# --- what a policy computes ----------------------------------------------------------------

def test_each_role_casts_its_operands_as_the_entry_says() -> None:
    torch.manual_seed(0)
    a = torch.randn(32, 64, requires_grad=True)
    b = torch.randn(64, 48, requires_grad=True)
    dc = torch.randn(32, 48)
    # TE's NVFP4 recipe forward: X in 1 x 16 blocks along K, W in 16 x 16 tiles
    out = policy_matmul(a, b, get_policy("te/nvfp4_recipe"))
    want = quantize(a.detach(), "te/nvfp4") @ quantize(b.detach(), "te/nvfp4_2d", axis=-2)
    assert torch.equal(out, want)
    assert not torch.equal(out, quantize(a.detach(), "te/nvfp4") @
                           quantize(b.detach(), "te/nvfp4", axis=-2))
    # row-scaled NVFP4 forward, MXFP8 dgrad cast from the forward's dequantized weight
    policy = get_policy("te/nvfp4_row_fwd_mxfp8_bwd")
    out = policy_matmul(a, b, policy)
    qb = quantize(b.detach(), "te/nvfp4", axis=-2)
    assert torch.equal(out, quantize(a.detach(), "te/nvfp4_row") @ qb)
    (out * dc).sum().backward()
    assert torch.equal(a.grad, quantize(dc, "te/mxfp8") @ quantize(qb.T, "te/mxfp8", axis=-2))
    recast = quantize(dc, "te/mxfp8") @ quantize(b.detach().T, "te/mxfp8", axis=-2)
    assert not torch.equal(a.grad, recast)
    # high-precision forward: the plain product
    assert torch.equal(policy_matmul(a, b, get_policy("te/hp_fwd_mxfp8_bwd")), a @ b)


def test_the_backward_state_is_per_operand() -> None:
    """One operand recast from the original, the other cast from the forward's dequantized
    values (te/mxfp8_fwd_nvfp4_bwd's split, deterministic casts so the grads can be written
    out): each gradient equals its own recipe and not the other state's."""
    torch.manual_seed(1)
    a = torch.randn(32, 64, requires_grad=True)
    b = (torch.randn(64, 48) * 3).requires_grad_()
    dc = torch.randn(32, 48)
    hybrid = policy_from_dict({
        "matmul": {"lhs": "te/mxfp8", "rhs": "te/mxfp8"},
        "dgrad": {"lhs": "te/nvfp4", "rhs": "te/nvfp4"},
        "wgrad": {"lhs": "te/nvfp4", "rhs": "te/nvfp4"},
        "backward_state": {"lhs": "recast", "rhs": "saved-cast"}})
    assert "backward: lhs recast, rhs saved-cast" in hybrid.describe()
    (policy_matmul(a, b, hybrid) * dc).sum().backward()
    qa = quantize(a.detach(), "te/mxfp8")
    qb = quantize(b.detach(), "te/mxfp8", axis=-2)
    g = quantize(dc, "te/nvfp4")  # dY along N for the dgrad
    saved_w = g @ quantize(qb.T, "te/nvfp4", axis=-2)
    recast_w = g @ quantize(b.detach().T, "te/nvfp4", axis=-2)
    assert torch.equal(a.grad, saved_w) and not torch.equal(a.grad, recast_w)
    g = quantize(dc, "te/nvfp4", axis=-2)  # dY along M for the wgrad
    recast_x = quantize(a.detach().T, "te/nvfp4") @ g
    saved_x = quantize(qa.T, "te/nvfp4") @ g
    assert torch.equal(b.grad, recast_x) and not torch.equal(b.grad, saved_x)
    # the recipe itself carries the split; a file starting from it can set one side
    recipe = get_policy("te/mxfp8_fwd_nvfp4_bwd")
    assert (recipe.operand_state(True), recipe.operand_state(False)) == \
        (BackwardState.RECAST, BackwardState.SAVED_CAST)
    mine = policy_from_dict({"preset": "te/mxfp8_fwd_nvfp4_bwd",
                             "backward_state": {"rhs": "recast"}})
    assert mine.operand_state(False) is BackwardState.RECAST
    assert policy_from_dict({"preset": "te/mxfp8_fwd_nvfp4_bwd",
                             "backward_state": "saved-cast"}).operand_state(True) is \
        BackwardState.SAVED_CAST


@pytest.mark.parametrize("given", [{"x": "recast"}, {"lhs": "fresh"}, {}, ["recast"]])
def test_a_wrong_per_operand_state_is_refused(given: object) -> None:
    with pytest.raises(DriftError, match="backward_state"):
        policy_from_dict({"preset": "te/mxfp8_recipe", "backward_state": given})


def test_a_policy_file_gives_the_state_per_operand(tmp_path: Path) -> None:
    path = tmp_path / "hybrid.toml"
    path.write_text('preset = "te/mxfp8_recipe"\n'
                    'backward_state = {lhs = "saved-cast", rhs = "recast"}\n')
    p = policy_from_toml(path)
    assert (p.operand_state(True), p.operand_state(False)) == \
        (BackwardState.SAVED_CAST, BackwardState.RECAST)


# --- drift train, 20 steps -------------------------------------------------------------------

VERSE = ("the king and queen of a far country went walking by the sea at night and spoke of "
         "what the morning would bring")


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    words = VERSE.split()
    path = tmp_path_factory.mktemp("text") / "verse.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(7))
                              for _ in range(600)) + "\n")
    return path


@pytest.fixture(scope="module")
def float32_losses(text: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return [r.loss for r in train(TrainConfig(TINY, policy="float32", steps=20, batch=4),
                                  tmp_path_factory.mktemp("f32") / "run", text).rows]


TINY = TransformerConfig(context=8, d_model=16, layers=1, heads=2)
"""A one-block transformer (attention and linear maps): 20 steps take about a second."""


@pytest.mark.parametrize("name", NAMES)
def test_each_recipe_trains_20_steps(name: str, text: Path, tmp_path: Path,
                                     float32_losses: list[float]) -> None:
    result = train(TrainConfig(TINY, policy=name, steps=20, batch=4), tmp_path / "run", text)
    losses = [r.loss for r in result.rows]
    assert result.steps_done == 20 and result.diverged_at is None
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5
    # the casts change the run: not one loss after the first step is float32's
    assert len(losses) == len(float32_losses) == 20
    assert all(a != b for a, b in zip(losses[2:], float32_losses[2:], strict=True)), name


def test_drift_train_takes_a_recipe_name(text: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["train", "--out", str(tmp_path / "run"), "--text", str(text), "-q",
                              "--hidden", "16", "--layers", "1", "--context", "8", "--batch",
                              "8", "--steps", "20", "--policy", "te/nvfp4_recipe"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["train", "--out", str(tmp_path / "bad"), "--text", str(text),
                              "--policy", "te/nvfp4_recipes"])
    assert res.exit_code == 2 and "te/nvfp4_recipe" in res.output  # the close match named


# --- grad-cosine on stories260K -------------------------------------------------------------

STORIES = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "stories260K-hf"
NO_HF = importlib.util.find_spec("transformers") is None or not STORIES.is_dir()
NO_HF_REASON = ("the HF checkpoint needs driftcli[hf] (transformers) and the shared "
                f"stories260K folder at {STORIES}")
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
         "park. One day, she saw a big, red ball. She wanted to play with it, but it was too "
         "high.")

# grad-cosine's aggregate cosine over every parameter against the float64 exact policy, 16
# tokens of STORY (docs/recipes.md#recipe-policies shows these, rounded to 3 places). The
# casts are exact and seeded; the matmuls are torch's float32 ones, whose order a CPU may
# change, so the check allows 5e-4.
COSINES = {"te/nvfp4_recipe": 0.519, "te/mxfp8_recipe": 0.979,
           "te/fp8_block_recipe": 0.979, "te/mxfp8_fwd_nvfp4_bwd": 0.902,
           "te/nvfp4_row_fwd_mxfp8_bwd": 0.780, "te/hp_fwd_mxfp8_bwd": 0.996,
           "torchao/mxfp8_recipe": 0.979, "torchao/nvfp4_recipe": 0.515,
           "deepseek/v3_recipe": 0.980}
# te/nvfp4 casts attention's operands too (every recipe keeps attention in high precision), and
# its cosine is each machine's own: o_proj's cast of P·v's output finds elements exactly on a
# rounding tie, which side MKL's float32 sgemm lands on depends on the kernel it picks for the
# CPU, and one flip sends the 4-bit forward elsewhere (tests/test_findings_rht.py's
# COSINE_B0_MACHINE: these 16 tokens are its batch 0). 0.446 on the AMD EPYC machine, 0.287 on
# an Intel Xeon, 0.203 to 0.414 under other MKL paths there: asserted is what held on all, above
# the floor and below the recipe.
MACHINE_COSINES = {"te/nvfp4": {"AMD EPYC": 0.446, "Intel Xeon": 0.287}}
MACHINE_FLOOR = 0.15


@pytest.mark.slow  # every recipe on the real model: 28-65 s on the shared 2-core machine
@pytest.mark.skipif(NO_HF, reason=NO_HF_REASON)
def test_every_recipe_under_grad_cosine_on_stories260k() -> None:
    stories = loaders.load_causal_lm(STORIES)
    ids = loaders.text_batch(stories, STORY, 16)
    rows = grad_cosine(stories.model, ids, next_token_loss(stories.logits),
                       ["exact", *COSINES, *MACHINE_COSINES], checkpoint=str(STORIES))
    agg = {r.policy: r for r in rows if r.parameter == ALL_PARAMETERS}
    exact = agg["exact"].loss_exact
    for name, cosine in COSINES.items():
        got = agg[name]
        assert abs(got.cosine - cosine) <= 5e-4, (name, got.cosine)
        assert got.policy_spec == get_policy(name).describe()
        # an uncast forward gives the exact loss itself; every cast forward moves it
        assert (got.loss == exact) is (name == "te/hp_fwd_mxfp8_bwd"), name
    recipe = agg["te/nvfp4_recipe"].cosine
    for name in MACHINE_COSINES:
        mine = agg[name].cosine
        assert mine is not None and recipe is not None and MACHINE_FLOOR < mine < recipe, name
        assert agg[name].loss != exact, name
    # the hybrid's forward is te/mxfp8_recipe's, so its loss is too
    assert agg["te/mxfp8_fwd_nvfp4_bwd"].loss == agg["te/mxfp8_recipe"].loss


def test_recipes_md_shows_the_cosines() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text(encoding="utf-8")
    table = doc.split("| policy | cosine |")[1].split("\n\n")[0]
    for name, cosine in COSINES.items():
        row = next(line for line in table.splitlines() if f"`{name}`" in line)
        assert f"| {cosine:.3f} |" in row, (name, row)
    for name, machines in MACHINE_COSINES.items():
        row = next(line for line in table.splitlines() if f"`{name}`" in line)
        for machine, cosine in machines.items():
            assert f"{cosine:.3f} ({machine})" in row, (name, row)


# --- drift formats --policies ----------------------------------------------------------------

def test_formats_policies_lists_each_recipe_with_roles_and_source() -> None:
    res = runner.invoke(app, ["formats", "--policies", "--json"])
    assert res.exit_code == 0, res.output
    listed = {r["preset"]: r for r in json.loads(res.stdout) if r["registry"] == "recipe policy"}
    assert list(listed) == NAMES
    te = listed["te/nvfp4_recipe"]
    assert te["roles"] == {"forward": {"lhs": "te/nvfp4", "rhs": "te/nvfp4_2d"},
                           "dgrad": {"lhs": "te/nvfp4:sr", "rhs": "te/nvfp4_2d"},
                           "wgrad": {"lhs": "te/nvfp4:rht=te", "rhs": "te/nvfp4:sr:rht=te"}}
    assert te["rht"] == ["wgrad.lhs", "wgrad.rhs"] and "592-609 (QParams" in te["source"]
    assert te["backward_state"] == "recast" and te["keep_matmuls"] == ["attention"]
    res = runner.invoke(app, ["formats", "--policies"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "recipe policies" in res.stdout and "te/nvfp4_2d" in res.stdout
    assert "te/nvfp4:sr:rht=te" in res.stdout and "plain (high precision)" in res.stdout
    for name in NAMES:  # each one's source, one paragraph below the table
        assert f"{name}: {RECIPE_BY_NAME[name].source}" in " ".join(res.stdout.split())


def test_entries_are_frozen_data() -> None:
    entry = RECIPES[0]
    assert isinstance(entry, RecipeEntry)
    with pytest.raises(AttributeError):
        entry.name = "x"  # type: ignore[misc]
