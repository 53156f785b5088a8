"""The capture API: every matmul operand of forward and backward, named, in a drift dump."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from safetensors import safe_open
from torch import nn

from driftcli.errors import DriftError
from driftcli.io.capture import DUMP_KEY, Role, capture

LINEAR = {"activation": "forward.lhs wgrad.rhs", "weight": "forward.rhs dgrad.rhs",
          "gradient": "dgrad.lhs wgrad.lhs"}
MATMUL = {"lhs": "forward.lhs wgrad.lhs", "rhs": "forward.rhs dgrad.rhs",
          "gradient": "dgrad.lhs wgrad.rhs"}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Attention(nn.Module):
    """q @ kᵀ with `@`, softmax, then torch.bmm with v; a parameter used through `@` and `.T`."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4, bias=False)
        self.k = nn.Linear(4, 4, bias=False)
        self.v = nn.Linear(4, 4, bias=False)
        self.proj = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        mixed = torch.bmm(torch.softmax(scores, dim=-1), self.v(x))
        return torch.matmul(mixed, self.proj.T)


class Twice(nn.Module):
    """One Linear applied twice: a reused module."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.relu(self.block(x)))


def read_dump(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(path), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        meta = json.loads(f.metadata()[DUMP_KEY])
    return tensors, meta


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().sum()
    loss.backward()
    return loss


def test_mlp_operands_are_the_tensors_the_step_used(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(7, 6)
    path = tmp_path / "dump.safetensors"
    with capture(model, path, step=3) as cap:
        step(model, x)
    tensors, meta = read_dump(path)

    # the same step again by hand, keeping the outputs' gradients
    y1 = model.fc1(x)
    h = torch.tanh(y1)
    y2 = model.fc2(h)
    y1.retain_grad()
    y2.retain_grad()
    y2.square().sum().backward()

    assert torch.equal(tensors["fc1/activation"], x)
    assert torch.equal(tensors["fc2/activation"], h.detach())
    assert torch.equal(tensors["fc1/weight"], model.fc1.weight.detach())
    assert torch.equal(tensors["fc2/weight"], model.fc2.weight.detach())
    assert torch.equal(tensors["fc2/gradient"], y2.grad)
    assert torch.equal(tensors["fc2/gradient"], 2 * y2.detach())  # d(sum y²)/dy
    assert torch.equal(tensors["fc1/gradient"], y1.grad)
    assert cap.names == tuple(f"{layer}/{role}" for layer in ("fc1", "fc2")
                              for role in ("activation", "weight", "gradient"))
    assert meta == {"version": 1, "tensors": {
        f"{layer}/{role}": {"role": role, "layer": layer, "operand": LINEAR[role], "step": 3}
        for layer in ("fc1", "fc2") for role in ("activation", "weight", "gradient")}}
    assert cap.entries["fc2/gradient"].role is Role.GRADIENT


def test_functional_matmuls_are_all_recorded_with_distinct_names(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model, x = Attention(), torch.randn(2, 3, 4)
    path = tmp_path / "attn.safetensors"
    with capture(model, path) as cap:
        step(model, x)
    tensors, meta = read_dump(path)
    linears = [f"{n}/{r}" for n in "qk" for r in ("activation", "weight", "gradient")]
    assert cap.names == (
        *linears,
        "<root>/0/lhs", "<root>/0/rhs", "<root>/0/gradient",               # q @ kᵀ
        "v/activation", "v/weight", "v/gradient",
        "<root>/1/lhs", "<root>/1/rhs", "<root>/1/gradient",               # bmm(p, v)
        "<root>/2/activation", "<root>/2/weight", "<root>/2/gradient",      # mixed @ proj.T
    )
    assert set(tensors) == set(cap.names)
    q, k, v = (layer(x).detach() for layer in (model.q, model.k, model.v))
    probs = torch.softmax(q @ k.transpose(1, 2), dim=-1)
    assert torch.equal(tensors["<root>/0/lhs"], q)
    assert torch.equal(tensors["<root>/0/rhs"], k.transpose(1, 2))
    assert torch.equal(tensors["<root>/1/lhs"], probs)
    assert torch.equal(tensors["<root>/1/rhs"], v)
    assert torch.equal(tensors["<root>/2/weight"], model.proj.detach().T)
    assert tensors["<root>/0/rhs"].is_contiguous()  # a transposed view, saved contiguous
    roles = {n: (e["role"], e["operand"]) for n, e in meta["tensors"].items()}
    assert roles["<root>/0/lhs"] == ("activation", MATMUL["lhs"])
    assert roles["<root>/0/rhs"] == ("activation", MATMUL["rhs"])
    assert roles["<root>/1/gradient"] == ("gradient", MATMUL["gradient"])
    assert roles["<root>/2/weight"] == ("weight", MATMUL["rhs"])  # a view of a parameter
    assert roles["<root>/2/activation"] == ("activation", MATMUL["lhs"])
    assert {e["layer"] for e in meta["tensors"].values()} == {"q", "k", "v", "<root>"}


def test_a_reused_module_gets_a_name_per_call_and_one_weight(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model, x = Twice(), torch.randn(3, 4)
    path = tmp_path / "twice.safetensors"
    with capture(model, path) as cap:
        step(model, x)
    tensors, meta = read_dump(path)
    assert cap.names == ("block#0/activation", "block/weight", "block#0/gradient",
                         "block#1/activation", "block#1/gradient")
    assert torch.equal(tensors["block#0/activation"], x)
    assert torch.equal(tensors["block#1/activation"], torch.relu(model.block(x)).detach())
    assert {meta["tensors"][n]["layer"] for n in cap.names} == {"block"}


def test_matmuls_outside_the_model_and_repeated_backward(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model, x = MLP(), torch.randn(2, 6)
    other = torch.randn(3, 2)
    with capture(model, tmp_path / "d.safetensors", roles=("gradient",)) as cap:
        loss = (model(x) @ other).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert cap.names == ("fc1/gradient.0", "fc1/gradient.1", "fc2/gradient.0", "fc2/gradient.1",
                         "<outside>/gradient.0", "<outside>/gradient.1")
    assert cap.entries["<outside>/gradient.0"].layer == "<outside>"


def test_checkpoint_recomputation_in_backward_is_not_recorded(tmp_path: Path) -> None:
    torch.manual_seed(9)
    model, x = MLP(), torch.randn(2, 6)
    with capture(model, tmp_path / "ckpt.safetensors") as cap:
        y = torch.utils.checkpoint.checkpoint(model.fc1, x, use_reentrant=False)
        model.fc2(y).sum().backward()  # backward runs fc1's forward again
    assert cap.names == tuple(f"{layer}/{role}" for layer in ("fc1", "fc2")
                              for role in ("activation", "weight", "gradient"))


def test_roles_select_what_is_recorded(tmp_path: Path) -> None:
    torch.manual_seed(4)
    model, x = Attention(), torch.randn(1, 2, 4)
    with capture(model, tmp_path / "w.safetensors", roles=("weight",)) as cap:
        step(model, x)
    assert cap.names == ("q/weight", "k/weight", "v/weight", "<root>/2/weight")  # indices kept
    with capture(model, tmp_path / "g.safetensors", roles="gradient") as cap:
        step(model, x)
    assert {e.role for e in cap.entries.values()} == {Role.GRADIENT} and len(cap.names) == 6
    with pytest.raises(DriftError,
                       match=r"'weights'; did you mean weight\? \(choose from activation, weight"):
        capture(model, tmp_path / "x.safetensors", roles=("weights",))
    with pytest.raises(DriftError, match="empty"):
        capture(model, tmp_path / "x.safetensors", roles=())


def test_no_backward_means_no_gradients(tmp_path: Path) -> None:
    torch.manual_seed(5)
    model = MLP()
    with capture(model, tmp_path / "fwd.safetensors") as cap:
        model(torch.randn(2, 6))
    assert cap.names == ("fc1/activation", "fc1/weight", "fc2/activation", "fc2/weight")
    # a backward after the capture ends is not recorded, and the model carries no hooks
    model(torch.randn(2, 6)).sum().backward()
    tensors, _ = read_dump(tmp_path / "fwd.safetensors")
    assert set(tensors) == set(cap.names)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_an_exception_in_the_body_writes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(6)
    model = MLP()
    with pytest.raises(RuntimeError, match="mat1 and mat2"), \
            capture(model, tmp_path / "dump.safetensors"):
        step(model, torch.randn(2, 6))
        model(torch.randn(2, 7))  # wrong width: fc1 raises inside the forward
    assert list(tmp_path.iterdir()) == []
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_outputs_and_gradients_are_bit_identical_with_capture(tmp_path: Path) -> None:
    torch.manual_seed(7)
    model = nn.Sequential(MLP(), nn.Linear(3, 4), nn.Unflatten(1, (1, 4)), Attention())
    model = model.to(torch.bfloat16)
    twin = copy.deepcopy(model)
    x = torch.randn(5, 6, dtype=torch.bfloat16)
    plain_out = twin(x)
    plain_out.float().square().sum().backward()
    path = tmp_path / "bf16.safetensors"
    with capture(model, path) as cap:
        out = model(x)
        out.float().square().sum().backward()
    assert torch.equal(out, plain_out)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    tensors, _ = read_dump(path)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}  # saved as they were
    assert "0.fc1/activation" in cap.names and "3/0/lhs" in cap.names


def test_the_file_is_a_plain_safetensors_dump(tmp_path: Path) -> None:
    torch.manual_seed(8)
    model = MLP()
    path = tmp_path / "sub" / "dump.safetensors"  # the folder is made
    with capture(model, str(path), step=12):
        step(model, torch.randn(4, 6))
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
        raw = f.metadata()
    meta = json.loads(raw[DUMP_KEY])
    assert meta["version"] == 1 and set(meta["tensors"]) == set(names)
    for entry in meta["tensors"].values():
        assert set(entry) == {"role", "layer", "operand", "step"}
        assert entry["role"] in {"activation", "weight", "gradient"} and entry["step"] == 12
    assert [p.name for p in path.parent.iterdir()] == ["dump.safetensors"]  # no temp left


def test_unrecorded_matmuls_are_reported(tmp_path: Path) -> None:
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"torch\.tensordot ×1"), \
            capture(nn.Identity(), tmp_path / "e.safetensors") as cap:
        torch.tensordot(a, b, dims=1)
    assert cap.unrecorded == {"torch.tensordot": 1} and cap.names == ()


def test_bad_arguments_are_drift_errors(tmp_path: Path) -> None:
    with pytest.raises(DriftError, match=r"nn\.Module"):
        capture(lambda x: x, tmp_path / "d.safetensors")  # type: ignore[arg-type]
    with pytest.raises(DriftError, match="step"):
        capture(MLP(), tmp_path / "d.safetensors", step=-1)
    with pytest.raises(DriftError, match="directory"), capture(MLP(), tmp_path):
        pass
    cap = capture(MLP(), tmp_path / "d.safetensors")
    with cap:
        pass
    with pytest.raises(DriftError, match="only once"), cap:
        pass


def test_example_script_writes_a_dump(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "examples" / "capture_dump.py"
    path = tmp_path / "mlp.safetensors"
    proc = subprocess.run([sys.executable, str(script), str(path)], capture_output=True,
                          text=True, check=True, timeout=120)
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == [f"{layer}/{role}" for layer in ("fc1", "fc2")
                     for role in ("activation", "weight", "gradient")]
    tensors, meta = read_dump(path)
    assert set(tensors) == set(names) and meta["tensors"]["fc1/weight"]["step"] == 0
