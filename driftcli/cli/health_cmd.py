"""``drift health``: signs that a run is failing, per parameter and checkpoint, into
``OUT/health.parquet`` (the freeze share in storage and its half-ulp prediction, the
gradient-to-noise ratio under a cast, the weights' oscillation under a cast)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

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
from driftcli.models.config import CHECKPOINTS

RunFolder = Annotated[Path, typer.Argument(
    metavar="RUN", exists=True, file_okay=False, show_default=False,
    help="A run folder written by drift train (its step-*.safetensors).")]


@command("health")
def health_command(
    run: RunFolder,
    reference: Annotated[Path | None, typer.Option(
        metavar="RUN", exists=True, file_okay=False,
        help="A high-precision run of the same steps whose trajectory predicts the freeze "
             "(default: RUN's own).")] = None,
    storage: Annotated[Storage | None, typer.Option(
        help="Format the weights are stored in, for the freeze columns (default: the run's "
             "--storage when bfloat16 or float16, else bfloat16).")] = None,
    threshold: Annotated[float, typer.Option(
        metavar="SHARE", help="The frozen share a parameter's freeze step waits for.")] = 0.5,
    cast: Annotated[str | None, typer.Option(
        "--cast", "-c", metavar="CAST",
        help="Cast of the weights for the oscillation columns (e.g. mxfp4_e2m1).")] = None,
    grad_cast: Annotated[str | None, typer.Option(
        metavar="CAST",
        help="Cast of the gradient for the gradient-to-noise ratio (e.g. nvfp4:sr).")] = None,
    state_layout: Annotated[str | None, typer.Option(
        metavar="LAYOUT",
        help="Quantized layout of Adam's moments for the optimizer-state columns: "
             "torchao-8bit, torchao-4bit, torchao-fp8 or ms-amp.")] = None,
    window: Annotated[int, typer.Option(
        metavar="N", min=1, help="Intervals between checkpoints the oscillation spans.")] = 8,
    checkpoints: Annotated[str, typer.Option(
        metavar="GLOB", help="Which checkpoints of the run.")] = CHECKPOINTS,
    batch: Annotated[int | None, typer.Option(
        metavar="N", min=1, help="Windows in the gradient's probe batch (default: the run's "
                                 "batch).")] = None,
    text: Annotated[Path | None, typer.Option(
        metavar="FILE", exists=True, dir_okay=False,
        help="Text for the probe batch (default: the run's own text).")] = None,
    seed: Annotated[int, typer.Option(
        metavar="S", min=0, help="Seed of a stochastic weight cast.")] = 0,
    threads: Annotated[int, typer.Option(
        metavar="T", min=1, help="Torch threads.")] = 1,
    out: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Folder for health.parquet (default: the run folder).")] = None,
    engine: EngineOpt = Engine.SERIAL, workers: Workers = None, ray_address: RayAddress = None,
    resume: Resume = False, overwrite: Overwrite = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q",
                                        help="No progress bar, no summary.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Signs a run is failing, per parameter and checkpoint.

    The share of weights storage froze and its half-ulp prediction from a high-precision
    trajectory, the gradient-to-noise ratio under a cast (flagged below √3), and the weights
    oscillating between grid points under a cast (TetraJet's ratio).
    """
    from driftcli.io.outputs import check_writable
    from driftcli.records.castspec import parse_cast
    from driftcli.runs.health import HEALTH_FILE, HealthRow, health, summary

    for spec in (cast, grad_cast):
        if spec is not None:
            parse_cast(spec)  # fail now, not after loading a checkpoint
    folder = run if out is None else out
    check_writable(folder)
    path = folder / HEALTH_FILE
    kept = units_dir(path)
    with table_output(path, overwrite=overwrite):
        run_on = execution(engine, workers, ray_address, kept, resume)
        with progress_bar(f"health {run.name}", Bar.ITEMS, quiet) as advance:
            rows = health(run, storage=storage, reference=reference, threshold=threshold,
                          cast=cast, grad_cast=grad_cast, window=window, windows=batch,
                          text=text, seed=seed, checkpoints=checkpoints, threads=threads,
                          state_layout=state_layout, progress=advance, execution=run_on)
        files = list(dict.fromkeys(run / r.checkpoint for r in rows))
        if reference is not None:
            files += list(dict.fromkeys(reference / r.checkpoint for r in rows))
        prov = table_provenance(files, run_on, seed=seed, extra={
            "storage": rows[0].storage if rows else None,
            "reference": None if reference is None else str(reference),
            "threshold": threshold, "cast": cast, "grad_cast": grad_cast, "window": window,
            "state_layout": state_layout,
            "checkpoints": checkpoints})
        written = write_kept(path, HealthRow, rows, prov, kept)
    totals = summary(rows)
    steps = {r.parameter: (r.freeze_step, r.predicted_freeze_step) for r in rows}
    if as_json:
        typer.echo(json.dumps({"table": str(written), "rows": totals, "freeze_steps": {
            p: {"freeze_step": a, "predicted_freeze_step": b} for p, (a, b) in steps.items()}},
            indent=2))
        return
    if quiet:
        return
    from rich.console import Console
    from rich.table import Table

    stored_in = rows[0].storage if rows else "-"
    table = Table(title=esc(f"health: {run} (all parameters; freeze in {stored_in})"))
    for col in ("step", "frozen", "predicted", "gnr", "gnr < √3", "oscillating",
                "flips/elem", "m stale", "v stale", "v → 0", "update cos"):
        table.add_column(col, justify="right")
    for t in totals:
        low = t["gnr_low"]
        table.add_row(str(t["step"]), fmt(t["frozen_share"]), fmt(t["predicted_frozen_share"]),
                      fmt(t["gnr"]), "-" if low is None else ("yes" if low else "no"),
                      fmt(t["oscillating_share"]), fmt(t["flips_mean"]),
                      fmt(t["m_stale_share"]), fmt(t["v_stale_share"]), fmt(t["v_zero_share"]),
                      fmt(t["update_cosine"]))
    console = Console(width=120)
    console.print(table)
    console.print(esc(f"first step frozen ≥ {threshold:g} (actual / predicted): " + ", ".join(
        f"{p} {fmt(a)}/{fmt(b)}" for p, (a, b) in steps.items())))
    console.print(esc(f"wrote {written}"))
