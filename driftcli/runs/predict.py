"""Does a signal warn of a divergence? Per-step signals of training runs, a rule per signal fit
on one half of the runs, judged on the other.

A **signal table** has a row per (run, step) and a column per signal, null where the step did
not measure it (``run`` and ``step`` are the keys). :func:`run_signals` reads one from a
``drift train`` folder: the loss over its running minimum (the plain loss-spike baseline, the
divergence rule's own quantity), the gradient and update norms over their trailing means, the
operand clip and underflow rates per role of the logged steps, and a transformer's attention
probes per layer (``blocks.0.attn/logit_max``).

A **rule** is a direction, a threshold and a window: it fires at every step ``t ≥ start``,
before the run's divergence, where the mean of the signal's last ``window`` measured values is
at or above the threshold (``above``) or at or below it (``below``). With a **horizon** ``H``,
a run that diverges at step ``d`` has a *warning stretch*, its steps from ``d − H`` on, and
every other judged step is *quiet* (all of a run that does not diverge; without a horizon a
diverging run is all warning). A rule that fires in a run's warning stretch is a **hit**, its
**lead** ``d`` minus the first step it fires there; one that fires in a run's quiet stretch is
a **false alarm**: a rule that fires 500 steps ahead of every divergence of a learning rate
that diverges is a false alarm there under a horizon of 100. Hit rate is over the diverging
runs, false-alarm rate over the runs with a quiet stretch. :func:`fit_rule` chooses a signal's
rule on the *fit* runs alone: the best hit rate minus false-alarm rate (Youden's J) first,
then the longest mean lead, then the shortest window; thresholds are tried halfway between
the observed values, and of those that tie the middle one is kept. A best J of 0 or less is no
rule. :func:`evaluate` fits every signal on the fit runs and judges the rule on the held-out
runs, which play no part in choosing it.

Everything here reads tables; nothing trains or measures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np
import pandas as pd

from driftcli.errors import DriftError
from driftcli.io.tables import read_table

KEYS = ("run", "step")
BASELINE = "loss_spike"
"""The plain loss-spike baseline: a step's loss over the lowest loss before it."""
RATE_COLUMNS = tuple(f"{kind}_{role}" for kind in ("clip_rate", "underflow_rate")
                     for role in ("activation", "weight", "gradient"))
ATTENTION_COLUMNS = ("logit_max", "p_mass_high", "p_clip_rate", "p_underflow_rate",
                     "dy_pv_clip_rate", "dy_pv_underflow_rate", "dy_qk_clip_rate",
                     "dy_qk_underflow_rate")


class PredictError(DriftError, ValueError):
    """A signal table, split or run folder the study cannot use."""


class Direction(StrEnum):
    """Which side of the threshold fires a rule."""

    ABOVE = "above"
    BELOW = "below"


@dataclass(frozen=True)
class Rule:
    """When a signal fires: the mean of its last ``window`` measured values at or beyond
    ``threshold`` on the ``direction`` side."""

    signal: str
    direction: Direction
    threshold: float
    window: int


@dataclass(frozen=True)
class Outcome:
    """A rule's record on a set of runs."""

    hits: int
    diverging: int
    false_alarms: int
    quiet: int
    """Runs with a quiet stretch (module docs): the false alarms' denominator."""
    leads: tuple[int, ...]
    """The lead (divergence step minus first alarm in the warning stretch) of each hit, in the
    runs' order."""

    @property
    def score(self) -> float:
        """Hit rate minus false-alarm rate (Youden's J); a side with no runs counts 0."""
        return self.hits / max(self.diverging, 1) - self.false_alarms / max(self.quiet, 1)

    @property
    def median_lead(self) -> float | None:
        """The median lead of the hits; None without a hit."""
        return float(np.median(self.leads)) if self.leads else None


@dataclass(frozen=True)
class Judgement:
    """One signal: its rule, fit on the fit runs, and its record there and held out."""

    signal: str
    rule: Rule | None
    """None where no rule beats chance on the fit runs (best J ≤ 0)."""
    fit: Outcome | None
    held_out: Outcome | None


# --- the signals of a run ------------------------------------------------------------------

def run_signals(run: str | Path, *, mean_steps: int = 50) -> tuple[pd.DataFrame, int | None]:
    """The signal table of a ``drift train`` folder and the step it diverged at (None: it did
    not). ``mean_steps`` is the trailing window of the norms' running means (a step's norm over
    the mean of the ``mean_steps`` steps before it; null until there are that many)."""
    folder = Path(run)
    table_path = folder / "train.parquet"
    if not table_path.is_file():
        raise PredictError(f"{folder}: no train.parquet; give a drift train run folder")
    train, _ = read_table(table_path)
    summary = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    diverged_at = summary.get("diverged_at")
    train = train.sort_values("step").reset_index(drop=True)
    out = pd.DataFrame({"run": folder.name, "step": train["step"].astype(int)})
    loss = train["loss"].astype(float)
    out[BASELINE] = loss / loss.cummin().shift(1)
    for name in ("grad_norm", "update_norm"):
        values = train[name].astype(float)
        mean = values.shift(1).rolling(mean_steps, min_periods=mean_steps).mean()
        out[f"{name}_ratio"] = values / mean
    for name in RATE_COLUMNS:
        out[name] = train[name].astype(float)
    attention_path = folder / "attention.parquet"
    if attention_path.is_file():
        att, _ = read_table(attention_path)
        casts = att["cast"].unique()
        for (layer, cast), rows in att.groupby(["layer", "cast"], sort=True):
            suffix = "" if len(casts) == 1 else f" ({cast})"
            by_step = rows.set_index("step")
            for name in ATTENTION_COLUMNS:
                out[f"{layer}/{name}{suffix}"] = out["step"].map(by_step[name].astype(float))
    return out, diverged_at


# --- rules ---------------------------------------------------------------------------------

def _series(signals: pd.DataFrame, run: str, signal: str, diverged_at: int | None,
            start: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The run's steps from ``start`` and before its divergence, and the signal's mean over
    its last ``window`` measured values there (the window may reach back before ``start``)."""
    rows = signals.loc[signals["run"] == run, ["step", signal]].dropna()
    rows = rows.sort_values("step")
    if diverged_at is not None:
        rows = rows[rows["step"] < diverged_at]
    smooth = rows[signal].astype(float).rolling(window, min_periods=window).mean()
    keep = (rows["step"] >= start).to_numpy() & smooth.notna().to_numpy()
    return rows["step"].to_numpy()[keep], smooth.to_numpy()[keep]


def first_alarm(steps: np.ndarray, values: np.ndarray, direction: Direction,
                threshold: float) -> int | None:
    """The first step whose value is at or beyond ``threshold``; None if none is."""
    fired = values >= threshold if direction is Direction.ABOVE else values <= threshold
    hit = np.flatnonzero(fired)
    return int(steps[hit[0]]) if hit.size else None


@dataclass(frozen=True)
class _Stretch:
    """Consecutive judged steps of a run, with running extremes for fast first alarms."""

    steps: np.ndarray
    top: np.ndarray
    """The running maximum (non-decreasing): the first alarm above θ is where it reaches θ."""
    neg_bottom: np.ndarray
    """Minus the running minimum (non-decreasing): likewise below θ."""

    @classmethod
    def of(cls, steps: np.ndarray, values: np.ndarray) -> _Stretch:
        if not values.size:
            return cls(steps, values, values)
        return cls(steps, np.maximum.accumulate(values), -np.minimum.accumulate(values))

    def first(self, direction: Direction, thresholds: np.ndarray) -> np.ndarray:
        """Per threshold, the index of the first step that fires (``len(steps)``: none)."""
        if direction is Direction.ABOVE:
            return np.searchsorted(self.top, thresholds, side="left")
        return np.searchsorted(self.neg_bottom, -thresholds, side="left")


@dataclass(frozen=True)
class _Prepared:
    """One run's series under one window, split into its quiet and warning stretches."""

    diverged_at: int | None
    quiet: _Stretch | None
    """None where the run has no quiet stretch."""
    warning: _Stretch | None
    """None where the run does not diverge."""
    values: np.ndarray

    @classmethod
    def of(cls, steps: np.ndarray, values: np.ndarray, diverged_at: int | None,
           horizon: int | None, start: int) -> _Prepared:
        if diverged_at is None:
            return cls(None, _Stretch.of(steps, values), None, values)
        warn_from = start if horizon is None else max(start, diverged_at - horizon)
        early = steps < warn_from
        quiet = _Stretch.of(steps[early], values[early]) if warn_from > start else None
        return cls(diverged_at, quiet, _Stretch.of(steps[~early], values[~early]), values)

    def record(self, direction: Direction, thresholds: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per threshold: whether it hits, whether it false-alarms, and the hit's lead."""
        false = np.zeros(thresholds.size, dtype=bool)
        hit = np.zeros(thresholds.size, dtype=bool)
        lead = np.zeros(thresholds.size)
        if self.quiet is not None:
            false = self.quiet.first(direction, thresholds) < self.quiet.steps.size
        if self.warning is not None and self.diverged_at is not None and self.warning.steps.size:
            index = self.warning.first(direction, thresholds)
            hit = index < self.warning.steps.size
            alarm = self.warning.steps[np.minimum(index, self.warning.steps.size - 1)]
            lead = np.where(hit, self.diverged_at - alarm, 0)
        return hit, false, lead


def _prepare(signals: pd.DataFrame, signal: str, diverged: Mapping[str, int | None],
             runs: Sequence[str], start: int, window: int,
             horizon: int | None) -> list[_Prepared]:
    return [_Prepared.of(*_series(signals, run, signal, diverged[run], start, window),
                         diverged[run], horizon, start) for run in runs]


def judge(rule: Rule, signals: pd.DataFrame, diverged: Mapping[str, int | None],
          runs: Sequence[str], *, start: int = 50, horizon: int | None = None) -> Outcome:
    """``rule``'s hits, false alarms and leads on ``runs`` (module docs)."""
    hits = false_alarms = n_div = n_quiet = 0
    leads: list[int] = []
    threshold = np.array([rule.threshold])
    for run in _prepare(signals, rule.signal, diverged, runs, start, rule.window, horizon):
        hit, false, lead = run.record(rule.direction, threshold)
        n_div += run.diverged_at is not None
        n_quiet += run.quiet is not None
        false_alarms += bool(false[0])
        if hit[0]:
            hits += 1
            leads.append(int(lead[0]))
    return Outcome(hits, n_div, false_alarms, n_quiet, tuple(leads))


def alarm_steps(rule: Rule, signals: pd.DataFrame, diverged: Mapping[str, int | None],
                runs: Sequence[str], *, start: int = 50) -> dict[str, int | None]:
    """Per run, the first step ``rule`` fires at (from ``start``, before a divergence), or
    None."""
    out = {}
    for run in runs:
        steps, values = _series(signals, run, rule.signal, diverged[run], start, rule.window)
        out[run] = first_alarm(steps, values, rule.direction, rule.threshold)
    return out


def _candidates(values: np.ndarray) -> np.ndarray:
    """Thresholds halfway between consecutive distinct values, and one past each end."""
    distinct = np.unique(values[np.isfinite(values)])
    if distinct.size == 0:
        return distinct
    mids = (distinct[1:] + distinct[:-1]) / 2
    pad = max(1.0, float(np.abs(distinct).max())) * 1e-9
    return np.concatenate([[distinct[0] - pad], mids, [distinct[-1] + pad]])


def fit_rule(signal: str, signals: pd.DataFrame, diverged: Mapping[str, int | None],
             runs: Sequence[str], *, windows: Sequence[int] = (1, 3, 10), start: int = 50,
             horizon: int | None = None) -> tuple[Rule, Outcome] | None:
    """The best rule for ``signal`` on ``runs`` alone (module docs), with its record there;
    None where no rule has a hit rate above its false-alarm rate."""
    best: tuple[tuple[float, float, int], Rule] | None = None
    for window in windows:
        prepared = _prepare(signals, signal, diverged, runs, start, window, horizon)
        thresholds = _candidates(np.concatenate([p.values for p in prepared] or [np.empty(0)]))
        if thresholds.size == 0:
            continue
        n_div = sum(p.diverged_at is not None for p in prepared)
        n_quiet = sum(p.quiet is not None for p in prepared)
        for direction in Direction:
            # every threshold at once: the running extremes are sorted
            hits = np.zeros(thresholds.size)
            false_alarms = np.zeros(thresholds.size)
            lead_sum = np.zeros(thresholds.size)
            for run in prepared:
                hit, false, lead = run.record(direction, thresholds)
                hits += hit
                false_alarms += false
                lead_sum += lead
            score = hits / max(n_div, 1) - false_alarms / max(n_quiet, 1)
            mean_lead = np.where(hits > 0, lead_sum / np.maximum(hits, 1), -math.inf)
            # the best score, then the longest mean lead; of the thresholds that tie, the
            # middle one (furthest from both ends of the tied range)
            top = np.flatnonzero(score == score.max())
            top = top[mean_lead[top] == mean_lead[top].max()]
            i = int(top[top.size // 2])
            key = (float(score[i]), float(mean_lead[i]), -window)
            if best is None or key > best[0]:
                best = (key, Rule(signal, direction, float(thresholds[i]), window))
    if best is None or best[0][0] <= 0:
        return None
    rule = best[1]
    return rule, judge(rule, signals, diverged, runs, start=start, horizon=horizon)


def evaluate(signals: pd.DataFrame, diverged: Mapping[str, int | None], fit: Sequence[str],
             held_out: Sequence[str], *, windows: Sequence[int] = (1, 3, 10),
             start: int = 50, horizon: int | None = None) -> list[Judgement]:
    """Per signal column of ``signals``: the rule fit on the ``fit`` runs alone and its record
    there and on the ``held_out`` runs (the baseline first, then the columns' order).
    ``diverged`` maps every run to its divergence step or None."""
    overlap = sorted(set(fit) & set(held_out))
    if overlap:
        raise PredictError(f"runs both fit and held out: {', '.join(overlap)}; a held-out run "
                           "must play no part in fitting the rules")
    missing = sorted({*fit, *held_out} - set(diverged))
    if missing:
        raise PredictError(f"no divergence step given for {', '.join(missing)}")
    absent = sorted({*fit, *held_out} - set(signals["run"].unique()))
    if absent:
        raise PredictError(f"runs not in the signal table: {', '.join(absent)}")
    names = [c for c in signals.columns if c not in KEYS]
    names.sort(key=lambda c: c != BASELINE)
    out = []
    for name in names:
        found = fit_rule(name, signals, diverged, fit, windows=windows, start=start,
                         horizon=horizon)
        if found is None:
            out.append(Judgement(name, None, None, None))
            continue
        rule, fit_outcome = found
        out.append(Judgement(name, rule, fit_outcome,
                             judge(rule, signals, diverged, held_out, start=start,
                                   horizon=horizon)))
    return out
