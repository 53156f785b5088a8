"""``drift formats``: the table of every named format, the cast presets, spec strings explained."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from driftcli.cli.app import command


@command("formats")
def formats(
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print JSON (exact values as strings).")] = False,
    presets: Annotated[bool, typer.Option(
        "--presets", help="List the cast presets with their canonical specs.")] = False,
    casts: Annotated[list[str] | None, typer.Option(
        "--cast", metavar="SPEC", help="Show the canonical form of a cast spec (repeatable).")
    ] = None,
) -> None:
    """List the formats, the cast presets, or a spec's form.

    Every named format with its widths, bias, range and special values.
    """
    from rich.console import Console
    from rich.table import Table

    from driftcli.cast import PRESETS, parse_cast
    from driftcli.formats import FORMATS, describe

    if casts:
        rows = [{"spec": spec, "canonical": str(parse_cast(spec))} for spec in casts]
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
        else:
            for r in rows:
                typer.echo(f"{r['spec']} = {r['canonical']}")
        return
    if presets:
        from driftcli.recipes import IMPLEMENTATION_PRESETS, IMPLEMENTATIONS

        listing = [{"preset": name, "spec": str(c), "meaning": meaning}
                   for name, (c, meaning) in PRESETS.items()]
        listing += [{"preset": p.name, "spec": str(p.cast), "meaning": p.meaning,
                     "implementation": p.implementation.name,
                     "version": p.implementation.version, "source": p.source,
                     "exact": p.exact} for p in IMPLEMENTATION_PRESETS.values()]
        if as_json:
            typer.echo(json.dumps(listing, indent=2))
            return
        console = Console(width=160)
        table = Table(title="drift's cast presets, exact (spec: FORMAT:GRANULARITY:SCALE_FORMAT:"
                            "RULE:ROUNDING:OVERFLOW[:ARITHMETIC])")
        for col in ("preset", "canonical spec", "meaning"):
            table.add_column(col)
        for r in listing:
            if "implementation" not in r:
                table.add_row(r["preset"], r["spec"], r["meaning"])
        console.print(table)
        for impl in IMPLEMENTATIONS:  # one table per implementation, its presets' sources
            table = Table(title=f"{impl.title} {impl.version} ({impl.home}): its operations, "
                                "bit for bit (docs/recipes.md)", expand=True)
            for col, ratio in (("preset", 3), ("canonical spec", 6), ("source", 4),
                               ("drift's exact cast", 3)):
                table.add_column(col, overflow="fold", ratio=ratio)
            for r in listing:
                if r.get("implementation") == impl.name:
                    table.add_row(r["preset"], r["spec"], r["source"], r["exact"])
            console.print(table)
        return
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
