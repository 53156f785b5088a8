"""The choices a command makes that are not a cast's (where its work runs, the device, the
weights' storage, a synthetic operand's distribution), as str enums, and
:func:`parse_choice`, which turns a user's string into a member of any choice (a cast's
too). Nothing here imports torch.
"""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import TypeVar

from driftcli.errors import ChoiceError, close_matches


class Engine(StrEnum):
    """Where a command's independent work units run (see :mod:`driftcli.engines`); each member
    says what it means, for ``--engine``'s help, and whether ``--workers`` sizes it."""

    means: str
    parallel: bool

    def __new__(cls, value: str, means: str, parallel: bool) -> Engine:
        member = str.__new__(cls, value)
        member._value_ = value
        member.means = means
        member.parallel = parallel
        return member

    SERIAL = "serial", "in this process, one unit after another (the default)", False
    PROCESSES = "processes", "in local worker processes", True
    RAY = "ray", "on a Ray cluster (needs Ray, the optional extra ray)", True


class Device(StrEnum):
    """Where casts run."""

    CPU = "cpu"
    CUDA = "cuda"


class Storage(StrEnum):
    """Formats the weights could be stored in, for the update-freeze share."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class Dist(StrEnum):
    """How a synthetic operand's elements are drawn (A and B alike, independently)."""

    NORMAL = "normal"
    """N(0, 1): signed, cancelling sums."""
    UNIFORM = "uniform"
    """U(-1, 1): bounded, signed."""
    LOGNORMAL = "lognormal"
    """A random sign times exp(N(0, 1)): heavy-tailed, a few products dominate a sum."""
    HALFNORMAL = "halfnormal"
    """|N(0, 1)|: all positive (like post-ReLU values without the zeros), so every sum grows
    with K and a narrow accumulator swamps."""
    TANH = "tanh"
    """tanh(2·N(0, 1)): values piling up just under ±1, as saturated tanh activations do."""


E = TypeVar("E", bound=Enum)


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
