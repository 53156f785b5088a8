"""Policy overrides: a module matched by a regex takes another cast for both operands of its
matmuls, forward and backward. The file reads back field for field, the cast operands are
bfloat16's own rounding (torch's .to(torch.bfloat16), round to nearest even: exact) where the
override applies and the main cast elsewhere, bad input is one line, and drift train and
grad-cosine run on it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_train import drift, text  # noqa: F401  (text: the fixture)

from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import (
    ArithmeticPolicy,
    ModuleOverride,
    PolicyError,
    get_policy,
    module_override,
    override_toml,
    policy_from_toml,
)
from driftcli.casts.quantization import quantize
from driftcli.io.tables import read_table
from driftcli.measures.grad_cosine import ALL_PARAMETERS
from driftcli.records.presets import PRESETS

MAIN = "mxfp8_e4m3"
FILE = f'''name = "mx-head-bf16"
preset = "{MAIN}"
seed = 3

[[override]]
modules = "^1$"
cast = "bf16"

[[override]]
modules = "^blocks\\\\.0\\\\."
cast = "fp8_e4m3"
'''


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _mx(t: torch.Tensor, axis: int) -> torch.Tensor:
    """drift's own MXFP8 cast of ``t``, blocks along ``axis``."""
    out = quantize(t, PRESETS[MAIN][0], axis=axis)
    assert isinstance(out, torch.Tensor)
    return out


def test_the_override_reads_back_field_for_field(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(FILE, encoding="utf-8")
    read = policy_from_toml(path)
    assert read.overrides == (ModuleOverride("^1$", PRESETS["bf16"][0]),
                              ModuleOverride(r"^blocks\.0\.", PRESETS["fp8_e4m3"][0]))
    # everything else is the preset's
    base = get_policy(MAIN)
    assert read == ArithmeticPolicy("mx-head-bf16", base.forward, base.dgrad, base.wgrad,
                                    seed=3, overrides=read.overrides)
    assert read.override("1") == read.overrides[0] and read.override("blocks.0.fc") == \
        read.overrides[1] and read.override("10") is None and read.override("blocks.1") is None
    assert "override ^1$: bfloat16" in read.describe() and not read.exact
    # written back by override_toml and read again: the same policy
    again = tmp_path / "again.toml"
    again.write_text("\n".join([f'name = "mx-head-bf16"\npreset = "{MAIN}"\nseed = 3',
                                *override_toml(read.overrides), ""]), encoding="utf-8")
    assert policy_from_toml(again) == read
    # a file starting from this one keeps its overrides unless it gives its own
    child = tmp_path / "child.toml"
    child.write_text(f'preset = "{path}"\n', encoding="utf-8")
    assert policy_from_toml(child).overrides == read.overrides


def _diagonal_net() -> tuple[torch.nn.Sequential, torch.nn.Linear, torch.nn.Linear,
                             torch.Tensor, torch.Tensor]:
    """Two linear maps with diagonal weights: each output is one product of two cast values
    (float32 holds it exactly), so the outputs and gradients are the cast operands' products,
    exactly. One token: the wgrad's contraction has one term."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False),
                              torch.nn.Linear(64, 64, bias=False))
    first, second = net
    assert isinstance(first, torch.nn.Linear) and isinstance(second, torch.nn.Linear)
    with torch.no_grad():
        for layer in (first, second):
            layer.weight.copy_(torch.diag(torch.randn(64)))
    return net, first, second, torch.randn(1, 64), torch.randn(1, 64)


def test_the_overridden_module_casts_to_bfloat16_and_the_others_take_the_main_cast() -> None:
    policy = replace(get_policy(MAIN), overrides=(module_override("^1$", "bf16"),))
    net, first, second, x, g = _diagonal_net()
    w0, w1 = first.weight, second.weight
    with arithmetic(policy, model=net) as arith:
        y0 = first(x)
        y0.retain_grad()
        y1 = second(y0)
        (y1 * g).sum().backward()
    assert arith.routed["F.linear"] == 2 and not arith.plain
    with torch.no_grad():
        # layer 0, the main cast: MXFP8 blocks along K
        assert torch.equal(y0, _mx(x, -1) * _mx(w0, -1).diagonal())
        assert not torch.equal(y0, _bf16(x) * _bf16(w0.diagonal()))  # not bfloat16's rounding
        # layer 1, the override: every operand of forward, dgrad and wgrad rounded as
        # torch.Tensor.to(torch.bfloat16) rounds (nearest even)
        d1 = _bf16(w1.diagonal())
        assert not torch.equal(d1, w1.diagonal()) and not torch.equal(_bf16(g), g)
        assert torch.equal(y1, _bf16(y0) * d1)                                  # forward
        assert y0.grad is not None and torch.equal(y0.grad, _bf16(g) * d1)     # dgrad: dY·W
        assert w1.grad is not None
        assert torch.equal(w1.grad, _bf16(g).T * _bf16(y0))                    # wgrad: dYᵀ·X
        # layer 0's backward, the main cast again (the wgrad's blocks run along the tokens)
        assert w0.grad is not None
        assert torch.equal(w0.grad, _mx(y0.grad, 0).T * _mx(x, 0))


def test_keep_high_precision_wins_over_an_override() -> None:
    policy = replace(get_policy(MAIN), overrides=(module_override("^1$", "bf16"),),
                     keep_high_precision=("^1$",))
    net, _, _, x, _ = _diagonal_net()
    with arithmetic(policy, model=net) as arith:
        net(x)
    assert arith.routed["F.linear"] == 1 and arith.plain["F.linear (kept in high precision)"] == 1


@pytest.mark.parametrize(("body", "says"), [
    ('[[override]]\nmodules = "(head"\ncast = "bf16"\n', "is not a regular expression"),
    ('[[override]]\nmodules = "head"\ncast = "bf17"\n', "[[override]] 1: override 'head': "
                                                        "cast spec 'bf17'"),
    ('[[override]]\nmodules = "head"\n', "cast must be a non-empty string"),
    ('[[override]]\nmodules = "head"\ncast = "bf16"\nkast = "x"\n', "unknown key 'kast'"),
    ('override = "head"\n', "override must be tables written [[override]]"),
])
def test_bad_overrides_are_one_line_naming_the_file(tmp_path: Path, body: str,
                                                    says: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f'preset = "{MAIN}"\n{body}', encoding="utf-8")
    with pytest.raises(PolicyError) as err:
        policy_from_toml(path)
    message = str(err.value)
    assert says in message and str(path) in message and "\n" not in message
    code, _, stderr = drift("train", "--steps", "1", "--policy", str(path), "--out",
                            str(tmp_path / "run"))
    assert code == 2 and says in stderr and len(stderr.strip().splitlines()) == 1


def test_train_and_grad_cosine_run_on_an_override(tmp_path: Path, text: Path) -> None:  # noqa: F811
    path = tmp_path / "p.toml"
    path.write_text(f'preset = "{MAIN}"\n[[override]]\nmodules = "^head$"\ncast = "bf16"\n',
                    encoding="utf-8")
    run = tmp_path / "run"
    code, _, err = drift("train", "--model", "mlp", "--context", "8", "--hidden", "16",
                         "--layers", "1", "--steps", "2", "--batch", "4", "--policy", str(path),
                         "--checkpoint-every", "2", "--text", str(text), "--out", str(run), "-q")
    assert code == 0, err
    assert "override ^head$: bfloat16" in (run / "run.json").read_text(encoding="utf-8")
    code, _, err = drift("grad-cosine", str(run / "step-000002.safetensors"), "-p", str(path),
                         "-p", MAIN, "--text", str(text), "--tokens", "9", "--out",
                         str(tmp_path / "gc"), "--json")
    assert code == 0, err
    table, _ = read_table(tmp_path / "gc" / "grad-cosine.parquet")
    whole = table[table["parameter"] == ALL_PARAMETERS]
    cos = dict(zip(whole["policy"], whole["cosine"], strict=True))
    # the head in bfloat16 brings the gradient closer to the exact one than MXFP8 everywhere
    assert cos["p"] > cos[MAIN]


def test_module_policy_reads_keeps_and_overrides_from_the_dotted_name() -> None:
    base = replace(get_policy(MAIN), overrides=(module_override(r"^blocks\.0$", "bf16"),
                                                module_override(r"\.fc$", "fp8_e4m3")),
                   keep_high_precision=(r"^blocks\.1\.attn$",))
    assert base.module_policy("head") is base
    below = base.module_policy("blocks.0.attn.qkv")  # the override of blocks.0, above it
    assert below is not None and below.forward == base.overrides[0].spec
    inner = base.module_policy("blocks.0.mlp.fc")  # the innermost override wins
    assert inner is not None and inner.wgrad == base.overrides[1].spec
    assert base.module_policy("blocks.1.attn.proj") is None  # kept above it


def test_train_logs_an_overridden_module_under_its_own_cast(text: Path,  # noqa: F811
                                                             tmp_path: Path) -> None:
    from driftcli.runs.dump import dump_operands
    from driftcli.runs.training import operand_rates

    code, _, err = drift("train", "--model", "mlp", "--context", "8", "--hidden", "16",
                         "--layers", "1", "--steps", "2", "--batch", "8", "--checkpoint-every",
                         "2", "--text", str(text), "--out", str(tmp_path / "run"), "-q")
    assert code == 0, err
    dump = tmp_path / "dump.safetensors"
    dump_operands(tmp_path / "run" / "step-000002.safetensors", dump, text, windows=4)
    fp4 = PRESETS["mxfp4_e2m1"][0]
    everywhere = replace(get_policy(MAIN), overrides=(module_override(".", "mxfp4_e2m1"),))
    rates = operand_rates(dump, everywhere)
    assert rates == operand_rates(dump, get_policy(MAIN), measure=fp4)
    assert rates != operand_rates(dump, get_policy(MAIN))  # not the main cast's
    kept = replace(everywhere, keep_high_precision=(".",))
    assert set(operand_rates(dump, kept).values()) == {None}
