"""``drift formats``: the table of every named format."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from driftcli.cli import command
from driftcli.formats import FORMATS, describe


@command("formats")
def formats(
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print JSON (exact values as strings).")] = False,
) -> None:
    """List every named format: widths, bias, range and special values."""
    rows = [describe(f) for f in FORMATS.values()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="drift formats (custom floats: eXmY, eXmYbZ)")
    columns = ["name", "bits", "E", "M", "bias", "max", "smallest normal",
               "smallest subnormal", "inf", "NaN", "-0"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("name", "NaN") else "right")
    for r in rows:
        table.add_row(r["name"], str(r["bits"]), str(r["ebits"]), str(r["mbits"]), str(r["bias"]),
                      r["max_display"], r["smallest_normal_display"],
                      r["smallest_subnormal_display"], "yes" if r["has_inf"] else "no",
                      r["nan"], "yes" if r["has_neg_zero"] else "no")
    Console(width=140).print(table)
