"""How verify-formats compares: the records of a comparison (a cell's :class:`Outcome`, the
table's :class:`VerifyRow`), the :class:`Plan`, and bitwise comparison of fast results with
the oracle's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar

import torch

from driftcli import oracle
from driftcli.io.tables import column
from driftcli.oracle.rounding import RoundingCell
from driftcli.records.formats import NAN, Exact, Format, Kind
from driftcli.records.modes import Overflow, Rounding

Tensor = torch.Tensor

FAILURE_CAP = 20
"""Disagreement rows kept per (format, check, operation, rounding, overflow) cell."""
SEED = 20261129
DETERMINISTIC = tuple(m for m in Rounding if m is not Rounding.SR)


@dataclass(frozen=True)
class VerifyRow:
    """One row of ``verify-formats.parquet``: a cell's counts, or one disagreement."""

    TABLE: ClassVar[str] = "verify-formats"
    KEYS: ClassVar[tuple[str, ...]] = ("kind", "format", "check", "operation", "rounding",
                                       "overflow", "operands")
    HEADLINE: ClassVar[str] = "n_failed"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    kind: str = column("'summary' (one per cell) or 'disagreement' (one per failing value)")
    format: str = column("format name")
    check: str = column("codes, pairs, float32-inputs, …")
    operation: str = column("decode, roundtrip, product, sum, cast")
    rounding: str = column("rounding mode, or '-' where none applies")
    overflow: str = column("overflow policy, or '-' where none applies")
    n_checked: int = column("values compared in this cell (1 for a disagreement row)")
    n_failed: int = column("values where the fast path differs from the oracle")
    operands: str | None = column("operand codes (hex) or float32 input bits, for disagreements")
    expected: str | None = column("the oracle's exact result (a fraction, ±inf, nan, -0)")
    got: str | None = column("the fast path's result, exactly")


@dataclass
class Outcome:
    """One cell's result: how many values were compared and which disagreed."""

    format: str
    check: str
    operation: str
    rounding: str
    overflow: str
    n_checked: int = 0
    failures: list[tuple[str, str, str]] = field(default_factory=list)
    n_failed: int = 0

    def rows(self) -> list[VerifyRow]:
        summary = VerifyRow("summary", self.format, self.check, self.operation, self.rounding,
                            self.overflow, self.n_checked, self.n_failed, None, None, None)
        return [summary] + [
            VerifyRow("disagreement", self.format, self.check, self.operation, self.rounding,
                      self.overflow, 1, 1, ops, exp, got) for ops, exp, got in self.failures]


@dataclass(frozen=True)
class Plan:
    """How much to check: ``quick`` is the subset every CI run can afford."""

    quick: bool = False
    seed: int = SEED



# --- comparison helpers --------------------------------------------------------------------

def to_float(x: Exact) -> float:
    """The float64 of an exact value (every format value is a float32, so this is exact)."""
    if x.kind is Kind.NAN:
        return float("nan")
    if x.kind is Kind.INF:
        return float("-inf") if x.negative else float("inf")
    v = float(x.mag)
    return -v if x.negative else v


def exact_of_float(v: float) -> Exact:
    """The exact value of a float, sign of zero included."""
    if v != v:
        return NAN
    if v in (float("inf"), float("-inf")):
        return Exact(Kind.INF, v < 0)
    return Exact.of(Fraction(v), negative_zero=str(v).startswith("-"))


def same(expected: Tensor, got: Tensor) -> Tensor:
    """Bitwise equality of float64 values, any NaN equal to any NaN."""
    e, g = expected.to(torch.float64), got.to(torch.float64)
    return (e.view(torch.int64) == g.view(torch.int64)) | (torch.isnan(e) & torch.isnan(g))


def judge(out: Outcome, expected: Tensor, got: Tensor, describe: Callable[[int], str]) -> None:
    """Count ``expected`` against ``got`` (:func:`same`) into ``out``, keeping up to
    :data:`FAILURE_CAP` disagreements, each named by ``describe(index)``."""
    ok = same(expected, got)
    out.n_checked += ok.numel()
    bad = (~ok).nonzero().flatten()
    out.n_failed += bad.numel()
    for i in bad[: FAILURE_CAP - len(out.failures)].tolist():
        out.failures.append((describe(i), str(exact_of_float(expected[i].item())),
                             str(exact_of_float(got[i].item()))))


def round_cells_float(fmt: Format, x: Exact, cells: Sequence[RoundingCell]) -> list[float]:
    """The oracle's rounding of ``x`` under each cell, as float64 (:func:`round_cells`)."""
    results = oracle.rounding.round_cells(fmt, x, cells)
    # cells that agree share one Exact object: convert each object once (the list keeps
    # every one alive, so no id is reused while ``seen`` holds it)
    seen: dict[int, float] = {}
    floats = []
    for e in results:
        v = seen.get(id(e))
        if v is None:
            v = seen[id(e)] = to_float(e)
        floats.append(v)
    return floats


def round_table(fmt: Format, rows: Sequence[tuple[Exact, Sequence[RoundingCell]]]) -> Tensor:
    """Float64 ``[len(rows), cells]``: row ``i`` is :func:`round_cells_float` of a value under
    its cells (every row has as many)."""
    width = len(rows[0][1]) if rows else 0
    return torch.tensor([round_cells_float(fmt, x, c) for x, c in rows],
                        dtype=torch.float64).reshape(len(rows), width)


def dedup(values: list[Exact]) -> tuple[list[Exact], Tensor]:
    """Distinct values and, for each input, its index among them (rounding each once)."""
    index: dict[Exact, int] = {}
    idx = [index.setdefault(v, len(index)) for v in values]
    return list(index), torch.tensor(idx, dtype=torch.int64)


def hex_code(fmt: Format, code: int) -> str:
    """A code in hex, padded to the format's width (``0x7e``)."""
    return f"0x{code:0{(fmt.bits + 3) // 4}x}"


Cell = tuple[Rounding, Overflow]
MAIN_CELL: Cell = (Rounding.RNE, Overflow.SATURATE)


def cells(fmt: Format, plan: Plan) -> list[Cell]:
    """The (rounding, overflow) cells to check; the quick plan keeps 16-bit formats to one."""
    if plan.quick and fmt.bits > 8:
        return [MAIN_CELL]
    return [(m, p) for m in Rounding for p in Overflow]

