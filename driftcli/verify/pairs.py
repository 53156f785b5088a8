"""The ``pairs`` suite: products and sums of pairs of codes, rounded back to the format."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from fractions import Fraction
from functools import partial

import torch

from driftcli import oracle
from driftcli.casts import codec, rounding
from driftcli.oracle.rounding import RoundingCell
from driftcli.records.formats import Exact, Format, pow2
from driftcli.records.modes import DEFAULT_SR_BITS, Overflow, Rounding
from driftcli.verify.compare import (
    MAIN_CELL,
    Cell,
    Outcome,
    Plan,
    dedup,
    hex_code,
    judge,
    round_table,
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
    drawn_bits = rounding.draw_random_bits(xa.shape, plan.seed)  # sr's one 16-bit draw a pair
    drawn: list[int] = drawn_bits.tolist()
    for op in ("product", "sum"):
        fast_op = rounding.multiply if op == "product" else rounding.add
        # the exact operands of each cell's rounding: the sum's only dependence on the mode is
        # the sign of an exact zero
        groups: dict[bool, list[Cell]] = {}
        for mode, policy in cells:
            down = op == "sum" and mode is Rounding.RDOWN
            if down not in sums and op == "sum":
                sums[down] = dedup([oracle.rounding.total(ref[i], ref[j], mode)
                                     for i, j in zip(la, lb, strict=True)])
            groups.setdefault(down, []).append((mode, policy))
        expected: dict[Cell, list[Tensor]] = {}
        for down, group in groups.items():
            uniq, index = products if op == "product" else sums[down]
            expected.update(_expected_by_cell(fmt, uniq, index, group, all_draws, drawn))
        for mode, policy in cells:
            out = Outcome(fmt.name, f"pairs ({label})", op, mode.value, policy.value)
            want = expected[(mode, policy)]
            if mode is not Rounding.SR:
                got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy)
                judge(out, want[0], got, describe)
            elif all_draws:
                for r in range(1 << PAIR_SR_BITS):
                    bits = torch.full(xa.shape, r, dtype=torch.int32)
                    got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy,
                                  random_bits=bits, sr_bits=PAIR_SR_BITS)
                    judge(out, want[r], got, partial(_with_draw, describe, r))
            else:
                got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy,
                              random_bits=drawn_bits)
                judge(out, want[0], got, partial(_with_drawn, describe, drawn))
            yield out


def _expected_by_cell(fmt: Format, uniq: list[Exact], index: Tensor, cells: list[Cell],
                      all_draws: bool, drawn: list[int]) -> dict[Cell, list[Tensor]]:
    """The oracle's results of every pair under each cell, one tensor per draw judged (sr:
    every draw of :data:`PAIR_SR_BITS` bits, or the pairs' own 16-bit ``drawn``), each
    distinct exact value rounded under all cells at once."""
    shared: list[RoundingCell] = []  # cells whose draw is the same for every value
    columns: dict[Cell, list[int]] = {}
    own_draw: list[Overflow] = []  # sr cells drawing per pair
    for mode, policy in cells:
        if mode is not Rounding.SR:
            columns[(mode, policy)] = [len(shared)]
            shared.append((mode, policy, 0, DEFAULT_SR_BITS))
        elif all_draws:
            columns[(mode, policy)] = list(range(len(shared), len(shared) + (1 << PAIR_SR_BITS)))
            shared += [(mode, policy, r, PAIR_SR_BITS) for r in range(1 << PAIR_SR_BITS)]
        else:
            own_draw.append(policy)
    out: dict[Cell, list[Tensor]] = {}
    if shared:
        table = round_table(fmt, [(v, shared) for v in uniq])
        out = {cell: [table[:, c][index] for c in cols] for cell, cols in columns.items()}
    if own_draw:
        per_pair = round_table(fmt, [
            (uniq[k], [(Rounding.SR, policy, r, DEFAULT_SR_BITS) for policy in own_draw])
            for k, r in zip(index.tolist(), drawn, strict=True)])
        out.update({(Rounding.SR, policy): [per_pair[:, j].contiguous()]
                    for j, policy in enumerate(own_draw)})
    return out
