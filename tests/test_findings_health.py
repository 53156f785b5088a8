"""docs/findings.md, "Does drift health predict a divergence?": examples/findings_health.py's
separation rule on hand-built series (a planted crossing it must not call a separation), and
the whole script re-run at tiny size on runs made here (two that diverge, two that do not)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import test_train
from test_train import drift

from driftcli.models import MLPConfig
from driftcli.runs import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "findings_health.py"
text = test_train.text


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("findings_health", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["findings_health"] = module
    spec.loader.exec_module(module)
    return module


fh = _script()


def test_a_lasting_separation_and_its_lead() -> None:
    # diverging runs above the others from step 20 on, the group's first divergence at 50
    diverging = [{0: 0.1, 10: 0.5, 20: 0.9, 30: 1.0, 40: 1.2}, {0: 0.3, 10: 0.1, 20: 0.8,
                                                                 30: 1.1, 40: 1.5}]
    others = [{0: 0.2, 10: 0.2, 20: 0.3, 30: 0.2, 40: 0.4}]
    sep = fh.separation("x", diverging, others, 50)
    assert (sep.direction, sep.from_step, sep.lead) == ("higher", 20, 30)
    assert sep.separated_checkpoints == 3 and sep.checkpoints == 5
    assert sep.last_diverging == [1.2, 1.5] and sep.last_other == [0.4]
    assert sep.change_diverging == pytest.approx((1.2 - 0.9 + 1.5 - 0.8) / 2)
    # checkpoints at or after the first divergence do not count
    assert fh.separation("x", diverging, others, 25).lead == 5


def test_a_crossing_at_the_end_is_no_separation() -> None:
    # planted: separated at every checkpoint but the last, where one other run crosses
    diverging = [{0: 1.0, 10: 1.0, 20: 1.0}]
    others = [{0: 0.0, 10: 0.0, 20: 2.0}, {0: 0.0, 10: 0.0, 20: 0.0}]
    sep = fh.separation("x", diverging, others, 30)
    assert sep.direction is None and sep.lead is None and sep.separated_checkpoints == 2
    # lower on one side is found as well
    sep = fh.separation("x", [{0: -1.0, 10: -1.0}], [{0: 0.0, 10: 0.0}], 30)
    assert (sep.direction, sep.lead) == ("lower", 30)


def test_the_script_at_tiny_size(text: Path, tmp_path: Path) -> None:
    """Four tiny MLP runs, a checkpoint every 2 steps: lr 0.6 diverges (seeds 1 and 2, at steps
    7 and 8 on this text; seed 0 does not), lr 0.01 does not; drift health on each; the
    script's summary and figure."""
    fates = {}
    for name, lr, seed in (("mlp-hot-s1", 0.6, 1), ("mlp-hot-s2", 0.6, 2),
                           ("mlp-cool-s1", 0.01, 1), ("mlp-cool-s2", 0.01, 2)):
        config = TrainConfig(MLPConfig(context=8, hidden=16, layers=1), steps=24, batch=8,
                             lr=lr, seed=seed, checkpoint_every=2, log_every=0, eval_every=0,
                             diverge_factor=2.0)
        fates[name] = train(config, tmp_path / name, text).diverged_at
        code, _, err = drift("health", tmp_path / name, "-c", "mxfp4_e2m1", "--grad-cast",
                             "mxfp4_e2m1", "--state-layout", "torchao-8bit", "-q")
        assert code == 0, err
    assert fates["mlp-cool-s1"] is None and fates["mlp-cool-s2"] is None
    assert fates["mlp-hot-s1"] is not None and fates["mlp-hot-s2"] is not None
    assert fh.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    group = summary["mlp"]
    assert group["diverging"] == ["mlp-hot-s1", "mlp-hot-s2"]
    assert group["first_divergence"] == min(fates["mlp-hot-s1"], fates["mlp-hot-s2"])
    assert set(group["signals"]) == {key for key, _, _ in fh.SIGNALS}
    # a learning rate 60 times larger: its updates pass half an ulp of bfloat16 more often, so
    # the half-ulp rule predicts less of the weights frozen, from the checkpoint at step 4 on
    # (0.334 and 0.337 against 0.345 and 0.353 at step 6: a gap of hundreds of coordinates,
    # far more than a float32 kernel's last bit could move)
    frozen = group["signals"]["predicted_frozen_share"]
    assert (frozen["direction"], frozen["from_step"], frozen["lead"]) == ("lower", 4, 3)
    assert max(frozen["last_diverging"]) < min(frozen["last_other"]) - 0.005
    assert (tmp_path / "health.png").stat().st_size > 10_000
