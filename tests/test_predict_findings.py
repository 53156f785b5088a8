"""docs/findings.md, "Which signal warns before a divergence?": the study's script
(examples/findings_predict.py) re-run at tiny size on runs made here, and the doc's tables
re-derived from the committed signal tables of the real runs (docs/findings/predict-signals.parquet)
with driftcli.runs.predict."""

from __future__ import annotations

import importlib
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
    """examples/findings_predict.py as a module (examples/ is no package)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(SCRIPT.stem)
    finally:
        sys.path.remove(str(SCRIPT.parent))


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
    assert fp.runs_lines("mlp", group)[2:] == [
        f"| 0.6 | — | {fates['mlp-lr0.6-s1']} | — | — |",
        f"| 0.7 | — | — | {fates['mlp-lr0.7-s2']} | {fates['mlp-lr0.7-s3']} |"]
    lines = fp.table_lines(group)
    assert len(lines) == 2 + len(group["horizons"]["5"])
    assert lines[0].startswith("| signal | within 5 steps: rule |")
    assert lines[2].startswith("| `loss_spike` (baseline) |")


def missing_lines(doc: str, lines: list[str]) -> list[str]:
    """The lines of ``lines`` that ``doc`` does not hold verbatim."""
    held = set(doc.splitlines())
    return [line for line in lines if line not in held]


def test_the_docs_tables_are_the_committed_runs_study() -> None:
    """Every table line of the section is what the study gives on the committed signal tables
    of the 32 runs (examples/findings.sh predict wrote them; nothing is trained here), and the
    runs' divergence steps the section quotes are theirs."""
    signals, diverged = fp.read_signals(SIGNALS)
    summary = fp.study(signals, diverged)
    doc = DOC.read_text(encoding="utf-8")
    section = doc.split("## Which signal warns before a divergence?")[1].split("\n## ")[0]
    for name, group in summary.items():
        lines = fp.table_lines(group)
        assert not missing_lines(section, lines), (name, missing_lines(section, lines))
        assert not missing_lines(section, fp.runs_lines(name, group))
    # the verdict's count: operand and attention signals (not the loss and the norms) that
    # catch every held-out transformer divergence at any time with at most 2 false alarms
    caught = [s["held_out"] for s in summary["tf"]["horizons"]["None"]
              if not s["signal"].endswith(("loss_spike", "norm_ratio"))]
    good = [h for h in caught if h and h["hits"] == h["diverging"] and h["false_alarms"] <= 2]
    leads = [lead for h in good for lead in h["leads"]]
    assert (f"{len(good)} of the {len(caught)} operand and attention signals catch every "
            f"held-out transformer divergence with at most 2 false alarms of 5, with leads of "
            f"{min(leads)} to {max(leads)} steps") in " ".join(section.split())
    for name, group in summary.items():
        assert not missing_lines(section, fp.alarms_lines(name, group, signals, diverged))
    # the checker catches a planted change of one number
    planted = section.replace("| `loss_spike` (baseline) | ≥ ", "| `loss_spike` (baseline) | ≥ 9")
    assert missing_lines(planted, fp.table_lines(summary["tf"]))
