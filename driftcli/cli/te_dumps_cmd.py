"""``drift te-dumps``: Transformer Engine's DumpTensors folders, whole: per dump and direction,
TE's quantized codes and scales against drift's preset of the same recipe, into
``OUT/te-dumps.parquet``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from driftcli.cli.app import EXIT_FOUND, command
from driftcli.cli.measure_cmds import OUT, Out
from driftcli.cli.run import (
    Bar,
    Overwrite,
    progress_bar,
    publish,
    table_output,
    table_provenance,
)
from driftcli.escaping import for_terminal as esc

Folders = Annotated[list[Path], typer.Argument(
    metavar="DUMPS...", exists=True, show_default=False,
    help="A tensor_dumps folder Transformer Engine's DumpTensors wrote (rank_R/iter_NNNNNN/"
         "LAYER_TENSOR.pt or rank_R/LAYER_TENSOR_iter_NNNNNN.pt), or dump files.")]


def _print(summary: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    console.print(f"{summary['files']} dump(s), {summary['compared']} direction(s) compared: "
                  f"{summary['n_codes_differ']:,} of {summary['n_elements']:,} codes and "
                  f"{summary['n_scales_differ']:,} of {summary['n_blocks']:,} scales differ "
                  "from drift's presets")
    for d in summary["differ"]:
        first = d["first_code_differ"] or d["first_scale_differ"]
        console.print(esc(f"  {d['source']} {d['direction']} ({d['preset']}): "
                          f"{d['n_codes_differ']} code(s), {d['n_scales_differ']} scale(s); "
                          f"first {first}"))
    console.print(f"table: {esc(summary['table'])}")


@command("te-dumps")
def te_dumps_command(
    dumps: Folders,
    out: Out = OUT,
    overwrite: Overwrite = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q",
                                        help="No progress bar, no summary.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Transformer Engine's dumps against drift's presets.

    Reads every DumpTensors file (step, rank, layer, tensor), and where it holds a quantized
    Float8Tensor, MXFP8Tensor or NVFP4Tensor (read without Transformer Engine, nothing of the
    pickle run), casts its high_precision tensor with drift's te/ preset and counts, rowwise
    and columnwise, the codes and block scales that differ from the bytes TE's kernel wrote.
    Exits 1 when any differ, 2 when a dump could not be compared.
    """
    from driftcli.io.outputs import check_writable
    from driftcli.measures.te_dumps import TE_DUMPS_FILE, TeDumpRow, dump_files, summary, te_dumps

    files = [p for p, _ in dump_files(dumps)]  # a folder with no dump fails before any work
    check_writable(out)
    path = out / TE_DUMPS_FILE
    with table_output(path, overwrite=overwrite):
        with progress_bar("te-dumps", Bar.ITEMS, quiet) as advance:
            rows = te_dumps(dumps, progress=advance)
        totals = {**summary(rows), "table": str(path)}
        failures = [f"{r.source} ({r.direction}): {r.error}" for r in rows
                    if r.error is not None]
        publish(path, TeDumpRow, rows, table_provenance(files), totals, _print, as_json=as_json,
                quiet=quiet, failures=failures, failed="dump(s) could not be compared")
    if totals["n_codes_differ"] or totals["n_scales_differ"]:
        raise typer.Exit(EXIT_FOUND)
