"""``drift advise``: rank a model's layers by their sensitivity to a cast and write the policy
that keeps the most sensitive in high precision within a budget of matmul work, into
``OUT/advise.parquet`` and ``OUT/advise.toml``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from driftcli.cli.app import command
from driftcli.cli.run import Overwrite, fmt, publish, table_output, table_provenance
from driftcli.escaping import for_terminal as esc

OUT = Path("drift-out")


def _print(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=esc(f"advise: {summary['checkpoint']} under {summary['cast']}"))
    for col in ("rank", "layer", "score", "loss_delta", "cosine", "layer_cosine",
                "work_share", "kept"):
        table.add_column(col, justify="left" if col in ("layer", "kept") else "right")
    for r in summary["layers"]:
        table.add_row(str(r["rank"]), esc(r["layer"]), fmt(r["score"], ".4g"),
                      fmt(r["loss_delta"], ".3g"), fmt(r["cosine"], ".6f"),
                      fmt(r["layer_cosine"], ".6f"), fmt(r["work_share"], ".4f"),
                      "yes" if r["kept"] else "")
    out = Console(width=160)
    out.print(table)
    out.print(f"kept {fmt(summary['kept_share'], '.4f')} of the matmul work (budget "
              f"{summary['budget']}); wrote {esc(summary['table'])} and "
              f"{esc(summary['policy_file'])}")


@command("advise")
def advise_command(
    checkpoint: Annotated[Path, typer.Argument(
        metavar="CHECKPOINT", exists=True, show_default=False,
        help="A drift model checkpoint (drift train's step-*.safetensors) or a Hugging Face "
             "causal-LM folder (needs driftcli[hf], i.e. transformers).")],
    cast: Annotated[str, typer.Option(
        "--cast", "-c", metavar="C", show_default=False,
        help="The cast of every layer not kept: a policy preset (mxfp8_e4m3, nvfp4, ...), a "
             "cast spec or a .toml policy file.")],
    budget: Annotated[float, typer.Option(
        metavar="B", help="Share of the matmul work kept in bfloat16, in [0, 1].")] = 0.15,
    text: Annotated[Path | None, typer.Option(
        metavar="FILE", exists=True, dir_okay=False,
        help="Text tokenized with the checkpoint's tokenizer.")] = None,
    batch: Annotated[Path | None, typer.Option(
        metavar="FILE", exists=True, dir_okay=False,
        help="A safetensors file with an integer tensor input_ids (windows, tokens).")] = None,
    tokens: Annotated[int, typer.Option(
        metavar="N", min=2, help="Tokens per window of --text.")] = 64,
    windows: Annotated[int, typer.Option(
        metavar="W", min=1, help="Windows per batch of --text.")] = 1,
    batches: Annotated[int, typer.Option(
        metavar="K", min=1, help="Batches the loss change is averaged over.")] = 4,
    seed: Annotated[int, typer.Option(
        metavar="S", min=0, help="Seed of a stochastic cast's draws.")] = 0,
    choose: Annotated[str, typer.Option(
        metavar="HOW", help="Which layers the budget keeps: score (the advice), or as a "
                            "control last (the last layers) or random.")] = "score",
    choose_seed: Annotated[int, typer.Option(
        metavar="N", min=0, help="Seed of --choose random's draw.")] = 0,
    out: Annotated[Path, typer.Option(
        metavar="DIR", help="Folder for advise.parquet and advise.toml.")] = OUT,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    overwrite: Overwrite = False,
) -> None:
    """Layers to keep in high precision under a cast.

    Ranks the layers by the loss change and gradient error when each alone is cast, and
    writes the policy keeping the most sensitive ones within the budget of matmul work.
    """
    from driftcli.arith.policy import get_policy
    from driftcli.choices import parse_choice
    from driftcli.io.outputs import check_writable
    from driftcli.measures.advise import (
        AdviseRow,
        Choose,
        advise,
        check_budget,
        split_batch,
        summarize,
    )
    from driftcli.measures.grad_cosine import BatchSource, load_input
    from driftcli.models.loaders import next_token_loss

    check_budget(budget)
    parse_choice(Choose, choose, "--choose")
    get_policy(cast)  # fail now, not after loading the model
    check_writable(out)
    source = BatchSource(None if text is None else str(text),
                         None if batch is None else str(batch), tokens, windows * batches)
    path = out / f"{AdviseRow.TABLE}.parquet"
    policy_file = out / "advise.toml"
    with table_output(path, overwrite=overwrite):
        loaded = load_input(checkpoint, source)
        parts = split_batch(loaded.ids, batches)
        advice = advise(loaded.lm.model, parts, next_token_loss(loaded.lm.logits), cast,
                        budget=budget, seed=seed, checkpoint=str(checkpoint), choose=choose,
                        choose_seed=choose_seed)
        advice.write_policy(policy_file)
        prov = table_provenance([*loaded.lm.files, source.path], seed=seed, extra={
            "checkpoint_kind": loaded.lm.kind, "cast": cast, "budget": budget,
            "batches": batches, "batch_shape": list(loaded.ids.shape), "choose": choose,
            "choose_seed": choose_seed,
            "policy_file": str(policy_file)})
        publish(path, AdviseRow, list(advice.rows), prov,
                summarize(advice, path, policy_file), _print, as_json=as_json, quiet=quiet)
