"""The fused clip pass (:func:`driftcli.measures.stats.clip_stats`, one read of a slice for
every cast of a scan) against the torch back-end's :func:`~driftcli.measures.stats.cast_stats`.

Counts are compared exactly. The float64 sums (the clip excess, Σ|x|) are added by the pass in
the vector lanes its machine code holds, and by torch in its pairwise reductions: they agree to
1e-12 relative (reordering n float64 additions of positive terms moves a sum by at most about
n·2^-53 of it, about 1e-12 for the 8,192 terms of :func:`test_kernels._tensor`). The pass's
sums are the same bits for any thread count, as its pieces are fixed and added in order; a
slicing into whole pieces changes only how the slices' totals are added (a few roundings of
the total: 1e-12 holds with room).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import ELEMENTS, _same, _tensor

from driftcli import kernels
from driftcli.casts.route import ScaleStep, flat_route
from driftcli.measures.stats import CastStats, cast_stats, clip_stats
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Overflow, ScaleRule


def _specs() -> list[str]:
    """Every scale rule over every element format and overflow policy, at every granularity
    the pass takes (blocks of 16 and 32, a tensor scale, none) and one it does not (a
    channel)."""
    specs = []
    for elem in ELEMENTS:
        for overflow in Overflow:
            specs.append(f"{elem}:none:rne:{overflow.value}")
            for rule in ScaleRule:
                if rule is ScaleRule.TWO_LEVEL:
                    specs.append(f"{elem}:block16:float8_e4m3fn:two-level:rne:{overflow.value}")
                    continue
                scale = "float8_e8m0fnu" if rule.power_of_two else "float32"
                for gran in ("block32", "block16", "tensor", "channel"):
                    form = "float32" if gran in ("tensor", "channel") else scale
                    specs.append(f"{elem}:{gran}:{form}:{rule.value}:rne:{overflow.value}")
    return specs


def _torch_stats(x: torch.Tensor, spec: str, tensor_amax: float | None) -> CastStats:
    kernels.set_jit("never")
    try:
        return cast_stats(x, spec, want_values=False, rounded=False, tensor_amax=tensor_amax)[0]
    finally:
        kernels.set_jit("auto")


@pytest.mark.parametrize("specials", [False, True])
def test_every_cast_the_pass_takes_counts_as_the_torch_back_end(specials: bool) -> None:
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    x = _tensor(seed=3, specials=specials)  # 64 x 128
    specs = _specs()
    got = clip_stats(x, list(specs))
    taken = {flat_route(parse_cast(s), (64, 128), -1, x.dtype) is not None for s in specs}
    assert taken == {True, False}
    # every scale step the pass has was taken
    kinds = {r.kind for s in specs if (r := flat_route(parse_cast(s), (64, 128), -1, x.dtype))}
    assert kinds == set(ScaleStep)
    clipped = 0
    counted = set()
    for i, spec in enumerate(specs):
        route = flat_route(parse_cast(spec), (64, 128), -1, x.dtype)
        if route is None or i not in got:
            # a cast the pass leaves out is counted by cast_stats (the same numbers): what
            # the pass returns must be right, and it must take every kind of step
            assert route is not None or i not in got, spec
            continue
        _same(spec, _torch_stats(x, spec, None), got[i])
        counted.add(route.kind)
        clipped += got[i].clipped
    assert counted == set(ScaleStep) and len(got) > len(specs) // 2
    assert clipped > 0  # the grid reached the clipping branch


def test_a_slice_reads_the_tensor_amax_it_is_given() -> None:
    """A slice of a larger tensor: its tensor scale and two-level scales come from the whole
    tensor's amax, as the torch back-end's."""
    x = _tensor(seed=4, specials=False)
    specs = ["fp8_e4m3", "nvfp4", "mxfp8_e4m3", "float8_e4m3fn:tensor:float32:ceil"]
    amax = float(x.abs().max()) * 3
    got = clip_stats(x[20:40], specs, tensor_amax=amax)
    assert sorted(got) == [0, 1, 2, 3]
    for i, spec in enumerate(specs):
        _same(spec, _torch_stats(x[20:40], spec, amax), got[i])


def test_a_planted_clip_is_counted() -> None:
    """The checker's planted fault: one element planted where the floor rule's scale cannot
    hold it (amax 464: scale 2**0, and 464 > 448) is the one clip counted; one it can hold
    (400) is none."""
    x = torch.ones(4, 64)
    assert clip_stats(x, ["mxfp8_e4m3"])[0].clipped == 0
    x[2, 40] = 400.0
    assert clip_stats(x, ["mxfp8_e4m3"])[0].clipped == 0
    x[2, 40] = 464.0
    got = clip_stats(x, ["mxfp8_e4m3"])[0]
    assert got.clipped == got.clipped_groups == _torch_stats(x, "mxfp8_e4m3", None).clipped == 1
    assert got.clip_excess == 16.0


def test_the_sums_are_the_same_bits_for_any_thread_count() -> None:
    """Pieces are fixed and their sums added exactly: one thread or two, the same bits, and a
    slicing on the pieces' boundaries (rows of 4096) the same bits too."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(256, 4096, generator=gen) * torch.exp(torch.randn(256, 4096, generator=gen))
    specs = ["fp8_e4m3", "mxfp8_e4m3", "nvfp4"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = clip_stats(x, specs)
        torch.set_num_threads(2)
        two = clip_stats(x, specs)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    amax = float(x.abs().max())
    for i, spec in enumerate(specs):
        parts = [clip_stats(x[a:a + 37], specs, tensor_amax=amax)[i] for a in range(0, 256, 37)]
        merged = CastStats.merge(parts, per_tensor=spec == "fp8_e4m3")
        assert merged == one[i], spec
        assert one[i].clipped > 0 or spec == "fp8_e4m3"
