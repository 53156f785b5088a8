"""``drift demo``: the whole toolkit on one short run, in about two minutes.

It is a script of drift commands, each run in-process exactly as typed (the lines are
printed first, so the demo shows how to do each step by hand): train a small tanh MLP
on Shakespeare under exact arithmetic, dump every matmul operand of one step, measure the
dump under five casts, compare gradients under the same casts as policies, prove the
formats (quick plan), and report to the terminal and to ``OUT/report.html``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from driftcli.cli.app import app, command
from driftcli.escaping import for_terminal

CASTS = ("fp8_e4m3", "mxfp8_e4m3", "mxfp8_e4m3_floor+1", "mxfp8_e4m3_ceil", "nvfp4")
"""Per-tensor FP8, OCP MX FP8 with the floor rule, one binade of headroom, the ceil rule,
and NVFP4."""
STEPS = 300
NEXT = (["clip-rate", "MODEL.safetensors", "-c", "mxfp8_e4m3", "-c", "mxfp8_e4m3_ceil", "-c",
         "nvfp4", "--out", "my-drift-out"],
        ["error-bias", "MODEL.safetensors", "-c", "mxfp8_e4m3", "-c", "nvfp4", "--out",
         "my-drift-out"],
        ["report", "my-drift-out", "--fail-on", "clip-rate:clip_rate > 0.01"])
"""What the demo suggests next, on the user's own checkpoint (in a folder of its own: the
demo's tables are kept, and a scan never replaces a table without --overwrite)."""


def script(out: Path, text: Path | None, steps: int = STEPS) -> list[list[str]]:
    """The demo's drift command lines, in order."""
    run, dump = out / "run", out / "dump.safetensors"
    checkpoint = run / f"step-{steps:06d}.safetensors"
    text_opt = [] if text is None else ["--text", str(text)]
    casts = [a for c in CASTS for a in ("-c", c)]
    policies = [a for p in ("exact", *CASTS) for a in ("-p", p)]
    # --overwrite: the demo is run again into the same folder (its train does so too)
    measures = [[m, str(dump), *casts, "--out", str(out), "--quiet", "--overwrite"]
                for m in ("clip-rate", "underflow-rate", "error-bias")]
    return [
        ["train", "--out", str(run), "--model", "mlp", "--steps", str(steps), "--seed", "0",
         "--overwrite", "--quiet", *text_opt],
        ["dump", str(checkpoint), "--out", str(dump), "--quiet", *text_opt],
        *measures,
        ["grad-cosine", str(checkpoint), *policies, "--text", "{text}", "--tokens", "64",
         "--windows", "8", "--draws", "4", "--out", str(out), "--quiet", "--overwrite"],
        ["verify-formats", "--quick", "--out", str(out), "--overwrite"],
        ["report", str(out), "--html", str(out / "report.html")],
    ]


@command("demo")
def demo(
    out: Annotated[Path, typer.Option(metavar="DIR", help="Folder for everything.")] = Path(
        "drift-out"),
    text: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Train on this text (default: Shakespeare, fetched once).")] = None,
) -> None:
    """Train, dump, measure, verify and report on one short run."""
    from driftcli.io.outputs import check_writable
    from driftcli.text import default_corpus

    check_writable(out)

    # one thread per command: on a small model, more threads cost more than they give
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    corpus = text if text is not None else default_corpus()
    for argv in script(out, text):
        argv = [str(corpus) if a == "{text}" else a for a in argv]
        typer.echo(for_terminal(f"$ drift {' '.join(argv)}", markup=False), err=True)
        sys.argv = ["drift", *argv]  # each table's provenance names its own command
        code = app(argv, standalone_mode=False)  # a typer.Exit comes back as its code
        if code:
            raise typer.Exit(int(code))
    typer.echo("\nnext, on your own checkpoint (safetensors, a .pt state dict, a Hugging Face "
               "folder):", err=True)
    for argv in NEXT:
        typer.echo(f"  drift {shlex.join(argv)}", err=True)
