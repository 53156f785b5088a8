"""``probe``: what other arithmetic would have done at every checkpoint of a training run.

For each checkpoint of a run (``drift train``'s ``step-NNNNNN.safetensors``) and each policy,
at the run's own weights and on one fixed probe batch (the first windows of the run's
validation text, evenly spaced, the same for every checkpoint), without changing the run:

- the :mod:`grad-cosine <driftcli.measures.grad_cosine>` metrics of the policy's gradient ĝ
  against the exact float64 gradient g (cosine, retention, norm_ratio, rel_error, and for
  stochastic policies the ``expected_`` metrics of the mean gradient over the draws), per
  parameter and over all parameters (``parameter = "*"``), and the loss each policy gives;
- the update-freeze share: the fraction of weights whose update storage would lose.
  The update is the one the run's optimizer would take next from ĝ: AdamW (or SGD with
  momentum) continued from the moments saved in the checkpoint, at the learning rate of the
  run's next step (its schedule), with its weight decay. With ``w_s`` the weight rounded to
  the storage format (nearest even; by default the run's own when ``drift train --storage``
  stored it in bfloat16 or float16, else bfloat16: :func:`freeze_storage`), a weight is frozen when
  ``round(w_s + Δw) == w_s``, the sum taken exactly. That holds when ``Δw`` falls short of
  half the gap from ``w_s`` to its neighbour on ``Δw``'s side (``Δw = 0`` included), or
  equals it and ``w_s`` has the even significand. Below a power of two the gap is half the
  one above; the largest finite value's gap up is its binade's spacing (a sum reaching half
  of it overflows to inf); zero's gaps are the smallest subnormal; values compare as numbers
  (−0 = +0), and a weight that overflows storage to ±inf stays there.
  :func:`update_lost_exact` is the rule one value at a time in exact rationals;
  :func:`update_lost` is the vectorized one, tested against it. For a stochastic policy the
  share is the mean over the draws.

The checkpoints probed must be one run's (same model config, recorded text and training
settings: :func:`run_checkpoints` refuses others, naming two that differ), taken in the order
of the step each records. Each checkpoint, under all the policies, is one unit of work
(:class:`CheckpointUnit`) that an engine (:mod:`driftcli.engines`) runs in this process, in
local processes or on a Ray cluster; the rows are assembled in step order whichever ran them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from driftcli import engines, oracle
from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import ArithmeticPolicy, Role, get_policy, with_seed
from driftcli.choices import Storage, parse_choice
from driftcli.engines import Execution
from driftcli.errors import DriftError
from driftcli.io.tables import column
from driftcli.measures.grad_cosine import (
    ALL_PARAMETERS,
    GradCosineRow,
    GradientColumns,
    grad_cosine,
)
from driftcli.measures.probe_attention import AttentionRecorder, AttentionRow, measured_casts
from driftcli.models.checkpoint import DriftCheckpoint, load_checkpoint, read_info
from driftcli.models.config import CHECKPOINTS, ModelConfig
from driftcli.models.nets import has_attention, next_byte_loss, watch_attention
from driftcli.progress import Progress
from driftcli.records.formats import NAN, Exact, Kind, get_format
from driftcli.records.modes import Overflow, Rounding
from driftcli.runs.training import deterministic
from driftcli.text import Corpus, fixed_windows, load_corpus, recorded_corpus

Tensor = torch.Tensor

PROBE_FILE = "probe.parquet"
ATTENTION_PROBE_FILE = "probe-attention.parquet"
"""The attention probes of a transformer run's checkpoints (``AttentionRow``)."""


class ProbeError(DriftError, ValueError):
    """A run, checkpoint or probe setting that cannot be used."""


_LAYOUT: dict[Storage, tuple[torch.dtype, torch.dtype, int, int]] = {
    Storage.BFLOAT16: (torch.bfloat16, torch.int16, 8, 7),
    Storage.FLOAT16: (torch.float16, torch.int16, 5, 10),
    Storage.FLOAT32: (torch.float32, torch.int32, 8, 23),
}
"""Per storage format: dtype, integer view, exponent bits, mantissa bits."""


def storage_gaps(w_s: Tensor, storage: Storage | str) -> tuple[Tensor, Tensor]:
    """The gaps (float64) from each finite value ``w_s`` (a tensor of the storage dtype) down to
    the next value of ``storage`` below it and up to the next above, read from the bits.

    With ``E`` the biased exponent field, the spacing of the binade is
    ``2**(max(E, 1) - bias - mantissa_bits)`` (subnormals and zero share the lowest normal
    binade's). A nonzero power of two above that binade (mantissa field 0, ``E > 1``) has a
    binade half as fine on its side toward zero. The largest finite value's gap away from zero
    is its binade's spacing: IEEE rounding overflows to inf from half of it on. Every gap is a
    power of two, so exact in float64. Values are not checked: an inf or NaN gets a number.
    """
    _, view, ebits, mbits = _LAYOUT[Storage(storage)]
    bits = w_s.view(view).to(torch.int64) & ((1 << (ebits + mbits)) - 1)
    exponent, mantissa = bits >> mbits, bits & ((1 << mbits) - 1)
    bias = (1 << (ebits - 1)) - 1
    away = torch.ldexp(torch.ones_like(bits, dtype=torch.float64),
                       torch.clamp(exponent, min=1) - bias - mbits)
    toward = torch.where((mantissa == 0) & (exponent > 1), away / 2, away)
    negative = w_s < 0
    return torch.where(negative, away, toward), torch.where(negative, toward, away)


def update_lost(w: Tensor, dw: Tensor, storage: Storage | str) -> Tensor:
    """Whether storage loses each update ``dw`` of ``w`` (module docs): with ``w_s`` the weight
    rounded to ``storage``, whether ``w_s + dw``, exact, rounds to nearest even back to ``w_s``.

    ``w`` holds float32 or narrower values (drift train keeps its weights in float32); it is
    not taken from float64 because torch rounds float64 to the half-width types through
    float32, a double rounding. ``dw`` is compared in float64 with half the gap on its side
    (:func:`storage_gaps`), which is exact: no sum is rounded twice.
    """
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"update_lost takes float32 weights, not {w.dtype}")
    dtype, view, _, _ = _LAYOUT[Storage(storage)]
    w_s = w.to(dtype)
    down, up = storage_gaps(w_s, storage)
    even = (w_s.view(view) & 1) == 0  # the significand's last bit is the code's
    d = dw.to(torch.float64)
    half_up, half_down = up / 2, down / 2
    kept = ((d == 0)
            | ((d > 0) & ((d < half_up) | ((d == half_up) & even)))
            | ((d < 0) & ((-d < half_down) | ((-d == half_down) & even))))
    value = w_s.to(torch.float64)
    # inf + a finite update stays inf; NaN equals nothing, so it never counts as kept
    special = (value == value) & (torch.isfinite(d) | (d == value))
    return torch.where(torch.isfinite(value), kept, special)


def _exact(x: float) -> Exact:
    if math.isnan(x):
        return NAN
    if math.isinf(x):
        return Exact(Kind.INF, x < 0)
    return Exact(Kind.FINITE, math.copysign(1.0, x) < 0, abs(Fraction(x)))


def update_lost_exact(w: float, dw: float, storage: Storage | str) -> bool:
    """:func:`update_lost` for one weight, in exact rationals: the reference it is tested
    against. ``w`` is rounded to ``storage``, ``dw`` added exactly, the sum rounded again
    (nearest even, overflow to inf), and the two compared as values (−0 = +0, NaN equal to
    nothing)."""
    fmt = get_format(Storage(storage).value)
    w_s = oracle.rounding.round_exact(fmt, _exact(w), Rounding.RNE, Overflow.IEEE)
    moved = oracle.rounding.round_exact(
        fmt, oracle.rounding.total(w_s, _exact(dw)), Rounding.RNE, Overflow.IEEE
    )
    if Kind.NAN in (w_s.kind, moved.kind):
        return False
    if Kind.INF in (w_s.kind, moved.kind):
        return moved == w_s
    return moved.value == w_s.value


def next_update(ck: DriftCheckpoint, name: str, w: Tensor, g: Tensor) -> Tensor:
    """The update (float64) the run's optimizer would apply next to parameter ``name``
    (weights ``w``, gradient ``g``), continuing from the checkpoint's saved buffers."""
    train = ck.state.get("train") or {}
    kind = str(train.get("optimizer", "adamw"))
    lr = float(ck.state.get("next_lr", train.get("lr", 0.0)))
    wd = float(train.get("weight_decay", 0.0))
    w, g = w.double(), g.double()
    if kind == "sgd":
        d = g + wd * w if wd else g
        buf = ck.optimizer.get("momentum_buffer", {}).get(name)
        mu = float(train.get("momentum", 0.0))
        step = d if buf is None else mu * buf.double() + d
        return -lr * step
    if kind != "adamw":
        raise ProbeError(f"{ck.path}: optimizer {kind!r} is not one probe can continue "
                         "(adamw, sgd)")
    b1, b2 = (float(b) for b in train.get("betas", (0.9, 0.999)))
    eps = float(train.get("eps", 1e-8))
    t = int(ck.state.get("optimizer_step", ck.step)) + 1
    m0 = ck.optimizer.get("exp_avg", {}).get(name)
    v0 = ck.optimizer.get("exp_avg_sq", {}).get(name)
    m = (1 - b1) * g if m0 is None else b1 * m0.double() + (1 - b1) * g
    v = (1 - b2) * g * g if v0 is None else b2 * v0.double() + (1 - b2) * g * g
    denom = v.sqrt() / math.sqrt(1 - b2**t) + eps
    return -lr * wd * w - (lr / (1 - b1**t)) * m / denom


@dataclass(frozen=True)
class _Checkpoint:
    run: str = column("The run folder's name")
    checkpoint: str = column("The checkpoint file")
    step: int = column("The training step of the checkpoint's weights")


@dataclass(frozen=True)
class ProbeRow(GradientColumns, _Checkpoint):
    """One parameter (or all of them) at one checkpoint under one policy (the gradient columns
    are measured on the run's probe batch)."""

    TABLE: ClassVar[str] = "probe"
    KEYS: ClassVar[tuple[str, ...]] = ("run", "step", "policy", "parameter")
    HEADLINE: ClassVar[str] = "cosine"
    HIGHER_IS_WORSE: ClassVar[bool] = False

    storage: str = column("Format the weights are taken to be stored in")
    optimizer: str = column("The run's optimizer, continued from its saved buffers")
    lr: float = column("Learning rate of the run's next step (the update probed)")
    freeze_share: float = column("Share of weights that storage keeps unchanged under the next "
                                 "update from the policy's gradient: w_s + Δw, exact, rounds "
                                 "back to w_s (mean over draws)")


def _gradient(model: nn.Module, params: list[Tensor], batch: Tensor) -> list[Tensor]:
    loss = next_byte_loss(model, batch)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach()
            for g, p in zip(grads, params, strict=True)]


def next_updates(ck: DriftCheckpoint, policy: ArithmeticPolicy, batch: Tensor, *,
                 seed: int = 0) -> dict[str, Tensor]:
    """Per trainable parameter, the update (float64) the run's optimizer would take next
    (:func:`next_update`) from the gradient under ``policy`` on ``batch``, computed on a float64
    copy of the checkpoint's model; a stochastic policy draws with ``seed``."""
    ref = copy.deepcopy(ck.model).double()
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    params: list[Tensor] = [p for _, p in named]
    with arithmetic(with_seed(policy, seed), model=ref):
        grads = _gradient(ref, params, batch.long())
    return {name: next_update(ck, name, p.detach(), g)
            for (name, p), g in zip(named, grads, strict=True)}


def freeze_counts(ck: DriftCheckpoint, policy: ArithmeticPolicy, batch: Tensor, *,
                  draws: int, seed: int, storage: Storage) -> dict[str, float]:
    """Per parameter and ``*``: the share of weights the next update leaves unchanged in
    ``storage`` (:func:`update_lost`), from the gradient under ``policy`` (the mean over draws
    if stochastic)."""
    weights = {n: p.detach() for n, p in ck.model.named_parameters() if p.requires_grad}
    n = draws if policy.stochastic else 1
    frozen = dict.fromkeys(weights, 0.0)
    for d in range(n):
        for name, u in next_updates(ck, policy, batch, seed=seed + d).items():
            frozen[name] += int(update_lost(weights[name], u, storage).sum()) / n
    out = {name: frozen[name] / w.numel() for name, w in weights.items()}
    out[ALL_PARAMETERS] = sum(frozen.values()) / sum(w.numel() for w in weights.values())
    return out


def _first_difference(what: str, x: dict[str, Any], y: dict[str, Any]) -> str | None:
    for key in sorted(set(x) | set(y)):
        if x.get(key) != y.get(key):
            return f"{what} {key} {x.get(key)!r} against {y.get(key)!r}"
    return None


def training_settings(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded training settings, less the model (its shape is the config's,
    compared on its own)."""
    train = state.get("train")
    return {k: v for k, v in train.items() if k != "model"} if isinstance(train, dict) else {}


def _difference(a: tuple[ModelConfig, dict[str, Any]],
                b: tuple[ModelConfig, dict[str, Any]]) -> str | None:
    """What tells two checkpoints' runs apart, in words; None when they may be one run's."""
    (config_a, state_a), (config_b, state_b) = a, b
    if config_a.kind is not config_b.kind:
        return f"model {config_a.kind.value} against {config_b.kind.value}"
    text_a, text_b = state_a.get("text") or {}, state_b.get("text") or {}
    text = None
    # the content decides where it is recorded: the same text read from another path gives
    # the same probe batch
    if (text_a.get("sha256") or text_a.get("source")) != (text_b.get("sha256")
                                                         or text_b.get("source")):
        text = (f"recorded text {text_a.get('source')!r} (sha256 "
                f"{str(text_a.get('sha256'))[:12]}…) against {text_b.get('source')!r} (sha256 "
                f"{str(text_b.get('sha256'))[:12]}…)")
    return (_first_difference("model config", config_a.to_json(), config_b.to_json()) or text
            or _first_difference("training setting", training_settings(state_a),
                                               training_settings(state_b)))


def freeze_storage(paths: Sequence[Path], storage: Storage | str | None = None) -> Storage:
    """The storage format a freeze share of these checkpoints is counted in: ``storage`` when
    given; else the format the run stored its weights in (``drift train --storage``, recorded
    in each checkpoint's training settings) when narrower than float32; else bfloat16, the
    format a float32 run's freeze is asked about."""
    if storage is not None:
        return parse_choice(Storage, storage, "storage format")
    recorded = Storage.FLOAT32
    if paths:
        train = read_info(paths[0])[1].get("train") or {}
        recorded = parse_choice(Storage, str(train.get("storage", "float32")),
                                f"storage format recorded in {paths[0]}")
    return Storage.BFLOAT16 if recorded is Storage.FLOAT32 else recorded


def run_checkpoints(run: str | Path, pattern: str = CHECKPOINTS) -> list[Path]:
    """The checkpoints of ``run`` matching ``pattern`` (a glob inside the run folder), in the
    order of the step each records, checked to be one run's: the same model config, training
    settings and recorded text, and no step twice. Only the metadata is read."""
    folder = Path(run)
    if not folder.is_dir():
        raise ProbeError(f"run {folder} is not a folder; give the --out folder of drift train")
    found = sorted(p for p in folder.glob(pattern) if p.is_file())
    if not found:
        # an HF folder or any other checkpoint: probe takes only drift's own runs, say so
        other = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower()
                       in (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json"))
        held = f" ({folder} holds {', '.join(other[:3])}{', ...' if other[3:] else ''})"
        raise ProbeError(f"run {folder} has no checkpoint matching {pattern!r}: drift probe "
                         "takes only the run folders drift train writes"
                         f"{held if other else ''}; measure another checkpoint's tensors with "
                         "drift clip-rate, underflow-rate or error-bias, or give another "
                         "--checkpoints glob")
    info = {p: read_info(p) for p in found}
    first = found[0]
    for path in found[1:]:
        why = _difference(info[first], info[path])
        if why:
            raise ProbeError(f"{first.name} and {path.name} in {folder} are not from one run "
                             f"({why}); probe one run's checkpoints at a time (move the others "
                             "out, or choose with --checkpoints GLOB)")
    steps: dict[int, Path] = {}
    for path in found:
        step = int(info[path][1].get("step", 0))
        if step in steps:
            raise ProbeError(f"{steps[step].name} and {path.name} in {folder} both hold step "
                             f"{step}; keep one of them, or choose with --checkpoints GLOB")
        steps[step] = path
    return [steps[s] for s in sorted(steps)]


def probe_corpus(ck: DriftCheckpoint, text: str | Path | None) -> Corpus:
    """The text the probe batch is cut from: ``text`` if given, else the run's own text
    (checked against the sha256 the checkpoint recorded)."""
    if text is not None:
        return load_corpus(text)
    return recorded_corpus(ck.state.get("text") or {}, str(ck.path))


def probe_batch(ck: DriftCheckpoint, corpus: Corpus, windows: int | None = None) -> Tensor:
    """The fixed probe batch: ``windows`` (default: the run's batch size) evenly spaced
    windows of ``context + 1`` bytes from the validation split."""
    train = ck.state.get("train") or {}
    n = int(windows or train.get("batch") or 8)
    return fixed_windows(corpus.validation, n, ck.config.context + 1, corpus.source)


@dataclass(frozen=True)
class CheckpointUnit:
    """One checkpoint under every policy: the work unit of a probe on an engine (it names the
    checkpoint by path and pickles small; the worker loads it and cuts the probe batch)."""

    run: str
    """The run folder's name (the rows' ``run``)."""
    path: str
    """The checkpoint (absolute: a worker's folder is not the driver's)."""
    policies: tuple[ArithmeticPolicy, ...]
    draws: int
    seed: int
    storage: Storage
    windows: int | None
    text: str | None
    threads: int

    def key(self) -> str:
        """Everything the unit's rows depend on, the files' stamps included."""
        policies = [(p.name, p.describe(), p.seed) for p in self.policies]
        return (f"probe|{self.run}|{engines.stamp(self.path, self.text)}|{policies}|"
                f"{self.draws}|{self.seed}|{self.storage}|{self.windows}|{self.threads}")

    def check_kept(self, rows: object) -> str | None:
        """Why ``rows``, a kept unit read back under ``--resume``, cannot be this unit's (see
        :meth:`driftcli.engines.Manifest.get`), or None: rows of this run, checkpoint,
        storage and policies, shares within [0, 1], cosines within [-1, 1]."""
        if not (isinstance(rows, list) and all(isinstance(r, ProbeRow) for r in rows)):
            return "not a list of probe rows"
        names = {p.name for p in self.policies}
        for r in rows:
            if (r.run, r.checkpoint, r.storage) != (self.run, Path(self.path).name,
                                                    self.storage.value) or r.policy not in names:
                return f"a row of {r.run}/{r.checkpoint} under {r.policy}, not this unit's"
            if not (0 <= r.freeze_share <= 1 and r.numel >= 0 and 1 <= r.draws <= self.draws):
                return (f"{r.parameter}: freeze_share {r.freeze_share}, numel {r.numel}, "
                        f"draws {r.draws}")
            for cosine in (r.cosine, r.expected_cosine):
                # a float64 cosine of parallel gradients may pass 1 by its last bits
                if cosine is not None and not math.isnan(cosine) and abs(cosine) > 1 + 1e-9:
                    return f"{r.parameter}: cosine {cosine}"
        return None


def probe_unit(unit: CheckpointUnit) -> list[ProbeRow]:
    """A checkpoint's rows, policy by policy, each policy's parameters then ``*``; torch runs
    deterministically on ``unit.threads`` threads meanwhile."""
    with deterministic(unit.threads):
        ck = load_checkpoint(unit.path)
        # every checkpoint of a run records the same text (run_checkpoints), so each unit
        # cutting its own batch cuts the same one
        batch = probe_batch(ck, probe_corpus(ck, unit.text), unit.windows)
        cos = grad_cosine(ck.model, batch, next_byte_loss, unit.policies, draws=unit.draws,
                          seed=unit.seed, checkpoint=ck.path.name)
        optimizer = str((ck.state.get("train") or {}).get("optimizer", "adamw"))
        lr = float(ck.state.get("next_lr", 0.0))
        rows: list[ProbeRow] = []
        for policy in unit.policies:
            shares = freeze_counts(ck, policy, batch, draws=unit.draws, seed=unit.seed,
                                   storage=unit.storage)
            rows.extend(_row(unit.run, ck, r, unit.storage, optimizer, lr, shares[r.parameter])
                        for r in cos if r.policy == policy.name)
    return rows


def probe(run: str | Path, policies: Sequence[ArithmeticPolicy | str], *, draws: int = 8,
          seed: int = 0, checkpoints: str = CHECKPOINTS,
          storage: Storage | str | None = None, windows: int | None = None,
          text: str | Path | None = None, threads: int = 1,
          progress: Progress | None = None,
          execution: Execution | None = None) -> list[ProbeRow]:
    """The probe rows of every checkpoint of ``run`` (module docs): per checkpoint, policy
    and parameter, then ``*`` over all parameters. Torch runs deterministically on
    ``threads`` threads meanwhile (on a busy machine one thread is often the fastest).

    The checkpoints run as :class:`CheckpointUnit` s on ``execution``'s engine (serial by
    default); the rows come in step order, the same on every engine. ``progress`` is told
    the checkpoints done."""
    resolved = tuple(get_policy(p) for p in policies)
    if not resolved:
        raise ProbeError("probe needs at least one policy, e.g. --policy mxfp8_e4m3")
    if draws < 1:
        raise ProbeError(f"draws must be at least 1, not {draws}")
    paths = run_checkpoints(run, checkpoints)
    store = freeze_storage(paths, storage)
    name = Path(run).resolve().name
    given = None if text is None else str(Path(text).resolve())
    units = [CheckpointUnit(name, str(path.resolve()), resolved, draws, seed, store, windows,
                            given, threads) for path in paths]
    per_unit = engines.run(units, probe_unit, execution, progress=progress,
                           label=lambda u: Path(u.path).name)
    return [row for rows in per_unit for row in rows]


def attention_at(ck: DriftCheckpoint, policy: ArithmeticPolicy, batch: Tensor, *, run: str,
                 seed: int = 0) -> list[AttentionRow]:
    """The attention probes of one checkpoint under ``policy``: one forward and backward of
    the checkpoint's (float32) model on ``batch`` under the policy (a stochastic one draws
    with ``seed``), each attention layer counted under the casts the policy applies to P and
    to dY (:func:`driftcli.measures.probe_attention.measured_casts`); no rows for a model
    without attention."""
    model = copy.deepcopy(ck.model).float()
    if not has_attention(model):
        return []
    forward, dgrad = policy.spec(Role.FORWARD), policy.spec(Role.DGRAD)
    casts = measured_casts(None if forward is None else forward.lhs,
                           None if dgrad is None else dgrad.lhs)
    recorder = AttentionRecorder(casts)
    params = [p for p in model.parameters() if p.requires_grad]
    with arithmetic(with_seed(policy, seed), model=model), watch_attention(model, recorder):
        loss = next_byte_loss(model, batch.long())
        if bool(torch.isfinite(loss)):
            torch.autograd.grad(loss, params, allow_unused=True)
    return recorder.rows(run, ck.step, "probe", policy.name)


def probe_attention(run: str | Path, policies: Sequence[ArithmeticPolicy | str], *,
                    seed: int = 0, checkpoints: str = CHECKPOINTS, windows: int | None = None,
                    text: str | Path | None = None, threads: int = 1) -> list[AttentionRow]:
    """The attention probes (:func:`attention_at`) of every checkpoint of ``run`` under every
    policy, on the probe batch of :func:`probe`, checkpoint by checkpoint in step order;
    empty for a run of a model without attention. Runs in this process, on ``threads``
    torch threads, deterministically."""
    resolved = tuple(get_policy(p) for p in policies)
    name = Path(run).resolve().name
    rows: list[AttentionRow] = []
    with deterministic(threads):
        for path in run_checkpoints(run, checkpoints):
            ck = load_checkpoint(path)
            if not has_attention(ck.model):
                return []
            batch = probe_batch(ck, probe_corpus(ck, text), windows)
            for policy in resolved:
                rows.extend(attention_at(ck, policy, batch, run=name, seed=seed))
    return rows


def _row(run: str, ck: DriftCheckpoint, r: GradCosineRow, storage: Storage, optimizer: str,
         lr: float, share: float) -> ProbeRow:
    keep = {k: getattr(r, k) for k in (
        "policy", "policy_spec", "parameter", "shape", "numel", "cosine", "retention",
        "norm_ratio", "rel_error", "expected_cosine", "expected_retention",
        "expected_norm_ratio", "expected_rel_error", "grad_norm_exact", "loss", "loss_exact",
        "draws")}
    return ProbeRow(run=run, checkpoint=ck.path.name, step=ck.step, storage=storage.value,
                    optimizer=optimizer, lr=lr, freeze_share=share, **keep)


def summary(rows: Sequence[ProbeRow]) -> list[dict[str, Any]]:
    """The all-parameters rows as plain dicts, checkpoint by checkpoint (for printing)."""
    return [{"step": r.step, "policy": r.policy, "cosine": r.cosine, "retention": r.retention,
             "expected_cosine": r.expected_cosine, "loss": r.loss,
             "freeze_share": r.freeze_share}
            for r in rows if r.parameter == ALL_PARAMETERS]
