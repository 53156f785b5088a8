"""docs/findings.md, "Does the advisor's hybrid train?": examples/findings.sh's part advise at
tiny size (a one-block transformer, a few steps): drift advise and its two controls on an early
checkpoint, a run per policy, and examples/findings_advise.py's summary and table of them."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_train
from test_train import drift

from driftcli.arith.policy import policy_from_toml
from driftcli.io.tables import read_table

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "findings_advise.py"
text = test_train.text
TF = ["--model", "transformer", "--activation", "tanh", "--layers", "1", "--d-model", "16",
      "--heads", "2", "--context", "8", "--batch", "4", "--diverge-factor", "2", "--log-every",
      "0", "--eval-every", "0", "--threads", "1", "-q"]


fa = SimpleNamespace(**runpy.run_path(str(SCRIPT), run_name="findings_advise"))


@pytest.mark.slow
def test_the_advise_part_at_tiny_size(text: Path, tmp_path: Path) -> None:
    # the cast alone at two seeds (seed 0's step-2 checkpoint is advised on)
    for seed in (0, 1):
        code, _, err = drift("train", *TF, "--policy", "mxfp8_e4m3", "--lr", "0.003", "--steps",
                             "4", "--seed", str(seed), "--checkpoint-every", "2", "--text",
                             text, "--out", tmp_path / f"mxfp8-s{seed}")
        assert code == 0, err
    checkpoint = tmp_path / "mxfp8-s0" / "step-000002.safetensors"
    for name, extra in (("advised", []), ("last", ["--choose", "last"]),
                        ("random-1", ["--choose", "random", "--choose-seed", "1"])):
        code, _, err = drift("advise", checkpoint, "-c", "mxfp8_e4m3", "--budget", "0.3",
                             "--text", text, "--tokens", "8", "--windows", "2", "--batches", "2",
                             "--out", tmp_path / name, "-q", *extra)
        assert code == 0, err
        code, _, err = drift("train", *TF, "--policy", tmp_path / name / "advise.toml",
                             "--lr", "0.003", "--steps", "4", "--seed", "0", "--text", text,
                             "--out", tmp_path / f"{name}-s0")
        assert code == 0, err
    assert fa.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    assert set(summary["choices"]) == {"advised", "last", "random-1"}
    assert set(summary["runs"]) == {"mxfp8", "advised", "last", "random-1"}
    for name, c in summary["choices"].items():
        table, _ = read_table(tmp_path / name / "advise.parquet")
        kept = set(table[table["kept"]]["layer"])
        # the outermost kept layers: each one's overrides are in the policy the run trained
        assert c["kept"] and set(c["kept"]) <= kept and 0 < c["kept_share"] <= 0.3
        assert all(any(k.startswith(o + ".") for o in c["kept"]) for k in kept - set(c["kept"]))
        policy = policy_from_toml(tmp_path / name / "advise.toml")
        assert [o.modules for o in policy.overrides] != [] and all(
            policy.override(k) is not None for k in c["kept"])
        run = summary["runs"][name]["0"]
        assert run["diverged_at"] is None and run["steps_done"] == 4
        assert run["final_val_loss"] is not None
        assert "override" in run["policy_spec"]
    assert summary["choices"]["last"]["choose"] == "last"
    # last first: the head (over half the work) does not fit in 0.3, the MLP's two maps do
    assert summary["choices"]["last"]["kept"] == ["blocks.0.mlp.fc", "blocks.0.mlp.out"]
    rows = fa.table(summary).splitlines()
    # the cast alone, the advice, then its controls
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| mxfp8", "| advised", "| last",
                                                     "| random-1"]
    mx = rows[2]
    assert "| none | 0 |" in mx
    assert f"{summary['runs']['mxfp8']['1']['final_val_loss']:.3f}" in mx
    advised = next(r for r in rows if r.startswith("| advised |"))
    assert f"{summary['runs']['advised']['0']['final_val_loss']:.3f}" in advised
    assert "not run" in advised  # seed 1 was run only for the cast alone
    # a run that diverged shows its step, not a loss
    assert fa.cell({"diverged_at": 501, "final_val_loss": 5.5}) == "**501**"
