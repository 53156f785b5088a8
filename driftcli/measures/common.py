"""What every per-tensor, per-cast measurement shares: the identifying columns, the
all-tensors row, and the plain registry that maps a command name to its measure."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from driftcli.io.tables import column
from driftcli.measures.diffstats import DiffStats
from driftcli.measures.scan import Result, Scan, ScanOptions, Source, iter_groups, scan
from driftcli.measures.stats import CastStats
from driftcli.progress import Progress
from driftcli.records.cast import Cast

CAST_NAME_DOC = ("The cast as it was given (a preset such as nvfp4); the canonical spec where "
                 "it was given as one, or as a Cast")
"""The ``cast_name`` column of every table that measures casts."""
ALL_TENSORS = "*"
"""The ``tensor`` of the row that aggregates every selected tensor of an input."""


@dataclass(frozen=True)
class TensorCastRow:
    """Columns that say which tensor, under which cast, and how much of it was finite."""

    source: str = column("File holding the tensor; for the all-tensors row, the input as given")
    tensor: str = column("Tensor name; '*' for the row over all selected tensors of the input")
    role: str | None = column("Role from a drift dump: activation, weight or gradient; null if "
                              "unknown")
    layer: str | None = column("Layer (module) from a drift dump; null if unknown")
    operand: str | None = column("Matmul operands the tensor feeds, from a drift dump, e.g. "
                                 "'forward.lhs wgrad.rhs'; null if unknown")
    step: int | None = column("Training step from a drift dump; null if unknown")
    dtype: str | None = column("Stored dtype (bfloat16 and float16 are widened exactly)")
    shape: str | None = column("Shape as a JSON list, e.g. [4096, 11008]")
    numel: int | None = column("Elements (all selected tensors in the all-tensors row)")
    cast: str = column("Canonical cast spec (drift formats --cast SPEC explains it)")
    cast_name: str = column(CAST_NAME_DOC)
    format: str = column("Element format")
    granularity: str = column("Scale granularity: none, tensor, channel, block or tile")
    block: int = column("Block or tile size (0 for none, tensor, channel)")
    scale_rule: str | None = column("Scale rule (floor, ceil, even, amax, ...); null unscaled")
    rounding: str = column("Rounding mode of the element cast")
    n_tensors: int = column("Tensors measured (1, or the count in the all-tensors row)")
    n_skipped: int = column("Non-floating-point tensors skipped (all-tensors row only; else 0)")
    n_finite: int | None = column("Finite input elements")
    n_nonfinite: int | None = column("Input elements that are NaN or ±inf")
    error: str | None = column("Why this tensor or file could not be measured; null when it was")


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, null when there is nothing to divide by (or a count was not taken)."""
    return num / den if num is not None and den else None


def _cast_columns(c: Cast, names: dict[str, str]) -> dict[str, Any]:
    s = c.scaling
    rule = None if s.rule is None else s.rule.value + (f"+{s.headroom}" if s.headroom else "")
    return {"cast": str(c), "cast_name": names.get(str(c), str(c)), "format": c.format.name,
            "granularity": s.granularity.value, "block": s.block, "scale_rule": rule,
            "rounding": c.rounding.value}


def _counts(st: CastStats | None) -> dict[str, Any]:
    if st is None:
        return {"n_finite": None, "n_nonfinite": None}
    return {"n_finite": st.numel - st.nonfinite, "n_nonfinite": st.nonfinite}


def _tensor_base(r: Result, names: dict[str, str]) -> dict[str, Any]:
    ref = r.ref
    st = r.draws[0] if r.draws else None
    return {
        "source": r.source, "tensor": ref.name if ref else r.name or "(unreadable file)",
        "role": ref.role if ref else None, "layer": ref.layer if ref else None,
        "operand": ref.operand if ref else None, "step": ref.step if ref else None,
        "dtype": ref.dtype if ref else None,
        "shape": json.dumps(list(ref.shape)) if ref else None,
        "numel": ref.numel if ref else None, **_cast_columns(r.cast, names), "n_tensors": 1,
        "n_skipped": 0, **_counts(st), "error": r.error,
    }


Columns = Callable[[tuple[CastStats, ...], CastStats | None], dict[str, Any]]
"""A measure's own columns from the stats of each draw and of the mean of the draws."""

PairColumns = Callable[[CastStats, CastStats, DiffStats], dict[str, Any]]
"""A comparing measure's own columns from one cast's stats, the first cast's, and where the two
casts differ."""


@dataclass(frozen=True)
class Measure:
    """One measurement: its command name, row type and how its columns are computed."""

    name: str
    row_type: type[Any]
    """The measure's :class:`~driftcli.io.tables.Row` type (called with its columns)."""
    columns: Columns
    rounded: bool = True
    """Whether its columns need the rounded values; clip-rate's do not, and skips the
    rounding."""
    pair_columns: PairColumns | None = None
    """Set for a measure of every cast against the first (cast-diff): the scan then compares
    them element by element, and each row is one cast against the first, with an ``against``
    column; ``columns`` is not used."""

    def _nulls(self) -> dict[str, Any]:
        base = {f.name for f in fields(TensorCastRow)}
        return {f.name: None for f in fields(self.row_type) if f.name not in base}

    def rows(self, s: Scan, totals: bool = True) -> list[Any]:
        """One row per (source, tensor, cast), then (with ``totals``) one per (input, cast)
        over all tensors."""
        if self.pair_columns is not None:
            return self._pair_rows(s, self.pair_columns, totals)
        out = []
        for r in s.results:
            own = self.columns(r.draws, r.expected) if r.error is None else self._nulls()
            out.append(self.row_type(**_tensor_base(r, s.names), **own))
        for inp, c, results in iter_groups(s) if totals else ():
            n_draws = max((len(r.draws) for r in results), default=1)
            draws = tuple(CastStats.merge([r.draws[d] for r in results], False)
                          for d in range(n_draws))
            exp = [r.expected for r in results if r.expected is not None]
            expected = CastStats.merge(exp, False) if exp else None
            bad = sum(1 for r in s.errors if r.input == inp and str(r.cast) == str(c))
            out.append(self.row_type(
                source=inp, tensor=ALL_TENSORS, role=None, layer=None, operand=None, step=None,
                dtype=None, shape=None, numel=draws[0].numel, **_cast_columns(c, s.names),
                n_tensors=len(results), n_skipped=s.skipped.get(inp, 0), **_counts(draws[0]),
                error=f"{bad} tensor(s) or file(s) could not be read" if bad else None,
                **self.columns(draws, expected)))
        return out

    def _pair_rows(self, s: Scan, own_columns: PairColumns, totals: bool) -> list[Any]:
        """Each cast but the first against the first: per tensor, then (with ``totals``) over
        all tensors."""
        if not s.results:
            return []
        first = str(s.results[0].cast)
        out, base = [], {}
        for r in s.results:
            key = (r.input, r.source, r.ref.name if r.ref else r.name)
            if key not in base:  # the first cast of this tensor: the baseline, no row
                base[key] = r
                continue
            b = base[key]
            ok = r.error is None and b.error is None and r.diff is not None
            # ``against`` is a column of the row type, so the nulls hold it too: it is given
            # below for every row, failed ones included
            nulls = {k: v for k, v in self._nulls().items() if k != "against"}
            own = (own_columns(r.draws[0], b.draws[0], r.diff)
                   if ok and r.diff is not None else nulls)
            out.append(self.row_type(**_tensor_base(r, s.names), against=first, **own))
        groups = list(iter_groups(s)) if totals else []
        baseline = {inp: results for inp, c, results in groups if str(c) == first}
        for inp, c, results in groups:
            if str(c) == first:
                continue
            mine = CastStats.merge([r.draws[0] for r in results], False)
            theirs = CastStats.merge([r.draws[0] for r in baseline.get(inp, [])], False)
            diff = DiffStats.merge([r.diff for r in results if r.diff is not None])
            bad = sum(1 for r in s.errors if r.input == inp and str(r.cast) == str(c))
            out.append(self.row_type(
                source=inp, tensor=ALL_TENSORS, role=None, layer=None, operand=None, step=None,
                dtype=None, shape=None, numel=mine.numel, **_cast_columns(c, s.names),
                n_tensors=len(results), n_skipped=s.skipped.get(inp, 0), **_counts(mine),
                error=f"{bad} tensor(s) or file(s) could not be read" if bad else None,
                against=first, **own_columns(mine, theirs, diff)))
        return out

    def scan_options(self, options: ScanOptions | None) -> ScanOptions:
        """``options`` as this measure's scan needs them (a comparing measure compares)."""
        options = options or ScanOptions()
        return dataclasses.replace(options, compare=self.pair_columns is not None)

    def run(self, paths: Sequence[Source], casts: Sequence[Cast | str], *,
            options: ScanOptions | None = None, include: Sequence[str] = (),
            exclude: Sequence[str] = (), progress: Progress | None = None,
            layout: str | None = None) -> list[Any]:
        """Scan ``paths`` under ``casts`` and return this measure's rows (``layout``: that of
        pre-quantized weights, where the checkpoint leaves it in doubt)."""
        return self.rows(scan(paths, casts, options=self.scan_options(options), include=include,
                              exclude=exclude, progress=progress, rounded=self.rounded,
                              layout=layout))
