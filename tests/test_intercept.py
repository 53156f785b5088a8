"""The one table of intercepted matmuls: every function the arithmetic mode casts, capture
records, with the same operands, and a function added to the table is picked up by both."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from driftcli.arith.intercept import MATMULS, UnsupportedMatmulError
from driftcli.arith.mode import arithmetic
from driftcli.io.capture import capture
from driftcli.io.dumps import DUMP_KEY

F64 = torch.float64
POLICY = "float32"  # a policy that simulates: every routed product is cast, none passes through


class Call(nn.Module):
    """One call of one function, in a module of its own so that it has its own layer name."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


class EveryRoute(nn.Module):
    """Calls each routed function once (``@`` and ``torch.matmul`` are two spellings of one)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8, dtype=F64, generator=g))
        self.bias = nn.Parameter(torch.randn(8, dtype=F64, generator=g))
        self.vec = nn.Parameter(torch.randn(8, dtype=F64, generator=g))
        self.linear = nn.Linear(8, 8, dtype=F64)
        self.matmul = Call(torch.matmul)
        self.at = Call(lambda a, b: a @ b)
        self.mm = Call(torch.mm)
        self.mv = Call(torch.mv)
        self.addmm = Call(torch.addmm)
        self.bmm = Call(torch.bmm)
        self.baddbmm = Call(torch.baddbmm)
        # a permuted output, so the batched matmul's layout is not the einsum's own
        self.einsum = Call(lambda a, b: torch.einsum("bik,bjk->bji", a, b))
        self.sdpa = Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        out["linear"] = h = self.linear(x)                          # (2, 4, 8)
        out["matmul"] = a = self.matmul(h, x.transpose(1, 2))       # (2, 4, 4)
        out["at"] = b = self.at(a, h)                               # (2, 4, 8)
        out["mm"] = m = self.mm(b[0], self.w)                       # (4, 8)
        out["mv"] = self.mv(m, self.vec)                            # (4,)
        out["addmm"] = self.addmm(self.bias, m, self.w)             # (4, 8)
        out["bmm"] = d = self.bmm(b, h.transpose(1, 2))             # (2, 4, 4)
        out["baddbmm"] = e = self.baddbmm(d, d, a)                  # (2, 4, 4)
        out["einsum"] = self.einsum(e, d)                           # (2, 4, 4): b j i
        q, k, v = (t.unsqueeze(1) for t in (b, h, x))               # (2, 1, 4, 8)
        out["sdpa"] = self.sdpa(q, k, v)
        return out


def step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = model(x)
    for o in out.values():
        o.retain_grad()
    sum(o.square().sum() for o in out.values()).backward()
    return out


def read_dump(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(path), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        meta = json.loads(f.metadata()[DUMP_KEY])["tensors"]
    return tensors, meta


def routed_in_table() -> set[str]:
    """The name of every routed function of the table (sdpa's counted per product)."""
    names = {e.name for e in MATMULS.values() if e.route is not None}
    sdpa = "F.scaled_dot_product_attention"
    return names - {sdpa} | {f"{sdpa}.qk", f"{sdpa}.pv"}


ROUTED = Counter({"F.linear": 1, "torch.matmul": 2, "torch.mm": 1, "torch.mv": 1,
                  "torch.addmm": 1, "torch.bmm": 1, "torch.baddbmm": 1, "torch.einsum": 1,
                  "F.scaled_dot_product_attention.qk": 1, "F.scaled_dot_product_attention.pv": 1})

NAMES = (
    "linear/activation", "linear/weight", "linear/gradient",
    "matmul/lhs", "matmul/rhs", "matmul/gradient",
    "at/lhs", "at/rhs", "at/gradient",
    "mm/activation", "mm/weight", "mm/gradient",
    "mv/activation", "mv/weight", "mv/gradient",
    "addmm/activation", "addmm/weight", "addmm/gradient",
    "bmm/lhs", "bmm/rhs", "bmm/gradient",
    "baddbmm/lhs", "baddbmm/rhs", "baddbmm/gradient",
    "einsum/lhs", "einsum/rhs", "einsum/gradient",
    "sdpa/0/lhs", "sdpa/0/rhs", "sdpa/0/gradient",
    "sdpa/1/lhs", "sdpa/1/rhs", "sdpa/1/gradient",
)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float64 rounding: the same softmax and matmuls, but torch's kernels (and so
    their summation order) may differ between a call and its repetition on another CPU."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_every_routed_function_is_cast_by_the_mode_and_recorded_by_capture(
        tmp_path: Path) -> None:
    x = torch.randn(2, 4, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    model = EveryRoute()
    with arithmetic(POLICY) as mode:
        step(model, x)
    assert mode.routed == ROUTED and not mode.plain
    assert set(mode.routed) == routed_in_table()  # the model calls every routed function

    path = tmp_path / "dump.safetensors"
    model.zero_grad()
    with capture(model, path) as cap:
        step(model, x)
    assert cap.names == NAMES and not cap.unrecorded
    t, meta = read_dump(path)

    # the same step again without capture, by hand where the mode decomposes a call
    model.zero_grad()
    out = step(model, x)
    h, a, b, m, d, e = (out[k].detach() for k in ("linear", "matmul", "at", "mm", "bmm",
                                                  "baddbmm"))
    w, vec = model.w.detach(), model.vec.detach()
    direct = {"linear": (x, model.linear.weight.detach()), "matmul": (h, x.transpose(1, 2)),
              "at": (a, h), "mm": (b[0], w), "mv": (m, vec), "addmm": (m, w),
              "bmm": (b, h.transpose(1, 2)), "baddbmm": (d, a)}
    for layer, (lhs, rhs) in direct.items():
        sides = [n for n in NAMES if n.startswith(f"{layer}/") and not n.endswith("gradient")]
        assert torch.equal(t[sides[0]], lhs) and torch.equal(t[sides[1]], rhs), layer
        assert torch.equal(t[f"{layer}/gradient"], out[layer].grad), layer
    # einsum bik,bjk->bji is the batched matmul (b, i, k) @ (b, k, j), its output (b, i, j)
    assert torch.equal(t["einsum/lhs"], e) and torch.equal(t["einsum/rhs"], d.transpose(1, 2))
    assert torch.equal(t["einsum/gradient"], out["einsum"].grad.transpose(1, 2))
    # sdpa is q·kᵀ, the scale and the causal mask, the softmax, then p·v
    q, k, v = (s.unsqueeze(1) for s in (b, h, x))
    scores = (q @ k.transpose(-2, -1)).requires_grad_()
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    probs = torch.softmax((scores / math.sqrt(8)).masked_fill(~keep, -math.inf), dim=-1)
    (probs @ v).backward(out["sdpa"].grad)
    assert torch.equal(t["sdpa/0/lhs"], q) and torch.equal(t["sdpa/0/rhs"], k.transpose(-2, -1))
    assert close(t["sdpa/1/lhs"], probs.detach()) and torch.equal(t["sdpa/1/rhs"], v)
    assert torch.equal(t["sdpa/1/gradient"], out["sdpa"].grad)  # p·v is the output
    assert close(t["sdpa/0/gradient"], scores.grad)
    # a decomposed call's products are matmuls C = A·B; only F.linear's are linear
    assert {n: e["operand"] for n, e in meta.items() if n.startswith(("einsum", "sdpa"))} == {
        n: {"lhs": "forward.lhs wgrad.lhs", "rhs": "forward.rhs dgrad.rhs",
            "gradient": "dgrad.lhs wgrad.rhs"}[n.rsplit("/", 1)[1]]
        for n in NAMES if n.startswith(("einsum", "sdpa"))}
    assert meta["linear/activation"]["operand"] == "forward.lhs wgrad.rhs"


def test_capture_under_a_policy_records_the_operands_and_counts_nothing_twice(
        tmp_path: Path) -> None:
    """As ``drift dump --policy`` runs them: the mode outside, capture inside. The products
    capture computes beside a decomposed call are out of the mode's sight."""
    x = torch.randn(2, 4, 8, dtype=F64, generator=torch.Generator().manual_seed(2))
    model = EveryRoute()
    with arithmetic(POLICY) as alone:
        cast = step(model, x)
    model.zero_grad()
    with arithmetic(POLICY) as mode, capture(model, tmp_path / "d.safetensors") as cap:
        both = step(model, x)
    assert mode.routed == alone.routed == ROUTED and not mode.plain
    assert cap.names == NAMES and not cap.unrecorded
    for name in cast:
        assert torch.equal(both[name], cast[name]), name  # capture changes nothing cast
        assert torch.equal(both[name].grad, cast[name].grad), name
    t, _ = read_dump(tmp_path / "d.safetensors")
    assert torch.equal(t["linear/activation"], x)  # before the policy's cast


def test_outputs_and_gradients_are_bit_identical_with_capture(tmp_path: Path) -> None:
    x = torch.randn(2, 4, 8, dtype=F64, generator=torch.Generator().manual_seed(3))
    model = EveryRoute()
    plain = step(model, x)
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with capture(model, tmp_path / "d.safetensors"):
        got = step(model, x)
    for name in plain:
        assert torch.equal(got[name], plain[name]), name
    for p, g in zip(model.parameters(), plain_grads, strict=True):
        assert torch.equal(p.grad, g)


class Linalg(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.linalg.matmul(a, b)


def test_a_function_added_to_the_table_is_cast_and_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(4)
    a = torch.randn(3, 8, dtype=F64, generator=g, requires_grad=True)
    b = torch.randn(8, 2, dtype=F64, generator=g)

    model = Linalg()

    def run() -> tuple[Counter[str], tuple[str, ...]]:
        with arithmetic(POLICY) as mode:
            model(a, b).sum().backward()
        with capture(model, tmp_path / "d.safetensors") as cap:
            model(a, b).sum().backward()
        return mode.routed, cap.names

    assert torch.linalg.matmul not in MATMULS
    assert run() == (Counter(), ())  # not in the table: neither sees it
    monkeypatch.setitem(MATMULS, torch.linalg.matmul, dataclasses.replace(
        MATMULS[torch.matmul], name="torch.linalg.matmul"))
    routed, names = run()
    assert routed == {"torch.linalg.matmul": 1}
    assert names == ("<root>/lhs", "<root>/rhs", "<root>/gradient")
    t, _ = read_dump(tmp_path / "d.safetensors")
    assert torch.equal(t["<root>/lhs"], a.detach()) and torch.equal(t["<root>/rhs"], b)
    assert routed_in_table() - set(ROUTED) == {"torch.linalg.matmul"}  # the model misses it


@pytest.mark.parametrize(("name", "call"), [
    ("torch.addbmm", lambda t: torch.addbmm(t[0], t, t)),
    ("torch.tensordot", lambda t: torch.tensordot(t, t, dims=2)),
])
def test_what_the_mode_refuses_capture_leaves_unrecorded(
        tmp_path: Path, name: str, call: Callable[[torch.Tensor], torch.Tensor]) -> None:
    t = torch.randn(3, 3, 3, dtype=F64)
    assert MATMULS[getattr(torch, name.split(".")[1])].route is None
    with arithmetic("mxfp8_e4m3"), pytest.raises(UnsupportedMatmulError, match=name):
        call(t)
    with pytest.warns(UserWarning, match=rf"{name} ×1"), \
            capture(nn.Identity(), tmp_path / "d.safetensors") as cap:
        call(t)
    assert cap.unrecorded == {name: 1} and cap.names == ()


def test_a_call_the_route_refuses_is_unrecorded(tmp_path: Path) -> None:
    """sdpa with dropout: the mode refuses it under a policy, so capture has no products."""
    t = torch.randn(1, 1, 4, 8, dtype=F64)
    with arithmetic("mxfp8_e4m3"), pytest.raises(UnsupportedMatmulError, match="dropout_p"):
        F.scaled_dot_product_attention(t, t, t, dropout_p=0.5)
    with pytest.warns(UserWarning, match=r"F\.scaled_dot_product_attention ×1"), \
            capture(nn.Identity(), tmp_path / "d.safetensors") as cap:
        F.scaled_dot_product_attention(t, t, t, dropout_p=0.5)
    assert cap.unrecorded == {"F.scaled_dot_product_attention": 1} and cap.names == ()



def test_each_backward_over_a_decomposed_call_records_its_gradients(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=F64, generator=g, requires_grad=True)
               for _ in range(3))
    model = Call(F.scaled_dot_product_attention)
    with capture(model, tmp_path / "d.safetensors", roles="gradient") as cap:
        out = model(q, k, v)
        out.backward(torch.ones_like(out), retain_graph=True)
        out.backward(2 * torch.ones_like(out))
    qk, pv = "<root>/0/gradient", "<root>/1/gradient"
    assert cap.names == (f"{qk}.0", f"{qk}.1", f"{pv}.0", f"{pv}.1")
    t, _ = read_dump(tmp_path / "d.safetensors")
    assert torch.equal(t[f"{pv}.0"], torch.ones_like(out))  # p·v is the output: dO itself
    assert torch.equal(t[f"{pv}.1"], 2 * torch.ones_like(out))
    # linear in dO, and doubling is exact in every product and sum of the softmax backward
    assert torch.equal(t[f"{qk}.1"], 2 * t[f"{qk}.0"]) and t[f"{qk}.0"].abs().max() > 0
