"""What every command that measures does around its library call: a progress bar while it
works, then the table written, its summary printed (or as JSON), and exit 2 when some input
could not be measured. A command is its typer signature, one library call and these."""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from driftcli.choices import Engine
from driftcli.cli.app import EXIT_USAGE
from driftcli.escaping import for_terminal
from driftcli.io.layouts import Layout
from driftcli.progress import Progress, notices_to

if TYPE_CHECKING:
    from driftcli.engines import Execution
    from driftcli.io.tables import Row

EngineOpt = Annotated[Engine, typer.Option(
    help="Where the independent units run: "
         + "; ".join(f"{e.value}: {e.means}" for e in Engine) + ".")]
Workers = Annotated[int | None, typer.Option(
    metavar="N", min=1, help="Workers of --engine "
                             + " or ".join(e.value for e in Engine if e.parallel)
                             + " (default: one per CPU).")]
RayAddress = Annotated[str | None, typer.Option(
    metavar="ADDR", help="With --engine ray: 'auto' (a running cluster) or its address; "
                         "default: a local cluster for the run.")]
Resume = Annotated[bool, typer.Option(
    "--resume", help="Take the units a run interrupted here finished (kept beside the table) "
                     "instead of running them again.")]
Overwrite = Annotated[bool, typer.Option(
    "--overwrite", help="Replace a table an earlier run wrote there (without it, an existing "
                        "table is kept and the command refuses before any work).")]
Append = Annotated[bool, typer.Option(
    "--append", help="Merge this run's rows into the table already there: a row of the same "
                     "source, tensor and cast replaces the earlier one, the others stay.")]
LAYOUTS = tuple(Layout)
"""The layouts ``--layout`` takes: :class:`~driftcli.io.layouts.Layout`'s values (a torch-free
module, so --help needs no torch)."""
LayoutOpt = Annotated[str | None, typer.Option(
    "--layout", metavar="LAYOUT",
    help=f"The layout of pre-quantized weights, where the checkpoint's config and the tensor "
         f"names leave it in doubt: {', '.join(LAYOUTS)}.")]


def execution(engine: Engine, workers: int | None, ray_address: str | None,
              units_dir: Path | None = None, resume: bool = False,
              fast_hash: bool = False) -> Execution:
    """The :class:`~driftcli.engines.Execution` the engine options ask for. ``units_dir`` is
    where finished units are kept (beside the table): with ``resume`` they are taken, without
    it they are cleared first (a new run); with ``fast_hash`` they record their inputs by size,
    mtime and ctime rather than sha256. A symlinked units folder is refused."""
    from driftcli.engines import Execution, clear_units, fast_hash_units, reset_taken, start

    _RUN.update(units=units_dir, earlier=False)
    if units_dir is not None:
        # a symlinked folder is never read through: clearing it below refuses it
        kept = 0 if os.path.islink(units_dir) else kept_units(units_dir)
        if kept and not resume:
            # an interrupted run's work is not thrown away by a run that forgot --resume: it
            # stays for a later --resume, and this run neither takes nor adds to it
            typer.echo(for_terminal(
                f"note: {kept} unit(s) an earlier run finished are kept in {units_dir}; this "
                f"run does them again (add --resume to take them instead)", markup=False),
                err=True)
            _RUN.update(earlier=True)
            units_dir = None
        else:
            if not resume:
                clear_units(units_dir)
            reset_taken(units_dir)
            fast_hash_units(units_dir, fast_hash)
    chosen = Execution(engine, workers, ray_address, units_dir)
    start(chosen)  # a missing extra or an unreachable cluster fails before any work
    return chosen


_RUN: dict[str, Any] = {"units": None, "earlier": False}
"""Where this command's run keeps its finished units (set by :func:`execution`), and whether
they are an earlier run's (kept aside), for the line an interrupt prints."""

_UNIT = re.compile(r"[0-9a-f]{64}")
"""A kept unit's file name (the sha256 of its key, see :class:`driftcli.engines.Manifest`)."""

EXIT_INTERRUPTED = 130
"""Ctrl-C: the shell's code for a process ended by SIGINT (128 + 2)."""


def kept_units(folder: Path) -> int:
    """How many finished units are kept in ``folder`` (0 when there is none)."""
    try:
        with os.scandir(folder) as entries:
            return sum(1 for e in entries if _UNIT.fullmatch(e.name))
    except OSError:
        return 0


def resume_command(argv: Sequence[str]) -> str:
    """The command line that runs ``argv`` (``sys.argv``) again taking the kept units."""
    args = [a for a in argv[1:] if a != "--resume"]
    return shlex.join(["drift", *args, "--resume"])


def interrupted() -> str:
    """The one line a Ctrl-C prints: what was kept, and the command that goes on from it."""
    units = _RUN["units"]
    if units is None:
        return "interrupted: nothing was kept (this command keeps no finished work)"
    kept = kept_units(units)
    if not kept:
        return "interrupted before any unit finished: nothing was kept"
    earlier = " (an earlier run's)" if _RUN["earlier"] else ""
    return (f"interrupted: {kept} finished unit(s){earlier} kept in {units}; to go on from them: "
            f"{resume_command(sys.argv)}")


@contextmanager
def table_output(path: Path, *, overwrite: bool, option: str = "--out",
                 append: bool | None = None) -> Iterator[None]:
    """What a command holds while it makes a table: the table's lock (a second run writing the
    same table refuses with one line, see :func:`~driftcli.io.tables.table_lock`), taken
    before any work, and the check that no earlier table is there unless ``overwrite`` (or
    ``append``: the command merges its rows into it, see :func:`appended`; None for a
    command without ``--append``)."""
    import os

    from driftcli.io.outputs import OutputError
    from driftcli.io.tables import table_lock

    if overwrite and append:
        raise OutputError("give --overwrite (replace the table) or --append (merge into it), "
                          "not both")
    with table_lock(path, option=option):
        if os.path.lexists(path) and not (overwrite or append):
            merge = "" if append is None else " --append to merge into it,"
            raise OutputError(f"{path} exists (an earlier run's table); give --overwrite to "
                              f"replace it,{merge} or another {option}")
        yield


def appended(path: Path, row_type: type[Row], rows: Sequence[Any],
             prov: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """``rows`` merged into the table at ``path`` (when there is one) and the provenance of
    the merged table: this run's, its inputs and casts joined to the earlier table's, and
    ``appended_to`` naming the earlier run and the rows kept from it."""
    import os

    from driftcli.io.tables import merge_rows, read_rows

    if not os.path.lexists(path):
        return list(rows), prov
    old, before = read_rows(path, row_type)
    merged = merge_rows(old, rows, row_type.KEYS)
    kept = len(merged) - len(rows)
    given = {str(i.get("path")) for i in prov.get("inputs", [])}
    out = dict(prov)
    out["inputs"] = [*prov.get("inputs", []),
                     *(i for i in before.get("inputs", []) if str(i.get("path")) not in given)]
    if "casts" in prov:
        out["casts"] = list(dict.fromkeys([*before.get("casts", []), *prov["casts"]]))
    if "names" in prov:
        names = dict(before.get("names", {}))
        for column, mapping in prov["names"].items():
            names[column] = {**names.get(column, {}), **mapping}
        out["names"] = names
    out["appended_to"] = [*before.get("appended_to", []),
                          {"command": before.get("command"), "utc": before.get("utc"),
                           "rows_kept": kept}]
    return merged, out


def write_kept(path: Path, row_type: type[Row], rows: Sequence[Any], prov: dict[str, Any],
               units: Path | None) -> Path:
    """Write the table (atomically and durably), then clear the units kept for it in
    ``units``: only once the table holds them. A table that cannot be written (a full disk)
    keeps the earlier table and the units, and the error says so."""
    from driftcli.engines import clear_units
    from driftcli.io.tables import WriteError, write_table

    try:
        write_table(path, row_type, rows, prov)
    except WriteError as err:
        if units is None or not units.is_dir():
            raise
        raise WriteError(f"{err}; the finished units are kept in {units}: make room and run "
                         "again with --resume") from None
    if units is not None:
        clear_units(units)
    return path


def table_provenance(inputs: Sequence[Path], run_on: Execution | None = None, *,
                     seed: int | None = None, device: str = "cpu", fast_hash: bool = False,
                     identities: Sequence[dict[str, Any]] | None = None,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A command's table provenance (:func:`~driftcli.io.tables.provenance`): the inputs, the
    seed and device, the command's ``extra`` settings, then where its units ran (``run_on``'s
    :meth:`~driftcli.engines.Execution.describe`)."""
    from driftcli.io.tables import provenance

    ran = run_on.describe() if run_on is not None else {}
    return provenance(inputs, seed=seed, device=device, fast_hash=fast_hash,
                      extra={**(extra or {}), **ran}, identities=identities)


def units_dir(table: Path) -> Path:
    """Where a run keeps the units it finished: beside its table, hidden."""
    return table.with_name(f".{table.name}.units")


class Bar(StrEnum):
    """What a progress bar counts."""

    BYTES = "bytes"
    """Bytes read, with the speed and time left (scans)."""
    ITEMS = "items"
    """Units done of all (matmuls, checkpoints, steps)."""


PROGRESS_EVERY = "DRIFT_PROGRESS_EVERY"
"""The environment variable of the seconds between plain progress lines without a terminal
(default 10; 0: none, and no notices either)."""


def _every() -> float:
    try:
        return max(0.0, float(os.environ.get(PROGRESS_EVERY, "10")))
    except ValueError:
        return 10.0


class PlainProgress:
    """Progress as plain lines on stderr, at most one per ``every`` seconds (a CI log, where a
    live bar cannot draw): the first once the work has gone on that long."""

    def __init__(self, label: str, bar: Bar, every: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.bar, self.every, self.clock = label, bar, every, clock
        self.last = clock()

    def __call__(self, done: int, total: int, name: str) -> None:
        now = self.clock()
        if now - self.last < self.every:
            return
        self.last = now
        share = f" ({100 * done / total:.0f} %)" if total else ""
        amount = (f"{done / 2**20:,.1f} of {total / 2**20:,.1f} MiB" if self.bar is Bar.BYTES
                  else f"{done} of {total}")
        typer.echo(for_terminal(f"{self.label}: {amount}{share}, at {name[-60:]}",
                                markup=False), err=True)


@contextmanager
def progress_bar(label: str, bar: Bar, quiet: bool) -> Iterator[Progress]:
    """A live bar on stderr when it is a terminal, else plain lines every
    :data:`PROGRESS_EVERY` seconds (none when ``quiet``), as the
    :data:`~driftcli.progress.Progress` callback the library reports to; the library's
    notices (kernels compiling) print above it. Ctrl-C inside ends the command with one line
    (:func:`interrupted`) and exit code 130."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.progress import Progress as Bars

    console = Console(stderr=True)
    columns: tuple[Any, ...] = (
        (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
         TransferSpeedColumn(), TimeRemainingColumn()) if bar is Bar.BYTES else
        # a TextColumn's text is a format template: braces in a name are doubled
        (TextColumn(for_terminal(label).replace("{", "{{").replace("}", "}}")), BarColumn(),
         MofNCompleteColumn(),
         TextColumn("{task.description}"), TimeElapsedColumn()))
    live = not quiet and console.is_terminal
    every = _every()
    plain = not quiet and not live and every > 0
    with Bars(*columns, console=console, disable=not live, transient=True) as shown:
        task = shown.add_task(for_terminal(label) if bar is Bar.BYTES else "", total=None)
        lines = PlainProgress(label, bar, every)

        def advance(done: int, total: int, name: str) -> None:
            shown.update(task, completed=done, total=total, description=for_terminal(name[-40:]))
            if plain:
                lines(done, total, name)

        def say(message: str) -> None:  # even with --quiet: minutes of silence are no quiet
            if live:
                shown.console.print(for_terminal(message, markup=False), markup=False)
            elif every > 0:
                typer.echo(for_terminal(message, markup=False), err=True)

        try:
            with notices_to(say):
                yield advance
        except KeyboardInterrupt:
            shown.stop()
            typer.echo(for_terminal(interrupted(), markup=False), err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None


def fmt(value: Any, spec: str = ".4g") -> str:
    """A number for a summary table: ``-`` for none, ``inf``, or ``spec``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else format(value, spec)
    return str(value)


def publish(path: Path, row_type: type[Row], rows: Sequence[Any], prov: dict[str, Any],
            summary: dict[str, Any], show: Callable[[dict[str, Any]], None], *, as_json: bool,
            quiet: bool, failures: Sequence[str] = (),
            failed: str = "input(s) could not be measured", units: Path | None = None) -> Path:
    """Write the table (:func:`write_kept`: the kept ``units`` cleared once it is written),
    then its summary (JSON with ``as_json``, ``show`` unless ``quiet``); with ``failures``
    (one line each), exit 2 naming the first after the others are written:
    ``error: N <failed>, first <failure>; the others were measured into <table>``."""
    write_kept(path, row_type, rows, prov, units)
    if as_json:
        from driftcli.report.jsonout import strict  # the report's JSON convention

        typer.echo(strict(summary))
    elif not quiet:
        show(summary)
    if failures:
        typer.echo(for_terminal(f"error: {len(failures)} {failed}, first {failures[0]}; the "
                                f"others were measured into {path}", markup=False), err=True)
        raise typer.Exit(EXIT_USAGE)
    return path
