"""The cast's public steps (:mod:`driftcli.casts.route`): each against the exact oracle and
against the steps ``quantize`` takes, on edge groups (all zero, NaN, inf, subnormal and huge
amaxes, amaxes beside powers of two and element maxima), and the torch and numba back-ends bit
for bit."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from kernel_paths import PATHS, kernel_path

from driftcli import oracle
from driftcli.casts.quantization import QuantInfo, quantize
from driftcli.casts.route import (
    GroupScales,
    block_amax,
    block_summary,
    cast_elements,
    fused_summary,
    group_ranges,
    group_scales,
    key_counts,
)
from driftcli.errors import DriftError
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS, Exact
from driftcli.records.modes import Granularity, ScaleRule
from driftcli.verify.blocks import rule_casts
from driftcli.verify.compare import to_float

F32 = FORMATS["float32"]


def _edge_blocks(k: int) -> torch.Tensor:
    """Rows of ``k`` float32: each row's amax one of the edge values (its other elements
    smaller, both signs), then an all-zero row, a row of -0, rows holding NaN, inf and -inf."""
    peaks = [2.0**-149, 2.0**-140, 2.0**-127, 2.0**-126, 1e-30, 0.5, 1.0, 6.0, 448.0, 3.0,
             57344.0, 2.0**100, 3e38, float(torch.finfo(torch.float32).max)]
    edge = []
    for p in peaks:
        v = torch.tensor(p, dtype=torch.float32)
        edge += [v, torch.nextafter(v, torch.tensor(0.0)), torch.nextafter(v, torch.tensor(1e39))]
    tops = torch.stack([t for t in edge if torch.isfinite(t) and t > 0])
    gen = torch.Generator().manual_seed(41)
    rows = torch.rand(len(tops), k, generator=gen) * tops[:, None] * 0.9
    rows[:, 0] = tops
    rows[1::2, 0] *= -1  # the amax negative in every other row
    special = torch.rand(5, k, generator=gen)
    special[0] = 0.0
    special[1] = -0.0
    special[2, 3], special[3, 1], special[4, 2] = float("nan"), float("inf"), float("-inf")
    return torch.cat([rows, special]).contiguous()


def _every_rule() -> list[Cast]:
    """Every scale rule's checked casts (:func:`driftcli.verify.blocks.rule_casts`) on an
    8-bit and a 4-bit element format: a new rule is tested with no edit here."""
    return [c for fmt in ("float8_e4m3fn", "float4_e2m1fn") for rule in ScaleRule
            for c in rule_casts(FORMATS[fmt], rule)]


def _on_each_path(fn):  # type: ignore[no-untyped-def]
    got = {}
    for path in PATHS:
        with kernel_path(path):
            got[path] = fn()
    return got


def test_block_amax_is_the_largest_finite_magnitude_on_each_back_end() -> None:
    blocks = _edge_blocks(32)
    got = _on_each_path(lambda: block_amax(blocks))
    (top, bad), (top2, bad2) = got["torch"], got["jit"]
    assert torch.equal(top, top2) and torch.equal(bad, bad2)
    for row, t, b in zip(blocks.tolist(), top.tolist(), bad.tolist(), strict=True):
        finite = [abs(Fraction(v)) for v in row if abs(v) != float("inf") and v == v]
        assert Fraction(t) == max(finite, default=Fraction(0))  # the exact max
        assert b == (len(finite) < len(row))
    assert bad.tolist()[-3:] == [True] * 3 and int(bad.sum()) == 3


def _oracle_scale(c: Cast, amax: Fraction, tensor_amax: Fraction) -> float:
    s = c.scaling
    assert s.rule is not None and s.scale_format is not None
    _, scale, _ = oracle.quantization.cast_block(
        [Exact.of(amax)], c.format, s.scale_format, s.rule, s.headroom, s.blocked, F32,
        tensor_amax=tensor_amax, scale_only=True)
    return to_float(scale)


def _applied(sc: GroupScales) -> torch.Tensor:
    """What the elements meet: the divisor, or the power of two."""
    return sc.value if sc.divisor is None else sc.divisor.double()


@pytest.mark.parametrize("c", _every_rule(), ids=str)
def test_group_scales_are_the_oracles_on_each_back_end(c: Cast) -> None:
    blocks = _edge_blocks(c.scaling.block or 32)
    amax, _ = block_amax(blocks)
    got = _on_each_path(lambda: group_scales(c, amax))
    a, b = got["torch"], got["jit"]
    assert torch.equal(a.value, b.value)
    pow2 = c.scaling.rule is not None and c.scaling.rule.power_of_two
    assert (a.exponent is None) == (b.exponent is None) == (not pow2)
    if a.exponent is not None and b.exponent is not None:
        assert torch.equal(a.exponent, b.exponent)
        assert torch.equal(a.value, torch.ldexp(torch.ones_like(a.value), a.exponent.double()))
    if a.divisor is not None and b.divisor is not None:
        assert torch.equal(a.divisor, b.divisor)
    top = Fraction(float(amax.max()))
    want = [_oracle_scale(c, Fraction(v), top) for v in amax.tolist()]
    assert _applied(a).tolist() == want


@pytest.mark.parametrize("spec", ["mxfp8_e4m3", "nvfp4", "float8_e4m3fn:block32:amax-rne",
                                  "float4_e2m1fn:block32:even-e2m1"])
def test_group_scales_are_what_quantize_divides_by(spec: str) -> None:
    c = parse_cast(spec)
    x = _edge_blocks(c.scaling.block)
    for path in PATHS:
        with kernel_path(path):
            info = quantize(x, c, return_info=True)
            assert isinstance(info, QuantInfo)
            amax, bad = block_amax(x)
            sc = group_scales(c, amax)
        live = ~bad
        assert torch.equal(_applied(sc)[live], info.scales[live]), path


def test_two_level_scales_take_the_given_tensor_amax_per_group() -> None:
    # eight groups per "tensor", each its own tensor amax (as verify's block scales read it)
    c = parse_cast("nvfp4")
    blocks = _edge_blocks(16)[:40]
    amax, _ = block_amax(blocks)
    tops = amax.reshape(-1, 8).amax(dim=1).repeat_interleave(8)
    got = _on_each_path(lambda: group_scales(c, amax, tensor_amax=tops))
    assert torch.equal(got["torch"].divisor, got["jit"].divisor)
    want = [_oracle_scale(c, Fraction(a), Fraction(t))
            for a, t in zip(amax.tolist(), tops.tolist(), strict=True)]
    assert got["torch"].divisor.double().tolist() == want
    # the block scale is a value of E4M3 (the divisor is it times the tensor scale)
    assert got["torch"].value.tolist() != want


def test_micro_scales_read_the_groups_elements() -> None:
    c = parse_cast("hifloat4")
    assert c.micro is not None
    blocks = _edge_blocks(c.micro.block)[:-3]  # finite groups
    got = _on_each_path(lambda: group_scales(c, blocks=blocks))
    assert torch.equal(got["torch"].value, got["jit"].value)
    bf16 = FORMATS["bfloat16"]
    want = [float(oracle.quantization.micro_first_scale(
        max(abs(Fraction(v)) for v in row), c.format, c.micro, bf16)[0])
        for row in blocks.tolist()]
    assert got["torch"].value.tolist() == want
    with pytest.raises(DriftError, match="give blocks="):
        group_scales(c, block_amax(blocks)[0])


@pytest.mark.parametrize("spec", ["mxfp8_e4m3", "nvfp4", "fp8_e4m3", "float8_e4m3fn:block32:amax"])
def test_cast_elements_are_quantizes_values_codes_and_scales(spec: str) -> None:
    c = parse_cast(spec)
    x = _edge_blocks(32)
    for path in PATHS:
        with kernel_path(path):
            info = quantize(x, c, return_info=True)
            got = cast_elements(x, c)
        assert isinstance(info, QuantInfo) and info.codes is not None
        assert torch.equal(got.values.view(torch.int32), info.values.view(torch.int32)), path
        assert _same(got.codes.float(), info.codes.float()), path
        scales = got.scales()
        assert scales.shape == x.shape and scales.dtype == torch.float64
        per = c.scaling.block if c.scaling.granularity is Granularity.BLOCK else x.numel()
        want = info.scales.repeat_interleave(per).reshape(x.shape)
        assert _same(scales, want), path


def test_the_counting_steps_agree_on_each_back_end() -> None:
    c = parse_cast("mxfp8_e4m3")
    sf = c.scaling.scale_format
    assert sf is not None
    x = _edge_blocks(32)[-40:].T.contiguous()  # each column one edge group
    ends = (float(sf.max), 0.0, float(sf.smallest_positive))

    def steps():  # type: ignore[no-untyped-def]
        rows, ranges = group_ranges(x, c.scaling, -1, keep=True)
        _, facts = group_ranges(x, c.scaling, 0, keep=False)  # in place on numba
        _, cols = group_ranges(x, c.scaling, 0, keep=True)
        top, _, span, bad = ranges
        sc = group_scales(c, top)
        clipped = top.double() > sc.value * float(c.format.max)
        summary = block_summary(top, span, bad, True, sc.value, clipped, ends, 17)
        assert sc.exponent is not None
        keys = key_counts(sc.exponent, ~bad)
        return rows, ranges, facts, cols, summary, keys, fused_summary(
            top, span, bad, True, c, ends, 17)

    got = _on_each_path(steps)
    for a, b in zip(got["torch"][:6], got["jit"][:6], strict=True):
        assert _same(a, b)
    assert _same(got["jit"][2], got["jit"][3])  # the columns read in place or cut
    assert got["torch"][6] is None  # the one-pass summary is numba's
    fused = got["jit"][6]
    assert fused is not None
    summary, values, found = fused
    assert _same(summary, got["torch"][4])
    low, counts = got["torch"][5]
    present = counts.nonzero()[:, 0]
    assert values.tolist() == [2.0 ** int(k) for k in present + low]
    assert found.tolist() == counts[present].tolist()


def _same(a: object, b: object) -> bool:
    """Equal, NaN where NaN (any payload); inf stays inf (nan_to_num made it the dtype's max,
    so an inf on one back-end and the largest finite value on the other compared equal)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if not a.is_floating_point():
            return bool(torch.equal(a, b))
        nan = a.isnan()
        return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b, strict=True))
    return a == b


def test_same_tells_inf_from_the_largest_float_and_nan_from_a_number() -> None:
    big = float(torch.finfo(torch.float32).max)
    assert _same(torch.tensor([float("nan"), -0.0, float("inf")]),
                 torch.tensor([float("nan"), 0.0, float("inf")]))
    assert not _same(torch.tensor([float("inf")]), torch.tensor([big]))
    assert not _same(torch.tensor([-float("inf")]), torch.tensor([-big]))
    assert not _same(torch.tensor([float("nan")]), torch.tensor([7.0]))
    assert not _same((torch.tensor([1]), 2), (torch.tensor([1]), 3))
