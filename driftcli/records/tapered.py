"""Tapered float formats: the exponent's width set by a prefix-coded "dot" field (HiFloat8).

A tapered format spends its bits where the values are: near 1 a short exponent and a long
mantissa, far from 1 the other way round. Its magnitude code (the bits after the sign) starts
with a prefix from a table; the prefix's row says how wide the exponent field after it is and
how many mantissa bits follow. :class:`Taper` holds that table, and reads every magnitude code
into an exponent, a mantissa field and a mantissa width; :class:`driftcli.records.formats.Format`
(``kind = tapered``) does the rest, as it does for the fixed-width kinds.

The exponent field of ``d`` bits is sign and magnitude with the magnitude's leading one
implicit (HiFloat8, arXiv 2409.16626 §2): its first bit is the exponent's sign (1: negative),
the other ``d - 1`` bits follow an implicit 1, so the field spans ``|E|`` from ``2**(d-1)``
to ``2**d - 1``; a width of 0 is ``E = 0``. The denormal row's mantissa ``m`` (``m > 0``)
means ``2**(m + denormal_exp)``; ``m = 0`` is zero.

Torch-free and drift-free: the format record in :mod:`driftcli.records.formats` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Dot:
    """One row of a tapered format's dot-field table."""

    prefix: int
    """The prefix's bits, read as an integer (``0b11``)."""
    width: int
    """How many bits the prefix takes."""
    ebits: int
    """Width of the exponent field after it (0: the exponent is 0)."""
    mbits: int
    """Mantissa bits after the exponent field."""


@dataclass(frozen=True)
class Taper:
    """A tapered format's magnitude codes: the dot rows and the denormal row."""

    bits: int
    """Bits of a magnitude code (the code without its sign bit)."""
    dots: tuple[Dot, ...]
    denormal: Dot
    """The row whose mantissa ``m`` is the value ``2**(m + denormal_exp)`` (0: zero)."""
    denormal_exp: int

    def split(self, magnitude_code: int) -> tuple[int, int, int] | None:
        """``(exponent, mantissa field, mantissa bits)`` of a magnitude code, whose value is
        ``(1 + field / 2**mbits) * 2**exponent``; None for zero."""
        for dot in (*self.dots, self.denormal):
            rest = self.bits - dot.width
            if magnitude_code >> rest != dot.prefix:
                continue
            field = magnitude_code & ((1 << dot.mbits) - 1)
            if dot is self.denormal:
                return None if field == 0 else (field + self.denormal_exp, 0, 0)
            exp_field = (magnitude_code >> dot.mbits) & ((1 << dot.ebits) - 1)
            return _exponent(exp_field, dot.ebits), field, dot.mbits
        raise ValueError(f"magnitude code {magnitude_code:#x} matches no row of the dot table")

    @cached_property
    def emin(self) -> int:
        """The lowest binade that holds a value (the smallest denormal's)."""
        return 1 + self.denormal_exp

    @cached_property
    def emax(self) -> int:
        """The highest binade a code reaches (before any of its codes is taken for inf)."""
        return max((1 << d.ebits) - 1 for d in self.dots)

    @cached_property
    def widths(self) -> tuple[int, ...]:
        """The mantissa width of each binade from :attr:`emin` to :attr:`emax`."""
        width = {e: 0 for e in range(self.emin, self.denormal_exp + (1 << self.denormal.mbits))}
        for dot in self.dots:
            low = 0 if dot.ebits == 0 else 1 << (dot.ebits - 1)
            high = 0 if dot.ebits == 0 else (1 << dot.ebits) - 1
            for magnitude in range(low, high + 1):
                width[magnitude] = width[-magnitude] = dot.mbits
        missing = [e for e in range(self.emin, self.emax + 1) if e not in width]
        if missing:
            raise ValueError(f"the dot table leaves binades {missing} without a width")
        return tuple(width[e] for e in range(self.emin, self.emax + 1))

    def mbits_at(self, binade: int) -> int:
        """The mantissa width of a binade; below :attr:`emin` the lowest's, above :attr:`emax`
        the highest's (the grid extended without bound, as rounding reads it)."""
        index = min(max(binade - self.emin, 0), len(self.widths) - 1)
        return self.widths[index]


def _exponent(exp_field: int, ebits: int) -> int:
    """The exponent of a sign-magnitude field of ``ebits`` bits with an implicit leading one."""
    if ebits == 0:
        return 0
    magnitude = (1 << (ebits - 1)) | (exp_field & ((1 << (ebits - 1)) - 1))
    return -magnitude if exp_field >> (ebits - 1) else magnitude


HIFLOAT8 = Taper(
    bits=7,
    # Huawei's table (hicann/amct amct_pytorch/experimental/hifloat8/hifloat8_cast.cpp, lines
    # 43-75, HIF8_DOT_MAP, commit 30e0b5c): prefix 11 -> 4 exponent bits and 1 mantissa bit,
    # 10 -> 3 and 2, 01 -> 2 and 3, 001 -> 1 and 3, 0001 -> 0 and 3, 0000 the denormals
    dots=(Dot(0b11, 2, 4, 1), Dot(0b10, 2, 3, 2), Dot(0b01, 2, 2, 3), Dot(0b001, 3, 1, 3),
          Dot(0b0001, 4, 0, 3)),
    denormal=Dot(0b0000, 4, 0, 3),
    denormal_exp=-23,  # HIF8_DENORMAL_EXP_BIAS: m = 1..7 is 2**-22..2**-16
)
"""HiFloat8's magnitude codes (arXiv 2409.16626; docs/formats.md#hifloat8)."""
