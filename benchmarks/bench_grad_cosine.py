"""grad-cosine: the cost of one gradient under each policy against the exact float64 gradient.

For each model (a seeded tanh MLP built here, and stories260K from the shared data folder when
``transformers`` is installed), the model is copied to float64 once, as ``grad_cosine`` does,
then one gradient (forward, loss, backward) is timed under each policy and without any (the
exact reference), interleaved round by round after one untimed warm-up of each, and the
medians are printed with their ratio to the exact gradient. A full ``grad_cosine()`` call over
every policy is timed once at the end (it adds the deep copy, the exact gradient and the
metrics).

Run ``python benchmarks/bench_grad_cosine.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from driftcli.arith.mode import arithmetic
from driftcli.measures.grad_cosine import grad_cosine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import machine, once

POLICIES = ("float32", "fp8_e4m3", "mxfp8_e4m3", "nvfp4", "mxfp4_e2m1:sr")
STORIES = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "stories260K-hf"
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
        "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high. "
        "Lily asked her mom for help. Her mom said, \"Let's find a stick to get the ball down.\" ")

Case = tuple[str, nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor], int]
"""name, model, batch, loss_fn(model, batch), matmuls per gradient."""


def mlp_case(tokens: int) -> Case:
    """A seeded tanh MLP of four 512-wide layers on ``tokens`` rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 64))
    batch = (torch.randn(tokens, 256), torch.randint(0, 64, (tokens,)))

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    return f"tanh MLP 256-512-512-512-64, {tokens} rows", model, batch, loss, 3 * 4


def stories_case(tokens: int) -> Case | None:
    """stories260K on ``tokens`` tokens of a story (None without transformers or the data)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    if not STORIES.is_dir():
        return None
    from driftcli.models.loaders import load_causal_lm, next_token_loss, text_batch

    lm = load_causal_lm(STORIES)
    ids = text_batch(lm, TEXT * (1 + tokens // 40), tokens)
    return f"stories260K (HF Llama), {tokens} tokens", lm.model, ids, \
        next_token_loss(lm.logits), 3 * 46


def time_case(case: Case, policies: Sequence[str], repeat: int) -> list[tuple[str, float]]:
    """Median seconds of one float64 gradient, exact and under each policy, interleaved."""
    _, model, batch, loss_fn, _ = case
    ref = copy.deepcopy(model).double()
    if isinstance(batch, tuple):
        batch = tuple(t.double() if t.dtype.is_floating_point else t for t in batch)
    params = [p for p in ref.parameters() if p.requires_grad]

    def gradient(policy: str | None) -> Callable[[], object]:
        def run() -> object:
            if policy is None:
                return torch.autograd.grad(loss_fn(ref, batch), params)
            with arithmetic(policy, model=ref):
                return torch.autograd.grad(loss_fn(ref, batch), params)
        return run

    calls = {"exact (float64, no mode)": gradient(None)} | {p: gradient(p) for p in policies}
    for fn in calls.values():
        once(fn)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeat):
        for name, fn in calls.items():
            times[name].append(once(fn))
    return [(name, statistics.median(ts)) for name, ts in times.items()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="timed rounds (median reported)")
    p.add_argument("--tokens", type=int, default=128, help="rows of the MLP, tokens of the LM")
    p.add_argument("--policy", action="append", help=f"policies (default: {', '.join(POLICIES)})")
    p.add_argument("--model", choices=("mlp", "stories", "all"), default="all")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    policies = args.policy or list(POLICIES)
    info = machine()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    cases = []
    if args.model in ("mlp", "all"):
        cases.append(mlp_case(args.tokens))
    if args.model in ("stories", "all"):
        case = stories_case(args.tokens)
        if case is None:
            print("stories260K skipped: needs transformers and ../shared/data/models")
        else:
            cases.append(case)
    for case in cases:
        name, model, batch, loss_fn, n_matmuls = case
        print(f"\n{name}: {n_matmuls} matmuls per gradient, median of {args.repeat}")
        rows = time_case(case, policies, args.repeat)
        base = rows[0][1]
        print(f"| {'policy':<26} | {'s / gradient':>12} | {'x exact':>8} |")
        print(f"|{'-' * 28}|{'-' * 13}:|{'-' * 9}:|")
        for policy, seconds in rows:
            print(f"| {policy:<26} | {seconds:12.3f} | {seconds / base:8.1f} |")
        start = time.perf_counter()
        grad_cosine(model, batch, loss_fn, policies, draws=1)
        print(f"grad_cosine() over {len(policies)} policies, one call: "
              f"{time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
