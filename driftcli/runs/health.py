"""``health``: signs that a run is failing, per parameter and checkpoint of a run's series.

For a run folder of ``drift train`` (its ``step-NNNNNN.safetensors``, taken in the order of
the step each records, one run's: :func:`driftcli.runs.probe.run_checkpoints`), per trainable
parameter and over all of them (``parameter = "*"``), at every checkpoint after the first:

- **freeze** ("The Silent Freeze"): the share of coordinates whose value in the storage
  format did not change since the previous checkpoint (``frozen_share``: for a run whose
  weights are stored in that format, the exact count of the updates storage lost; the stored
  values are compared, nothing rounded twice), and the share the **half-ulp condition**
  predicts from a high-precision trajectory alone (``predicted_frozen_share``): with ``w``
  the trajectory's weight at the previous checkpoint and ``Δw`` its update per step (the
  difference to this checkpoint over the steps between), whether ``round(w_s + Δw) == w_s``
  with ``w_s`` the weight in storage: :func:`driftcli.runs.probe.update_lost`, the rule
  ``drift probe`` counts its freeze share with. The trajectory is the run's own, or a
  ``reference`` run's (a float32 run of the same settings, against a run stored in
  bfloat16, ``drift train --storage bfloat16``). The storage format is by default the run's
  own when it stores its weights in bfloat16 or float16, else bfloat16
  (:func:`driftcli.runs.probe.freeze_storage`). Per parameter, ``freeze_step`` and
  ``predicted_freeze_step`` are the first steps whose shares reach ``threshold``.
- **gradient-to-noise ratio** ("FP4 All the Way"): ‖g‖ / ‖Q(g) − g‖ of the parameter's
  gradient g under the cast ``grad_cast`` (blocked along the last axis), from drift's own
  backward on the run's probe batch (:func:`driftcli.runs.probe.probe_batch`) at the
  checkpoint's float32 weights; for a stochastic cast the noise is its expectation,
  ``E‖Q(g) − g‖² = Σ (g − lo)(hi − g)`` over the two neighbours of each element under its
  block's scale (ideal stochastic rounding). Flagged (``gnr_low``) below √3.
- **oscillation** (TetraJet): over the last ``window`` intervals between checkpoints, per
  element, the path of the quantized weight Σ|Q(w_{j+1}) − Q(w_j)| against the master
  weight's Σ|w_{j+1} − w_j|, ``cast`` applied to the weight along its last axis; the share
  of elements whose ratio is 16 or more (``oscillating_share``; an element whose quantized
  value moved while the master did not counts), and the mean number of code flips.
- **optimizer state** (``state_layout``): the run's float32 Adam moments under one of
  torchao's or MS-AMP's quantized layouts (:mod:`driftcli.runs.optstate`): second moments
  stored as 0 at every checkpoint; over one-step intervals, the EMA updates that round back
  to the stored value and the cosine of the update the layout takes against the exact one.

The checkpoints run in units of :data:`CHUNK` on an engine (:mod:`driftcli.engines`), each
unit reading the checkpoints before its first that its counts need.

All the sums are float64; the freeze counts are exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from driftcli import engines
from driftcli.casts.quantization import quantize
from driftcli.choices import Storage, parse_choice
from driftcli.engines import Execution
from driftcli.errors import DriftError
from driftcli.io.tables import column
from driftcli.measures.grad_cosine import ALL_PARAMETERS
from driftcli.models.checkpoint import DriftCheckpoint, load_checkpoint, read_info
from driftcli.models.config import CHECKPOINTS
from driftcli.models.nets import next_byte_loss
from driftcli.progress import Progress
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Rounding
from driftcli.runs.optstate import StateCounts, StateLayout, quantized, state_counts
from driftcli.runs.probe import (
    freeze_storage,
    probe_batch,
    probe_corpus,
    run_checkpoints,
    training_settings,
    update_lost,
)
from driftcli.runs.training import deterministic

Tensor = torch.Tensor

HEALTH_FILE = "health.parquet"
GNR_FLOOR = math.sqrt(3)
"""Below this gradient-to-noise ratio quantized training stops helping (Chmiel et al., "FP4
All the Way", 2025, arXiv 2505.19115, abstract and section 4)."""
OSCILLATION_RATIO = 16.0
"""An element oscillates when its quantized weight travels this many times the master
weight's path (TetraJet's ``opt_ramping_alpha``: thu-ml/TetraJet-MXFP4Training at bbe9bd6,
``scripts/Pretrain-TetraJet-Q-Ramping/pretrain-deit_small.sh`` line 10, used in
``quantization/Qoptimizers/Qengine_DeiT.py`` lines 119-127)."""

_DTYPES = {Storage.BFLOAT16: torch.bfloat16, Storage.FLOAT16: torch.float16,
           Storage.FLOAT32: torch.float32}


class HealthError(DriftError, ValueError):
    """A run, reference or health setting that cannot be used."""


@dataclass(frozen=True)
class HealthRow:
    """One parameter (or all of them) at one checkpoint of a run."""

    TABLE: ClassVar[str] = "health"
    KEYS: ClassVar[tuple[str, ...]] = ("run", "step", "parameter")
    HEADLINE: ClassVar[str] = "frozen_share"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    run: str = column("The run folder's name")
    checkpoint: str = column("The checkpoint file")
    step: int = column("The training step of the checkpoint's weights")
    parameter: str = column("Parameter name; * for the row over all parameters together")
    numel: int = column("Elements (all parameters in the * row)")
    storage: str = column("The storage format of the freeze columns")
    steps_between: int | None = column("Steps since the previous checkpoint; null at the first")
    frozen_share: float | None = column(
        "Share of coordinates whose value in storage equals the previous checkpoint's (exact); "
        "null at the first checkpoint")
    predicted_frozen_share: float | None = column(
        "Share the half-ulp condition predicts from the trajectory (the reference run's, else "
        "this run's): the update per step from the previous checkpoint, added exactly to the "
        "weight in storage, rounds back to it; null at the first checkpoint")
    freeze_step: int | None = column(
        "The parameter's first step whose frozen_share reaches the threshold; null if none")
    predicted_freeze_step: int | None = column(
        "The parameter's first step whose predicted_frozen_share reaches the threshold; null "
        "if none")
    threshold: float = column("The share freeze_step and predicted_freeze_step wait for")
    grad_cast: str | None = column("The cast of the gradient-to-noise ratio; null if none")
    grad_norm: float | None = column("‖g‖ on the run's probe batch; null without grad_cast")
    noise_norm: float | None = column(
        "‖Q(g) − g‖ under grad_cast (a stochastic cast: the square root of its expectation)")
    gnr: float | None = column("grad_norm / noise_norm (inf when the cast is exact on g); null "
                               "when g is 0 or without grad_cast")
    gnr_low: bool | None = column("gnr below √3 (FP4 All the Way's threshold)")
    cast: str | None = column("The weights' cast of the oscillation columns; null if none")
    window: int | None = column("Intervals between checkpoints the oscillation columns span "
                                "(fewer at the start of the run); null without cast")
    oscillating_share: float | None = column(
        "Share of elements whose quantized weight's path over the window is 16 times the "
        "master weight's or more (TetraJet's ratio); null at the first checkpoint")
    flips_mean: float | None = column("Mean code changes per element over the window")
    state_layout: str | None = column("The quantized layout of Adam's moments; null if none")
    m_stale_share: float | None = column(
        "Of the exp_avg values the step's float32 EMA moved, the share whose stored value the "
        "layout's update leaves unchanged (one-step intervals, tensors the layout quantizes); "
        "else null")
    v_stale_share: float | None = column("As m_stale_share, for exp_avg_sq")
    v_zero_share: float | None = column(
        "Share of nonzero exp_avg_sq values stored as 0 (every checkpoint with moments)")
    update_cosine: float | None = column(
        "Cosine of the Adam update the layout takes (from the float32 lerp of its stored "
        "moments) against the float32 run's (one-step intervals); else null")


@dataclass(frozen=True)
class HealthSettings:
    """What a health pass measures besides the freeze columns."""

    storage: Storage = Storage.BFLOAT16
    threshold: float = 0.5
    cast: Cast | None = None
    grad_cast: Cast | None = None
    window: int = 8
    windows: int | None = None
    """Windows in the probe batch of the gradient (default: the run's batch)."""
    text: str | None = None
    seed: int = 0
    threads: int = 1
    state_layout: StateLayout | None = None


# --- freeze -------------------------------------------------------------------------------------

def stored(w: Tensor, storage: Storage | str) -> Tensor:
    """``w`` (float32 or narrower) rounded once to nearest even in ``storage``."""
    return w.to(_DTYPES[Storage(storage)])


def frozen(before: Tensor, after: Tensor, storage: Storage | str) -> Tensor:
    """Per coordinate: whether its value in ``storage`` is the same at both checkpoints
    (compared as numbers: −0 = +0, NaN equal to nothing)."""
    return stored(before, storage) == stored(after, storage)


def predicted_frozen(before: Tensor, after: Tensor, steps: int,
                     storage: Storage | str) -> Tensor:
    """Per coordinate: whether the half-ulp condition freezes the trajectory's update per step,
    ``(after − before) / steps``, at ``before`` in ``storage`` (:func:`update_lost`).

    The difference of two float32 values is exact in float64 unless their exponents are 29
    or more apart, where the update is far from any half gap; over one step (``steps = 1``)
    the update is the trajectory's own, over more its mean."""
    if steps < 1:
        raise HealthError(f"checkpoints must be at least one step apart, not {steps}")
    dw = (after.to(torch.float64) - before.to(torch.float64)) / steps
    return update_lost(before, dw, storage)


def first_step(steps: Sequence[int], shares: Sequence[float | None],
               threshold: float) -> int | None:
    """The first step whose share reaches ``threshold``, or None."""
    return next((s for s, v in zip(steps, shares, strict=True)
                 if v is not None and v >= threshold), None)


# --- gradient-to-noise ratio ------------------------------------------------------------------

def gradient_noise(g: Tensor, cast: Cast | str, *, axis: int = -1,
                   seed: int = 0) -> tuple[float, float]:
    """``(‖g‖, ‖Q(g) − g‖)`` under ``cast``, in float64. A stochastic cast's noise is the
    square root of its expectation: each element between its neighbours ``lo ≤ g ≤ hi`` under
    its block's scale (rounded down and up) contributes ``(g − lo)(hi − g)``, the variance of
    unbiased rounding between them, or ``(g − lo)²`` where both are one value (a clip).
    ``seed`` is unused by the expectation and kept for a caller's drawn comparison."""
    c = parse_cast(cast)
    x = g.detach().to(torch.float64)
    norm = math.sqrt(float(x.pow(2).sum()))
    if c.rounding is Rounding.SR:
        lo = _values(x, dataclasses.replace(c, rounding=Rounding.RDOWN), axis)
        hi = _values(x, dataclasses.replace(c, rounding=Rounding.RUP), axis)
        var = torch.where(hi > lo, (x - lo) * (hi - x), (x - lo).pow(2))
        return norm, math.sqrt(float(var.sum()))
    q = _values(x, c, axis, seed)
    return norm, math.sqrt(float((q - x).pow(2).sum()))


def _values(x: Tensor, c: Cast, axis: int, seed: int = 0) -> Tensor:
    out = quantize(x, c, axis=axis, seed=seed)
    if not isinstance(out, Tensor):  # quantize without return_info gives the values
        raise TypeError(f"quantize returned {type(out).__name__}, not a tensor")
    return out


def ratio(norm: float, noise: float) -> float | None:
    """‖g‖ / noise: inf for an exact cast of a nonzero g, None for g = 0 (or not finite)."""
    if not math.isfinite(norm) or not math.isfinite(noise) or norm == 0:
        return None
    return math.inf if noise == 0 else norm / noise


# --- oscillation --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Oscillation:
    """Per element over a window of checkpoints: the paths and code flips."""

    quantized_path: Tensor
    """Σ |Q(w_{j+1}) − Q(w_j)| (float64)."""
    master_path: Tensor
    """Σ |w_{j+1} − w_j| (float64)."""
    flips: Tensor
    """How many intervals changed Q(w) (int64)."""

    def oscillating(self, at: float = OSCILLATION_RATIO) -> Tensor:
        """Elements whose quantized path is ``at`` times the master's or more (an element whose
        code moved while the master did not counts, one whose code never moved does not)."""
        q, m = self.quantized_path, self.master_path
        return (q > 0) & (q >= at * m)


def oscillation(weights: Sequence[Tensor], quantized: Sequence[Tensor]) -> Oscillation:
    """The paths of a weight series and its quantized series (same shapes, in step order)."""
    if len(weights) != len(quantized) or len(weights) < 2:
        raise HealthError("oscillation needs two or more checkpoints, each with its cast")
    shape = weights[0].shape
    qp = torch.zeros(shape, dtype=torch.float64)
    mp = torch.zeros(shape, dtype=torch.float64)
    flips = torch.zeros(shape, dtype=torch.int64)
    for j in range(len(weights) - 1):
        w0, w1 = weights[j].to(torch.float64), weights[j + 1].to(torch.float64)
        q0, q1 = quantized[j].to(torch.float64), quantized[j + 1].to(torch.float64)
        mp += (w1 - w0).abs()
        qp += (q1 - q0).abs()
        flips += (q1 != q0).to(torch.int64)
    return Oscillation(qp, mp, flips)


def weight_cast(w: Tensor, cast: Cast, seed: int = 0) -> Tensor:
    """``w`` under ``cast``, blocked along its last axis (a linear weight ``(out, in)`` is read
    along ``in`` by the forward matmul); a 0-d parameter as one element."""
    x = w.detach().to(torch.float64).reshape(-1) if w.dim() == 0 else w.detach().to(
        torch.float64)
    return _values(x, cast, -1, seed).reshape(w.shape)


# --- a run --------------------------------------------------------------------------------------

def _weights(ck: DriftCheckpoint) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in ck.model.named_parameters() if p.requires_grad}


def _gradients(ck: DriftCheckpoint, settings: HealthSettings) -> dict[str, Tensor]:
    """The float32 model's gradient on the run's probe batch (drift's own backward)."""
    batch = probe_batch(ck, probe_corpus(ck, settings.text), settings.windows)
    model = ck.model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = next_byte_loss(model, batch.long())
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g.detach()
            for (n, p), g in zip(named, grads, strict=True)}


@dataclass
class _Counts:
    numel: int = 0
    frozen: int | None = None
    predicted: int | None = None
    grad_sq: float | None = None
    noise_sq: float | None = None
    oscillating: int | None = None
    flips: int | None = None
    state: StateCounts | None = None

    def problem(self) -> str | None:
        """Why these cannot be one parameter's counts (a kept unit), or None."""
        for name in ("frozen", "predicted", "oscillating"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= self.numel:
                return f"{name} {value} outside 0..{self.numel}"
        if self.numel < 0 or (self.flips is not None and self.flips < 0):
            return f"numel {self.numel}, flips {self.flips}"
        for name in ("grad_sq", "noise_sq"):
            value = getattr(self, name)
            if value is not None and not value >= 0:  # NaN too
                return f"{name} {value}"
        return None


class ReferenceNotice(UserWarning):
    """A reference run trained with other settings than the run (seed, learning rate, ...):
    its trajectory is still taken for the run's, and the CLI says so in one ``warning:``
    line."""


EXPECTED_DIFFERENCES = frozenset({"storage"})
"""Training settings a reference is expected to differ in: it is the float32 run of a run
stored in bfloat16 or float16."""


def _against(x: dict[str, Any], y: dict[str, Any], skip: frozenset[str] = frozenset()) -> str:
    """Every key whose values differ, as ``key REF against the run's RUN``, comma-joined."""
    return ", ".join(f"{k} {_json_text(y.get(k))} against the run's {_json_text(x.get(k))}"
                     for k in sorted(set(x) | set(y)) if k not in skip and x.get(k) != y.get(k))


def _json_text(value: Any) -> str:
    """A recorded setting as JSON writes it, cut at 40 characters (it is data from a file)."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:39] + "…"


def _reference_paths(run: Path, reference: str | Path | None, pattern: str,
                     paths: Sequence[Path], steps: list[int]) -> list[Path] | None:
    """The reference's checkpoints, refused unless they are the run's model (the prediction
    follows the reference's weights name by name, so the same config: the same names and
    shapes) at the same steps; other training settings than the expected storage are said in
    one :class:`ReferenceNotice`."""
    if reference is None:
        return None
    found = run_checkpoints(reference, pattern)
    (config, state), (their_config, their_state) = read_info(paths[0]), read_info(found[0])
    mine, theirs = config.to_json(), their_config.to_json()
    if mine != theirs:
        what = (f"model {their_config.kind.value} against the run's {config.kind.value}"
                if config.kind is not their_config.kind else
                f"model config {_against(mine, theirs)}")
        raise HealthError(f"reference {reference} is not the model of run {run} ({what}); "
                          "the prediction follows the reference's weights name by name: give "
                          "a run of the same model (drift train with the same model options)")
    theirs_steps = [read_info(p)[1].get("step", 0) for p in found]
    if theirs_steps != steps:
        raise HealthError(f"reference {reference} holds checkpoints of steps "
                          f"{theirs_steps[:6]}…, run {run} of {steps[:6]}…; the prediction "
                          "needs the same steps (train both with the same --checkpoint-every "
                          "and --steps)")
    settings = _against(training_settings(state), training_settings(their_state),
                        EXPECTED_DIFFERENCES)
    if settings:
        warnings.warn(f"reference {reference} was trained with other settings than run {run} "
                      f"({settings}); its trajectory is taken for the run's", ReferenceNotice,
                      stacklevel=3)
    return found


CHUNK = 16
"""Checkpoints per work unit. A unit also reads the ``window`` checkpoints before its first
(the oscillation's history and the freeze's previous weights) without counting them, so the
units are the same on every engine and each checkpoint is counted once, the same way."""


@dataclass(frozen=True)
class HealthUnit:
    """Checkpoints ``start`` to ``stop − 1`` of a run (and of its reference), counted."""

    paths: tuple[str, ...]
    reference: tuple[str, ...] | None
    start: int
    stop: int
    settings: HealthSettings

    def key(self) -> str:
        """Everything the unit's counts depend on, the files' stamps included."""
        first = max(0, self.start - self.settings.window)  # at most what the unit reads
        files = self.paths[first:self.stop] + (self.reference or ())[first:self.stop]
        return (f"health|{engines.stamp(*files)}|{self.start}|{self.stop}|"
                f"{self.settings}")

    def check_kept(self, points: object) -> str | None:
        """Why ``points``, a kept unit read back under ``--resume``, cannot be this unit's
        counts (see :meth:`driftcli.engines.Manifest.get`), or None: one point per checkpoint
        of the unit, in order, each parameter's counts within its elements."""
        if not (isinstance(points, list) and all(isinstance(p, _Point) for p in points)):
            return "not a list of checkpoint counts"
        if [p.index for p in points] != list(range(self.start, self.stop)):
            return f"counts of checkpoints other than {self.start}..{self.stop - 1}"
        for p in points:
            if p.checkpoint != Path(self.paths[p.index]).name:
                return f"checkpoint {p.checkpoint!r} at {Path(self.paths[p.index]).name}"
            for name, c in p.counts.items():
                if not isinstance(c, _Counts):
                    return f"{name}: not counts"
                if (why := c.problem()) is not None:
                    return f"{p.checkpoint} {name}: {why}"
        return None


def health_unit(unit: HealthUnit) -> list[_Point]:
    """The counts of the unit's checkpoints (module docs), in step order."""
    settings = unit.settings
    # the oscillation's history needs the window before the first checkpoint, the freeze the
    # one checkpoint before it
    first = max(0, unit.start - (settings.window if settings.cast is not None else 1))
    history: deque[tuple[dict[str, Tensor], dict[str, Tensor]]] = deque(
        maxlen=settings.window + 1)
    prev: dict[str, Tensor] | None = None
    prev_ck: DriftCheckpoint | None = None
    prev_ref: dict[str, Tensor] | None = None
    prev_step = 0
    out: list[_Point] = []
    with deterministic(settings.threads):
        for i in range(first, unit.stop):
            ck = load_checkpoint(Path(unit.paths[i]))
            ref_w = (None if unit.reference is None
                     else _weights(load_checkpoint(Path(unit.reference[i]))))
            w = _weights(ck)
            counted = i >= unit.start
            counts = {n: _Counts(t.numel()) for n, t in w.items()}
            between = None if prev is None else ck.step - prev_step
            if counted and prev is not None and between is not None:
                source_prev = prev if prev_ref is None else prev_ref
                source_now = w if ref_w is None else ref_w
                for n, t in w.items():
                    counts[n].frozen = int(frozen(prev[n], t, settings.storage).sum())
                    counts[n].predicted = int(predicted_frozen(
                        source_prev[n], source_now[n], between, settings.storage).sum())
            if counted and settings.state_layout is not None:
                # staleness needs the step's gradient, recoverable over one step only
                before = prev_ck if between == 1 else None
                for n, c in _moments(before, ck, settings.state_layout).items():
                    counts[n].state = c
            if counted and settings.grad_cast is not None:
                for n, g in _gradients(ck, settings).items():
                    norm, noise = gradient_noise(g, settings.grad_cast, seed=settings.seed)
                    counts[n].grad_sq, counts[n].noise_sq = norm * norm, noise * noise
            if settings.cast is not None:
                history.append((w, {n: weight_cast(t, settings.cast, settings.seed)
                                    for n, t in w.items()}))
                if counted and len(history) > 1:
                    for n in w:
                        osc = oscillation([h[0][n] for h in history], [h[1][n] for h in history])
                        counts[n].oscillating = int(osc.oscillating().sum())
                        counts[n].flips = int(osc.flips.sum())
            if counted:
                out.append(_Point(i, ck.step, ck.path.name, between, counts))
            prev, prev_ref, prev_step, prev_ck = w, ref_w, ck.step, ck
    return out


def health(run: str | Path, *, storage: Storage | str | None = None,
           reference: str | Path | None = None, threshold: float = 0.5,
           cast: Cast | str | None = None, grad_cast: Cast | str | None = None,
           window: int = 8, windows: int | None = None, text: str | Path | None = None,
           seed: int = 0, checkpoints: str = CHECKPOINTS, threads: int = 1,
           state_layout: StateLayout | str | None = None,
           progress: Progress | None = None,
           execution: Execution | None = None) -> list[HealthRow]:
    """The health rows of every checkpoint of ``run`` (module docs): per checkpoint, each
    trainable parameter in the model's order, then ``*``. Torch runs deterministically on
    ``threads`` threads. The checkpoints run in :class:`HealthUnit` s of :data:`CHUNK` on
    ``execution``'s engine (serial by default), the same units on every engine, so every
    engine gives the same rows; ``progress`` is told the checkpoints done."""
    if not 0 < threshold <= 1:
        raise HealthError(f"threshold must be a share in (0, 1], not {threshold}")
    if window < 1:
        raise HealthError(f"window must be at least 1 interval, not {window}")
    folder = Path(run)
    paths = run_checkpoints(folder, checkpoints)
    settings = HealthSettings(
        freeze_storage(paths, storage), threshold,
        None if cast is None else parse_cast(cast),
        None if grad_cast is None else parse_cast(grad_cast), window, windows,
        None if text is None else str(Path(text).resolve()), seed, threads,
        None if state_layout is None else parse_choice(StateLayout, state_layout,
                                                       "optimizer-state layout"))
    steps = [read_info(p)[1].get("step", 0) for p in paths]  # checked: int steps
    ref = _reference_paths(folder, reference, checkpoints, paths, steps)
    mine = tuple(str(p.resolve()) for p in paths)
    theirs = None if ref is None else tuple(str(p.resolve()) for p in ref)
    units = [HealthUnit(mine, theirs, i, min(i + CHUNK, len(mine)), settings)
             for i in range(0, len(mine), CHUNK)]
    per_unit = engines.run(units, health_unit, execution, progress=progress,
                           label=lambda u: Path(u.paths[u.stop - 1]).name,
                           size=lambda u: u.stop - u.start)
    return _rows(folder.resolve().name, [p for points in per_unit for p in points], settings)


def _moments(before: DriftCheckpoint | None, after: DriftCheckpoint,
             layout: StateLayout) -> dict[str, StateCounts]:
    """Per parameter the layout quantizes and ``after`` holds AdamW moments of: the moments'
    counts at ``after``, with their staleness over the step from ``before`` (one step earlier;
    None: no staleness)."""
    train = after.state.get("train") or {}
    if str(train.get("optimizer", "adamw")) != "adamw":
        return {}
    b1, b2 = (float(b) for b in train.get("betas", (0.9, 0.999)))
    eps = float(train.get("eps", 1e-8))
    step = int(after.state.get("optimizer_step", after.step))
    out: dict[str, StateCounts] = {}
    old = {} if before is None else before.optimizer
    m0s, v0s = old.get("exp_avg", {}), old.get("exp_avg_sq", {})
    m1s, v1s = after.optimizer.get("exp_avg", {}), after.optimizer.get("exp_avg_sq", {})
    for name, m1 in m1s.items():
        if name in v1s and quantized(m1.numel(), layout) and step > 0:
            out[name] = state_counts(m0s.get(name), v0s.get(name) if name in m0s else None, m1,
                                     v1s[name], betas=(b1, b2), eps=eps, step=step,
                                     layout=layout)
    return out


def _total(counts: dict[str, _Counts]) -> _Counts:
    parts = list(counts.values())

    def add(field: str) -> float | None:
        values = [getattr(c, field) for c in parts]
        return None if any(v is None for v in values) else sum(values)

    out = _Counts(sum(c.numel for c in parts))
    for field in ("frozen", "predicted", "oscillating", "flips"):
        value = add(field)
        setattr(out, field, None if value is None else int(value))
    out.grad_sq, out.noise_sq = add("grad_sq"), add("noise_sq")
    held = [c.state for c in parts if c.state is not None]
    if held:
        out.state = StateCounts(*(_sum([getattr(h, f.name) for h in held])
                                  for f in dataclasses.fields(StateCounts)))
    return out


def _sum(values: list[Any]) -> Any:
    """The sum of counts, None if any is None (a tensor without a one-step interval)."""
    return None if any(v is None for v in values) else sum(values)


@dataclass(frozen=True)
class _Point:
    """One checkpoint's counts (the checkpoint itself is not kept: a long series would hold
    every model)."""

    index: int
    step: int
    checkpoint: str
    between: int | None
    counts: dict[str, _Counts]


def _rows(name: str, per_step: list[_Point], settings: HealthSettings) -> list[HealthRow]:
    table: list[tuple[_Point, int | None, str, _Counts]] = []
    for ck in per_step:
        table += [(ck, ck.between, n, c) for n, c in ck.counts.items()]
        table.append((ck, ck.between, ALL_PARAMETERS, _total(ck.counts)))
    first: dict[str, tuple[int | None, int | None]] = {}
    for parameter in dict.fromkeys(p for _, _, p, _ in table):
        mine = [(ck.step, c) for ck, _, p, c in table if p == parameter]
        steps = [s for s, _ in mine]
        first[parameter] = (
            first_step(steps, [_share(c.frozen, c.numel) for _, c in mine], settings.threshold),
            first_step(steps, [_share(c.predicted, c.numel) for _, c in mine],
                       settings.threshold))
    rows = []
    for ck, between, parameter, c in table:
        gnr, st = None, c.state
        if c.grad_sq is not None and c.noise_sq is not None:
            gnr = ratio(math.sqrt(c.grad_sq), math.sqrt(c.noise_sq))
        span = None
        if settings.cast is not None:
            span = min(ck.index, settings.window)
        rows.append(HealthRow(
            run=name, checkpoint=ck.checkpoint, step=ck.step, parameter=parameter,
            numel=c.numel, storage=settings.storage.value, steps_between=between,
            frozen_share=_share(c.frozen, c.numel),
            predicted_frozen_share=_share(c.predicted, c.numel),
            freeze_step=first[parameter][0], predicted_freeze_step=first[parameter][1],
            threshold=settings.threshold,
            grad_cast=None if settings.grad_cast is None else str(settings.grad_cast),
            grad_norm=None if c.grad_sq is None else math.sqrt(c.grad_sq),
            noise_norm=None if c.noise_sq is None else math.sqrt(c.noise_sq),
            gnr=gnr, gnr_low=None if gnr is None else gnr < GNR_FLOOR,
            cast=None if settings.cast is None else str(settings.cast), window=span,
            oscillating_share=_share(c.oscillating, c.numel),
            flips_mean=None if c.flips is None else c.flips / c.numel,
            state_layout=None if settings.state_layout is None else settings.state_layout.value,
            m_stale_share=None if st is None or st.m_moved is None else _share(
                st.m_stale, st.m_moved),
            v_stale_share=None if st is None or st.v_moved is None else _share(
                st.v_stale, st.v_moved),
            v_zero_share=None if st is None else _share(st.v_zero, st.v_nonzero),
            update_cosine=None if st is None else st.cosine()))
    return rows


def _share(count: int | None, n: int) -> float | None:
    return None if count is None or n == 0 else count / n


def summary(rows: Sequence[HealthRow]) -> list[dict[str, object]]:
    """The all-parameters rows as plain dicts, checkpoint by checkpoint (for printing)."""
    return [{"step": r.step, "frozen_share": r.frozen_share,
             "predicted_frozen_share": r.predicted_frozen_share, "gnr": r.gnr,
             "gnr_low": r.gnr_low, "oscillating_share": r.oscillating_share,
             "flips_mean": r.flips_mean, "m_stale_share": r.m_stale_share,
             "v_stale_share": r.v_stale_share, "v_zero_share": r.v_zero_share,
             "update_cosine": r.update_cosine}
            for r in rows if r.parameter == ALL_PARAMETERS]
