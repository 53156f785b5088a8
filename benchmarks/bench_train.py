"""Simulated training: a step of the findings' small transformer under a policy against the
exact step, side by side in one process.

The model is the transformer of ``docs/findings.md`` (2 pre-norm blocks, d_model 64, 4 heads,
tanh MLP, context 32, batch 16, AdamW at 3e-3, Shakespeare unless ``--text``). A step is what
``drift train`` does for one update: the batch's forward and backward with every matmul under
the policy (``driftcli.arithmetic``), then the optimizer's step. Each configuration (``exact``;
each policy on the numba back-end, the default; with ``--general`` each policy on the torch
back-end, ``DRIFT_JIT=never``: see :mod:`driftcli.kernels`) trains its own copy of
the run from the same seed, and the configurations take turns: every round runs
``--steps`` steps of each, one after the other, so a slow phase of a shared machine hits all
of them alike. The figure of a configuration is the median of its step times; the ratio is
that median over the exact step's. Runs of one policy on both paths must give the same loss
at every step, bit for bit: the script checks it and says so.

Run ``python benchmarks/bench_train.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from driftcli import kernels
from driftcli.arith.mode import arithmetic
from driftcli.arith.policy import ArithmeticPolicy, get_policy
from driftcli.models.config import TransformerConfig
from driftcli.models.nets import build_model, next_byte_loss
from driftcli.text import Corpus, load_corpus, sample_windows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import machine

CONFIG = TransformerConfig(context=32, d_model=64, layers=2, heads=4, activation="tanh")
BATCH = 16


@dataclass
class Run:
    """One configuration's own copy of the training run."""

    name: str
    policy: ArithmeticPolicy
    fused: bool
    corpus: Corpus
    seed: int = 0
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        self.model = build_model(CONFIG)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, betas=(0.9, 0.99))
        self.gen = torch.Generator().manual_seed(self.seed)

    def step(self) -> None:
        """One update, timed (the batch is drawn outside the timing)."""
        batch = sample_windows(self.corpus.train, BATCH, CONFIG.context + 1, self.gen,
                               self.corpus.source)
        start = time.perf_counter()
        kernels.set_jit("auto" if self.fused else "never")
        try:
            self.opt.zero_grad(set_to_none=True)
            with arithmetic(self.policy, model=self.model):
                loss = next_byte_loss(self.model, batch)
                loss.backward()
            self.opt.step()
        finally:
            kernels.set_jit("auto")
        self.times.append(time.perf_counter() - start)
        self.losses.append(float(loss.detach()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=["mxfp8_e4m3", "nvfp4"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="steps of each run per round")
    parser.add_argument("--general", action="store_true",
                        help="also time each policy on the torch back-end")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--text", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    corpus = load_corpus(args.text)
    runs = [Run("exact", get_policy("exact"), True, corpus)]
    for name in args.policies:
        runs.append(Run(name, get_policy(name), True, corpus))
        if args.general:
            runs.append(Run(f"{name} (torch back-end)", get_policy(name), False, corpus))
    for run in runs:  # warm-up: the first steps load or compile kernels
        run.step()
        run.step()
        run.times.clear()
    for _ in range(args.rounds):
        for run in runs:
            for _ in range(args.steps):
                run.step()
    print(" ".join(f"{k}={v}" for k, v in machine().items()))
    exact = statistics.median(runs[0].times)
    print(f"{'configuration':32s} {'s/step':>9s} {'x exact':>8s} {'steps':>6s}")
    for run in runs:
        median = statistics.median(run.times)
        print(f"{run.name:32s} {median:9.4f} {median / exact:8.2f} {len(run.times):6d}")
    for name in args.policies:
        pair = [r for r in runs if r.policy.name == name]
        if len(pair) == 2:
            same = pair[0].losses == pair[1].losses
            print(f"{name}: numba and torch back-ends give the same loss at every step "
                  f"({len(pair[0].losses)} steps): {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
