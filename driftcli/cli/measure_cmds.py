"""``drift clip-rate``, ``drift underflow-rate``, ``drift error-bias``, ``drift cast-diff``: one
scan each, one Parquet table each, with the same inputs and options."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from driftcli.choices import Device, Engine
from driftcli.cli.app import EXIT_USAGE, command
from driftcli.cli.run import (
    Append,
    Bar,
    EngineOpt,
    LayoutOpt,
    Overwrite,
    RayAddress,
    Resume,
    Workers,
    appended,
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
    from driftcli.measures.common import Measure
    from driftcli.measures.scan import ScanOptions

OUT = Path("drift-out")
WORST = 3
"""Worst tensors named per cast in the summary."""

Inputs = Annotated[list[Path], typer.Argument(
    metavar="INPUT...", show_default=False,
    # the readers' registry (io/readers/collect.KINDS) imports torch, which --help must not:
    # a test holds this list to every kind's name and endings
    help="safetensors (or its .index.json folder), .pt/.pth/.bin/.ckpt state dicts, .npz/.npy, "
         "Transformer Engine dumps, or folders of these; drift dumps too.")]
Casts = Annotated[list[str], typer.Option(
    "--cast", "-c", metavar="SPEC", show_default=False,
    help="A preset (mxfp8_e4m3, nvfp4, ...) or a cast spec; repeatable.")]
Out = Annotated[Path, typer.Option(metavar="DIR", help="Folder for the table.")]
Axis = Annotated[int, typer.Option(metavar="N", help="Axis blocks run along.")]
DeviceOpt = Annotated[Device, typer.Option(help="Where the casts run.")]
Include = Annotated[list[str] | None, typer.Option(
    metavar="GLOB", help="Only tensors whose name matches (repeatable).")]
Exclude = Annotated[list[str] | None, typer.Option(
    metavar="GLOB", help="Leave out tensors whose name matches (repeatable).")]
FastHash = Annotated[bool, typer.Option(
    "--fast-hash", help="Identify inputs by size and mtime instead of sha256 (huge inputs).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no summary.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")]


def cast_names(given: list[str]) -> dict[str, str]:
    """Each cast's canonical spec → the name the user gave it, where they differ (a preset
    reads better than its canonical spec): the summary and the report show these names."""
    from driftcli.records.castspec import parse_cast

    return {spec: g for g in given if (spec := str(parse_cast(g))) != g}


def _summary(m: Measure, rows: list[Any], path: Path, given: list[str]) -> dict[str, Any]:
    """Per input and cast: the all-tensors headline and the worst tensors; casts are named
    as the user gave them (see :func:`cast_names`)."""
    from driftcli.measures.common import ALL_TENSORS
    from driftcli.report.summary import input_of

    label = cast_names(given)
    head = m.row_type.HEADLINE
    out: dict[str, Any] = {"table": str(path), "measure": m.name, "headline": head,
                           "beside": list(getattr(m.row_type, "SHOWN", ())), "casts": []}
    # a name held by several files (two checkpoints given) is shown with its file
    sources: dict[str, set[str]] = {}
    for r in rows:
        sources.setdefault(r.tensor, set()).add(r.source)
    inputs = list(dict.fromkeys(r.source for r in rows if r.tensor == ALL_TENSORS))
    for agg in (r for r in rows if r.tensor == ALL_TENSORS):
        tensors = [r for r in rows if r.tensor != ALL_TENSORS and r.cast == agg.cast
                   and r.error is None and getattr(r, head) is not None
                   and input_of(r.source, inputs) in (agg.source, None)]
        tensors.sort(key=lambda r: getattr(r, head), reverse=m.row_type.HIGHER_IS_WORSE)
        out["casts"].append({
            "input": agg.source, "cast": label.get(agg.cast, agg.cast), "spec": agg.cast,
            "tensors": agg.n_tensors,
            "skipped": agg.n_skipped, head: getattr(agg, head),
            # beside the headline: what it hides (error-bias: bias, alignment, lost elements;
            # clip-rate: the clip rate without the scale's rounding)
            **{c: getattr(agg, c) for c in getattr(m.row_type, "SHOWN", ())},
            "worst": [{"source": r.source, "tensor": r.tensor, head: getattr(r, head),
                       "shown": (f"{r.tensor} ({r.source})" if len(sources[r.tensor]) > 1
                                 else r.tensor)}
                      for r in tensors[:WORST]]})
    out["errors"] = [{"source": r.source, "tensor": r.tensor, "error": r.error}
                     for r in rows if r.error is not None and r.tensor != ALL_TENSORS]
    return out


def _print(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from driftcli.report.terminal import fixed_columns, width

    head = summary["headline"]
    table = Table(title=esc(f"{summary['measure']}: {head} (all tensors, and the worst)"))
    beside = summary.get("beside", [])
    casts = summary["casts"]
    several = len({c["input"] for c in casts}) > 1  # then each row says which input it is
    columns = [*([("input", [esc(c["input"]) for c in casts], False)] if several else []),
               ("cast", [esc(c["cast"]) for c in casts], False),
               ("tensors", [str(c["tensors"]) for c in casts], True),
               *((col, [fmt(c[col]) for c in casts], True) for col in (head, *beside))]
    out = Console(width=width(), soft_wrap=True)  # lines outside the table are never broken
    # names and numbers never cut; the worst tensors wrapped, or below the table when narrow
    inside = fixed_columns(table, columns, "worst tensors", out.width)
    worst = [esc(", ".join(f"{w['shown']} {fmt(w[head])}" for w in c["worst"]) or "-")
             for c in casts]
    for n in range(len(casts)):
        table.add_row(*(cells[n] for _, cells, _ in columns), *([worst[n]] if inside else []))
    out.print(table)
    if not inside:
        for c, w in zip(casts, worst, strict=True):
            where = f"{c['input']} " if several else ""
            out.print(f"worst tensors under {esc(where + c['cast'])}: {w}")
    for line in summary.get("unmeasured", []):
        out.print(esc(line, markup=False), markup=False)
    for f in summary.get("skipped_files", []):
        out.print(esc(f"skipped {f}: holds no weights (training state)", markup=False),
                  markup=False)
    for line in summary.get("axis_skipped", []):
        out.print(esc(f"skipped {line}", markup=False), markup=False)
    for line in summary.get("notices", []):
        out.print(esc(f"notice: {line}", markup=False), markup=False)
    seen = set()
    for e in summary["errors"]:
        if (e["source"], e["tensor"]) not in seen:
            seen.add((e["source"], e["tensor"]))
            out.print(f"[red]not measured[/red] {esc(e['source'])} {esc(e['tensor'])}: "
                      f"{esc(e['error'])}")
    out.print(f"wrote {esc(summary['table'])}")


@dataclass(frozen=True)
class ScanArgs:
    """The options every scan command shares, as one bundle (:func:`scan_command` gives a
    command these parameters): a new scan command takes it whole."""

    inputs: list[Path]
    cast: list[str]
    out: Path
    axis: int
    device: Device
    include: list[str] | None
    exclude: list[str] | None
    fast_hash: bool
    quiet: bool
    as_json: bool
    engine: Engine
    workers: int | None
    ray_address: str | None
    resume: bool
    overwrite: bool
    append: bool
    layout: str | None


def _shared(
    inputs: Inputs, cast: Casts, out: Out = OUT, axis: Axis = -1,
    device: DeviceOpt = Device.CPU, include: Include = None, exclude: Exclude = None,
    fast_hash: FastHash = False, quiet: Quiet = False, as_json: AsJson = False,
    engine: EngineOpt = Engine.SERIAL, workers: Workers = None, ray_address: RayAddress = None,
    resume: Resume = False, overwrite: Overwrite = False, append: Append = False,
    layout: LayoutOpt = None,
) -> None:
    """The typer signature of :class:`ScanArgs` (read by :func:`scan_command`, never called)."""


_AFTER = 4
"""A command's own options come after the shared ``INPUT... --cast --out --axis`` (where
error-bias has always shown ``--draws`` and ``--seed``)."""


def scan_command(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register ``fn(args: ScanArgs, **own)`` as the scan command ``name``: its typer
    signature is :class:`ScanArgs`'s options with ``fn``'s own ones after ``--axis``."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        shared = list(inspect.signature(_shared, eval_str=True).parameters.values())
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
               if p.name != "args"]
        names = [p.name for p in shared]

        @functools.wraps(fn)
        def bundled(**given: Any) -> None:
            fn(ScanArgs(**{n: given.pop(n) for n in names}), **given)

        params = [*shared[:_AFTER], *own, *shared[_AFTER:]]
        # typer reads the signature (and the hints) of what it registers: the options, not
        # the bundle
        bundled.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        bundled.__annotations__ = {p.name: p.annotation for p in params}
        command(name)(bundled)
        return fn

    return register


def _run(name: str, args: ScanArgs, draws: int = 1, seed: int = 0) -> None:
    """Measure ``name`` over the inputs into ``OUT/<table>.parquet``, holding the table's lock."""
    from driftcli.io.outputs import check_writable
    from driftcli.measures import MEASURES
    from driftcli.measures.scan import ScanOptions

    m = MEASURES[name]
    check_writable(args.out)  # fail now, not after the scan
    path = args.out / f"{m.name}.parquet"
    options = ScanOptions(axis=args.axis, draws=draws, seed=seed, device=args.device)
    with table_output(path, overwrite=args.overwrite, append=args.append):  # held to the end
        _measure(m, path, args, options)


def _measure(m: Measure, path: Path, args: ScanArgs, options: ScanOptions) -> None:
    from driftcli.engines import clear_units
    from driftcli.io.readers.collect import unmeasured
    from driftcli.io.tables import identify_in_background
    from driftcli.measures.axes import axis_misfits
    from driftcli.measures.scan import scan
    from driftcli.memory import bound_memory

    include, exclude, casts, layout = args.include or (), args.exclude or (), args.cast, args.layout
    if args.append and path.exists():  # a table rows cannot merge into: refused before the scan
        from driftcli.io.tables import read_rows

        read_rows(path, m.row_type)
    fit = axis_misfits(args.inputs, options.axis, include, exclude, layout)
    run_on = execution(args.engine, args.workers, args.ray_address, units_dir(path),
                       args.resume, args.fast_hash)
    identities: list[Callable[[], list[dict[str, Any]]]] = []  # hashing, from the inputs opening
    bound_memory()
    with progress_bar("scanning", Bar.BYTES, args.quiet) as advance:
        s = scan(args.inputs, casts, options=m.scan_options(options), include=include,
                 exclude=[*exclude, *fit.exclude],
                 progress=advance, rounded=m.rounded, execution=run_on, layout=layout,
                 on_open=lambda files: identities.append(identify_in_background(
                     files, args.fast_hash)))
    prov = table_provenance(s.files, run_on, seed=options.seed, device=options.device.value,
                            fast_hash=args.fast_hash, identities=identities[0](), extra={
                                "casts": casts, "axis": options.axis,
                                **({"layout": layout} if layout else {}),
                                "draws": options.draws, "names": {"cast": cast_names(casts)}})
    rows = m.rows(s)
    if len(s.errors) == len(s.results):  # nothing measured: an earlier table stays as it was
        bad = {(r.source, r.ref.name if r.ref else "") for r in s.errors}
        first = s.errors[0]
        kept = f"; {path} from an earlier run is kept" if path.exists() else ""
        typer.echo(esc(f"error: nothing could be measured: {len(bad)} tensor(s) or file(s) "
                       f"failed, first {first.source} {first.ref.name if first.ref else ''}: "
                       f"{first.error}; no table written{kept}", markup=False), err=True)
        clear_units(units_dir(path))  # every unit an error: nothing worth resuming
        raise typer.Exit(EXIT_USAGE)
    summary = _summary(m, rows, path, casts)
    summary["skipped_files"] = [str(f) for i in s.inputs for f in i.skipped]
    summary["unmeasured"] = unmeasured(s.inputs)
    summary["axis_skipped"] = fit.lines()
    summary["notices"] = list(dict.fromkeys(n for i in s.inputs for n in i.notices))
    failed = {f"{e['source']} {e['tensor']}: {e['error']}": None for e in summary["errors"]}
    if args.append:  # the summary is this run's; the table holds the earlier rows too
        rows, prov = appended(path, m.row_type, rows, prov)
    publish(path, m.row_type, rows, prov, summary, _print, as_json=args.as_json,
            quiet=args.quiet, failures=list(failed),
            failed="tensor(s) or file(s) could not be read", units=units_dir(path))


@scan_command("clip-rate")
def clip_rate(args: ScanArgs) -> None:
    """Share of each tensor that clips, per cast.

    An element clips when its scaled magnitude is above the element format's max.
    """
    _run("clip-rate", args)


@scan_command("underflow-rate")
def underflow_rate(args: ScanArgs) -> None:
    """Share of nonzero values that flush to zero, per cast."""
    _run("underflow-rate", args)


@scan_command("error-bias")
def error_bias(
    args: ScanArgs,
    draws: Annotated[int, typer.Option(
        metavar="N", min=1, help="Independent draws of a stochastic (sr) cast.")] = 8,
    seed: Annotated[int, typer.Option(metavar="S", help="Seed of the stochastic draws.")] = 0,
) -> None:
    """Size of the cast error and its bias, per cast.

    The bias says which way the error points: along the tensor (it shrinks or grows).
    """
    _run("error-bias", args, draws, seed)


@scan_command("cast-diff")
def cast_diff(args: ScanArgs) -> None:
    """Where casts disagree with the first, element by element.

    Per tensor: the share of codes and of dequantized values that differ, the largest
    difference in grid spacings, each cast's clips and underflows.
    """
    if len(args.cast) < 2:
        from driftcli.errors import DriftError

        raise DriftError(f"cast-diff compares casts with the first: give two or more, not "
                         f"{len(args.cast)} (e.g. -c nvfp4 -c torchao/nvfp4)")
    _run("cast-diff", args)
