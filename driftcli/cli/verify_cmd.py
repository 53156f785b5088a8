"""``drift verify-formats``: prove the fast path against the exact oracle."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Annotated, Any

import typer

from driftcli.choices import Engine
from driftcli.cli.app import EXIT_FOUND, command
from driftcli.cli.run import (
    Bar,
    EngineOpt,
    Overwrite,
    RayAddress,
    execution,
    progress_bar,
    table_output,
    table_provenance,
)
from driftcli.escaping import for_terminal

OUT = Path("drift-out")


@command("verify-formats")
def verify_formats(
    format_names: Annotated[list[str] | None, typer.Option(
        "--format", "-f", metavar="NAME",
        help="Verify only this format (repeatable; eXmY allowed).")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="The subset fast enough for every CI run.")] = False,
    out: Annotated[Path, typer.Option(
        metavar="DIR", help="Folder for verify-formats.parquet.")] = OUT,
    engine: EngineOpt = Engine.PROCESSES,
    workers: Annotated[int | None, typer.Option(
        "--workers", "--jobs", "-j", metavar="N", min=1,
        help="Workers of --engine processes or ray (default: one per CPU); --engine "
             "processes with 1 runs in this process.")] = None,
    ray_address: RayAddress = None,
    overwrite: Overwrite = False,
) -> None:
    """Prove every format against the exact rational oracle.

    Exit 1 on any disagreement.
    """
    from rich.console import Console
    from rich.table import Table

    from driftcli import verify as v
    from driftcli.io.outputs import check_writable
    from driftcli.io.tables import write_table

    formats = v.element_formats(format_names)
    check_writable(out)  # fail now, not after minutes of checks
    with table_output(out / "verify-formats.parquet", overwrite=overwrite):  # held to the end
        if engine is Engine.PROCESSES and workers == 1:
            engine = Engine.SERIAL  # one worker process would only add its start-up
        run_on = execution(engine, workers, ray_address)
        with progress_bar("verifying", Bar.ITEMS, quiet=False) as advance:
            outcomes = v.verify(formats, v.Plan(quick=quick), run_on, progress=advance)
        path = write_table(out / "verify-formats.parquet", v.VerifyRow, v.rows(outcomes),
                           table_provenance((), run_on, seed=v.SEED,
                                            extra={"plan": "quick" if quick else "full"}))
        by_format: dict[str, list[Any]] = defaultdict(list)
        for o in outcomes:
            by_format[o.format].append(o)
        table = Table(title=f"verify-formats ({'quick' if quick else 'full'})")
        for col in ("format", "checks", "values checked", "disagreements"):
            table.add_column(col, justify="left" if col == "format" else "right")
        for name, outs in by_format.items():
            failed = sum(o.n_failed for o in outs)
            table.add_row(name, str(len(outs)), f"{sum(o.n_checked for o in outs):,}",
                          f"[red]{failed:,}[/red]" if failed else "0")
        stdout = Console(width=120)
        stdout.print(table)
        bad = [o for o in outcomes if o.n_failed]
        for o in bad[:20]:
            stdout.print(f"[red]FAIL[/red] {o.format} {o.check} {o.operation} {o.rounding} "
                         f"{o.overflow}: {o.n_failed:,} of {o.n_checked:,}")
            for ops, exp, got in o.failures[:3]:
                stdout.print(f"    {ops}: expected {exp}, got {got}")
        total = sum(o.n_checked for o in outcomes)
        failed = sum(o.n_failed for o in outcomes)
        stdout.print(f"{total:,} values checked, {failed:,} disagreements; "
                     f"wrote {for_terminal(path)}")
        if failed:
            raise typer.Exit(EXIT_FOUND)
