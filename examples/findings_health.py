"""Does drift health predict a divergence? The numbers and figure of docs/findings.md's section
"Does drift health predict a divergence?", from the runs examples/findings.sh's part health
trained and the health.parquet tables drift health wrote beside them.

    python examples/findings_health.py DIR

DIR holds run folders named GROUP-...-sSEED (drift train, each with run.json, train.parquet and
health.parquet). Runs are grouped by the name before the first dash (tf, mlp): a group compares
its runs that diverged with those that did not, same model and learning rate, differing only in
the cast. Per signal (a column of the all-parameters rows, or the worst parameter's value), at
every checkpoint the runs share before the group's first divergence, the signal *separates* the
two outcomes when every diverging run lies above every other run (or every one below). The lead
is the group's first divergence step minus the first checkpoint from which it separates at
every later shared checkpoint. Prints the summary, writes DIR/summary.json and draws
DIR/health.png. Everything here reads tables; nothing trains or measures.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

# (key, label, how a run's value at a checkpoint is read off its health table)
SIGNALS: tuple[tuple[str, str, str], ...] = (
    ("frozen_share", "frozen share (bfloat16 view)", "*"),
    ("predicted_frozen_share", "predicted frozen share", "*"),
    ("oscillating_share", "oscillating share (ratio ≥ 16)", "*"),
    ("flips_mean", "code flips per element (window 8)", "*"),
    ("gnr", "gradient-to-noise ratio, all parameters", "*"),
    ("gnr_min", "gradient-to-noise ratio, worst parameter", "min:gnr"),
    ("v_zero_share", "second moments stored as 0 (torchao 8-bit)", "*"),
)


@dataclass(frozen=True)
class Separation:
    """How one signal separates a group's diverging runs from the others."""

    signal: str
    direction: str | None
    """"higher" (diverging runs above every other) or "lower"; None: no lasting separation."""
    from_step: int | None
    """The first shared checkpoint from which it separates at every later one."""
    lead: int | None
    """The group's first divergence step minus from_step."""
    separated_checkpoints: int
    """Shared checkpoints (of ``checkpoints``) at which it separates, either way."""
    checkpoints: int
    """Shared checkpoints before the first divergence with a value in every run."""
    last_diverging: list[float]
    """Each diverging run's value at the last shared checkpoint."""
    last_other: list[float]
    change_diverging: float | None
    """Mean over the diverging runs of the signal's change from the shared checkpoint nearest
    half the horizon to the last one: does it move as the divergence nears?"""
    change_other: float | None


def run_series(folder: Path) -> tuple[int | None, dict[str, dict[int, float]]]:
    """A run's divergence step and each signal's value per checkpoint step."""
    diverged_at = json.loads((folder / "run.json").read_text())["diverged_at"]
    table = pd.read_parquet(folder / "health.parquet")
    series: dict[str, dict[int, float]] = {}
    total = table[table.parameter == "*"]
    parts = table[table.parameter != "*"]
    for key, _, how in SIGNALS:
        if how == "*":
            col = total[["step", key]].dropna()
            series[key] = {int(s): float(v) for s, v in zip(col.step, col[key], strict=True)}
        else:
            column = how.split(":")[1]
            worst = parts[["step", column]].dropna().groupby("step")[column].min()
            series[key] = {int(s): float(v) for s, v in worst.items()}
    return (None if diverged_at is None else int(diverged_at)), series


def separation(signal: str, diverging: list[dict[int, float]], others: list[dict[int, float]],
               horizon: int) -> Separation:
    """The separation of one signal over the checkpoints every run holds before ``horizon``."""
    runs = diverging + others
    steps = sorted(set.intersection(*(set(r) for r in runs)))
    steps = [s for s in steps if s < horizon and all(math.isfinite(r[s]) for r in runs)]

    def side(step: int) -> str | None:
        d, o = [r[step] for r in diverging], [r[step] for r in others]
        if min(d) > max(o):
            return "higher"
        if max(d) < min(o):
            return "lower"
        return None

    sides = [side(s) for s in steps]
    direction = sides[-1] if sides else None
    start = None
    if direction is not None:
        start = len(sides) - 1
        while start > 0 and sides[start - 1] == direction:
            start -= 1
    last = steps[-1] if steps else None
    mid = min(steps, key=lambda s: abs(s - horizon / 2)) if steps else None

    def change(group: list[dict[int, float]]) -> float | None:
        if last is None or mid is None or last == mid:
            return None
        return round(sum(r[last] - r[mid] for r in group) / len(group), 6)

    return Separation(
        signal, direction, None if start is None else steps[start],
        None if start is None else horizon - steps[start], sum(s is not None for s in sides),
        len(steps), [] if last is None else [round(r[last], 6) for r in diverging],
        [] if last is None else [round(r[last], 6) for r in others], change(diverging),
        change(others))


def study(folder: Path) -> dict[str, Any]:
    """Every group's runs, fates and separations (module docs)."""
    groups: dict[str, dict[str, tuple[int | None, dict[str, dict[int, float]]]]] = {}
    for run in sorted(p for p in folder.iterdir() if (p / "health.parquet").is_file()):
        groups.setdefault(run.name.split("-")[0], {})[run.name] = run_series(run)
    out: dict[str, Any] = {}
    for group, runs in groups.items():
        diverging = {n: r for n, r in runs.items() if r[0] is not None}
        others = {n: r for n, r in runs.items() if r[0] is None}
        entry: dict[str, Any] = {
            "diverged_at": {n: r[0] for n, r in runs.items()},
            "diverging": sorted(diverging), "others": sorted(others)}
        if diverging and others:
            horizon = min(r[0] for r in diverging.values() if r[0] is not None)
            entry["first_divergence"] = horizon
            entry["signals"] = {key: asdict(separation(
                key, [r[1][key] for r in diverging.values()],
                [r[1][key] for r in others.values()], horizon)) for key, _, _ in SIGNALS}
        out[group] = entry
    return out


def plot(folder: Path, result: dict[str, Any]) -> Path:
    """Each signal against the step, a row per group: diverging runs red, the others blue,
    each divergence a dotted line."""
    groups = list(result)
    fig, axes = plt.subplots(len(groups), len(SIGNALS), figsize=(3.2 * len(SIGNALS),
                                                                 2.8 * len(groups)),
                             squeeze=False)
    for row, group in enumerate(groups):
        for col, (key, label, _) in enumerate(SIGNALS):
            ax = axes[row][col]
            for name, at in result[group]["diverged_at"].items():
                _, series = run_series(folder / name)
                values = series[key]
                colour = "tab:red" if at is not None else "tab:blue"
                ax.plot(list(values), list(values.values()), color=colour, lw=1, alpha=0.8)
                if at is not None:
                    ax.axvline(at, color="tab:red", ls=":", lw=0.8)
            sep = result[group].get("signals", {}).get(key)
            lead = "" if not sep or sep["lead"] is None else f"\nseparates {sep['lead']} ahead"
            ax.set_title(f"{group}: {label}{lead}", fontsize=7)
            ax.tick_params(labelsize=6)
            if key.startswith("gnr"):
                ax.set_yscale("log")
    fig.tight_layout()
    path = folder / "health.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    folder = Path(argv[0])
    result = study(folder)
    (folder / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(folder, result)
    for group, entry in result.items():
        print(f"{group}: diverged at {entry['diverged_at']}")
        for key, sep in entry.get("signals", {}).items():
            how = ("no lasting separation" if sep["lead"] is None else
                   f"{sep['direction']} from step {sep['from_step']}, {sep['lead']} steps ahead")
            print(f"  {key:24} {how}; separated at {sep['separated_checkpoints']} of "
                  f"{sep['checkpoints']} checkpoints; last: {sep['last_diverging']} against "
                  f"{sep['last_other']}; change since mid-way {sep['change_diverging']} "
                  f"against {sep['change_other']}")
    print(f"wrote {folder / 'summary.json'}, {folder / 'health.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
