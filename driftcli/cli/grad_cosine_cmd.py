"""``drift grad-cosine``: the gradient under arithmetic policies against the exact gradient, at
one checkpoint and one batch, into ``OUT/grad-cosine.parquet``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from driftcli.choices import Engine
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
    publish,
    table_output,
    table_provenance,
    units_dir,
)
from driftcli.escaping import for_terminal as esc

OUT = Path("drift-out")


def _print(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=esc(f"grad-cosine: {summary['checkpoint']} (all parameters)"))
    for col in ("policy", "cosine", "retention", "norm_ratio", "rel_error", "loss", "draws",
                "lowest cosine"):
        table.add_column(col, justify="left" if col in ("policy", "lowest cosine") else "right")
    for p in summary["policies"]:
        low = p["worst"][0] if p["worst"] else None
        lowest = "-" if low is None else f"{low['parameter']} {fmt(low['cosine'], '.4f')}"
        table.add_row(esc(p["policy"]), fmt(p["cosine"], ".6f"), fmt(p["retention"], ".6f"),
                      fmt(p["norm_ratio"], ".4f"), fmt(p["rel_error"], ".3g"),
                      fmt(p["loss"], ".5f"), str(p["draws"]), esc(lowest))
    out = Console(width=160)
    out.print(table)
    out.print(f"exact loss {fmt(summary['loss_exact'], '.5f')}; wrote {esc(summary['table'])}")


@command("grad-cosine")
def grad_cosine_command(
    checkpoint: Annotated[Path, typer.Argument(
        metavar="CHECKPOINT", exists=True, show_default=False,
        help="A drift model checkpoint (drift train's step-*.safetensors) or a Hugging Face "
             "causal-LM folder (needs transformers, the optional extra hf).")],
    policy: Annotated[list[str], typer.Option(
        "--policy", "-p", metavar="P", show_default=False,
        help="A policy preset (exact, float32, mxfp8_e4m3, nvfp4, ...), a cast spec or a "
             ".toml policy file; repeatable.")],
    text: Annotated[Path | None, typer.Option(
        metavar="FILE", exists=True, dir_okay=False,
        help="Text tokenized with the checkpoint's tokenizer.")] = None,
    batch: Annotated[Path | None, typer.Option(
        metavar="FILE", exists=True, dir_okay=False,
        help="A safetensors file with an integer tensor input_ids (tokens,) or "
             "(windows, tokens).")] = None,
    tokens: Annotated[int, typer.Option(
        metavar="N", min=2, help="Tokens per window of --text.")] = 128,
    windows: Annotated[int, typer.Option(
        metavar="W", min=1, help="Consecutive windows of --text in the batch.")] = 1,
    draws: Annotated[int, typer.Option(
        metavar="N", min=1, help="Gradients drawn under a stochastic (sr) policy.")] = 8,
    seed: Annotated[int, typer.Option(
        metavar="S", min=0, help="Seed of the first draw (draw d uses S + d).")] = 0,
    out: Annotated[Path, typer.Option(metavar="DIR", help="Folder for the table.")] = OUT,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    engine: EngineOpt = Engine.SERIAL, workers: Workers = None, ray_address: RayAddress = None,
    resume: Resume = False, overwrite: Overwrite = False,
) -> None:
    """Gradient under a policy against the exact gradient.

    Cosine, retention, norm ratio and relative error against the float64 gradient, per
    parameter and over all parameters.
    """
    from driftcli.arith.policy import get_policy
    from driftcli.io.outputs import check_writable
    from driftcli.io.tables import identify_in_background
    from driftcli.measures.grad_cosine import (
        BatchSource,
        GradCosineRow,
        grad_cosine_checkpoint,
        load_input,
        summarize,
    )

    resolved = [get_policy(p) for p in policy]  # fail now, not after loading the model
    check_writable(out)  # fail now, not after the gradients
    source = BatchSource(None if text is None else str(text),
                         None if batch is None else str(batch), tokens, windows)
    path = out / f"{GradCosineRow.TABLE}.parquet"
    with table_output(path, overwrite=overwrite):  # before any work, held to the end
        run_on = execution(engine, workers, ray_address, units_dir(path), resume)
        # loaded here too: a bad checkpoint or batch fails before any worker starts, and the
        # serial engine's units take this load
        loaded = load_input(checkpoint, source)
        files, kind, shape = [*loaded.lm.files, source.path], loaded.lm.kind, list(loaded.ids.shape)
        del loaded  # on other engines the workers load their own: no model held here meanwhile
        identities = identify_in_background(files)  # beside the gradients
        with progress_bar("grad-cosine", Bar.ITEMS, quiet) as advance:
            rows = grad_cosine_checkpoint(checkpoint, source, resolved, draws=draws, seed=seed,
                                          execution=run_on, progress=advance)
        prov = table_provenance(files, run_on, seed=seed, identities=identities(), extra={
            "checkpoint_kind": kind, "policies": policy, "draws": draws,
            "batch_shape": shape, "tokens": tokens if text is not None else None,
            "windows": windows if text is not None else None})
        publish(path, GradCosineRow, rows, prov, summarize(rows, path), _print,
                as_json=as_json, quiet=quiet, units=units_dir(path))
