"""The ``codes`` suite: every code decodes to the reference value and round-trips."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from driftcli.casts import codec, rounding
from driftcli.records.formats import Format
from driftcli.records.modes import DEFAULT_SR_BITS
from driftcli.verify.compare import (
    FAILURE_CAP,
    Outcome,
    Plan,
    cells,
    hex_code,
    judge,
    round_table,
    to_float,
)


def check_codes(fmt: Format, plan: Plan) -> Iterator[Outcome]:
    """Every code decodes to the reference value and round-trips through every cast."""
    if fmt.bits > 16:
        return
    reference = [v for _, v in fmt.values()]
    codes = torch.arange(1 << fmt.bits)
    decoded = codec.decode(codes, fmt)
    out = Outcome(fmt.name, "codes", "decode", "-", "-")
    judge(out, torch.tensor([to_float(v) for v in reference], dtype=torch.float64), decoded,
           lambda i: hex_code(fmt, i))
    yield out
    # a value on the grid is its own rounding under every mode and policy
    finite = torch.isfinite(decoded)
    # a symmetric integer format's most negative code decodes but is off its grid (-128 of
    # int8_sym rounds to -127): the rounding is checked above, its code is not its own
    on_grid = finite & (decoded >= float(fmt.min)) & (decoded <= float(fmt.max))
    exact_codes = codes.clone()
    nan = codec.nan_code(fmt)
    if nan is not None:
        exact_codes[torch.isnan(decoded)] = nan
    top = (1 << DEFAULT_SR_BITS) - 1
    checked = cells(fmt, plan)
    # every cell's expected values at once, so each value's bracket is found once
    expected = round_table(fmt, [(v, [(mode, policy, top, DEFAULT_SR_BITS)
                                      for mode, policy in checked]) for v in reference])
    for k, (mode, policy) in enumerate(checked):
        out = Outcome(fmt.name, "codes", "roundtrip", mode.value, policy.value)
        bits = torch.full(codes.shape, top, dtype=torch.int32)
        got = rounding.round_to_format(decoded, fmt, rounding=mode, overflow=policy,
                                       random_bits=bits)
        judge(out, expected[:, k].contiguous(), got, lambda i: hex_code(fmt, i))
        back = codec.encode(torch.where(finite, got, decoded), fmt) if out.n_failed == 0 \
            else exact_codes
        wrong = (back != exact_codes) & on_grid
        out.n_failed += int(wrong.sum())
        for i in wrong.nonzero().flatten()[:FAILURE_CAP].tolist():
            out.failures.append((hex_code(fmt, i), hex_code(fmt, i), hex_code(fmt, int(back[i]))))
        yield out

