"""``drift train``: a reference model trained on text under an arithmetic policy, on CPU.

Every matmul of every step (forward, dgrad, wgrad) runs under the policy
(:func:`driftcli.arithmetic`); everything else is float32. A run is deterministic for a seed
and a thread count: the initialisation comes from ``torch.manual_seed(seed)``, the batches
from a generator seeded with ``seed``, a stochastic policy's random bits from a seed derived
from ``seed`` and the step (new bits every step), and torch runs with
``use_deterministic_algorithms`` and ``threads`` threads.

Per step ``s`` (1-based; the weights after ``s`` updates are "step s"), ``RUN/train.parquet``
holds the batch's loss, the gradient's and the update's norms and the learning rate; every
``eval_every`` steps the validation loss; every ``log_every`` steps (and at step 1) the clip
and underflow rates of the matmul operands by role. Those are the rates the policy's own
casts meet: the step runs inside :func:`driftcli.io.capture.capture`, and each captured operand
goes through :func:`driftcli.measures.stats.cast_stats` (the code behind ``drift clip-rate`` and
``drift underflow-rate``) with the cast the policy applies to it, blocked along the axis that
matmul contracts; counts are summed over a role's tensors.

The run stops at a divergence: a non-finite loss, or, after the warm-up, a loss above
``diverge_factor`` times the lowest loss so far. That step's row has ``diverged`` true and no
update is taken; ``run.json`` and the table's provenance record ``diverged_at``, and the last
finite weights are checkpointed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import ArithmeticPolicy, Role, get_policy, with_seed
from driftcli.choices import Storage, parse_choice
from driftcli.errors import DriftError
from driftcli.io.capture import capture
from driftcli.io.dumps import DUMP_KEY, ROLES
from driftcli.io.tables import column, provenance, write_table
from driftcli.measures import clip_rate, underflow_rate
from driftcli.measures.probe_attention import AttentionRecorder, AttentionRow, measured_casts
from driftcli.measures.stats import CastStats, cast_stats
from driftcli.models.checkpoint import save_checkpoint
from driftcli.models.config import CHECKPOINTS, MLPConfig, ModelConfig, OptimizerKind, Schedule
from driftcli.models.nets import (
    build_model,
    count_parameters,
    has_attention,
    next_byte_loss,
    watch_attention,
)
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Rounding
from driftcli.text import Corpus, fixed_windows, load_corpus, require_length, sample_windows

Tensor = torch.Tensor

TABLE_FILE = "train.parquet"
RUN_FILE = "run.json"
ATTENTION_FILE = "attention.parquet"
"""The attention probes of a transformer run's logged steps (``AttentionRow``)."""


class TrainError(DriftError, ValueError):
    """A training setting or run folder that cannot be used."""


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of ``step``: ``step-000100.safetensors``."""
    return f"step-{step:06d}.safetensors"


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a run (with the text): same config and text, same run."""

    model: ModelConfig = field(default_factory=MLPConfig)
    policy: str = "exact"
    """A policy preset, cast spec or .toml file (see drift grad-cosine)."""
    steps: int = 200
    seed: int = 0
    batch: int = 32
    """Windows per step; each window is ``context + 1`` bytes (``context`` predictions)."""
    lr: float = 3e-3
    schedule: Schedule = Schedule.CONSTANT
    warmup: int = 0
    """Steps of linear warm-up from 0 to ``lr``; divergence is checked only after them."""
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's moment decays."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    momentum: float = 0.9
    """SGD's momentum."""
    checkpoint_every: int = 0
    """Checkpoint at step 0 and every N steps (0: only the last step)."""
    log_every: int = 10
    """Operand clip and underflow rates at step 1 and every k steps (0: never)."""
    eval_every: int = 50
    """Validation loss every k steps and at the last (0: only at the last)."""
    eval_windows: int = 16
    """Validation windows (fixed, evenly spaced over the validation split)."""
    diverge_factor: float = 4.0
    threads: int = 1
    measure_cast: str | None = None
    """Log the operand rates under this cast instead of the policy's own (e.g. to watch
    ``mxfp8_e4m3`` clipping in an ``exact`` run)."""
    storage: Storage = Storage.FLOAT32
    """The format the weights are stored in: the initial weights and the weights after every
    optimizer step are rounded to it (nearest even), as torch's bfloat16 or float16
    parameters are; the optimizer's state stays float32 (module docs)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage", parse_choice(Storage, self.storage,
                                                         "storage format"))
        object.__setattr__(self, "schedule", parse_choice(Schedule, self.schedule, "schedule"))
        object.__setattr__(self, "optimizer",
                           parse_choice(OptimizerKind, self.optimizer, "optimizer"))
        for name in ("steps", "batch", "threads", "eval_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TrainError(f"train: {name} must be a positive integer, not {value!r}")
        for name in ("seed", "warmup", "checkpoint_every", "log_every", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TrainError(f"train: {name} must be a non-negative integer, not {value!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise TrainError(f"train: lr must be a positive number, not {self.lr!r}")
        if not (math.isfinite(self.diverge_factor) and self.diverge_factor > 1):
            raise TrainError(f"train: diverge_factor must be above 1, not {self.diverge_factor}")
        if self.weight_decay < 0 or not 0 <= self.momentum < 1 or self.eps <= 0 or not all(
                0 <= b < 1 for b in self.betas):
            raise TrainError("train: weight_decay must be ≥ 0, momentum and betas in [0, 1), "
                             "eps > 0")

    def lr_at(self, step: int) -> float:
        """The learning rate of the update taken at ``step`` (1-based)."""
        if self.warmup and step <= self.warmup:
            return self.lr * step / self.warmup
        if self.schedule is Schedule.CONSTANT or self.steps <= self.warmup:
            return self.lr
        done = (step - self.warmup) / max(1, self.steps - self.warmup)
        low = self.lr / 10
        return low + (self.lr - low) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    def to_json(self) -> dict[str, Any]:
        """The config as JSON (what run.json and the checkpoints store)."""
        data = asdict(self)
        data["model"] = self.model.to_json()
        data["schedule"] = self.schedule.value
        data["optimizer"] = self.optimizer.value
        data["storage"] = self.storage.value
        data["betas"] = list(self.betas)
        return data


@dataclass(frozen=True)
class TrainRow:
    """One step of a training run."""

    TABLE: ClassVar[str] = "train"
    KEYS: ClassVar[tuple[str, ...]] = ("run", "step")
    HEADLINE: ClassVar[str] = "loss"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    run: str = column("The run folder's name")
    step: int = column("Step (1-based): the update taken on this row's batch")
    policy: str = column("The arithmetic policy the run trains under")
    seed: int = column("The run's seed")
    lr: float = column("Learning rate of this step's update")
    loss: float = column("Mean next-byte cross-entropy of the step's batch (nats), under the "
                         "policy, before the update")
    val_loss: float | None = column("Validation loss in plain float32 (no casts) after the "
                                    "update, every eval_every steps and at the last; else null")
    grad_norm: float | None = column("‖g‖ of the step's gradient under the policy; null when the "
                                     "loss is not finite")
    update_norm: float | None = column("‖Δw‖ of the update taken; null on a divergence (none "
                                       "taken)")
    clip_rate_activation: float | None = column(
        "Logged steps: share of activation operand elements beyond the element format's max "
        "under their cast (clip-rate's clip_rate over every activation); else null")
    clip_rate_weight: float | None = column("As clip_rate_activation, for the weights")
    clip_rate_gradient: float | None = column("As clip_rate_activation, for the output "
                                              "gradients dY")
    underflow_rate_activation: float | None = column(
        "Logged steps: share of nonzero activation operand elements cast to zero "
        "(underflow-rate's underflow_rate over every activation); else null")
    underflow_rate_weight: float | None = column("As underflow_rate_activation, for the "
                                                 "weights")
    underflow_rate_gradient: float | None = column("As underflow_rate_activation, for the "
                                                   "output gradients dY")
    diverged: bool = column("Whether the run diverged at this step (then it stopped)")


@dataclass(frozen=True)
class TrainResult:
    """What a run left behind."""

    run: Path
    table: Path
    rows: tuple[TrainRow, ...]
    checkpoints: tuple[Path, ...]
    diverged_at: int | None
    parameters: int
    seconds: float
    """Wall time of the steps (text loading and setup excluded)."""
    attention: tuple[AttentionRow, ...] = ()
    """The attention probes of the logged steps (a transformer's; empty otherwise)."""
    attention_table: Path | None = None
    """Where they were written (``attention.parquet``), or None."""

    @property
    def steps_done(self) -> int:
        """Updates taken."""
        return sum(1 for r in self.rows if not r.diverged)

    @property
    def seconds_per_step(self) -> float:
        """Mean wall time of a step (checkpoints, evaluation and logging included)."""
        return self.seconds / max(1, len(self.rows))


StepProgress = Callable[[int, int, float], None]
"""Called after each step with the step, the steps in all and the step's loss."""


# --- pieces ------------------------------------------------------------------------------------

def step_seed(seed: int, step: int) -> int:
    """The random-bit seed of a stochastic policy at ``step`` of a run seeded ``seed``."""
    digest = hashlib.blake2b(f"train:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Torch set to deterministic algorithms and ``threads`` threads, restored afterwards."""
    was_threads = torch.get_num_threads()
    was_det = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(was_threads)
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)


def _operand_cast(policy: ArithmeticPolicy, measure: Cast | None, slot: str) -> Cast | None:
    """The cast a policy applies at ``slot`` (``forward.lhs``, ``forward.rhs``,
    ``dgrad.lhs``), or ``measure`` when given."""
    if measure is not None:
        return measure
    role, side = slot.split(".")
    spec = policy.spec(Role(role))
    return None if spec is None else getattr(spec, side)


def operand_rates(dump: Path, policy: ArithmeticPolicy,
                  measure: Cast | None = None) -> dict[str, float | None]:
    """Clip and underflow rates per role of a drift dump's operands under the casts ``policy``
    applies to them, module by module (or ``measure`` for every operand): columns
    ``clip_rate_ROLE`` and ``underflow_rate_ROLE``, null for a role nothing casts.

    Each tensor is cast as its first matmul reads it: an activation on the left of the forward
    and an output gradient (the left of dgrad) blocked along their last axis, a linear weight
    ``(out, in)`` along its last axis, an activation on the right of a plain matmul
    (``k``ᵀ, ``v``) along its second-to-last.
    """
    from safetensors import safe_open

    parts: dict[str, list[CastStats]] = {r: [] for r in ROLES}
    with safe_open(str(dump), framework="pt") as fh:
        entries = json.loads((fh.metadata() or {})[DUMP_KEY])["tensors"]
        for name, entry in entries.items():
            slot = entry["operand"].split()[0]
            # a module kept plain or overridden (drift advise's bf16 layers) casts as it runs
            own = policy.module_policy(entry["layer"]) if measure is None else policy
            c = None if own is None else _operand_cast(own, measure, slot)
            if c is None or entry["role"] not in parts:
                continue
            x = fh.get_tensor(name)
            axis = -2 if slot == "forward.rhs" and entry["role"] == "activation" else -1
            seed = 0 if c.rounding is Rounding.SR else None  # counts do not depend on bits
            st, _ = cast_stats(x.float(), c, axis=axis, seed=seed, want_values=False)
            parts[entry["role"]].append(st)
    out: dict[str, float | None] = {}
    for role, stats in parts.items():
        merged = (CastStats.merge(stats, False),) if stats else None
        out[f"clip_rate_{role}"] = (
            clip_rate.columns(merged, None)["clip_rate"] if merged else None)
        out[f"underflow_rate_{role}"] = (
            underflow_rate.columns(merged, None)["underflow_rate"] if merged else None)
    return out


def _make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if config.optimizer is OptimizerKind.ADAMW:
        return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                 weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                           weight_decay=config.weight_decay)


def optimizer_buffers(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Tensor]]:
    """The optimizer's tensor state as ``{buffer: {parameter name: tensor}}``."""
    out: dict[str, dict[str, Tensor]] = {}
    for name, p in model.named_parameters():
        for buffer, value in opt.state.get(p, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0:
                out.setdefault(buffer, {})[name] = value
    return out


_STORAGE_DTYPES = {Storage.BFLOAT16: torch.bfloat16, Storage.FLOAT16: torch.float16}


def store_weights(params: Sequence[Tensor], storage: Storage) -> None:
    """Round each parameter, in place, once to nearest even in ``storage`` (float32: nothing
    to do). The values stay float32 tensors, so every matmul and the optimizer see exactly
    the stored weights, and the optimizer's moments stay float32."""
    dtype = _STORAGE_DTYPES.get(storage)
    if dtype is None:
        return
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(dtype).float())


def _prepare(run: Path, overwrite: bool) -> None:
    old = [p for p in (run / TABLE_FILE, run / RUN_FILE, run / ATTENTION_FILE,
                       run / "probe.parquet", run / "probe-attention.parquet") if p.exists()]
    old += sorted(run.glob(CHECKPOINTS)) if run.is_dir() else []
    if old and not overwrite:
        raise TrainError(f"run folder {run} already holds a run ({old[0].name}); give a new "
                         "--out or --overwrite to replace it")
    for p in old:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    run.mkdir(parents=True, exist_ok=True)


def _norm(tensors: list[Tensor]) -> float:
    return math.sqrt(math.fsum(float(t.double().pow(2).sum()) for t in tensors))


# --- the run -----------------------------------------------------------------------------------

def train(config: TrainConfig, out: str | Path, text: str | Path | None = None, *,
          overwrite: bool = False, progress: StepProgress | None = None,
          corpus: Corpus | None = None) -> TrainResult:
    """Train ``config.model`` on ``text`` (a file; None: the Shakespeare corpus) into the run
    folder ``out``: ``train.parquet``, ``run.json`` and ``step-NNNNNN.safetensors``
    checkpoints (module docs). ``overwrite`` replaces a run already in ``out``."""
    run = Path(out)
    policy = get_policy(config.policy)
    measure = None if config.measure_cast is None else parse_cast(config.measure_cast)
    corpus = corpus if corpus is not None else load_corpus(text)
    length = config.model.context + 1
    val = fixed_windows(corpus.validation, config.eval_windows, length, corpus.source)
    require_length(corpus.train, length, "training", corpus.source)
    _prepare(run, overwrite)
    watched = measure is not None or any(
        _operand_cast(policy, None, s) is not None
        for s in ("forward.lhs", "forward.rhs", "dgrad.lhs"))
    base_state = {"seed": config.seed, "policy": policy.name, "policy_spec": policy.describe(),
                  "train": config.to_json(),
                  "text": corpus.describe()}
    rows: list[TrainRow] = []
    attention: list[AttentionRow] = []
    lenses = measured_casts(_operand_cast(policy, None, "forward.lhs"),
                            _operand_cast(policy, None, "dgrad.lhs"),
                            () if measure is None else (measure,))
    checkpoints: list[Path] = []
    diverged_at: int | None = None
    with deterministic(config.threads):
        torch.manual_seed(config.seed)
        model = build_model(config.model)
        model.train()
        params = list(model.parameters())
        store_weights(params, config.storage)
        opt = _make_optimizer(config, model)
        gen = torch.Generator().manual_seed(config.seed)
        probed = has_attention(model)

        def save(step: int, loss: float | None) -> None:
            state = {**base_state, "step": step, "loss": loss, "diverged_at": diverged_at,
                     "lr": config.lr_at(step) if step else 0.0,
                     "next_lr": config.lr_at(step + 1), "optimizer_step": step}
            path = save_checkpoint(run / checkpoint_name(step), model, config.model, state,
                                   optimizer_buffers(model, opt))
            checkpoints.append(path)

        if config.checkpoint_every:
            save(0, None)
        lowest = math.inf
        start = time.perf_counter()
        for step in range(1, config.steps + 1):
            lr = config.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = sample_windows(corpus.train, config.batch, length, gen, corpus.source)
            log_step = config.log_every > 0 and (step == 1 or step % config.log_every == 0)
            logged = watched and log_step
            recorder = AttentionRecorder(lenses) if log_step and probed else None
            opt.zero_grad(set_to_none=True)
            rates: dict[str, float | None] = {}
            with tempfile.TemporaryDirectory() if logged else nullcontext() as tmp:
                dump = Path(tmp) / "operands.safetensors" if tmp else None
                with arithmetic(with_seed(policy, step_seed(config.seed, step)), model=model), \
                        capture(model, dump, step=step) if dump else nullcontext(), \
                        watch_attention(model, recorder) if recorder is not None else nullcontext():
                    loss_t = next_byte_loss(model, batch)
                    loss = float(loss_t.detach())
                    if math.isfinite(loss):
                        loss_t.backward()
                if dump is not None:
                    rates = operand_rates(dump, policy, measure)
            if recorder is not None:
                attention.extend(recorder.rows(run.name, step, "train", policy.name))
            finite = math.isfinite(loss)
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = _norm(grads) if finite else None
            if not finite or (step > config.warmup and loss > config.diverge_factor * lowest):
                diverged_at = step
                rows.append(TrainRow(run.name, step, policy.name, config.seed, lr, loss, None,
                                     grad_norm, None, **_rate_columns(rates), diverged=True))
                if progress:
                    progress(step, config.steps, loss)
                break
            lowest = min(lowest, loss)
            before = [p.detach().clone() for p in params]
            opt.step()
            store_weights(params, config.storage)
            update_norm = _norm([p.detach() - b for p, b in zip(params, before, strict=True)])
            last = step == config.steps
            val_loss = None
            if last or (config.eval_every and step % config.eval_every == 0):
                val_loss = evaluate(model, val)
            rows.append(TrainRow(run.name, step, policy.name, config.seed, lr, loss, val_loss,
                                 grad_norm, update_norm, **_rate_columns(rates),
                                 diverged=False))
            if last or (config.checkpoint_every and step % config.checkpoint_every == 0):
                save(step, loss)
            if progress:
                progress(step, config.steps, loss)
        seconds = time.perf_counter() - start
        if diverged_at is not None:
            done = diverged_at - 1
            weights_ok = all(bool(torch.isfinite(p).all()) for p in params)
            if weights_ok and not any(p.name == checkpoint_name(done) for p in checkpoints):
                save(done, rows[-2].loss if len(rows) > 1 else None)
    n_params = count_parameters(model)
    prov = provenance([corpus.path], seed=config.seed, extra={
        "train": config.to_json(), "policy_spec": policy.describe(), "text": corpus.source,
        "diverged_at": diverged_at, "parameters": n_params,
        "checkpoints": [p.name for p in checkpoints]})
    table = write_table(run / TABLE_FILE, TrainRow, rows, prov)
    attention_table = (write_table(run / ATTENTION_FILE, AttentionRow, attention, prov)
                       if attention else None)
    result = TrainResult(run, table, tuple(rows), tuple(checkpoints), diverged_at, n_params,
                         seconds, tuple(attention), attention_table)
    _write_run_json(result, config, corpus, policy)
    return result


def _rate_columns(rates: dict[str, float | None]) -> dict[str, float | None]:
    return {f"{kind}_{role}": rates.get(f"{kind}_{role}")
            for kind in ("clip_rate", "underflow_rate") for role in ROLES}


def evaluate(model: nn.Module, windows: Tensor) -> float:
    """The model's mean next-byte loss on ``windows`` in plain float32 (no policy)."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float(next_byte_loss(model, windows))
    finally:
        model.train(was)


def _write_run_json(result: TrainResult, config: TrainConfig, corpus: Corpus,
                    policy: ArithmeticPolicy) -> None:
    last = result.rows[-1] if result.rows else None
    vals = [r.val_loss for r in result.rows if r.val_loss is not None]
    data = {"run": result.run.name, "config": config.to_json(), "policy_spec": policy.describe(),
            "text": {**corpus.describe(), "bytes": len(corpus.data)},
            "parameters": result.parameters, "steps_done": result.steps_done,
            "diverged_at": result.diverged_at, "final_loss": last.loss if last else None,
            "final_val_loss": vals[-1] if vals else None,
            "checkpoints": [p.name for p in result.checkpoints],
            "seconds": round(result.seconds, 3),
            "seconds_per_step": round(result.seconds_per_step, 5)}
    path = result.run / RUN_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
