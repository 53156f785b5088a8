"""The exact twin of :mod:`driftcli.casts.hadamard`: the random Hadamard transform of a
group of 16 values, its float32 products summed in order and rounded to bfloat16 as the
implementation does, each step exactly. It imports neither torch nor the fast path.
"""

from __future__ import annotations

from driftcli.oracle import blockfma
from driftcli.oracle.blockfma import Unit
from driftcli.oracle.rounding import round_exact, total
from driftcli.oracle.scalearith import ZERO, fl, mul, of64
from driftcli.records.formats import FORMATS, Exact, Format
from driftcli.records.modes import (
    Overflow,
    Rounding,
)


def hadamard16(values: list[Exact], entries: tuple[float, ...]) -> list[Exact]:
    """The random Hadamard transform of one group of 16 values, exactly with the roundings
    drift fixes (:mod:`driftcli.casts.hadamard`): ``y_j = rn_bf16(fl32(... fl32(fl32(0 + fl32(x_0 ·
    m_0j)) + fl32(x_1 · m_1j)) ...))``, ``entries`` the row-major matrix (``Rht.entries``)."""
    size = len(values)
    out = []
    for j in range(size):
        acc = ZERO
        for i in range(size):
            acc = fl(total(acc, mul(values[i], of64(entries[i * size + j]))))
        out.append(round_exact(FORMATS["bfloat16"], acc, Rounding.RNE, Overflow.IEEE))
    return out


def hadamard16_blockfma(values: list[Exact], entries: tuple[float, ...], unit: Unit,
                        inputs: Format, acc: Format, rounding: Rounding) -> list[Exact]:
    """The transform of one group of 16 on a tensor core (``rht=…,tc=``), exactly: each value
    rounded to ``inputs`` (nearest even, the MMA's operands), ``y_j`` the block-FMA dot
    product of the group with column ``j`` of ``entries`` under ``unit`` (every group's result
    rounded into ``acc`` by ``rounding``, from +0, no promotion: :func:`blockfma.fma_dot`),
    then rounded to bfloat16 (nearest even)."""
    size = len(values)
    operands = [round_exact(inputs, v, Rounding.RNE, Overflow.IEEE) for v in values]
    out = []
    for j in range(size):
        column = [of64(entries[i * size + j]) for i in range(size)]
        y = blockfma.fma_dot(operands, column, unit, acc, rounding, (inputs.emin, inputs.emin),
                             FORMATS["float32"])
        out.append(round_exact(FORMATS["bfloat16"], y, Rounding.RNE, Overflow.IEEE))
    return out
