"""Does a signal warn of a divergence, in runs that share their cast? The table of
docs/findings.md's section "Which signal warns before a divergence?", from the runs
examples/findings.sh's part predict trained.

    python examples/findings_predict.py DIR

DIR holds drift train run folders named GROUP-...-sSEED (each with run.json, train.parquet and,
for a transformer, attention.parquet). Runs are grouped by the name before the first dash (tf,
mlp); within a group, the runs of seeds 0 and 1 fit each signal's rule and those of seeds 2 and
3 judge it (driftcli.runs.predict). Writes DIR/signals.parquet (every run's signal table, the
runs' divergence steps in its metadata), DIR/summary.json and prints the tables as they stand
in the doc. Everything here reads tables; nothing trains or measures.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from driftcli.runs.predict import (
    BASELINE,
    Direction,
    Judgement,
    Rule,
    alarm_steps,
    evaluate,
    run_signals,
)

FIT_SEEDS = (0, 1)
HELD_OUT_SEEDS = (2, 3)
START = 50
"""Steps before this are not judged: the loss falls too fast there for a ratio to mean much
(the divergence rule's own check of its factor starts at step 50)."""
MEAN_STEPS = 50
"""The norms' running mean: the 50 steps before."""
WINDOWS = (1, 3, 10)
HORIZONS: tuple[int | None, ...] = (100, None)
"""Each signal's rule is fit and judged twice: a hit must come within 100 steps of the
divergence (an alarm before that is a false alarm), and at any time before it."""
RUNS_KEY = b"drift.predict.runs"
ALARM_SIGNALS = {
    "tf": (BASELINE, "grad_norm_ratio", "clip_rate_activation", "blocks.1.attn/logit_max"),
    "mlp": (BASELINE, "grad_norm_ratio", "clip_rate_activation", "clip_rate_weight"),
}
"""The signals whose first alarms the doc shows run by run (the rules without a horizon)."""


def collect(folder: Path, mean_steps: int = MEAN_STEPS
            ) -> tuple[pd.DataFrame, dict[str, int | None]]:
    """Every run folder's signal table, joined, and each run's divergence step."""
    tables = []
    diverged: dict[str, int | None] = {}
    for run in sorted(p.parent for p in folder.glob("*/run.json")):
        table, step = run_signals(run, mean_steps=mean_steps)
        tables.append(table)
        diverged[run.name] = step
    if not tables:
        raise SystemExit(f"findings_predict: no run folders in {folder}")
    signals = pd.concat(tables, ignore_index=True)
    # float32 (seven digits, more than any rule's threshold needs) halves the committed table
    # docs/findings/predict-signals.parquet; the study runs on these very values
    values = [c for c in signals.columns if c not in ("run", "step")]
    signals[values] = signals[values].astype("float32")
    return signals, diverged


def write_signals(path: Path, signals: pd.DataFrame, diverged: dict[str, int | None]) -> None:
    """The signal table as Parquet, the divergence steps in its metadata."""
    table = pa.Table.from_pandas(signals, preserve_index=False)
    meta = {**(table.schema.metadata or {}), RUNS_KEY: json.dumps(diverged).encode()}
    pq.write_table(table.replace_schema_metadata(meta), path, compression="zstd")


def read_signals(path: Path) -> tuple[pd.DataFrame, dict[str, int | None]]:
    """What :func:`write_signals` wrote."""
    table = pq.read_table(path)
    diverged = json.loads((table.schema.metadata or {})[RUNS_KEY])
    return table.to_pandas(), diverged


def _seed(run: str) -> int:
    found = re.search(r"-s(\d+)$", run)
    if found is None:
        raise SystemExit(f"findings_predict: run {run!r} is not named ...-sSEED")
    return int(found.group(1))


def study(signals: pd.DataFrame, diverged: dict[str, int | None], start: int = START,
          horizons: tuple[int | None, ...] = HORIZONS) -> dict[str, Any]:
    """Per group: its runs, the split, and every signal's rule and records."""
    groups: dict[str, Any] = {}
    for group in sorted({run.split("-")[0] for run in diverged}):
        runs = sorted(r for r in diverged if r.split("-")[0] == group)
        fit = [r for r in runs if _seed(r) in FIT_SEEDS]
        held = [r for r in runs if _seed(r) in HELD_OUT_SEEDS]
        table = signals[signals["run"].isin(runs)].dropna(axis=1, how="all")
        judgements = {}
        for horizon in horizons:
            judged = evaluate(table, diverged, fit, held, windows=WINDOWS, start=start,
                              horizon=horizon)
            judgements[str(horizon)] = [_judgement(j) for j in judged]
        groups[group] = {"runs": {r: diverged[r] for r in runs}, "fit": fit,
                         "held_out": held, "horizons": judgements}
    return groups


def _judgement(j: Judgement) -> dict[str, Any]:
    out: dict[str, Any] = {"signal": j.signal, "rule": None, "fit": None, "held_out": None}
    if j.rule is not None:
        out["rule"] = {**asdict(j.rule), "direction": j.rule.direction.value}
        out["fit"] = {**asdict(j.fit), "leads": list(j.fit.leads)} if j.fit else None
        out["held_out"] = ({**asdict(j.held_out), "leads": list(j.held_out.leads)}
                           if j.held_out else None)
    return out


def _threshold(value: float) -> str:
    return f"{value:.4g}"


def _cells(s: dict[str, Any]) -> list[str]:
    """A judgement's cells: the rule, held-out hits, false alarms and leads."""
    rule = s["rule"]
    if rule is None:
        return ["none beats chance", "", "", ""]
    held = s["held_out"]
    sign = "≥" if rule["direction"] == "above" else "≤"
    window = "" if rule["window"] == 1 else f", mean of {rule['window']}"
    leads = ", ".join(str(v) for v in held["leads"]) or "—"
    return [f"{sign} {_threshold(rule['threshold'])}{window}",
            f"{held['hits']}/{held['diverging']}", f"{held['false_alarms']}/{held['quiet']}",
            leads]


def table_lines(group: dict[str, Any]) -> list[str]:
    """The doc's table of a group, one line per signal (the baseline first): per horizon, the
    rule fit on seeds 0 and 1 and its held-out hits, false alarms and leads."""
    head = ["signal"]
    for horizon in group["horizons"]:
        when = "any time before" if horizon == "None" else f"within {horizon} steps"
        head += [f"{when}: rule", "hits", "false alarms", "lead (steps)"]
    lines = ["| " + " | ".join(head) + " |",
             "| --- |" + " --- | ---: | ---: | --- |" * len(group["horizons"])]
    for judged in zip(*group["horizons"].values(), strict=True):
        signal = judged[0]["signal"]
        cells = [f"`{signal}`" + (" (baseline)" if signal == BASELINE else "")]
        for j in judged:
            cells += _cells(j)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def runs_lines(name: str, group: dict[str, Any]) -> list[str]:
    """The doc's table of a group's runs: the step each diverged at, by learning rate (rows)
    and seed (columns); —: it ran all its steps."""
    by_lr: dict[float, dict[int, int | None]] = {}
    for run, step in group["runs"].items():
        found = re.search(r"-lr([0-9.]+)-s(\d+)$", run)
        if found is None:
            raise SystemExit(f"findings_predict: run {run!r} is not named GROUP-lrLR-sSEED")
        by_lr.setdefault(float(found.group(1)), {})[int(found.group(2))] = step
    seeds = sorted({seed for steps in by_lr.values() for seed in steps})
    lines = [f"| {name}: lr | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "| ---: |" + " ---: |" * len(seeds)]
    for lr in sorted(by_lr):
        cells = [str(by_lr[lr].get(s) or "—") for s in seeds]
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    return lines


def alarms_lines(name: str, group: dict[str, Any], signals: pd.DataFrame,
                 diverged: dict[str, int | None], start: int = START) -> list[str]:
    """The doc's table of first alarms: per held-out run, the step at which each of the
    group's ALARM_SIGNALS first fires under its rule fit without a horizon (—: never)."""
    judged = {j["signal"]: j for j in group["horizons"]["None"]}
    shown = [s for s in ALARM_SIGNALS.get(name, ()) if judged.get(s, {}).get("rule")]
    lines = ["| run | diverged at | " + " | ".join(f"`{s}`" for s in shown) + " |",
             "| --- | ---: |" + " ---: |" * len(shown)]
    for run in group["held_out"]:
        cells = [run, str(diverged[run] or "—")]
        for signal in shown:
            r = judged[signal]["rule"]
            rule = Rule(signal, Direction(r["direction"]), r["threshold"], r["window"])
            step = alarm_steps(rule, signals, diverged, [run], start=start)[run]
            cells.append(str(step or "—"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str], start: int = START, mean_steps: int = MEAN_STEPS,
         horizons: tuple[int | None, ...] = HORIZONS) -> int:
    folder = Path(argv[0])
    signals, diverged = collect(folder, mean_steps)
    write_signals(folder / "signals.parquet", signals, diverged)
    groups = study(signals, diverged, start, horizons)
    (folder / "summary.json").write_text(json.dumps(groups, indent=2) + "\n", encoding="utf-8")
    for name, group in groups.items():
        print("\n".join(runs_lines(name, group)))
        print("\n".join(table_lines(group)))
        print("\n".join(alarms_lines(name, group, signals, diverged, start)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
