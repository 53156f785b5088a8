"""The ``pairs`` suite: products and sums of pairs of codes, rounded back to the format."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from fractions import Fraction
from functools import partial

import torch

from driftcli import oracle
from driftcli.casts import codec, rounding
from driftcli.records.formats import Exact, Format, pow2
from driftcli.records.modes import Overflow, Rounding
from driftcli.verify.compare import (
    MAIN_CELL,
    Cell,
    Outcome,
    Plan,
    dedup,
    hex_code,
    judge,
    round_all,
    to_float,
)

Tensor = torch.Tensor

PAIR_SR_BITS = 4
"""Random-bit width at which ``sr`` products and sums are checked for every draw."""
PAIR_SAMPLE_16 = 1 << 18
"""Seeded pairs per 16-bit format under (rne, saturate), products and sums, in the full run
(2**20 until the full plan, which CI runs, passed 20 minutes; each pair costs the oracle about
40 microseconds, and the boundary pairs, where a fault shows first, are checked besides)."""
QUICK_PAIRS = 1024
QUICK_PAIRS_16 = 4096
WIDE_PAIRS = 1 << 14
"""Seeded pairs per cell for formats wider than 16 bits (float32, e8m13, …)."""
OTHER_SAMPLE_16 = 1 << 16
"""Seeded pairs per 16-bit format for every cell but (rne, saturate), in the full run."""


def _with_draw(describe: Callable[[int], str], r: int, i: int) -> str:
    return f"{describe(i)} r={r}"


def _with_drawn(describe: Callable[[int], str], drawn: list[int], i: int) -> str:
    return f"{describe(i)} r={drawn[i]}"


def _boundary_codes(fmt: Format) -> list[int]:
    """Codes where rounding goes wrong first: zeros, subnormal edges, 1, max, specials."""
    tiny, normal, one = fmt.smallest_positive, fmt.smallest_normal, Fraction(1)
    ulp_top = pow2(fmt.qmax)
    picks = [tiny, 2 * tiny, normal - tiny, normal, normal + tiny, one - fmt.eps / 2, one,
             one + fmt.eps, fmt.max - ulp_top, fmt.max]
    mags = torch.tensor([float(v) for v in picks if fmt.min <= -v or v <= fmt.max])
    on_grid = rounding.round_to_format(mags.double(), fmt, rounding=Rounding.RTZ)
    values = torch.cat([on_grid, -on_grid, torch.tensor([0.0, -0.0, float("inf"), float("-inf"),
                                                          float("nan")], dtype=torch.float64)])
    # onto the grid, keeping ±inf where the format has it; NaN only where it has a code
    values = rounding.round_to_format(values, fmt, overflow=Overflow.IEEE)
    if not fmt.has_nan:
        values = values[~torch.isnan(values)]
    return sorted(set(codec.encode(values, fmt).tolist()))


def _seeded_pairs(fmt: Format, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """``count`` seeded random code pairs plus every pair of the boundary codes."""
    n = 1 << fmt.bits
    gen = torch.Generator().manual_seed(seed)
    # codes of 32-bit formats do not fit int32 arithmetic later on; int64 draws hold them
    a = torch.randint(0, n, (count,), generator=gen)
    b = torch.randint(0, n, (count,), generator=gen)
    edge = torch.tensor(_boundary_codes(fmt))
    return (torch.cat([a, edge.repeat_interleave(len(edge))]),
            torch.cat([b, edge.repeat(len(edge))]))



def _pair_sets(fmt: Format, plan: Plan) -> list[tuple[str, Tensor, Tensor, list[Cell]]]:
    """Which operand pairs each (rounding, overflow) cell sees: ``(label, a, b, cells)``."""
    cells = [(m, p) for m in Rounding for p in Overflow]
    n = 1 << fmt.bits
    if fmt.bits <= 6 or (fmt.bits <= 8 and not plan.quick):
        return [("all pairs", torch.arange(n).repeat_interleave(n), torch.arange(n).repeat(n),
                 cells)]
    if fmt.bits <= 8 or fmt.bits > 16:
        count = QUICK_PAIRS if plan.quick or fmt.bits <= 8 else WIDE_PAIRS
        return [("sampled pairs", *_seeded_pairs(fmt, count, plan.seed), cells)]
    if plan.quick:
        return [("sampled pairs", *_seeded_pairs(fmt, QUICK_PAIRS_16, plan.seed), [MAIN_CELL])]
    return [("sampled pairs", *_seeded_pairs(fmt, PAIR_SAMPLE_16, plan.seed), [MAIN_CELL]),
            ("sampled pairs", *_seeded_pairs(fmt, OTHER_SAMPLE_16, plan.seed + 1),
             [c for c in cells if c != MAIN_CELL])]


def check_pairs(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Products and sums of pairs of codes, rounded back to the format, against the oracle."""
    for label, ca, cb, cells in _pair_sets(fmt, plan):
        ref = {c: fmt.decode(c) for c in set(ca.tolist()) | set(cb.tolist())}
        yield from _check_pair_set(fmt, plan, ref, label, ca, cb, cells)


def _check_pair_set(fmt: Format, plan: Plan, ref: dict[int, Exact], label: str, ca: Tensor,
                    cb: Tensor, cells: list[Cell]) -> Iterator[Outcome]:
    xa, xb = codec.decode(ca, fmt), codec.decode(cb, fmt)
    la, lb = ca.tolist(), cb.tolist()
    all_draws = fmt.bits <= 8  # sr: every value of PAIR_SR_BITS bits; else one 16-bit draw

    def describe(i: int) -> str:
        j = i % len(la)
        return f"{hex_code(fmt, la[j])} {hex_code(fmt, lb[j])}"

    products = dedup([oracle.rounding.product(ref[i], ref[j]) for i, j in zip(la, lb, strict=True)])
    sums: dict[bool, tuple[list[Exact], Tensor]] = {}
    for op in ("product", "sum"):
        fast_op = rounding.multiply if op == "product" else rounding.add
        for mode, policy in cells:
            if op == "product":
                uniq, index = products
            else:  # the sum's only dependence on the mode: the sign of an exact zero
                down = mode is Rounding.RDOWN
                if down not in sums:
                    sums[down] = dedup([oracle.rounding.total(ref[i], ref[j], mode)
                                         for i, j in zip(la, lb, strict=True)])
                uniq, index = sums[down]
            out = Outcome(fmt.name, f"pairs ({label})", op, mode.value, policy.value)
            if mode is not Rounding.SR:
                expected = round_all(fmt, uniq, mode, policy)[index]
                got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy)
                judge(out, expected, got, describe)
            elif all_draws:
                for r in range(1 << PAIR_SR_BITS):
                    expected = round_all(fmt, uniq, mode, policy, r, PAIR_SR_BITS)[index]
                    bits = torch.full(xa.shape, r, dtype=torch.int32)
                    got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy,
                                  random_bits=bits, sr_bits=PAIR_SR_BITS)
                    judge(out, expected, got, partial(_with_draw, describe, r))
            else:
                bits = rounding.draw_random_bits(xa.shape, plan.seed)
                drawn = bits.tolist()
                expected = torch.tensor(
                    [to_float(oracle.rounding.round_exact(fmt, uniq[k], mode, policy, r))
                     for k, r in zip(index.tolist(), drawn, strict=True)],
                    dtype=torch.float64)
                got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy, random_bits=bits)
                judge(out, expected, got, partial(_with_drawn, describe, drawn))
            yield out

