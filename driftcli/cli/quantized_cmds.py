"""``drift dequantize`` and ``drift inspect``: pre-quantized checkpoints written back as plain
ones, and what their codes and scales hold (``docs/dequantize.md``, ``docs/inspect.md``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from driftcli.cli.app import command
from driftcli.cli.run import LayoutOpt
from driftcli.escaping import for_terminal as esc

OrderOpt = Annotated[str, typer.Option(
    "--order", metavar="exact|library",
    help="exact: code x scales rounded once; library: as the library that wrote the "
         "checkpoint decodes it (its intermediate roundings and sign of zero).")]


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
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an earlier dequantize output at --out (never an input, "
                            "never a folder of other files).")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No summary.")] = False,
) -> None:
    """Write a pre-quantized checkpoint back as a plain one.

    Each quantized weight becomes the exact product of its codes and scales, rounded once
    to --dtype; other tensors are copied as stored. A weight that cannot be dequantized
    (NaN scales, scales that do not cover it) is an error and nothing is written.
    """
    from driftcli.io.dequantize import dequantize

    done = dequantize(inputs, out, dtype=dtype, layout=layout, order=order,
                      include=include or (), exclude=exclude or (), overwrite=overwrite)
    if not quiet:
        for line in done.notices:
            typer.echo(esc(f"notice: {line}", markup=False))
        typer.echo(f"dequantized {done.weights} weight(s) to {dtype}, copied "
                   f"{done.copied} tensor(s)")
        for f in done.files:
            typer.echo(f"wrote {esc(str(f), markup=False)}")


def _show(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = summary["rows"]
    table = Table(title="inspect: quantized weights")
    heads = ("tensor", "layout", "block", "max codes", "zero blocks", "scales", "pow2",
             "scale rules", "requant", "changed blocks", "changed codes")
    for h in heads:
        table.add_column(h, justify="left" if h in ("tensor", "layout", "scale rules", "requant")
                         else "right")
    for r in rows:
        if r["error"] is not None:
            continue
        span = ("-" if r["scale_min"] is None else
                f"{r['scale_min']:.3g}..{r['scale_max']:.3g}")
        table.add_row(esc(r["tensor"]), r["layout"], r["block"], str(r["max_codes"]),
                      str(r["zero_blocks"]), span, str(r["scales_pow2"]).lower(),
                      esc(r["scale_rules"] or "-"),
                      esc(r["requant"] or "-"), _num(r["requant_changed_blocks"]),
                      _num(r["requant_changed_codes"]))
    out = Console(width=160)
    for line in summary["notices"]:
        out.print(esc(f"notice: {line}", markup=False), markup=False)
    if rows:
        out.print(table)
    elif not summary["errors"]:
        out.print("no quantized weights in the inputs: every tensor is stored as plain values "
                  "(see docs/inputs.md#pre-quantized-checkpoints)")
    for f in summary["findings"]:
        out.print(f"[yellow]{f['lint']}[/yellow] {esc(f['tensor'])}: {esc(f['message'])}")
    out.print(f"wrote {esc(summary['table'])}")


def _num(x: object) -> str:
    return "-" if x is None else str(x)


@command("inspect")
def inspect_cmd(
    inputs: Annotated[list[Path], typer.Argument(
        metavar="INPUT...", show_default=False,
        help="Pre-quantized checkpoints: safetensors file(s), folders, or an index.")],
    out: Annotated[Path, typer.Option(
        "--out", metavar="DIR", help="Folder for the table.")] = Path("drift-out"),
    requant: Annotated[list[str] | None, typer.Option(
        "--requant", metavar="PRESET",
        help="Quantize each dequantized weight again with this preset or cast spec and count "
             "the blocks and codes it would not have written as stored, and the blocks the "
             "round trip rescales (repeatable).")] = None,
    layout: LayoutOpt = None,
    include: Annotated[list[str] | None, typer.Option(
        metavar="GLOB", help="Only weights whose name matches (repeatable).")] = None,
    exclude: Annotated[list[str] | None, typer.Option(
        metavar="GLOB", help="Leave out weights whose name matches (repeatable).")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a table an earlier run left in --out.")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No summary.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """What a pre-quantized checkpoint's codes and scales hold.

    One row per quantized weight: saturated, zero and NaN codes, the scales' range and
    exponents, power-of-two check, and lints (power-of-two scales declared but not held,
    an implausible magnitude, NaN scales, all-zero blocks).
    """
    import dataclasses

    from driftcli.cli.run import publish, table_output, table_provenance
    from driftcli.measures.inspect import InspectRow, inspect

    path = out / "inspect.parquet"
    with table_output(path, overwrite=overwrite):
        found = inspect(inputs, requant=requant or (), layout=layout,
                        include=include or (), exclude=exclude or ())
        prov = table_provenance(found.files, extra={"requant": list(requant or ()),
                                                    "layout": layout})
        summary = {"table": str(path),
                   "rows": [dataclasses.asdict(r) for r in found.rows],
                   "findings": [dataclasses.asdict(f) for f in found.findings],
                   "errors": list(found.errors), "notices": list(found.notices)}
        publish(path, InspectRow, found.rows, prov, summary, _show, as_json=as_json,
                quiet=quiet, failures=found.errors,
                failed="input(s) or weight(s) could not be inspected")
