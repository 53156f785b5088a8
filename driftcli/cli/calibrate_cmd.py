"""``drift calibrate``: infer how a matmul backend accumulates, or fit recorded dot products."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from driftcli.cli.app import command, fail
from driftcli.cli.run import Bar, Overwrite, fmt, progress_bar, table_output, table_provenance
from driftcli.escaping import for_terminal as esc

OUT = Path("drift-out")


def _print(rows: list[Any], path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(width=160)
    for name in dict.fromkeys(r.backend for r in rows):
        mine = [r for r in rows if r.backend == name]
        head = mine[0]
        what = "probes" if head.kind == "probes" else "recordings"
        verdict = f"reproduces every one of the {what}" if head.fits else (
            f"no model of the family reproduces it: the best gives "
            f"{fmt(head.share, '.4%')} of the {what}")
        out.print(f"[bold]{esc(name)}[/bold]")
        out.print(f"  model: {esc(head.model)}", soft_wrap=True)
        if head.fits:
            line = f"  {verdict}; {head.survivors} model(s) give the same bits" + (
                f" (they differ in {head.alternatives})" if head.alternatives else "")
        else:
            line = f"  {verdict}" + (f"; {head.alternatives}" if head.alternatives else "")
        out.print(esc(line + (f"; c {head.c_mode}" if head.c_mode else "")))
        checks = [r for r in mine if r.kind == "check"]
        if checks:
            table = Table(title="outputs reproduced bit for bit", title_justify="left")
            for col in ("K", "dist", "outputs", "reproduced", "share"):
                table.add_column(col, justify="left" if col == "dist" else "right")
            for r in checks:
                table.add_row(str(r.k), esc(r.dist), f"{r.outputs:,}", f"{r.reproduced:,}",
                              fmt(r.share, ".4%"))
            out.print(table)
    out.print(f"wrote {esc(path)}")


@command("calibrate")
def calibrate_cmd(
    backend: Annotated[list[str] | None, typer.Option(
        "--backend", "-b", metavar="BACKEND",
        help="torch:cpu:<dtype>, torch:cuda:<dtype> or drift:<matmul spec> (repeatable).")
    ] = None,
    recordings: Annotated[Path | None, typer.Option(
        metavar="DIR", exists=True, file_okay=False,
        help="Recorded dot products: a GPU/FORMAT folder, or a folder of them.")] = None,
    max_k: Annotated[int, typer.Option(
        "--max-k", metavar="K", min=128,
        help="Longest K of the promotion probes and the checks.")] = 8192,
    seed: Annotated[int, typer.Option(metavar="S", help="Seed of the random probes and "
                                                        "checks.")] = 0,
    out: Annotated[Path, typer.Option(metavar="DIR", help="Folder for calibrate.parquet.")
                   ] = OUT,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress, no summary.")
                     ] = False,
    overwrite: Overwrite = False,
) -> None:
    """Infer how a matmul backend accumulates, from probes.

    Prints the inferred spec and the share of random matmuls it reproduces bit for bit;
    with --recordings, fits recorded GPU dot products instead.
    """
    import dataclasses
    import json

    from driftcli.io.outputs import check_writable
    from driftcli.io.tables import write_table
    from driftcli.measures.calibrate import CalibrateRow, calibrate, calibrate_recordings

    if not backend and recordings is None:
        raise fail("give --backend (e.g. torch:cpu:bfloat16, drift:tc=h100_e4m3_f32) or "
             "--recordings DIR")
    check_writable(out)
    with table_output(out / f"{CalibrateRow.TABLE}.parquet", overwrite=overwrite):
        rows: list[CalibrateRow] = []
        with progress_bar("calibrating", Bar.ITEMS, quiet or as_json) as advance:
            for name in backend or ():
                rows += calibrate(name, seed=seed, max_k=max_k, progress=advance)
            if recordings is not None:
                rows += calibrate_recordings(recordings, progress=advance)
        path = write_table(out / f"{CalibrateRow.TABLE}.parquet", CalibrateRow, rows,
                           table_provenance([recordings] if recordings else [], seed=seed,
                                            extra={"backends": list(backend or [])}))
        if as_json:
            typer.echo(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
        elif not quiet:
            _print(rows, path)
