"""``drift accum-error``: the error of simulated matmuls against the exact product, by
accumulator format, order and K, on synthetic operands or on the matmuls of drift dumps."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from driftcli.choices import Dist, Engine
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

if TYPE_CHECKING:
    pass

OUT = Path("drift-out")
WORST = 20
"""Specs listed in the summary, worst first."""


def _print(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="accum-error: rel_error per spec over all matmuls, worst first")
    # the mean ulps, not the max: an output whose exact value cancels to near zero has a tiny
    # ulp, so the max over outputs mostly says how close to zero the closest output came
    heads = ("spec", "matmuls", "median rel_error", "max rel_error", "mean ulps",
             "median bias", "worst matmul")
    for h in heads:
        table.add_column(h, justify="left" if h in ("spec", "worst matmul") else "right")
    for s in summary["specs"][:WORST]:
        w = s["worst"]
        table.add_row(esc(s["label"]), str(s["matmuls"]), fmt(s["median_rel_error"], ".3g"),
                      fmt(s["max_rel_error"], ".3g"), fmt(s["mean_abs_error_ulps"], ".3g"),
                      fmt(s["median_bias"], ".3g"),
                      esc(f"{w['matmul']} {w['m']}x{w['k']}x{w['n']}"))
    out = Console(width=160)
    out.print(table)
    if len(summary["specs"]) > WORST:
        out.print(f"… and {len(summary['specs']) - WORST} more spec(s) in the table")
    for e in summary["errors"]:
        out.print(f"[red]not measured[/red] {esc(e['source'])} {esc(e['matmul'])}: "
                  f"{esc(e['error'])}")
    out.print(f"wrote {esc(summary['table'])}")


@command("accum-error")
def accum_error_cmd(
    dumps: Annotated[list[Path] | None, typer.Argument(
        metavar="[DUMP]...", show_default=False,
        help="Drift dumps (from driftcli.io.capture.capture) whose matmuls to measure.")] = None,
    shape: Annotated[list[str] | None, typer.Option(
        metavar="MxKxN", help="Synthetic matmul shape, e.g. 64x1024x64 (repeatable).")] = None,
    k: Annotated[list[int] | None, typer.Option(
        "--k", metavar="K", help="K values for every MxN of --shape (default 32x32); "
                                 "repeatable.")] = None,
    dist: Annotated[list[Dist] | None, typer.Option(
        metavar="NAME", help="Distribution of synthetic operands (repeatable; default "
                             "normal).")] = None,
    spec: Annotated[list[str] | None, typer.Option(
        metavar="MATMULSPEC", help="A full matmul spec, e.g. acc=bfloat16:rtz,order=chunked:128 "
                                   "(repeatable).")] = None,
    acc: Annotated[list[str] | None, typer.Option(
        metavar="FMT", help="Accumulator of the grid, e.g. bfloat16 or bfloat16:rtz "
                            "(repeatable).")] = None,
    order: Annotated[list[str] | None, typer.Option(
        metavar="ORDER", help="Order of the grid: sequential, pairwise, chunked:N, native "
                              "(repeatable).")] = None,
    cast: Annotated[str | None, typer.Option(
        metavar="SPEC", help="Cast both operands of the grid's specs (a preset or cast "
                             "spec).")] = None,
    seed: Annotated[int, typer.Option(metavar="S", help="Seed of the synthetic operands and "
                                                        "of stochastic casts.")] = 0,
    include: Annotated[list[str] | None, typer.Option(
        metavar="GLOB", help="Only dump tensors whose name matches (repeatable).")] = None,
    exclude: Annotated[list[str] | None, typer.Option(
        metavar="GLOB", help="Leave out dump tensors whose name matches (repeatable).")] = None,
    out: Annotated[Path, typer.Option(metavar="DIR", help="Folder for the table.")] = OUT,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress, no summary.")] = False,
    engine: EngineOpt = Engine.SERIAL, workers: Workers = None, ray_address: RayAddress = None,
    resume: Resume = False, overwrite: Overwrite = False,
) -> None:
    """Error of simulated matmuls against the exact product.

    By accumulator format, order and K, on synthetic operands or on a dump's matmuls.
    """
    from driftcli.io.outputs import check_writable
    from driftcli.io.tables import identify_in_background
    from driftcli.measures.accum_error import AccumErrorRow, accum_error, choose_specs, summarize
    from driftcli.measures.accum_problems import parse_shape, synthetic_shapes

    specs = choose_specs(spec or (), acc or (), order or (), cast)
    shapes = (synthetic_shapes([parse_shape(s) for s in shape or ()], k or ())
              if shape or k else None)
    check_writable(out)  # fail now, not after the matmuls
    path = out / f"{AccumErrorRow.TABLE}.parquet"
    with table_output(path, overwrite=overwrite):  # before any work, held to the end
        run_on = execution(engine, workers, ray_address, units_dir(path), resume)
        identities = identify_in_background(dumps or ())  # beside the matmuls
        with progress_bar("accum-error", Bar.ITEMS, quiet or as_json) as advance:
            rows = accum_error(dumps or (), shapes=shapes, dists=dist, specs=specs, seed=seed,
                               include=include or (), exclude=exclude or (), progress=advance,
                               execution=run_on)
        prov = table_provenance(dumps or (), run_on, seed=seed, identities=identities(), extra={
            "specs": [str(s) for s in specs], "shapes": None if shapes is None else
            [list(s) for s in shapes], "dists": None if dist is None else [d.value for d in dist],
            "reference": "Sum2 (compensated) sum of exact float64 products; see ref_bound_ulps"})
        summary = summarize(rows, path)
        publish(path, AccumErrorRow, rows, prov, summary, _print, as_json=as_json, quiet=quiet,
                failures=[f"{e['source']} {e['matmul']}: {e['error']}"
                          for e in summary["errors"]], failed="matmul(s) could not be measured",
                units=units_dir(path))
