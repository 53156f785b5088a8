"""Arithmetic policies and the arithmetic mode: presets and policy files, every routed function,
and above all that the backward matmuls multiply cast operands (never cast an uncast product)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from driftcli.arith.autograd import MatmulCall, Slot, policy_matmul
from driftcli.arith.matmul import MatmulSpec, Order, matmul, matmul_spec
from driftcli.arith.mode import UnsupportedMatmulError, arithmetic
from driftcli.arith.policy import (
    EXACT,
    POLICIES,
    ArithmeticPolicy,
    BackwardCast,
    BackwardState,
    PolicyError,
    Role,
    get_policy,
    module_override,
    policy_from_dict,
    policy_from_toml,
    uniform_policy,
)
from driftcli.casts.quantization import quantize
from driftcli.casts.rounding import draw_random_bits
from driftcli.errors import DriftError
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Rounding
from driftcli.records.presets import PRESETS

F64 = torch.float64
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "policies"
MX = parse_cast("mxfp8_e4m3")


def q(t: torch.Tensor, axis: int, c=MX, bits: torch.Tensor | None = None) -> torch.Tensor:
    return quantize(t, c, axis=axis, random_bits=bits)


def f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A float32 matmul of (already cast) operands, widened back: the native order."""
    return (a.float() @ b.float()).double()


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to float32 summation order (the layouts of two float32 GEMMs may differ)."""
    scale = float(expected.abs().max())
    return float((actual - expected).abs().max()) <= 1e-6 * scale


def far(actual: torch.Tensor, other: torch.Tensor) -> float:
    return float((actual - other).abs().max().detach() / other.abs().max().detach())


# --- presets and files ----------------------------------------------------------------------

def test_every_cast_preset_is_a_policy_casting_every_operand() -> None:
    for name, (c, _) in PRESETS.items():
        p = POLICIES[name][0]
        for role in Role:
            spec = p.spec(role)
            assert spec is not None and spec.lhs == c and spec.rhs == c and spec.out is None
            assert spec.order is Order.NATIVE and spec.accumulator.name == "float32"
        assert p.backward_state is BackwardState.RECAST and not p.exact
    assert EXACT.exact and all(EXACT.spec(r) is None for r in Role)
    f32_policy = get_policy("float32")
    assert f32_policy.forward == MatmulSpec(order=Order.NATIVE) and not f32_policy.exact


def test_get_policy_names_close_matches_and_takes_cast_specs() -> None:
    with pytest.raises(PolicyError,
                       match=r"unknown policy 'mxfp8_e4m'; did you mean mxfp8_e4m3") as err:
        get_policy("mxfp8_e4m")
    assert "\n" not in str(err.value)
    sr = get_policy("mxfp4_e2m1:sr")
    assert sr.stochastic and sr.forward is not None and sr.forward.lhs.rounding is Rounding.SR
    assert not get_policy("mxfp4_e2m1").stochastic
    assert get_policy(sr) is sr


def test_example_policy_files_load() -> None:
    files = sorted(EXAMPLES.glob("*.toml"))
    assert len(files) == 7
    h100 = get_policy(str(EXAMPLES / "h100_fp8.toml"))
    promoted = get_policy(str(EXAMPLES / "h100_fp8_promoted.toml"))
    f32 = get_policy(str(EXAMPLES / "fp8_f32_accumulate.toml"))
    pow2 = parse_cast("float8_e4m3fn:tensor:float8_e8m0fnu:amax-up")
    for pol in (h100, promoted, f32):
        assert all(pol.spec(r) is not None and pol.spec(r).lhs == pow2 for r in Role)
    assert str(h100.forward.unit) == "32:13:e-133" and h100.forward.chunk == 0
    assert promoted.forward.chunk == 128 and promoted.forward.unit == h100.forward.unit
    assert f32.forward.order.value == "native"
    keep = policy_from_toml(EXAMPLES / "mxfp8_ceil_keep_head.toml")
    ceil = parse_cast("mxfp8_e4m3_ceil")
    assert keep.name == "mxfp8-ceil-keep-head" and keep.keep_high_precision == ("lm_head",)
    assert keep.keeps("lm_head") and not keep.keeps("model.layers.0.mlp")
    assert all(keep.spec(r) == uniform_policy("x", ceil).forward for r in Role)
    hybrid = get_policy(str(EXAMPLES / "fp8_hybrid_chunked.toml"))
    e4, e5 = parse_cast("fp8_e4m3"), parse_cast("fp8_e5m2")
    assert hybrid.backward_state is BackwardState.SAVED_CAST and hybrid.seed == 7
    assert (hybrid.forward.lhs, hybrid.forward.rhs) == (e4, e4)
    assert (hybrid.dgrad.lhs, hybrid.dgrad.rhs) == (e5, e4)
    assert (hybrid.wgrad.lhs, hybrid.wgrad.rhs) == (e4, e5)
    assert all(hybrid.spec(r).order_name == "chunked:128" for r in Role)
    assert all(hybrid.spec(r).accumulator.name == "e8m13" for r in Role)
    result = get_policy(str(EXAMPLES / "mxfp8_result_cast.toml"))
    operands = get_policy("mxfp8_e4m3")
    assert result.backward_cast is BackwardCast.RESULT
    assert result.spec(Role.FORWARD) == operands.spec(Role.FORWARD)
    # the backward multiplies uncast operands and casts its result with dY's cast
    assert result.spec(Role.DGRAD).lhs is None and result.spec(Role.DGRAD).rhs is None
    assert result.spec(Role.DGRAD).out == operands.spec(Role.DGRAD).lhs
    assert result.spec(Role.WGRAD).out == operands.spec(Role.WGRAD).rhs
    head = get_policy(str(EXAMPLES / "mxfp8_bf16_head.toml"))
    assert head.overrides == (module_override("^head$", "bf16"),)
    assert replace(head, name="mxfp8_e4m3", overrides=()) == operands


def test_policy_file_errors_name_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[matmul]\nlsh = "mxfp8_e4m3"\n')
    with pytest.raises(PolicyError, match=r"unknown key 'lsh'; did you mean lhs"):
        get_policy(bad)
    bad.write_text("backward_state = 'saved'\n")
    with pytest.raises(DriftError, match=r"unknown backward_state 'saved'.*saved-cast"):
        get_policy(bad)
    bad.write_text("keep_high_precision = ['(']\n")
    with pytest.raises(PolicyError, match="not a regular expression"):
        get_policy(bad)
    bad.write_text("name = \n")
    with pytest.raises(PolicyError, match="not valid TOML"):
        get_policy(bad)
    with pytest.raises(PolicyError, match="cannot read policy file"):
        get_policy(tmp_path / "missing.toml")
    # a role written "plain", the others from the shared table and defaults
    p = policy_from_dict({"matmul": {"lhs": "nvfp4", "rhs": "nvfp4"}, "wgrad": "plain"})
    assert p.wgrad is None and p.forward.lhs == parse_cast("nvfp4")
    assert p.forward.order is Order.NATIVE


# --- the backward multiplies cast operands ---------------------------------------------------

@pytest.fixture()
def linear_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 20, 96, dtype=F64, generator=g)  # 60 tokens: blocks straddle sequences
    w = torch.randn(48, 96, dtype=F64, generator=g) * 0.1
    dy = torch.randn(3, 20, 48, dtype=F64, generator=g)
    return x, w, dy


def _run_linear(policy: ArithmeticPolicy | str, x: torch.Tensor, w: torch.Tensor,
                dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with arithmetic(policy):
        y = F.linear(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_backward_casts_operands_not_results(linear_case) -> None:
    """The seed study's first GPU check cast the *result* of an uncast backward matmul. Here
    dgrad must equal cast(dY)·cast(W), W recast along the output features, and wgrad
    cast(dYᵀ)·cast(X) with both blocked along the tokens; casting dY·W after the fact, or
    reading W cast along the forward's axis, gives different numbers."""
    x, w, dy = linear_case
    y, dx, dw = _run_linear("mxfp8_e4m3", x, w, dy)
    assert close(y, f32(q(x, -1), q(w, -1).T))
    dgrad = f32(q(dy, -1), q(w, 0))
    assert close(dx, dgrad)
    wrong_result_cast = q(dy @ w, -1)  # cast(dY·W)
    wrong_axis = f32(q(dy, -1), q(w, -1))  # W as the forward cast it
    assert far(dx, wrong_result_cast) > 1e-3 and far(dx, wrong_axis) > 1e-3
    tokens_x, tokens_dy = x.reshape(60, 96), dy.reshape(60, 48)
    wgrad = f32(q(tokens_dy.T, -1), q(tokens_x, 0))
    assert close(dw, wgrad)
    assert far(dw, q(tokens_dy.T @ tokens_x, -1)) > 1e-3  # cast(dYᵀ·X)
    assert far(dw, f32(tokens_dy.T, tokens_x)) > 1e-3  # uncast operands


def test_saved_cast_reads_the_forward_cast(linear_case) -> None:
    x, w, dy = linear_case
    policy = replace(get_policy("mxfp8_e4m3"), backward_state=BackwardState.SAVED_CAST)
    _, dx, dw = _run_linear(policy, x, w, dy)
    assert close(dx, f32(q(dy, -1), q(q(w, -1), 0)))  # the saved cast, blocked again along N
    tokens_x = x.reshape(60, 96)
    assert close(dw, f32(q(dy.reshape(60, 48).T, -1), q(q(tokens_x, -1), 0)))
    _, dx_recast, _ = _run_linear("mxfp8_e4m3", x, w, dy)
    assert far(dx, dx_recast) > 1e-4


@pytest.mark.parametrize("state", [BackwardState.RECAST, BackwardState.FRESH_SR])
def test_stochastic_backward_bits(linear_case, state: BackwardState) -> None:
    """recast reuses the forward's random bits for W (only the blocking changes); fresh-sr
    draws new ones. Both cast dY with the dgrad's own bits."""
    x, w, dy = linear_case
    sr = parse_cast("mxfp8_e4m3:sr")
    policy = replace(uniform_policy("sr", sr), backward_state=state, seed=11)
    _, dx, _ = _run_linear(policy, x, w, dy)
    call = MatmulCall(policy, 0)
    slot = Slot.FORWARD_RHS if state is BackwardState.RECAST else Slot.DGRAD_RHS
    w_bits = draw_random_bits(w.T.shape, call.seed(slot)).T  # drawn on the operand Wᵀ
    dy_bits = draw_random_bits(dy.shape, call.seed(Slot.DGRAD_LHS))
    assert close(dx, f32(q(dy, -1, sr, dy_bits), q(w, 0, sr, w_bits)))
    _, dx_again, _ = _run_linear(policy, x, w, dy)
    assert torch.equal(dx, dx_again)  # reproducible for a seed
    _, dx_other, _ = _run_linear(replace(policy, seed=12), x, w, dy)
    assert not torch.equal(dx, dx_other)


def test_non_native_orders_go_through_the_simulated_matmul() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g)
    w = torch.randn(5, 64, generator=g)
    for spec in (matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator="bfloat16",
                             order="sequential"),
                 matmul_spec(lhs="mxfp8_e4m3_ceil", rhs="mxfp8_e4m3_ceil",
                             accumulator="e8m13", order="chunked:32", scale_application="block")):
        policy = ArithmeticPolicy("t", spec, spec, spec)
        with arithmetic(policy):
            y = F.linear(x, w)
        expected = matmul(x, w.T, spec)
        assert torch.equal(y, expected)
        assert not torch.equal(y, x @ w.T)


# --- shapes, routes, decompositions ---------------------------------------------------------

SHAPES = [((5,), (5, 3)), ((4, 5), (5,)), ((2, 4, 5), (5, 3)), ((4, 5), (2, 5, 3)),
          ((2, 1, 4, 5), (3, 5, 6)), ((3, 4, 5), (3, 5, 2))]


@pytest.mark.parametrize(("sa", "sb"), SHAPES)
def test_broadcast_gradients(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    """Operands broadcast over leading dims get gradients summed over them (folded into the
    contraction); under exact the mode is bit for bit torch, under float32 within 1e-6."""
    g = torch.Generator().manual_seed(len(sa) * 10 + len(sb))
    a = torch.randn(sa, dtype=F64, generator=g, requires_grad=True)
    b = torch.randn(sb, dtype=F64, generator=g, requires_grad=True)
    ref_out = torch.matmul(a, b)
    upstream = torch.randn(ref_out.shape, dtype=F64, generator=g)
    ref = torch.autograd.grad(ref_out, (a, b), upstream)
    for name, tol in (("exact", 0.0), ("float32", 1e-6)):
        with arithmetic(name) as mode:
            out = torch.matmul(a, b)
            got = torch.autograd.grad(out, (a, b), upstream)
        assert mode.routed["torch.matmul"] == 1 and out.shape == ref_out.shape
        for r, h in zip(ref, got, strict=True):
            assert h.shape == r.shape and h.dtype == F64
            assert float((h - r).abs().max()) <= tol * float(r.abs().max())


def test_every_route_is_counted_and_computes_the_product() -> None:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=F64, generator=g)

    a, b, v, m3, n3 = r(4, 6), r(6, 3), r(6), r(2, 4, 6), r(2, 6, 3)
    bias, w = r(4, 3), r(3, 6)
    cases = {
        "F.linear": (lambda: F.linear(a, w, bias[0]), a @ w.T + bias[0]),
        "torch.matmul": (lambda: (torch.matmul(a, b), a @ b, a.matmul(b)), None),
        "torch.mm": (lambda: (torch.mm(a, b), a.mm(b)), None),
        "torch.bmm": (lambda: (torch.bmm(m3, n3), m3.bmm(n3)), None),
        "torch.mv": (lambda: torch.mv(a, v), a @ v),
        "torch.addmm": (lambda: torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
                        0.5 * bias + 2.0 * (a @ b)),
        "torch.baddbmm": (lambda: torch.baddbmm(bias, m3, n3), bias + m3 @ n3),
        "torch.einsum": (lambda: torch.einsum("bij,bjk->bik", m3, n3), m3 @ n3),
    }
    for name, (fn, expected) in cases.items():
        for policy, tol in (("exact", 1e-14), ("float32", 1e-6)):
            with arithmetic(policy) as mode:
                out = fn()
            outs = out if isinstance(out, tuple) else (out,)
            assert mode.routed[name] == len(outs), (name, mode.routed)
            assert not mode.plain
            for o in outs:
                want = expected if expected is not None else torch.matmul(*(
                    (a, b) if o.dim() == 2 else (m3, n3)))
                assert float((o - want).abs().max()) <= tol * float(want.abs().max()), name


EINSUMS = [("bij,bjk->bik", (2, 3, 4), (2, 4, 5)), ("bhqd,bhkd->bhqk", (2, 3, 5, 4), (2, 3, 6, 4)),
           ("ij,kj->ik", (3, 4), (5, 4)), ("...ij,jk->...ik", (2, 3, 3, 4), (4, 5)),
           ("bi,bi->b", (3, 4), (3, 4)), ("ij,j->i", (3, 4), (4,)), ("ij,jk", (3, 4), (4, 2)),
           ("ijk,kl->il", (3, 2, 4), (4, 5)), ("bhd,hdk->bhk", (2, 3, 4), (3, 4, 5)),
           ("ij,ik->jk", (1, 4), (1, 3))]


@pytest.mark.parametrize(("eq", "sa", "sb"), EINSUMS)
def test_einsum_decomposition_matches_torch(eq: str, sa: tuple[int, ...],
                                            sb: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(eq))
    a = torch.randn(sa, dtype=F64, generator=g, requires_grad=True)
    b = torch.randn(sb, dtype=F64, generator=g, requires_grad=True)
    ref = torch.einsum(eq, a, b)
    with arithmetic("exact") as mode:
        out = torch.einsum(eq, a, b)
    assert torch.equal(out, ref)  # exact runs the einsum as written: the same bits
    outer = eq == "ij,ik->jk"  # contracts over i of length 1: an outer product, left plain
    assert mode.routed["torch.einsum"] == (0 if outer else 1)
    assert sum(mode.plain.values()) == (1 if outer else 0)
    # the decomposition into one batched matmul runs under a policy that simulates: float32
    # operands and products, so it agrees with torch's float32 einsum to float32 rounding
    # (a few ulps over K <= 4); a wrong permutation or a wrong summed index is off by O(1)
    a32, b32 = (t.detach().float().requires_grad_() for t in (a, b))
    ref32 = torch.einsum(eq, a32, b32)
    ref_grads = torch.autograd.grad(ref32.sum(), (a32, b32))
    with arithmetic("float32"):
        out = torch.einsum(eq, a32, b32)
    grads = torch.autograd.grad(out.sum(), (a32, b32))
    assert out.shape == ref32.shape
    assert torch.allclose(out, ref32, rtol=1e-5, atol=1e-5)
    for gr, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(gr, r, rtol=1e-5, atol=1e-5)


def test_einsum_under_a_cast_policy_is_the_cast_matmul() -> None:
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 40, 64, dtype=F64, generator=g), torch.randn(64, 24, dtype=F64,
                                                                         generator=g)
    with arithmetic("mxfp8_e4m3"):
        via_einsum = torch.einsum("bik,kj->bij", a, b)
        via_matmul = a @ b
    assert torch.equal(via_einsum, via_matmul)
    assert close(via_einsum, f32(q(a, -1), q(b, 0)))


SDPA_CASES = [dict(), dict(is_causal=True), dict(scale=0.3), dict(mask="bool"),
              dict(mask="float", is_causal=False), dict(gqa=True, is_causal=True)]


@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: ",".join(c) or "plain")
def test_sdpa_decomposition_matches_torch(case: dict) -> None:
    g = torch.Generator().manual_seed(1)
    heads_kv = 2 if case.get("gqa") else 4
    qt = torch.randn(2, 4, 7, 8, dtype=F64, generator=g, requires_grad=True)
    k = torch.randn(2, heads_kv, 7, 8, dtype=F64, generator=g, requires_grad=True)
    v = torch.randn(2, heads_kv, 7, 8, dtype=F64, generator=g, requires_grad=True)
    mask = None
    if case.get("mask") == "bool":
        mask = torch.rand(7, 7, generator=g) > 0.3
        mask[:, 0] = True  # every query sees something
    elif case.get("mask") == "float":
        mask = torch.randn(7, 7, dtype=F64, generator=g)
    kwargs = dict(attn_mask=mask, is_causal=case.get("is_causal", False),
                  scale=case.get("scale"), enable_gqa=bool(case.get("gqa")))
    ref = F.scaled_dot_product_attention(qt, k, v, **kwargs)
    with arithmetic("exact") as mode:
        out = F.scaled_dot_product_attention(qt, k, v, **kwargs)
    assert mode.routed == {"F.scaled_dot_product_attention.qk": 1,
                           "F.scaled_dot_product_attention.pv": 1}
    assert torch.equal(out, ref)  # exact runs sdpa as written: the same bits
    # the decomposition (scale, masks, GQA, softmax, two matmuls) runs under a policy that
    # simulates: in float32 it agrees with torch's float32 sdpa to float32 rounding through
    # a softmax of 7 terms (about 1e-6 relative); a wrong mask or scale is off by O(1)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (qt, k, v))
    kw32 = {**kwargs, "attn_mask": mask.float() if mask is not None and mask.dtype == F64
            else mask}
    ref32 = F.scaled_dot_product_attention(q32, k32, v32, **kw32)
    ref_grads = torch.autograd.grad(ref32.square().sum(), (q32, k32, v32))
    with arithmetic("float32"):
        out = F.scaled_dot_product_attention(q32, k32, v32, **kw32)
    grads = torch.autograd.grad(out.square().sum(), (q32, k32, v32))
    assert torch.allclose(out, ref32, rtol=1e-5, atol=1e-5)
    for gr, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(gr, r, rtol=1e-4, atol=1e-5)
    with arithmetic("mxfp8_e4m3"):
        cast_out = F.scaled_dot_product_attention(qt, k, v, **kwargs)
    assert 1e-4 < far(cast_out, ref) < 0.2


def test_sdpa_rejects_dropout() -> None:
    t = torch.randn(1, 1, 4, 8, dtype=F64)
    with arithmetic("mxfp8_e4m3"), pytest.raises(UnsupportedMatmulError, match="dropout_p"):
        F.scaled_dot_product_attention(t, t, t, dropout_p=0.1)


# --- modules kept in high precision, and what cannot be routed --------------------------------

class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("given_model", [True, False])
def test_keep_high_precision_leaves_a_module_uncast(given_model: bool) -> None:
    torch.manual_seed(0)
    net = Net().double()
    x = torch.randn(40, 64, dtype=F64)
    dy = torch.randn(40, 8, dtype=F64)
    policy = replace(get_policy("mxfp8_e4m3"), keep_high_precision=(r"^head$",))
    seen: list[torch.Tensor] = []
    net.head.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with arithmetic(policy, model=net if given_model else None) as mode:
        y = net(x)
    y.backward(dy)
    assert mode.routed == {"F.linear": 1}
    assert mode.plain == {"F.linear (kept in high precision)": 1}
    hidden = seen[0]
    assert torch.equal(net.head.weight.grad, dy.T @ hidden)  # plain float64: bit for bit
    assert torch.equal(y, F.linear(hidden, net.head.weight, net.head.bias))
    body_grad = net.body.weight.grad.clone()
    net.zero_grad()
    net(x).backward(dy)
    assert far(body_grad, net.body.weight.grad) > 1e-3  # the body is cast


def test_unroutable_matmuls_raise_unless_kept() -> None:
    mha = nn.MultiheadAttention(16, 2, batch_first=True).double()
    x = torch.randn(2, 5, 16, dtype=F64)
    with arithmetic("mxfp8_e4m3"), pytest.raises(UnsupportedMatmulError,
                                                 match="multi_head_attention_forward"):
        mha(x, x, x)
    with arithmetic(replace(get_policy("mxfp8_e4m3"), keep_high_precision=("",))):
        mha(x, x, x)  # the whole model kept: runs as torch
    with arithmetic("exact"):
        mha(x, x, x)  # nothing simulated: nothing to miss
    a = torch.randn(3, 3, dtype=F64)
    with arithmetic("mxfp8_e4m3"), pytest.raises(UnsupportedMatmulError, match="3 operands"):
        torch.einsum("ij,jk,kl->il", a, a, a)


def test_outer_products_are_left_plain() -> None:
    """A contraction of length 1 sums nothing (rotary angles are computed this way)."""
    inv_freq = torch.rand(4, 1, dtype=F64)
    pos = torch.arange(9, dtype=F64)[None, :]
    with arithmetic("mxfp8_e4m3") as mode:
        angles = inv_freq @ pos
    assert torch.equal(angles, inv_freq * pos)
    assert mode.plain == {"torch.matmul (outer product (K = 1))": 1} and not mode.routed


def test_policy_matmul_checks_its_operands() -> None:
    a = torch.randn(2, 3)
    with pytest.raises(DriftError, match="do not agree along K"):
        policy_matmul(a, torch.randn(4, 2), EXACT)
    with pytest.raises(DriftError, match="dtypes"):
        policy_matmul(a, torch.randn(3, 2, dtype=F64), EXACT)


def test_one_policy_at_a_time_and_autocast_does_not_lower_the_spec() -> None:
    inner = arithmetic("nvfp4")
    with arithmetic("exact"), pytest.raises(DriftError, match="one policy at a time"):
        inner.__enter__()
    with arithmetic("nvfp4") as mode:  # the failed entry left nothing behind
        torch.randn(2, 32) @ torch.randn(32, 2)
    assert mode.routed == {"torch.matmul": 1}
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(4, 64, generator=g), torch.randn(8, 64, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16), arithmetic("float32"):
        y = F.linear(x, w)
    assert y.dtype == torch.float32 and torch.equal(y, x @ w.T)


def test_the_policy_files_in_the_docs_are_the_example_files() -> None:
    docs = (EXAMPLES.parents[1] / "docs" / "arithmetic.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", docs, flags=re.S)
    assert len(blocks) == 4
    for block in blocks:
        path = EXAMPLES / re.search(r"examples/policies/(\S+\.toml)", block)[1]
        shown = policy_from_dict(tomllib.loads(block), default_name=path.stem)
        assert shown == policy_from_toml(path)


def test_block_scale_application_casts_each_operand_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``scale=block`` the forward hands the casts' own block scales to the accumulation
    (``accumulate``), so each operand is cast once (it was cast again to recover its scales),
    and the product is still ``matmul``'s."""
    import importlib

    import driftcli.arith.autograd as autograd_module

    real = autograd_module.quantize
    casts: list[int] = []

    def counted(*args: object, **kwargs: object) -> object:
        casts.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    g = torch.Generator().manual_seed(30)
    x, w = torch.randn(4, 64, generator=g), torch.randn(64, 3, generator=g)
    spec = matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator="bfloat16",
                       order="chunked:32", scale_application="block")
    for module in (autograd_module, importlib.import_module("driftcli.arith.matmul")):
        monkeypatch.setattr(module, "quantize", counted)  # every cast either module makes
    y = policy_matmul(x, w, ArithmeticPolicy("t", spec, None, None))
    monkeypatch.undo()
    assert len(casts) == 2
    assert torch.equal(y, matmul(x, w, spec))
