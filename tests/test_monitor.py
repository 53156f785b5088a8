"""drift.monitor: a training run's matmul operands measured live, the run's numbers unchanged."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import driftcli as drift
from driftcli.errors import DriftError
from driftcli.io.readers import open_inputs
from driftcli.live.monitor import Alert
from driftcli.live.tables import read_monitor

CASTS = ["mxfp8_e4m3", "nvfp4", "fp8_e4m3"]
CAST_MEASURES = ("clip-rate", "underflow-rate", "error-bias")


class Block(nn.Module):
    """A pre-norm transformer block: attention written with explicit matmuls, then an MLP."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for y in self.qkv(self.norm1(x)).split(d, dim=-1))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TwoLayer(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def run(steps: int = 20, *, monitor: dict[str, Any] | None = None,
        dumps: dict[int, Path] | None = None,
        before: Callable[[int, TwoLayer], None] | None = None) -> dict[str, Any]:
    """Train the two-layer model on fixed random tokens: plainly, under ``drift.monitor(model,
    **monitor)``, or with ``drift.capture`` around the steps of ``dumps``; ``before(step,
    model)`` runs before each step."""
    torch.manual_seed(0)
    model = TwoLayer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 40, (steps, 2, 17))
    mon = drift.monitor(model, **monitor) if monitor is not None else None
    if mon is not None:
        mon.start()
    losses = []
    for s in range(steps):
        if before is not None:
            before(s, model)
        cap = drift.capture(model, dumps[s], step=s) if dumps and s in dumps else None
        if cap is not None:
            cap.__enter__()
        logits = model(data[s, :, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 40), data[s, :, 1:].reshape(-1))
        loss.backward()
        if cap is not None:
            cap.__exit__(None, None, None)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        if mon is not None:
            mon.step()
    if mon is not None:
        mon.close()
    return {"losses": losses, "model": model, "monitor": mon}


# The axis each direction casts a recorded operand along (docs/monitor.md#directions, from
# arith/autograd's forward A·B, dgrad dC·Bᵀ, wgrad Aᵀ·dC): a Linear's weight is stored (N, K)
# and multiplied transposed; a Linear's activation and gradient fold their leading dims into
# the wgrad's contraction.
def _oriented(x: torch.Tensor, role: str, operand: str, token: str) -> tuple[torch.Tensor, int]:
    kind, side = token.split(".")
    linear_weight = role == "weight"  # every weight of the test's model is a Linear's
    if kind == "forward":
        return x, -1 if side == "lhs" or linear_weight else -2
    if kind == "dgrad":
        return x, 0 if linear_weight else -1
    if operand in ("forward.lhs wgrad.rhs", "dgrad.lhs wgrad.lhs"):  # a Linear's wgrad
        return x.reshape(-1, x.shape[-1]), 0
    return x, -2


IDENTITY = ["source", "tensor", "role", "layer", "operand", "step", "cast"]


def _expected(dumps: dict[int, Path], what: str) -> pd.DataFrame:
    """drift.measure's tensor rows of every captured operand, in every direction it feeds."""
    frames = []
    for step, path in dumps.items():
        refs = open_inputs([path], (), ()).tensors
        groups: dict[int, dict[str, torch.Tensor]] = {}
        info = {}
        for ref in refs:
            assert ref.operand is not None and ref.role is not None
            for token in ref.operand.split():
                x, axis = _oriented(ref.read(), ref.role, ref.operand, token)
                key = f"{ref.name}@{token}"
                groups.setdefault(axis, {})[key] = x
                info[key] = (ref.name, ref.role, ref.layer, token, token.split(".")[0])
        for axis, tensors in groups.items():
            rows = drift.measure(tensors, CASTS, what, axis=axis)
            rows = rows[rows.tensor != "*"].copy()
            got = rows.tensor.map(info)
            rows["tensor"] = [g[0] for g in got]
            rows["role"] = [g[1] for g in got]
            rows["layer"] = [g[2] for g in got]
            rows["operand"] = [g[3] for g in got]
            rows["direction"] = [g[4] for g in got]
            rows["step"] = step
            frames.append(rows)
    return pd.concat(frames, ignore_index=True)


def _keyed(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.drop(columns=["source", "shape"])  # the file's, and the folded view's
    return frame.sort_values(["step", "tensor", "direction", "cast"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plain run, the run monitored every 5 steps of 20, and the run captured at those
    steps."""
    root = tmp_path_factory.mktemp("monitor")
    dumps = {s: root / f"step{s}.safetensors" for s in range(0, 20, 5)}
    return {"plain": run(), "watched": run(monitor={"casts": CASTS, "every": 5,
                                                    "out": root / "mon"}),
            "captured": run(dumps=dumps), "dumps": dumps, "out": root / "mon"}


@pytest.mark.slow
def test_the_monitored_run_is_bit_for_bit_the_plain_one(runs: dict[str, Any]) -> None:
    plain, watched = runs["plain"], runs["watched"]
    assert all(torch.equal(a, b) for a, b in zip(plain["losses"], watched["losses"],
                                                 strict=True))
    for (name, p), q in zip(plain["model"].named_parameters(),
                            watched["model"].parameters(), strict=True):
        assert torch.equal(p, q), name
    # a planted change is seen: one step of another seed's data gives other losses
    assert not torch.equal(plain["losses"][3], plain["losses"][4])


@pytest.mark.slow
@pytest.mark.parametrize("what", CAST_MEASURES)
def test_rows_are_measure_of_the_captured_operands(runs: dict[str, Any], what: str) -> None:
    """Count for count and column for column, the monitor's rows are drift.measure's rows of
    the operands drift.capture records at the sampled steps, each in every direction."""
    got = _keyed(runs["watched"]["monitor"].rows(what))
    want = _keyed(_expected(runs["dumps"], what))
    assert sorted(got.step.unique()) == [0, 5, 10, 15]
    assert len(got) == len(want) > 0
    assert len(got) == len(want.drop_duplicates(["step", "tensor", "direction", "cast"]))
    pd.testing.assert_frame_equal(got[want.columns], want, check_exact=False, rtol=1e-12)
    counts = [c for c in got.columns if got[c].dtype.kind in "iu"]
    assert counts  # the counts are exact: drift defines them exactly
    pd.testing.assert_frame_equal(got[counts], want[counts], check_exact=True)


@pytest.mark.slow
def test_the_written_tables_are_the_rows(runs: dict[str, Any]) -> None:
    tables = read_monitor(runs["out"])
    mon = runs["watched"]["monitor"]
    assert set(tables) == {*CAST_MEASURES, "stats"}
    for what, frame in tables.items():
        pd.testing.assert_frame_equal(frame, mon.rows(what))
    parts = sorted(p.name for p in (runs["out"] / "monitor-clip-rate").iterdir())
    assert parts == [f"part-{s:09d}.parquet" for s in (0, 5, 10, 15)]


def _block0(model: TwoLayer) -> Block:
    block = model.blocks[0]
    assert isinstance(block, Block)
    return block


def _modes() -> int:
    return int(torch._C._len_torch_function_stack())


def test_unsampled_steps_install_nothing() -> None:
    """Steps 1, 4 and 7 of 10 are sampled (start 1, every 3, end 7): on the others no hook and
    no mode is installed at all."""
    seen: dict[int, tuple[int, int]] = {}

    def before(s: int, model: TwoLayer) -> None:
        seen[s] = (len(_block0(model).up._forward_pre_hooks), _modes())

    out = run(10, monitor={"casts": "mxfp8_e4m3", "every": 3, "start": 1, "end": 7,
                           "measurements": "clip-rate"}, before=before)
    assert seen == {s: ((1, 1) if s in (1, 4, 7) else (0, 0)) for s in range(10)}
    assert sorted(out["monitor"].rows("clip-rate").step.unique()) == [1, 4, 7]
    assert _modes() == 0 and not _block0(out["model"]).up._forward_pre_hooks


def test_layers_types_operands_and_directions_select() -> None:
    mon = run(1, monitor={"casts": CASTS[:2], "every": 1, "layers": "blocks.0.*",
                          "types": nn.Linear, "operands": ["weight", "gradient"],
                          "directions": "dgrad", "measurements": ["stats", "clip-rate"]}
              )["monitor"]
    stats = mon.rows("stats")
    layers = {"blocks.0.qkv", "blocks.0.proj", "blocks.0.up", "blocks.0.down"}
    assert set(stats.layer) == layers  # not blocks.0 (its q @ kᵀ), not head
    assert set(zip(stats.role, stats.operand, strict=True)) == {
        ("weight", "dgrad.rhs"), ("gradient", "dgrad.lhs")}
    assert len(stats) == 8 and len(mon.rows("clip-rate")) == 16
    # the dgrad reads a Linear's weight (N, K) along N, its gradient along its last axis
    up = stats.set_index("tensor")
    assert up.loc["blocks.0.up/weight", "shape"] == "[64, 32]"
    with pytest.raises(DriftError, match="error-bias is not measured"):
        mon.rows("error-bias")


@pytest.mark.slow
def test_an_alert_fires_at_the_step_of_the_planted_fault(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """One weight of blocks.0.up is set to 5000 before step 10 and back after it: the rule
    fires at step 10 only, for that weight in both its directions, calls the callback and logs
    one line naming layer, operand, cast and value."""
    got: list[Alert] = []

    def before(s: int, model: TwoLayer) -> None:
        if s in (10, 11):
            with torch.no_grad():
                _block0(model).up.weight[3, 7] = 5000.0 if s == 10 else 0.01

    rules = ["stats: amax > 1000 and role == 'weight'",
             "clip-rate: clip_rate > 0.9 and role == 'weight'"]
    with caplog.at_level(logging.WARNING, logger="driftcli.monitor"):
        run(20, monitor={"casts": "mxfp8_e4m3", "every": 5, "alerts": rules,
                         "on_alert": got.append, "measurements": ["stats", "clip-rate"]},
            before=before)
    assert [(a.step, a.tensor, a.direction, a.value) for a in got] == [
        (10, "blocks.0.up/weight", "forward", 5000.0),
        (10, "blocks.0.up/weight", "dgrad", 5000.0)]
    assert [r.getMessage() for r in caplog.records] == [a.line() for a in got]
    assert "blocks.0.up weight" in got[0].line() and "amax = 5000.0" in got[0].line()


def test_bad_arguments_are_one_line_errors() -> None:
    model = TwoLayer()
    for kwargs, match in (({"casts": []}, "no cast"), ({"casts": "nope"}, "nope"),
                          ({"casts": "nvfp4", "every": 0}, "every must be"),
                          ({"casts": "nvfp4", "measurements": "clip"}, "clip"),
                          ({"casts": "nvfp4", "operands": "act"}, "act"),
                          ({"casts": "nvfp4", "types": int}, "nn.Module classes"),
                          ({"casts": "nvfp4", "alerts": "clip_rate >"}, "clip_rate")):
        with pytest.raises(DriftError, match=match):
            drift.monitor(model, **kwargs)
    with pytest.raises(DriftError, match="outside the monitor"):
        drift.monitor(model, "nvfp4").step()


def test_a_folder_holding_a_run_is_not_written_over(tmp_path: Path) -> None:
    model = nn.Linear(32, 8)
    with drift.monitor(model, "nvfp4", out=tmp_path, every=1, measurements="stats") as mon:
        model(torch.ones(2, 32)).sum().backward()
        mon.step()
    before = sorted(p.name for p in (tmp_path / "monitor-stats").iterdir())
    assert before == ["part-000000000.parquet"] and len(mon.rows("stats")) == 6  # 3 x 2
    with pytest.raises(DriftError, match="holds a monitor run already"):
        drift.monitor(model, "nvfp4", out=tmp_path).start()
    assert sorted(p.name for p in (tmp_path / "monitor-stats").iterdir()) == before


_KILLED = """
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, {tests!r})
import driftcli as drift
from test_monitor import TwoLayer

torch.manual_seed(0)
model = TwoLayer()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
with drift.monitor(model, ["mxfp8_e4m3", "nvfp4"], out={out!r}, every=1,
                   measurements=["clip-rate", "stats"]) as mon:
    step = 0
    while True:  # until killed
        tokens = torch.randint(0, 40, (2, 17))
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 40), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step()
"""


@pytest.mark.slow
def test_a_run_killed_mid_training_keeps_every_flushed_step(tmp_path: Path) -> None:
    """SIGKILL while a step is measured or written: every part written before reads back
    whole, each step with all its rows; no half-written part is read."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "mon"
    script = tmp_path / "train.py"
    script.write_text(_KILLED.format(tests=str(Path(__file__).parent), out=str(out)))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE)
    parts = out / "monitor-clip-rate"
    deadline = time.monotonic() + 240
    try:
        while len(list(parts.glob("part-*.parquet"))) < 4:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "no four parts within 240 s"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    tables = read_monitor(out)
    steps = sorted(tables["clip-rate"].step.unique())
    assert len(steps) >= 4 and steps == list(range(len(steps)))
    per_step = tables["clip-rate"].groupby("step").size()
    assert per_step.nunique() == 1 and per_step.iloc[0] > 0
    # the stats parts of the steps written so far: at most the step being written is missing
    assert set(tables["stats"].step) <= set(steps) and len(set(tables["stats"].step)) >= \
        len(steps) - 1


def _binade(v: float) -> int:
    return math.frexp(v)[1] - 1  # v = m·2**e with m in [0.5, 1): floor(log2 v) = e - 1


def test_stats_columns_count_by_hand() -> None:
    """amax, the smallest nonzero magnitude, the binades between them and the blocks' ranges,
    against math.frexp; NaN and inf counted, not taken for the amax."""
    from driftcli.live.operands import operand_stats

    x = torch.full((4, 64), 1.5)
    x[0, 3], x[1, 40], x[2, 0] = 5000.0, 1e-30, 0.0
    x[3, 33], x[3, 34] = math.nan, math.inf
    got = operand_stats(x, -1)
    # the 8 blocks: 5000 beside 1.5, 1e-30 beside 1.5, five of 1.5 (and zeros), one with NaN
    spans = sorted([_binade(5000.0) - _binade(1.5), _binade(1.5) - _binade(1e-30), 0, 0, 0, 0,
                    0])
    assert spans == [0, 0, 0, 0, 0, 12, 100]
    assert got == {"numel": 256, "n_nonfinite": 2, "amax": 5000.0,
                   "amin": float(torch.tensor(1e-30)), "dynamic_range": 112, "block": 32,
                   "block_range_median": spans[3], "block_range_max": 100}
    # along the first axis (4 long): no whole block, so no blockwise range
    along = operand_stats(x, 0)
    assert along["block_range_median"] is None and along["amax"] == 5000.0


def test_block_stats_rows_are_block_stats_of_the_captured_linear_operands(tmp_path: Path
                                                                          ) -> None:
    """A Linear's operands in each direction are block-stats' rows (forward, the gradient's
    dgrad) or columns (the wgrad's folded tokens, the weight's dgrad) of the captured tensor;
    a cast block-stats refuses (unscaled bfloat16) is an error row, the others measured."""
    from driftcli.measures.block_stats import block_stats

    casts = ["mxfp8_e4m3", "nvfp4", "fp8_e4m3", "bfloat16"]

    def step(model: nn.Module, x: torch.Tensor) -> None:
        model(x).square().mean().backward()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    x = torch.randn(2, 16, 64) * torch.logspace(-3, 3, 64)
    with drift.monitor(model, casts, every=1, measurements="block-stats") as mon:
        step(model, x)
        mon.step()
    model.zero_grad()
    with drift.capture(model, tmp_path / "d.safetensors"):
        step(model, x)
    got = mon.rows("block-stats")
    assert len(got) == 6 * 2 * 4 and got.error.notna().sum() == 12  # bfloat16: no scales
    assert got[got.error.notna()].cast.unique().tolist() == [str(drift.parse_cast("bfloat16"))]
    want = pd.DataFrame([r.__dict__ for r in block_stats([tmp_path / "d.safetensors"],
                                                         casts[:3]).rows])
    axis_of = {"forward.lhs": "rows", "forward.rhs": "rows", "dgrad.lhs": "rows",
               "dgrad.rhs": "columns", "wgrad.lhs": "columns", "wgrad.rhs": "columns"}
    mine = got[got.error.isna()].assign(groups=lambda d: d.operand.map(axis_of))
    per_tensor_cast = {"fp8_e4m3": "tensor"}  # one scale: block-stats' only direction
    names = {str(drift.parse_cast(c)): c for c in casts}
    mine["groups"] = [per_tensor_cast.get(names[c], g) for c, g in zip(mine.cast, mine.groups,
                                                                        strict=True)]
    columns = ["n_blocks", "clipped_blocks", "scale_at_max", "scale_exponent_min",
               "scale_exponent_max", "range_median", "range_max", "zero_blocks"]
    merged = mine.merge(want, left_on=["tensor", "cast", "groups"],
                        right_on=["tensor", "cast", "direction"], suffixes=("", "_cmd"))
    assert len(merged) == len(mine) == 36
    for c in columns:
        assert merged[c].tolist() == merged[f"{c}_cmd"].tolist(), c
    assert (merged.clipped_blocks > 0).any() and merged.range_max.max() > 8  # not all trivial
