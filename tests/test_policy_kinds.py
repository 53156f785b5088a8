"""Two policy settings for the seed study's claims: the backward that casts its result (a wrong
method, kept for comparison) and keeping matmuls in high precision by the kind the interception
gives them (attention: two activations)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from driftcli.arith.intercept import MatmulKind, matmul_kind
from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import (
    BackwardCast,
    PolicyError,
    Role,
    get_policy,
    policy_from_dict,
    policy_from_toml,
)
from driftcli.casts.quantization import quantize
from driftcli.models import TransformerConfig, build_model
from driftcli.models.nets import next_byte_loss
from driftcli.records.castspec import parse_cast

F64 = torch.float64
MX = parse_cast("mxfp8_e4m3")
RESULT = replace(get_policy("mxfp8_e4m3"), name="mx-result", backward_cast=BackwardCast.RESULT)


def q(t: torch.Tensor, axis: int) -> torch.Tensor:
    return quantize(t, MX, axis=axis)


def integer_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Operands whose every product and partial sum is exact in float32 (small integers and
    eighths): any summation order gives the same float32 matmul, so results compare exactly,
    before and after a cast."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-8, 9, (2, 16, 64), generator=g).to(F64)
    w = torch.randint(-7, 8, (40, 64), generator=g).to(F64) / 8
    dy = torch.randint(-9, 10, (2, 16, 40), generator=g).to(F64)
    return x, w, dy


def run_linear(policy: object, x: torch.Tensor, w: torch.Tensor,
               dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with arithmetic(policy):  # type: ignore[arg-type]
        y = F.linear(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_result_cast_is_the_cast_of_the_uncast_product() -> None:
    x, w, dy = integer_case()
    y, dx, dw = run_linear(RESULT, x, w, dy)
    # the forward still casts both operands
    assert torch.equal(y, (q(x, -1).float() @ q(w, -1).float().T).double())
    # dgrad: cast(dY·W) along the input features; wgrad: cast(Xᵀ·dY) along the output
    # features, transposed back to W's layout
    assert torch.equal(dx, q((dy @ w).float(), -1).double())
    tokens_x, tokens_dy = x.reshape(32, 64), dy.reshape(32, 40)
    assert torch.equal(dw, q((tokens_x.T @ tokens_dy).float(), -1).double().T)
    # and it is not what casting the operands gives
    _, dx_ops, dw_ops = run_linear("mxfp8_e4m3", x, w, dy)
    assert not torch.equal(dx, dx_ops) and not torch.equal(dw, dw_ops)


def test_result_cast_specs_and_files(tmp_path: Path) -> None:
    spec = RESULT.spec(Role.DGRAD)
    assert spec is not None and spec.lhs is None and spec.rhs is None and spec.out == MX
    assert RESULT.spec(Role.FORWARD) == get_policy("mxfp8_e4m3").forward
    assert "backward cast: result (a wrong method" in RESULT.describe()
    path = tmp_path / "r.toml"
    path.write_text('preset = "mxfp4_e2m1"\nbackward_cast = "result"\n'
                    '[dgrad]\nout = "mxfp8_e4m3"\n')
    p = policy_from_toml(path)
    assert p.backward_cast is BackwardCast.RESULT
    assert p.spec(Role.DGRAD).out == MX  # the role's own output cast wins
    assert p.spec(Role.WGRAD).out == parse_cast("mxfp4_e2m1")  # else dY's cast
    path.write_text('preset = "mxfp4_e2m1"\nbackward_cast = "results"\n')
    with pytest.raises(PolicyError, match=r"unknown backward_cast 'results'; did you mean "
                                          r"result"):
        policy_from_toml(path)


class Attn(nn.Module):
    """A linear map, then attention written three ways: explicit matmuls, an einsum, and
    sdpa; and a matmul with a parameter (not F.linear), which is a linear kind."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96, bias=False)
        self.extra = nn.Parameter(torch.randn(32, 32, dtype=F64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(32, dim=-1)
        p = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(32), dim=-1)
        a = p @ v
        s = torch.einsum("btd,bsd->bts", a, k)
        b = F.scaled_dot_product_attention(q, k, v)
        return (a + b + s @ v) @ self.extra


def test_keep_attention_matmuls_by_kind() -> None:
    torch.manual_seed(0)
    model = Attn().double()
    x = torch.randn(2, 8, 32, dtype=F64)
    policy = replace(get_policy("mxfp8_e4m3"), keep_matmuls=("attention",))
    assert policy.keep_matmuls == (MatmulKind.ATTENTION,)
    with arithmetic(policy, model=model) as mode:
        out = model(x)
    out.sum().backward()
    assert mode.routed == {"F.linear": 1, "torch.matmul": 1}  # qkv, and the parameter's
    kept = "attention matmul kept in high precision"
    assert mode.plain == {f"torch.matmul ({kept})": 3, f"torch.einsum ({kept})": 1,
                          f"F.scaled_dot_product_attention ({kept})": 1}
    # by hand: the two linear-kind products cast, every attention product plain float64
    with torch.no_grad():
        qkv = (q(x, -1).float() @ q(model.qkv.weight, -1).float().T).double()
        qq, kk, vv = qkv.split(32, dim=-1)
        p = torch.softmax(qq @ kk.transpose(-2, -1) / math.sqrt(32), dim=-1)
        a = p @ vv
        s = torch.einsum("btd,bsd->bts", a, kk)
        b = F.scaled_dot_product_attention(qq, kk, vv)
        mixed = a + b + s @ vv
        want = (q(mixed, -1).float() @ q(model.extra, -2).float()).double()
    # float64 attention and softmax against the same ops: the same kernels, the same bits;
    # the final float32 GEMM may sum in another order: a float32 rounding of tolerance
    assert torch.allclose(out.detach(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_matmul_kinds() -> None:
    w = nn.Parameter(torch.ones(3, 3))
    params = {id(w)}

    def is_param(t: object) -> bool:
        return isinstance(t, torch.Tensor) and (
            id(t) in params or (t._base is not None and id(t._base) in params))

    a = torch.ones(3, 3)
    assert matmul_kind("F.linear", a, a, is_param) is MatmulKind.LINEAR
    assert matmul_kind("torch.matmul", a, w.T, is_param) is MatmulKind.LINEAR  # a view of w
    assert matmul_kind("torch.matmul", a, a, is_param) is MatmulKind.ATTENTION
    assert matmul_kind("F.scaled_dot_product_attention.qk", w, a,
                       is_param) is MatmulKind.ATTENTION


def test_keep_matmuls_in_files_and_on_the_transformer() -> None:
    p = policy_from_dict({"preset": "nvfp4", "keep_matmuls": ["attention"]})
    assert p.keeps_kind(MatmulKind.ATTENTION) and not p.keeps_kind(MatmulKind.LINEAR)
    assert "keep matmuls: attention" in p.describe()
    with pytest.raises(PolicyError, match=r"unknown keep_matmuls kind 'attn'; did you mean "
                                          r"attention"):
        policy_from_dict({"preset": "nvfp4", "keep_matmuls": ["attn"]})
    with pytest.raises(PolicyError, match="keep_matmuls must be a list"):
        policy_from_dict({"keep_matmuls": [3]})
    torch.manual_seed(0)
    model = build_model(TransformerConfig(context=8, d_model=16, layers=2, heads=2))
    ids = torch.randint(0, 256, (2, 9))
    with arithmetic(p, model=model) as mode:
        next_byte_loss(model, ids).backward()
    assert mode.routed == {"F.linear": 2 * 4 + 1}
    assert mode.plain == {"torch.matmul (attention matmul kept in high precision)": 2 * 2}
