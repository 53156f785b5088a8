"""The ``recipes`` suite: every implementation preset's op sequence against the same sequence
evaluated exactly (:mod:`driftcli.oracle.scalearith`: every float32 operation rounded once, in the
preset's order), value by value and code by code, so a wrong order or a missing rounding in
:mod:`driftcli.casts.scalearith` shows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import cast

import torch

from driftcli.arith.tensorcores import tensor_core
from driftcli.casts.hadamard import transform
from driftcli.casts.quantization import QuantInfo
from driftcli.oracle.blockfma import Unit
from driftcli.oracle.hadamard import hadamard16, hadamard16_blockfma
from driftcli.oracle.quantization import cast_group
from driftcli.oracle.scalearith import amax_of
from driftcli.records.cast import Cast, Rht
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import Exact, Format, Kind, get_format
from driftcli.records.modes import Granularity, ScaleRule
from driftcli.records.recipes import IMPLEMENTATION_PRESETS
from driftcli.verify.blocks import blocks_of, constructed_cases, random_blocks
from driftcli.verify.compare import Outcome, Plan, exact_of_float, judge, to_float

Tensor = torch.Tensor

RECIPE_BLOCKS = 256
"""Seeded random blocks per preset in the full plan (and as many again moved onto the
element grid's midpoints under the preset's own scales); the quick plan takes none."""
LARGE_GROUP = 4096
"""Groups of at least this many elements (128 x 128 tiles) get every twelfth constructed case
in the full plan, the first one in the quick plan: the exact evaluation costs tens of
microseconds per element."""
QUICK_CASES = 12
"""Constructed cases per preset in the quick plan."""
TRANSFORM_CORES = ("a100_bf16_f32", "h100_bf16_f32")
"""The tensor cores a preset's transform is also checked on (``rht=…,tc=``): one of each kind
of bfloat16 unit in ``CORES`` (8 products and 24 bits kept; 16 products and 25 bits)."""


def presets_of(fmt: Format) -> list[str]:
    """The implementation presets whose element format is ``fmt``."""
    return [name for name, p in IMPLEMENTATION_PRESETS.items() if p.cast.format == fmt]


def _group_size(c: Cast) -> int:
    s = c.scaling
    return s.block * s.block if s.granularity is Granularity.TILE else s.block or 32


FOUR_OVER_SIX_BLOCKS = (
    (1536.0, 768.0),  # both candidates exact: a tie at 0, kept at map-to-6
    (1536.0, 1280.0),  # 1280 an E2M1 tie under map-to-6: map-to-4 wins
    (1536.0, 1344.0, -1344.0, 5.25 * 256),  # equal nonzero errors: a tie
    # found by a seeded search: map-to-4 or map-to-6 by the order of the MAE sum (the two
    # sums differ in their last bit when added from the last element)
    (1536.0, 500.7586975097656, -63.88329315185547, -1279.8004150390625, -384.05908203125,
     -768.00537109375, 1344.5618896484375, 439.3720703125, -578.7420654296875,
     483.65057373046875, -1536.0, 893.8468017578125, 275.6475524902344, -63.6159782409668,
     -1273.1719970703125, -992.3137817382812),
    # the same for the fast (FP16) error path
    (1536.0, -700.727294921875, 1348.2852783203125, -127.89717864990234, -495.9152526855469,
     -1536.0, 384.109375, 1153.4844970703125, 960.0608520507812, -675.4094848632812,
     -576.0596923828125, -1153.0875244140625, 1344.02099609375, 639.7029418945312,
     0.43209803104400635, -1023.8630981445312),
)
"""Blocks that part four over six's choices: ties between the two errors, a win of map-to-4,
and sums whose order decides (each its own tensor, so amax 1536 gives S_enc = 1)."""


def four_over_six_cases() -> list[Tensor]:
    """:data:`FOUR_OVER_SIX_BLOCKS` as 1 x 16 tensors (zero padded)."""
    out = []
    for head in FOUR_OVER_SIX_BLOCKS:
        x = torch.zeros(1, 16)
        x[0, : len(head)] = torch.tensor(head)
        out.append(x)
    return out


ORDER_TILES = 64
"""Tiles :func:`four_over_six_tile_case` draws (about one in ten parts the two orders of the
sum)."""
ORDER_PARTED = (11, 14, 24, 29, 34, 45, 46, 50, 59)
"""The drawn tiles (seed 27) whose choice the sum's order decides under MAE (11, 14, 29, 34,
50, 59) or MSE (24, 29, 45, 46, 59), each error path: found by summing the row errors in row
order instead (tests/test_fouroversix.py plants that and checks these part)."""


def four_over_six_tile_case(seed: int = 27, keep: tuple[int, ...] | None = ORDER_PARTED
                            ) -> Tensor:
    """16 x 16 tiles stacked along the rows (each with 1536, so S_enc = 1) whose choice the
    order of the tile's sum can decide: rows 1-15 of values 320 + δ, 0 < δ < 64, whose
    map-to-4 and map-to-6 errors are equal (both round to 384), and a first row whose two
    errors differ by a few ulps (576 - ε and 128 + ε'): the row errors added by halves and in
    row order can then tie in one order and not in the other. ``keep``: the drawn tiles kept
    (None: all :data:`ORDER_TILES`)."""
    gen = torch.Generator().manual_seed(seed)
    x = 320 + torch.rand(ORDER_TILES, 16, 16, generator=gen) * 64
    x[:, 0] = 0.0
    x[:, 0, 0] = 1536.0
    eps = torch.rand(ORDER_TILES, generator=gen) * 32
    ulps = torch.randint(-3, 4, (ORDER_TILES,), generator=gen, dtype=torch.int32)
    x[:, 0, 1] = 576 - eps
    x[:, 0, 2] = ((128 + eps).view(torch.int32) + ulps).view(torch.float32)
    if keep is not None:
        x = x[list(keep)]
    return x.reshape(-1, 16)


def row_scaled_case() -> Tensor:
    """Rows of two blocks whose amaxes lie 2**-20 apart: under one tensor amax the small row's
    block scale rounds to E4M3's zero, under its own it is 448 (a row-scaled cast's check)."""
    return torch.tensor([[2688.0] + [0.0] * 15 + [1.0] * 16, [3e-3, 1e-3] + [0.0] * 30,
                         [0.5, -0.25] + [2.0**-20] * 30])


TC_HEADS: tuple[tuple[float, ...], ...] = (
    (1.0, 3 * 2.0**-8, -(2.0**-25)) + (0.0,) * 13,
    (1.0, 2.0**-8) + (2.0**-25,) * 14,
    (2.0**20, -(2.0**20), 2.0**-30, 2.0**-31) + (0.0,) * 12,
    (2.0**-135,) * 15 + (3 * 2.0**-135,),
    (1.0, -(2.0**-24)) * 8,
)
"""Groups (as the ``v_i`` of :func:`rht_cases`, every ``x_i`` a bfloat16 value) that part a
tensor core's transform (``tc=``) from the float32 sum in order and its units from each other:
1 + 3·2**-8 (a bfloat16 tie whose even neighbour is above) less 2**-25, rounded toward zero
into float32 where the unit keeps 25 bits (1 + 2**-7), to the tie where it keeps 24 or adds in
order (1 + 2**-6); 1 + 2**-8 and fourteen 2**-25, past the tie where all are kept; a
cancellation of 2**20 that leaves terms the unit has cut; bfloat16's smallest subnormals;
alternating terms 24 binades apart."""


def rht_cases(c: Cast, plan: Plan) -> list[Tensor]:
    """Groups that part the random Hadamard transform's roundings (each a tensor, its values
    ``4 · s_i · v_i`` so that column 0 sums the ``v_i``): a bfloat16 tie that the order of the
    float32 sum decides (1 + 2**-8 and fifteen terms below half an ulp: 1.0 in order, 1 + 2**-7
    summed exactly), products below float32's subnormals, a sum past float32's max, inf, -inf
    and NaN, exact cancellation; with ``tc=`` also :data:`TC_HEADS`; and seeded groups whose
    binades spread over 80."""
    if c.rht is None:
        return []
    signs = torch.tensor(c.rht.signs, dtype=torch.float64)
    heads = [[1 + 2.0**-8] + [2.0**-25] * 15, [2.0**-150] * 16, [2.0**-149, -(2.0**-150)] * 8,
             [3.0e38] * 16, [1.0, float("inf")] + [0.5] * 14, [float("inf"), float("-inf")] * 8,
             [1.0, float("nan")] + [2.0] * 14, [1.0, -1.0] * 8, [2.0**24, 1.0, 1.0] + [0.5] * 13]
    if c.rht.core:  # a tensor core's transform: its own partings too
        heads += [list(h) for h in TC_HEADS]
    out = [(signs * torch.tensor(h, dtype=torch.float64) * 4).float() for h in heads]
    gen = torch.Generator().manual_seed(plan.seed + 23)
    n = 8 if plan.quick else 64
    mag = torch.exp2(torch.randint(-40, 41, (n, 16), generator=gen).double())
    sig = 1 + torch.randint(0, 1 << 23, (n, 16), generator=gen).double() * 2.0**-23
    sign = torch.where(torch.rand(n, 16, generator=gen) < 0.5, -1.0, 1.0).double()
    out.append((sign * sig * mag).float())
    return out


def _padded(x: Tensor) -> Tensor:
    """``x`` zero padded along its last axis to whole groups of 16 (what ``rht=`` needs)."""
    x = x.reshape(1) if x.dim() == 0 else x
    extra = -x.shape[-1] % 16
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


def recipe_cases(fmt: Format, c: Cast, plan: Plan) -> list[Tensor]:
    """The tensors one preset is checked on: drift's constructed blocks (amax at and beside
    powers of two and element maxima, ties, NaN, inf, zeros, partial blocks and tiles); in the
    full plan also seeded random blocks and the same blocks moved onto the element grid and its
    midpoints times each block's own scale, one ulp either side (as tensors of 8 blocks where
    the scale reads the tensor's amax)."""
    cases = constructed_cases(fmt, c)
    if _group_size(c) >= LARGE_GROUP:
        cases = cases[:1] if plan.quick else cases[::12]
    elif plan.quick:
        cases = cases[:QUICK_CASES - 3] + cases[-5:-2]  # and NaN, inf, -inf
    if c.scaling.arithmetic.two.four_over_six:
        cases = cases + four_over_six_cases()
        if c.scaling.granularity is Granularity.TILE:
            cases.append(four_over_six_tile_case())
    if c.scaling.arithmetic.two.row_scaled:
        cases = [*cases, row_scaled_case()]
    if c.rht is not None:
        cases = [_padded(x) for x in cases] + rht_cases(c, plan)
    if plan.quick or c.scaling.granularity is Granularity.TILE:
        return cases
    k = c.scaling.block or 32
    blocks = random_blocks(RECIPE_BLOCKS, k, plan.seed + 13)
    scales = cast_info(blocks, c).scales.float()
    per_row = scales if scales.numel() == blocks.shape[0] else scales.expand(blocks.shape[0])
    grid = torch.tensor(sorted({float(v.value) for _, v in fmt.values()
                                if v.kind is Kind.FINITE and v.value >= 0}))
    mids = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    gen = torch.Generator().manual_seed(plan.seed + 17)
    pick = mids[torch.randint(0, len(mids), blocks.shape, generator=gen)]
    moved = (pick * per_row[:, None]).view(torch.int32) + torch.randint(
        -1, 2, blocks.shape, generator=gen, dtype=torch.int32)
    moved = torch.where(pick == 0, 0.0, moved.view(torch.float32))
    amax = blocks.abs().amax(dim=1, keepdim=True)
    moved = torch.where(moved.abs() <= amax, moved, blocks)
    moved[:, 0] = blocks[:, 0]
    for rows in (blocks, moved):
        if c.scaling.granularity is Granularity.TENSOR or c.scaling.rule is ScaleRule.TWO_LEVEL:
            cases += list(rows.reshape(-1, 8, k))
        else:
            cases.append(rows)
    return cases


def cast_info(x: Tensor, c: Cast) -> QuantInfo:
    """The fast path's cast with its codes (looked up at call time, so tests can plant
    faults)."""
    from driftcli.casts.quantization import quantize

    return cast(QuantInfo, quantize(x, c, return_info=True))


def exact_transform(values: list[Exact], rht: Rht) -> list[Exact]:
    """The exact twin of ``rht`` on flat ``values`` (whole groups of 16): the float32 sum in
    order, or with ``tc=`` the tensor core's block-FMA unit (its parameters read from
    ``CORES`` here, as the oracle reads no fast-path module)."""
    entries = rht.entries()
    if not rht.core:
        return [y for i in range(0, len(values), 16) for y in hadamard16(values[i:i + 16], entries)]
    core = tensor_core(rht.core)
    u = core.unit
    unit = Unit(u.size, u.kept_bits, u.min_exp, u.interleave)
    acc = get_format(core.acc)
    return [y for i in range(0, len(values), 16)
            for y in hadamard16_blockfma(values[i:i + 16], entries, unit, core.input_format, acc,
                                         core.rounding)]


def oracle_recipe(case: Tensor, c: Cast) -> tuple[list[Exact], list[Exact]]:
    """The exact values and codes of a whole tensor (flat), group by group."""
    values = [exact_of_float(v) for v in case.flatten().tolist()]
    if c.rht is not None:  # the cast reads the transform of each run of 16 along the last axis
        values = exact_transform(values, c.rht)
    s = c.scaling
    tensor_amax = amax_of(values, s.arithmetic.amax)
    out: list[Exact] = list(values)
    codes: list[Exact] = list(values)
    cols = case.shape[-1] if case.dim() else 1
    # four over six sums a tile's errors row by row: its groups keep their 16 x 16 places
    tiled = s.granularity is Granularity.TILE and s.arithmetic.two.four_over_six
    zero = exact_of_float(0.0)
    for idx in (whole_tiles(case, s.block) if tiled else blocks_of(case, c)):
        top = tensor_amax
        if s.arithmetic.two.row_scaled:  # the amax of the group's row
            start = next(i for i in idx if i is not None) // cols * cols
            top = amax_of(values[start:start + cols], s.arithmetic.amax)
        deq, code, _ = cast_group([zero if i is None else values[i] for i in idx], c.format,
                                  s, top, c.rounding, c.overflow)
        for i, v, q in zip(idx, deq, code, strict=True):
            if i is not None:
                out[i], codes[i] = v, q
    return out, codes


def whole_tiles(case: Tensor, k: int) -> list[list[int | None]]:
    """Flat indices of each k x k tile of a 1-D (one row) or 2-D ``case``, row by row, None
    where the tile passes the tensor's edge (its zero padding)."""
    rows, cols = (1, case.numel()) if case.dim() < 2 else tuple(case.shape)
    return [[r * cols + j if r < rows and j < cols else None
             for r in range(i, i + k) for j in range(b, b + k)]
            for i in range(0, rows, k) for b in range(0, cols, k)]


def check_recipe(fmt: Format, name: str, plan: Plan) -> Iterator[Outcome]:
    """One implementation preset: its values and its codes against the exact evaluation."""
    c = parse_cast(name)
    values = Outcome(fmt.name, "recipes", f"{name} value", c.rounding.value, c.overflow.value)
    codes = Outcome(fmt.name, "recipes", f"{name} code", c.rounding.value, c.overflow.value)
    for case in recipe_cases(fmt, c, plan):
        got = cast_info(case, c)
        exact_values, exact_codes = oracle_recipe(case, c)
        want = torch.tensor([to_float(v) for v in exact_values], dtype=torch.float64)
        raw = case.flatten().view(torch.int32).tolist()

        def describe(i: int, raw: list[int] = raw) -> str:
            return f"element {i} float32 0x{raw[i] & 0xFFFFFFFF:08x}"

        judge(values, want, got.values.flatten(), describe)
        # a fast path that gave no codes disagrees on every code (NaN against each)
        got_codes = got.codes if got.codes is not None else torch.full_like(got.values, torch.nan)
        shown = ~torch.isnan(want)  # a NaN value has no code to compare
        want_codes = torch.tensor([to_float(q) for q in exact_codes], dtype=torch.float64)
        judge(codes, torch.where(shown, want_codes, torch.nan),
              torch.where(shown, got_codes.flatten().double(), torch.nan), describe)
    yield values
    yield codes
    if c.rht is not None:
        yield check_transform(fmt, name, c, plan)
        for core in TRANSFORM_CORES:  # the same transform on a tensor core (rht=…,tc=)
            yield check_transform(fmt, f"{name},tc={core}", replace(c, rht=replace(c.rht,
                                                                                   core=core)),
                                  plan)


def check_transform(fmt: Format, name: str, c: Cast, plan: Plan) -> Outcome:
    """A preset's random Hadamard transform alone (what its cast reads) against the exact twin
    (:func:`driftcli.oracle.hadamard.hadamard16`), on the preset's cases: a transform error that
    the cast's rounding hides still shows here."""
    if c.rht is None:
        raise ValueError(f"{name} has no rht= to check")  # a caller's bug, not user input
    out = Outcome(fmt.name, "recipes", f"{name} transform", c.rounding.value, c.overflow.value)
    for case in recipe_cases(fmt, c, plan):
        values = [exact_of_float(v) for v in case.flatten().tolist()]
        want = torch.tensor([to_float(y) for y in exact_transform(values, c.rht)],
                            dtype=torch.float64)
        raw = case.flatten().view(torch.int32).tolist()

        def describe(i: int, raw: list[int] = raw) -> str:
            return f"group {i // 16} output {i % 16} (element float32 0x{raw[i] & 0xFFFFFFFF:08x})"

        judge(out, want, transform(case, c.rht).flatten(), describe)
    return out


def check_recipes(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Every implementation preset on ``fmt`` (``drift formats --presets``)."""
    for name in presets_of(fmt):
        yield from check_recipe(fmt, name, plan)

