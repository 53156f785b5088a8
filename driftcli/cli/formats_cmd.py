"""``drift formats``: the table of every named format, the cast presets, spec strings explained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

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
    tensor_cores: Annotated[bool, typer.Option(
        "--tensor-cores", help="List the tensor-core presets (tc=NAME in a matmul spec).")
    ] = False,
    policies: Annotated[bool, typer.Option(
        "--policies", help="List the arithmetic policy presets (--policy NAME), the recipe "
                           "policies with each role's casts and source, and the example "
                           "policy files.")] = False,
) -> None:
    """List the formats, the cast presets, or a spec's form.

    Every named format with its widths, bias, range and special values.
    """
    from rich.console import Console
    from rich.table import Table

    from driftcli.records.castspec import parse_cast
    from driftcli.records.formats import FORMATS, describe
    from driftcli.records.presets import PRESETS

    if tensor_cores or policies:
        listing = _tensor_cores() if tensor_cores else []
        listing += _policies() if policies else []
        if as_json:
            typer.echo(json.dumps(listing, indent=2))
            return
        _print_registries(listing)
        return
    if casts:
        rows = [_tensor_core_row(spec) if spec.strip().startswith("tc=") else
                {"spec": spec, "canonical": str(parse_cast(spec))} for spec in casts]
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
        else:
            for r in rows:
                typer.echo(f"{r['spec']} = {r['canonical']}")
        return
    if presets:
        from driftcli.records.recipes import IMPLEMENTATION_PRESETS, IMPLEMENTATIONS

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
        # listed by their own options: they need torch, which the cast presets do not
        console.print("tensor-core presets (tc=NAME in a matmul spec): drift formats "
                      "--tensor-cores; arithmetic policies (--policy NAME, example files): drift "
                      "formats --policies", soft_wrap=True)
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


def _tensor_cores() -> list[dict[str, Any]]:
    """Every tensor-core preset with its unit's parameters and source."""
    from driftcli.arith.tensorcores import CORES

    return [{"registry": "tensor-core", "preset": name, "use": f"tc={name}",
             "inputs": core.inputs, "group": core.unit.size, "kept_bits": core.unit.kept_bits,
             "result": core.acc, "rounding": core.rounding.value,
             "interleave": core.unit.interleave, "source": core.source}
            for name, core in CORES.items()]


def _example_policies() -> list[Path]:
    """The example policy files of a source checkout (``examples/policies``; an installed
    drift has none)."""
    folder = Path(__file__).resolve().parents[2] / "examples" / "policies"
    return sorted(folder.glob("*.toml")) if folder.is_dir() else []


def _policies() -> list[dict[str, Any]]:
    """The preset policies, then the example policy files with their first comment line."""
    from driftcli.arith.policy import POLICIES
    from driftcli.arith.recipe_policies import RECIPE_BY_NAME, RECIPES

    out: list[dict[str, Any]] = [{"registry": "policy", "preset": name, "use": f"--policy {name}",
                                  "meaning": meaning} for name, (_, meaning) in POLICIES.items()
                                 if name not in RECIPE_BY_NAME]
    for r in RECIPES:
        out.append({
            "registry": "recipe policy", "preset": r.name, "use": f"--policy {r.name}",
            "meaning": r.meaning,
            "roles": {role: dict(zip(("lhs", "rhs"), r.role_casts(role), strict=True))
                      for role in ("forward", "dgrad", "wgrad")},
            "accumulation": f"tc={r.tc}, order={r.order}" if r.tc
            else f"acc={r.acc}, order={r.order}",
            "backward_state": r.backward_state,
            "operand_states": dict(zip(("X", "W"), r.operand_states, strict=True)),
            "keep_matmuls": list(r.keep_matmuls),
            "keep_high_precision": list(r.keep_high_precision),
            "rht": list(r.rht), "departures": r.departures, "source": r.source})
    for path in _example_policies():
        lines = path.read_text(encoding="utf-8").splitlines()
        head = " ".join(line.lstrip("# ").strip() for line in
                        lines[:next((i for i, ln in enumerate(lines) if not ln.startswith("#")),
                                    len(lines))])
        first = head.split(". ")[0].rstrip(".") + "."  # the header comment's first sentence
        out.append({"registry": "example policy", "preset": path.stem,
                    "use": f"--policy examples/policies/{path.name}", "meaning": first})
    return out


def _print_registries(listing: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from driftcli.report.terminal import width

    console = Console(width=width(), soft_wrap=False)
    cores = [r for r in listing if r["registry"] == "tensor-core"]
    if cores:
        table = Table(title="tensor-core presets: tc=NAME in a matmul spec (docs/tensor-cores.md)")
        for col in ("preset", "inputs", "group", "kept bits", "result", "rounding", "source"):
            table.add_column(col, overflow="fold", no_wrap=col == "preset")
        for r in cores:
            table.add_row(r["preset"], r["inputs"], str(r["group"]), str(r["kept_bits"]),
                          r["result"], r["rounding"], r["source"])
        console.print(table)
    for registry, title in (("policy", "arithmetic policy presets: --policy NAME"),
                            ("recipe policy", ""),
                            ("example policy", "example policy files: --policy FILE")):
        rows = [r for r in listing if r["registry"] == registry]
        if not rows:
            continue
        if registry == "recipe policy":
            _print_recipes(console, rows)
            continue
        table = Table(title=title)
        for col in ("preset", "use", "meaning"):
            table.add_column(col, overflow="fold", no_wrap=col == "preset")
        for r in rows:
            table.add_row(r["preset"], r["use"], r["meaning"])
        console.print(table)


def _print_recipes(console: Any, recipes: list[dict[str, Any]]) -> None:
    """The recipe policies: each role's casts (lhs · rhs), what the backward reads, what stays
    in high precision; then each one's source and departures."""
    from rich.table import Table

    table = Table(title="recipe policies: --policy NAME, a cast per role and operand "
                        "(docs/recipes.md#recipe-policies)")
    for col in ("policy", "forward X·Wᵀ", "dgrad dY·W", "wgrad Xᵀ·dY", "backward, kept"):
        table.add_column(col, overflow="fold", no_wrap=col == "policy")
    def cell(r: dict[str, Any], role: str) -> str:
        casts = r["roles"][role]
        if casts["lhs"] == casts["rhs"] == "none":
            return "plain (high precision)"
        return " · ".join(casts[side] for side in ("lhs", "rhs"))

    for r in recipes:
        kept = ", ".join([*r["keep_matmuls"], *r["keep_high_precision"]]) or "nothing"
        table.add_row(r["preset"], cell(r, "forward"), cell(r, "dgrad"), cell(r, "wgrad"),
                      f"{_states(r['operand_states'])}; {r['accumulation']}; keeps {kept}")
    console.print(table)
    for r in recipes:  # the sources are long: one paragraph each, below the table
        departs = f" Departs: {r['departures']}." if r["departures"] else ""
        console.print(f"{r['preset']}: {r['source']}.{departs}", soft_wrap=True)


def _tensor_core_row(spec: str) -> dict[str, Any]:
    """``tc=NAME`` (a matmul spec's tensor-core part) explained: the unit it stands for."""
    from driftcli.arith.tensorcores import tensor_core

    name = spec.strip().removeprefix("tc=")
    core = tensor_core(name)  # an unknown name: a DriftError naming the closest presets
    unit = core.unit
    text = (f"tensor core: {core.inputs} operands, groups of {unit.size} products, "
            f"{unit.kept_bits} bits kept, each group rounded ({core.rounding.value}) into "
            f"{core.acc}" + (f", interleaved by {unit.interleave}" if unit.interleave else "")
            + f" (a matmul spec part, not a cast; {core.source})")
    return {"spec": spec, "canonical": text, "tensor_core": name}


def _states(states: dict[str, str]) -> str:
    """A recipe's backward state: one word, or one per operand where they differ."""
    x, w = states["X"], states["W"]
    return x if x == w else f"X {x}, W {w}"
