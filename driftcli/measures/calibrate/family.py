"""The family of models a backend is matched against: block-FMA units and classic
accumulations (sequential, pairwise, chunked), as drift matmul specs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from driftcli.arith.blockfma import (
    DOUBLE_BITS,
    FMAUnit,
)
from driftcli.arith.matmul import MatmulSpec, Order, matmul_spec
from driftcli.measures.calibrate.backends import FLOAT32
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS, Format, get_format
from driftcli.records.modes import Rounding

SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Group sizes of the family."""


INTERLEAVES = (0, 1, 2)
"""Interleaves of the family: none, odd/even positions (AMD CDNA3's FP8), pairs (Hopper's FP8
``mma.sync`` with an fp16 result)."""


KEPT = range(4, 49)
"""Kept bits of the family."""


ACC_BITS = range(4, 24)
"""Fraction bits of the family's ``e8mM`` accumulators (``e8m23`` is float32)."""


CLASSIC_ACCS = ("float32", "bfloat16", "float16")


ROUNDINGS = (Rounding.RTZ, Rounding.RNE)


@dataclass(frozen=True)
class Model:
    """One model of the family (see :mod:`driftcli.measures.calibrate`)."""

    order: Order
    acc: Format
    rounding: Rounding
    unit: FMAUnit | None = None
    chunk: int = 0
    """The promotion interval of ``blockfma``, the chunk of ``chunked``; 0 for none."""

    def spec(self, inputs: Format, output: Format) -> MatmulSpec:
        """The matmul spec of this model for a backend's formats."""
        plain = None if inputs == FLOAT32 else parse_cast(inputs.name)
        # a conversion of the result overflows to inf, as IEEE (and torch's .to) does
        out = None if output == FLOAT32 else parse_cast(f"{output.name}:none:rne:ieee")
        return matmul_spec(lhs=plain, rhs=plain, accumulator=self.acc,
                           acc_rounding=self.rounding, order=self.order, chunk=self.chunk,
                           unit=self.unit, out=out)

    def simplicity(self) -> tuple[int, ...]:
        """Sort key among models that give the same bits: the simplest first."""
        unit = self.unit or FMAUnit(1, 1)
        named = self.acc.name in CLASSIC_ACCS
        # one rounding per addition is the fewest parameters: it goes first
        return (self.order is Order.BLOCKFMA, unit.interleave, self.chunk > 0, unit.size,
                unit.kept_bits, not named, -self.acc.mbits, self.rounding is Rounding.RNE)


def acc_format(mbits: int) -> Format:
    """The ``e8mM`` accumulator of ``mbits`` fraction bits (float32 and bfloat16 by name)."""
    return {23: FLOAT32, 7: FORMATS["bfloat16"]}.get(mbits) or get_format(f"e8m{mbits}")


def blockfma_models(max_k: int) -> Iterator[Model]:
    """Every block-FMA model of the family whose promotion interval is below ``max_k``, with
    accumulators no wider than can be seen: a group's result has at most ``kept + 3 +
    log2(size + 1)`` significant bits, so wider accumulators give the same bits."""
    accs = [*(acc_format(m) for m in ACC_BITS), FORMATS["float16"]]
    for size in SIZES:
        for il in INTERLEAVES:
            if il and size % (2 * il):
                continue
            promotions = [0, *(p for p in (size << i for i in range(14)) if p < max_k)]
            for kept in KEPT:
                if kept + 3 + (size + 1).bit_length() > DOUBLE_BITS:
                    continue
                unit = FMAUnit(size, kept, interleave=il)
                seen = kept + 2 + (size + 1).bit_length()
                for acc in accs:
                    if acc.mbits + 1 >= seen and acc.ebits == FLOAT32.ebits and acc != FLOAT32:
                        continue  # never rounds a group's sum: float32 stands for it
                    for rounding in ROUNDINGS:
                        for chunk in promotions:
                            yield Model(Order.BLOCKFMA, acc, rounding, unit, chunk)


def classic_models(max_k: int) -> Iterator[Model]:
    """The one-rounding-per-addition models of the family."""
    for name in CLASSIC_ACCS:
        acc = FORMATS[name]
        for rounding in ROUNDINGS:
            yield Model(Order.SEQUENTIAL, acc, rounding)
            yield Model(Order.PAIRWISE, acc, rounding)
            for i in range(1, 14):
                if (1 << i) < max_k:
                    yield Model(Order.CHUNKED, acc, rounding, chunk=1 << i)
