"""``drift.monitor``'s cost on a training run: a small transformer's training step on the CPU,
plain and under the monitor (three casts, every layer, every operand and direction, the four
measurements), sampled at every step, every 10 steps, and never (its steps only counted), and
at every step with clip-rate alone (no rounding: the cheapest measurement),
side by side in one process (issue 44's targets: every step at most 2x the plain step, every
10 steps at most 1.1x over the run, unsampled steps at most 1.01x).

Each configuration trains the same seeded model for ``--steps`` steps, after an untimed
warm-up run of each (numba's kernels loaded, torch's allocator warm); rounds are interleaved
and the best round of each is kept (the least disturbed by a shared machine's other jobs).
Prints milliseconds per step and the ratio to the plain step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import driftcli as drift

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import machine

CASTS = ("mxfp8_e4m3", "nvfp4", "fp8_e4m3")


class Block(nn.Module):
    """A pre-norm transformer block: causal attention with explicit matmuls, then an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for y in self.qkv(self.norm1(x)).split(d, dim=-1))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(args: argparse.Namespace, every: int | None, start: int = 0,
          measurements: tuple[str, ...] = ("clip-rate", "underflow-rate", "error-bias",
                                           "stats")) -> float:
    """Seconds for ``args.steps`` training steps, under a monitor sampling every ``every``
    steps from ``start`` (None: no monitor) with ``measurements``."""
    torch.manual_seed(0)
    model = Model(args.vocab, args.d, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.seq + 1))
    mon: Any = None
    if every is not None:
        mon = drift.monitor(model, list(CASTS), every=every, start=start,
                            measurements=measurements).start()
    began = time.perf_counter()
    for s in range(args.steps):
        logits = model(data[s, :, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), data[s, :, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.step()
    took = time.perf_counter() - began
    if mon is not None:
        mon.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--runs", default="plain,every step,every 10 steps,clip-rate every,"
                        "never sampled", help="which runs, comma-separated ('plain,never "
                        "sampled': the unsampled cost alone, undisturbed by the heavy runs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (one: a shared machine's other jobs disturb less)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = {"plain": lambda: train(args, None),
            "every step": lambda: train(args, 1),
            "every 10 steps": lambda: train(args, 10),
            "clip-rate every": lambda: train(args, 1, measurements=("clip-rate",)),
            "never sampled": lambda: train(args, 1, start=10**9)}
    chosen = [n.strip() for n in args.runs.split(",")]
    unknown = [n for n in chosen if n not in runs]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {', '.join(runs)}")
    runs = {n: runs[n] for n in chosen}
    for fn in runs.values():
        fn()
    best = dict.fromkeys(runs, math.inf)
    for _ in range(args.rounds):
        for name, fn in runs.items():
            best[name] = min(best[name], fn())
    print(json.dumps(machine()))
    print(f"model: d={args.d}, {args.layers} layers, {args.heads} heads, batch {args.batch} x "
          f"{args.seq} tokens; {args.steps} steps; casts {', '.join(CASTS)}")
    plain = best["plain"]
    print(f"{'run':<18} {'ms/step':>9} {'x plain':>8}")
    for name, seconds in best.items():
        print(f"{name:<18} {1e3 * seconds / args.steps:9.1f} {seconds / plain:8.2f}")


if __name__ == "__main__":
    main()
