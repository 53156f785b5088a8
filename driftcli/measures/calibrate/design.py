"""The probe design: rows and columns built from powers of two, each exposing one feature of
the family's parameters (see :mod:`driftcli.measures.calibrate`), the long rows that decide
the promotion interval and the tiny rows that decide an exponent floor."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from driftcli.casts.rounding import round_to_format
from driftcli.measures.calibrate.backends import FLOAT32
from driftcli.measures.calibrate.family import SIZES
from driftcli.records.formats import Format
from driftcli.records.modes import Rounding

PROBE_K = 128
"""K of the structure probes (two groups of the largest size)."""


LONG_K = (1024, 8192)
"""K of the promotion probes."""


COLUMNS = 16


RANDOM_ROWS = 64
"""Seeded random rows among the structure probes (the last rows)."""


def _exponent_range(fmt: Format) -> tuple[int, int]:
    """The exponents of powers of two exact in ``fmt`` that leave headroom: from the smallest
    normal to a quarter of the largest finite (two of them, and a sum of 32, stay finite)."""
    top = math.floor(math.log2(float(fmt.max))) - 2 if fmt != FLOAT32 else 60
    return max(fmt.emin, -60), max(min(top, 60), fmt.emin)


def exact_in(fmt: Format, x: Tensor) -> Tensor:
    """``x`` rounded to ``fmt`` (saturating), float32."""
    return round_to_format(x, fmt, rounding=Rounding.RNE).float()


def probe_columns(fmt: Format, k: int, gen: torch.Generator) -> Tensor:
    """B (K x 16): ones; the top and bottom powers of two; a large first entry over ones and
    over tiny ones; alternating signs; a ramp; a large first entry, six ones, tiny ones; eight
    seeded random columns."""
    lo, hi = _exponent_range(fmt)
    one, big, small = 1.0, 2.0**hi, 2.0**lo
    cols = torch.ones(k, COLUMNS)
    cols[:, 1] = big
    cols[:, 2] = small
    cols[:, 3], cols[0, 3] = one, big
    cols[:, 4], cols[0, 4] = small, big
    cols[:, 5] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    cols[:, 6] = 1 + torch.arange(k) % 4 * 0.25
    # three tiers: a row's first entry scaled up, its next six kept, the rest scaled down
    cols[:, 7] = torch.where(torch.arange(k) < 7, one, small)
    cols[0, 7] = big
    scale = torch.exp2(torch.randint(-3, 4, (k, 8), generator=gen).float())
    cols[:, 8:] = torch.randn(k, 8, generator=gen) * scale
    return exact_in(fmt, cols)


def probe_rows(fmt: Format, k: int, gen: torch.Generator) -> Tensor:
    """A (rows x K) of the structure probes (see :mod:`driftcli.measures.calibrate`), exact in
    ``fmt``; each family at two anchors, 1 and the top power of two, so that the columns'
    large and tiny entries stretch the gaps a row can hold."""
    lo, hi = _exponent_range(fmt)
    tiny = fmt.smallest_positive
    bottom = max(tiny.numerator.bit_length() - tiny.denominator.bit_length(), -80)
    rows: list[Tensor] = []

    def row(**at: float) -> None:
        r = torch.zeros(k)
        for pos, v in at.items():
            r[int(pos[1:])] = v
        rows.append(r)

    big = 2.0**hi
    for q in (1, 2, 4, 8):  # where groups and halves end
        for p in range(1, min(k, 2 * max(SIZES) + 2)):
            if p != q:
                row(**{"p0": big, f"p{q}": -big, f"p{p}": 2.0**lo})
    for x in (0, hi):
        gap = min(x - bottom, 50)
        for q, p in ((1, 2), (2, 3), (4, 5), (1, 9), (3, 33)):  # kept bits
            for j in range(1, gap + 1):
                row(**{"p0": 2.0**x, f"p{q}": -(2.0**x), f"p{p}": 2.0**(x - j)})
        for p in (1, 5):  # precision and rounding
            for j in range(1, min(gap, 30) + 1):
                for m in (1.0, 1.5):
                    for sign in (1.0, -1.0):
                        row(**{"p0": sign * 2.0**x, f"p{p}": sign * m * 2.0**(x - j)})
                    row(**{"p0": 2.0**x, f"p{p}": -m * 2.0**(x - j)})
        for p, q in ((1, 2), (3, 7)):  # a tie, and a tail past the kept bits that breaks it
            for j in range(1, min(gap, 24) + 1):
                for d in (1, 3, 8, 14, 20, 26, 32):
                    if j + d <= gap:
                        for sign in (1.0, -1.0):
                            row(**{"p0": 2.0**x, f"p{p}": 2.0**(x - j),
                                   f"p{q}": sign * 2.0**(x - j - d)})
    for n in (2, 3, 4, 7, 8, 15, 16, 31, 32, 63):  # carries
        for j in (1, 3, 8, 12, 20):
            r = torch.zeros(k)
            r[:n] = 1.0
            r[n] = 2.0**-j
            rows.append(r)
    scale = torch.exp2(torch.randint(-6, 7, (RANDOM_ROWS, k), generator=gen).float())
    rows.extend(torch.randn(RANDOM_ROWS, k, generator=gen) * scale)  # seeded random rows
    return exact_in(fmt, torch.stack(rows))


def long_rows(fmt: Format, k: int, gen: torch.Generator) -> Tensor:
    """A (rows x K) of the promotion probes: a large first term then small ones (kept only
    where the chain restarts from zero), and seeded random rows."""
    lo, hi = _exponent_range(fmt)
    rows = []
    for j in (4, 8, 12, 16, 24):
        r = torch.full((k,), 2.0**max(hi - j, lo))
        r[0] = 2.0**hi
        rows.append(r)
    rows.extend(torch.randn(8, k, generator=gen))
    return exact_in(fmt, torch.stack(rows))


def tiny_rows(fmt: Format, k: int) -> Tensor:
    """Rows of a term, one 9 binades below it and a negative one 12 to 30 below, at every
    exponent of ``fmt``'s range (the columns scale them into float32's subnormals): a floor
    under a group's exponent cuts the negative tail where it lies below the floor's kept
    bits, and the result, rounded toward zero or to nearest, shows it."""
    tiny = fmt.smallest_positive
    bottom = tiny.numerator.bit_length() - tiny.denominator.bit_length()
    top = _exponent_range(fmt)[1]
    rows = []
    for d in (12, 18, 24, 30):
        for x in range(bottom + d, top + 1):
            r = torch.zeros(k)
            r[0], r[1], r[2] = 2.0**x, 2.0**(x - 9), -(2.0**(x - d))
            rows.append(r)
    return exact_in(fmt, torch.stack(rows))
