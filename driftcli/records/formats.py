"""Number formats: one small record per format, everything else derived.

A :class:`Format` holds only primitive fields (exponent and mantissa widths,
bias, sign, which special values exist and how NaN is encoded, whether there
are subnormals, whether it is an integer). Every other property (``max``,
``smallest_normal``, ``eps``, …) is derived from them, with numpy ``finfo``
names, and no code anywhere branches on a format's name.

This module imports no torch: it is the specification that the exact oracle
(:mod:`driftcli.oracle`) and the table printed by ``drift formats`` read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from fractions import Fraction
from functools import cached_property

from driftcli.errors import FormatSpecError, UnknownFormatError, close_matches
from driftcli.records.tapered import HIFLOAT8, Taper


class NanEncoding(StrEnum):
    """Which codes of a format are NaN."""

    NONE = "none"
    """No NaN code at all (FP4, FP6, integers)."""
    IEEE = "ieee"
    """All-ones exponent with a nonzero mantissa (IEEE 754, E5M2)."""
    TOP = "top"
    """Only all-ones exponent *and* all-ones mantissa, either sign (E4M3FN; E8M0's 0xFF)."""
    NEG_ZERO = "neg_zero"
    """The code that would be −0, sign bit alone (the ``fnuz`` formats); there is no −0."""


class FormatKind(StrEnum):
    """Which family's rules a float format's fields follow (for listing and naming; the
    decoding reads the fields alone)."""

    IEEE_LIKE = "ieee-like"
    """IEEE 754 and OCP: a sign bit, an exponent and a mantissa, specials as ``nan`` says."""
    P3109 = "p3109"
    """IEEE P3109 ``binaryKpP``: no −0, NaN at 2**(K−1) (signed) or the top code (unsigned),
    ±inf at the top code of each sign in the extended domain (docs/formats.md#ieee-p3109)."""
    TAPERED = "tapered"
    """A prefix-coded dot field sets each binade's exponent and mantissa widths (HiFloat8):
    the record's ``taper`` decodes the magnitude codes (docs/formats.md#hifloat8)."""


class Kind(StrEnum):
    """The three kinds of value a code or an exact result can be."""

    FINITE = "finite"
    INF = "inf"
    NAN = "nan"


@dataclass(frozen=True)
class Exact:
    """An exact value with an explicit sign: a rational, ±inf or NaN.

    ``negative`` is kept for zero (−0 is not +0) and infinities; ``mag`` is the
    magnitude and is only meaningful for finite values.
    """

    kind: Kind
    negative: bool = False
    mag: Fraction = Fraction(0)

    @classmethod
    def of(cls, value: Fraction | int, negative_zero: bool = False) -> Exact:
        """The finite value ``value``; ``negative_zero`` marks −0 when ``value`` is 0."""
        v = Fraction(value)
        return cls(Kind.FINITE, v < 0 or (v == 0 and negative_zero), abs(v))

    @property
    def value(self) -> Fraction:
        """The signed rational (−0 and +0 both give 0)."""
        return -self.mag if self.negative else self.mag

    def __str__(self) -> str:
        sign = "-" if self.negative else ""
        if self.kind is Kind.NAN:
            return "nan"
        if self.kind is Kind.INF:
            return f"{sign or '+'}inf"
        return f"{sign}{self.mag}"


NAN = Exact(Kind.NAN)


def pow2(exponent: int) -> Fraction:
    """``2**exponent`` as an exact Fraction (without Fraction's slow ``__pow__``)."""
    return Fraction(1 << exponent) if exponent >= 0 else Fraction(1, 1 << -exponent)


@dataclass(frozen=True)
class Format:
    """A number format, defined by primitive fields only.

    A code is read as ``sign | exponent field | mantissa field``. For floats a
    normal code means ``(1 + m / 2**mbits) * 2**(E - bias)``; with subnormals an
    exponent field of 0 means ``(m / 2**mbits) * 2**(1 - bias)``. Without
    subnormals the exponent field 0 is an ordinary binade, so the format has no
    zero (E8M0). With IEEE NaN encoding, infinities sit in the all-ones exponent; with any
    other, ``has_inf`` puts ±inf at the largest code of each sign that is not NaN (P3109's
    extended domain: 0x7F and 0xFF of a signed 8-bit format, 0xFE of an unsigned one).
    Integer formats are two's complement with ``ebits == 0``; their values are
    ``code * 2**(1 - bias - mbits)``, so ``bias = 1 - mbits`` gives a quantum of 1 (int8:
    bias −6). A ``symmetric`` integer format saturates at ``-max``, as implementations that
    clamp MXINT8 to ±127/64 do: its cast never writes the code ``-2**(bits-1)`` (0x80 of
    int8), which still decodes to its two's-complement value
    (docs/formats.md#mxint8s-128-int8_sym-and-mxint8_sym).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    signed: bool = True
    has_inf: bool = False
    nan: NanEncoding = NanEncoding.NONE
    has_subnormals: bool = True
    integer: bool = False
    kind: FormatKind = FormatKind.IEEE_LIKE
    taper: Taper | None = None
    """The dot-field table of a tapered format (``ebits + mbits`` is then its magnitude
    code's width and ``mbits`` its widest mantissa; ``bias`` is unused)."""
    symmetric: bool = False
    """An integer format whose range is ``-max..max``: rounding and saturation stop at
    ``-max``, so the most negative code is never written (int8_sym: ±127)."""

    def __post_init__(self) -> None:
        if (self.taper is None) != (self.kind is not FormatKind.TAPERED):
            raise FormatSpecError(f"format {self.name!r}: a tapered format, and only one, has "
                                  "a dot-field table")
        if self.has_inf and self.nan is NanEncoding.NONE:
            raise FormatSpecError(f"format {self.name!r}: infinities need a NaN code")
        if self.integer and (self.ebits or not self.signed or self.nan is not NanEncoding.NONE):
            raise FormatSpecError(f"format {self.name!r}: integers are signed, ebits 0, no NaN")
        if self.symmetric and not self.integer:
            raise FormatSpecError(f"format {self.name!r}: only an integer format is symmetric "
                                  "(a signed float's range is symmetric already)")

    # --- widths and codes -------------------------------------------------------------

    @property
    def bits(self) -> int:
        """Total width of a code in bits."""
        return int(self.signed) + self.ebits + self.mbits

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))

    def __hash__(self) -> int:
        # the oracle's caches key on a Format millions of times in a verify run; the hash
        # dataclass generates walks every field on each call (an explicit one is kept)
        return self._hash

    @property
    def has_nan(self) -> bool:
        """Whether any code is NaN."""
        return self.nan is not NanEncoding.NONE

    @property
    def has_neg_zero(self) -> bool:
        """Whether −0 has a code of its own."""
        return self.signed and not self.integer and self.nan is not NanEncoding.NEG_ZERO

    @property
    def has_zero(self) -> bool:
        """Whether 0 is a value (not so for E8M0)."""
        return self.has_subnormals or self.integer

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade (for integers: of the top binade; tapered:
        of the lowest binade with a mantissa bit, above the denormals)."""
        if self.taper is not None:
            return next(self.taper.emin + i for i, w in enumerate(self.taper.widths) if w)
        return (1 if self.has_subnormals else 0) - self.bias

    @property
    def grid_emin(self) -> int:
        """The lowest binade with a quantum of its own: below it the grid's spacing is the
        finest quantum (``emin``, or a tapered format's smallest denormal's binade)."""
        return self.emin if self.taper is None else self.taper.emin

    def mbits_at(self, binade: int) -> int:
        """The mantissa width of a binade (``mbits`` but in a tapered format)."""
        return self.mbits if self.taper is None else self.taper.mbits_at(binade)

    @property
    def qmin(self) -> int:
        """Exponent of the finest quantum (the spacing of the lowest binade)."""
        return self.grid_emin - self.mbits_at(self.grid_emin)

    @property
    def ties_by_code(self) -> bool:
        """Whether ties to even go to the even *code* rather than the even significand: where
        the two differ, with no mantissa bits (every significand is 1), and the format has a
        zero. That is P3109's P = 1 (gfloat's ``round.py``); E8M0, without a zero, rounds its
        ties up, as torch's ``float8_e8m0fnu`` cast does."""
        return self.mbits == 0 and self.has_zero and not self.integer

    @property
    def inf_code(self) -> int | None:
        """The code of +inf (−inf adds the sign bit), or None without infinities."""
        if not self.has_inf:
            return None
        if self.taper is not None:
            return self._tapered_top
        top = (1 << (self.ebits + self.mbits)) - 1  # the largest magnitude code
        if self.nan is NanEncoding.IEEE:
            return top - ((1 << self.mbits) - 1)
        return top - 1 if self.nan is NanEncoding.TOP else top

    def decode(self, code: int) -> Exact:
        """The exact value of ``code`` (an unsigned integer of ``bits`` bits).

        This is the reference decoding, one code at a time; the vectorized one
        in :mod:`driftcli.casts.codec` is checked against it.
        """
        if not 0 <= code < 1 << self.bits:
            raise FormatSpecError(f"code {code} is outside {self.name}'s {self.bits} bits")
        if self.integer:
            signed = code - (1 << self.bits) if code >> (self.bits - 1) else code
            return Exact.of(Fraction(signed) * pow2(self.qmin))
        negative = self.signed and bool(code >> (self.ebits + self.mbits))
        if self.taper is not None:
            return self._tapered_decode(code, negative)
        exp_field = (code >> self.mbits) & ((1 << self.ebits) - 1)
        man_field = code & ((1 << self.mbits) - 1)
        top_exp = exp_field == (1 << self.ebits) - 1
        top_man = man_field == (1 << self.mbits) - 1
        if self.nan is NanEncoding.IEEE and top_exp:
            return Exact(Kind.INF, negative) if man_field == 0 and self.has_inf else NAN
        if self.nan is NanEncoding.TOP and top_exp and top_man:
            return NAN
        if self.has_inf and code & ((1 << (self.ebits + self.mbits)) - 1) == self.inf_code:
            return Exact(Kind.INF, negative)
        if self.nan is NanEncoding.NEG_ZERO and negative and exp_field == 0 and man_field == 0:
            return NAN
        if self.has_subnormals and exp_field == 0:
            mag = Fraction(man_field) * pow2(self.qmin)
        else:
            significand = (1 << self.mbits) + man_field
            mag = Fraction(significand) * pow2(exp_field - self.bias - self.mbits)
        return Exact(Kind.FINITE, negative, mag)

    @cached_property
    def _tapered_top(self) -> int:
        """The magnitude code of a tapered format's largest magnitude (HiFloat8's 0x6F)."""
        return max(range(1, 1 << (self.ebits + self.mbits)), key=self._tapered_magnitude)

    def _tapered_magnitude(self, magnitude_code: int) -> Fraction:
        parts = self.taper.split(magnitude_code) if self.taper is not None else None
        if parts is None:
            return Fraction(0)
        exponent, field, mbits = parts
        return Fraction((1 << mbits) + field) * pow2(exponent - mbits)

    def _tapered_decode(self, code: int, negative: bool) -> Exact:
        magnitude_code = code & ((1 << (self.ebits + self.mbits)) - 1)
        if magnitude_code == 0:
            # the sign bit on a zero magnitude is NaN (HiFloat8's 0x80), as in the fnuz formats
            return NAN if negative and self.nan is NanEncoding.NEG_ZERO else Exact.of(0)
        if magnitude_code == self.inf_code:
            return Exact(Kind.INF, negative)
        return Exact(Kind.FINITE, negative, self._tapered_magnitude(magnitude_code))

    def values(self) -> list[tuple[int, Exact]]:
        """Every code with its exact value, in code order."""
        return [(c, self.decode(c)) for c in range(1 << self.bits)]

    # --- derived range (finfo names) ----------------------------------------------------

    @cached_property
    def extremes(self) -> tuple[Fraction, Fraction]:
        """``(max, |min|)``: the largest magnitude a positive / a negative value can have."""
        if self.integer:
            top = Fraction((1 << (self.bits - 1)) - 1) * pow2(self.qmin)
            return top, top if self.symmetric else Fraction(1 << (self.bits - 1)) * pow2(self.qmin)
        if self.taper is not None:
            top = max(v.mag for _, v in self.values() if v.kind is Kind.FINITE)
            return top, (top if self.signed else Fraction(0))
        # the largest finite code is the top code, the one below it (E4M3FN's NaN sits on top),
        # two below (P3109 unsigned extended: NaN, then inf), or the top of the binade below
        # (IEEE reserves the whole top exponent)
        top_code = (1 << (self.ebits + self.mbits)) - 1
        below_top_exp = top_code - (1 << self.mbits)
        code = next(c for c in (top_code, top_code - 1, top_code - 2, below_top_exp)
                    if self.decode(c).kind is Kind.FINITE)
        top = self.decode(code).mag
        return top, (top if self.signed else Fraction(0))

    @cached_property
    def max(self) -> Fraction:
        """Largest finite value."""
        return self.extremes[0]

    @cached_property
    def min(self) -> Fraction:
        """Most negative finite value (0 for unsigned, −128 for int8, −127 for int8_sym)."""
        return -self.extremes[1]

    @cached_property
    def smallest_normal(self) -> Fraction:
        """Smallest positive normal value (for integers: the quantum)."""
        return pow2(self.qmin if self.integer else self.emin)

    @cached_property
    def smallest_subnormal(self) -> Fraction | None:
        """Smallest positive subnormal value, or None without subnormals."""
        if self.integer or not self.has_subnormals or self.mbits == 0:
            return None
        return pow2(self.qmin)

    @cached_property
    def smallest_positive(self) -> Fraction:
        """Smallest positive value, subnormal or not."""
        return self.smallest_subnormal or self.smallest_normal

    @property
    def eps(self) -> Fraction:
        """Distance from 1 to the next larger value (floats)."""
        return Fraction(1, 1 << self.mbits)

    @cached_property
    def emax(self) -> int:
        """Exponent of the largest binade that holds finite values."""
        top = self.max
        return top.numerator.bit_length() - top.denominator.bit_length()

    @cached_property
    def qmax(self) -> int:
        """Exponent of the quantum of the top binade (the spacing next to ``max``)."""
        top = max(self.emax, self.grid_emin)
        return top - self.mbits_at(top)

    @cached_property
    def max_significand(self) -> int:
        """``max`` as an integer multiple of ``2**qmax``."""
        return int(self.max / pow2(self.qmax))

    @cached_property
    def min_significand(self) -> int:
        """``|min|`` as an integer multiple of ``2**qmax`` (one more than max for integers but
        symmetric ones)."""
        return int(-self.min / pow2(self.qmax))

    def contains(self, other: Format) -> bool:
        """Whether every finite value of ``other`` is a value of this format."""
        if self.taper is not None or other.taper is not None:
            # a tapered grid is no fixed width: compare the values (formats of 8 bits or
            # below; a wider tapered format does not exist)
            if other.bits > 8 or (self.taper is not None and self.bits < other.bits):
                return False
            if self.bits > 8:
                return self._holds_all(other)
            mine = {v.value for _, v in self.values() if v.kind is Kind.FINITE}
            return all(v.value in mine for _, v in other.values() if v.kind is Kind.FINITE)
        if other.integer and not self.integer:
            # integers up to 2**(bits-1) need bits-1 significant bits, at quantum 2**qmin
            return (self.mbits + 1 >= other.bits - 1 and self.max >= -other.min
                    and self.qmin <= other.qmin)
        return (self.integer == other.integer and self.mbits >= other.mbits
                and self.max >= other.max and self.min <= other.min and self.qmin <= other.qmin
                and (self.signed or not other.signed))

    def _holds_all(self, other: Format) -> bool:
        """Whether this fixed-width float, wider than 8 bits, holds every finite value of
        ``other`` (a tapered format): each on this grid's spacing in its binade, within max."""
        for _, v in other.values():
            if v.kind is not Kind.FINITE or not v.mag:
                continue
            e = v.mag.numerator.bit_length() - v.mag.denominator.bit_length()
            e = e if pow2(e) <= v.mag else e - 1
            quantum = pow2(max(e, self.emin) - self.mbits)
            if v.mag > self.max or (v.mag / quantum).denominator != 1:
                return False
        return True


def _display(value: Fraction | None) -> str:
    """A value as people write it: ``2^-9`` for powers of two, else a short decimal."""
    if value is None:
        return "-"
    if value > 0 and value.numerator & (value.numerator - 1) == 0 \
            and value.denominator & (value.denominator - 1) == 0:
        exponent = value.numerator.bit_length() - value.denominator.bit_length()
        if not -4 <= exponent <= 10:
            return f"2^{exponent}"
    return f"{float(value):.6g}"


def describe(fmt: Format) -> dict[str, object]:
    """Primitive and derived facts of a format, JSON-ready (exact values as strings)."""
    return {
        "name": fmt.name, "bits": fmt.bits, "ebits": fmt.ebits, "mbits": fmt.mbits,
        "bias": fmt.bias, "signed": fmt.signed, "integer": fmt.integer, "kind": fmt.kind.value,
        "symmetric": fmt.symmetric,
        "has_subnormals": fmt.has_subnormals, "has_inf": fmt.has_inf, "nan": fmt.nan.value,
        "has_neg_zero": fmt.has_neg_zero, "has_zero": fmt.has_zero,
        "max": str(fmt.max), "min": str(fmt.min),
        "smallest_normal": str(fmt.smallest_normal),
        "smallest_subnormal": None if fmt.smallest_subnormal is None
        else str(fmt.smallest_subnormal),
        "emin": fmt.emin, "emax": fmt.emax, "eps": str(fmt.eps),
        "max_display": _display(fmt.max),
        "smallest_normal_display": _display(fmt.smallest_normal),
        "smallest_subnormal_display": _display(fmt.smallest_subnormal),
    }


def _ieee(name: str, ebits: int, mbits: int, bias: int | None = None) -> Format:
    """An IEEE-like float: subnormals, ±inf and NaN in the all-ones exponent."""
    return Format(name, ebits, mbits, (1 << (ebits - 1)) - 1 if bias is None else bias,
                  has_inf=True, nan=NanEncoding.IEEE)


def p3109(k: int, precision: int, signed: bool = True, extended: bool = True) -> Format:
    """IEEE P3109's ``binaryKpP`` (interim report, 2026; gfloat's ``format_info_p3109``).

    ``P - 1`` trailing significand bits, the rest exponent (one more when unsigned, which has
    no sign bit); bias ``floor(2**(K-P-1))`` signed, ``2**(K-P)`` unsigned; subnormals always;
    no −0: NaN is 2**(K−1) when signed, the top code when unsigned; the extended domain puts
    ±inf at the largest non-NaN code of each sign, the finite domain has no infinities.
    """
    suffix = f"{'s' if signed else 'u'}{'e' if extended else 'f'}"
    name = f"binary{k}p{precision}{suffix}"
    if not 2 <= k <= MAX_P3109_K or not 1 <= precision <= k - int(signed):
        raise FormatSpecError(
            f"P3109 format {name!r} is impossible: K must be 2..{MAX_P3109_K} and P 1..K-1 "
            "(signed) or 1..K (unsigned); for example p3109:k8p4se or p3109:k8p3uf")
    ebits = k - precision + 1 - int(signed)
    # signed P <= K - 1, so gfloat's floor(2**(K-P-1)) is a whole power of two here
    bias = 1 << (k - precision - int(signed))
    fmt = Format(name, ebits, precision - 1, bias, signed=signed, has_inf=extended,
                 nan=NanEncoding.NEG_ZERO if signed else NanEncoding.TOP,
                 kind=FormatKind.P3109)
    if fmt.qmin < -149 or fmt.emax > 127:
        raise FormatSpecError(
            f"P3109 format {name!r} is outside float32's range (its values run "
            f"2^{fmt.qmin}..2^{fmt.emax + 1}); drift casts through float32: choose a larger P")
    return fmt


MAX_P3109_K = 16
"""The widest P3109 format drift builds (the public value tables stop at K = 16)."""

_P3109 = re.compile(r"(?:p3109[:_]k|binary)(\d+)p(\d+)([su])([ef])")


def _p3109_spec(name: str) -> Format | None:
    """``p3109:k8p4se``, ``p3109_k8p4se`` (gfloat's name) or ``binary8p4se`` (the report's)."""
    match = _P3109.fullmatch(name.lower())
    if match is None:
        return None
    return p3109(int(match[1]), int(match[2]), match[3] == "s", match[4] == "e")


_P3109_PREFIX = re.compile(r"(?i)\bp3109:k(?=\d)")


def colon_free(spec: str) -> str:
    """``spec`` with each P3109 name ``p3109:kKpP..`` spelled ``binaryKpP..``, so that a cast
    spec, whose fields are separated by colons, can split on them."""
    return _P3109_PREFIX.sub("binary", spec)


_NAMED: tuple[Format, ...] = (
    _ieee("float32", 8, 23),
    _ieee("bfloat16", 8, 7),
    _ieee("float16", 5, 10),
    _ieee("float8_e5m2", 5, 2),
    Format("float8_e4m3fn", 4, 3, 7, nan=NanEncoding.TOP),
    Format("float8_e4m3fnuz", 4, 3, 8, nan=NanEncoding.NEG_ZERO),
    Format("float8_e5m2fnuz", 5, 2, 16, nan=NanEncoding.NEG_ZERO),
    Format("float6_e3m2fn", 3, 2, 3),
    Format("float6_e2m3fn", 2, 3, 1),
    Format("float4_e2m1fn", 2, 1, 1),
    # HiFloat4's element, S1E1M2: k/4 for k = 0..7 (docs/formats.md#hifloat4)
    Format("float4_e1m2", 1, 2, 1),
    # MX6's and MX9's elements, S1E1M3 and S1E1M6: k/8 and k/64 below 2
    # (docs/formats.md#mx6-and-mx9)
    Format("float5_e1m3", 1, 3, 1),
    Format("float8_e1m6", 1, 6, 1),
    Format("float8_e8m0fnu", 8, 0, 127, signed=False, nan=NanEncoding.TOP, has_subnormals=False),
    # block-scale formats of the FP4 recipes after OCP (docs/formats.md#ue5m3-and-ue4m3)
    Format("ue5m3", 5, 3, 15, signed=False, nan=NanEncoding.TOP),
    Format("ue4m3", 4, 3, 7, signed=False, nan=NanEncoding.TOP),
    Format("int8", 0, 7, -6, integer=True),
    Format("int4", 0, 3, -2, integer=True),
    # IEEE P3109 (docs/formats.md#ieee-p3109): the two 8-bit formats that stand beside E5M2 and
    # E4M3, and the 4-bit one; every other binaryKpP resolves by name on lookup (registering all
    # would add 40-50 CPU-seconds each to the full verify plan that CI runs)
    p3109(8, 3),
    p3109(8, 4),
    p3109(4, 2, extended=False),
    # HiFloat8 (docs/formats.md#hifloat8): tapered; NaN the sign bit alone (0x80), ±inf the
    # largest magnitude code of each sign (0x6F, 0xEF)
    Format("hifloat8", 4, 3, 0, has_inf=True, nan=NanEncoding.NEG_ZERO,
           kind=FormatKind.TAPERED, taper=HIFLOAT8),
)

_NAMED_BY_NAME = {f.name: f for f in _NAMED}

_CUSTOM = re.compile(r"e(\d+)m(\d+)(?:b(-?\d+))?")
# Custom formats must sit inside float32's range so that every value is a float32 and every
# float32 subnormal lies below the format's smallest normal (the fast path relies on both).
MAX_CUSTOM_EBITS, MAX_CUSTOM_MBITS = 8, 23


def _same_widths(ebits: int, mbits: int) -> list[str]:
    """The registered signed floats of at most 8 bits with these widths: a
    custom ``eXmY`` of their widths would read as one of them (``e4m3`` as float8_e4m3fn)."""
    # signed, as a custom float is (not UE4M3, a scale format); IEEE-like (a P3109 format is
    # named binaryKpP, never eXmY)
    return [f.name for f in _NAMED if f.signed and not f.integer and f.bits <= 8
            and f.kind is FormatKind.IEEE_LIKE and (f.ebits, f.mbits) == (ebits, mbits)]


def _custom(name: str) -> Format | None:
    match = _CUSTOM.fullmatch(name)
    if match is None:
        return None
    ebits, mbits = int(match[1]), int(match[2])
    default_bias = (1 << (ebits - 1)) - 1 if ebits >= 1 else 0
    bias = default_bias if match[3] is None else int(match[3])
    if not 2 <= ebits <= MAX_CUSTOM_EBITS or not 1 <= mbits <= MAX_CUSTOM_MBITS:
        raise FormatSpecError(
            f"custom format {name!r} is impossible: exponent bits must be 2..{MAX_CUSTOM_EBITS} "
            f"and mantissa bits 1..{MAX_CUSTOM_MBITS} (an IEEE-like format needs a mantissa bit "
            "to tell NaN from inf); for example e3m4, e8m13 or e5m2b16")
    standard = _same_widths(ebits, mbits)
    if standard and match[3] is None:
        raise FormatSpecError(
            f"format {name!r} is ambiguous: name the standard format of these widths "
            f"({' or '.join(standard)}), or the IEEE-like custom float (±inf, NaN in the top "
            f"exponent), spelled e{ebits}m{mbits}b{default_bias}")
    # a bias equal to the default is dropped, unless the name alone would be ambiguous
    implied = bias == default_bias and not standard
    canonical = f"e{ebits}m{mbits}" + ("" if implied else f"b{bias}")
    fmt = _ieee(canonical, ebits, mbits, bias)
    if fmt.emin < -126 or fmt.emax > 127:
        raise FormatSpecError(
            f"custom format {name!r} is impossible: bias {bias} puts its range at "
            f"2^{fmt.emin}..2^{fmt.emax}, outside float32's 2^-126..2^127; choose a bias in "
            f"{(1 << ebits) - 2 - 127}..127")
    return fmt


_SYMMETRIC_SUFFIX = "_sym"


def _symmetric(name: str) -> Format | None:
    """``int8_sym``, ``int4_sym``: a registered integer format clamped to ``-max..max``.

    Resolved on lookup, not registered, so that ``drift formats`` and the verify plans keep
    their counts (``drift verify-formats -f int8_sym`` checks it like any other format)."""
    base = _NAMED_BY_NAME.get(name.removesuffix(_SYMMETRIC_SUFFIX)) \
        if name.endswith(_SYMMETRIC_SUFFIX) else None
    if base is None or not base.integer:
        return None
    return replace(base, name=name, symmetric=True)


class _Registry(Mapping[str, Format]):
    """Named formats by name; custom ``eXmY`` / ``eXmYbZ`` names resolve on lookup."""

    def __init__(self, formats: tuple[Format, ...]) -> None:
        self._named = {f.name: f for f in formats}

    def __getitem__(self, name: str) -> Format:
        if name in self._named:
            return self._named[name]
        custom = _p3109_spec(name) or _symmetric(name) or _custom(name)
        if custom is None:
            raise UnknownFormatError(
                f"unknown format {name!r}{close_matches(name, self._named)} "
                "(see drift formats; custom floats are written eXmY or eXmYbZ, IEEE P3109 "
                "formats p3109:kKpP with s/u and e/f, e.g. p3109:k8p4se)")
        return custom

    def __contains__(self, name: object) -> bool:
        if name in self._named:
            return True
        try:
            return isinstance(name, str) and (
                _p3109_spec(name) or _symmetric(name) or _custom(name)) is not None
        except FormatSpecError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._named)

    def __len__(self) -> int:
        return len(self._named)


FORMATS: Mapping[str, Format] = _Registry(_NAMED)
"""Every named format; ``FORMATS["e3m4"]`` also builds custom IEEE-like formats."""


def get_format(fmt: str | Format) -> Format:
    """Resolve a name (registered or ``eXmY`` / ``eXmYbZ``) or pass a :class:`Format` through."""
    return fmt if isinstance(fmt, Format) else FORMATS[fmt]
