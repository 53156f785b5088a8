"""The ``float32-inputs`` suite: casts of float32 values at and around every rounding
boundary of a format."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from driftcli.casts import codec, rounding
from driftcli.records.formats import Format, pow2
from driftcli.records.modes import DEFAULT_SR_BITS, Overflow, Rounding
from driftcli.verify.compare import Outcome, Plan, exact_of_float, judge, round_table

Tensor = torch.Tensor


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

    top = (1 << DEFAULT_SR_BITS) - 1
    sr_draws: list[Tensor | None] = [torch.zeros(x.shape, dtype=torch.int32),
                                     torch.full(x.shape, top, dtype=torch.int32),
                                     rounding.draw_random_bits(x.shape, plan.seed)]
    cells = [(mode, policy, sr_draws if mode is Rounding.SR else [None])
             for mode in Rounding for policy in Overflow]
    # every cast's expected values at once, so each value's bracket is found once
    columns = [(mode, policy, [0] * len(exact) if bits is None else bits.tolist())
               for mode, policy, draws in cells for bits in draws]
    expected = round_table(fmt, [(v, [(mode, policy, d[i], DEFAULT_SR_BITS)
                                      for mode, policy, d in columns])
                                 for i, v in enumerate(exact)])
    k = 0
    for mode, policy, draws in cells:
        out = Outcome(fmt.name, "float32-inputs", "cast", mode.value, policy.value)
        for bits in draws:
            got = rounding.round_to_format(x, fmt, rounding=mode, overflow=policy,
                                           random_bits=bits)
            judge(out, expected[:, k].contiguous(), got, describe)
            k += 1
        yield out
