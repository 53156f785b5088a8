"""The exact twin of :mod:`driftcli.arith.matmul`: a simulated matmul's sums.

Exact operand values (the casts already applied), the exact products, and an
accumulator that rounds after every addition in a stated order. Every step is
:func:`driftcli.oracle.rounding.total` followed by ``round_exact`` onto the
accumulator; nothing else is ever rounded. It imports neither torch nor the fast path.
"""

from __future__ import annotations

from fractions import Fraction

from driftcli.oracle.rounding import product, round_exact, total
from driftcli.records.formats import NAN, Exact, Format, Kind
from driftcli.records.modes import Overflow, Rounding

# --- dot products ---------------------------------------------------------------------------
#
# The reference for driftcli.arith.matmul: one output element of a simulated matmul, from the
# exact operand values (the casts already applied), the exact products, and an accumulator that
# rounds after every addition in a stated order. Every step is oracle.total followed by
# round_exact onto the accumulator; nothing else is ever rounded.

ZERO = Exact(Kind.FINITE, False, Fraction(0))
"""+0: the value of a cleared accumulator."""


def products(a: list[Exact], b: list[Exact]) -> list[Exact]:
    """The exact products ``a[k] * b[k]``, k = 0..K-1 (sign of zero and specials as IEEE)."""
    return [product(x, y) for x, y in zip(a, b, strict=True)]


def exact_sum(terms: list[Exact]) -> Exact:
    """The exact sum of ``terms``, with +0 for a zero sum (a cleared register plus the terms);
    ±inf and NaN as IEEE (inf + -inf is NaN), whatever the order."""
    s = ZERO
    for t in terms:
        s = total(s, t, Rounding.RNE)
    return s


def block_terms(a_elements: list[Exact], b_elements: list[Exact], a_scales: list[Exact],
                b_scales: list[Exact], block: int) -> list[Exact]:
    """Scale application ``block``: one term per block of ``block`` consecutive k, the exact dot
    product of the blocks' elements (in element units, +0 when it is zero) times the two scales.

    The last block may be shorter. ``a_scales[j]`` and ``b_scales[j]`` are block ``j``'s scales.
    """
    terms = []
    for j, (sa, sb) in enumerate(zip(a_scales, b_scales, strict=True)):
        ks = slice(j * block, (j + 1) * block)
        dot = exact_sum(products(a_elements[ks], b_elements[ks]))
        terms.append(product(product(dot, sa), sb) if dot.kind is not Kind.FINITE or dot.mag
                     else ZERO if Kind.NAN not in (sa.kind, sb.kind) else NAN)
    return terms


def accumulate_step(acc: Exact, term: Exact, fmt: Format, rounding: Rounding) -> Exact:
    """One accumulator step: the exact ``acc + term`` rounded once onto ``fmt``.

    An accumulator overflows as IEEE 754 arithmetic does (to ±inf, to ±max under ``rtz``).
    """
    return round_exact(fmt, total(acc, term, rounding), rounding, Overflow.IEEE)


def sequential(terms: list[Exact], fmt: Format, rounding: Rounding) -> Exact:
    """``acc = +0; for k in 0..K-1: acc = round(acc + t[k])``."""
    acc = ZERO
    for t in terms:
        acc = accumulate_step(acc, t, fmt, rounding)
    return acc


def pairwise(terms: list[Exact], fmt: Format, rounding: Rounding) -> Exact:
    """The pairwise tree: level by level, adjacent pairs ``(t0 + t1), (t2 + t3), …`` are each
    rounded once; an odd last element is carried to the next level unchanged; when one value
    is left it is added to a cleared accumulator (+0) and rounded.

    K = 5: ``((t0 + t1) + (t2 + t3)) + t4``; K = 6: ``((t0 + t1) + (t2 + t3)) + (t4 + t5)``.
    """
    level = list(terms)
    while len(level) > 1:
        pairs = [accumulate_step(level[i], level[i + 1], fmt, rounding)
                 for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2:]
    return accumulate_step(ZERO, level[0], fmt, rounding) if level else ZERO


def chunked(terms: list[Exact], chunk: int, fmt: Format, rounding: Rounding,
            master: Format) -> Exact:
    """Promotion every ``chunk`` terms: each run of ``chunk`` consecutive terms is summed
    sequentially in ``fmt`` from +0; each run's result is then added, in order, into a master
    sum in ``master`` (float32) rounded to nearest even, starting from +0."""
    total_ = ZERO
    for start in range(0, len(terms), chunk):
        part = sequential(terms[start:start + chunk], fmt, rounding)
        total_ = accumulate_step(total_, part, master, Rounding.RNE)
    return total_


def dot(terms: list[Exact], order: str, fmt: Format, rounding: Rounding, chunk: int = 0,
        master: Format | None = None) -> Exact:
    """The accumulated sum of ``terms`` in ``order``: ``sequential``, ``pairwise`` or
    ``chunked`` (with ``chunk`` and the ``master`` format). ``order`` is a
    :class:`driftcli.arith.matmul.Order` value; ``native`` has no reference of its own (see
    docs/arithmetic.md) and is rejected here."""
    if order == "sequential":
        return sequential(terms, fmt, rounding)
    if order == "pairwise":
        return pairwise(terms, fmt, rounding)
    if order == "chunked" and chunk >= 1 and master is not None:
        return chunked(terms, chunk, fmt, rounding, master)
    raise ValueError(f"the oracle has no order {order!r} (chunk {chunk}, master {master})")
