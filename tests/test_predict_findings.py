"""docs/findings.md, "Which signal warns before a divergence?": the study's script
(examples/findings_predict.py) re-run at tiny size on runs made here, and the doc's tables
re-derived from the committed signal tables of the real runs (docs/findings/predict-signals.parquet)
with driftcli.runs.predict."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import test_train

from driftcli.models import MLPConfig
from driftcli.runs import TrainConfig, train
from driftcli.runs.predict import BASELINE, Direction, Rule, judge

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "findings_predict.py"
DOC = ROOT / "docs" / "findings.md"
SIGNALS = ROOT / "docs" / "findings" / "predict-signals.parquet"
text = test_train.text


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("findings_predict", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["findings_predict"] = module
    spec.loader.exec_module(module)
    return module


fp = _script()


@pytest.mark.slow
def test_the_study_at_tiny_size(text: Path, tmp_path: Path) -> None:
    """Eight tiny MLP runs under mxfp4_e2m1 (both backward operands cast), lr 0.6 and 0.7,
    seeds 0-3, 60 steps, operands logged every 2 steps: on this text lr 0.6 diverges at seed 1
    only and lr 0.7 at seeds 2 and 3, so both halves hold both outcomes."""
    fates = {}
    for lr in (0.6, 0.7):
        for seed in range(4):
            name = f"mlp-lr{lr}-s{seed}"
            config = TrainConfig(MLPConfig(context=8, hidden=16, layers=1), policy="mxfp4_e2m1",
                                 steps=60, batch=8, lr=lr, seed=seed, log_every=2,
                                 eval_every=0, diverge_factor=2.0)
            fates[name] = train(config, tmp_path / name, text).diverged_at
    diverging = sorted(name for name, step in fates.items() if step is not None)
    assert diverging == ["mlp-lr0.6-s1", "mlp-lr0.7-s2", "mlp-lr0.7-s3"], fates
    assert fp.main([str(tmp_path)], start=2, mean_steps=3, horizons=(5, None)) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    group = summary["mlp"]
    assert group["runs"] == fates
    assert group["fit"] == ["mlp-lr0.6-s0", "mlp-lr0.6-s1", "mlp-lr0.7-s0", "mlp-lr0.7-s1"]
    assert group["held_out"] == ["mlp-lr0.6-s2", "mlp-lr0.6-s3", "mlp-lr0.7-s2",
                                 "mlp-lr0.7-s3"]
    assert list(group["horizons"]) == ["5", "None"]
    # the signal table written beside, read back, gives the same study (the doc test's path)
    signals, diverged = fp.read_signals(tmp_path / "signals.parquet")
    assert diverged == fates
    assert fp.study(signals, diverged, start=2, horizons=(5, None)) == summary
    # held out: lr 0.7's seeds 2 and 3 diverge, at steps 8 and 48 on this text; within 5
    # steps, both keep a quiet stretch before their warning (from step 2, the start, to 3 and
    # to 43), so all 4 runs can false-alarm; at any time, only the 2 that survive
    quiet = {"5": 4, "None": 2}
    for key, judged in group["horizons"].items():
        names = [s["signal"] for s in judged]
        assert names[0] == BASELINE and "grad_norm_ratio" in names
        assert "clip_rate_gradient" in names
        ruled = [s for s in judged if s["rule"] is not None]
        assert ruled, f"no signal beat chance on the fit half (horizon {key})"
        horizon = None if key == "None" else int(key)
        for s in ruled:
            fit, held, rule = s["fit"], s["held_out"], s["rule"]
            assert fit["hits"] / fit["diverging"] > fit["false_alarms"] / max(fit["quiet"], 1)
            assert (held["diverging"], held["quiet"]) == (2, quiet[key])
            # the held-out record is the rule judged on the held-out runs alone
            again = judge(Rule(s["signal"], Direction(rule["direction"]), rule["threshold"],
                               rule["window"]), signals, diverged, group["held_out"], start=2,
                          horizon=horizon)
            assert (again.hits, again.false_alarms, list(again.leads)) == (
                held["hits"], held["false_alarms"], held["leads"])
            assert all(0 < lead <= (horizon or 60) for lead in held["leads"])
    lines = fp.table_lines(group)
    assert len(lines) == 2 + len(group["horizons"]["5"])
    assert lines[0].startswith("| signal | within 5 steps: rule |")
    assert lines[2].startswith("| `loss_spike` (baseline) |")
