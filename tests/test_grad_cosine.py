"""grad-cosine: the exact policy is the reference, float32 is nearly it, the MX floor rule loses
gradient on tanh activations where ceil does not, stochastic rounding is unbiased per step, and
the command runs on a real Hugging Face model (when transformers is installed) and on a model
kind registered in a test."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from typer.testing import CliRunner

from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import get_policy
from driftcli.cli import app
from driftcli.io.tables import read_table, schema_of
from driftcli.measures.grad_cosine import ALL_PARAMETERS, GradCosineRow, grad_cosine
from driftcli.measures.stats import cast_stats
from driftcli.models import loaders
from driftcli.models.loaders import CausalLM, CheckpointKind, next_token_loss

runner = CliRunner()
STORIES = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "stories260K-hf"
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
         "park. One day, she saw a big, red ball. She wanted to play with it, but it was too "
         "high. Lily asked her mom for help. Her mom said, \"Let's find a stick to get the ball "
         "down.\" They found a long stick and Lily got the ball. She was very happy.")


class TinyLM(nn.Module):
    """A causal LM with every routed kind of matmul: F.linear, an einsum and sdpa."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mix = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim))
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        heads = [t.unflatten(-1, (4, -1)).transpose(1, 2) for t in (q, k, v)]
        a = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2).flatten(2)
        h = h + torch.tanh(torch.einsum("btd,de->bte", a, self.mix))
        return self.out(h)


def tiny_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids)


def tiny_case() -> tuple[TinyLM, torch.Tensor]:
    torch.manual_seed(3)
    return TinyLM(), torch.randint(0, 64, (2, 40))


def by_param(rows: list[GradCosineRow], policy: str) -> dict[str, GradCosineRow]:
    return {r.parameter: r for r in rows if r.policy == policy}


# --- the acceptance points --------------------------------------------------------------------

def test_exact_policy_is_the_reference_and_float32_is_close() -> None:
    model, ids = tiny_case()
    rows = grad_cosine(model, ids, next_token_loss(tiny_logits), ["exact", "float32"])
    exact, f32 = by_param(rows, "exact"), by_param(rows, "float32")
    names = [n for n, _ in model.named_parameters()]
    assert list(exact) == [*names, ALL_PARAMETERS] and list(f32) == list(exact)
    for r in exact.values():
        assert abs(r.cosine - 1) <= 1e-12 and abs(r.retention - 1) <= 1e-12
        assert abs(r.norm_ratio - 1) <= 1e-12 and r.rel_error <= 1e-12
        assert r.loss == r.loss_exact and r.draws == 1 and r.expected_cosine is None
    for r in f32.values():
        assert r.cosine > 0.999999 and abs(r.retention - 1) < 1e-5, r
        assert 0 < r.rel_error < 1e-4  # float32 really ran: not the float64 path
    agg = f32[ALL_PARAMETERS]
    assert agg.numel == sum(p.numel() for p in model.parameters())
    assert agg.grad_norm_exact == pytest.approx(math.sqrt(sum(
        r.grad_norm_exact ** 2 for n, r in f32.items() if n != ALL_PARAMETERS)), rel=1e-12)
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched


def tanh_mlp() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                          nn.Linear(128, 10))
    x = torch.randn(256, 64) * 2  # pre-activations of about 1.1: tanh saturates often
    return model, (x, torch.randint(0, 10, (256,)))


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_floor_scales_lose_gradient_on_tanh_where_ceil_does_not() -> None:
    """The MX floor rule gives a block the scale 2**(floor(log2 amax) - 8): a block whose amax
    lies in [1.75, 2)·2**k has its largest elements above E4M3's 448 = 1.75·2**8 and clips
    them. tanh outputs pile up just under 1.0 = 1.98·2**-1, the worst spot: everything in
    (0.875, 1) is clipped to 0.875 (here 24% of the first tanh layer's outputs). The clipping
    only shrinks, so the wgrads reading those activations lose gradient along its own
    direction; ceil (the scale rounded up) never clips.

    Measured (seed 0): retention 0.9453 under mxfp8_e4m3 (floor), 0.9994 under
    mxfp8_e4m3_ceil; the weights reading tanh outputs keep 0.93 under floor."""
    model, batch = tanh_mlp()
    rows = grad_cosine(model, batch, mlp_loss, ["mxfp8_e4m3", "mxfp8_e4m3_ceil"])
    floor, ceil = by_param(rows, "mxfp8_e4m3"), by_param(rows, "mxfp8_e4m3_ceil")
    f, c = floor[ALL_PARAMETERS].retention, ceil[ALL_PARAMETERS].retention
    assert f < c - 0.02, f"floor retention {f:.4f} should be well below ceil's {c:.4f}"
    assert f < 0.97 and abs(c - 1) < 0.01, (f, c)
    for name in ("2.weight", "4.weight"):  # wgrad = dYᵀ·tanh(...): the clipped operand
        assert floor[name].retention < ceil[name].retention - 0.03, name
    hidden = torch.tanh(model[0](batch[0])).detach()
    clipped = {p: cast_stats(hidden, p, axis=-1)[0].clipped / hidden.numel()
               for p in ("mxfp8_e4m3", "mxfp8_e4m3_ceil")}
    assert clipped["mxfp8_e4m3"] > 0.1 and clipped["mxfp8_e4m3_ceil"] == 0, clipped
    assert clipped["mxfp8_e4m3"] == float((hidden.abs() > 0.875).float().mean())


def test_stochastic_rounding_is_unbiased_per_step() -> None:
    """With a loss linear in the output and no clipping (ceil scales), every gradient is a
    product of independently SR-cast operands, whose expectation is the exact product: the
    mean of N draws approaches g with an error that shrinks as 1/sqrt(N)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(48, 64, bias=False), nn.Linear(64, 32, bias=False))
    x, upstream = torch.randn(96, 48), torch.randn(96, 32)

    def linear_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (m(b[0]) * b[1]).sum()

    errors = {}
    for n in (4, 16, 64):
        agg = by_param(grad_cosine(model, (x, upstream), linear_loss, ["mxfp4_e2m1_ceil:sr"],
                                   draws=n, seed=5), "mxfp4_e2m1_ceil:sr")[ALL_PARAMETERS]
        assert agg.draws == n
        per_draw = agg.rel_error  # one draw's error: ‖ĝ - g‖/‖g‖, about 0.3 for FP4
        assert 0.05 < per_draw < 1
        assert agg.expected_rel_error <= 2 * per_draw / math.sqrt(n), (n, agg)
        assert agg.expected_retention == pytest.approx(1, abs=3 * per_draw / math.sqrt(n))
        errors[n] = agg.expected_rel_error
    assert errors[64] < errors[4] / 2.5, errors  # 1/sqrt(16) = 0.25 expected
    biased = by_param(grad_cosine(model, (x, upstream), linear_loss, ["mxfp4_e2m1"], draws=16),
                      "mxfp4_e2m1")[ALL_PARAMETERS]
    assert biased.draws == 1 and biased.expected_rel_error is None  # deterministic: one draw


def test_keep_high_precision_policy_in_grad_cosine() -> None:
    model, ids = tiny_case()
    keep_out = replace(get_policy("nvfp4"), name="nvfp4-keep-out", keep_high_precision=("out",))
    rows = grad_cosine(model, ids, next_token_loss(tiny_logits), ["nvfp4", keep_out])
    plain, kept = by_param(rows, "nvfp4"), by_param(rows, "nvfp4-keep-out")
    assert kept["out.bias"].cosine > plain["out.bias"].cosine
    assert kept[ALL_PARAMETERS].policy_spec.endswith("keep: out")


# --- the real model ---------------------------------------------------------------------------

NO_HF = importlib.util.find_spec("transformers") is None or not STORIES.is_dir()
NO_HF_REASON = ("the HF checkpoint needs driftcli[hf] (transformers) and the shared "
                f"stories260K folder at {STORIES}")


@pytest.fixture(scope="module")
def stories() -> CausalLM:
    return loaders.load_causal_lm(STORIES)


@pytest.mark.skipif(NO_HF, reason=NO_HF_REASON)
def test_stories260k_under_the_policies(stories: CausalLM) -> None:
    ids = loaders.text_batch(stories, STORY, 48)
    loss = next_token_loss(stories.logits)
    with arithmetic("mxfp8_e4m3", model=stories.model) as mode:
        loss(stories.model, ids).backward()
    stories.model.zero_grad(set_to_none=True)
    # 5 layers x (q, k, v, o, gate, up, down) + the tied head; sdpa is two matmuls per layer
    assert mode.routed == {"F.linear": 36, "F.scaled_dot_product_attention.qk": 5,
                           "F.scaled_dot_product_attention.pv": 5}
    assert not mode.plain and mode.matmuls == 46
    eager = copy.deepcopy(stories.model)
    eager.set_attn_implementation("eager")  # attention as two torch.matmul calls
    with arithmetic("mxfp8_e4m3", model=eager) as mode:
        loss(eager, ids).backward()
    assert mode.routed == {"F.linear": 36, "torch.matmul": 10} and not mode.plain
    policies = ["exact", "fp8_e4m3", "mxfp8_e4m3", "nvfp4"]
    rows = grad_cosine(stories.model, ids, loss, policies, checkpoint=str(STORIES))
    agg = {r.policy: r for r in rows if r.parameter == ALL_PARAMETERS}
    assert list(agg) == policies
    assert len(rows) == 4 * (47 + 1)  # 47 tensors (the head is tied to the embedding)
    assert abs(agg["exact"].cosine - 1) <= 1e-12 and abs(agg["exact"].retention - 1) <= 1e-12
    assert 0 < agg["exact"].loss_exact < 3  # a trained model on a story of its own kind
    for p in policies[1:]:
        assert math.isfinite(agg[p].cosine) and agg[p].cosine < 1, agg[p]
        assert agg[p].loss != agg[p].loss_exact
    # fewer bits, worse gradient: 8-bit formats beat the 4-bit one
    assert agg["nvfp4"].cosine < min(agg["fp8_e4m3"].cosine, agg["mxfp8_e4m3"].cosine)


@pytest.mark.skipif(NO_HF, reason=NO_HF_REASON)
def test_stories260k_cli(stories: CausalLM, tmp_path: Path) -> None:
    text = tmp_path / "story.txt"
    text.write_text(STORY)
    out = tmp_path / "out"
    res = runner.invoke(app, ["grad-cosine", str(STORIES), "--policy", "exact", "--policy",
                              "mxfp8_e4m3", "--text", str(text), "--tokens", "32", "--out",
                              str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert [p["policy"] for p in summary["policies"]] == ["exact", "mxfp8_e4m3"]
    df, prov = read_table(out / "grad-cosine.parquet")
    assert len(df) == 2 * 48 and set(df.policy) == {"exact", "mxfp8_e4m3"}
    assert prov["checkpoint_kind"] == "hf" and prov["batch_shape"] == [1, 32]
    assert any(i["path"].endswith("model.safetensors") for i in prov["inputs"])


# --- the command, on a model kind registered here -----------------------------------------------

@pytest.fixture()
def tiny_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A second checkpoint kind, as drift's own checkpoints will add one: a folder holding
    tiny.pt, byte-level tokens."""
    model, _ = tiny_case()
    folder = tmp_path / "tiny"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "tiny.pt")

    def load(path: Path) -> CausalLM:
        m = TinyLM()
        m.load_state_dict(torch.load(path / "tiny.pt"))
        return CausalLM(m.eval(), "tiny", tiny_logits,
                        lambda text: [b % 64 for b in text.encode()], (path / "tiny.pt",))

    kind = CheckpointKind("tiny", lambda p: (p / "tiny.pt").is_file(), load, "a tiny.pt folder")
    monkeypatch.setattr(loaders, "KINDS", [*loaders.KINDS, kind])
    return folder


def test_cli_text_and_batch(tiny_kind: Path, tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(STORY)
    out = tmp_path / "out"
    res = runner.invoke(app, ["grad-cosine", str(tiny_kind), "-p", "exact", "-p", "nvfp4",
                              "-p", "mxfp4_e2m1:sr", "--draws", "3", "--seed", "4", "--text",
                              str(text), "--tokens", "24", "--windows", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "grad-cosine" in res.stdout and "mxfp4_e2m1:sr" in res.stdout
    table = pq.read_table(out / "grad-cosine.parquet")
    assert table.schema.equals(schema_of(GradCosineRow), check_metadata=False)
    df, prov = read_table(out / "grad-cosine.parquet")
    assert prov["seed"] == 4 and prov["batch_shape"] == [2, 24] and prov["draws"] == 3
    assert prov["policies"] == ["exact", "nvfp4", "mxfp4_e2m1:sr"]
    assert [i["path"] for i in prov["inputs"]] == [str(tiny_kind / "tiny.pt"), str(text)]
    assert [i["sha256"] for i in prov["inputs"]] == [
        hashlib.sha256(p.read_bytes()).hexdigest() for p in (tiny_kind / "tiny.pt", text)]
    agg = df[df.parameter == ALL_PARAMETERS].set_index("policy")
    assert agg.loc["exact", "cosine"] == pytest.approx(1, abs=1e-12)
    assert agg.loc["mxfp4_e2m1:sr", "draws"] == 3 and agg.loc["nvfp4", "draws"] == 1
    assert 0 < agg.loc["mxfp4_e2m1:sr", "expected_cosine"] < 1
    # the same token ids from a safetensors batch give the same table
    ids = torch.tensor([b % 64 for b in STORY.encode()][:48]).reshape(2, 24)
    batch = tmp_path / "batch.safetensors"
    save_file({"input_ids": ids.to(torch.int32)}, str(batch))
    out2 = tmp_path / "out2"
    res = runner.invoke(app, ["grad-cosine", str(tiny_kind), "-p", "exact", "-p", "nvfp4",
                              "-p", "mxfp4_e2m1:sr", "--draws", "3", "--seed", "4", "--batch",
                              str(batch), "--out", str(out2), "--quiet"])
    assert res.exit_code == 0 and res.stdout == "", res.output
    df2, _ = read_table(out2 / "grad-cosine.parquet")
    assert df2.drop(columns=[]).equals(df)


@pytest.mark.parametrize(("args", "message"), [
    ([], "exactly one of --text FILE"),
    (["--policy-file"], None),
    (["-p", "mxfp9", "--text", "{text}"], "unknown policy 'mxfp9'"),
    (["--text", "{text}", "--tokens", "4000"], "fewer than 1 window(s) of 4000"),
    (["--batch", "{text}"], "cannot read batch"),
])
def test_cli_errors(tiny_kind: Path, tmp_path: Path, args: list[str],
                    message: str | None) -> None:
    text = tmp_path / "t.txt"
    text.write_text("a short text")
    args = [a.replace("{text}", str(text)) for a in args]
    policy = [] if "-p" in args else ["-p", "exact"]
    res = runner.invoke(app, ["grad-cosine", str(tiny_kind), *policy, *args, "--out",
                              str(tmp_path / "o")])
    assert res.exit_code == 2
    if message is not None:
        assert message in res.stderr, res.output


def test_cli_rejects_a_folder_no_loader_reads(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(STORY)
    res = runner.invoke(app, ["grad-cosine", str(tmp_path), "-p", "exact", "--text", str(text),
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "is not a checkpoint drift can load" in res.stderr


def test_hf_folder_without_transformers_names_the_extra(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    real = loaders.importlib.util.find_spec
    monkeypatch.setattr(loaders.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    text = tmp_path / "t.txt"
    text.write_text(STORY)
    res = runner.invoke(app, ["grad-cosine", str(folder), "-p", "exact", "--text", str(text),
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "Hugging Face model folder" in res.stderr
    assert "optional extra hf): pip install transformers" in res.stderr, res.stderr


DOC = Path(__file__).resolve().parents[1] / "docs" / "grad-cosine.md"
TOLERANCE = {"exact": 0.0, "float32": 1e-5, "fp8_e4m3": 1e-3, "mxfp8_e4m3": 1e-3,
             "mxfp8_e4m3_ceil": 1e-3, "nvfp4": 0.1, "mxfp4_e2m1:sr": 0.1}
"""Relative tolerance per policy of the documented run. exact is drift's own result (the
model's ops, bit for bit). The others multiply in float32 by torch's kernels, whose last bits
differ by CPU: float32 alone keeps 1.7e-6 of relative gradient error, so its metrics move
below 1e-5; the 8-bit casts flip a handful of elements at most (unchanged to 6 digits on an
Intel Xeon); the 4-bit ones amplify a flipped cast through the layers (nvfp4's cosine was
0.2597 on AMD, 0.2491 on Intel: 4 %)."""


def _half_unit(cell: str) -> float:
    """Half a unit in the last digit a table cell shows (``0.39``: 0.005; ``1.68e-06``:
    5e-9): the rounding of the figure itself."""
    mantissa, _, exponent = cell.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


@pytest.mark.skipif(NO_HF, reason=NO_HF_REASON)
def test_the_documented_run_reproduces(tmp_path: Path) -> None:
    text = DOC.read_text(encoding="utf-8")
    story = text.split("$ cat > story.txt <<'EOF'\n")[1].split("\nEOF\n")[0]
    (tmp_path / "story.txt").write_text(story + "\n")
    metrics = ("cosine", "retention", "norm_ratio", "rel_error", "loss")
    shown = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if line.startswith("│") and cells[0] in TOLERANCE:
            shown[cells[0]] = dict(zip(metrics, cells[1:6], strict=True))
    assert list(shown) == list(TOLERANCE)
    argv = ["grad-cosine", str(STORIES), *(a for p in TOLERANCE for a in ("-p", p)), "--draws",
            "4", "--text", str(tmp_path / "story.txt"), "--tokens", "64", "--out",
            str(tmp_path), "--json"]
    res = runner.invoke(app, argv)
    assert res.exit_code == 0, res.output
    got = {p["policy"]: p for p in json.loads(res.stdout[res.stdout.index("{"):])["policies"]}
    assert got["exact"]["rel_error"] == 0 and got["exact"]["cosine"] == 1  # by construction
    for policy, cells in shown.items():
        for name, cell in cells.items():
            doc, value = float(cell), got[policy][name]
            if policy == "float32" and name == "rel_error":
                # float32's whole error is the last bits of torch's sgemm, whose blocking the
                # BLAS library picks by CPU vendor: 1.68e-06 on an AMD EPYC, 1.86e-06 on an
                # Intel Xeon with MKL; within a factor of 2 (an 8-bit cast's is 1e-2 and more)
                assert doc / 2 <= value <= 2 * doc, (policy, name, cell, value)
                continue
            allowed = max(TOLERANCE[policy] * abs(doc), _half_unit(cell))
            assert abs(value - doc) <= allowed, (policy, name, cell, value)


@pytest.mark.skipif(NO_HF, reason=NO_HF_REASON)
def test_a_hugging_face_command_prints_no_third_party_bars(tmp_path: Path) -> None:
    """transformers draws a "Loading weights" bar and logs notices on every load; a drift
    command keeps its output its own (unless the environment asks for them)."""
    import os
    import subprocess
    import sys

    (tmp_path / "story.txt").write_text(STORY)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "TRANSFORMERS_"))}
    argv = [sys.executable, "-m", "driftcli", "grad-cosine", str(STORIES), "-p", "exact",
            "--text", str(tmp_path / "story.txt"), "--tokens", "32", "--out", str(tmp_path),
            "--quiet", "--overwrite"]
    quiet = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
    assert quiet.stderr == "" and quiet.stdout == ""
    asked = subprocess.run(argv, capture_output=True, text=True, check=True,
                           env={**env, "HF_HUB_DISABLE_PROGRESS_BARS": "0"})
    assert "Loading weights" in asked.stderr  # what the default silences
