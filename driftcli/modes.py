"""Rounding modes and overflow policies: the two choices every cast makes."""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import TypeVar

from driftcli.errors import ChoiceError, close_matches


class Rounding(StrEnum):
    """How a real value is rounded onto a format's grid."""

    RNE = "rne"
    """Nearest, ties to the even significand (IEEE roundTiesToEven); the default."""
    RNA = "rna"
    """Nearest, ties away from zero (IEEE roundTiesToAway)."""
    RTZ = "rtz"
    """Toward zero (truncation)."""
    RUP = "rup"
    """Toward +inf."""
    RDOWN = "rdown"
    """Toward −inf."""
    SR = "sr"
    """Stochastic: with k random bits r, round away from zero when floor(f·2^k) + r ≥ 2^k,
    f the fractional distance past the lower neighbour (hardware adds random bits, truncates)."""

    def toward_zero(self, negative: bool) -> bool:
        """Whether this mode rounds a value of this sign toward zero (never past it)."""
        return self is Rounding.RTZ or (self is Rounding.RUP and negative) or (
            self is Rounding.RDOWN and not negative)


class Overflow(StrEnum):
    """What a value beyond the largest finite becomes."""

    SATURATE = "saturate"
    """Clamp to ±max finite, ±inf included (OCP saturating, TE satfinite)."""
    IEEE = "ieee"
    """As IEEE 754: ±inf where the format has it (±max when the mode rounds toward zero),
    NaN where it has only NaN, ±max where it has neither."""


E = TypeVar("E", bound=Enum)

DEFAULT_SR_BITS = 16
"""Random bits per element that stochastic rounding uses unless told otherwise."""


def parse_choice(enum: type[E], value: str | E, what: str) -> E:
    """Turn a user's string into a member of ``enum`` or raise a ChoiceError naming the choices."""
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except ValueError:
        choices = [m.value for m in enum]
        raise ChoiceError(
            f"unknown {what} {value!r}{close_matches(str(value), choices)} "
            f"(choose from {', '.join(choices)})") from None
