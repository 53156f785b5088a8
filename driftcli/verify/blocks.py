"""The ``blocks`` and ``block scales`` suites: block-scaled casts against the oracle."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from fractions import Fraction
from functools import cache, partial
from typing import cast

import numpy as np
import torch

from driftcli import oracle
from driftcli.casts.route import block_amax, group_scales
from driftcli.records.cast import Cast, MicroBase, Scaling
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS, NAN, Exact, Format, Kind, pow2
from driftcli.records.modes import Granularity, Overflow, ScaleRule
from driftcli.records.presets import PRESETS
from driftcli.verify.compare import (
    DETERMINISTIC,
    MAIN_CELL,
    SEED,
    Outcome,
    Plan,
    exact_of_float,
    judge,
    to_float,
)

Tensor = torch.Tensor

BLOCK_SCALE_SAMPLE = 100_000
"""Seeded random blocks whose scale is checked per (element format, cast) in the full run."""
REAL_SCALE_SAMPLE = 25_000
"""Seeded random blocks whose divisor (any rule that is not a power of two) is checked per cast."""
BLOCK_FULL_SAMPLE = 256
"""Random blocks whose every element is checked too, per cast (the element rounding itself
is checked exhaustively by the element checks)."""


_E8M0, _E4M3, _F32 = (FORMATS[n] for n in ("float8_e8m0fnu", "float8_e4m3fn", "float32"))
_UE5M3, _UE4M3 = FORMATS["ue5m3"], FORMATS["ue4m3"]
_BLOCK, _TILE = Granularity.BLOCK, Granularity.TILE

RULE_SCALINGS: dict[ScaleRule, tuple[Scaling, ...]] = {
    ScaleRule.FLOOR: (
        Scaling(_BLOCK, 32, _E8M0, ScaleRule.FLOOR),  # OCP MX
        *(Scaling(_BLOCK, 32, _E8M0, ScaleRule.FLOOR, h) for h in (1, 2)),
        Scaling(_BLOCK, 32, _E4M3, ScaleRule.FLOOR),  # a narrow scale range: clamps at both ends
    ),
    ScaleRule.AMAX: (Scaling(Granularity.TENSOR, 0, _F32, ScaleRule.AMAX),),  # current scaling
    ScaleRule.AMAX_RNE: (Scaling(Granularity.CHANNEL, 0, _E4M3, ScaleRule.AMAX_RNE),),
    ScaleRule.AMAX_UP: (Scaling(_BLOCK, 32, _E8M0, ScaleRule.AMAX_UP),),  # up to powers of two
    ScaleRule.TWO_LEVEL: (Scaling(_BLOCK, 16, _E4M3, ScaleRule.TWO_LEVEL),
                          Scaling(_TILE, 16, _E4M3, ScaleRule.TWO_LEVEL),
                          # the unsigned block scales after OCP: AMD-FP4's, tcgen05's mxf4nvf4
                          Scaling(_BLOCK, 16, _UE5M3, ScaleRule.TWO_LEVEL),
                          Scaling(_BLOCK, 16, _UE4M3, ScaleRule.TWO_LEVEL)),
}
"""The scalings that stress what a rule does; a rule not listed here (``ceil``, ``even``, and
any new one) is checked under the scaling that ``FORMAT:block32:RULE`` gives: blocks of 32 in
the rule's default scale format."""


def rule_casts(fmt: Format, rule: ScaleRule) -> list[Cast]:
    """The casts that check ``rule`` with ``fmt`` as element format (see :data:`RULE_SCALINGS`),
    under ``rne`` and ``saturate``."""
    if rule in RULE_SCALINGS:
        return [Cast(fmt, s) for s in RULE_SCALINGS[rule]]
    return [parse_cast(f"{fmt.name}:block32:{rule.value}")]


def block_casts(fmt: Format) -> list[Cast]:
    """The casts checked with ``fmt`` as element format in the full plan: every scale rule's
    (looping over :class:`~driftcli.records.modes.ScaleRule`, so a new rule is checked with no edit
    here), the OCP MX cast under every other deterministic rounding mode and overflow policy,
    per-tensor ``amax`` under every deterministic mode with ``ieee``, and every preset on ``fmt``
    not already listed."""
    casts = [c for rule in ScaleRule for c in rule_casts(fmt, rule)]
    ocp = rule_casts(fmt, ScaleRule.FLOOR)[0]
    current = rule_casts(fmt, ScaleRule.AMAX)[0]
    casts += [replace(ocp, rounding=mode, overflow=policy) for mode in DETERMINISTIC
              for policy in Overflow if (mode, policy) != MAIN_CELL]
    casts += [replace(current, rounding=mode, overflow=Overflow.IEEE) for mode in DETERMINISTIC]
    casts += [c for c, _ in PRESETS.values() if c.format == fmt and c.scaling.granularity
              is not Granularity.NONE and c not in casts]
    return casts


def quick_casts(fmt: Format) -> list[Cast]:
    """The quick plan's casts: the OCP MX rule, the two-level (NVFP4) rule and the presets
    with micro-exponents on ``fmt`` (no single-level rule covers their scale choice)."""
    return [rule_casts(fmt, ScaleRule.FLOOR)[0], rule_casts(fmt, ScaleRule.TWO_LEVEL)[0],
            *(c for c, _ in PRESETS.values() if c.format == fmt and c.micro is not None)]


def blocks_of(case: Tensor, c: Cast) -> list[list[int]]:
    """Flat element indices of each block of ``case``, found without driftcli.casts.scaling."""
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
    if s.rule is None:  # unscaled: every value rounded on its own, scale 1
        return ([oracle.rounding.round_exact(c.format, v, c.rounding, c.overflow) for v in values],
                [Exact.of(1)] * len(values))
    finite = [v.mag for v in values if v.kind is Kind.FINITE]
    tensor_amax = max(finite, default=Fraction(0))
    out: list[Exact] = [NAN] * len(values)
    scales: list[Exact] = [Exact.of(1)] * len(values)
    for idx in blocks_of(case, c):
        if c.micro is not None:
            block = [values[i] for i in idx]
            # a partial block is padded with zeros, as drift's blocking pads it
            pad = [Exact.of(0)] * (c.micro.block - len(block))
            deq, scale, _ = oracle.quantization.cast_micro_block(
                block + pad, c.format, c.micro, FORMATS["float32"], FORMATS["bfloat16"],
                c.rounding, c.overflow)
            for i, v in zip(idx, deq, strict=False):
                out[i], scales[i] = v, scale
            continue
        deq, scale, _ = oracle.quantization.cast_block(
            [values[i] for i in idx], c.format, s.scale_format or FORMATS["float32"],
            s.rule, s.headroom, s.blocked, FORMATS["float32"], c.rounding, c.overflow,
            tensor_amax=tensor_amax)
        for i, v in zip(idx, deq, strict=True):
            out[i], scales[i] = v, scale
    return out, scales


def constructed_cases(fmt: Format, c: Cast) -> list[Tensor]:
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
    cases: list[Tensor] = []
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
    if c.micro is not None:
        cases += micro_cases(fmt, c)
    if c.scaling.granularity is Granularity.TILE:
        cases = [b.reshape(k, k) for b in cases]
        cases.append(torch.randn(k + 5, 2 * k + 3, generator=gen))  # partial tiles
    else:
        cases.append(torch.randn(k + 13, generator=gen) * 1e3)  # a partial block
    return cases


def micro_cases(fmt: Format, c: Cast) -> list[Tensor]:
    """Blocks at a multi-level cast's boundaries: block amaxes whose first-level scale is a
    power of two (elements on exact ties) or sits on a tie of its own roundings (``5·2**j``,
    ``7·2**j`` for HiFloat4's bf16 step, the scale format's midpoints), with each run's
    largest element at, just below and just above every micro-exponent threshold
    ``2**(emax + 1 + i) / r``."""
    micro = c.micro
    if micro is None:
        return []
    bf16 = FORMATS["bfloat16"]
    block, run = micro.block, micro.levels[-1].size if micro.levels else micro.block
    gen = torch.Generator().manual_seed(SEED + 3)
    grid = [float(v.mag) for _, v in fmt.values() if v.kind is Kind.FINITE and not v.negative]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(sorted(set(grid)))]
    peaks = [float(fmt.max * pow2(micro.steps)) * m for m in (1.0, 5 / 7, 1.125, 1.375, 0.9)]
    peaks += _double_rounding_amaxes(fmt, c)
    cases = []
    for j in (-60, -40, -3, 0, 5, 14, 17):
        for peak in peaks:
            amax = torch.tensor(peak * 2.0**j).float()
            _, r, _ = oracle.quantization.micro_first_scale(Fraction(float(amax)), fmt, micro, bf16)
            tops = []
            for i in range(micro.steps + 1):
                t = torch.tensor(float(pow2(fmt.emax + 1 + i) / r)).float()
                tops += [v for v in (t, torch.nextafter(t, torch.tensor(0.0)),
                                     torch.nextafter(t, torch.tensor(float("inf"))))
                         if v <= amax]
            tops = tops or [amax]
            x = torch.tensor([mids[i % len(mids)] for i in range(block)]) / float(r)
            x = x * torch.where(torch.rand(block, generator=gen) < 0.5, -1.0, 1.0)
            for start in range(0, block, run):  # each run's largest: a threshold
                x[start] = tops[(start // run) % len(tops)]
            x[block - 1] = amax
            if torch.isfinite(x).all():
                cases.append(x.float())
    return cases


def _rne_significand(v: np.ndarray, bits: int) -> np.ndarray:
    m, e = np.frexp(v)
    return np.ldexp(np.rint(np.ldexp(m, bits)), e - bits)


def _double_rounding_amaxes(fmt: Format, c: Cast) -> list[float]:
    """Under the bf16-reciprocal base: float32 amaxes near the scale format's ties whose
    product with ``rne_bf16(1 / M)``, rounded to float32 before bf16 (a double rounding),
    would give another first-level scale than the exact product: the blocks that tell an
    exact implementation from one computing in float32."""
    micro = c.micro
    if micro is None or micro.base is not MicroBase.BF16_RCP:
        return []
    bf16 = FORMATS["bfloat16"]
    k = float(oracle.rounding.round_exact(bf16, Exact.of(1 / (fmt.max * pow2(micro.steps)))).mag)
    sig = micro.scale_format.mbits + 1
    # the bf16 midpoints beside each tie of the scale format (in [1/2, 1))
    ties = [(2 * i + 1) / 2 ** (sig + 1) + 0.5 + d for i in range(2 ** (sig - 1))
            for d in (-(2.0**-9), 2.0**-9)]
    found = []
    for tie in ties:
        start = np.float32(2 * tie / k).view(np.int32)
        a = (start + np.arange(-4000, 4000, dtype=np.int32)).view(np.float32).astype(np.float64)
        exact = _rne_significand(_rne_significand(a * k, 8), sig)
        via32 = _rne_significand(_rne_significand((a * k).astype(np.float32)
                                                  .astype(np.float64), 8), sig)
        found += [float(v) / 2 for v in a[exact != via32][:2]]
    return found


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


def _fast_scales(blocks: Tensor, c: Cast, group: int) -> Tensor:
    """The scales (float64) the cast's steps choose for each row of ``blocks`` (rows grouped
    by ``group`` into tensors, whose amax the two-level rule reads): the divisor where the
    elements are divided, else the scale (``2**k``, a micro-scaled cast's first level)."""
    if c.micro is not None:
        return group_scales(c, blocks=blocks).value
    amax, _ = block_amax(blocks)
    tensor_amax = amax.reshape(-1, group).amax(dim=1).repeat_interleave(group)
    sc = group_scales(c, amax, tensor_amax=tensor_amax)
    return sc.value if sc.divisor is None else sc.divisor.double()


@cache
def _random_pool(count: int, size: int, seed: int) -> tuple[Tensor, tuple[Fraction, ...]]:
    """Random blocks and their exact amax (Python's max over floats compares exactly)."""
    blocks = random_blocks(count, size, seed)
    return blocks, tuple(Fraction(max(abs(v) for v in row)) for row in blocks.tolist())


def check_blocks(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Block-scaled casts against the oracle: constructed blocks and seeded random blocks."""
    if fmt.bits > 8 or not fmt.signed:
        return
    seen: set[Scaling] = set()
    for c in quick_casts(fmt) if plan.quick else block_casts(fmt):
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
    cases: list[Tensor] = constructed_cases(fmt, c)
    if not plan.quick and random:
        pool = random_blocks(BLOCK_FULL_SAMPLE, size, plan.seed + 7)
        cases += ([pool.reshape(-1, k, k)[i] for i in range(BLOCK_FULL_SAMPLE // 16)]
                  if s.granularity is Granularity.TILE else [pool])
    for case in cases:
        got = cast_quantize(case, c).flatten()
        expected = torch.tensor(_oracle_cast(case, c), dtype=torch.float64)
        raw = case.flatten().view(torch.int32).tolist()
        judge(out, expected, got, partial(_element_bits, raw))
    yield out
    # the scale of many random blocks: the rule's whole job
    if s.granularity is Granularity.TILE or not random:
        return  # a tile's scale is a block's scale; tiling is checked element by element
    rule = s.rule
    if rule is None:
        return  # no scale rule, no scales to check
    exponent_rule = rule.power_of_two
    count = BLOCK_SCALE_SAMPLE if exponent_rule else REAL_SCALE_SAMPLE
    count //= 10 if plan.quick else 1
    group = 8  # two-level: blocks form tensors of 8 blocks, each with its own tensor scale
    count -= count % group
    out = Outcome(fmt.name, "block scales", spec, c.rounding.value, c.overflow.value)
    blocks, amax = _random_pool(count, size, plan.seed + 11)
    got = _fast_scales(blocks, c, group)
    scale_format = s.scale_format or f32
    if c.micro is not None:
        bf16 = FORMATS["bfloat16"]
        want = [
            float(oracle.quantization.micro_first_scale(a, fmt, c.micro, bf16)[0]) for a in amax
        ]
    elif exponent_rule:
        low = oracle.rounding.binade(scale_format.smallest_positive)
        want = [float(pow2(oracle.scaling.pow2_scale_exponent(a, fmt, rule, s.headroom, low,
                                                      scale_format.emax)[0]))
                for a in amax]
    else:
        group_amax = [max(amax[i:i + group]) for i in range(0, len(amax), group)]
        want = [to_float(oracle.quantization.cast_block(
            [Exact.of(a)], fmt, scale_format, rule, 0, s.blocked, f32,
            tensor_amax=group_amax[i // group], scale_only=True)[1])
            for i, a in enumerate(amax)]
    judge(out, torch.tensor(want, dtype=torch.float64), got, partial(_block_amax, amax))
    yield out


def _element_bits(raw: list[int], i: int) -> str:
    return f"element {i} float32 0x{raw[i] & 0xFFFFFFFF:08x}"


def _block_amax(amax: tuple[Fraction, ...], i: int) -> str:
    return f"block {i} amax {float(amax[i])!r}"


def cast_quantize(x: Tensor, c: Cast) -> Tensor:
    """The fast path's dequantized values (looked up at call time, so tests can plant faults)."""
    from driftcli.casts.quantization import quantize

    return cast(Tensor, quantize(x, c))

