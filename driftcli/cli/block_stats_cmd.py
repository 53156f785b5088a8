"""``drift block-stats``: inside the scale groups of each tensor under each cast, in each
direction, into ``OUT/block-stats.parquet`` and the scale-code histogram
``OUT/block-scales.parquet``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from driftcli.choices import Engine
from driftcli.cli.app import command
from driftcli.cli.measure_cmds import (
    OUT,
    AsJson,
    Casts,
    Exclude,
    FastHash,
    Include,
    Inputs,
    Out,
    Quiet,
    cast_names,
)
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

SHOWN = ("n_blocks", "clipped_block_share", "scale_at_max", "scale_subnormal", "scale_at_min",
         "scale_spread", "range_median", "range_max", "range_over_span")
"""Columns of the summary, per cast and direction, over every tensor."""


def summarize(rows: list[Any], path: Path, given: list[str]) -> dict[str, Any]:
    """Per cast and direction, over every measured tensor: the groups, their clipped share,
    the scale flags, the widest spread and range, and the tensor with the most clipped share."""
    label = cast_names(given)
    groups: dict[tuple[str, str], list[Any]] = {}
    for r in rows:
        if r.error is None:
            groups.setdefault((r.cast, r.direction), []).append(r)
    out: dict[str, Any] = {"table": str(path), "casts": [], "errors": [
        {"source": r.source, "tensor": r.tensor, "error": r.error}
        for r in rows if r.error is not None]}
    for (cast, direction), rs in groups.items():
        n = sum(r.n_blocks for r in rs)
        live = [r for r in rs if r.range_over_span is not None]
        n_live = sum(r.n_blocks - r.zero_blocks - r.nonfinite_blocks for r in live)
        over = sum(r.range_over_span * (r.n_blocks - r.zero_blocks - r.nonfinite_blocks)
                   for r in live)
        worst = max(rs, key=lambda r: r.clipped_block_share or 0.0)
        out["casts"].append({
            "cast": label.get(cast, cast), "spec": cast, "direction": direction,
            "tensors": len(rs), "n_blocks": n,
            "clipped_block_share": sum(r.clipped_blocks for r in rs) / n if n else None,
            **{k: sum(getattr(r, k) for r in rs)
               for k in ("scale_at_max", "scale_subnormal", "scale_at_min")},
            "scale_spread": max((r.scale_spread for r in live), default=None),
            # the median of medians is no median: the per-tensor table holds them
            "range_median": None,
            "range_max": max((r.range_max for r in live), default=None),
            "range_over_span": round(over) / n_live if n_live else None,
            "worst": {"tensor": worst.tensor, "clipped_block_share": worst.clipped_block_share}})
    return out


def _print(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from driftcli.report.terminal import width

    table = Table(title="block-stats: over all tensors, per cast and direction")
    head = ("cast", "direction", "tensors", "blocks", "clipped", "scale max", "scale sub",
            "scale min", "spread", "range max", "over span", "most clipped")
    for col in head:
        table.add_column(col, justify="left" if col in ("cast", "direction", "most clipped")
                         else "right")
    for c in summary["casts"]:
        w = c["worst"]
        table.add_row(esc(c["cast"]), c["direction"], str(c["tensors"]), str(c["n_blocks"]),
                      fmt(c["clipped_block_share"]), str(c["scale_at_max"]),
                      str(c["scale_subnormal"]), str(c["scale_at_min"]), fmt(c["scale_spread"]),
                      fmt(c["range_max"]), fmt(c["range_over_span"]),
                      esc(f"{w['tensor']} {fmt(w['clipped_block_share'])}"))
    out = Console(width=width(), soft_wrap=True)
    out.print(table)
    for e in summary["errors"]:
        out.print(f"[red]not measured[/red] {esc(e['source'])} {esc(e['tensor'])}: "
                  f"{esc(e['error'])}")
    out.print(f"wrote {esc(summary['table'])} and {esc(summary['scales_table'])}")


@command("block-stats")
def block_stats_command(
    inputs: Inputs, cast: Casts, out: Out = OUT, include: Include = None,
    exclude: Exclude = None, fast_hash: FastHash = False, quiet: Quiet = False,
    as_json: AsJson = False, engine: EngineOpt = Engine.SERIAL, workers: Workers = None,
    ray_address: RayAddress = None, resume: Resume = False, overwrite: Overwrite = False,
) -> None:
    """Inside the scale groups, per tensor, cast and direction.

    Along rows and along columns (the transpose a weight-gradient matmul reads), or per tile:
    the scale-code histogram, blocks that clip, scales at the scale format's max, in its
    subnormals or at its minimum, each block's dynamic range in binades, the scales' spread.
    """
    from driftcli.io.outputs import check_writable
    from driftcli.io.tables import identify_in_background, write_table
    from driftcli.measures.block_stats import BlockScaleRow, BlockStatsRow, block_stats
    from driftcli.memory import bound_memory

    check_writable(out)  # fail now, not after the pass
    path = out / f"{BlockStatsRow.TABLE}.parquet"
    scales_path = out / f"{BlockScaleRow.TABLE}.parquet"
    with table_output(path, overwrite=overwrite), \
            table_output(scales_path, overwrite=overwrite):
        run_on = execution(engine, workers, ray_address, units_dir(path), resume, fast_hash)
        bound_memory()
        with progress_bar("block-stats", Bar.BYTES, quiet) as advance:
            found = block_stats(inputs, cast, include=include or (), exclude=exclude or (),
                                execution=run_on, progress=advance)
        identities = identify_in_background(found.files, fast_hash)
        prov = table_provenance(found.files, run_on, fast_hash=fast_hash,
                                identities=identities(),
                                extra={"casts": cast, "names": {"cast": cast_names(cast)}})
        write_table(scales_path, BlockScaleRow, found.scales, prov)
        summary = summarize(found.rows, path, cast)
        summary["scales_table"] = str(scales_path)
        failed = [f"{e['source']} {e['tensor']}: {e['error']}" for e in summary["errors"]]
        publish(path, BlockStatsRow, found.rows, prov, summary, _print, as_json=as_json,
                quiet=quiet, failures=failed, failed="tensor(s) or file(s) could not be read",
                units=units_dir(path))
