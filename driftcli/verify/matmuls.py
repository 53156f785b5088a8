"""The ``matmul`` suite: simulated matmuls accumulating in a format against the oracle's exact
dot products."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch

from driftcli import oracle
from driftcli.arith.blockfma import FMAUnit
from driftcli.arith.matmul import MatmulSpec, Order, input_emin, matmul, matmul_spec
from driftcli.records.cast import Cast
from driftcli.records.formats import FORMATS, Exact, Format
from driftcli.records.modes import Rounding
from driftcli.verify.blocks import oracle_cast_exact
from driftcli.verify.compare import SEED, Outcome, Plan, exact_of_float, judge, to_float

Tensor = torch.Tensor

MATMUL_ACCUMULATORS = ("float32", "bfloat16", "float16", "e8m13", "float8_e5m2")
"""Accumulator formats whose matmuls are checked (and any unregistered eXmY asked for)."""
MATMUL_CASTS = ("none", "mxfp8_e4m3", "mxfp4_e2m1", "nvfp4")
"""Operand casts (both operands alike) under every order and accumulator rounding."""
MATMUL_BLOCK_CASTS = ("mxfp8_e4m3", "mxfp4_e2m1")
"""Operand casts also checked with ``scale=block``."""
MATMUL_ORDERS = ("sequential", "pairwise", "chunked:16", "chunked:64")
MATMUL_BLOCK_ORDERS = ("sequential", "pairwise", "chunked:64")
MATMUL_NATIVE_CASTS = ("none", "mxfp8_e4m3", "mxfp4_e2m1")
MATMUL_SHAPES = ((3, 4, 1), (2, 3, 7), (4, 3, 33), (3, 4, 96), (2, 3, 200), (3, 3, 256))
"""Seeded random matmuls as (M, N, K), in the full plan."""
QUICK_MATMUL_SHAPES = ((2, 3, 7), (2, 2, 70))
MATMUL_CONSTRUCTED_K = 256
"""K of the constructed cases (cancellation, swamping, overflow); 96 in the quick plan."""
BLOCKFMA_ACCUMULATORS = ("float32", "bfloat16", "float16", "e8m13")
"""Accumulator formats whose block-FMA matmuls are checked."""
BLOCKFMA_UNITS = ("1:40", "8:24:e-132", "8:9:i2", "16:25:e-133",
                  "32:13:e-133", "32:25:i2:e-133")
"""Block-FMA units checked (``SIZE:KEPT[:iK][:eMIN]``): the published models' shapes, a unit of
one product, narrow ones, interleaved ones."""
BLOCKFMA_CASTS = ("none", "float8_e4m3fn", "fp16")
"""Operand casts of the block-FMA cells: float32 values (48-bit products), FP8 (subnormal inputs
keep the format's smallest exponent) and fp16."""
BLOCKFMA_PROMOTIONS = ("blockfma", "blockfma:64")
BLOCKFMA_BLOCK_UNITS = ("8:9:i2", "16:25", "32:13")
"""Units checked with MXFP8 operands under ``scale=block`` (each scale block promoted)."""


@dataclass(frozen=True)
class MatmulCase:
    """One matmul to check: float32 operands ``a`` (M, K) and ``b`` (K, N)."""

    name: str
    a: Tensor
    b: Tensor


def _matmul_random(name: str, m: int, n: int, k: int, gen: torch.Generator) -> MatmulCase:
    """Normal values times a random power of two per element (2**-6..2**6), so that sums
    cancel and terms differ in size."""
    def draw(rows: int, cols: int) -> Tensor:
        mags = torch.exp2(torch.randint(-6, 7, (rows, cols), generator=gen).float())
        return torch.randn(rows, cols, generator=gen) * mags

    return MatmulCase(name, draw(m, k), draw(k, n))


def _matmul_constructed(k: int) -> MatmulCase:
    """Rows built to expose the order (B's columns: ones, alternating signs, a ramp):

    0. swamping: one large product first, then small ones (each small one is lost in a narrow
       sequential accumulator, kept when small ones are summed among themselves first);
    1. cancellation: +L first, -L in the last block, small values between;
    2. small values of both signs around a large one in the middle;
    3. a constant 300 everywhere: the sum overflows float16 and E5M2 accumulators.

    The large values sit alone in their 32-element block (the rest of it zero), so block
    scales keep the small values of the other blocks.
    """
    gen = torch.Generator().manual_seed(SEED + 3)
    large = 1536.0
    small = 1 + torch.randint(0, 8, (k,), generator=gen).float() / 8
    signs = torch.where(torch.rand(k, generator=gen) < 0.5, -1.0, 1.0)
    a = torch.zeros(4, k)
    a[0] = small
    a[0, :32] = 0
    a[0, 0] = large
    a[1] = small
    a[1, :32] = 0
    a[1, k - 32:] = 0
    a[1, 0], a[1, k - 32] = large, -large
    a[2] = small * signs
    middle = (k // 64) * 32
    a[2, middle:middle + 32] = 0
    a[2, middle] = large
    a[3] = 300.0
    b = torch.stack([torch.ones(k), torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0),
                     1 + torch.arange(k).float() % 4 / 4], dim=1)
    return MatmulCase(f"constructed K={k}", a, b)


def _matmul_edges(gen: torch.Generator) -> list[MatmulCase]:
    """``tiny``: products near 2**-125 of both signs, whose partial sums fall into the
    subnormal range of float32 and below (to zero in float16 and E5M2); ``huge``: products near
    2**125 whose sums pass float32's max (inf, or max under rtz)."""
    def few_bits(rows: int, cols: int, exponent: int) -> Tensor:
        mags = 1 + torch.randint(0, 8, (rows, cols), generator=gen).float() / 8
        signs = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
        return mags * signs * 2.0**exponent

    return [MatmulCase("tiny 3x64x3", few_bits(3, 64, -62), few_bits(64, 3, -63)),
            MatmulCase("huge 2x128x2", few_bits(2, 128, 62).abs(), few_bits(128, 2, 63).abs())]


def _matmul_integers(name: str, m: int, n: int, k: int, gen: torch.Generator) -> MatmulCase:
    """Integers in -15..15: under the native casts every product and partial sum is a float32
    (at most 22 significant bits), so every order of float32 additions gives the exact sum."""
    return MatmulCase(name, torch.randint(-15, 16, (m, k), generator=gen).float(),
                      torch.randint(-15, 16, (k, n), generator=gen).float())


def matmul_cases(plan: Plan, native: bool = False) -> list[MatmulCase]:
    """The seeded random and constructed matmuls; ``native``: the integer ones."""
    gen = torch.Generator().manual_seed(plan.seed + 5)
    shapes = QUICK_MATMUL_SHAPES if plan.quick else MATMUL_SHAPES
    if native:
        return [_matmul_integers(f"integers {m}x{k}x{n}", m, n, k, gen) for m, n, k in shapes]
    cases = [_matmul_random(f"random {m}x{k}x{n}", m, n, k, gen) for m, n, k in shapes]
    edges = [] if plan.quick else _matmul_edges(gen)
    return [*cases, *edges, _matmul_constructed(96 if plan.quick else MATMUL_CONSTRUCTED_K)]


def _element(case: str, n: int, i: int) -> str:
    """Output element ``i`` of an ``m x n`` case, named."""
    return f"{case} element ({i // n}, {i % n})"


def matmul_specs(fmt: Format, plan: Plan) -> list[MatmulSpec]:
    """The matmul specs checked with accumulator ``fmt`` (see the module docs)."""
    modes = (Rounding.RNE, Rounding.RTZ)
    casts: tuple[str, ...]
    orders: tuple[str, ...]
    block_orders: tuple[str, ...]
    block_casts: tuple[str, ...]
    if plan.quick:
        casts, orders, block_orders = ("none", "nvfp4"), MATMUL_ORDERS[:3], ("sequential",)
        block_casts = MATMUL_BLOCK_CASTS[:1]
    else:
        casts, orders, block_orders = MATMUL_CASTS, MATMUL_ORDERS, MATMUL_BLOCK_ORDERS
        block_casts = MATMUL_BLOCK_CASTS
    specs = [matmul_spec(lhs=c, rhs=c, accumulator=fmt, acc_rounding=mode, order=order)
             for c in casts for order in orders for mode in modes]
    specs += [matmul_spec(lhs=c, rhs=c, accumulator=fmt, acc_rounding=mode, order=order,
                          scale_application="block")
              for c in block_casts for order in block_orders for mode in modes]
    if not plan.quick:  # mixed operands, and an output cast
        specs.append(matmul_spec(lhs="mxfp8_e4m3", rhs="nvfp4", accumulator=fmt,
                                 order="pairwise"))
        specs.append(matmul_spec(lhs="mxfp4_e2m1", rhs="mxfp4_e2m1", accumulator=fmt,
                                 acc_rounding="rtz", order="chunked:64", out="bf16"))
    if fmt.name in BLOCKFMA_ACCUMULATORS:
        specs += blockfma_specs(fmt, plan)
    if fmt == FORMATS["float32"]:
        native = MATMUL_NATIVE_CASTS[:2] if plan.quick else MATMUL_NATIVE_CASTS
        specs += [matmul_spec(lhs=c, rhs=c, order="native") for c in native]
        specs.append(matmul_spec(lhs=native[-1], rhs=native[-1], order="native", out="bf16"))
    return specs


def blockfma_specs(fmt: Format, plan: Plan) -> list[MatmulSpec]:
    """The block-FMA specs checked with accumulator ``fmt`` [quick: two FP8 units, no
    promotion]."""
    modes = (Rounding.RNE, Rounding.RTZ)
    if plan.quick:
        return [matmul_spec(lhs="float8_e4m3fn", rhs="float8_e4m3fn", accumulator=fmt,
                            acc_rounding=mode, order="blockfma", unit=unit)
                for unit in ("32:13:e-133", "32:25:i2:e-133") for mode in modes]
    specs = [matmul_spec(lhs=c, rhs=c, accumulator=fmt, acc_rounding=mode, order=order,
                         unit=unit)
             for c in BLOCKFMA_CASTS for unit in BLOCKFMA_UNITS for order in BLOCKFMA_PROMOTIONS
             for mode in modes]
    specs += [matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator=fmt,
                          acc_rounding=mode, order="blockfma:32", unit=unit,
                          scale_application="block")
              for unit in BLOCKFMA_BLOCK_UNITS for mode in modes]
    return specs


class _MatmulOracle:
    """The oracle's matmuls, with each case's cast operands and products computed once."""

    def __init__(self) -> None:
        self._operands: dict[tuple[str, str, str], tuple[list[Exact], list[Exact]]] = {}
        self._products: dict[tuple[str, str, str], list[list[Exact]]] = {}

    def operand(self, case: MatmulCase, side: str, c: Cast | None) -> tuple[list[Exact],
                                                                          list[Exact]]:
        """Rows along K (A's rows, B's columns) flattened: values and each one's scale."""
        key = (case.name, side, str(c))
        if key not in self._operands:
            rows = case.a if side == "lhs" else case.b.T.contiguous()
            if c is None:
                values = [exact_of_float(v) for v in rows.flatten().tolist()]
                self._operands[key] = values, [Exact.of(1)] * len(values)
            else:
                self._operands[key] = oracle_cast_exact(rows, c)
        return self._operands[key]

    def terms(self, case: MatmulCase, spec: MatmulSpec) -> list[list[Exact]]:
        """The terms of every output element (row-major): products, or block terms."""
        (m, k), n = case.a.shape, case.b.shape[1]
        av, ascale = self.operand(case, "lhs", spec.lhs)
        bv, bscale = self.operand(case, "rhs", spec.rhs)
        if spec.block:
            size = spec.block
            ea = [oracle.scaling.times(v, 1 / s.mag) for v, s in zip(av, ascale, strict=True)]
            eb = [oracle.scaling.times(v, 1 / s.mag) for v, s in zip(bv, bscale, strict=True)]
            return [oracle.matmul.block_terms(ea[i * k:(i + 1) * k], eb[j * k:(j + 1) * k],
                                       ascale[i * k:(i + 1) * k:size],
                                       bscale[j * k:(j + 1) * k:size], size)
                    for i in range(m) for j in range(n)]
        key = (case.name, str(spec.lhs), str(spec.rhs))
        if key not in self._products:
            self._products[key] = [
                oracle.matmul.products(av[i * k : (i + 1) * k], bv[j * k : (j + 1) * k])
                for i in range(m)
                for j in range(n)
            ]
        return self._products[key]

    def blockfma(self, case: MatmulCase, spec: MatmulSpec) -> list[Exact]:
        """Every output element of ``case`` under a block-FMA ``spec``, row-major."""
        (m, k), n = case.a.shape, case.b.shape[1]
        av, ascale = self.operand(case, "lhs", spec.lhs)
        bv, bscale = self.operand(case, "rhs", spec.rhs)
        size = spec.block
        if size:  # the unit sums element values; each block's scales meet its partial sum
            av = [oracle.scaling.times(v, 1 / s.mag) for v, s in zip(av, ascale, strict=True)]
            bv = [oracle.scaling.times(v, 1 / s.mag) for v, s in zip(bv, bscale, strict=True)]
        u = cast(FMAUnit, spec.unit)
        unit = oracle.blockfma.Unit(u.size, u.kept_bits, u.min_exp, u.interleave)
        emin = (input_emin(spec.lhs, bool(size)), input_emin(spec.rhs, bool(size)))
        out = []
        for i in range(m):
            for j in range(n):
                scales = None if not size else [
                    (x.mag, y.mag) for x, y in zip(ascale[i * k:(i + 1) * k:size],
                                                   bscale[j * k:(j + 1) * k:size], strict=True)]
                out.append(oracle.blockfma.fma_dot(
                    av[i * k:(i + 1) * k], bv[j * k:(j + 1) * k], unit, spec.accumulator,
                    spec.acc_rounding, emin, FORMATS["float32"], spec.chunk, scales=scales))
        return out

    def result(self, case: MatmulCase, spec: MatmulSpec) -> list[Exact]:
        """Every output element of ``case`` under ``spec``, row-major."""
        if spec.order is Order.BLOCKFMA:
            out = self.blockfma(case, spec)
            if spec.out is not None:
                c = spec.out
                out = [
                    oracle.rounding.round_exact(c.format, v, c.rounding, c.overflow) for v in out
                ]
            return out
        order = spec.order.value
        fmt, mode = spec.accumulator, spec.acc_rounding
        if order == "native":  # the cases make every float32 order exact: sequential stands
            order, fmt, mode = "sequential", FORMATS["float32"], Rounding.RNE
        chunk = spec.chunk // spec.block if spec.block else spec.chunk
        out = [oracle.matmul.dot(t, order, fmt, mode, chunk, FORMATS["float32"])
               for t in self.terms(case, spec)]
        if spec.out is not None:  # an unscaled output cast (checked specs use no other)
            c = spec.out
            out = [oracle.rounding.round_exact(c.format, v, c.rounding, c.overflow) for v in out]
        return out


def check_matmul(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Simulated matmuls accumulating in ``fmt`` against the oracle's exact dot products."""
    registered = set(FORMATS)  # iterating the registry gives the named formats only
    if fmt.name not in MATMUL_ACCUMULATORS and (fmt.name in registered or fmt.integer
                                                or not fmt.signed):
        return
    ref = _MatmulOracle()
    cases = matmul_cases(plan)
    native_cases = matmul_cases(plan, native=True)
    for spec in matmul_specs(fmt, plan):
        out = Outcome(fmt.name, "matmul", str(spec), spec.acc_rounding.value, "ieee")
        for case in native_cases if spec.order.value == "native" else cases:
            expected = torch.tensor([to_float(v) for v in ref.result(case, spec)],
                                    dtype=torch.float64)
            got = matmul_fast(case.a, case.b, spec).flatten()
            n = case.b.shape[1]
            judge(out, expected, got, partial(_element, case.name, n))
        yield out


def matmul_fast(a: Tensor, b: Tensor, spec: MatmulSpec) -> Tensor:
    """The fast path's matmul."""
    return matmul(a, b, spec)

