"""The exact twin of :mod:`driftcli.casts.fouroversix`: four over six's choice between
two NVFP4 block scales, every float operation of the implementation rounded exactly
(:mod:`driftcli.oracle.scalearith`). It imports neither torch nor the fast path.
"""

from __future__ import annotations

from fractions import Fraction

from driftcli.oracle.rounding import product, round_exact
from driftcli.oracle.scalearith import E4M3, F32, ONE, ZERO, at_most, div, fl, less, mul, nan
from driftcli.records.cast import Scaling
from driftcli.records.formats import NAN, Exact, Format, Kind
from driftcli.records.modes import (
    ElementOp,
    Granularity,
    Overflow,
    Rounding,
)


def _plus(a: Exact, b: Exact) -> Exact:
    """``fl(a + b)`` (IEEE specials; the sign of a zero sum is not kept: 4/6 takes the
    magnitude or the square of what it adds)."""
    if nan(a) or nan(b) or (a.kind is b.kind is Kind.INF and a.negative != b.negative):
        return NAN
    if Kind.INF in (a.kind, b.kind):
        return a if a.kind is Kind.INF else b
    return fl(Exact.of(a.value + b.value))


def _minus(a: Exact, b: Exact) -> Exact:
    """``fl(a - b)``."""
    return _plus(a, Exact(b.kind, not b.negative, b.mag))


_FOUR_OVER_SIX_MAX = Exact.of(1536)  # 6 · nvfp4_e4m3_max (256)


def four_over_six(values: list[Exact], amax: Exact, tensor_amax: Exact, elem: Format,
                  scaling: Scaling) -> tuple[Exact, ElementOp, Exact]:
    """Four over six exactly (``driftcli.casts.fouroversix``, its sources there): both candidates of
    a 1 x 16 block (zero padded: a zero adds a zero error), their errors summed from 0 in
    element order, map-to-4 kept only where its error is smaller (a NaN error never is). A
    16 x 16 tile (``values`` its 256 elements row by row, zero padded where the tensor ends)
    sums each row's error so, then the 16 row errors pairwise by halves (``tile_sum``)."""
    order = scaling.arithmetic.two
    t = tensor_amax
    enc = at_most(div(_FOUR_OVER_SIX_MAX, t), Exact.of(F32.max))
    if (t.kind is Kind.FINITE and t.mag == 0) or (enc.kind is Kind.FINITE and enc.mag == 0):
        enc = ONE
    dec = div(ONE, enc)
    base = mul(div(amax, Exact.of(6)), enc)
    size = scaling.block * (scaling.block if scaling.granularity is Granularity.TILE else 1)
    xs = values + [ZERO] * (size - len(values))

    def candidate(raw: Exact) -> tuple[Exact, Exact, Exact]:
        sb = round_exact(E4M3, raw, Rounding.RNE, Overflow.SATURATE)
        inv = at_most(div(ONE, mul(sb, dec)), Exact.of(F32.max))
        rows = [run_error(xs[i:i + scaling.block], sb, inv)
                for i in range(0, size, scaling.block)]
        while len(rows) > 1:  # a tile's rows by halves, as the warp reduction
            half = len(rows) // 2
            rows = [_plus(a, b) for a, b in zip(rows[:half], rows[half:], strict=True)]
        return sb, inv, rows[0]

    def run_error(run: list[Exact], sb: Exact, inv: Exact) -> Exact:
        err = ZERO
        for v in run:
            q = round_exact(elem, mul(v, inv), Rounding.RNE, Overflow.SATURATE)
            if order.fp16_error:  # the FP16 product q·sb is exact
                diff = _minus(product(q, sb), mul(v, enc))
            else:
                diff = _minus(div(mul(mul(q, sb), t), _FOUR_OVER_SIX_MAX), v)
            term = mul(diff, diff) if order.squared else (
                diff if nan(diff) else Exact(diff.kind, False, diff.mag))
            err = _plus(err, term)
        return err

    sb4, inv4, err4 = candidate(mul(base, Exact.of(Fraction(3, 2))))
    sb6, inv6, err6 = candidate(base)
    four = not nan(err4) and not nan(err6) and less(err4, err6)
    sb, inv = (sb4, inv4) if four else (sb6, inv6)
    return inv, ElementOp.MUL, mul(mul(sb, t), div(ONE, _FOUR_OVER_SIX_MAX))
