"""Attention probes: what the casts meet inside each attention layer of drift's transformer.

For every attention layer (``blocks.N.attn``) of :class:`driftcli.models.nets.TransformerLM`,
on one forward and backward (a training step in ``drift train``, the probe batch at a
checkpoint in ``drift probe``):

- ``logit_max``: the largest |q·kᵀ / sqrt(head width)| over the positions the causal mask
  keeps, the largest logit the softmax reads (its growth over a run is the classic sign of
  attention going unstable);
- ``p_mass_high``: the share of the softmax output P's mass on entries in [0.5, 1],
  Σ{p ≥ 0.5} p / Σ p (Σ p is the number of query rows): how much of the attention is
  concentrated on single keys, the entries that sit just under 1.0 where the MX floor rule
  clips;
- under each measured cast, the clip and underflow rates (clip-rate's and underflow-rate's
  definitions, counted by :func:`driftcli.measures.stats.cast_stats`) of P as the left operand
  of ``P·v`` (blocked along the keys), of that matmul's dY (the gradient of ``P·v``, blocked
  along the head width, as the dgrad's left operand) and of the ``q·kᵀ`` matmul's dY (the
  gradient of the scores, blocked along the keys). Every element of an operand counts, the
  causally masked zeros of P included (they are part of what the cast sees; they never clip
  and, being zero, never count as underflow).

A stochastic cast is counted with the random bits of seed 0 (clipping does not depend on
them). Rows come layer by layer in the model's order, each layer's casts in the order given;
without a cast, one row with ``cast = "none"`` and null rates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from driftcli.io.tables import column
from driftcli.measures import clip_rate, underflow_rate
from driftcli.measures.stats import CastStats, cast_stats
from driftcli.models.nets import AttentionTensors
from driftcli.records.cast import Cast
from driftcli.records.modes import Rounding

Tensor = torch.Tensor

NO_CAST = "none"
"""The ``cast`` of a row measured under no cast (its rates are null)."""
OPERANDS = ("p", "dy_pv", "dy_qk")
"""The attention operands counted under each cast: P, the ``P·v`` matmul's dY, the
``q·kᵀ`` matmul's dY."""


@dataclass(frozen=True)
class AttentionRow:
    """One attention layer at one step under one measured cast."""

    TABLE: ClassVar[str] = "attention"
    KEYS: ClassVar[tuple[str, ...]] = ("run", "batch", "policy", "layer", "cast", "step")
    HEADLINE: ClassVar[str] = "p_clip_rate"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    run: str = column("The run folder's name")
    step: int = column("The training step: the update taken on the batch (train), or the "
                       "step of the checkpoint's weights (probe)")
    batch: str = column("train: the step's own training batch, under the run's policy, "
                        "before the update; probe: the fixed probe batch at a checkpoint")
    policy: str = column("The policy the forward and backward ran under")
    layer: str = column("The attention module's qualified name (blocks.N.attn)")
    cast: str = column("The measured cast's canonical spec (none: no cast)")
    logit_max: float = column("Largest |q·kᵀ / sqrt(head width)| over the causally kept "
                              "positions: the largest logit the softmax reads")
    p_mass_high: float = column("Σ of the softmax output P over entries ≥ 0.5 / Σ P: the "
                                "share of attention mass on entries in [0.5, 1]")
    p_clip_rate: float | None = column(
        "Clipped / finite elements of P as the left operand of P·v (blocked along the "
        "keys) under the cast; null without a cast")
    p_underflow_rate: float | None = column(
        "Nonzero elements of P cast to zero / nonzero elements, under the cast")
    dy_pv_clip_rate: float | None = column(
        "Clip rate of the P·v matmul's dY (the gradient of P·v, blocked along the head "
        "width) under the cast; null without a cast or a backward")
    dy_pv_underflow_rate: float | None = column(
        "Underflow rate of the P·v matmul's dY under the cast")
    dy_qk_clip_rate: float | None = column(
        "Clip rate of the q·kᵀ matmul's dY (the gradient of the scores, blocked along the "
        "keys) under the cast; null without a cast or a backward")
    dy_qk_underflow_rate: float | None = column(
        "Underflow rate of the q·kᵀ matmul's dY under the cast")


def logit_max(t: AttentionTensors) -> float:
    """The largest |logit| the softmax reads (module docs)."""
    scores = t.scores.detach()
    keep = t.keep.expand_as(scores)
    return float(scores.abs().masked_select(keep).max()) if bool(keep.any()) else 0.0


def operand_stats(x: Tensor, c: Cast) -> CastStats:
    """What ``c`` does to ``x`` blocked along its last axis (counts only)."""
    seed = 0 if c.rounding is Rounding.SR else None
    st, _ = cast_stats(x.detach().float(), c, axis=-1, seed=seed, want_values=False)
    return st


def _rates(parts: list[CastStats]) -> tuple[float | None, float | None]:
    if not parts:
        return None, None
    merged = (CastStats.merge(parts, False),)
    return (clip_rate.columns(merged, None)["clip_rate"],
            underflow_rate.columns(merged, None)["underflow_rate"])


@dataclass
class _Layer:
    logit_max: float = 0.0
    mass: list[float] = field(default_factory=lambda: [0.0, 0.0])
    stats: dict[tuple[str, int], list[CastStats]] = field(default_factory=dict)


class AttentionRecorder:
    """An :data:`~driftcli.models.nets.AttentionWatch` that measures each call and hooks the
    gradients of its two products; use with :func:`driftcli.models.nets.watch_attention`
    around one forward and backward, then read :meth:`rows`."""

    def __init__(self, casts: Sequence[Cast]) -> None:
        self.casts = tuple(casts)
        self.layers: dict[str, _Layer] = {}

    def _count(self, layer: _Layer, operand: str, x: Tensor) -> None:
        for i, c in enumerate(self.casts):
            layer.stats.setdefault((operand, i), []).append(operand_stats(x, c))

    def __call__(self, name: str, t: AttentionTensors) -> None:
        layer = self.layers.setdefault(name, _Layer())
        layer.logit_max = max(layer.logit_max, logit_max(t))
        p = t.probs.detach().double()
        layer.mass[0] += float(p[p >= 0.5].sum())
        layer.mass[1] += float(p.sum())
        self._count(layer, "p", t.probs)
        for operand, product in (("dy_pv", t.pv), ("dy_qk", t.qk)):
            if product.requires_grad:
                product.register_hook(
                    lambda g, layer=layer, operand=operand: self._count(layer, operand, g))

    def rows(self, run: str, step: int, batch: str, policy: str) -> list[AttentionRow]:
        """One row per layer and cast (one ``none`` row per layer without casts)."""
        out = []
        for name, layer in self.layers.items():
            high = layer.mass[0] / layer.mass[1] if layer.mass[1] else 0.0
            specs = [(i, str(c)) for i, c in enumerate(self.casts)] or [(-1, NO_CAST)]
            for i, spec in specs:
                rates = {op: _rates(layer.stats.get((op, i), [])) for op in OPERANDS}
                out.append(AttentionRow(
                    run=run, step=step, batch=batch, policy=policy, layer=name, cast=spec,
                    logit_max=layer.logit_max, p_mass_high=high,
                    p_clip_rate=rates["p"][0], p_underflow_rate=rates["p"][1],
                    dy_pv_clip_rate=rates["dy_pv"][0], dy_pv_underflow_rate=rates["dy_pv"][1],
                    dy_qk_clip_rate=rates["dy_qk"][0],
                    dy_qk_underflow_rate=rates["dy_qk"][1]))
        return out


def measured_casts(forward_lhs: Cast | None, dgrad_lhs: Cast | None,
                   given: Sequence[Cast] = ()) -> tuple[Cast, ...]:
    """The casts a probe counts under: ``given`` when there are any, else the casts the
    policy applies to P (the forward's left operand) and to dY (the dgrad's), each once."""
    if given:
        return tuple(dict.fromkeys(given))
    return tuple(dict.fromkeys(c for c in (forward_lhs, dgrad_lhs) if c is not None))
