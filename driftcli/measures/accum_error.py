"""``accum-error``: how far a simulated matmul lands from the exact product, by accumulator
format, order and K, with the error of the operand casts told apart from that of the sum.

For operands ``A`` (..., M, K) and ``B`` (..., K, N), both taken as float32 as
:func:`driftcli.arith.matmul.matmul` takes them, three products are compared:

- ``E0``, the exact product of the operands as given;
- ``E1``, the exact product of the cast operands (``E1 = E0`` when a spec casts neither);
- ``C``, the simulated matmul under the spec (casts, accumulator, order, output cast).

The exact products come from :func:`exact_matmul`: every product of two float32 values is
exact in float64 (at most 48 significant bits, exponents far inside float64's range), and the
K products of each output are summed by Ogita, Rump and Oishi's Sum2 (compensated summation:
an error-free TwoSum per step, the errors summed alongside). The pair ``(hi, lo)`` it returns
is the exact sum to within ``γ(K-1)² · Σ|a_k b_k|`` with ``γ(n) = n·u/(1 - n·u)`` and
``u = 2**-53``: for K = 1024 about ``1e-26 · Σ|a_k b_k|``, ten orders of magnitude below a
float32 ulp of the result unless the dot product cancels by a factor of ``1e10``. The bound
is computed per output and reported (``ref_bound_ulps``), so a row whose reference could
matter says so.

Errors are ``C - E`` evaluated as ``(C - hi) - lo`` in float64. Ulps are those of the
accumulator format: the spacing of its grid in the binade that holds ``|E|`` (read from the
float64 exponent bits with ``frexp``, clamped to the format's normal range, so values in the
subnormal range get the subnormal spacing and zero gets it too).

Inputs are seeded synthetic operands (:class:`Dist`) or the matmuls of a drift dump: for a
linear layer ``y = x·Wᵀ`` the forward ``A = x, B = Wᵀ``, the dgrad ``A = dY, B = W`` and the
wgrad ``A = dYᵀ, B = x``; for ``C = A·B`` (``torch.matmul`` and friends) the forward ``A·B``,
the dgrad ``dC·Bᵀ`` and the wgrad ``Aᵀ·dC``. See docs/accum-error.md.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from driftcli import engines
from driftcli.arith.exact import ExactProduct, exact_matmul
from driftcli.arith.matmul import (
    FLOAT32,
    MatmulSpec,
    Order,
    matmul,
    matmul_spec,
    parse_matmul_spec,
    parse_order,
)
from driftcli.casts.quantization import quantize
from driftcli.choices import Dist, parse_choice
from driftcli.engines import Execution
from driftcli.errors import DriftError
from driftcli.io.tables import column
from driftcli.measures.accum_problems import (
    Problem,
    checked,
    dump_problems,
    synthetic_problems,
    synthetic_shapes,
)
from driftcli.measures.common import ratio
from driftcli.memory import available_memory
from driftcli.progress import Progress
from driftcli.records.cast import Cast
from driftcli.records.formats import Format, get_format
from driftcli.records.modes import Rounding

Tensor = torch.Tensor

DEFAULT_ACCUMULATORS = ("float32", "bfloat16", "float16", "e8m13")
"""The accumulators of the default grid (each rounding to nearest even)."""
DEFAULT_ORDERS = ("sequential", "pairwise", "chunked:128", "native")
"""The orders of the default grid; ``native`` pairs with float32 only."""


@dataclass(frozen=True)
class AccumErrorRow:
    """One matmul (synthetic or from a dump) under one matmul spec."""

    TABLE: ClassVar[str] = "accum-error"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "matmul", "spec", "m", "k", "n")
    HEADLINE: ClassVar[str] = "rel_error"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    source: str = column("Dump file holding the operands, or 'synthetic'")
    matmul: str = column("Which matmul: the distribution for synthetic operands ('normal'); "
                         "for a dump, the operands' name without the label, then the role "
                         "('fc1/forward', 'attn#1/0/wgrad')")
    dist: str | None = column("Distribution of synthetic operands; null for a dump")
    layer: str | None = column("Layer (module) from the dump; null for synthetic operands")
    role: str | None = column("Matmul role: forward, dgrad or wgrad; null for synthetic")
    step: int | None = column("Training step from the dump; null if unknown")
    batch: int = column("Independent matmuls along the leading (batch) dimensions; 1 for 2-D")
    m: int = column("Rows of A and of the result")
    k: int = column("Contraction length: products summed per output")
    n: int = column("Columns of B and of the result")
    spec: str = column("Canonical matmul spec (lhs=…,rhs=…,acc=…,order=…,scale=…,out=…)")
    accumulator: str = column("Accumulator format")
    acc_rounding: str = column("Accumulator rounding: rne or rtz")
    order: str = column("Summation order: sequential, pairwise, chunked:N or native")
    lhs_cast: str = column("Canonical cast of A along K, or 'none'")
    rhs_cast: str = column("Canonical cast of B along K, or 'none'")
    rel_error: float | None = column("‖C − E0‖ / ‖E0‖: the simulated result against the exact "
                                     "product of the operands as given; inf if C overflowed")
    bias: float | None = column("⟨C − E0, E0⟩ / ‖E0‖²: signed; negative when the result "
                                "shrinks along the exact one (swamping, rtz); null if C is "
                                "not finite")
    max_abs_error_ulps: float | None = column(
        "max |C − E0| in ulps of the accumulator format at |E0| (the grid spacing of the binade "
        "holding |E0|)")
    mean_abs_error_ulps: float | None = column("mean |C − E0| in the same ulps")
    cast_rel_error: float | None = column("‖E1 − E0‖ / ‖E0‖: the operand casts alone (E1: "
                                          "exact product of the cast operands); 0 uncast")
    accum_rel_error: float | None = column("‖C − E1‖ / ‖E1‖: accumulation (and the output "
                                           "cast) alone")
    accum_bias: float | None = column("⟨C − E1, E1⟩ / ‖E1‖²: the sign of the accumulation "
                                      "error alone")
    accum_max_error_ulps: float | None = column(
        "max |C − E1| in ulps of the accumulator format at |E1|")
    ref_bound_ulps: float | None = column(
        "max over outputs of the bound on the reference's own error, γ(K−1)²·Σ|a·b|, in the "
        "same ulps (tiny unless a sum cancels by ~1e10)")
    n_outputs: int | None = column("Output elements compared (batch·m·n)")
    n_nonfinite: int | None = column("Outputs of C that are ±inf or NaN (accumulator overflow)")
    error: str | None = column("Why this matmul could not be measured; null when it was")


# --- ulps -----------------------------------------------------------------------------------

def ulp(fmt: Format, hi: Tensor, lo: Tensor | None = None) -> Tensor:
    """The spacing of ``fmt``'s grid in the binade holding ``|hi + lo|`` (float64).

    The binade comes from the float64 exponent bits (``frexp``), not from a logarithm; a value
    ``hi + lo`` just below a power of two ``hi`` (``lo`` of the other sign) is in the binade
    below. Binades under the smallest normal share the subnormal spacing ``2**qmin`` (zero
    too); binades above the largest finite value take the top spacing ``2**qmax``.
    """
    mant, exp = torch.frexp(hi)  # hi = mant · 2**exp with 0.5 <= |mant| < 1
    e = exp.to(torch.int64) - 1  # floor(log2 |hi|)
    if lo is not None:
        below = (mant.abs() == 0.5) & ((lo < 0) != (hi < 0)) & (lo != 0)
        e = e - below.to(torch.int64)
    e = torch.where(hi == 0, torch.full_like(e, fmt.emin), e)
    e = e.clamp(min=fmt.emin, max=max(fmt.emax, fmt.emin))
    return torch.ldexp(torch.ones_like(hi), e - fmt.mbits)


# --- comparing a result with a reference ----------------------------------------------------

@dataclass(frozen=True)
class _Errors:
    """C against one exact product: relative error, bias, ulps."""

    rel: float | None
    bias: float | None
    max_ulps: float | None
    mean_ulps: float | None
    nonfinite: int


def _compare(c: Tensor, ref: ExactProduct, acc: Format) -> _Errors:
    c = c.double()
    d = (c - ref.hi) - ref.lo  # C − exact, to float64 rounding of the difference itself
    r = ref.value
    finite = bool(torch.isfinite(d).all())
    rr = float((r * r).sum())
    ulps = d.abs() / ulp(acc, ref.hi, ref.lo)
    nonfinite = int((~torch.isfinite(c)).sum())
    if not finite:
        return _Errors(math.inf, None, math.inf, math.inf, nonfinite)
    rel = ratio(math.sqrt(float((d * d).sum())), math.sqrt(rr))
    return _Errors(rel, ratio(float((d * r).sum()), rr), float(ulps.max()) if d.numel() else None,
                   float(ulps.mean()) if d.numel() else None, nonfinite)


def _cast_error(e1: ExactProduct, e0: ExactProduct) -> float | None:
    diff = (e1.hi - e0.hi) + (e1.lo - e0.lo)
    return ratio(math.sqrt(float((diff * diff).sum())),
                 math.sqrt(float((e0.value * e0.value).sum())))


# --- specs ----------------------------------------------------------------------------------

def _acc_and_rounding(text: str) -> tuple[str, str]:
    name, _, mode = text.strip().partition(":")
    return name, mode or Rounding.RNE.value


def grid_specs(accumulators: Sequence[str] = DEFAULT_ACCUMULATORS,
               orders: Sequence[str] = DEFAULT_ORDERS,
               cast_spec: Cast | str | None = None) -> tuple[MatmulSpec, ...]:
    """Every accumulator (``bfloat16`` or ``bfloat16:rtz``) with every order, both operands
    cast by ``cast_spec`` (None: uncast). ``native`` is torch.matmul in float32, so it is only
    paired with a float32 rne accumulator; other pairings with it are left out."""
    specs: list[MatmulSpec] = []
    for acc in accumulators:
        name, mode = _acc_and_rounding(acc)
        fmt, rounding = get_format(name), parse_choice(Rounding, mode, "accumulator rounding")
        for order in orders:
            if parse_order(order)[0] is Order.NATIVE and (fmt != FLOAT32
                                                          or rounding is not Rounding.RNE):
                continue  # native is torch.matmul: float32, rne, nothing else to vary
            spec = matmul_spec(lhs=cast_spec, rhs=cast_spec, accumulator=fmt,
                               acc_rounding=rounding, order=order)
            if spec not in specs:
                specs.append(spec)
    if not specs:
        raise DriftError(f"no matmul spec left from accumulators {list(accumulators)} and orders "
                         f"{list(orders)}: order native needs --acc float32; add another order "
                         "or accumulator")
    return tuple(specs)


DEFAULT_SPECS = grid_specs()
"""The default grid: float32, bfloat16, float16 and e8m13 (rne) in sequential, pairwise and
chunked:128 order, and float32 native."""


def choose_specs(specs: Sequence[MatmulSpec | str] = (), accumulators: Sequence[str] = (),
                 orders: Sequence[str] = (),
                 cast_spec: Cast | str | None = None) -> tuple[MatmulSpec, ...]:
    """The specs a run measures: the full ``specs`` given, then the grid of ``accumulators`` ×
    ``orders`` (each defaulting to the default grid's) cast by ``cast_spec``. The grid is left
    out when ``specs`` are given and none of the grid's three settings is."""
    chosen = [parse_matmul_spec(s) for s in specs]
    if not chosen or accumulators or orders or cast_spec is not None:
        grid = grid_specs(accumulators or DEFAULT_ACCUMULATORS, orders or DEFAULT_ORDERS,
                          cast_spec)
        chosen += [s for s in grid if s not in chosen]
    return tuple(dict.fromkeys(chosen))


_DEFAULT_PARTS = ("lhs=none", "rhs=none", "scale=dequantized", "out=none")


def spec_label(spec: MatmulSpec | str) -> str:
    """The canonical spec without the parts at their defaults (``acc=bfloat16:rne,order=
    sequential``): short enough for a summary line, and still a valid spec."""
    parts = str(parse_matmul_spec(spec)).split(",")
    return ",".join(p for p in parts if p not in _DEFAULT_PARTS)


# --- measuring ------------------------------------------------------------------------------

def _names(p: Problem, spec: MatmulSpec) -> dict[str, Any]:
    batch, m, k, n = p.shape
    return {"source": p.source, "matmul": p.matmul, "dist": p.dist, "layer": p.layer,
            "role": p.role, "step": p.step, "batch": batch, "m": m, "k": k, "n": n,
            "spec": str(spec), "accumulator": spec.accumulator.name,
            "acc_rounding": spec.acc_rounding.value, "order": spec.order_name,
            "lhs_cast": "none" if spec.lhs is None else str(spec.lhs),
            "rhs_cast": "none" if spec.rhs is None else str(spec.rhs)}


_NULLS: dict[str, Any] = {"rel_error": None, "bias": None, "max_abs_error_ulps": None,
          "mean_abs_error_ulps": None, "cast_rel_error": None, "accum_rel_error": None,
          "accum_bias": None, "accum_max_error_ulps": None, "ref_bound_ulps": None,
          "n_outputs": None, "n_nonfinite": None}


OPERAND_BYTES = 64
"""Bytes held per operand element (A's M·K and B's K·N) while a matmul is measured: drawn in
float64, kept in float32, copied to float64 by the exact product and by the simulated
matmul's terms, and a pairwise order's row of K·N terms with its levels."""
OUTPUT_BYTES = 128
"""Bytes held per output element (M·N): about 16 float64 arrays of the output's shape (the
exact product's sum, errors, magnitude sum and bound, for the cast operands too; the
simulated result and its accumulators; the comparisons' temporaries)."""


def matmul_bytes(batch: int, m: int, k: int, n: int) -> int:
    """An upper estimate of the memory measuring one ``batch`` × (M×K)·(K×N) matmul takes
    (:data:`OPERAND_BYTES`, :data:`OUTPUT_BYTES`)."""
    return batch * (OPERAND_BYTES * (m * k + k * n) + OUTPUT_BYTES * m * n)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB"


def check_shapes(shapes: Sequence[tuple[int, int, int]], memory: int | None = None) -> None:
    """Refuse (:class:`DriftError`) the first synthetic shape whose measurement would take
    more than ``memory`` bytes (default: what is available), before any operand is drawn."""
    have = available_memory() if memory is None else memory
    for m, k, n in shapes:
        need = matmul_bytes(1, m, k, n)
        if need > have:
            raise DriftError(f"shape {m}x{k}x{n}: measuring it takes about {_gib(need)} "
                             f"(operands, the exact product's float64 sums), more than the "
                             f"{_gib(have)} of memory available; give smaller shapes")


def measure(problem: Problem, specs: Sequence[MatmulSpec | str], *,
            seed: int = 0) -> list[AccumErrorRow]:
    """One row per spec for one matmul: the simulated result against the exact products.

    Stochastic casts draw from ``seed`` (A), ``seed + 1`` (B) and ``seed + 2`` (the output),
    as :func:`~driftcli.arith.matmul.matmul` does, so ``E1`` is built from the very operands
    the simulated matmul used.
    """
    parsed = [parse_matmul_spec(s) for s in specs]
    problem = checked(problem)
    need, have = matmul_bytes(*problem.shape), available_memory()
    if problem.error is None and need > have:  # a dump's 1×K and K×1e6 operands: 1e12 outputs
        nb, m, k, n = problem.shape
        problem = replace(problem, a=None, b=None, error=(
            f"a {nb}x{m}x{k}x{n} matmul takes about {_gib(need)} to measure, more than the "
            f"{_gib(have)} of memory available; leave it out with --exclude"))
    if problem.error is not None or problem.a is None or problem.b is None:
        return [AccumErrorRow(**_names(problem, s), **_NULLS, error=problem.error)
                for s in parsed]
    a, b = problem.a.to(torch.float32), problem.b.to(torch.float32)
    e0 = exact_matmul(a, b)
    cast_refs: dict[tuple[str, str], tuple[ExactProduct, float | None]] = {}
    rows = []
    for spec in parsed:
        key = (str(spec.lhs), str(spec.rhs))
        if key not in cast_refs:
            if spec.lhs is None and spec.rhs is None:
                cast_refs[key] = (e0, 0.0)
            else:
                qa = a if spec.lhs is None else cast(Tensor, quantize(a, spec.lhs, axis=-1,
                                                                      seed=seed))
                qb = b if spec.rhs is None else cast(Tensor, quantize(b, spec.rhs, axis=-2,
                                                                      seed=seed + 1))
                e1 = exact_matmul(qa, qb)
                cast_refs[key] = (e1, _cast_error(e1, e0))
        e1, cast_rel = cast_refs[key]
        c = matmul(a, b, spec, seed=seed)
        total = _compare(c, e0, spec.accumulator)
        accum = _compare(c, e1, spec.accumulator)
        bound = torch.maximum(e0.bound / ulp(spec.accumulator, e0.hi, e0.lo),
                              e1.bound / ulp(spec.accumulator, e1.hi, e1.lo))
        rows.append(AccumErrorRow(
            **_names(problem, spec), rel_error=total.rel, bias=total.bias,
            max_abs_error_ulps=total.max_ulps, mean_abs_error_ulps=total.mean_ulps,
            cast_rel_error=cast_rel, accum_rel_error=accum.rel, accum_bias=accum.bias,
            accum_max_error_ulps=accum.max_ulps,
            ref_bound_ulps=float(bound.max()) if bound.numel() else None,
            n_outputs=c.numel(), n_nonfinite=total.nonfinite, error=None))
    return rows




def accum_error(dumps: Sequence[str | Path] = (), *,
                shapes: Sequence[tuple[int, int, int]] | None = None,
                dists: Sequence[Dist | str] | None = None,
                specs: Sequence[MatmulSpec | str] = DEFAULT_SPECS, seed: int = 0,
                include: Sequence[str] = (), exclude: Sequence[str] = (),
                progress: Progress | None = None,
                execution: Execution | None = None) -> list[AccumErrorRow]:
    """Rows of ``accum-error`` for the matmuls of ``dumps`` and for synthetic operands.

    Synthetic operands are measured when ``shapes`` or ``dists`` is given, or when no dump is:
    each distribution (default ``normal``) at each shape (default 64×K×64 for K in 64, 256,
    1024; see :func:`synthetic_shapes`). Every matmul is measured under every spec; each
    matmul is a unit of ``execution`` (see :mod:`driftcli.engines`), rows in matmul order.
    """
    if not specs:
        raise DriftError("no matmul spec given; pass specs, e.g. ['acc=bfloat16,order=pairwise']")
    parsed = tuple(parse_matmul_spec(s) for s in specs)
    problems: list[Problem] = []
    if shapes is not None or dists is not None or not dumps:
        check_shapes(synthetic_shapes(shapes or ()))
        problems += synthetic_problems(synthetic_shapes(shapes or ()),
                                       dists or (Dist.NORMAL,), seed)
    if dumps:
        problems += dump_problems(dumps, include, exclude)
    units = [MatmulUnit(p, parsed, seed) for p in problems]
    per_unit = engines.run(units, measure_unit, execution, progress=progress,
                           label=lambda u: f"{u.problem.matmul} k={u.problem.shape[2]}")
    return [row for rows in per_unit for row in rows]


@dataclass(frozen=True)
class MatmulUnit:
    """One matmul under every spec: the work unit an engine runs."""

    problem: Problem
    specs: tuple[MatmulSpec, ...]
    seed: int

    def key(self) -> str:
        """Everything the unit's rows depend on: the operands by the sha256 of their bytes."""
        p = self.problem
        digest = hashlib.sha256()
        for t in (p.a, p.b):
            if t is not None:
                digest.update(t.detach().contiguous().cpu().numpy().tobytes())
        return (f"accum|{p.source}|{p.matmul}|{p.shape}|{p.error}|{digest.hexdigest()}|"
                f"{[str(s) for s in self.specs]}|{self.seed}")


def measure_unit(unit: MatmulUnit) -> list[AccumErrorRow]:
    """The rows of one matmul unit (:func:`measure`)."""
    return measure(unit.problem, unit.specs, seed=unit.seed)


def summarize(rows: Sequence[AccumErrorRow], path: Path) -> dict[str, Any]:
    """Per spec over every measured matmul: median and max rel_error, the largest mean and max
    ulps, the median bias and the worst matmul; specs ordered worst (largest max rel_error)
    first."""
    by_spec: dict[str, list[AccumErrorRow]] = {}
    for r in rows:
        if r.error is None and r.rel_error is not None:
            by_spec.setdefault(r.spec, []).append(r)
    specs: list[dict[str, Any]] = []
    for spec, group in by_spec.items():
        worst = max(group, key=lambda r: r.rel_error or 0.0)
        biases = [r.bias for r in group if r.bias is not None]
        specs.append({
            "spec": spec, "label": spec_label(spec), "matmuls": len(group),
            "median_rel_error": statistics.median(r.rel_error or 0.0 for r in group),
            "max_rel_error": worst.rel_error,
            "mean_abs_error_ulps": max(r.mean_abs_error_ulps or 0.0 for r in group),
            "max_abs_error_ulps": max(r.max_abs_error_ulps or 0.0 for r in group),
            "median_bias": statistics.median(biases) if biases else None,
            "worst": {"source": worst.source, "matmul": worst.matmul, "m": worst.m,
                      "k": worst.k, "n": worst.n, "rel_error": worst.rel_error}})
    specs.sort(key=lambda s: s["max_rel_error"], reverse=True)
    errors = list({(r.source, r.matmul): {"source": r.source, "matmul": r.matmul,
                                          "error": r.error}
                   for r in rows if r.error is not None}.values())
    return {"table": str(path), "measure": AccumErrorRow.TABLE,
            "headline": AccumErrorRow.HEADLINE, "rows": len(rows), "specs": specs,
            "errors": errors}
