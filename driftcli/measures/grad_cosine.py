"""``grad-cosine``: the gradient under an arithmetic policy against the exact gradient.

At one set of weights and one batch, g is the exact gradient (the model deep-copied to
float64, no casts, plain torch ops) and ĝ the gradient with every matmul under a policy
(:func:`driftcli.arithmetic`, the same float64 copy, the same batch). Per parameter tensor and
for all parameters together (``parameter = "*"``, the sums over every tensor):

- cosine = ⟨ĝ, g⟩ / (‖ĝ‖‖g‖);
- retention = ⟨ĝ, g⟩ / ‖g‖² (the share of the exact gradient kept along its own direction);
- norm_ratio = ‖ĝ‖ / ‖g‖;
- rel_error = ‖ĝ - g‖ / ‖g‖;
- loss under the policy and loss_exact.

A policy with stochastic casts runs ``draws`` times with seeds ``seed, seed + 1, …``: the
columns above are then means over the draws, and the ``expected_`` columns are the same
metrics of the mean gradient over the draws (SR's bias separated from its per-draw noise).

:func:`grad_cosine` measures a model in memory, in this process. :func:`grad_cosine_checkpoint`
measures a checkpoint on an engine (:mod:`driftcli.engines`), one unit per policy with all of
its draws (the mean gradient over the draws needs them together); a worker loads the
checkpoint and works out its exact gradient once for all the units it runs. Both go through
:func:`exact_reference` and :func:`policy_rows`, so every engine gives the same rows.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean
from typing import Any, ClassVar

import torch
from torch import nn

from driftcli import engines
from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import ArithmeticPolicy, get_policy, with_seed
from driftcli.choices import Engine
from driftcli.engines import Execution
from driftcli.errors import DriftError
from driftcli.io.tables import column
from driftcli.models.loaders import (
    CausalLM,
    load_batch,
    load_causal_lm,
    next_token_loss,
    text_batch,
)
from driftcli.progress import Progress

Tensor = torch.Tensor
LossFn = Callable[[nn.Module, Any], Tensor]
"""``loss_fn(model, batch)``: a scalar loss."""
ALL_PARAMETERS = "*"
"""The ``parameter`` of the row over all parameters together."""
METRICS = ("cosine", "retention", "norm_ratio", "rel_error")


@dataclass(frozen=True)
class GradientColumns:
    """The columns of every gradient measurement (grad-cosine, probe): the policy and the
    parameter, and ĝ against the exact g."""

    policy: str = column("Policy name as given (a preset, a cast spec, a policy file's name)")
    policy_spec: str = column("Every setting of the policy: each role's matmul spec, the "
                              "backward state, the modules kept in high precision")
    parameter: str = column("Parameter name; '*' for the row over all parameters together")
    shape: str | None = column("Shape as a JSON list; null in the all-parameters row")
    numel: int = column("Elements (all parameters in the all-parameters row)")
    cosine: float | None = column("⟨ĝ, g⟩ / (‖ĝ‖‖g‖) (mean over draws); null when a norm is 0")
    retention: float | None = column("⟨ĝ, g⟩ / ‖g‖²: share of the exact gradient kept along "
                                     "its own direction (mean over draws); null when g = 0")
    norm_ratio: float | None = column("‖ĝ‖ / ‖g‖ (mean over draws); null when g = 0")
    rel_error: float | None = column("‖ĝ - g‖ / ‖g‖ (mean over draws); null when g = 0")
    grad_norm_exact: float = column("‖g‖, the exact gradient's norm")
    loss: float = column("Loss under the policy (mean over draws)")
    loss_exact: float = column("Loss of the exact float64 model")
    draws: int = column("Gradients drawn: 1 unless the policy casts stochastically")
    expected_cosine: float | None = column("Stochastic policies: cosine of the mean gradient "
                                           "over the draws; null otherwise")
    expected_retention: float | None = column("Stochastic policies: retention of the mean "
                                              "gradient")
    expected_norm_ratio: float | None = column("Stochastic policies: norm_ratio of the mean "
                                               "gradient")
    expected_rel_error: float | None = column("Stochastic policies: rel_error of the mean "
                                              "gradient")


@dataclass(frozen=True)
class _Model:
    checkpoint: str = column("The model: a checkpoint path, or the name the caller gave")


@dataclass(frozen=True)
class GradCosineRow(GradientColumns, _Model):
    """One parameter tensor (or all of them) under one policy: ĝ against the exact g."""

    TABLE: ClassVar[str] = "grad-cosine"
    KEYS: ClassVar[tuple[str, ...]] = ("checkpoint", "policy", "parameter")
    HEADLINE: ClassVar[str] = "cosine"
    HIGHER_IS_WORSE: ClassVar[bool] = False


@dataclass(frozen=True)
class _Sums:
    """⟨ĝ, g⟩, ‖g‖², ‖ĝ‖², ‖ĝ - g‖² of one tensor (or their sums over tensors)."""

    dot: float
    gg: float
    hh: float
    ee: float

    @staticmethod
    def of(approx: Tensor, exact: Tensor) -> _Sums:
        a, g = approx.double().reshape(-1), exact.double().reshape(-1)
        return _Sums(float(a @ g), float(g @ g), float(a @ a), float((a - g) @ (a - g)))

    @staticmethod
    def total(parts: Sequence[_Sums]) -> _Sums:
        return _Sums(*(math.fsum(getattr(p, f) for p in parts)
                       for f in ("dot", "gg", "hh", "ee")))

    def metrics(self) -> dict[str, float | None]:
        """The four metrics; null where a norm they divide by is zero."""
        if self.gg == 0:
            return dict.fromkeys(METRICS)
        return {"cosine": self.dot / math.sqrt(self.hh * self.gg) if self.hh else None,
                "retention": self.dot / self.gg, "norm_ratio": math.sqrt(self.hh / self.gg),
                "rel_error": math.sqrt(self.ee / self.gg)}


def _mean(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else fmean(v for v in values if v is not None)


def _to_double(batch: Any) -> Any:
    """``batch`` with every floating-point tensor in it (nested lists, tuples, dicts) float64."""
    if isinstance(batch, Tensor):
        return batch.double() if batch.dtype.is_floating_point else batch
    if isinstance(batch, dict):
        return {k: _to_double(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to_double(v) for v in batch)
    return batch


def _gradient(model: nn.Module, params: list[Tensor], batch: Any,
              loss_fn: LossFn) -> tuple[float, list[Tensor]]:
    loss = loss_fn(model, batch)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise DriftError(f"loss_fn must return a scalar tensor, not {type(loss).__name__} of "
                         f"shape {tuple(getattr(loss, 'shape', ()))}")
    grads = torch.autograd.grad(loss.reshape(()), params, allow_unused=True)
    return float(loss.detach()), [torch.zeros_like(p) if g is None else g.detach()
                         for g, p in zip(grads, params, strict=True)]


@dataclass(frozen=True)
class Reference:
    """The exact side of a grad-cosine: the float64 copy of a model, the float64 batch, its
    trainable parameters and the exact loss and gradient on it. Every policy of a checkpoint
    is measured against one of these (:func:`policy_rows`)."""

    model: nn.Module
    batch: Any
    loss_fn: LossFn
    named: tuple[tuple[str, Tensor], ...]
    loss_exact: float
    exact: tuple[Tensor, ...]
    checkpoint: str


def exact_reference(model: nn.Module, batch: Any, loss_fn: LossFn,
                    checkpoint: str = "model") -> Reference:
    """``model`` deep-copied to float64 (the caller's is not touched) and its exact gradient
    on ``batch`` (its floating-point tensors made float64), under no policy."""
    ref = copy.deepcopy(model).double()
    batch = _to_double(batch)
    named = tuple((n, p) for n, p in ref.named_parameters() if p.requires_grad)
    if not named:
        raise DriftError(f"{checkpoint}: the model has no parameter that requires grad")
    loss_exact, exact = _gradient(ref, [p for _, p in named], batch, loss_fn)
    return Reference(ref, batch, loss_fn, named, loss_exact, tuple(exact), checkpoint)


def policy_rows(ref: Reference, policy: ArithmeticPolicy, *, draws: int = 1,
                seed: int = 0) -> list[GradCosineRow]:
    """One policy's rows against ``ref``: per parameter tensor, then ``"*"`` for all. A
    stochastic policy runs ``draws`` times with seeds ``seed + d``, others once."""
    params = [p for _, p in ref.named]
    n = draws if policy.stochastic else 1
    per_draw: list[list[_Sums]] = []
    losses = []
    mean = [torch.zeros_like(g) for g in ref.exact]
    for d in range(n):
        with arithmetic(with_seed(policy, seed + d), model=ref.model):
            loss, approx = _gradient(ref.model, params, ref.batch, ref.loss_fn)
        losses.append(loss)
        per_draw.append([_Sums.of(a, g) for a, g in zip(approx, ref.exact, strict=True)])
        for m, a in zip(mean, approx, strict=True):
            m.add_(a.double(), alpha=1 / n)
    expected = [_Sums.of(m, g) for m, g in zip(mean, ref.exact, strict=True)]
    common = {"checkpoint": ref.checkpoint, "policy": policy.name,
              "policy_spec": policy.describe(), "loss": fmean(losses),
              "loss_exact": ref.loss_exact, "draws": n}
    rows = [_row(common, name, json.dumps(list(p.shape)), p.numel(),
                 [sums[i] for sums in per_draw], expected[i], policy.stochastic)
            for i, (name, p) in enumerate(ref.named)]
    rows.append(_row(common, ALL_PARAMETERS, None, sum(p.numel() for p in params),
                     [_Sums.total(sums) for sums in per_draw], _Sums.total(expected),
                     policy.stochastic))
    return rows


def _resolve(policies: Sequence[ArithmeticPolicy | str], draws: int) -> list[ArithmeticPolicy]:
    if draws < 1:
        raise DriftError(f"draws must be at least 1, not {draws}")
    resolved = [get_policy(p) for p in policies]
    if not resolved:
        raise DriftError("grad_cosine needs at least one policy, e.g. mxfp8_e4m3")
    return resolved


def grad_cosine(model: nn.Module, batch: Any, loss_fn: LossFn,
                policies: Sequence[ArithmeticPolicy | str], *, draws: int = 1, seed: int = 0,
                checkpoint: str = "model") -> list[GradCosineRow]:
    """The gradient under each policy against the exact float64 gradient (module docs), in
    this process.

    ``model`` is deep-copied and converted to float64 (the caller's model is not touched; its
    train/eval mode is kept, so call ``eval()`` first if it has dropout); the floating-point
    tensors of ``batch`` are converted to float64 too. ``loss_fn(model, batch)`` returns the
    scalar loss. Stochastic policies run ``draws`` times with seeds ``seed + d``; others once
    (with seed ``seed``). Rows: per parameter tensor, then ``"*"`` for all, per policy.
    """
    resolved = _resolve(policies, draws)
    ref = exact_reference(model, batch, loss_fn, checkpoint)
    return [row for policy in resolved for row in policy_rows(ref, policy, draws=draws,
                                                               seed=seed)]


# --- a checkpoint's policies as engine units ---------------------------------------------------

@dataclass(frozen=True)
class BatchSource:
    """Where a checkpoint's batch comes from, by path, so that a unit naming it pickles small
    and a worker makes the batch itself: exactly one of ``text`` (tokenized with the
    checkpoint's tokenizer: ``windows`` consecutive windows of ``tokens`` tokens) and
    ``batch`` (a safetensors file with ``input_ids``)."""

    text: str | None = None
    batch: str | None = None
    tokens: int = 128
    windows: int = 1

    def __post_init__(self) -> None:
        if (self.text is None) == (self.batch is None):
            raise DriftError("give the batch as exactly one of --text FILE (tokenized with the "
                             "checkpoint's tokenizer) or --batch FILE (safetensors input_ids)")

    @property
    def path(self) -> Path:
        """The file the batch is read from."""
        return Path(self.text if self.text is not None else str(self.batch))

    def absolute(self) -> BatchSource:
        """The same source by absolute paths (a worker's folder is not the driver's)."""
        text, batch = (None if p is None else str(Path(p).resolve())
                       for p in (self.text, self.batch))
        return replace(self, text=text, batch=batch)

    def ids(self, lm: CausalLM) -> Tensor:
        """The token ids (int64, ``(windows, tokens)``) for ``lm``."""
        if self.batch is not None:
            return load_batch(self.batch)
        text = self.path.read_text(encoding="utf-8")
        return text_batch(lm, text, self.tokens, self.windows, str(self.path))


@dataclass
class Loaded:
    """A checkpoint loaded with its batch, and (once asked for) its exact reference."""

    lm: CausalLM
    ids: Tensor
    checkpoint: str
    exact: Reference | None = field(default=None, repr=False)

    def reference(self) -> Reference:
        """The exact float64 gradient of the checkpoint on the batch, worked out once."""
        if self.exact is None:
            self.exact = exact_reference(self.lm.model, self.ids,
                                         next_token_loss(self.lm.logits), self.checkpoint)
        return self.exact


_LOADED: dict[tuple[object, ...], Loaded] = {}
"""This process's loaded checkpoint (one: a unit's neighbours are the same checkpoint's other
policies, and a model is large), keyed by what it was loaded from."""


def _stamp(path: Path) -> tuple[object, ...]:
    """What tells a file (or a folder's files) apart from a rewritten one: names, sizes and
    modification times, so a cached model is not served for a checkpoint trained again."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)


def load_input(checkpoint: str | Path, source: BatchSource, name: str | None = None) -> Loaded:
    """The checkpoint (:func:`~driftcli.models.loaders.load_causal_lm`) and its batch, kept for
    this process's next call with the same files: the units of one checkpoint that run in
    one process load it once. ``name`` is the rows' ``checkpoint`` (default: the path)."""
    path = Path(checkpoint)
    label = str(checkpoint) if name is None else name
    key = (str(path.resolve()), source.absolute(), label,
           *(_stamp(p) for p in (path, source.path) if p.exists()))
    if key not in _LOADED:
        _LOADED.clear()  # the old model goes before the new one is loaded
        lm = load_causal_lm(path, float64_copies=4)  # the float64 model, exact, draw, mean
        _LOADED[key] = Loaded(lm, source.ids(lm), label)
    return _LOADED[key]


def forget_loaded() -> None:
    """Drop this process's loaded checkpoint (its memory)."""
    _LOADED.clear()


@dataclass(frozen=True)
class PolicyUnit:
    """One policy at one checkpoint, every draw of it: the work unit of a grad-cosine on an
    engine (the mean gradient over the draws needs them all in one place). It names the
    checkpoint and batch by path; the worker loads them (:func:`load_input`)."""

    checkpoint: str
    """The path the worker loads (absolute: a worker's folder is not the driver's)."""
    name: str
    """The rows' ``checkpoint``: the path as given."""
    source: BatchSource
    policy: ArithmeticPolicy
    draws: int
    seed: int

    def key(self) -> str:
        """Everything the unit's rows depend on, the files' stamps included."""
        s, p = self.source, self.policy
        return (f"grad-cosine|{engines.stamp(self.checkpoint, s.text, s.batch)}|{self.name}|"
                f"{s}|{p.name}|{p.describe()}|{p.seed}|{self.draws}|{self.seed}")


def policy_unit(unit: PolicyUnit) -> list[GradCosineRow]:
    """A unit's rows: :func:`policy_rows` against the checkpoint's exact reference."""
    ref = load_input(unit.checkpoint, unit.source, unit.name).reference()
    return policy_rows(ref, unit.policy, draws=unit.draws, seed=unit.seed)


def grad_cosine_checkpoint(checkpoint: str | Path, source: BatchSource,
                           policies: Sequence[ArithmeticPolicy | str], *, draws: int = 1,
                           seed: int = 0, execution: Execution | None = None,
                           progress: Progress | None = None) -> list[GradCosineRow]:
    """:func:`grad_cosine` of a checkpoint file or folder on its batch, one
    :class:`PolicyUnit` per policy run on ``execution``'s engine (serial by default); the rows
    come in policy order, the same on every engine. ``progress`` is told the policies done."""
    resolved = _resolve(policies, draws)
    execution = execution or Execution()
    if execution.engine is not Engine.SERIAL:
        forget_loaded()  # the workers load their own; the driver need not hold one meanwhile
    path, src = str(Path(checkpoint).resolve()), source.absolute()
    units = [PolicyUnit(path, str(checkpoint), src, p, draws, seed) for p in resolved]
    per_unit = engines.run(units, policy_unit, execution, progress=progress,
                           label=lambda u: u.policy.name)
    return [row for rows in per_unit for row in rows]


def _row(common: dict[str, Any], name: str, shape: str | None, numel: int,
         draws: list[_Sums], expected: _Sums, stochastic: bool) -> GradCosineRow:
    each = [s.metrics() for s in draws]
    own: dict[str, Any] = {m: _mean([e[m] for e in each]) for m in METRICS}
    exp: dict[str, Any] = expected.metrics() if stochastic else dict.fromkeys(METRICS)
    return GradCosineRow(parameter=name, shape=shape, numel=numel, **own,
                         grad_norm_exact=math.sqrt(expected.gg), **common,
                         **{f"expected_{m}": exp[m] for m in METRICS})


WORST = 3
"""Parameters with the lowest cosine named per policy in the summary."""


def summarize(rows: Sequence[GradCosineRow], path: Path) -> dict[str, Any]:
    """Per policy: the all-parameters metrics and the parameters with the lowest cosine (what
    ``drift grad-cosine`` prints, or writes as JSON)."""
    out: dict[str, Any] = {"table": str(path), "policies": []}
    for agg in (r for r in rows if r.parameter == ALL_PARAMETERS):
        params = [r for r in rows if r.policy == agg.policy and r.parameter != ALL_PARAMETERS
                  and r.cosine is not None]
        params.sort(key=lambda r: r.cosine if r.cosine is not None and not math.isnan(r.cosine)
                    else -math.inf)
        out["checkpoint"] = agg.checkpoint
        out["loss_exact"] = agg.loss_exact
        out["policies"].append({
            "policy": agg.policy, "cosine": agg.cosine, "retention": agg.retention,
            "norm_ratio": agg.norm_ratio, "rel_error": agg.rel_error, "loss": agg.loss,
            "draws": agg.draws, "expected_cosine": agg.expected_cosine,
            "expected_retention": agg.expected_retention,
            "worst": [{"parameter": r.parameter, "cosine": r.cosine} for r in params[:WORST]]})
    return out
