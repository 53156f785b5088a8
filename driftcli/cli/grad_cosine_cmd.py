"""``drift grad-cosine``: the gradient under arithmetic policies against the exact gradient, at
one checkpoint and one batch, into ``OUT/grad-cosine.parquet``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from driftcli.cli.app import command
from driftcli.cli.run import fmt, publish
from driftcli.errors import DriftError

if TYPE_CHECKING:
    from driftcli.models.loaders import CausalLM

OUT = Path("drift-out")


def _batch(lm: CausalLM, text: Path | None, batch: Path | None, tokens: int,
           windows: int) -> tuple[Any, Path]:
    from driftcli.models.loaders import load_batch, text_batch

    if (text is None) == (batch is None):
        raise DriftError("give the batch as exactly one of --text FILE (tokenized with the "
                         "checkpoint's tokenizer) or --batch FILE (safetensors input_ids)")
    if batch is not None:
        return load_batch(batch), batch
    path = cast(Path, text)
    return text_batch(lm, path.read_text(encoding="utf-8"), tokens, windows, str(path)), path


def _print(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"grad-cosine: {summary['checkpoint']} (all parameters)")
    for col in ("policy", "cosine", "retention", "norm_ratio", "rel_error", "loss", "draws",
                "lowest cosine"):
        table.add_column(col, justify="left" if col in ("policy", "lowest cosine") else "right")
    for p in summary["policies"]:
        low = p["worst"][0] if p["worst"] else None
        lowest = "-" if low is None else f"{low['parameter']} {fmt(low['cosine'], '.4f')}"
        table.add_row(p["policy"], fmt(p["cosine"], ".6f"), fmt(p["retention"], ".6f"),
                      fmt(p["norm_ratio"], ".4f"), fmt(p["rel_error"], ".3g"),
                      fmt(p["loss"], ".5f"), str(p["draws"]), lowest)
    out = Console(width=160)
    out.print(table)
    out.print(f"exact loss {fmt(summary['loss_exact'], '.5f')}; wrote {summary['table']}")


@command("grad-cosine")
def grad_cosine_command(
    checkpoint: Annotated[Path, typer.Argument(
        metavar="CHECKPOINT", exists=True, show_default=False,
        help="A drift model checkpoint (drift train's step-*.safetensors) or a Hugging Face "
             "causal-LM folder (needs driftcli[hf], i.e. transformers).")],
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
) -> None:
    """Gradient under a policy against the exact gradient.

    Cosine, retention, norm ratio and relative error against the float64 gradient, per
    parameter and over all parameters.
    """
    from driftcli.arith.policy import get_policy
    from driftcli.io.outputs import check_writable
    from driftcli.io.tables import identify_in_background, provenance
    from driftcli.measures.grad_cosine import GradCosineRow, grad_cosine, summarize
    from driftcli.models.loaders import load_causal_lm, next_token_loss

    resolved = [get_policy(p) for p in policy]  # fail now, not after loading the model
    check_writable(out)  # fail now, not after the gradients
    lm = load_causal_lm(checkpoint)
    ids, source = _batch(lm, text, batch, tokens, windows)
    identities = identify_in_background([*lm.files, source])  # beside the gradients
    rows = grad_cosine(lm.model, ids, next_token_loss(lm.logits), resolved, draws=draws,
                       seed=seed, checkpoint=str(checkpoint))
    prov = provenance([*lm.files, source], seed=seed, extra={
        "checkpoint_kind": lm.kind, "policies": policy, "draws": draws,
        "batch_shape": list(ids.shape), "tokens": tokens if text is not None else None,
        "windows": windows if text is not None else None}, identities=identities())
    path = out / f"{GradCosineRow.TABLE}.parquet"
    publish(path, GradCosineRow, rows, prov, summarize(rows, path), _print, as_json=as_json,
            quiet=quiet)
