"""The numbers and plots of docs/findings.md, from the tables examples/findings.sh wrote.

    python examples/findings_summary.py OUT SECONDS PART [PART ...]

For each part (a, b, c, d, claim1 ... claim7) it reads drift's own tables in OUT, prints the
key numbers, merges them into OUT/summary.json under the part's name, and draws
OUT/plots/PART.png. Everything here reads tables; nothing trains or measures.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

SEEDS = (0, 1, 2)
STUDY = {
    "claim2": "diverged on every seed with attention; GPU steps 452, 494, 553, simulator 446, "
              "453, 497; the same policy trained fine without attention",
    "claim3": "casting the gradient afterwards never diverges",
    "claim4": "one extra bit of exponent headroom rescued it there too",
    "claim5": "softmax probabilities clip a tenth as much as the tanh outputs (27-30 %)",
    "claim6": "holding the attention matmuls in full precision did not save the run",
    "claim7": "rounding the scale up made every four-bit run diverge; the scale with the better "
              "gradient is the one that dies",
}
OUT = Path(".")
PLOTS = Path(".")


def r4(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and not np.isfinite(x)) else round(
        float(x), 4)


# --- runs ----------------------------------------------------------------------------------------

def run(folder: Path) -> dict[str, Any]:
    """A training run's fate and losses."""
    j = json.loads((folder / "run.json").read_text())
    t = pd.read_parquet(folder / "train.parquet")
    loss = t.loss.to_numpy()
    done = t[~t.diverged]
    return {"diverged_at": j["diverged_at"], "steps_done": j["steps_done"],
            "min_loss": r4(done.loss.min()), "final_val_loss": r4(j["final_val_loss"]),
            "last20_mean_loss": r4(done.loss.iloc[-20:].mean()),
            "max_ratio_after_50": r4(max_ratio(loss)),
            "seconds_per_step": j["seconds_per_step"]}


def max_ratio(loss: np.ndarray, after: int = 50) -> float:
    """The largest loss over the running minimum before it, after step ``after``."""
    low = np.minimum.accumulate(loss)
    return float((loss[after:] / low[after - 1:-1]).max()) if len(loss) > after else 1.0


def runs(pattern: str) -> dict[str, dict[str, Any]]:
    """Every run whose folder matches ``pattern`` (a glob under OUT), by folder name."""
    return {p.parent.name: run(p.parent) for p in sorted(OUT.glob(f"{pattern}/run.json"))}


def fates(group: dict[str, dict[str, Any]]) -> str:
    return ", ".join("-" if v["diverged_at"] is None else str(v["diverged_at"])
                     for v in group.values())


def curve(ax: Any, folder: Path, label: str | None, colour: str, style: str = "-") -> None:
    """A run's loss, the mean of every 10 steps, with an x where it diverged."""
    t = pd.read_parquet(folder / "train.parquet")
    smooth = t.loss.rolling(10, min_periods=1).mean()
    ax.plot(t.step, smooth, style, color=colour, lw=1, label=label)
    if t.diverged.any():
        ax.plot(t.step.iloc[-1], min(smooth.iloc[-1], 7.5), "x", color=colour, ms=8, mew=2)


def loss_panels(path: Path, panels: list[tuple[str, list[tuple[str, str, str]]]]) -> None:
    """One panel per title, each a list of (run glob with {seed}, label, colour)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, arms) in zip(axes[0], panels, strict=True):
        for pattern, label, colour in arms:
            for i, seed in enumerate(SEEDS):
                folder = OUT / pattern.format(seed=seed)
                if (folder / "train.parquet").exists():
                    curve(ax, folder, label if i == 0 else None, colour,
                          ("-", "--", ":")[i])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss, mean of 10 steps (nats/byte)")
        ax.set_ylim(1.5, 7.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="seeds 0, 1, 2: solid, dashed, dotted; x: diverged",
                  title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --- tables ---------------------------------------------------------------------------------------

def cast_name(spec: str) -> str:
    if ":tensor:" in spec:
        return "fp8_e4m3"
    if ":floor+1:" in spec:
        return "mxfp8_e4m3_floor+1"
    if ":floor:" in spec:
        return "mxfp8_e4m3"
    return spec


def clip_table(folder: Path) -> pd.DataFrame:
    d = pd.read_parquet(folder / "clip-rate.parquet")
    d = d[d.tensor != "*"].copy()
    d["c"] = d.cast.map(cast_name)
    return d


def pooled(d: pd.DataFrame, pattern: str, cast: str = "mxfp8_e4m3") -> float:
    t = d[d.tensor.str.fullmatch(pattern) & (d.c == cast)]
    return float(t.clipped.sum() / t.n_finite.sum())


MLP_TANH = r"(hidden\.1|head)/activation"
TF_TANH = r"blocks\.\d+\.mlp\.out/activation"
TF_P = r"blocks\.\d+\.attn/1/lhs"


def probe_all(folder: Path) -> pd.DataFrame:
    p = pd.read_parquet(folder / "probe.parquet")
    return p[p.parameter == "*"]


# --- parts ----------------------------------------------------------------------------------------

def part_a() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for model, tanh in (("mlp", MLP_TANH), ("tf", TF_TANH)):
        for seed in SEEDS:
            d = clip_table(OUT / "a" / f"clip-{model}-s{seed}")
            row = {"tanh_pooled": r4(pooled(d, tanh)),
                   "tanh_pooled_floor+1": r4(pooled(d, tanh, "mxfp8_e4m3_floor+1")),
                   "tanh_per_tensor": {r.tensor: r4(r.clip_rate) for r in d[
                       d.tensor.str.fullmatch(tanh) & (d.c == "mxfp8_e4m3")].itertuples()},
                   "other_max": r4(d[~d.tensor.str.fullmatch(tanh)
                                     & (d.c == "mxfp8_e4m3")].clip_rate.max())}
            if model == "tf":
                row["softmax_p"] = {r.tensor: r4(r.clip_rate) for r in d[
                    d.tensor.str.fullmatch(TF_P) & (d.c == "mxfp8_e4m3")].itertuples()}
            res[f"{model}-s{seed}"] = row
    for seed in SEEDS:
        res[f"mlp-s{seed}"]["final_val_loss"] = run(OUT / f"mlp-exact-s{seed}")["final_val_loss"]
        res[f"tf-s{seed}"]["final_val_loss"] = run(OUT / f"tf-exact-s{seed}")["final_val_loss"]
    for k, v in res.items():
        print(f"  {k}: tanh clipped {v['tanh_pooled']} (floor+1 {v['tanh_pooled_floor+1']}), "
              f"other operands max {v['other_max']}, P {v.get('softmax_p', '')}")
    return res


def part_b() -> dict[str, Any]:
    res: dict[str, Any] = {"error_bias": {}, "probe": {}}
    for model in ("mlp", "tf"):
        for seed in SEEDS:
            d = pd.read_parquet(OUT / "b" / f"eb-{model}-s{seed}" / "error-bias.parquet")
            d["c"] = d.cast.map(cast_name)
            res["error_bias"][f"{model}-s{seed}"] = {
                r.c: {"rel_error": r4(r.rel_error), "bias": round(float(r.bias), 5),
                      "alignment": round(float(r.alignment), 3)}
                for r in d[d.tensor == "*"].itertuples()}
            p = probe_all(OUT / f"{model}-exact-s{seed}")
            res["probe"][f"{model}-s{seed}"] = {
                pol: {int(r.step): [r4(r.cosine), r4(r.retention), r4(r.rel_error)]
                      for r in g.itertuples()}
                for pol, g in p.groupby("policy", sort=False)
                if pol in ("fp8_e4m3", "mxfp8_e4m3", "mxfp8_e4m3_floor+1")}
    for k, v in res["error_bias"].items():
        print(f"  {k}: " + "; ".join(f"{c} err {x['rel_error']} bias {x['bias']:+} align "
                                    f"{x['alignment']:+}" for c, x in v.items()))
    for k, v in res["probe"].items():
        print(f"  {k}: " + "; ".join(f"{pol} s1000 cos/ret/err {x.get(1000)}"
                                    for pol, x in v.items()))
    return res


CLAIM1_POLICIES = ("fp8_e4m3", "mxfp8_e4m3", "mxfp8_e4m3_floor+1", "nvfp4", "mxfp4_e2m1",
                   "mxfp4_e2m1_ceil")


def claim1() -> dict[str, Any]:
    frames = []
    for model in ("mlp", "tf"):
        for seed in SEEDS:
            p = probe_all(OUT / f"{model}-exact-s{seed}").assign(model=model, seed=seed)
            frames.append(p[p.policy.isin(CLAIM1_POLICIES) & (p.step > 0)])
    p = pd.concat(frames)
    res: dict[str, Any] = {"per_policy": {}}
    worse_cos = worse_ret = cases = 0
    for pol in CLAIM1_POLICIES:
        g = p[p.policy == pol]
        row = {}
        for model in ("mlp", "tf"):
            m = g[g.model == model]
            row[model] = {"cosine_mean": r4(m.cosine.mean()), "cosine_min": r4(m.cosine.min()),
                          "cosine_max": r4(m.cosine.max()),
                          "retention_mean": r4(m.retention.mean()),
                          "abs_1_minus_retention_mean": r4((1 - m.retention).abs().mean())}
        pair = g.pivot_table(index=["seed", "step"], columns="model",
                             values=["cosine", "retention"])
        tf_worse = (pair["cosine"]["tf"] < pair["cosine"]["mlp"])
        tf_ret = ((1 - pair["retention"]["tf"]).abs() > (1 - pair["retention"]["mlp"]).abs())
        row["tf_lower_cosine"] = f"{int(tf_worse.sum())}/{len(tf_worse)}"
        row["tf_retention_further_from_1"] = f"{int(tf_ret.sum())}/{len(tf_ret)}"
        worse_cos += int(tf_worse.sum())
        worse_ret += int(tf_ret.sum())
        cases += len(tf_worse)
        res["per_policy"][pol] = row
        print(f"  {pol:20s} MLP cos {row['mlp']['cosine_mean']} ret {row['mlp']['retention_mean']}"
              f" | TF cos {row['tf']['cosine_mean']} ret {row['tf']['retention_mean']} | TF lower "
              f"cosine {row['tf_lower_cosine']}, retention further from 1 "
              f"{row['tf_retention_further_from_1']}")
    res["tf_lower_cosine"] = f"{worse_cos}/{cases}"
    res["tf_retention_further_from_1"] = f"{worse_ret}/{cases}"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, col in zip(axes, ("cosine", "retention"), strict=True):
        for k, (model, colour) in enumerate((("mlp", "#1f77b4"), ("tf", "#d62728"))):
            m = p[p.model == model]
            for i, pol in enumerate(CLAIM1_POLICIES):
                v = m[m.policy == pol][col].to_numpy()
                x = i + (k - 0.5) * 0.3 + np.linspace(-0.1, 0.1, len(v))
                ax.plot(x, v, "o", color=colour, ms=3, alpha=0.7,
                        label=("tanh MLP" if model == "mlp" else "transformer") if i == 0
                        else None)
        ax.set_xticks(range(len(CLAIM1_POLICIES)), CLAIM1_POLICIES, rotation=20, fontsize=8)
        ax.set_ylabel(f"{col} (gradient under the policy vs exact)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if col == "retention":
            ax.axhline(1, color="k", lw=0.5)
    axes[0].set_title("gradient cosine, checkpoints 250-1000, seeds 0-2", fontsize=10)
    axes[1].set_title("retention <g^, g>/|g|^2", fontsize=10)
    fig.tight_layout()
    fig.savefig(PLOTS / "claim1.png", dpi=80)
    plt.close(fig)
    return res


def claim2() -> dict[str, Any]:
    res = {arm: runs(f"lr01/{arm}-s*") for arm in ("tf-mxfp8", "mlp-mxfp8", "tf-exact",
                                                 "mlp-exact")}
    for arm, g in res.items():
        print(f"  {arm:10s} diverged at {fates(g)}; min loss "
              f"{[v['min_loss'] for v in g.values()]}; final val "
              f"{[v['final_val_loss'] for v in g.values()]}")
    # the attention probes of both transformer arms: the largest |q.k| logit of any layer and
    # P's mass in [0.5, 1] (the mean over layers), every 100 logged steps
    res["attention"] = {}
    for arm in ("tf-exact", "tf-mxfp8"):
        for seed in SEEDS:
            path = OUT / "lr01" / f"{arm}-s{seed}" / "attention.parquet"
            if not path.exists():
                continue
            a = pd.read_parquet(path)
            by_step = a.groupby("step").agg(logit_max=("logit_max", "max"),
                                            p_mass_high=("p_mass_high", "mean"))
            res["attention"][f"{arm}-s{seed}"] = {
                int(step): [r4(r.logit_max), r4(r.p_mass_high)]
                for step, r in by_step.iterrows() if step % 100 == 0 or step == by_step.index[-1]}
            print(f"  {arm}-s{seed} largest logit / P mass in [0.5, 1] by step: "
                  f"{res['attention'][f'{arm}-s{seed}']}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, colour, label in (("tf-exact", "#2ca02c", "exact"),
                               ("tf-mxfp8", "#d62728", "mxfp8_e4m3 (both operands)")):
        for i, seed in enumerate(SEEDS):
            path = OUT / "lr01" / f"{arm}-s{seed}" / "attention.parquet"
            if path.exists():
                a = pd.read_parquet(path).groupby("step").logit_max.max()
                ax.plot(a.index, a.values, ("o-", "s--", "^:")[i], color=colour, ms=3,
                        label=label if i == 0 else None)
    ax.set_title("transformer, lr 0.01: largest |q·k| logit of any layer", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("logit")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "claim2_logits.png", dpi=80)
    plt.close(fig)
    loss_panels(PLOTS / "claim2.png", [
        ("transformer, lr 0.01", [("lr01/tf-exact-s{seed}", "exact", "#2ca02c"),
                                  ("lr01/tf-mxfp8-s{seed}", "mxfp8_e4m3 (both operands)",
                                   "#d62728")]),
        ("tanh MLP, lr 0.01", [("lr01/mlp-exact-s{seed}", "exact", "#2ca02c"),
                               ("lr01/mlp-mxfp8-s{seed}", "mxfp8_e4m3 (both operands)",
                                "#d62728")])])
    return res


def claim3() -> dict[str, Any]:
    res = {"tf-mxfp8-operands": runs("lr01/tf-mxfp8-s*"),
           "tf-mxfp8-result": runs("lr01/tf-result-s*"),
           "mlp-mxfp4-operands-lr0.03": runs("c/mxfp4-recast-s*"),
           "mlp-mxfp4-result-lr0.03": runs("c/mxfp4-result-s*")}
    for arm, g in res.items():
        print(f"  {arm:26s} diverged at {fates(g)}; final val "
              f"{[v['final_val_loss'] for v in g.values()]}")
    loss_panels(PLOTS / "claim3.png", [
        ("transformer, mxfp8_e4m3, lr 0.01", [
            ("lr01/tf-mxfp8-s{seed}", "backward casts its operands", "#d62728"),
            ("lr01/tf-result-s{seed}", "backward casts its result (wrong)", "#1f77b4")]),
        ("tanh MLP, mxfp4_e2m1, lr 0.03", [
            ("c/mxfp4-recast-s{seed}", "backward casts its operands", "#d62728"),
            ("c/mxfp4-result-s{seed}", "backward casts its result (wrong)", "#1f77b4")])])
    return res


def claim4() -> dict[str, Any]:
    res = {"tf-mxfp8-floor": runs("lr01/tf-mxfp8-s*"),
           "tf-mxfp8-floor+1": runs("lr01/tf-floor1-s*"),
           "mlp-mxfp8-floor-lr0.03": runs("c/mxfp8-recast-s*"),
           "mlp-mxfp8-floor+1-lr0.03": runs("c/mxfp8-floor1-s*")}
    for arm, g in res.items():
        print(f"  {arm:26s} diverged at {fates(g)}; final val "
              f"{[v['final_val_loss'] for v in g.values()]}")
    loss_panels(PLOTS / "claim4.png", [
        ("transformer, lr 0.01", [("lr01/tf-mxfp8-s{seed}", "mxfp8_e4m3 (floor)", "#d62728"),
                                  ("lr01/tf-floor1-s{seed}", "mxfp8_e4m3_floor+1", "#1f77b4")]),
        ("tanh MLP, lr 0.03", [("c/mxfp8-recast-s{seed}", "mxfp8_e4m3 (floor)", "#d62728"),
                               ("c/mxfp8-floor1-s{seed}", "mxfp8_e4m3_floor+1", "#1f77b4")])])
    return res


def claim5() -> dict[str, Any]:
    rows = []
    tables = {m: clip_table(OUT / "claim5" / f"clip-{m}") for m in ("tf", "mlp")}
    for d in tables.values():
        found = d.source.str.extract(r"s(\d)-(\d{6})\.safetensors$")
        d["seed"], d["step"] = found[0].astype(int), found[1].astype(int)
    for (seed, step), d in tables["tf"].groupby(["seed", "step"]):
        for layer in (0, 1):
            p = d[d.tensor == f"blocks.{layer}.attn/1/lhs"].clip_rate.iloc[0]
            tanh = d[d.tensor == f"blocks.{layer}.mlp.out/activation"].clip_rate.iloc[0]
            rows.append({"model": "tf", "seed": seed, "step": step, "layer": layer, "p": p,
                         "tanh": tanh})
    for (seed, step), m in tables["mlp"].groupby(["seed", "step"]):
        rows.append({"model": "mlp", "seed": seed, "step": step, "layer": -1, "p": None,
                     "tanh": pooled(m, MLP_TANH)})
    f = pd.DataFrame(rows)
    tf = f[f.model == "tf"]
    mlp = f[f.model == "mlp"]
    res: dict[str, Any] = {
        "per_layer_step_mean_over_seeds": {
            f"layer{layer}-step{step}": {"p": r4(g.p.mean()), "tanh": r4(g.tanh.mean())}
            for (layer, step), g in tf.groupby(["layer", "step"])},
        "tf_p_mean": r4(tf.p.mean()), "tf_tanh_mean": r4(tf.tanh.mean()),
        "mlp_tanh_mean": r4(mlp.tanh.mean()),
        "p_over_tf_tanh": r4(tf.p.sum() / tf.tanh.sum()),
        "p_over_mlp_tanh": r4(tf.p.mean() / mlp.tanh.mean()),
        "p_below_tanh_cells": f"{int((tf.p < tf.tanh).sum())}/{len(tf)}",
    }
    # P in the diverging runs (the train table's attention probes, every 50 steps)
    att = []
    for seed in SEEDS:
        path = OUT / "lr01" / f"tf-mxfp8-s{seed}" / "attention.parquet"
        if path.exists():
            att.append(pd.read_parquet(path).assign(seed=seed))
    if att:
        a = pd.concat(att)
        res["lr01_mxfp8_p_clip_by_layer"] = {
            str(layer): {"first": r4(g.sort_values("step").p_clip_rate.iloc[:3].mean()),
                         "last": r4(g.sort_values("step").p_clip_rate.iloc[-3:].mean())}
            for layer, g in a.groupby("layer")}
        res["lr01_mxfp8_logit_max_last"] = r4(a.sort_values("step").groupby(
            ["seed", "layer"]).logit_max.last().max())
    print(f"  P clip (mean over layers, checkpoints, seeds) {res['tf_p_mean']}, the same "
          f"transformer's tanh outputs {res['tf_tanh_mean']}, the MLP's tanh outputs "
          f"{res['mlp_tanh_mean']}; P/tanh {res['p_over_tf_tanh']} (transformer), "
          f"{res['p_over_mlp_tanh']} (MLP); P below tanh in {res['p_below_tanh_cells']} cells")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for layer, ax in zip((0, 1), axes, strict=True):
        g = tf[tf.layer == layer]
        for col, colour, label in (("p", "#d62728", "softmax P (P·v's left operand)"),
                                   ("tanh", "#1f77b4", "tanh output (mlp.out's input)")):
            for i, seed in enumerate(SEEDS):
                s = g[g.seed == seed].sort_values("step")
                ax.plot(s.step, s[col], ("o-", "s--", "^:")[i], color=colour, ms=4,
                        label=label if i == 0 else None)
        ms = mlp.groupby("step").tanh.mean()
        ax.plot(ms.index, ms.values, "D-", color="#7f7f7f", ms=4,
                label="tanh MLP's tanh outputs (mean of seeds)")
        ax.set_yscale("log")
        ax.set_title(f"transformer block {layer}: share clipped by mxfp8_e4m3 (floor)",
                     fontsize=10)
        ax.set_xlabel("checkpoint step (exact runs, lr 3e-3)")
        ax.set_ylabel("clip rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOTS / "claim5.png", dpi=80)
    plt.close(fig)
    return res


def claim6() -> dict[str, Any]:
    res = {"tf-mxfp8": runs("lr01/tf-mxfp8-s*"), "tf-keep-attention": runs("lr01/tf-keepattn-s*"),
           "tf-exact": runs("lr01/tf-exact-s*")}
    for arm, g in res.items():
        print(f"  {arm:18s} diverged at {fates(g)}; final val "
              f"{[v['final_val_loss'] for v in g.values()]}")
    loss_panels(PLOTS / "claim6.png", [
        ("transformer, lr 0.01", [
            ("lr01/tf-exact-s{seed}", "exact", "#2ca02c"),
            ("lr01/tf-mxfp8-s{seed}", "mxfp8_e4m3, every matmul", "#d62728"),
            ("lr01/tf-keepattn-s{seed}", "mxfp8_e4m3, q·kᵀ and P·v in float32", "#9467bd")])])
    return res


def claim7() -> dict[str, Any]:
    res: dict[str, Any] = {"floor": runs("claim7/mlp-floor-s*"),
                           "ceil": runs("claim7/mlp-ceil-s*")}
    for arm in ("floor", "ceil"):
        print(f"  mxfp4 {arm:5s} diverged at {fates(res[arm])}; final val "
              f"{[v['final_val_loss'] for v in res[arm].values()]}")
    # the gradient each rule gives at the same weights: the exact runs' checkpoints
    frames = [probe_all(OUT / f"mlp-exact-s{seed}").assign(seed=seed) for seed in SEEDS]
    p = pd.concat(frames)
    p = p[p.policy.isin(["mxfp4_e2m1", "mxfp4_e2m1_ceil"]) & (p.step > 0)]
    res["exact_checkpoints"] = {
        pol: {"cosine_mean": r4(g.cosine.mean()), "retention_mean": r4(g.retention.mean()),
              "rel_error_mean": r4(g.rel_error.mean())}
        for pol, g in p.groupby("policy")}
    pair = p.pivot_table(index=["seed", "step"], columns="policy", values="cosine")
    res["ceil_higher_cosine"] = (f"{int((pair['mxfp4_e2m1_ceil'] > pair['mxfp4_e2m1']).sum())}"
                                 f"/{len(pair)}")
    # and along each run, at its own weights, under its own rule
    own = []
    for arm, pol in (("floor", "mxfp4_e2m1"), ("ceil", "mxfp4_e2m1_ceil")):
        for seed in SEEDS:
            path = OUT / "claim7" / f"mlp-{arm}-s{seed}" / "probe.parquet"
            if path.exists():
                q = probe_all(path.parent)
                own.append(q[q.policy == pol].assign(arm=arm, seed=seed))
    o = pd.concat(own) if own else pd.DataFrame()
    if len(o):
        res["own_runs"] = {arm: {int(s): r4(g[g.step == s].cosine.mean())
                                 for s in sorted(g.step.unique())}
                           for arm, g in o.groupby("arm")}
    print(f"  at the exact runs' checkpoints: {res['exact_checkpoints']}; ceil's cosine higher "
          f"in {res['ceil_higher_cosine']}; along their own runs: {res.get('own_runs')}")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for arm, colour in (("floor", "#d62728"), ("ceil", "#1f77b4")):
        for i, seed in enumerate(SEEDS):
            folder = OUT / "claim7" / f"mlp-{arm}-s{seed}"
            curve(axes[0], folder, f"mxfp4_e2m1 {arm}" if i == 0 else None, colour,
                  ("-", "--", ":")[i])
    axes[0].set_ylim(1.5, 7.5)
    axes[0].set_title("tanh MLP, lr 3e-3: training loss (mean of 10 steps)", fontsize=10)
    axes[0].set_xlabel("step")
    for pol, colour in (("mxfp4_e2m1", "#d62728"), ("mxfp4_e2m1_ceil", "#1f77b4")):
        for i, seed in enumerate(SEEDS):
            s = p[(p.policy == pol) & (p.seed == seed)].sort_values("step")
            axes[1].plot(s.step, s.cosine, ("o-", "s--", "^:")[i], color=colour, ms=4,
                         label=pol if i == 0 else None)
    axes[1].set_title("gradient cosine at the exact runs' checkpoints", fontsize=10)
    axes[1].set_xlabel("checkpoint step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "claim7.png", dpi=80)
    plt.close(fig)
    return res


C_ARMS = ("exact", "mxfp4-fwd", "mxfp4-dyonly", "mxfp4-nody", "mxfp4-recast", "mxfp8-fwd",
          "mxfp8-recast")


def part_c() -> dict[str, Any]:
    res = {arm: runs(f"c/{arm}-s*") for arm in C_ARMS}
    for arm, g in res.items():
        print(f"  {arm:13s} diverged at {fates(g)}; min {[v['min_loss'] for v in g.values()]}; "
              f"final val {[v['final_val_loss'] for v in g.values()]}")
    loss_panels(PLOTS / "c.png", [
        ("tanh MLP, lr 0.03, MXFP4", [
            ("c/exact-s{seed}", "exact", "#2ca02c"),
            ("c/mxfp4-fwd-s{seed}", "forward only", "#1f77b4"),
            ("c/mxfp4-nody-s{seed}", "backward casts W, X, not dY", "#9467bd"),
            ("c/mxfp4-dyonly-s{seed}", "backward casts dY only", "#ff7f0e"),
            ("c/mxfp4-recast-s{seed}", "both backward operands", "#d62728")]),
        ("tanh MLP, lr 0.03, MXFP8", [
            ("c/exact-s{seed}", "exact", "#2ca02c"),
            ("c/mxfp8-fwd-s{seed}", "forward only", "#1f77b4"),
            ("c/mxfp8-recast-s{seed}", "both backward operands", "#d62728")])])
    return res


def part_d() -> dict[str, Any]:
    res: dict[str, Any] = {"rne": runs("d/nvfp4-rne-s*"), "sr": runs("d/nvfp4-sr-s*"),
                           "exact_val": {seed: run(OUT / f"mlp-exact-s{seed}")["final_val_loss"]
                                         for seed in SEEDS}}
    probe = {}
    for seed in SEEDS:
        p = probe_all(OUT / f"mlp-exact-s{seed}")
        for pol in ("nvfp4", "nvfp4:sr"):
            for r in p[(p.policy == pol) & (p.step > 0)].itertuples():
                probe[f"{pol} s{seed} step{r.step}"] = {
                    "cosine": r4(r.cosine), "retention": r4(r.retention),
                    "rel_error": r4(r.rel_error), "expected_cosine": r4(r.expected_cosine),
                    "expected_retention": r4(r.expected_retention),
                    "expected_rel_error": r4(r.expected_rel_error)}
    res["probe"] = probe
    for arm in ("rne", "sr"):
        g = res[arm]
        print(f"  nvfp4 {arm}: final val {[v['final_val_loss'] for v in g.values()]}; last 20 "
              f"{[v['last20_mean_loss'] for v in g.values()]}; diverged {fates(g)}")
    print(f"  exact final val {list(res['exact_val'].values())}")
    loss_panels(PLOTS / "d.png", [("tanh MLP, lr 3e-3, NVFP4", [
        ("mlp-exact-s{seed}", "exact", "#2ca02c"),
        ("d/nvfp4-rne-s{seed}", "nvfp4 (round to nearest)", "#d62728"),
        ("d/nvfp4-sr-s{seed}", "nvfp4:sr", "#1f77b4")])])
    return res


def divergence_rule() -> dict[str, Any]:
    """The largest loss / running-minimum ratio after step 50 in every run that did not
    diverge, and where the diverged runs stood 20 steps before they were caught."""
    calm, caught = [], []
    for path in sorted(OUT.glob("**/run.json")):
        t = pd.read_parquet(path.parent / "train.parquet")
        if t.diverged.any():
            loss = t.loss.to_numpy()
            low = np.minimum.accumulate(loss)
            caught.append(float(loss[-1] / low[-2]))
        elif len(t) > 50:
            calm.append(max_ratio(t.loss.to_numpy()))
    return {"runs_not_diverged": len(calm), "their_largest_ratio": r4(max(calm, default=None)),
            "runs_diverged": len(caught), "ratio_when_caught_min": r4(min(caught, default=None))}


PARTS: dict[str, Callable[[], dict[str, Any]]] = {
    "a": part_a, "b": part_b, "c": part_c, "d": part_d, "claim1": claim1, "claim2": claim2,
    "claim3": claim3, "claim4": claim4, "claim5": claim5, "claim6": claim6, "claim7": claim7}


def main(argv: list[str]) -> None:
    global OUT, PLOTS
    OUT = Path(argv[0])
    seconds = int(argv[1])
    PLOTS = OUT / "plots"
    PLOTS.mkdir(parents=True, exist_ok=True)
    path = OUT / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary["seconds_before_summary"] = seconds
    for part in argv[2:]:
        print(f"== {part}" + (f" (the study: {STUDY[part]})" if part in STUDY else ""))
        summary[part] = PARTS[part]()
    summary["divergence_rule"] = divergence_rule()
    print(f"== divergence rule: {summary['divergence_rule']}")
    print(f"== total {seconds} s before the summary")
    path.write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
