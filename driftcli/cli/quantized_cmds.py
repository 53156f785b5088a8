"""``drift dequantize`` and ``drift inspect``: pre-quantized checkpoints written back as plain
ones, and what their codes and scales hold (``docs/dequantize.md``, ``docs/inspect.md``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftcli.cli.app import command
from driftcli.escaping import for_terminal as esc

_LAYOUTS = ("deepseek-fp8", "mxfp8", "ct-fp8", "ct-nvfp4", "modelopt-nvfp4", "gpt-oss-mxfp4")
"""``driftcli.io.readers.quantized.Layout``'s values (kept here so --help needs no torch)."""

LayoutOpt = Annotated[str | None, typer.Option(
    "--layout", metavar="LAYOUT",
    help=f"The quantized layout, where the config and the names leave it in doubt: "
         f"{', '.join(_LAYOUTS)}.")]
OrderOpt = Annotated[str, typer.Option(
    "--order", metavar="exact|library",
    help="exact: code x scales rounded once; library: an NVFP4 combined scale rounded to "
         "float32 first, as compressed-tensors and ModelOpt's eager decoders do.")]


@command("dequantize")
def dequantize_cmd(
    inputs: Annotated[list[Path], typer.Argument(
        metavar="INPUT...", show_default=False,
        help="A pre-quantized checkpoint: safetensors file(s), a folder, or its index.")],
    out: Annotated[Path, typer.Option(
        "--out", metavar="FILE|DIR", show_default=False,
        help="A .safetensors file (one-file input) or a folder (one file per input file, "
             "and an index for a sharded input).")],
    dtype: Annotated[str, typer.Option(
        "--dtype", metavar="float32|bfloat16|float16",
        help="Dtype of the dequantized weights.")] = "float32",
    layout: LayoutOpt = None,
    order: OrderOpt = "exact",
    include: Annotated[list[str] | None, typer.Option(
        metavar="GLOB", help="Only tensors whose name matches (repeatable).")] = None,
    exclude: Annotated[list[str] | None, typer.Option(
        metavar="GLOB", help="Leave out tensors whose name matches (repeatable).")] = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No summary.")] = False,
) -> None:
    """Write a pre-quantized checkpoint back as a plain one.

    Each quantized weight becomes the exact product of its codes and scales, rounded once
    to --dtype; other tensors are copied as stored. A weight that cannot be dequantized
    (NaN scales, scales that do not cover it) is an error and nothing is written.
    """
    from driftcli.io.dequantize import dequantize

    done = dequantize(inputs, out, dtype=dtype, layout=layout, order=order,
                      include=include or (), exclude=exclude or ())
    if not quiet:
        typer.echo(f"dequantized {done.weights} weight(s) to {dtype}, copied "
                   f"{done.copied} tensor(s)")
        for f in done.files:
            typer.echo(f"wrote {esc(str(f), markup=False)}")
