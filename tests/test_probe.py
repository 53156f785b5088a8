"""drift probe: the update-freeze rule against exact rationals on every bfloat16 and float16
value, the freeze share of a run counted by that rule, rows per (checkpoint, policy, parameter)
in the order of the recorded steps, and runs that mix checkpoints refused with one line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import test_train
import torch
from test_train import _one_line_error, drift, trained

from driftcli.arith.policy import get_policy
from driftcli.io.tables import read_table
from driftcli.models import (
    MLPConfig,
    TransformerConfig,
    load_checkpoint,
    save_checkpoint,
)
from driftcli.runs import TrainConfig, train
from driftcli.runs.probe import (
    ProbeError,
    ProbeRow,
    Storage,
    next_updates,
    probe,
    probe_batch,
    probe_corpus,
    run_checkpoints,
    storage_gaps,
    update_lost,
    update_lost_exact,
)

text = test_train.text  # the same made-up verse, a module fixture here too

DTYPES = {Storage.BFLOAT16: torch.bfloat16, Storage.FLOAT16: torch.float16,
          Storage.FLOAT32: torch.float32}


# --- the rule, value by value ------------------------------------------------------------------

def _neighbour_gaps(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gaps (float64) from each finite stored value down and up to the values of the codes
    beside it, found by stepping the code (not by the exponent arithmetic under test). The
    largest finite value's gap up is the one below it, in the same binade."""
    view = torch.int16 if stored.element_size() == 2 else torch.int32
    sign = 1 << (8 * stored.element_size() - 1)
    mag = stored.view(view).to(torch.int64) & (sign - 1)

    def size(m: torch.Tensor) -> torch.Tensor:
        return m.to(view).view(stored.dtype).double()

    here = size(mag)
    below = torch.where(mag > 0, here - size(mag - 1), size(torch.ones_like(mag)))
    above = size(mag + 1) - here
    above = torch.where(torch.isinf(above), below, above)
    negative = stored < 0
    return torch.where(negative, above, below), torch.where(negative, below, above)


def _around_half_gaps(stored: torch.Tensor) -> list[torch.Tensor]:
    """Updates at, just below and just above half the gap up, and the same down (float64)."""
    down, up = _neighbour_gaps(stored)
    out = []
    for half in (up / 2, -down / 2):
        out += [half, torch.nextafter(half, torch.zeros_like(half)),
                torch.nextafter(half, 2 * half)]
    return out


def _disagreements(w: torch.Tensor, updates: list[torch.Tensor], storage: Storage) -> list[str]:
    bad = []
    for dw in updates:
        fast = update_lost(w, dw, storage).tolist()
        for x, d, got in zip(w.tolist(), dw.tolist(), fast, strict=True):
            if update_lost_exact(x, d, storage) != got:
                bad.append(f"w={x!r} dw={d!r}: vectorized says {got}")
    return bad


@pytest.mark.parametrize("storage", [Storage.BFLOAT16, Storage.FLOAT16])
def test_update_lost_is_the_exact_rule_on_every_value(storage: Storage) -> None:
    """Every finite value of the format as the weight, with updates at and one float64 step
    either side of each half-gap: the vectorized rule says what exact rationals say. The
    rationals judge the values from +0 up; rounding to nearest even (overflow included) is
    symmetric in sign, so (-w, -Δw) must get the verdict of (w, Δw)."""
    codes = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16)
    values = codes.view(DTYPES[storage])
    values = values[torch.isfinite(values)]
    w = values.float()
    bad = []
    for dw in _around_half_gaps(values):
        exact = [update_lost_exact(x, d, storage)
                 for x, d in zip(w.tolist(), dw.tolist(), strict=True)]
        for sign in (1, -1):
            fast = update_lost(sign * w, sign * dw, storage).tolist()
            bad += [f"w={sign * x!r} dw={sign * d!r}: {got}, exactly {want}" for x, d, got, want
                    in zip(w.tolist(), dw.tolist(), fast, exact, strict=True) if got != want]
    assert not bad, f"{len(bad)} disagreements, first: {bad[:5]}"


@pytest.mark.parametrize("storage", list(Storage))
def test_update_lost_rounds_the_weight_to_storage_first(storage: Storage) -> None:
    """float32 weights off the storage grid, down into the subnormals and up past the largest
    value (stored as inf), against the exact rule."""
    rng = np.random.default_rng(5)
    low, high = (-30, 17) if storage is Storage.FLOAT16 else (-150, 126)
    x = rng.standard_normal(3000) * np.exp2(rng.integers(low, high, 3000))
    top = [3.3895e38, 3.3961e38, 3.4e38, 65519.0, 65520.0, 70000.0]  # bfloat16, float16 tops
    w = torch.from_numpy(np.concatenate([x, top, np.negative(top)]).astype(np.float32))
    stored = w.to(DTYPES[storage])
    finite = torch.isfinite(stored)
    if storage is not Storage.FLOAT32:
        assert (~finite).sum() >= 2 and (stored[finite] != w[finite]).sum() > 2500
    updates = [torch.where(finite, d, 1.0) for d in _around_half_gaps(
        torch.where(finite, stored, torch.zeros_like(stored)))]
    assert not _disagreements(w, updates, storage)


def test_update_lost_at_the_boundaries() -> None:
    """The cases that decide the rule, written out: ties go to the even neighbour, a power of
    two has the finer spacing below it, zero and the smallest subnormal, the top of the range
    overflowing to inf, stored infinities, NaN."""
    big = (2 - 2**-7) * 2.0**127  # bfloat16's largest
    cases = [  # (storage, w, dw, lost)
        ("bfloat16", 1.0, -(2**-9), True),  # tie below 1 (spacing 2**-8 there): 1 is even
        ("bfloat16", 1.0, -1.5 * 2**-9, False),  # under half the ulp above, yet it moves
        ("bfloat16", 1.0, 2.0**-8, True),  # tie above: stays on the even 1
        ("bfloat16", 1.0, 2.0**-8 * (1 + 2**-52), False),
        ("bfloat16", 1 + 2**-7, 2.0**-8, False),  # odd: the tie goes up to 1 + 2**-6
        ("bfloat16", -1.0, 1.5 * 2**-9, False),  # the same toward zero from below
        ("bfloat16", 0.0, 2.0**-134, True),  # half the smallest subnormal: tie to 0
        ("bfloat16", 0.0, 1.5 * 2**-134, False),
        ("bfloat16", -0.0, 0.0, True),
        ("bfloat16", 0.0, -0.0, True),
        ("bfloat16", -0.0, 2.0**-135, True),  # rounds to +0, equal to -0 as a number
        ("bfloat16", 2.0**-133, -(2.0**-134), False),  # the odd smallest subnormal ties to 0
        ("bfloat16", 2.0**-126, -(2.0**-134), True),  # the smallest normal: subnormal spacing
        ("bfloat16", 2.0**-126, -(2.0**-133), False),
        ("bfloat16", big, 2.0**119, False),  # half the top spacing: overflows to inf
        ("bfloat16", big, 2.0**119 * (1 - 2**-53), True),
        ("bfloat16", big, -(2.0**119), False),  # tie down to the even neighbour
        ("bfloat16", 1e39, -1e30, True),  # stored as inf, and inf it stays
        ("bfloat16", -1e39, math.inf, False),  # -inf + inf is NaN
        ("bfloat16", 1e39, math.inf, True),
        ("bfloat16", 1.0, math.nan, False),
        ("bfloat16", math.nan, 0.0, False),
        ("bfloat16", 1.0, math.inf, False),
        ("float16", 70000.0, -1e6, True),  # above 65504 + 16: inf in float16
        ("float16", 65504.0, 16.0, False),
        ("float16", 65504.0, 15.9, True),
        ("float16", 2.0**-14, -(2.0**-25), True),
        ("float32", 1.0, -(2.0**-25), True),
        ("float32", 1.0, -(2.0**-25) * (1 + 2**-40), False),
        ("float32", 1.0, 2.0**-24, True),
        ("float32", 2.0**-149, 2.0**-150, False),  # odd: the tie goes up to 2**-148
    ]
    for storage, w, dw, lost in cases:
        assert update_lost_exact(w, dw, storage) is lost, (storage, w, dw)
        got = update_lost(torch.tensor([w]), torch.tensor([dw], dtype=torch.float64), storage)
        assert got.tolist() == [lost], (storage, w, dw)


def test_update_lost_refuses_float64_weights() -> None:
    # torch rounds float64 to bfloat16 through float32: 1 + 2**-8 + 2**-30 lands on 1, not up
    w = torch.tensor([1 + 2**-8 + 2**-30], dtype=torch.float64)
    assert w.to(torch.bfloat16).item() == 1.0
    with pytest.raises(TypeError, match=r"float32 weights, not torch\.float64"):
        update_lost(w, torch.zeros(1, dtype=torch.float64), Storage.BFLOAT16)


@pytest.mark.parametrize("storage", [Storage.FLOAT16, Storage.FLOAT32])
def test_storage_gaps_are_numpy_spacings(storage: Storage) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(2000) * np.exp2(rng.integers(-30, 30, 2000))).astype(np.float32)
    powers = np.exp2(np.arange(-30, 16)).astype(np.float32)  # zero, subnormals, normals
    x = np.concatenate([x, powers, -powers])
    dtype = np.float16 if storage is Storage.FLOAT16 else np.float32
    with np.errstate(over="ignore"):
        stored = x.astype(dtype)
    stored = stored[np.isfinite(stored) & (np.abs(stored) < np.finfo(dtype).max)]
    down, up = storage_gaps(torch.from_numpy(stored), storage)
    inf = np.array(np.inf, dtype=dtype)
    assert np.array_equal(down.numpy(), (stored - np.nextafter(stored, -inf)).astype(np.float64))
    assert np.array_equal(up.numpy(), (np.nextafter(stored, inf) - stored).astype(np.float64))
    assert (down.numpy() != up.numpy()).any()  # some powers of two among them


def test_storage_gaps_from_the_bits() -> None:
    w = torch.tensor([1.0, 1.5, 0.75, -3.0, 2.0**-130, 0.0, -0.0, 1.9999, -2.0, 2.0**-126])
    down, up = storage_gaps(w.bfloat16(), Storage.BFLOAT16)
    assert up.tolist() == [2**-7, 2**-7, 2**-8, 2**-6, 2**-133, 2**-133, 2**-133, 2**-6,
                           2**-7, 2**-133]  # 1.9999 is 2 in bfloat16
    assert down.tolist() == [2**-8, 2**-7, 2**-8, 2**-6, 2**-133, 2**-133, 2**-133, 2**-7,
                             2**-6, 2**-133]


# --- the freeze share of a run -----------------------------------------------------------------

def test_freeze_share_counts_what_storage_keeps(text: Path, tmp_path: Path) -> None:
    """An SGD run whose embedding weights are set to 1/8 (a power of two in bfloat16): rows of
    bytes not in the probe batch get no gradient, so their update is the weight decay's alone,
    -lr·λ·w = -0.003 w, toward zero and between half the gap below 1/8 (2**-12) and half the ulp
    above it (2**-11). Storage moves them; the probe counts every weight as the exact rule does."""
    run = tmp_path / "run"
    train(TrainConfig(MLPConfig(context=8, hidden=16, layers=1), steps=2, batch=8,
                      optimizer="sgd", momentum=0.0, lr=0.03, weight_decay=0.1), run, text)
    path = run / "step-000002.safetensors"
    ck = load_checkpoint(path)
    with torch.no_grad():
        ck.model.embed.weight.fill_(0.125)
    save_checkpoint(path, ck.model, ck.config, ck.state, ck.optimizer)
    ck = load_checkpoint(path)
    batch = probe_batch(ck, probe_corpus(ck, None), 4)
    updates = next_updates(ck, get_policy("exact"), batch)
    params = dict(ck.model.named_parameters())
    byte = torch.arange(256)  # the model reads all but the last byte, padded with byte 0
    still = ~torch.isin(byte, batch[:, :-1]) & (byte != 0)
    decay_only = updates["embed.weight"][still]
    assert still.sum() > 100
    assert torch.equal(decay_only, torch.full_like(decay_only, -0.03 * (0.1 * 0.125)))
    rows = {r.parameter: r for r in probe(run, ["exact"], windows=4)}
    kept = {name: sum(update_lost_exact(w, d, "bfloat16") for w, d in zip(
        params[name].detach().flatten().tolist(), u.flatten().tolist(), strict=True))
        for name, u in updates.items()}
    for name, count in kept.items():
        assert rows[name].freeze_share == count / params[name].numel(), name
    assert rows["*"].freeze_share == sum(kept.values()) / sum(p.numel() for p in params.values())
    # none of the rows without gradient is frozen: at most the rows the batch holds are
    assert rows["embed.weight"].freeze_share <= (~still).sum().item() / still.numel()


def test_finer_storage_freezes_fewer_weights(text: Path, tmp_path: Path) -> None:
    run = trained(tmp_path / "run", text, "--steps", "30", "--checkpoint-every", "30",
                  "--lr", "1e-4")
    shares = {}
    for storage in ("bfloat16", "float16", "float32"):
        rows = probe(run, ["exact"], checkpoints="step-000030.safetensors", storage=storage,
                     windows=4)
        total = next(r for r in rows if r.parameter == "*")
        assert isinstance(total, ProbeRow) and total.lr == 1e-4
        shares[storage] = total.freeze_share
    assert shares["bfloat16"] > shares["float16"] > shares["float32"]
    assert shares["bfloat16"] > 0.5  # lr 1e-4 is well below bfloat16's half ulp at |w| ~ 0.1


# --- the checkpoints of one run, in step order -------------------------------------------------

def test_probe_rows_per_checkpoint_policy_and_parameter(text: Path, tmp_path: Path) -> None:
    run = trained(tmp_path / "run", text, "--steps", "6", "--checkpoint-every", "3")
    code, out, err = drift("probe", run, "-p", "exact", "-p", "mxfp8_e4m3", "-p",
                           "mxfp4_e2m1:sr", "--draws", "3", "--batch", "4", "--json")
    assert code == 0, err
    frame, prov = read_table(run / "probe.parquet")
    params = [n for n, _ in load_checkpoint(run / "step-000000.safetensors")
              .model.named_parameters()]
    policies = ["exact", "mxfp8_e4m3", "mxfp4_e2m1:sr"]
    keys = [(s, p, n) for s in (0, 3, 6) for p in policies for n in [*params, "*"]]
    assert list(zip(frame.step, frame.policy, frame.parameter, strict=True)) == keys
    exact = frame[frame.policy == "exact"]
    assert ((exact.cosine - 1).abs() < 1e-12).all() and exact.expected_cosine.isna().all()
    sr = frame[frame.policy == "mxfp4_e2m1:sr"]
    assert (sr.draws == 3).all() and sr.expected_cosine.notna().all()
    assert frame.freeze_share.between(0, 1).all() and (frame.storage == "bfloat16").all()
    # the totals count every weight
    totals = frame[frame.parameter == "*"]
    assert (totals.numel == frame[frame.parameter != "*"].groupby(
        ["step", "policy"]).numel.sum().values).all()
    assert [r["step"] for r in json.loads(out)["rows"]] == [0] * 3 + [3] * 3 + [6] * 3
    assert prov["draws"] == 3 and len(prov["inputs"]) == 3


def test_checkpoints_come_in_the_order_of_their_steps(text: Path, tmp_path: Path) -> None:
    run = trained(tmp_path / "run", text, "--steps", "12", "--checkpoint-every", "3")
    for p in run.glob("step-*.safetensors"):  # unpadded: by name, step 12 comes before 3
        p.rename(run / f"step-{int(p.stem.split('-')[1])}.safetensors")
    assert [p.name for p in run_checkpoints(run)] == [
        "step-0.safetensors", "step-3.safetensors", "step-6.safetensors", "step-9.safetensors",
        "step-12.safetensors"]
    rows = probe(run, ["exact"], windows=2)
    assert [r.step for r in rows if r.parameter == "*"] == [0, 3, 6, 9, 12]
    assert [r.checkpoint for r in rows if r.parameter == "*"][-1] == "step-12.safetensors"


def _other_text(tmp_path: Path, source: Path) -> Path:
    other = tmp_path / "other.txt"
    other.write_text(source.read_text().upper())
    return other


def test_a_folder_mixing_runs_is_refused(text: Path, tmp_path: Path) -> None:
    mlp = trained(tmp_path / "mlp", text, "--steps", "2")
    transformer = train(TrainConfig(TransformerConfig(context=8, d_model=16, layers=1, heads=2),
                                    steps=1, batch=4), tmp_path / "transformer", text)
    mixed = tmp_path / "mixed"
    shutil.copytree(mlp, mixed)
    shutil.copy(transformer.checkpoints[-1], mixed)  # step-000001, beside the MLP's step 2
    _one_line_error(*drift("probe", mixed, "-p", "exact")[::2],
                    "step-000001.safetensors and step-000002.safetensors",
                    "not from one run (model transformer against mlp)", "--checkpoints GLOB")
    assert not (mixed / "probe.parquet").exists()

    def refused(name: str, source: Path, *extra: str) -> str:
        other = trained(tmp_path / name, source, "--steps", "1", *extra)
        folder = shutil.copytree(mlp, tmp_path / f"mixed-{name}")
        shutil.copy(other / "step-000001.safetensors", folder)
        with pytest.raises(ProbeError) as err:
            run_checkpoints(folder)
        assert "step-000001.safetensors and step-000002.safetensors" in str(err.value)
        return str(err.value)

    assert "model config hidden 32 against 16" in refused("wider", text, "--hidden", "32")
    assert "training setting lr 0.01 against 0.003" in refused("faster", text, "--lr", "0.01")
    message = refused("other-text", _other_text(tmp_path, text))
    assert "recorded text" in message and "other.txt" in message


def test_two_checkpoints_of_one_step_are_refused(text: Path, tmp_path: Path) -> None:
    run = trained(tmp_path / "run", text, "--steps", "2")
    shutil.copy(run / "step-000002.safetensors", run / "step-copy.safetensors")
    _one_line_error(*drift("probe", run, "-p", "exact")[::2],
                    "step-000002.safetensors and step-copy.safetensors", "both hold step 2")
