"""``advise``: which layers to keep in high precision under a cast, within a budget of work.

A **layer** is a module in which matmuls run (a ``nn.Linear``, an attention module's own
``q·kᵀ`` and ``P·v``), named as ``model.named_modules()`` names it; keeping it runs every
matmul in it and below it with both operands in bfloat16 (:data:`KEEP_CAST`, a policy
override, :class:`~driftcli.arith.policy.ModuleOverride`). Its
**work** is the multiply-adds of those matmuls in one forward pass, from their operands'
shapes (the dgrad and the wgrad of a product take as many again each, so shares are the same
for a training step); the **total** is the work of every matmul the cast applies to.

Each layer is measured with the cast applied to it alone (every other matmul the plain torch
op on the float64 copy of :func:`~driftcli.measures.grad_cosine.exact_reference`, i.e.
exact): the loss change against the exact loss, as a mean over ``batches``; on the first
batch, the whole gradient's cosine and relative error against the exact one, and the cosine,
retention (the bias along the exact direction) and relative error of the layer's own
parameters' gradient. With the cast on every layer at once the layer's own gradient cosine is
measured as well. The **score** is ``|Δloss| / |loss_exact| + rel_error``: how far the step's
two results, the loss and its gradient, move when that layer alone is cast, each relative to
its exact value. Layers are ranked by score (a non-finite score first), and the advice keeps
layers in rank order while they fit: a layer is kept when its work not already kept with
another layer fits in what the budget has left, so every layer not kept would overrun it.
As controls, the same budget can keep the last layers or a random draw (:class:`Choose`).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from statistics import fmean
from typing import Any, ClassVar

import torch
from torch import nn

from driftcli.arith.intercept import OUTSIDE, ROOT
from driftcli.arith.matmul import MatmulSpec
from driftcli.arith.mode import ArithmeticMode
from driftcli.arith.policy import (
    ROLES,
    ArithmeticPolicy,
    Role,
    get_policy,
    module_override,
    override_toml,
    with_seed,
)
from driftcli.choices import parse_choice
from driftcli.errors import DriftError
from driftcli.io.tables import column
from driftcli.measures.grad_cosine import LossFn, Reference, exact_reference

Tensor = torch.Tensor
DEFAULT_BUDGET = 0.15
"""The share of the matmul work kept in high precision by default: about what NVIDIA's NVFP4
pretraining recipe keeps in BF16."""
DEFAULT_BATCHES = 4
"""Batches the loss change is averaged over by default."""
KEEP_CAST = "bf16"
"""The cast of a kept layer's matmuls (both operands, every role; float32 accumulation): the
BF16 layers of NVIDIA's NVFP4 recipe, not the model's own dtype."""


class Choose(StrEnum):
    """Which layers the budget keeps."""

    SCORE = "score"
    """The most sensitive first (the advice)."""
    LAST = "last"
    """The last layers first, by where their first matmul runs in the forward (what NVIDIA's
    NVFP4 recipe keeps): a control."""
    RANDOM = "random"
    """Layers in a seeded random order: a control."""


class AdviseError(DriftError, ValueError):
    """A budget, cast or model that advise cannot use."""


@dataclass(frozen=True)
class AdviseRow:
    """One layer under one cast: its work, its sensitivity and whether the advice keeps it."""

    TABLE: ClassVar[str] = "advise"
    KEYS: ClassVar[tuple[str, ...]] = ("checkpoint", "cast", "layer")
    HEADLINE: ClassVar[str] = "score"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    checkpoint: str = column("The model: a checkpoint path, or the name the caller gave")
    cast: str = column("The cast every layer not kept runs under (a policy name or cast spec)")
    policy_spec: str = column("Every setting of the cast's policy (each role's matmul spec)")
    layer: str = column("Qualified module name of the layer (where its matmuls run)")
    rank: int = column("1 for the most sensitive layer (highest score)")
    score: float = column("|loss_delta| / |loss_exact| + rel_error; inf when not finite")
    kept: bool = column("Whether the advised policy keeps the layer in high precision")
    work: int = column("Multiply-adds of the layer's matmuls (and those below it) per forward")
    work_share: float = column("work / the work of every matmul the cast applies to")
    loss_delta: float = column("Loss with only this layer cast minus the exact loss, mean "
                               "over the batches")
    loss_exact: float = column("The exact loss, mean over the batches")
    cosine: float | None = column("Whole gradient with only this layer cast: cosine against "
                                  "the exact gradient (first batch); null when a norm is 0")
    rel_error: float | None = column("Whole gradient with only this layer cast: ‖ĝ - g‖ / ‖g‖ "
                                     "(first batch); null when g = 0")
    layer_cosine: float | None = column("The layer's own parameters' gradient with only this "
                                        "layer cast: cosine; null without parameters")
    layer_retention: float | None = column("The same: ⟨ĝ, g⟩ / ‖g‖², the gradient kept along "
                                           "its exact direction (its bias)")
    layer_rel_error: float | None = column("The same: ‖ĝ - g‖ / ‖g‖")
    full_cosine: float | None = column("The layer's own parameters' gradient with every layer "
                                       "cast: cosine")
    forward_rel_error: float | None = column("Whole gradient with only this layer's forward "
                                             "cast (its dgrad and wgrad plain): ‖ĝ - g‖ / ‖g‖")
    forward_retention: float | None = column("The same: ⟨ĝ, g⟩ / ‖g‖² (its bias)")
    dgrad_rel_error: float | None = column("Whole gradient with only this layer's dgrad cast: "
                                           "‖ĝ - g‖ / ‖g‖")
    dgrad_retention: float | None = column("The same: ⟨ĝ, g⟩ / ‖g‖²")
    wgrad_rel_error: float | None = column("Whole gradient with only this layer's wgrad cast: "
                                           "‖ĝ - g‖ / ‖g‖")
    wgrad_retention: float | None = column("The same: ⟨ĝ, g⟩ / ‖g‖²")
    batches: int = column("Batches the loss change is averaged over")


@dataclass(frozen=True)
class Advice:
    """The measured layers, in rank order, and the policy they advise."""

    rows: tuple[AdviseRow, ...]
    policy: ArithmeticPolicy
    """The cast with the kept layers overridden to :data:`KEEP_CAST`."""
    toml: str
    """The policy as a file :func:`~driftcli.arith.policy.policy_from_toml` reads."""
    budget: float
    total_work: int
    kept_work: int

    @property
    def kept_share(self) -> float:
        """The share of the total work the advice keeps."""
        return self.kept_work / self.total_work if self.total_work else 0.0

    def write_policy(self, path: str | Path) -> Path:
        """Write :attr:`toml` to ``path``."""
        p = Path(path)
        try:
            p.write_text(self.toml, encoding="utf-8")
        except OSError as err:
            raise AdviseError(f"cannot write policy file {p}: {err.strerror or err}; give a "
                              "writable path") from None
        return p


class _Watch(ArithmeticMode):
    """The arithmetic mode that records the multiply-adds each module's products take and,
    with ``only``, casts only the products of that module and those below it (the others run
    as the plain torch op)."""

    def __init__(self, policy: ArithmeticPolicy, model: nn.Module, only: str | None) -> None:
        super().__init__(policy, model)
        self.only = only
        self.work: Counter[str] = Counter()

    def product(self, a: Tensor, b: Tensor, name: str) -> Tensor:
        module = self.current_module
        if self.only is not None and not _within(module, self.only):
            self.note_plain(name, "not the layer measured")
            return torch.matmul(a, b)
        m = a.shape[-2] if a.dim() > 1 else 1
        n = b.shape[-1] if b.dim() > 1 else 1
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]).numel()
        self.work[module] += lead * m * a.shape[-1] * n
        return super().product(a, b, name)


def _one_role(policy: ArithmeticPolicy, role: Role) -> ArithmeticPolicy:
    """``policy`` with every role but ``role`` the plain torch op."""
    specs: dict[str, MatmulSpec | None] = {
        r.value: getattr(policy, r.value) if r is role else None for r in ROLES}
    return replace(policy, forward=specs["forward"], dgrad=specs["dgrad"],
                   wgrad=specs["wgrad"])


def _within(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def keep_pattern(layer: str) -> str:
    """The override regex matching exactly this module (the ones below it run under its
    override with it)."""
    return f"^{re.escape(layer)}$"


@dataclass(frozen=True)
class _Run:
    loss: float
    grads: tuple[Tensor, ...]
    work: Counter[str]


def _run(ref: Reference, policy: ArithmeticPolicy, only: str | None, grad: bool) -> _Run:
    params = [p for _, p in ref.named]
    watch = _Watch(policy, ref.model, only)
    with watch:
        if grad:
            loss = ref.loss_fn(ref.model, ref.batch)
            grads = torch.autograd.grad(loss.reshape(()), params, allow_unused=True)
            got = tuple(torch.zeros_like(p) if g is None else g.detach()
                        for g, p in zip(grads, params, strict=True))
        else:
            with torch.no_grad():
                loss = ref.loss_fn(ref.model, ref.batch)
            got = ()
    return _Run(float(loss.detach()), got, watch.work)


def _metrics(approx: Sequence[Tensor], exact: Sequence[Tensor]) -> dict[str, float | None]:
    """Cosine, retention and relative error of the concatenated tensors (null where a norm
    they divide by is 0, or with no tensors)."""
    if not exact:
        return {"cosine": None, "retention": None, "rel_error": None}
    a = torch.cat([t.double().reshape(-1) for t in approx])
    g = torch.cat([t.double().reshape(-1) for t in exact])
    gg, aa, dot = float(g @ g), float(a @ a), float(a @ g)
    if gg == 0:
        return {"cosine": None, "retention": None, "rel_error": None}
    return {"cosine": dot / math.sqrt(aa * gg) if aa else None, "retention": dot / gg,
            "rel_error": float((a - g).norm()) / math.sqrt(gg)}


def _score(loss_delta: float, loss_exact: float, rel_error: float | None) -> float:
    value = abs(loss_delta) / abs(loss_exact) if loss_exact else abs(loss_delta)
    value += rel_error if rel_error is not None else 0.0
    return value if math.isfinite(value) else math.inf


def check_budget(budget: float) -> float:
    """``budget`` if it is a share in [0, 1], else an :class:`AdviseError`."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not (
            0.0 <= budget <= 1.0):
        raise AdviseError(f"budget {budget!r} is not a share of the matmul work in [0, 1]; "
                          f"give e.g. {DEFAULT_BUDGET}")
    return float(budget)


def advise(model: nn.Module, batches: Sequence[Any], loss_fn: LossFn,
           cast: ArithmeticPolicy | str, *, budget: float = DEFAULT_BUDGET, seed: int = 0,
           checkpoint: str = "model", choose: Choose | str = Choose.SCORE,
           choose_seed: int = 0) -> Advice:
    """Rank ``model``'s layers by their sensitivity to ``cast`` and keep the most sensitive
    in bfloat16 (:data:`KEEP_CAST`) within ``budget`` (a share of the matmul work); see the
    module docs.

    ``batches`` are what ``loss_fn(model, batch)`` takes (at least one): the loss change is
    their mean, the gradients are the first one's. The model is deep-copied to float64 per
    batch (the caller's is not touched). A stochastic cast draws with ``seed``. ``choose``
    other than ``score`` keeps layers in another order within the same budget, as a control
    (:class:`Choose`; ``random`` shuffles with ``choose_seed``); the rows are measured and
    ranked the same.
    """
    budget = check_budget(budget)
    choose = parse_choice(Choose, choose, "choose")
    if not batches:
        raise AdviseError("advise needs at least one batch")
    base = get_policy(cast)
    policy = with_seed(base, seed)
    preset = base.name
    if isinstance(cast, str | Path):  # what a policy file's preset key reads back
        preset = str(Path(cast).resolve()) if str(cast).endswith(".toml") else str(cast)
    if policy.exact:
        raise AdviseError(f"cast {policy.name!r} casts nothing: give a cast such as mxfp8_e4m3 "
                          "or nvfp4")
    ref = exact_reference(model, batches[0], loss_fn, checkpoint)
    full = _run(ref, policy, None, grad=True)
    own = full.work  # every product the cast applies to, by the module it runs in, in order
    total = sum(own.values())
    layers = sorted(m for m in own if m not in (ROOT, OUTSIDE))
    if not layers or total == 0:
        raise AdviseError(f"{checkpoint}: no matmul of the model runs in a module under "
                          f"{policy.name!r}, so there is no layer to advise on")
    index = {name: i for i, (name, _) in enumerate(ref.named)}

    def owned(layer: str) -> list[int]:
        return [i for name, i in index.items() if _within(name.rpartition(".")[0], layer)]

    measured: dict[str, dict[str, Any]] = {}
    for layer in layers:
        run = _run(ref, policy, layer, grad=True)
        mine = owned(layer)
        whole = _metrics(run.grads, ref.exact)
        part = _metrics([run.grads[i] for i in mine], [ref.exact[i] for i in mine])
        measured[layer] = {
            "deltas": [run.loss - ref.loss_exact], "exacts": [ref.loss_exact],
            "cosine": whole["cosine"], "rel_error": whole["rel_error"],
            "layer_cosine": part["cosine"], "layer_retention": part["retention"],
            "layer_rel_error": part["rel_error"],
            "full_cosine": _metrics([full.grads[i] for i in mine],
                                    [ref.exact[i] for i in mine])["cosine"]}
        for role in ROLES:  # the cast on one role of this layer: what each matmul adds
            alone = _run(ref, _one_role(policy, role), layer, grad=True)
            m = _metrics(alone.grads, ref.exact)
            measured[layer][f"{role.value}_rel_error"] = m["rel_error"]
            measured[layer][f"{role.value}_retention"] = m["retention"]
    del ref
    for batch in batches[1:]:
        other = exact_reference(model, batch, loss_fn, checkpoint)
        for layer in layers:
            loss = _run(other, policy, layer, grad=False).loss
            measured[layer]["deltas"].append(loss - other.loss_exact)
            measured[layer]["exacts"].append(other.loss_exact)
    return _advice(checkpoint, preset, policy, budget, own, total, measured, len(batches),
                   choose, choose_seed)


def keep_within(order: Sequence[str], own: Mapping[str, int], budget: float
                ) -> tuple[list[str], int]:
    """The layers of ``order`` kept, in that order, while they fit in ``budget`` (a share of
    the work of every module in ``own``, the multiply-adds each module's own products take):
    a layer is kept when the work of its modules not already kept (it and those below it)
    fits in what is left. Returns the kept layers and the work kept."""
    kept: list[str] = []
    covered: set[str] = set()
    limit = budget * sum(own.values())
    used = 0
    for layer in order:
        extra = {m for m in own if _within(m, layer)} - covered
        more = sum(own[m] for m in extra)
        if used + more <= limit:
            used += more
            covered |= extra
            if more:
                kept.append(layer)
    return kept, used


def _chosen(choose: Choose, ranked: Sequence[str], own: Mapping[str, int], seed: int
            ) -> list[str]:
    """The order in which ``choose`` keeps layers (``ranked``: by score)."""
    if choose is Choose.SCORE:
        return list(ranked)
    if choose is Choose.LAST:  # the layers by their first product in the forward, last first
        first = {layer: next(i for i, m in enumerate(own) if _within(m, layer))
                 for layer in ranked}
        return sorted(ranked, key=lambda layer: (-first[layer], layer))
    order = sorted(ranked)
    random.Random(seed).shuffle(order)
    return order


def _advice(checkpoint: str, preset: str, policy: ArithmeticPolicy, budget: float,
            own: Counter[str], total: int, measured: dict[str, dict[str, Any]],
            n: int, choose: Choose, choose_seed: int) -> Advice:
    def work(layer: str) -> int:
        return sum(w for m, w in own.items() if _within(m, layer))

    scored = {}
    for layer, m in measured.items():
        delta, exact = fmean(m["deltas"]), fmean(m["exacts"])
        scored[layer] = (_score(delta, exact, m["rel_error"]), delta, exact)
    order = sorted(measured, key=lambda name: (-scored[name][0], name))
    kept, used = keep_within(_chosen(choose, order, own, choose_seed), own, budget)
    covered = {m for m in own if any(_within(m, k) for k in kept)}
    rows = tuple(AdviseRow(
        checkpoint=checkpoint, cast=policy.name, policy_spec=policy.describe(), layer=layer,
        rank=rank, score=scored[layer][0], kept=all(m in covered for m in own
                                                     if _within(m, layer)),
        work=work(layer), work_share=work(layer) / total, loss_delta=scored[layer][1],
        loss_exact=scored[layer][2], batches=n,
        **{k: measured[layer][k] for k in (
            "cosine", "rel_error", "layer_cosine", "layer_retention", "layer_rel_error",
            "full_cosine", *(f"{r.value}_{m}" for r in ROLES for m in ("rel_error",
                                                                       "retention")))})
        for rank, layer in enumerate(order, start=1))
    overrides = (*(module_override(keep_pattern(k), KEEP_CAST) for k in kept),
                 *policy.overrides)
    how = "the most sensitive layers" if choose is Choose.SCORE else (
        "the last layers" if choose is Choose.LAST else
        f"layers drawn at random (seed {choose_seed})")
    name = f"{policy.name}+" + ("advised" if choose is Choose.SCORE else choose.value) + (
        f"{choose_seed}" if choose is Choose.RANDOM else "")
    advised = replace(policy, name=name, overrides=overrides)
    text = "\n".join([
        f"# drift advise: {preset} with {how} kept in {KEEP_CAST} ({used / total:.4f} of the "
        f"matmul work, budget {budget})",
        f"name = {json.dumps(name)}", f"preset = {json.dumps(preset)}",
        f"seed = {policy.seed}", *override_toml(overrides), ""])
    return Advice(rows, advised, text, budget, total, used)


def split_batch(ids: Tensor, batches: int) -> list[Tensor]:
    """Token ids ``(windows, tokens)`` cut into ``batches`` batches of whole windows."""
    if batches < 1 or ids.shape[0] < batches or ids.shape[0] % batches:
        raise AdviseError(f"{ids.shape[0]} window(s) cannot be cut into {batches} batch(es) "
                          "of equal size; give a multiple of --batches windows")
    return list(ids.reshape(batches, ids.shape[0] // batches, *ids.shape[1:]))


def summarize(advice: Advice, table: Path, policy_file: Path | None) -> dict[str, Any]:
    """What ``drift advise`` prints (or writes as JSON): the ranking and the kept layers."""
    first = advice.rows[0] if advice.rows else None
    return {"table": str(table), "policy_file": None if policy_file is None else str(policy_file),
            "checkpoint": None if first is None else first.checkpoint,
            "cast": None if first is None else first.cast, "budget": advice.budget,
            "kept_share": advice.kept_share, "total_work": advice.total_work,
            "kept": [r.layer for r in advice.rows if r.kept],
            "layers": [{"layer": r.layer, "rank": r.rank, "score": r.score, "kept": r.kept,
                        "work_share": r.work_share, "loss_delta": r.loss_delta,
                        "cosine": r.cosine, "layer_cosine": r.layer_cosine}
                       for r in advice.rows]}
