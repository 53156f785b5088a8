"""The advisor against the world (docs/findings.md, "Does the advisor's hybrid train?").

    python examples/findings_advise.py DIR

DIR is examples/findings.sh's ``advise`` folder: one ``drift advise`` output folder per choice
of kept layers (``advised``, ``last``, ``random-N``: an ``advise.parquet`` and ``advise.toml``)
and one ``drift train`` run per policy and seed, named ``NAME-sSEED`` (``mxfp8-s0`` is the
cast alone, ``advised-s0`` the advised policy). Writes DIR/summary.json and prints the table:
per choice its kept layers and their share of the matmul work, per run whether and where it
diverged, its final training loss and its final validation loss.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from driftcli.io.tables import read_table

RUN = re.compile(r"^(?P<name>.+)-s(?P<seed>\d+)$")
CHOICES = ("score", "last", "random")
"""drift advise's --choose values, in the order the table shows them."""


def choice(folder: Path) -> dict[str, Any]:
    """The layers one advise folder keeps, outermost only, and their share of the work."""
    table, prov = read_table(folder / "advise.parquet")
    rows = table.to_dict("records")
    kept = sorted(r["layer"] for r in rows if r["kept"])
    outer = [k for k in kept if not any(k.startswith(o + ".") for o in kept)]
    total = rows[0]["work"] / rows[0]["work_share"]
    return {"kept": outer, "kept_share": sum(r["work"] for r in rows if r["layer"] in outer)
            / total, "choose": prov.get("choose", "score"),
            "choose_seed": prov.get("choose_seed", 0), "budget": prov["budget"]}


def run(folder: Path) -> dict[str, Any]:
    """Whether and where one run diverged, and its last losses."""
    info = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    return {"diverged_at": info["diverged_at"], "steps_done": info["steps_done"],
            "final_loss": info["final_loss"], "final_val_loss": info["final_val_loss"],
            "policy_spec": info["policy_spec"]}


def summarize(root: Path) -> dict[str, Any]:
    """Every choice and every run under ``root``."""
    choices = {p.parent.name: choice(p.parent) for p in sorted(root.glob("*/advise.parquet"))}
    runs: dict[str, dict[str, Any]] = {}
    for p in sorted(root.glob("*/run.json")):
        m = RUN.match(p.parent.name)
        if m is not None:
            runs.setdefault(m["name"], {})[m["seed"]] = run(p.parent)
    return {"choices": choices, "runs": runs}


def cell(r: dict[str, Any] | None) -> str:
    """One run as the doc's table shows it."""
    if r is None:
        return "not run"
    if r["diverged_at"] is not None:
        return f"**{r['diverged_at']}**"
    return f"— ({r['final_val_loss']:.3f})"


def table(summary: dict[str, Any]) -> str:
    """The markdown table of docs/findings.md."""
    seeds = sorted({s for runs in summary["runs"].values() for s in runs}, key=int)
    lines = ["| policy | layers kept in bf16 | work kept | " +
             " | ".join(f"seed {s}" for s in seeds) + " |",
             "| --- | --- | ---: | " + " | ".join("---" for _ in seeds) + " |"]
    def order(name: str) -> tuple[int, int, int, str]:
        # the cast alone first, then the advice, the last layers, the random draws by seed
        c = summary["choices"].get(name)
        if c is None:
            return (0, 0, 0, name)
        return (1, CHOICES.index(c["choose"]), c["choose_seed"], name)

    for name in sorted(summary["runs"], key=order):
        runs = summary["runs"][name]
        c = summary["choices"].get(name)
        kept = "none" if c is None else ", ".join(f"`{k}`" for k in c["kept"]) or "none"
        share = "0" if c is None else f"{c['kept_share']:.4f}"
        lines.append(f"| {name} | {kept} | {share} | " +
                     " | ".join(cell(runs.get(s)) for s in seeds) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    summary = summarize(root)
    if not summary["runs"]:
        print(f"findings_advise: no run folder NAME-sSEED with a run.json in {root}",
              file=sys.stderr)
        return 2
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
