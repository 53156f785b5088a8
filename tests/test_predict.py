"""driftcli.runs.predict: the early-warning rules on planted series (a rise k steps before a
planted divergence has lead k, a firing in a run that survives is a false alarm, the rule is fit
on the fit runs alone, a leak of the held-out runs into fitting is caught), and the signals of
a real run folder."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import test_train

from driftcli.models import MLPConfig, TransformerConfig
from driftcli.runs import TrainConfig, train
from driftcli.runs.predict import (
    BASELINE,
    Direction,
    Judgement,
    PredictError,
    Rule,
    evaluate,
    fit_rule,
    judge,
    run_signals,
)

text = test_train.text


def _run(name: str, steps: int, rise_at: int | None = None, level: float = 1.0,
         spikes: Sequence[int] = (), base: float = 0.0) -> pd.DataFrame:
    """A run's signal ``x``: ``base`` until ``rise_at``, ``level`` from there, 5 at ``spikes``."""
    step = np.arange(1, steps + 1)
    x = np.full(steps, base)
    if rise_at is not None:
        x[step >= rise_at] = level
    x[np.isin(step, spikes)] = 5.0
    return pd.DataFrame({"run": name, "step": step, "x": x})


def _table(*runs: pd.DataFrame) -> pd.DataFrame:
    return pd.concat(runs, ignore_index=True)


def test_a_rise_k_steps_before_the_divergence_has_lead_k() -> None:
    # fit: d1 rises 20 steps before its divergence at 200, s1 stays flat
    # held out: d2 rises 35 steps before 250; d3 never rises (a miss); s2 stays flat
    signals = _table(_run("d1", 199, 180), _run("s1", 400), _run("d2", 249, 215),
                     _run("d3", 299), _run("s2", 400))
    diverged = {"d1": 200, "s1": None, "d2": 250, "d3": 300, "s2": None}
    [j] = evaluate(signals, diverged, ["d1", "s1"], ["d2", "d3", "s2"])
    assert j.rule == Rule("x", Direction.ABOVE, 0.5, 1)
    assert j.fit is not None and (j.fit.hits, j.fit.false_alarms, j.fit.leads) == (1, 0, (20,))
    assert j.held_out is not None
    assert (j.held_out.hits, j.held_out.diverging, j.held_out.leads) == (1, 2, (35,))
    assert (j.held_out.false_alarms, j.held_out.quiet) == (0, 1)
    assert j.held_out.median_lead == 35


def test_steps_at_or_after_the_divergence_and_before_start_do_not_count() -> None:
    # the table holds the diverged step's own value (drift train logs the step it stops at):
    # a rise there is the divergence, not a warning; a rise before start is not judged
    signals = _table(_run("d", 200, 200), _run("e", 200, 10))
    rule = Rule("x", Direction.ABOVE, 0.5, 1)
    out = judge(rule, signals, {"d": 200, "e": 200}, ["d", "e"], start=50)
    # e's value stays 1 from step 10, so it fires at start (50): lead 150
    assert (out.hits, out.leads) == (1, (150,))


def test_a_firing_in_a_surviving_run_is_a_false_alarm() -> None:
    signals = _table(_run("d1", 199, 180), _run("s1", 400), _run("s2", 400, spikes=[300]))
    diverged = {"d1": 200, "s1": None, "s2": None}
    rule = Rule("x", Direction.ABOVE, 0.5, 1)
    out = judge(rule, signals, diverged, ["d1", "s1", "s2"])
    assert (out.hits, out.false_alarms, out.quiet) == (1, 1, 2)
    # a mean over 3 values of one spike of 5 is 5/3: still above 0.5
    assert judge(Rule("x", Direction.ABOVE, 0.5, 3), signals, diverged, ["s2"]).false_alarms == 1
    # above 2 it takes the rise, held for 3 steps, not the spike (mean 5/3)
    assert judge(Rule("x", Direction.ABOVE, 2.0, 3), signals, diverged, ["s2"]).false_alarms == 0


def test_under_a_horizon_an_alarm_long_before_the_divergence_is_false() -> None:
    # d1 is high from step 60 (a run that "looks like" a diverging learning rate from the
    # start) and higher still 30 steps before its divergence at 400; s1 stays flat
    high = _run("d1", 399, 60, level=1.0)
    high.loc[high["step"] >= 370, "x"] = 3.0
    signals = _table(high, _run("s1", 400))
    diverged = {"d1": 400, "s1": None}
    low = Rule("x", Direction.ABOVE, 0.5, 1)
    # without a horizon: a hit, 340 steps ahead
    out = judge(low, signals, diverged, ["d1", "s1"])
    assert (out.hits, out.false_alarms, out.quiet, out.leads) == (1, 0, 1, (340,))
    # within 100 steps: still a hit (it fires in the warning stretch, from step 300) but a
    # false alarm too (it fired in the quiet stretch before), and both runs have a quiet stretch
    out = judge(low, signals, diverged, ["d1", "s1"], horizon=100)
    assert (out.hits, out.false_alarms, out.quiet, out.leads) == (1, 1, 2, (100,))
    # the rule fit under the horizon takes the late rise only: 30 steps ahead, no false alarm
    found = fit_rule("x", signals, diverged, ["d1", "s1"], horizon=100)
    assert found is not None
    assert 1.0 < found[0].threshold <= 3.0
    assert (found[1].hits, found[1].false_alarms, found[1].leads) == (1, 0, (30,))
    # a divergence closer to start than the horizon leaves its run no quiet stretch
    assert judge(low, signals, {"d1": 120, "s1": None}, ["d1"], horizon=100).quiet == 0


def test_the_window_is_fit_to_ignore_a_one_step_spike() -> None:
    # the surviving fit run has a one-step spike higher than the diverging runs' rise: with
    # window 1 any threshold that catches the rise also fires on the spike; a mean over 3
    # values of a sustained rise to 4 is 4, of the spike 5/3
    signals = _table(_run("d1", 199, 170, level=4.0), _run("d2", 199, 160, level=4.0),
                     _run("s1", 400, spikes=[120]))
    diverged = {"d1": 200, "d2": 200, "s1": None}
    found = fit_rule("x", signals, diverged, ["d1", "d2", "s1"], windows=(1, 3))
    assert found is not None
    rule, outcome = found
    assert rule.window == 3 and rule.direction is Direction.ABOVE
    # halfway between the spike's mean (5/3) and the rise's second mean (8/3): the rise fires
    # on its second step, 29 and 39 steps ahead
    assert rule.threshold == pytest.approx(13 / 6)
    assert (outcome.hits, outcome.false_alarms, outcome.leads) == (2, 0, (29, 39))


def test_a_falling_signal_is_fit_below() -> None:
    signals = _table(_run("d1", 199, 150, level=-1.0, base=1.0), _run("s1", 400, base=1.0))
    found = fit_rule("x", signals, {"d1": 200, "s1": None}, ["d1", "s1"])
    assert found is not None and found[0].direction is Direction.BELOW
    assert found[1].leads == (50,)


def test_a_signal_that_separates_nothing_has_no_rule() -> None:
    # the same rise in the run that survives as in the one that diverges: J is 0 at best
    signals = _table(_run("d1", 199, 150), _run("s1", 400, 150))
    [j] = evaluate(signals, {"d1": 200, "s1": None}, ["d1", "s1"], [])
    assert j == Judgement("x", None, None, None)


def _rule_fit_by(evaluator: Callable[..., list[Judgement]], signals: pd.DataFrame,
                 diverged: Mapping[str, int | None], fit: list[str],
                 held: list[str]) -> list[Rule | None]:
    return [j.rule for j in evaluator(signals, diverged, fit, held)]


def _held_out_plays_no_part(evaluator: Callable[..., list[Judgement]]) -> bool:
    """The checker: the rules an evaluator fits do not move when only the held-out runs'
    values change (here, a held-out diverging run whose rise is far lower than the fit runs'
    and a held-out survivor that spikes)."""
    fit_runs = [_run("d1", 199, 180, level=4.0), _run("s1", 400)]
    diverged = {"d1": 200, "s1": None, "d2": 250, "s2": None}
    quiet = _table(*fit_runs, _run("d2", 249, 215, level=4.0), _run("s2", 400))
    loud = _table(*fit_runs, _run("d2", 249, 215, level=0.5), _run("s2", 400, spikes=[90]))
    return (_rule_fit_by(evaluator, quiet, diverged, ["d1", "s1"], ["d2", "s2"])
            == _rule_fit_by(evaluator, loud, diverged, ["d1", "s1"], ["d2", "s2"]))


def test_the_rule_is_fit_on_the_fit_half_only_and_a_leak_is_caught() -> None:
    assert _held_out_plays_no_part(evaluate)

    def leaky(signals: pd.DataFrame, diverged: Mapping[str, int | None], fit: list[str],
              held: list[str]) -> list[Judgement]:
        # planted fault: the held-out runs join the fitting
        found = fit_rule("x", signals, diverged, [*fit, *held])
        assert found is not None
        return [Judgement("x", found[0], found[1], judge(found[0], signals, diverged, held))]

    assert not _held_out_plays_no_part(leaky)
    # and a run named on both sides is refused
    signals = _table(_run("d1", 199, 180), _run("s1", 400))
    with pytest.raises(PredictError, match="both fit and held out: d1"):
        evaluate(signals, {"d1": 200, "s1": None}, ["d1", "s1"], ["d1"])
    with pytest.raises(PredictError, match="no divergence step given for s1"):
        evaluate(signals, {"d1": 200}, ["d1"], ["s1"])


def test_run_signals_of_a_diverging_mlp_run(text: Path, tmp_path: Path) -> None:
    config = TrainConfig(MLPConfig(context=8, hidden=16, layers=1), policy="mxfp4_e2m1",
                         steps=24, batch=8, lr=0.6, seed=1, log_every=4, eval_every=0,
                         diverge_factor=2.0)
    result = train(config, tmp_path / "mlp-hot-s1", text)
    assert result.diverged_at is not None
    signals, diverged_at = run_signals(tmp_path / "mlp-hot-s1", mean_steps=3)
    assert diverged_at == result.diverged_at
    loss = np.array([r.loss for r in result.rows])
    # the baseline is the divergence rule's quantity: at the diverged step it is above 2
    expected = loss[1:] / np.minimum.accumulate(loss)[:-1]
    np.testing.assert_array_equal(signals[BASELINE].to_numpy()[1:], expected)
    assert signals[BASELINE].iloc[-1] > 2.0
    grad = np.array([np.nan if r.grad_norm is None else r.grad_norm for r in result.rows])
    assert signals["grad_norm_ratio"].iloc[3] == pytest.approx(grad[3] / grad[:3].mean(),
                                                                rel=1e-12)
    logged = signals.dropna(subset=["clip_rate_gradient"])["step"].tolist()
    assert logged == [s for s in (1, 4, 8, 12, 16, 20, 24) if s <= result.diverged_at]
    assert not any(c.startswith("blocks.") for c in signals.columns)


def test_run_signals_of_a_transformer_has_its_attention_per_layer(text: Path,
                                                                   tmp_path: Path) -> None:
    config = TrainConfig(TransformerConfig(d_model=16, layers=2, heads=2, context=8),
                         policy="mxfp8_e4m3", steps=6, batch=4, log_every=3, eval_every=0)
    train(config, tmp_path / "tf", text)
    signals, diverged_at = run_signals(tmp_path / "tf")
    assert diverged_at is None
    for layer in ("blocks.0.attn", "blocks.1.attn"):
        column = signals[f"{layer}/logit_max"]
        assert column.notna().sum() == 3 and (column.dropna() > 0).all()  # steps 1, 3, 6
    with pytest.raises(PredictError, match=r"no train\.parquet"):
        run_signals(tmp_path / "nothing")
