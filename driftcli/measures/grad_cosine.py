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
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any, ClassVar

import torch
from torch import nn

from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import ArithmeticPolicy, get_policy, with_seed
from driftcli.errors import DriftError
from driftcli.io.tables import column

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


def grad_cosine(model: nn.Module, batch: Any, loss_fn: LossFn,
                policies: Sequence[ArithmeticPolicy | str], *, draws: int = 1, seed: int = 0,
                checkpoint: str = "model") -> list[GradCosineRow]:
    """The gradient under each policy against the exact float64 gradient (module docs).

    ``model`` is deep-copied and converted to float64 (the caller's model is not touched; its
    train/eval mode is kept, so call ``eval()`` first if it has dropout); the floating-point
    tensors of ``batch`` are converted to float64 too. ``loss_fn(model, batch)`` returns the
    scalar loss. Stochastic policies run ``draws`` times with seeds ``seed + d``; others once
    (with seed ``seed``). Rows: per parameter tensor, then ``"*"`` for all, per policy.
    """
    if draws < 1:
        raise DriftError(f"draws must be at least 1, not {draws}")
    resolved = [(q.name, q) for q in (get_policy(p) for p in policies)]
    if not resolved:
        raise DriftError("grad_cosine needs at least one policy, e.g. mxfp8_e4m3")
    ref = copy.deepcopy(model).double()
    batch = _to_double(batch)
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    if not named:
        raise DriftError(f"{checkpoint}: the model has no parameter that requires grad")
    params = [p for _, p in named]
    loss_exact, exact = _gradient(ref, params, batch, loss_fn)
    rows: list[GradCosineRow] = []
    for label, policy in resolved:
        n = draws if policy.stochastic else 1
        per_draw: list[list[_Sums]] = []
        losses = []
        mean = [torch.zeros_like(g) for g in exact]
        for d in range(n):
            with arithmetic(with_seed(policy, seed + d), model=ref):
                loss, approx = _gradient(ref, params, batch, loss_fn)
            losses.append(loss)
            per_draw.append([_Sums.of(a, g) for a, g in zip(approx, exact, strict=True)])
            for m, a in zip(mean, approx, strict=True):
                m.add_(a.double(), alpha=1 / n)
        expected = [_Sums.of(m, g) for m, g in zip(mean, exact, strict=True)]
        common = {"checkpoint": checkpoint, "policy": label, "policy_spec": policy.describe(),
                  "loss": fmean(losses), "loss_exact": loss_exact, "draws": n}
        for i, (name, p) in enumerate(named):
            rows.append(_row(common, name, json.dumps(list(p.shape)), p.numel(),
                             [sums[i] for sums in per_draw], expected[i], policy.stochastic))
        rows.append(_row(common, ALL_PARAMETERS, None, sum(p.numel() for p in params),
                         [_Sums.total(sums) for sums in per_draw], _Sums.total(expected),
                         policy.stochastic))
    return rows


def _row(common: dict[str, Any], name: str, shape: str | None, numel: int,
         draws: list[_Sums], expected: _Sums, stochastic: bool) -> GradCosineRow:
    each = [s.metrics() for s in draws]
    own = {m: _mean([e[m] for e in each]) for m in METRICS}
    exp = expected.metrics() if stochastic else dict.fromkeys(METRICS)
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
        params.sort(key=lambda r: r.cosine if not math.isnan(r.cosine) else -math.inf)
        out["checkpoint"] = agg.checkpoint
        out["loss_exact"] = agg.loss_exact
        out["policies"].append({
            "policy": agg.policy, "cosine": agg.cosine, "retention": agg.retention,
            "norm_ratio": agg.norm_ratio, "rel_error": agg.rel_error, "loss": agg.loss,
            "draws": agg.draws, "expected_cosine": agg.expected_cosine,
            "expected_retention": agg.expected_retention,
            "worst": [{"parameter": r.parameter, "cosine": r.cosine} for r in params[:WORST]]})
    return out
