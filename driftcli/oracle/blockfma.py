"""The exact reference of block-FMA accumulation (a tensor core's dot product), in rationals.

Read like the published models (Fasi, Higham, Mikaitis and Pranesh, PeerJ CS 2021; Khattak and
Mikaitis, IEEE HPEC 2025): for each group of ``size`` consecutive products and the running sum
``c``,

1. every term's exponent is floor(log2 |x|) of each operand, at least the operand format's
   smallest normal exponent, added (a product's exponent); ``c``'s is its own floor(log2 |c|),
   at least -126; zero terms have none;
2. E is the largest of them, at least ``min_exp``;
3. every term (``c`` included) is cut toward zero to a multiple of ``2**(E - kept_bits)``;
4. the cut terms are added exactly, and the sum rounded once onto the accumulator format (an
   exact zero is +0); that is the next group's ``c``.

An interleaved unit sums its two halves as two such groups (the first from 0, the second onto
the first) and adds ``c`` last, rounded to nearest. With promotion every ``promote`` products,
the chain's value (times the scale block's two scales, when given) is added into a float32
master sum rounded to nearest, and the chain restarts from +0. NaN and infinite operands give
the IEEE sum of the exact products. It imports neither torch nor the fast path it judges.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from driftcli.oracle.matmul import ZERO, accumulate_step, exact_sum, products
from driftcli.oracle.rounding import binade, product, round_exact
from driftcli.records.formats import Exact, Format, Kind, pow2
from driftcli.records.modes import Overflow, Rounding

C_EMIN = -126
TOP_FLOOR = -400


@dataclass(frozen=True)
class Unit:
    """The unit's parameters, as plain integers (``driftcli.arith.blockfma.FMAUnit``'s)."""

    size: int
    kept_bits: int
    min_exp: int
    interleave: int


def _exponent(x: Exact, emin: int) -> int | None:
    return None if not x.mag else max(binade(x.mag), emin)


def _cut(x: Fraction, quantum: Fraction) -> Fraction:
    """``x`` cut toward zero to a multiple of ``quantum``."""
    steps = abs(x) // quantum
    return steps * quantum if x >= 0 else -steps * quantum


def group(terms: list[tuple[Exact, int | None]], c: Exact, unit: Unit, acc: Format,
          rounding: Rounding) -> Exact:
    """One group: ``terms`` (exact products with their exponents) and ``c``, steps 1-4."""
    if c.kind is not Kind.FINITE:
        # an overflowed chain stays infinite, or NaN (an accumulator with no infinity
        # overflows to NaN): the terms are finite
        return c
    exps = [e for t, e in terms if t.mag and e is not None]
    if c.mag:
        exps.append(max(binade(c.mag), C_EMIN))
    top = max([*exps, unit.min_exp, TOP_FLOOR])
    quantum = pow2(top - unit.kept_bits)
    total = _cut(c.value, quantum) + sum((_cut(t.value, quantum) for t, _ in terms), Fraction(0))
    if not total:
        return ZERO
    return round_exact(acc, Exact.of(total), rounding, Overflow.IEEE)


def fma_dot(a: list[Exact], b: list[Exact], unit: Unit, acc: Format, rounding: Rounding,
            emin: tuple[int, int], master: Format, promote: int = 0, c: Exact = ZERO,
            scales: list[tuple[Fraction, Fraction]] | None = None) -> Exact:
    """One dot product ``sum_k a[k] * b[k] + c`` through the unit (see the module docs);
    ``scales[j]`` are promotion interval ``j``'s two block scales."""
    prods = products(a, b)
    if any(x.kind is not Kind.FINITE for x in (*a, *b, c)):
        return exact_sum([*prods, c])
    terms = [(p, None if ea is None or eb is None else ea + eb)
             for p, ea, eb in zip(prods, (_exponent(x, emin[0]) for x in a),
                                  (_exponent(y, emin[1]) for y in b), strict=True)]
    groups = max(1, -(-len(terms) // unit.size))
    per = promote // unit.size
    chain, total = c, ZERO
    for g in range(groups):
        block = terms[g * unit.size:(g + 1) * unit.size]
        if unit.interleave:
            halves = ([t for i, t in enumerate(block) if (i // unit.interleave) % 2 == h]
                      for h in (0, 1))
            part = group(next(halves), ZERO, unit, acc, rounding)
            part = group(next(halves), part, unit, acc, rounding)
            chain = accumulate_step(part, chain, acc, Rounding.RNE)
        else:
            chain = group(block, chain, unit, acc, rounding)
        if per and ((g + 1) % per == 0 or g == groups - 1):
            if scales is not None:
                sa, sb = scales[g // per]
                chain = product(product(chain, Exact.of(sa)), Exact.of(sb))
            total = accumulate_step(total, chain, master, Rounding.RNE)
            chain = ZERO
    return total if per else chain
