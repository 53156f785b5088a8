"""``verify-formats``: the fast path against the exact oracle, value by value.

Checks are plain functions ``check(fmt, plan) -> Iterator[Outcome]`` listed in
:data:`CHECKS`; each outcome is one (format, check, operation, rounding,
overflow) cell with its count and its disagreements. Full plan, with the
quick plan's numbers in brackets:

- ``codes``: every code of every format of at most 16 bits decodes to the
  reference value (``Format.decode``) and round-trips, through every rounding
  mode and overflow policy, back to its own code [16-bit formats: rne and
  saturate only].
- ``pairs``: products and sums, rounded back to the format, of every pair of
  codes of every format of at most 8 bits [8-bit: 1,024 seeded pairs plus all
  pairs of a boundary set], under every mode and both policies; ``sr`` for
  every value of :data:`PAIR_SR_BITS` random bits. 16-bit formats: 2**20
  seeded pairs under (rne, saturate) and 2**16 under every other cell, plus
  all boundary pairs, ``sr`` with one seeded 16-bit draw per pair [4,096
  pairs, (rne, saturate) only]. Wider formats (float32, ``e8m13``): 2**14
  seeded pairs plus boundary pairs per cell [1,024].
- ``float32-inputs``: float32 values at every midpoint between neighbouring
  values, one float32 ulp either side of each midpoint and each value, just
  above max, and 4,096 [256] through the subnormal range, under every mode
  and policy (``sr``: all-zero, all-one and seeded 16-bit draws) [formats of
  at most 8 bits only].
- ``blocks``: block-scaled casts of every signed element format of at most 8
  bits under every scale rule (:func:`block_casts`): every element of
  constructed blocks (amax at, just below and just above powers of two and
  element maxima, zeros, NaN and inf members, clamped scales, partial blocks
  and tiles) and of :data:`BLOCK_FULL_SAMPLE` random blocks, plus the scale of
  :data:`BLOCK_SCALE_SAMPLE` random blocks per power-of-two rule and
  :data:`REAL_SCALE_SAMPLE` per real-valued rule [the floor and two-level
  rules only, constructed blocks and a tenth of the scale samples].
- ``matmul``: simulated matmuls accumulating in the format, for the formats of
  :data:`MATMUL_ACCUMULATORS` (and any unregistered ``eXmY`` asked for), against
  :func:`driftcli.oracle.dot` on the oracle's own casts: every output element of
  seeded random matmuls (:data:`MATMUL_SHAPES`), a tiny and a huge case and a
  constructed case (swamping, cancellation, overflow) under the orders of
  :data:`MATMUL_ORDERS`, ``rne`` and ``rtz``, the operand casts of
  :data:`MATMUL_CASTS` and, with ``scale=block``, :data:`MATMUL_BLOCK_CASTS`; mixed
  operands and an output cast; ``native`` (float32 only) on integer cases where
  every float32 order is exact [two random shapes and the constructed case with
  K = 96; no cast and NVFP4, ``sequential``, ``pairwise``, ``chunked:16``; MXFP8
  with ``scale=block`` under ``sequential``].
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache
from typing import ClassVar, cast

import torch

from driftcli import codec, oracle
from driftcli import rounding as fast
from driftcli.arith import MatmulSpec, matmul, matmul_spec
from driftcli.formats import FORMATS, Exact, Format, Kind, get_format, pow2
from driftcli.io.tables import column
from driftcli.modes import DEFAULT_SR_BITS, Granularity, Overflow, Rounding, ScaleRule
from driftcli.scaling import block_stats, pow2_exponents, real_scales, two_level_scales
from driftcli.spec import PRESETS, Cast, Scaling

Tensor = torch.Tensor

PAIR_SR_BITS = 4
"""Random-bit width at which ``sr`` products and sums are checked for every draw."""
PAIR_SAMPLE_16 = 1 << 20
"""Seeded pairs per 16-bit format under (rne, saturate), products and sums, in the full run."""
QUICK_PAIRS = 1024
QUICK_PAIRS_16 = 4096
WIDE_PAIRS = 1 << 14
"""Seeded pairs per cell for formats wider than 16 bits (float32, e8m13, …)."""
OTHER_SAMPLE_16 = 1 << 16
"""Seeded pairs per 16-bit format for every cell but (rne, saturate), in the full run."""
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
        return oracle.NAN
    if v in (float("inf"), float("-inf")):
        return Exact(Kind.INF, v < 0)
    return Exact.of(Fraction(v), negative_zero=str(v).startswith("-"))


def _same(expected: Tensor, got: Tensor) -> Tensor:
    """Bitwise equality of float64 values, any NaN equal to any NaN."""
    e, g = expected.to(torch.float64), got.to(torch.float64)
    return (e.view(torch.int64) == g.view(torch.int64)) | (torch.isnan(e) & torch.isnan(g))


def _judge(out: Outcome, expected: Tensor, got: Tensor, describe: Callable[[int], str]) -> None:
    ok = _same(expected, got)
    out.n_checked += ok.numel()
    bad = (~ok).nonzero().flatten()
    out.n_failed += bad.numel()
    for i in bad[: FAILURE_CAP - len(out.failures)].tolist():
        out.failures.append((describe(i), str(exact_of_float(expected[i].item())),
                             str(exact_of_float(got[i].item()))))


def _round_all(fmt: Format, values: list[Exact], mode: Rounding, policy: Overflow,
               random: int = 0, sr_bits: int = DEFAULT_SR_BITS) -> Tensor:
    return torch.tensor([to_float(oracle.round_exact(fmt, v, mode, policy, random, sr_bits))
                         for v in values], dtype=torch.float64)


def _dedup(values: list[Exact]) -> tuple[list[Exact], Tensor]:
    """Distinct values and, for each input, its index among them (rounding each once)."""
    index: dict[Exact, int] = {}
    idx = [index.setdefault(v, len(index)) for v in values]
    return list(index), torch.tensor(idx, dtype=torch.int64)


def _hex(fmt: Format, code: int) -> str:
    return f"0x{code:0{(fmt.bits + 3) // 4}x}"


# --- checks ------------------------------------------------------------------------------

def check_codes(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Every code decodes to the reference value and round-trips through every cast."""
    if fmt.bits > 16:
        return
    reference = [v for _, v in fmt.values()]
    codes = torch.arange(1 << fmt.bits)
    decoded = codec.decode(codes, fmt)
    out = Outcome(fmt.name, "codes", "decode", "-", "-")
    _judge(out, torch.tensor([to_float(v) for v in reference], dtype=torch.float64), decoded,
           lambda i: _hex(fmt, i))
    yield out
    # a value on the grid is its own rounding under every mode and policy
    finite = torch.isfinite(decoded)
    exact_codes = codes.clone()
    nan = codec.nan_code(fmt)
    if nan is not None:
        exact_codes[torch.isnan(decoded)] = nan
    for mode, policy in _cells(fmt, plan):
        out = Outcome(fmt.name, "codes", "roundtrip", mode.value, policy.value)
        bits = torch.full(codes.shape, (1 << DEFAULT_SR_BITS) - 1, dtype=torch.int32)
        got = fast.round_to_format(decoded, fmt, rounding=mode, overflow=policy,
                                   random_bits=bits)
        expected = _round_all(fmt, reference, mode, policy, (1 << DEFAULT_SR_BITS) - 1)
        _judge(out, expected, got, lambda i: _hex(fmt, i))
        back = codec.encode(torch.where(finite, got, decoded), fmt) if out.n_failed == 0 \
            else exact_codes
        wrong = (back != exact_codes) & finite
        out.n_failed += int(wrong.sum())
        for i in wrong.nonzero().flatten()[:FAILURE_CAP].tolist():
            out.failures.append((_hex(fmt, i), _hex(fmt, i), _hex(fmt, int(back[i]))))
        yield out


def _boundary_codes(fmt: Format) -> list[int]:
    """Codes where rounding goes wrong first: zeros, subnormal edges, 1, max, specials."""
    tiny, normal, one = fmt.smallest_positive, fmt.smallest_normal, Fraction(1)
    ulp_top = pow2(fmt.qmax)
    picks = [tiny, 2 * tiny, normal - tiny, normal, normal + tiny, one - fmt.eps / 2, one,
             one + fmt.eps, fmt.max - ulp_top, fmt.max]
    mags = torch.tensor([float(v) for v in picks if fmt.min <= -v or v <= fmt.max])
    on_grid = fast.round_to_format(mags.double(), fmt, rounding=Rounding.RTZ)
    values = torch.cat([on_grid, -on_grid, torch.tensor([0.0, -0.0, float("inf"), float("-inf"),
                                                          float("nan")], dtype=torch.float64)])
    # onto the grid, keeping ±inf where the format has it; NaN only where it has a code
    values = fast.round_to_format(values, fmt, overflow=Overflow.IEEE)
    if not fmt.has_nan:
        values = values[~torch.isnan(values)]
    return sorted(set(codec.encode(values, fmt).tolist()))


def _seeded_pairs(fmt: Format, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """``count`` seeded random code pairs plus every pair of the boundary codes."""
    n = 1 << fmt.bits
    gen = torch.Generator().manual_seed(seed)
    # codes of 32-bit formats do not fit int32 arithmetic later on; int64 draws hold them
    a = torch.randint(0, n, (count,), generator=gen)
    b = torch.randint(0, n, (count,), generator=gen)
    edge = torch.tensor(_boundary_codes(fmt))
    return (torch.cat([a, edge.repeat_interleave(len(edge))]),
            torch.cat([b, edge.repeat(len(edge))]))


Cell = tuple[Rounding, Overflow]
MAIN_CELL: Cell = (Rounding.RNE, Overflow.SATURATE)


def _cells(fmt: Format, plan: Plan) -> list[Cell]:
    """The (rounding, overflow) cells to check; the quick plan keeps 16-bit formats to one."""
    if plan.quick and fmt.bits > 8:
        return [MAIN_CELL]
    return [(m, p) for m in Rounding for p in Overflow]


def _pair_sets(fmt: Format, plan: Plan) -> list[tuple[str, Tensor, Tensor, list[Cell]]]:
    """Which operand pairs each (rounding, overflow) cell sees: ``(label, a, b, cells)``."""
    cells = [(m, p) for m in Rounding for p in Overflow]
    n = 1 << fmt.bits
    if fmt.bits <= 6 or (fmt.bits <= 8 and not plan.quick):
        return [("all pairs", torch.arange(n).repeat_interleave(n), torch.arange(n).repeat(n),
                 cells)]
    if fmt.bits <= 8 or fmt.bits > 16:
        count = QUICK_PAIRS if plan.quick or fmt.bits <= 8 else WIDE_PAIRS
        return [("sampled pairs", *_seeded_pairs(fmt, count, plan.seed), cells)]
    if plan.quick:
        return [("sampled pairs", *_seeded_pairs(fmt, QUICK_PAIRS_16, plan.seed), [MAIN_CELL])]
    return [("sampled pairs", *_seeded_pairs(fmt, PAIR_SAMPLE_16, plan.seed), [MAIN_CELL]),
            ("sampled pairs", *_seeded_pairs(fmt, OTHER_SAMPLE_16, plan.seed + 1),
             [c for c in cells if c != MAIN_CELL])]


def check_pairs(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Products and sums of pairs of codes, rounded back to the format, against the oracle."""
    for label, ca, cb, cells in _pair_sets(fmt, plan):
        ref = {c: fmt.decode(c) for c in set(ca.tolist()) | set(cb.tolist())}
        yield from _check_pair_set(fmt, plan, ref, label, ca, cb, cells)


def _check_pair_set(fmt: Format, plan: Plan, ref: dict[int, Exact], label: str, ca: Tensor,
                    cb: Tensor, cells: list[Cell]) -> Iterator[Outcome]:
    xa, xb = codec.decode(ca, fmt), codec.decode(cb, fmt)
    la, lb = ca.tolist(), cb.tolist()
    all_draws = fmt.bits <= 8  # sr: every value of PAIR_SR_BITS bits; else one 16-bit draw

    def describe(i: int) -> str:
        j = i % len(la)
        return f"{_hex(fmt, la[j])} {_hex(fmt, lb[j])}"

    products = _dedup([oracle.product(ref[i], ref[j]) for i, j in zip(la, lb, strict=True)])
    sums: dict[bool, tuple[list[Exact], Tensor]] = {}
    for op in ("product", "sum"):
        fast_op = fast.multiply if op == "product" else fast.add
        for mode, policy in cells:
            if op == "product":
                uniq, index = products
            else:  # the sum's only dependence on the mode: the sign of an exact zero
                down = mode is Rounding.RDOWN
                if down not in sums:
                    sums[down] = _dedup([oracle.total(ref[i], ref[j], mode)
                                         for i, j in zip(la, lb, strict=True)])
                uniq, index = sums[down]
            out = Outcome(fmt.name, f"pairs ({label})", op, mode.value, policy.value)
            if mode is not Rounding.SR:
                expected = _round_all(fmt, uniq, mode, policy)[index]
                got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy)
                _judge(out, expected, got, describe)
            elif all_draws:
                for r in range(1 << PAIR_SR_BITS):
                    expected = _round_all(fmt, uniq, mode, policy, r, PAIR_SR_BITS)[index]
                    bits = torch.full(xa.shape, r, dtype=torch.int32)
                    got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy,
                                  random_bits=bits, sr_bits=PAIR_SR_BITS)
                    _judge(out, expected, got, lambda i, r=r: f"{describe(i)} r={r}")
            else:
                bits = fast.draw_random_bits(xa.shape, plan.seed)
                expected = torch.tensor(
                    [to_float(oracle.round_exact(fmt, uniq[k], mode, policy, r))
                     for k, r in zip(index.tolist(), bits.tolist(), strict=True)],
                    dtype=torch.float64)
                got = fast_op(xa, xb, fmt, rounding=mode, overflow=policy, random_bits=bits)
                _judge(out, expected, got, lambda i, b=bits: f"{describe(i)} r={int(b[i])}")
            yield out


def float32_inputs(fmt: Format, seed: int, n_tiny: int = 4096) -> Tensor:
    """Float32 inputs at and around every rounding boundary of ``fmt``."""
    decoded = codec.decode(torch.arange(1 << fmt.bits), fmt)
    grid = torch.unique(decoded[torch.isfinite(decoded)].abs())  # sorted magnitudes
    mids = (grid[:-1].double() + grid[1:].double()) / 2
    mids = mids.float()  # exact: a midpoint needs one bit more than the format, float32 has it
    up, down = torch.tensor(float("inf")), torch.tensor(0.0)
    points = [grid, mids]
    for p in (grid, mids):
        points += [torch.nextafter(p, up), torch.nextafter(p, down)]
    top = float(fmt.max)
    ulp_top = float(pow2(fmt.qmax))
    above = torch.tensor([top + ulp_top / 2, top + ulp_top, 2 * top, 3.4028234663852886e38,
                          float("inf"), float("nan")], dtype=torch.float32)
    points += [above, torch.nextafter(above, up), torch.nextafter(above, down)]
    gen = torch.Generator().manual_seed(seed)
    small = float(fmt.smallest_normal)
    tiny = torch.exp2(torch.rand(n_tiny, generator=gen) * -40) * small
    float32_subnormals = torch.tensor([1, 2, 3, 1 << 22, (1 << 23) - 1, 1 << 23],
                                      dtype=torch.int32).view(torch.float32)
    points += [tiny, float32_subnormals]
    mags = torch.cat([p.float().flatten() for p in points])
    return torch.cat([mags, -mags])


def check_float32_inputs(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Casts of float32 values placed at and around every rounding boundary."""
    if fmt.bits > 16 or (plan.quick and fmt.bits > 8):
        return
    x = float32_inputs(fmt, plan.seed, 256 if plan.quick else 4096)
    exact = [exact_of_float(v) for v in x.tolist()]
    raw = x.view(torch.int32).tolist()

    def describe(i: int) -> str:
        return f"float32 0x{raw[i % len(raw)] & 0xFFFFFFFF:08x}"

    for mode in Rounding:
        for policy in Overflow:
            out = Outcome(fmt.name, "float32-inputs", "cast", mode.value, policy.value)
            if mode is Rounding.SR:
                top = (1 << DEFAULT_SR_BITS) - 1
                draws = [torch.zeros(x.shape, dtype=torch.int32),
                         torch.full(x.shape, top, dtype=torch.int32),
                         fast.draw_random_bits(x.shape, plan.seed)]
            else:
                draws = [None]
            for bits in draws:
                rs = [0] * len(exact) if bits is None else bits.tolist()
                expected = torch.tensor(
                    [to_float(oracle.round_exact(fmt, v, mode, policy, r))
                     for v, r in zip(exact, rs, strict=True)], dtype=torch.float64)
                got = fast.round_to_format(x, fmt, rounding=mode, overflow=policy,
                                           random_bits=bits)
                _judge(out, expected, got, describe)
            yield out


# --- block-scaled casts ---------------------------------------------------------------------

BLOCK_SCALE_SAMPLE = 100_000
"""Seeded random blocks whose scale is checked per (element format, cast) in the full run."""
REAL_SCALE_SAMPLE = 25_000
"""Seeded random blocks whose real-valued scale (amax, two-level) is checked per cast."""
BLOCK_FULL_SAMPLE = 256
"""Random blocks whose every element is checked too, per cast (the element rounding itself
is checked exhaustively by the element checks)."""


def block_casts(fmt: Format) -> list[Cast]:
    """The casts checked with ``fmt`` as element format: every preset that uses it, and every
    scale rule (floor, ceil, even, floor+1, floor+2, amax, amax-rne, amax-up, two-level)."""
    e8m0, e4m3, f32 = (FORMATS[n] for n in ("float8_e8m0fnu", "float8_e4m3fn", "float32"))
    block, tile = Granularity.BLOCK, Granularity.TILE
    generic = [
        *(Scaling(block, 32, e8m0, rule) for rule in (ScaleRule.FLOOR, ScaleRule.CEIL,
                                                       ScaleRule.EVEN, ScaleRule.AMAX_UP)),
        *(Scaling(block, 32, e8m0, ScaleRule.FLOOR, h) for h in (1, 2)),
        Scaling(block, 32, e4m3, ScaleRule.FLOOR),  # a narrow scale range: clamps at both ends
        Scaling(Granularity.TENSOR, 0, f32, ScaleRule.AMAX),
        Scaling(Granularity.CHANNEL, 0, e4m3, ScaleRule.AMAX_RNE),
        Scaling(block, 16, e4m3, ScaleRule.TWO_LEVEL),
        Scaling(tile, 16, e4m3, ScaleRule.TWO_LEVEL),
    ]
    casts = [Cast(fmt, sc) for sc in generic]
    # the other rounding modes and the ieee policy, under the OCP rule and under amax
    casts += [Cast(fmt, generic[0], mode, policy) for mode in DETERMINISTIC
              for policy in Overflow if (mode, policy) != MAIN_CELL]
    casts += [Cast(fmt, generic[7], mode, Overflow.IEEE) for mode in DETERMINISTIC]
    casts += [c for c, _ in PRESETS.values() if c.format == fmt and c.scaling.granularity
              is not Granularity.NONE and c not in casts]
    return casts


def _blocks_of(case: Tensor, c: Cast) -> list[list[int]]:
    """Flat element indices of each block of ``case``, found without driftcli.scaling."""
    g, k = c.scaling.granularity, c.scaling.block
    flat = list(range(case.numel()))
    if g is Granularity.TENSOR:
        return [flat]
    if case.dim() == 1:
        size = case.numel() if g is Granularity.CHANNEL else k
        return [flat[i:i + size] for i in range(0, len(flat), size)]
    rows, cols = case.shape
    if g is Granularity.CHANNEL:
        return [flat[r * cols:(r + 1) * cols] for r in range(rows)]
    if g is Granularity.BLOCK:
        return [[r * cols + j for j in range(b, min(b + k, cols))]
                for r in range(rows) for b in range(0, cols, k)]
    return [[r * cols + j for r in range(i, min(i + k, rows)) for j in range(b, min(b + k, cols))]
            for i in range(0, rows, k) for b in range(0, cols, k)]


def _oracle_cast(case: Tensor, c: Cast) -> list[float]:
    """Dequantized values of a whole tensor, block by block, by the oracle."""
    return [to_float(v) for v in oracle_cast_exact(case, c)[0]]


def oracle_cast_exact(case: Tensor, c: Cast) -> tuple[list[Exact], list[Exact]]:
    """The oracle's dequantized values of a whole tensor (flat) and the scale of each one."""
    values = [exact_of_float(v) for v in case.flatten().tolist()]
    s = c.scaling
    finite = [v.mag for v in values if v.kind is Kind.FINITE]
    tensor_amax = max(finite, default=Fraction(0))
    out: list[Exact] = [oracle.NAN] * len(values)
    scales: list[Exact] = [Exact.of(1)] * len(values)
    for idx in _blocks_of(case, c):
        deq, scale, _ = oracle.cast_block(
            [values[i] for i in idx], c.format, s.scale_format or FORMATS["float32"],
            str(s.rule), s.headroom, s.blocked, FORMATS["float32"], c.rounding, c.overflow,
            tensor_amax=tensor_amax)
        for i, v in zip(idx, deq, strict=True):
            out[i], scales[i] = v, scale
    return out, scales


def _constructed_cases(fmt: Format, c: Cast) -> list[Tensor]:
    """Blocks built to break scale rules: amax at, just below and just above each power of two
    and each element max, zeros, NaN and inf members, clamping at both ends, partial blocks."""
    k = c.scaling.block or 32
    n = k * k if c.scaling.granularity is Granularity.TILE else k
    gen = torch.Generator().manual_seed(SEED)
    body = torch.rand(n, generator=gen) * 0.9
    peaks: list[float] = []
    for j in (-130, -127, -126, -60, -20, -9, -3, -1, 0, 1, 3, 8, 20, 60, 100, 126, 127):
        for base in (1.0, float(fmt.max)):
            v = torch.tensor(base * 2.0**j, dtype=torch.float64).float()
            if torch.isfinite(v) and v > 0:
                peaks += [float(v), float(torch.nextafter(v, torch.tensor(0.0))),
                          float(torch.nextafter(v, torch.tensor(float("inf"))))]
    peaks.append(float(torch.nextafter(torch.tensor(8.0), torch.tensor(0.0))))
    peaks.append(torch.finfo(torch.float32).max)  # 2**128 after a ceil scale: inf in float32
    cases = []
    for peak in peaks:
        block = body * peak
        block[0] = -peak if len(cases) % 2 else peak
        cases.append(block)
    # ties: the element max sets a power-of-two scale 2**j, the rest sit on exact midpoints of
    # the element grid times 2**j, with both signs (ties decide rne against rna, and rup/rdown)
    grid = sorted({abs(float(v.value)) for _, v in fmt.values() if v.kind is Kind.FINITE})
    mids = torch.tensor([(a + b) / 2 for a, b in itertools.pairwise(grid)])
    for j in (-3, 0, 5):
        tie = torch.cat([torch.tensor([float(fmt.max)]), mids, -mids])[:n]
        tie = torch.cat([tie, torch.zeros(n - len(tie))]) * 2.0**j
        cases.append(tie)
    for special in (float("nan"), float("inf"), float("-inf")):
        block = body.clone()
        block[3] = special
        cases.append(block)
    cases.append(torch.zeros(n))
    cases.append(-torch.zeros(n))
    if c.scaling.granularity is Granularity.TILE:
        cases = [b.reshape(k, k) for b in cases]
        cases.append(torch.randn(k + 5, 2 * k + 3, generator=gen))  # partial tiles
    else:
        cases.append(torch.randn(k + 13, generator=gen) * 1e3)  # a partial block
    return cases


def random_blocks(count: int, size: int, seed: int) -> Tensor:
    """Seeded float32 blocks: normal, heavy-tailed (Cauchy), log-normal, tanh-shaped (piling up
    just under 1) and edge blocks, whose amax sits within 3 ulps of a power of two or of the
    significand of an element max (1.5, 1.75, 1.875, 1.984375) times one, each at a random
    power-of-two magnitude."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(count, size, generator=gen)
    kinds = (torch.arange(count) % 5)[:, None]
    cauchy = torch.tan(torch.pi * (torch.rand(count, size, generator=gen) - 0.5))
    lognormal = torch.exp(3 * z) * torch.sign(torch.randn(count, size, generator=gen))
    tanh = torch.tanh(3 * z)
    significands = torch.tensor([1.0, 1.5, 1.75, 1.875, 1.984375])
    pick = torch.randint(0, len(significands), (count,), generator=gen)
    ulps = torch.randint(-3, 4, (count,), generator=gen, dtype=torch.int32)
    peak = (significands[pick].view(torch.int32) + ulps).view(torch.float32)[:, None]
    edge = torch.rand(count, size, generator=gen) * 0.9 * peak
    edge[:, :1] = peak * torch.sign(torch.randn(count, 1, generator=gen))
    x = torch.where(kinds == 0, z, torch.where(kinds == 1, cauchy, torch.where(
        kinds == 2, lognormal, torch.where(kinds == 3, tanh, edge))))
    shift = torch.randint(-20, 21, (count, 1), generator=gen).float()
    x = x * torch.exp2(torch.where(kinds == 3, torch.zeros_like(shift), shift))
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _fast_scales(blocks: Tensor, c: Cast, group: int) -> tuple[Tensor, Tensor]:
    """The scales the fast path chooses for each row of ``blocks`` (rows grouped by ``group``
    into tensors for the two-level rule)."""
    stats = block_stats(blocks)
    s = c.scaling
    if s.rule is not None and s.rule.power_of_two:
        k, clamped = pow2_exponents(stats.amax, c.format, s)
        return torch.ldexp(torch.ones_like(k, dtype=torch.float64), k.double()), clamped
    if s.rule is ScaleRule.TWO_LEVEL:
        group_amax = stats.amax.reshape(-1, group).amax(dim=1).repeat_interleave(group)
        two = two_level_scales(stats.amax, group_amax, c.format, s)
        return two.divisor.double(), two.clamped
    scale, clamped = real_scales(stats.amax, c.format, s)
    return scale.double(), clamped


@cache
def _random_pool(count: int, size: int, seed: int) -> tuple[Tensor, tuple[Fraction, ...]]:
    """Random blocks and their exact amax (Python's max over floats compares exactly)."""
    blocks = random_blocks(count, size, seed)
    return blocks, tuple(Fraction(max(abs(v) for v in row)) for row in blocks.tolist())


def _quick_casts(fmt: Format) -> list[Cast]:
    """The quick plan's casts: the OCP MX rule and the two-level (NVFP4) rule."""
    e8m0, e4m3 = FORMATS["float8_e8m0fnu"], FORMATS["float8_e4m3fn"]
    return [Cast(fmt, Scaling(Granularity.BLOCK, 32, e8m0, ScaleRule.FLOOR)),
            Cast(fmt, Scaling(Granularity.BLOCK, 16, e4m3, ScaleRule.TWO_LEVEL))]


def check_blocks(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Block-scaled casts against the oracle: constructed blocks and seeded random blocks."""
    if fmt.bits > 8 or not fmt.signed:
        return
    seen: set[Scaling] = set()
    for c in _quick_casts(fmt) if plan.quick else block_casts(fmt):
        # a rounding mode or overflow policy changes the elements, not the scales: the random
        # blocks serve the cast's first mode; later ones get the constructed blocks, ties included
        first = c.scaling not in seen
        seen.add(c.scaling)
        yield from check_cast(fmt, c, plan, random=first)


def check_cast(fmt: Format, c: Cast, plan: Plan, random: bool = True) -> Iterator[Outcome]:
    """One block-scaled cast: every element of some blocks, and (``random``) the elements of
    random blocks and the scale of many."""
    f32 = FORMATS["float32"]
    spec = str(c)
    s = c.scaling
    k = s.block or 32
    size = k * k if s.granularity is Granularity.TILE else k
    # every element of constructed blocks, and of random blocks
    out = Outcome(fmt.name, "blocks", spec, c.rounding.value, c.overflow.value)
    cases = _constructed_cases(fmt, c)
    if not plan.quick and random:
        pool = random_blocks(BLOCK_FULL_SAMPLE, size, plan.seed + 7)
        cases += ([pool.reshape(-1, k, k)[i] for i in range(BLOCK_FULL_SAMPLE // 16)]
                  if s.granularity is Granularity.TILE else [pool])
    for case in cases:
        got = cast_quantize(case, c).flatten()
        expected = torch.tensor(_oracle_cast(case, c), dtype=torch.float64)
        raw = case.flatten().view(torch.int32).tolist()
        _judge(out, expected, got, lambda i, raw=raw: f"element {i} float32 "
               f"0x{raw[i] & 0xFFFFFFFF:08x}")
    yield out
    # the scale of many random blocks: the rule's whole job
    if s.granularity is Granularity.TILE or not random:
        return  # a tile's scale is a block's scale; tiling is checked element by element
    exponent_rule = s.rule is not None and s.rule.power_of_two
    count = BLOCK_SCALE_SAMPLE if exponent_rule else REAL_SCALE_SAMPLE
    count //= 10 if plan.quick else 1
    group = 8  # two-level: blocks form tensors of 8 blocks, each with its own tensor scale
    count -= count % group
    out = Outcome(fmt.name, "block scales", spec, c.rounding.value, c.overflow.value)
    blocks, amax = _random_pool(count, size, plan.seed + 11)
    got, _ = _fast_scales(blocks, c, group)
    scale_format = s.scale_format or f32
    if exponent_rule:
        low = oracle.binade(scale_format.smallest_positive)
        expected = [float(pow2(oracle.pow2_scale_exponent(a, fmt, str(s.rule), s.headroom,
                                                          low, scale_format.emax)[0]))
                    for a in amax]
    else:
        group_amax = [max(amax[i:i + group]) for i in range(0, len(amax), group)]
        expected = [to_float(oracle.cast_block(
            [Exact.of(a)], fmt, scale_format, str(s.rule), 0, s.blocked, f32,
            tensor_amax=group_amax[i // group], scale_only=True)[1])
            for i, a in enumerate(amax)]
    _judge(out, torch.tensor(expected, dtype=torch.float64), got,
           lambda i, amax=amax: f"block {i} amax {float(amax[i])!r}")
    yield out


def cast_quantize(x: Tensor, c: Cast) -> Tensor:
    """The fast path's dequantized values (looked up at call time, so tests can plant faults)."""
    from driftcli.cast import quantize

    return cast(Tensor, quantize(x, c))


# --- simulated matmuls -------------------------------------------------------------------------

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


def matmul_specs(fmt: Format, plan: Plan) -> list[MatmulSpec]:
    """The matmul specs checked with accumulator ``fmt`` (see the module docs)."""
    modes = (Rounding.RNE, Rounding.RTZ)
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
    if fmt == FORMATS["float32"]:
        native = MATMUL_NATIVE_CASTS[:2] if plan.quick else MATMUL_NATIVE_CASTS
        specs += [matmul_spec(lhs=c, rhs=c, order="native") for c in native]
        specs.append(matmul_spec(lhs=native[-1], rhs=native[-1], order="native", out="bf16"))
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
            ea = [oracle.times(v, 1 / s.mag) for v, s in zip(av, ascale, strict=True)]
            eb = [oracle.times(v, 1 / s.mag) for v, s in zip(bv, bscale, strict=True)]
            return [oracle.block_terms(ea[i * k:(i + 1) * k], eb[j * k:(j + 1) * k],
                                       ascale[i * k:(i + 1) * k:size],
                                       bscale[j * k:(j + 1) * k:size], size)
                    for i in range(m) for j in range(n)]
        key = (case.name, str(spec.lhs), str(spec.rhs))
        if key not in self._products:
            self._products[key] = [oracle.products(av[i * k:(i + 1) * k], bv[j * k:(j + 1) * k])
                                   for i in range(m) for j in range(n)]
        return self._products[key]

    def result(self, case: MatmulCase, spec: MatmulSpec) -> list[Exact]:
        """Every output element of ``case`` under ``spec``, row-major."""
        order = spec.order.value
        fmt, mode = spec.accumulator, spec.acc_rounding
        if order == "native":  # the cases make every float32 order exact: sequential stands
            order, fmt, mode = "sequential", FORMATS["float32"], Rounding.RNE
        chunk = spec.chunk // spec.block if spec.block else spec.chunk
        out = [oracle.dot(t, order, fmt, mode, chunk, FORMATS["float32"])
               for t in self.terms(case, spec)]
        if spec.out is not None:  # an unscaled output cast (checked specs use no other)
            c = spec.out
            out = [oracle.round_exact(c.format, v, c.rounding, c.overflow) for v in out]
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
            _judge(out, expected, got,
                   lambda i, case=case, n=n: f"{case.name} element ({i // n}, {i % n})")
        yield out


def matmul_fast(a: Tensor, b: Tensor, spec: MatmulSpec) -> Tensor:
    """The fast path's matmul."""
    return matmul(a, b, spec)


CHECKS: list[Callable[[Format, Plan], Iterator[Outcome]]] = [
    check_codes, check_pairs, check_float32_inputs, check_blocks, check_matmul]
"""Every check ``verify-formats`` runs, in order."""


def element_formats(names: list[str] | None = None) -> list[Format]:
    """The formats to verify: the given names, or every registered format and the custom
    accumulators of :data:`MATMUL_ACCUMULATORS` (``e8m13``)."""
    if names:
        return [get_format(n) for n in names]
    registered = list(FORMATS.values())
    return registered + [get_format(n) for n in MATMUL_ACCUMULATORS if n not in set(FORMATS)]


def _run_task(name: str, index: int, plan: Plan) -> list[Outcome]:
    torch.set_num_threads(1)  # one worker per core does better than threads on small tensors
    return list(CHECKS[index](get_format(name), plan))


def verify(formats: list[Format], plan: Plan = Plan(), jobs: int = 1,
           progress: Callable[[str], None] | None = None) -> list[Outcome]:
    """Run every check on every format; return all outcomes in a fixed order (no printing).

    ``jobs > 1`` spreads (format, check) tasks over that many processes.
    """
    tasks = [(f.name, i) for f in formats for i in range(len(CHECKS))]

    def label(task: tuple[str, int]) -> str:
        return f"{task[0]}: {CHECKS[task[1]].__name__.removeprefix('check_')}"

    results: dict[tuple[str, int], list[Outcome]] = {}
    if jobs <= 1:
        for task in tasks:
            results[task] = list(CHECKS[task[1]](get_format(task[0]), plan))
            if progress is not None:
                progress(label(task))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_run_task, name, i, plan): (name, i) for name, i in tasks}
            for done in as_completed(futures):
                results[futures[done]] = done.result()
                if progress is not None:
                    progress(label(futures[done]))
    return [o for task in tasks for o in results[task]]


def rows(outcomes: list[Outcome]) -> list[VerifyRow]:
    """The Parquet rows: one summary per cell, then its disagreements."""
    return [r for o in outcomes for r in o.rows()]
