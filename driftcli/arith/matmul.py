"""Simulated matmuls: operand casts along K, exact products, a stated accumulator and order.

``C = A·B`` with ``A`` of shape ``(..., M, K)`` and ``B`` of shape ``(..., K, N)``
(leading dimensions broadcast as in ``torch.matmul``) is computed as:

1. each operand is taken as float32 (a float64 tensor is rounded to nearest even first;
   bfloat16 and float16 widen exactly), then cast with its :class:`~driftcli.records.cast.Cast`
   along K: A along its last axis, B along its second-to-last (rows of A's blocks and
   columns of B's blocks run along K);
2. every product of two cast operands is exact: each operand is a float32 value (at most
   24 significant bits, exponents within 2**-149..2**128), so a product has at most 48
   significant bits and lies within float64's normal range, and it is formed in float64;
3. the terms (the products, or with ``scale_application=block`` one scaled partial dot
   product per block) are summed by an accumulator of the stated format, which rounds every
   addition once, in the stated order; each addition is the exact sum (float64 TwoSum, the
   residual entering the rounding as a sticky bit, :func:`driftcli.casts.rounding.add`);
4. the optional output cast is applied to the result along its last axis (N).

Order ``blockfma`` replaces step 3 with a tensor core's block-FMA unit
(:mod:`driftcli.arith.blockfma`): groups of products aligned to their largest exponent, cut to
the unit's kept bits, summed exactly and rounded once into the accumulator, chained, with
promotion into a float32 master sum every ``N`` products for ``blockfma:N``.

The spec, its checks and its grammar are :mod:`driftcli.arith.matmulspec` (its names are
importable from here too); :func:`accumulate` is steps 3 (or the block-FMA unit) on operands
already cast, for callers that cast them themselves (:mod:`driftcli.arith.autograd`).

docs/arithmetic.md states every rule exactly; :mod:`driftcli.oracle` is the reference that
``drift verify-formats`` checks this module against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from driftcli import kernels
from driftcli.arith.blockfma import C_EMIN, Accumulation, FMAUnit, fma_dot
from driftcli.arith.matmulspec import (
    ACC_ROUNDINGS,
    DOUBLE_BITS,
    FLOAT32,
    MASTER,
    MatmulSpec,
    MatmulSpecError,
    Order,
    ScaleApplication,
    element_bits,
    matmul_spec,
    parse_matmul_spec,
    parse_order,
)
from driftcli.casts import rounding
from driftcli.casts.quantization import QuantInfo, quantize
from driftcli.casts.twosum import two_sum
from driftcli.errors import DriftError
from driftcli.kernels import jit
from driftcli.records.cast import Cast
from driftcli.records.formats import Format
from driftcli.records.modes import DEFAULT_SR_BITS, Granularity, Overflow, Rounding

__all__ = [
    "ACC_ROUNDINGS",
    "DOUBLE_BITS",
    "FLOAT32",
    "FLOAT32_HEADROOM",
    "MASTER",
    "PAIRWISE_ELEMENTS",
    "STEPS_PER_CALL",
    "MatmulSpec",
    "MatmulSpecError",
    "Order",
    "ScaleApplication",
    "accumulate",
    "element_bits",
    "input_emin",
    "matmul",
    "matmul_spec",
    "parse_matmul_spec",
    "parse_order",
    "significant_bits",
    "truncate_float32",
]
"""The spec's names (:mod:`driftcli.arith.matmulspec`) with the execution's: callers import
either from here."""

Tensor = torch.Tensor


PAIRWISE_ELEMENTS = 1 << 22
"""Products held at once by the pairwise order (rows of C are processed in groups this big)."""


def _check_operands(a: Tensor, b: Tensor) -> None:
    for name, t in (("A", a), ("B", b)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            raise DriftError(f"matmul operand {name} must be a floating-point tensor, not "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() < 2:
            raise DriftError(f"matmul operand {name} has shape {tuple(t.shape)}; it needs at "
                             "least two dimensions (use unsqueeze for a vector)")
    if a.shape[-1] != b.shape[-2]:
        raise DriftError(f"matmul shapes {tuple(a.shape)} and {tuple(b.shape)} do not agree "
                         f"along K ({a.shape[-1]} != {b.shape[-2]})")
    try:
        torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise DriftError(f"matmul batch dimensions {tuple(a.shape[:-2])} and "
                         f"{tuple(b.shape[:-2])} do not broadcast") from None


def _cast_operand(x: Tensor, c: Cast | None, axis: int, seed: int | None,
                  want_scales: bool) -> tuple[Tensor, Tensor | None]:
    """The cast values (float32) and, when asked, the per-block scales (float64)."""
    if c is None:
        return x, None
    if want_scales:
        info = cast(QuantInfo, quantize(x, c, axis=axis, seed=seed, return_info=True))
        return info.values, info.scales
    return cast(Tensor, quantize(x, c, axis=axis, seed=seed)), None


def _sr_seeds(spec: MatmulSpec, seed: int | None) -> tuple[int | None, int | None, int | None]:
    """Seeds of the lhs, rhs and output casts: ``seed``, ``seed + 1``, ``seed + 2``."""
    for side, c in (("lhs", spec.lhs), ("rhs", spec.rhs), ("out", spec.out)):
        if c is not None and c.rounding is Rounding.SR and seed is None:
            raise DriftError(f"the {side} cast {c} rounds stochastically; pass "
                             "matmul(..., seed=S) to draw its random bits reproducibly")
    return (seed, None if seed is None else seed + 1, None if seed is None else seed + 2)


def matmul(a: Tensor, b: Tensor, spec: MatmulSpec | str, *, seed: int | None = None) -> Tensor:
    """``A·B`` computed as ``spec`` says; a float32 tensor of shape ``(..., M, N)``.

    ``a`` is ``(..., M, K)`` and ``b`` is ``(..., K, N)``; leading dimensions broadcast as in
    ``torch.matmul``. Stochastic casts draw their random bits from ``seed`` (the lhs),
    ``seed + 1`` (the rhs) and ``seed + 2`` (the output cast).
    """
    spec = parse_matmul_spec(spec)
    _check_operands(a, b)
    seeds = _sr_seeds(spec, seed)
    block = spec.scale_application is ScaleApplication.BLOCK
    qa, sa = _cast_operand(a.to(torch.float32), spec.lhs, -1, seeds[0], block)
    qb, sb = _cast_operand(b.to(torch.float32), spec.rhs, -2, seeds[1], block)
    c = accumulate(qa, qb, spec, lhs_scales=sa, rhs_scales=sb)
    if spec.out is not None:
        c = cast(Tensor, quantize(c, spec.out, axis=-1, seed=seeds[2]))
    return c


def accumulate(qa: Tensor, qb: Tensor, spec: MatmulSpec, *, lhs_scales: Tensor | None = None,
               rhs_scales: Tensor | None = None) -> Tensor:
    """``qa·qb`` of operands already cast by ``spec``'s casts (float32 dequantized values,
    ``(..., M, K)`` and ``(..., K, N)``): ``spec``'s accumulation in its order, without the
    casts and without the output cast; a float32 tensor of shape ``(..., M, N)``.

    Under ``scale=block`` the terms need the casts' per-block scales, as
    :func:`~driftcli.casts.quantization.quantize` returns them (``return_info=True``): the caller
    that cast the operands passes them, and nothing is cast a second time."""
    block = spec.scale_application is ScaleApplication.BLOCK
    if block and spec.order is not Order.NATIVE and (lhs_scales is None or rhs_scales is None):
        raise MatmulSpecError(f"{spec} applies block scales: accumulate needs both operands' "
                              "block scales (quantize(..., return_info=True).scales)")
    batch = torch.broadcast_shapes(qa.shape[:-2], qb.shape[:-2])
    (M, K), N = qa.shape[-2:], qb.shape[-1]
    if spec.order is Order.BLOCKFMA:
        return _blockfma(qa, qb, lhs_scales, rhs_scales, spec, batch)
    if spec.order is Order.NATIVE:
        return torch.matmul(qa.expand(*batch, M, K), qb.expand(*batch, K, N))
    wide = not _float32_exact(qa, qb, spec)
    a_shape, b_shape = qa.shape, qb.shape
    qa, qb = qa.expand(*batch, M, K), qb.expand(*batch, K, N)
    terms: _Terms
    if block:
        terms = _BlockTerms(qa, qb, cast(Tensor, lhs_scales), cast(Tensor, rhs_scales), a_shape,
                            b_shape, spec.block)
    else:
        terms = _ProductTerms(qa, qb, torch.float64 if wide else torch.float32)
    return _accumulate(terms, spec).to(torch.float32)


def input_emin(c: Cast | None, elements: bool) -> int:
    """The exponent floor of an operand the block-FMA unit reads: its format's smallest normal
    exponent where the unit sees the format's own values (an unscaled cast, or element values
    under block scale application), else a float32's (dequantized values, no cast)."""
    if c is not None and (elements or c.scaling.granularity is Granularity.NONE):
        return c.format.emin
    return C_EMIN


def _blockfma(qa: Tensor, qb: Tensor, sa: Tensor | None, sb: Tensor | None, spec: MatmulSpec,
              batch: torch.Size) -> Tensor:
    """Order ``blockfma``: every output element's products through the spec's unit. Under
    block scale application the unit sums element values (``q / s``, exact: powers of two)
    and each scale block's partial sum, times its two scales, is promoted."""
    (M, K), N = qa.shape[-2:], qb.shape[-1]
    if K == 0:  # no products: every result is the cleared chain, +0 (as every other order)
        return torch.zeros(*batch, M, N, device=qa.device)
    rows_a = qa.expand(*batch, M, K).reshape(-1, K)
    rows_b = qb.expand(*batch, K, N).transpose(-1, -2).reshape(-1, K)
    block = spec.block
    scales = None
    if block:
        nb = -(-K // block)
        per_a = cast(Tensor, sa).reshape(*qa.shape[:-1], nb).expand(*batch, M, nb).reshape(-1, nb)
        per_b = cast(Tensor, sb).reshape(*qb.shape[:-2], N, nb).expand(*batch, N, nb) \
            .reshape(-1, nb)
        rows_a = rows_a.double() / per_a.double().repeat_interleave(block, dim=1)[:, :K]
        rows_b = rows_b.double() / per_b.double().repeat_interleave(block, dim=1)[:, :K]
        scales = (per_a, per_b)
    how = Accumulation(cast(FMAUnit, spec.unit), spec.accumulator, spec.acc_rounding,
                       input_emin(spec.lhs, bool(block)), input_emin(spec.rhs, bool(block)),
                       spec.chunk)
    out = fma_dot(rows_a, rows_b, how, scales=scales,
                  shape=(math.prod(batch), M, N))
    return out.to(torch.float32).reshape(*batch, M, N)


# The accumulator adds terms t[k]. Each is handed over as two factors whose product is the term
# exactly (a product of operands; or a block term times 1), so that a step multiplies
# and accumulates in one pass without storing the products.

class _Terms:
    """The terms the accumulator sums, indexed along K (products or per-block terms)."""

    count: int
    shape: torch.Size
    """The shape of one term: ``(*batch, M, N)``."""
    dtype: torch.dtype
    """The working precision: float32 where every product and sum is exact in it, else
    float64."""

    def factors(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Two tensors whose product is the terms ``index`` (shape ``(U,)`` or ``(U, C)``):
        ``(U, *shape)`` or ``(U, C, *shape)`` after broadcasting."""
        raise NotImplementedError

    def rows(self, start: int, stop: int) -> _Terms:
        """The same terms for rows ``start:stop`` of the output only."""
        raise NotImplementedError

    def sources(self) -> tuple[Tensor, ...]:
        """The tensors the terms are read from."""
        raise NotImplementedError

    def operands(self) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """The terms in the numba kernel's layout (:func:`driftcli.kernels.jit.accumulate`):
        ``a`` ``(rows_a, K)``, ``b`` ``(rows_b, N)``, each batch's first row of ``a`` (in
        matrices of ``m`` rows) and of ``b`` (in matrices of K rows), and ``m``."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the terms live (the accumulator lives there too)."""
        raise NotImplementedError

    def all(self) -> Tensor:
        """Every term, stacked along a new last axis."""
        index = torch.arange(self.count, device=self.device)
        a, b = self.factors(index)
        return (a * b).movedim(0, -1)


def _lead(t: Tensor, dims: int) -> Tensor:
    """The last ``dims`` axes of ``t`` moved to the front, in order."""
    return t.movedim(tuple(range(-dims, 0)), tuple(range(dims)))


class _ProductTerms(_Terms):
    """``t[k] = a[..., m, k] * b[..., k, n]``: exact in float64 always (two float32 values have
    at most 48 significant bits together), in float32 where :func:`_float32_exact` says so."""

    def __init__(self, qa: Tensor, qb: Tensor, dtype: torch.dtype) -> None:
        self.a = qa.to(dtype)  # (..., M, K)
        self.bt = qb.to(dtype).transpose(-1, -2)  # (..., N, K)
        self.count = qa.shape[-1]
        self.dtype = dtype
        self.shape = torch.Size([*qa.shape[:-1], qb.shape[-1]])

    @property
    def device(self) -> torch.device:
        return self.a.device

    def factors(self, index: Tensor) -> tuple[Tensor, Tensor]:
        a = _lead(self.a[..., index], index.dim())  # (U[, C], ..., M)
        b = _lead(self.bt[..., index], index.dim())  # (U[, C], ..., N)
        return a[..., :, None], b[..., None, :]

    def rows(self, start: int, stop: int) -> _Terms:
        return _ProductTerms(self.a[..., start:stop, :], self.bt.transpose(-1, -2), self.dtype)

    def sources(self) -> tuple[Tensor, ...]:
        return self.a, self.bt

    def operands(self) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        a, a_of = _distinct(self.a)
        b, b_of = _distinct(self.bt.transpose(-1, -2))
        return a.reshape(a.shape[0] * a.shape[1], a.shape[2]), \
            b.reshape(b.shape[0] * b.shape[1], b.shape[2]), a_of, b_of, self.shape[-2]


def _distinct(t: Tensor) -> tuple[Tensor, Tensor]:
    """The matrices of ``t`` (``(*batch, R, C)``) without the copies broadcasting made (a
    batch axis of stride 0 is one matrix), contiguous as ``(D, R, C)``, and the index of each
    batch's matrix among them."""
    batch = t.shape[:-2]
    keep = tuple(slice(0, 1) if t.stride(d) == 0 else slice(None) for d in range(len(batch)))
    base = t[keep]
    count = math.prod(base.shape[:-2])
    index = torch.arange(count).reshape(base.shape[:-2]).expand(batch)
    return base.contiguous().reshape(count, *t.shape[-2:]), index.reshape(-1)


class _BlockTerms(_Terms):
    """``t[j] = sa[m, j] * sb[n, j] * sum over block j of ea[m, k] * eb[k, n]``, the element
    values ``e = q / s`` (exact: the scales are powers of two); the partial dot product is
    exact in float64 by the bit budget MatmulSpec checks, and a zero one is +0."""

    def __init__(self, qa: Tensor, qb: Tensor, sa: Tensor, sb: Tensor, a_shape: torch.Size,
                 b_shape: torch.Size, block: int) -> None:
        K = qa.shape[-1]
        nb = -(-K // block)
        pad = nb * block - K
        # scales in the order of to_blocks: A's blocks are (..., M, nb), B's (..., N, nb)
        sa = sa.reshape(*a_shape[:-1], nb)
        sb = sb.reshape(*b_shape[:-2], b_shape[-1], nb)
        # element values: a power-of-two scale divides out exactly (NaN for a NaN block)
        ea = qa.double() / sa.repeat_interleave(block, dim=-1)[..., :K]
        eb = qb.double() / sb.repeat_interleave(block, dim=-1)[..., :K].transpose(-1, -2)
        ea = torch.nn.functional.pad(ea, (0, pad))  # zeros: a shorter last block
        eb = torch.nn.functional.pad(eb, (0, 0, 0, pad))
        batch = qa.shape[:-2]
        M, N = qa.shape[-2], qb.shape[-1]
        # (..., nb, M, block) @ (..., nb, block, N): every partial sum exact, in any order
        blocks_a = ea.reshape(*batch, M, nb, block).movedim(-2, -3)
        blocks_b = eb.reshape(*batch, nb, block, N)
        dots = torch.matmul(blocks_a, blocks_b)  # (..., nb, M, N)
        dots = torch.where(dots == 0, torch.zeros_like(dots), dots)  # +0 for a zero dot
        scale = sa.expand(*batch, M, nb).movedim(-1, -2)[..., :, :, None] * \
            sb.expand(*batch, N, nb).movedim(-1, -2)[..., :, None, :]
        self._init((dots * scale).movedim(-3, -1))  # powers of two: exact

    def _init(self, terms: Tensor) -> None:
        self.terms = terms  # (..., M, N, nb)
        self.count = terms.shape[-1]
        self.shape = terms.shape[:-1]
        self.dtype = torch.float64
        self.one = torch.ones((), dtype=torch.float64, device=terms.device)

    @property
    def device(self) -> torch.device:
        return self.terms.device

    def factors(self, index: Tensor) -> tuple[Tensor, Tensor]:
        picked = _lead(self.terms[..., index], index.dim())  # (U[, C], ..., M, N)
        ones = self.one.reshape([1] * picked.dim())
        return picked, ones.expand(picked.shape[0], *ones.shape[1:])

    def rows(self, start: int, stop: int) -> _Terms:
        part = _BlockTerms.__new__(_BlockTerms)
        part._init(self.terms[..., start:stop, :, :])
        return part

    def sources(self) -> tuple[Tensor, ...]:
        return (self.terms,)

    def operands(self) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        # each output row its own "batch" of one row: its terms times 1, as factors() has them
        rows = math.prod(self.shape[:-1])
        by_row = self.terms.movedim(-1, -2).reshape(rows * self.count, self.shape[-1])
        ones = torch.ones(1, self.count, dtype=torch.float64)
        return ones, by_row, torch.zeros(rows, dtype=torch.int64), torch.arange(rows), 1


def significant_bits(c: Cast | None) -> int:
    """At most how many significant bits a value cast by ``c`` has: the element format's
    precision under no scaling or a power-of-two scale, else (real-valued scales, or no cast)
    a float32's 24."""
    if c is None:
        return 24
    rule = c.scaling.rule
    if c.scaling.granularity is not Granularity.NONE and (rule is None or not rule.power_of_two):
        return 24
    fmt = c.format
    return fmt.bits - 1 if fmt.integer else min(24, fmt.mbits + 1)


FLOAT32_HEADROOM = 126
"""log2 of a bound that keeps every float32 partial sum finite with room to spare."""


def _float32_exact(qa: Tensor, qb: Tensor, spec: MatmulSpec) -> bool:
    """Whether float32 arithmetic computes every product and every accumulator step exactly:
    the operands' significant bits add up to at most 24; every nonzero product is at least
    2**-126 (no float32 subnormal, so no bit is lost); nothing is NaN or inf; and no partial
    sum can reach float32's overflow (where TwoSum stops being exact), bounded by
    ``K * max|a| * max|b| * (1 + 2**-mbits)**K`` (each rounding grows a sum by at most one ulp);
    and the accumulator is laid out as float32 or has fewer mantissa bits than float32.
    Otherwise the work is done in float64, where products are always exact."""
    if qa.numel() == 0 or qb.numel() == 0:
        return True
    if significant_bits(spec.lhs) + significant_bits(spec.rhs) > 24:
        return False
    acc = spec.accumulator
    if not _float32_layout(acc) and acc.mbits >= FLOAT32.mbits:
        return False  # the kernel's sticky residual needs a bit of float32 below the format
    fa, fb = qa.abs().double(), qb.abs().double()
    if not (bool(torch.isfinite(fa).all()) and bool(torch.isfinite(fb).all())):
        return False
    big = float(fa.max()) * float(fb.max())
    if big == 0:
        return True
    small = float(torch.where(fa > 0, fa, torch.inf).min()) * float(
        torch.where(fb > 0, fb, torch.inf).min())
    K = qa.shape[-1]
    growth = K * math.log2(1 + 2.0 ** -spec.accumulator.mbits)
    return small >= 2.0 ** -126 and math.log2(K * big) + growth < FLOAT32_HEADROOM


@dataclass(frozen=True)
class _Rule:
    """How one accumulator step rounds."""

    target: rounding.Target
    """The rounding kernel's constants for the accumulator format."""
    rounding: Rounding
    wide: bool
    """float64 working precision (else float32)."""
    drop: int | None
    """For a format laid out as float32 (8 exponent bits, bias 127, IEEE specials, subnormals)
    with fewer mantissa bits: how many float32 mantissa bits it drops. None: the generic
    kernel."""
    numba: bool = False
    """Whether the order's whole accumulation runs as the numba kernel (as
    :func:`_accumulate` found, asking :func:`driftcli.kernels.numba_runs` once): each order's
    function then hands its work to it, so that whatever runs as an order runs on the chosen
    back-end."""


def _float32_layout(fmt: Format) -> bool:
    return (fmt.ebits == FLOAT32.ebits and fmt.bias == FLOAT32.bias and fmt.has_inf
            and fmt.has_subnormals and not fmt.integer and fmt.signed
            and fmt.nan is FLOAT32.nan and fmt.mbits <= FLOAT32.mbits)


def _rule(fmt: Format, mode: Rounding, wide: bool, numba: bool = False) -> _Rule:
    drop = FLOAT32.mbits - fmt.mbits if _float32_layout(fmt) and not wide else None
    return _Rule(rounding.target_of(fmt), mode, wide, drop, numba)


_SIGN, _ABS, _INF = -(1 << 31), (1 << 31) - 1, 0x7F800000


def truncate_float32(s: Tensor, r: Tensor, drop: int, rounding: Rounding) -> Tensor:
    """``s + r`` (a float32 TwoSum pair: ``r`` below ``s``'s last bit) rounded, under ``rne``
    or ``rtz``, to a format laid out as float32 with ``drop`` fewer mantissa bits.

    The exact value lies just past ``|s|`` on ``r``'s side: step ``|s|`` one float32 ulp toward
    zero when ``r`` points that way, then the cut below the kept bits decides, with ``r != 0`` as
    a sticky bit. Subnormals need nothing more (the format's subnormal quantum is the float32
    one times ``2**drop``), a carry out of the mantissa moves into the exponent and past the
    top to inf, as IEEE rounding to nearest does; NaN and inf pass through. The same rule as
    :func:`driftcli.casts.rounding.add`, written on float32 bits so that it vectorizes.
    """
    bits = s.view(torch.int32)
    mag = bits & _ABS
    # r and s of opposite signs (comparisons, not signbit: they vectorize; r != 0 means s != 0)
    toward = ((r < 0) & (s > 0)) | ((r > 0) & (s < 0))
    stepped = mag - toward.to(torch.int32)
    kept = stepped >> drop
    if rounding is Rounding.RNE and drop:
        low = stepped & ((1 << drop) - 1)
        half = 1 << (drop - 1)
        up = (low > half) | ((low == half) & ((r != 0) | ((kept & 1) == 1)))
        kept = kept + up.to(torch.int32)
    elif rounding is Rounding.RNE:
        return s  # float32 addition is already rounded to nearest even
    out = torch.where(mag < _INF, kept << drop, mag)
    return (out | (bits & _SIGN)).view(torch.float32)


def _round_sum(acc: Tensor, term: Tensor, rule: _Rule) -> Tensor:
    """``round(acc + term)`` onto the accumulator format: exact sum, one rounding.

    ``s = fl(acc + term)`` carries IEEE's sign for an exact zero (+0 for x + (-x) and
    (+0) + (-0), -0 for (-0) + (-0)), and TwoSum's ``r`` is its exact error."""
    s, r = two_sum(acc, term)
    if rule.drop == 0 and rule.rounding is Rounding.RNE:
        return s
    if rule.wide:  # inf or NaN: no residual (float32 work is chosen only where sums are finite)
        r = torch.where(torch.isfinite(s), r, torch.zeros_like(r))
    if rule.drop is not None:
        return truncate_float32(s, r, rule.drop, rule.rounding)
    return rounding.round_sum(s, r, rule.target, rule.rounding, wide=rule.wide)


def _steps(acc: Tensor, a: Tensor, b: Tensor, live: Tensor | None, *, rule: _Rule,
           count: int) -> Tensor:
    """``count`` accumulator steps: ``acc = round(acc + a[u] * b[u])`` for u = 0..count-1;
    where ``live[u]`` is False the accumulator keeps its value (a short last chunk)."""
    for u in range(count):
        new = _round_sum(acc, a[u] * b[u], rule)
        acc = new if live is None else torch.where(live[u], new, acc)
    return acc


STEPS_PER_CALL = 8
"""Accumulator steps per call of the step function (one pass over the accumulator)."""


def _run_steps(acc: Tensor, terms: _Terms, index: Tensor, live: Tensor | None,
               rule: _Rule) -> Tensor:
    """:func:`_steps` over the terms ``index``."""
    a, b = terms.factors(index)
    return _steps(acc, a, b, live, rule=rule, count=index.shape[0])


def _accumulate(terms: _Terms, spec: MatmulSpec) -> Tensor:
    """The accumulated sum of the terms in the spec's order, in the working dtype: on the
    back-end :func:`driftcli.kernels.numba_runs` chooses (the same bits on both)."""
    wide = terms.dtype == torch.float64
    rule = _rule(spec.accumulator, spec.acc_rounding, wide, kernels.numba_runs(*terms.sources()))
    chunk = spec.chunk // spec.block if spec.block else spec.chunk
    if spec.order is Order.PAIRWISE:
        return _pairwise(terms, rule)
    if spec.order is Order.SEQUENTIAL:
        return _sequential(terms, rule)
    return _chunked(terms, chunk, rule, _rule(MASTER, Rounding.RNE, wide))


def _kernel_params(rule: _Rule, dtype: torch.dtype) -> tuple[int, ...]:
    return rounding.jit_params(src=rounding.source_of(dtype), tgt=rule.target,
                               rounding=rule.rounding, overflow=Overflow.IEEE,
                               sr_bits=DEFAULT_SR_BITS)


def _numba_accumulate(terms: _Terms, order: Order, chunk: int, rule: _Rule,
                      master_rule: _Rule) -> Tensor:
    """:func:`_accumulate` as one numba kernel (:mod:`driftcli.kernels.accumcode`): each step
    the one of :func:`_round_sum`, chosen by the same rule."""
    if rule.wide:
        kind, drop = "rounded", 0
    elif rule.drop == 0 and rule.rounding is Rounding.RNE:
        kind, drop = "plain", 0
    elif rule.drop is not None:
        kind, drop = "layout", rule.drop
    else:
        kind, drop = "rounded", 0
    a, b, a_of, b_of, m = terms.operands()
    out = jit.accumulate(a, b, a_of, b_of, m, order.value, chunk, kind, drop,
                         _kernel_params(rule, terms.dtype),
                         _kernel_params(master_rule, terms.dtype))
    return out.reshape(terms.shape)


def _sequential(terms: _Terms, rule: _Rule) -> Tensor:
    if rule.numba:
        return _numba_accumulate(terms, Order.SEQUENTIAL, 0, rule, rule)
    # a cleared accumulator: +0
    acc = torch.zeros(terms.shape, dtype=terms.dtype, device=terms.device)
    for k in range(0, terms.count, STEPS_PER_CALL):
        index = torch.arange(k, min(k + STEPS_PER_CALL, terms.count), device=terms.device)
        acc = _run_steps(acc, terms, index, None, rule)
    return acc


def _chunked(terms: _Terms, chunk: int, rule: _Rule, master_rule: _Rule) -> Tensor:
    """All chunks at once: position ``j`` of every chunk is added in one vectorized step (the
    chunk axis first, so that the innermost axis is N)."""
    if rule.numba:
        return _numba_accumulate(terms, Order.CHUNKED, chunk, rule, master_rule)
    n_chunks = -(-terms.count // chunk)
    acc = torch.zeros((n_chunks, *terms.shape), dtype=terms.dtype, device=terms.device)
    starts = torch.arange(n_chunks, device=terms.device) * chunk
    for j in range(0, min(chunk, terms.count), STEPS_PER_CALL):
        index = starts[None, :] + torch.arange(j, min(j + STEPS_PER_CALL, chunk),
                                               device=terms.device)[:, None]  # (U, C)
        # only the last chunk can be short: its missing terms leave its sum as it is
        live = index < terms.count
        mask = None if bool(live.all()) else live.reshape(*live.shape, *[1] * len(terms.shape))
        acc = _run_steps(acc, terms, index.clamp(max=terms.count - 1), mask, rule)
    master = torch.zeros(terms.shape, dtype=terms.dtype, device=terms.device)
    for c in range(n_chunks):
        master = _round_sum(master, acc[c], master_rule)
    return master


def _pairwise(terms: _Terms, rule: _Rule) -> Tensor:
    """Level by level: adjacent pairs summed, an odd last element carried; in row groups that
    keep the level-0 terms within :data:`PAIRWISE_ELEMENTS`."""
    if rule.numba:
        return _numba_accumulate(terms, Order.PAIRWISE, 0, rule, rule)
    M = terms.shape[-2]
    per_row = math.prod(terms.shape[:-2]) * terms.shape[-1] * max(terms.count, 1)
    group = max(1, PAIRWISE_ELEMENTS // max(per_row, 1))  # N = 0: no products at all
    out = torch.zeros(terms.shape, dtype=terms.dtype, device=terms.device)
    for start in range(0, M, group):
        part = terms.rows(start, min(M, start + group))
        level = part.all()
        while level.shape[-1] > 1:
            n = level.shape[-1]
            pairs = _round_sum(level[..., 0:n - 1:2], level[..., 1:n:2], rule)
            level = torch.cat([pairs, level[..., n - 1:]], dim=-1) if n % 2 else pairs
        zero = torch.zeros(part.shape, dtype=terms.dtype, device=terms.device)
        out[..., start:start + group, :] = _round_sum(zero, level[..., 0], rule) \
            if part.count else zero
    return out
