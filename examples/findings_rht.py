"""The numbers of docs/findings.md's section on the Hadamard transform and four over six.

    python examples/findings_rht.py OUT      # OUT: the folder examples/findings.sh rht wrote

Reads drift's own tables there (the scans of the wgrad operands in OUT/rht/scan, the
grad-cosine tables in OUT/rht/gc-b*), prints the section's numbers and writes them to
OUT/rht/summary.json. tests/test_findings_rht.py runs the same commands and checks the doc's
numbers with :func:`scan_numbers` and :func:`cosine_numbers`.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pandas as pd

CASTS = ("te/nvfp4", "te/nvfp4_rht", "te/nvfp4_4over6", "te/nvfp4_4over6_mse")
POLICIES = ("nvfp4", "te/nvfp4", "te/nvfp4_recipe", "te-nvfp4-recipe-no-rht")
# the dump's roles: X is the wgrad's activation operand, dY the gradient
OPERANDS = {"X": "activation", "dY": "gradient"}


def _cast_names(table: pd.DataFrame) -> dict[str, str]:
    """The preset name of each canonical cast spec in a scan table, in CASTS' order."""
    specs = list(dict.fromkeys(table["cast"]))
    if len(specs) != len(CASTS):
        raise ValueError(f"expected the {len(CASTS)} casts {CASTS}, found {len(specs)}")
    return dict(zip(specs, CASTS, strict=True))


def scan_numbers(scan_dir: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per cast and operand (X, dY): clipped and underflowed counts and rates, the mean
    rel_error and bias over the tensors, and in how many tensors each is below te/nvfp4's."""
    clip = pd.read_parquet(scan_dir / "clip-rate.parquet")
    under = pd.read_parquet(scan_dir / "underflow-rate.parquet")
    bias = pd.read_parquet(scan_dir / "error-bias.parquet")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for table in (clip, under, bias):
        table["name"] = table["cast"].map(_cast_names(table))
    base = bias[bias["name"] == CASTS[0]].set_index("tensor")
    for cast in CASTS:
        out[cast] = {}
        for label, role in OPERANDS.items():
            c = clip[(clip["name"] == cast) & (clip["role"] == role)]
            u = under[(under["name"] == cast) & (under["role"] == role)]
            b = bias[(bias["name"] == cast) & (bias["role"] == role)].set_index("tensor")
            ref = base.loc[b.index]
            out[cast][label] = {
                "tensors": len(b),
                "elements": int(c["n_finite"].sum()),
                "clipped": int(c["clipped"].sum()),
                "clip_rate": float(c["clipped"].sum() / c["n_finite"].sum()),
                "underflowed": int(u["underflowed"].sum()),
                "nonzero": int(u["n_nonzero"].sum()),
                "underflow_rate": float(u["underflowed"].sum() / u["n_nonzero"].sum()),
                "rel_error": float(b["rel_error"].mean()),
                "bias": float(b["bias"].mean()),
                "abs_bias": float(b["bias"].abs().mean()),
                "lower_error": int((b["rel_error"] < ref["rel_error"]).sum()),
                "lower_abs_bias": int((b["bias"].abs() < ref["bias"].abs()).sum()),
            }
    return out


def cosine_numbers(tables: list[Path]) -> dict[str, dict[str, Any]]:
    """Per policy (the recipe without its RHT by its policy file's name): the all-parameter
    cosine against exact on each batch, their mean and sample standard deviation, and the
    recipe's cosine minus the policy's on each batch (paired: the same batch)."""
    per: dict[str, list[float]] = {p: [] for p in POLICIES}
    for path in tables:
        t = pd.read_parquet(path)
        t = t[t["parameter"] == "*"]
        for _, row in t.iterrows():
            if row["policy"] in per:
                per[str(row["policy"])].append(float(row["cosine"]))
    recipe = per["te/nvfp4_recipe"]
    return {p: {"cosines": v, "mean": statistics.fmean(v), "sd": statistics.stdev(v),
                "recipe_minus": [r - c for r, c in zip(recipe, v, strict=True)]}
            for p, v in per.items() if len(v) > 1}


def main(argv: list[str]) -> None:
    """Print the section's numbers from OUT and write OUT/rht/summary.json."""
    root = Path(argv[1]) / "rht"
    summary = {"scan": scan_numbers(root / "scan"),
               "grad_cosine": cosine_numbers(sorted(root.glob("gc-b*/grad-cosine.parquet")))}
    for cast, ops in summary["scan"].items():
        for label, n in ops.items():
            print(f"{cast:20} {label:2} clip {n['clip_rate']:.4f} ({n['clipped']}) underflow "
                  f"{n['underflow_rate']:.4f} ({n['underflowed']}) rel_error {n['rel_error']:.4f}"
                  f" bias {n['bias']:+.5f} |bias| {n['abs_bias']:.5f} lower error "
                  f"{n['lower_error']}/{n['tensors']} lower |bias| {n['lower_abs_bias']}")
    for policy, n in summary["grad_cosine"].items():
        cos = " ".join(f"{c:.3f}" for c in n["cosines"])
        diff = " ".join(f"{d:+.4f}" for d in n["recipe_minus"])
        print(f"{policy:22} cosine {n['mean']:.3f} ± {n['sd']:.3f}  ({cos}); recipe minus it "
              f"{diff}, mean {statistics.fmean(n['recipe_minus']):+.4f}")
    (root / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv)
