"""``drift train``, ``drift dump``, ``drift probe``: training runs of the reference models, one
step's matmul operands, and other arithmetic probed at a run's checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from driftcli.choices import Engine, Storage
from driftcli.cli.app import command
from driftcli.cli.run import (
    Bar,
    EngineOpt,
    Overwrite,
    RayAddress,
    Resume,
    Workers,
    execution,
    fmt,
    progress_bar,
    table_output,
    table_provenance,
    units_dir,
    write_kept,
)
from driftcli.escaping import for_terminal as esc
from driftcli.models.config import (
    CHECKPOINTS,
    Activation,
    MLPConfig,
    ModelConfig,
    ModelError,
    ModelKind,
    OptimizerKind,
    Schedule,
    TransformerConfig,
)

if TYPE_CHECKING:
    from rich.table import Table

    from driftcli.measures.probe_attention import AttentionRow
    from driftcli.runs.training import TrainResult

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no summary.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")]
TextOpt = Annotated[Path | None, typer.Option(
    metavar="FILE", exists=True, dir_okay=False,
    help="Any text file (default: Shakespeare's plays, fetched once and cached).")]

Threads = Annotated[int, typer.Option(
    metavar="T", min=1, help="Torch threads (results are deterministic per thread count).")]

DEFAULT_LR = {OptimizerKind.ADAMW: 3e-3, OptimizerKind.SGD: 0.1}
"""The learning rate when --lr is not given."""


def model_config(model: ModelKind, width: int | None, layers: int | None,
                 context: int | None, embed: int | None, heads: int | None,
                 activation: Activation | None) -> ModelConfig:
    """The model config the train options describe (unset sizes take the defaults); an
    option of the other model family is an error rather than silently ignored."""
    given: dict[str, Any] = {k: v for k, v in (("layers", layers), ("context", context))
                             if v is not None}
    if model is ModelKind.MLP:
        wrong = [o for o, v in (("--heads", heads), ("--activation", activation)) if v is not None]
        if wrong:
            raise ModelError(f"{', '.join(wrong)} set the transformer's shape; add --model "
                             "transformer or leave them out")
        sizes = {k: v for k, v in (("hidden", width), ("embed", embed)) if v is not None}
        return MLPConfig(**given, **sizes)
    if embed is not None:
        raise ModelError("--embed sets the MLP's byte embedding; the transformer's is --d-model")
    extra: dict[str, Any] = {k: v for k, v in (("d_model", width), ("heads", heads),
                                               ("activation", activation)) if v is not None}
    return TransformerConfig(**given, **extra)


def attention_table(rows: list[AttentionRow], title: str) -> Table:
    """The attention probes as a terminal table (a cast named by its preset where it is
    one)."""
    from rich.table import Table

    from driftcli.records.presets import PRESETS

    names = {str(c): name for name, (c, _) in reversed(PRESETS.items())}
    table = Table(title=esc(title))
    heads = ("step", "policy", "layer", "cast", "logit_max", "P mass ≥0.5", "P clip",
             "P underflow", "dY(P·v) clip", "dY(P·v) uf", "dY(q·kᵀ) clip", "dY(q·kᵀ) uf")
    for head in heads:
        table.add_column(head, justify="left" if head in ("policy", "layer", "cast") else "right")
    for r in rows:
        table.add_row(str(r.step), esc(r.policy), esc(r.layer), esc(names.get(r.cast, r.cast)),
                      fmt(r.logit_max, ".3f"), fmt(r.p_mass_high, ".4f"),
                      *(fmt(v, ".4f") for v in (r.p_clip_rate, r.p_underflow_rate,
                                                r.dy_pv_clip_rate, r.dy_pv_underflow_rate,
                                                r.dy_qk_clip_rate, r.dy_qk_underflow_rate)))
    return table


def train_summary(result: TrainResult) -> dict[str, Any]:
    """What ``drift train`` prints: the run.json contents."""
    return json.loads((result.run / "run.json").read_text(encoding="utf-8"))


@command("train")
def train_command(
    out: Annotated[Path, typer.Option(metavar="RUN", help="The run folder.")],
    model: Annotated[ModelKind, typer.Option(help="The model family.")] = ModelKind.MLP,
    policy: Annotated[str, typer.Option(
        "--policy", "-p", metavar="P",
        help="Arithmetic of every matmul: a preset (exact, float32, mxfp8_e4m3, ...), a cast "
             "spec or a .toml policy file.")] = "exact",
    steps: Annotated[int, typer.Option(metavar="N", min=1, help="Updates.")] = 200,
    seed: Annotated[int, typer.Option(metavar="S", min=0, help="Seed of everything.")] = 0,
    width: Annotated[int | None, typer.Option(
        "--d-model", "--hidden", metavar="W", min=1,
        help="Width: the MLP's hidden layers (default 128), the transformer's d_model "
             "(default 64).")] = None,
    layers: Annotated[int | None, typer.Option(
        metavar="L", min=1, help="Hidden tanh layers / transformer blocks (default 2).")] = None,
    context: Annotated[int | None, typer.Option(
        metavar="C", min=1, help="Bytes the model sees (default 16 MLP, 64 transformer).")
    ] = None,
    embed: Annotated[int | None, typer.Option(
        metavar="E", min=1, help="MLP: embedding width per byte (default 16).")] = None,
    heads: Annotated[int | None, typer.Option(
        metavar="H", min=1, help="Transformer: attention heads (default 4).")] = None,
    activation: Annotated[Activation | None, typer.Option(
        help="Transformer: the MLP's nonlinearity (default gelu).")] = None,
    batch: Annotated[int, typer.Option(metavar="B", min=1, help="Windows per step.")] = 32,
    lr: Annotated[float | None, typer.Option(
        metavar="LR", help="Learning rate (default 3e-3 adamw, 0.1 sgd).")] = None,
    schedule: Annotated[Schedule, typer.Option(help="Learning-rate schedule.")] = (
        Schedule.CONSTANT),
    warmup: Annotated[int, typer.Option(
        metavar="N", min=0, help="Linear warm-up steps; divergence is checked after them.")
    ] = 0,
    optimizer: Annotated[OptimizerKind, typer.Option(help="Optimizer.")] = OptimizerKind.ADAMW,
    weight_decay: Annotated[float, typer.Option(
        metavar="WD", min=0.0,
        help="Decoupled weight decay (AdamW) or L2 added to the gradient (SGD).")] = 0.0,
    checkpoint_every: Annotated[int, typer.Option(
        metavar="N", min=0, help="Checkpoint at step 0 and every N steps (0: the last only).")
    ] = 0,
    log_every: Annotated[int, typer.Option(
        metavar="K", min=0, help="Operand clip/underflow rates every K steps (0: never).")
    ] = 10,
    eval_every: Annotated[int, typer.Option(
        metavar="K", min=0, help="Validation loss every K steps (0: the last only).")] = 50,
    text: TextOpt = None,
    diverge_factor: Annotated[float, typer.Option(
        metavar="F", help="Diverged: loss above F × its running minimum (or not finite).")
    ] = 4.0,
    threads: Threads = 1,
    measure_cast: Annotated[str | None, typer.Option(
        metavar="SPEC", help="Log operand rates under this cast instead of the policy's own.")
    ] = None,
    storage: Annotated[Storage, typer.Option(
        help="Format the weights are stored in: rounded to it after every step (the "
             "optimizer's state stays float32).")] = Storage.FLOAT32,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a run already in the folder.")] = False,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Train a small model on text under an arithmetic policy.

    The tanh MLP language model or a small transformer.
    """
    from rich.console import Console
    from rich.table import Table

    from driftcli.arith.policy import get_policy
    from driftcli.io.outputs import check_writable
    from driftcli.runs.training import TrainConfig, train

    config = TrainConfig(
        model=model_config(model, width, layers, context, embed, heads, activation),
        policy=policy, steps=steps, seed=seed, batch=batch,
        lr=DEFAULT_LR[optimizer] if lr is None else lr, schedule=schedule, warmup=warmup,
        optimizer=optimizer, weight_decay=weight_decay, checkpoint_every=checkpoint_every,
        log_every=log_every, eval_every=eval_every, diverge_factor=diverge_factor,
        threads=threads, measure_cast=measure_cast, storage=storage)
    get_policy(policy)  # fail now, not after loading the text
    check_writable(out)
    with progress_bar(f"train {out.name}", Bar.ITEMS, quiet) as advance:
        result = train(config, out, text, overwrite=overwrite,
                       progress=lambda step, total, loss: advance(step, total, f"loss {loss:.4f}"))
    summary = train_summary(result)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    elif not quiet:
        console = Console(width=120)
        table = Table(title=esc(f"train: {out}"))
        for col in ("model", "params", "policy", "steps", "loss", "val_loss", "diverged_at",
                    "s/step"):
            table.add_column(col, justify="left" if col in ("model", "policy") else "right")
        table.add_row(config.model.kind.value, str(result.parameters), esc(policy),
                      str(result.steps_done), fmt(summary["final_loss"], ".4f"),
                      fmt(summary["final_val_loss"], ".4f"),
                      "-" if result.diverged_at is None else str(result.diverged_at),
                      f"{result.seconds_per_step:.4f}")
        console.print(table)
        if result.attention:
            last = max(r.step for r in result.attention)
            console.print(attention_table([r for r in result.attention if r.step == last],
                                          f"train: {out} (attention, last logged step)"))
        names = ", ".join(p.name for p in result.checkpoints) or "none"
        wrote = ", ".join(str(p) for p in (result.table, out / "run.json",
                                           result.attention_table) if p is not None)
        console.print(esc(f"wrote {wrote}; checkpoints: {names}"))


@command("dump")
def dump_command(
    checkpoint: Annotated[Path, typer.Argument(
        metavar="CHECKPOINT", exists=True, show_default=False,
        help="A drift checkpoint (step-*.safetensors) or a Hugging Face model folder.")],
    out: Annotated[Path, typer.Option(metavar="FILE", help="The dump to write.")] = Path(
        "drift-out/dump.safetensors"),
    text: Annotated[Path | None, typer.Option(
        metavar="FILE", exists=True, dir_okay=False,
        help="Text for the batch (default: a drift run's own text).")] = None,
    batch: Annotated[int, typer.Option(metavar="N", min=1, help="Windows in the batch.")] = 8,
    context: Annotated[int | None, typer.Option(
        metavar="C", min=1, help="Tokens the model reads per window (default: its context).")
    ] = None,
    seed: Annotated[int, typer.Option(metavar="S", min=0, help="Seed of the windows.")] = 0,
    policy: Annotated[str | None, typer.Option(
        "--policy", "-p", metavar="P", help="Run the step under this policy (default: plain "
        "float32); the dump holds the operands before its casts.")] = None,
    threads: Threads = 1,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Record every matmul operand of one training step.

    One forward and backward step, into a drift dump.
    """
    from driftcli.io.outputs import check_writable
    from driftcli.runs.dump import dump_operands

    check_writable(out, folder=False)
    result = dump_operands(checkpoint, out, text, windows=batch, context=context, seed=seed,
                           policy=policy, threads=threads)
    summary = {"dump": str(result.path), "checkpoint": str(checkpoint), "kind": result.kind,
               "step": result.step, "batch_shape": list(result.batch_shape),
               "loss": result.loss, "tensors": len(result.names), "roles": result.roles,
               "text": str(result.text)}
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    elif not quiet:
        roles = ", ".join(f"{n} {r}" for r, n in sorted(result.roles.items()))
        typer.echo(esc(f"wrote {result.path}: {len(result.names)} tensors ({roles}) from a "
                       f"batch of {result.batch_shape[0]}×{result.batch_shape[1]} tokens, loss "
                       f"{result.loss:.4f}", markup=False))


@command("probe")
def probe_command(
    run: Annotated[Path, typer.Argument(
        metavar="RUN", exists=True, file_okay=False, show_default=False,
        help="A run folder written by drift train.")],
    policy: Annotated[list[str], typer.Option(
        "--policy", "-p", metavar="P", show_default=False,
        help="A policy preset, cast spec or .toml policy file; repeatable.")],
    draws: Annotated[int, typer.Option(
        metavar="N", min=1, help="Gradients drawn under a stochastic (sr) policy.")] = 8,
    seed: Annotated[int, typer.Option(
        metavar="S", min=0, help="Seed of the first draw (draw d uses S + d).")] = 0,
    checkpoints: Annotated[str, typer.Option(
        metavar="GLOB", help="Which checkpoints of the run.")] = CHECKPOINTS,
    storage: Annotated[Storage | None, typer.Option(
        help="Format the weights are stored in, for the update-freeze share (default: the "
             "run's --storage when bfloat16 or float16, else bfloat16).")] = None,
    batch: Annotated[int | None, typer.Option(
        metavar="N", min=1, help="Windows in the probe batch (default: the run's batch).")
    ] = None,
    text: Annotated[Path | None, typer.Option(
        metavar="FILE", exists=True, dir_okay=False,
        help="Text for the probe batch (default: the run's own text).")] = None,
    threads: Threads = 1,
    quiet: Quiet = False,
    as_json: AsJson = False,
    out: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Folder for probe.parquet and probe-attention.parquet (default: "
                            "the run folder).")] = None,
    engine: EngineOpt = Engine.SERIAL, workers: Workers = None, ray_address: RayAddress = None,
    resume: Resume = False, overwrite: Overwrite = False,
) -> None:
    """Other policies' gradients at a run's own checkpoints.

    Gradient metrics, loss and update-freeze share, per checkpoint and policy.
    """
    from rich.console import Console
    from rich.table import Table

    from driftcli.arith.policy import get_policy
    from driftcli.io.outputs import check_writable
    from driftcli.io.tables import write_table
    from driftcli.measures.grad_cosine import ALL_PARAMETERS
    from driftcli.measures.probe_attention import AttentionRow
    from driftcli.runs.probe import (
        ATTENTION_PROBE_FILE,
        PROBE_FILE,
        ProbeRow,
        probe,
        probe_attention,
    )

    resolved = [get_policy(p) for p in policy]  # fail now, not after loading a checkpoint
    folder = run if out is None else out
    check_writable(folder)  # a read-only run folder: one line now, not after the gradients
    probe_table = folder / PROBE_FILE
    kept = units_dir(probe_table)
    with table_output(probe_table, overwrite=overwrite), \
            table_output(folder / ATTENTION_PROBE_FILE, overwrite=overwrite):
        run_on = execution(engine, workers, ray_address, kept, resume)
        with progress_bar(f"probe {run.name}", Bar.ITEMS, quiet) as advance:
            rows = probe(run, resolved, draws=draws, seed=seed, checkpoints=checkpoints,
                         storage=storage, windows=batch, text=text, threads=threads,
                         progress=advance, execution=run_on)
        files = list(dict.fromkeys(run / r.checkpoint for r in rows))  # in step order
        prov = table_provenance(files, run_on, seed=seed, extra={
            "policies": policy, "draws": draws,
            "storage": rows[0].storage if rows else None,
            "checkpoints": checkpoints})
        path = write_kept(probe_table, ProbeRow, rows, prov, kept)
        attention = probe_attention(run, resolved, seed=seed, checkpoints=checkpoints,
                                    windows=batch, text=text, threads=threads)
        attention_path = (write_table(folder / ATTENTION_PROBE_FILE, AttentionRow, attention,
                                      prov) if attention else None)
    totals = [r for r in rows if r.parameter == ALL_PARAMETERS]
    if as_json:
        typer.echo(json.dumps({"table": str(path), "attention_table": (
            None if attention_path is None else str(attention_path)), "rows": [
            {k: getattr(r, k) for k in ("step", "policy", "cosine", "retention",
                                        "expected_cosine", "loss", "loss_exact",
                                        "freeze_share")} for r in totals]}, indent=2))
    elif not quiet:
        table = Table(title=esc(f"probe: {run} (all parameters; freeze share in "
                                f"{totals[0].storage if totals else '-'})"))
        for col in ("step", "policy", "cosine", "retention", "E[ĝ] cosine", "loss",
                    "freeze share"):
            table.add_column(col, justify="left" if col == "policy" else "right")
        for r in totals:
            table.add_row(str(r.step), esc(r.policy), fmt(r.cosine, ".6f"),
                          fmt(r.retention, ".6f"), fmt(r.expected_cosine, ".6f"),
                          fmt(r.loss, ".4f"), fmt(r.freeze_share, ".4f"))
        console = Console(width=120)
        console.print(table)
        if attention:
            console.print(attention_table(attention, f"probe: {run} (attention)"))
        console.print(esc(f"wrote {path}" + ("" if attention_path is None
                                              else f", {attention_path}")))
