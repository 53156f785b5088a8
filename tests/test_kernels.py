"""The kernel seam's promise (docs/architecture.md#the-kernel-seam): the torch and numba
back-ends give the same bits for every scale rule, rounding mode, overflow policy and
implementation preset, in a cast's values and in the scan's counts.

The cast values and the counts are compared exactly. The float64 sums of the statistics (Σe²,
Σex, …) are added in another order by each back-end (torch's pairwise reductions against the
numba pass's 4,096-element pieces added with compensation), so they are compared to 1e-12
relative: reordering n float64 additions moves a sum by at most about n·2^-53 of the sum of
magnitudes, about 1e-13 for the 8,192 terms here. A tolerance cannot see a wrong element among
far larger ones, so the values the scan's own pass rounded (``cast_stats``' values, from the same
kernel that counts) are compared bit for bit as well as ``quantize``'s.
"""

from __future__ import annotations

import math

import pytest
import torch

from driftcli import kernels
from driftcli.casts.quantization import quantize
from driftcli.measures.stats import CastStats, cast_stats
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Overflow, Rounding, ScaleRule
from driftcli.records.recipes import IMPLEMENTATION_PRESETS

ELEMENTS = ("float8_e4m3fn", "float8_e5m2", "float6_e3m2fn", "float4_e2m1fn", "int8")
"""Element formats of every kind the kernels branch on: FP8 with and without infinities,
FP6, FP4 (no subnormal-free shortcut), an integer grid."""


def _tensor(rows: int = 64, cols: int = 128, seed: int = 11, *,
            specials: bool = True) -> torch.Tensor:
    """Values over 40 binades across the columns, a few rows far below float32's normals,
    zeros, and (with ``specials``) NaN and inf planted: every branch of a scaled cast is taken
    somewhere. An inf makes a tensor's amax inf and every per-tensor or two-level scale NaN,
    so those casts are also measured without one."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-20, 20, cols, base=2.0)
    x[:2] *= 2.0**-110
    x[9, 31], x[10, 1] = 0.0, -0.0
    if specials:
        x[3, 5], x[7, 0] = math.nan, -math.inf
    return x


def _specs(rule: ScaleRule) -> list[str]:
    """Casts of ``rule`` over every element format, rounding and overflow policy, the
    granularity and scale format turning with them so that each meets several."""
    if rule is ScaleRule.TWO_LEVEL:
        shapes = [("block16", "float8_e4m3fn")]
    elif rule.power_of_two:
        shapes = [("block32", "float8_e8m0fnu"), ("channel", "float32"),
                  ("tile16", "float8_e8m0fnu"), ("tensor", "float32")]
    else:
        shapes = [("block32", "float32"), ("channel", "float32"), ("tile16", "float32"),
                  ("tensor", "float32")]
    specs, turn = [], 0
    for elem in ELEMENTS:
        for rounding in Rounding:
            for overflow in Overflow:
                gran, scale = shapes[turn % len(shapes)]
                turn += 1
                specs.append(f"{elem}:{gran}:{scale}:{rule.value}:{rounding.value}:"
                             f"{overflow.value}")
    return specs


Run = tuple[torch.Tensor, torch.Tensor, CastStats]


def _both(x: torch.Tensor, spec: str) -> tuple[Run, Run]:
    """``quantize``'s values, the scan pass's values and its statistics on the torch back-end,
    then on numba's."""
    out = []
    try:
        for mode in ("never", "auto"):
            kernels.set_jit(mode)
            q = quantize(x, spec, seed=5)
            stats, values = cast_stats(x, spec, seed=5)
            assert values is not None
            out.append((q, values, stats))
    finally:
        kernels.set_jit("auto")
    return out[0], out[1]


def _same(spec: str, a: CastStats, b: CastStats) -> None:
    for field in a.__dataclass_fields__:
        u, v = getattr(a, field), getattr(b, field)
        if isinstance(u, float) and isinstance(v, float):
            assert v == pytest.approx(u, rel=1e-12, abs=1e-300) or (
                math.isnan(u) and math.isnan(v)), f"{spec}: {field} {u} != {v}"
        else:
            assert u == v, f"{spec}: {field} {u} != {v}"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("rule", list(ScaleRule), ids=lambda r: r.value)
def test_every_rule_rounding_and_policy_casts_the_same_bits_on_both_back_ends(
        rule: ScaleRule) -> None:
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    specs = _specs(rule)
    assert len(specs) == len(ELEMENTS) * len(Rounding) * len(Overflow)
    clipped = underflowed = 0
    for n, spec in enumerate(specs):
        parse_cast(spec)  # every combination here is a valid cast
        x = _tensor(seed=n, specials=n % 2 == 0)
        (qt, vt, st), (qn, vn, sn) = _both(x, spec)
        assert _bits_equal(qt, qn) and _bits_equal(vt, vn) and _bits_equal(qt, vt), spec
        _same(spec, st, sn)
        clipped += st.clipped
        underflowed += st.underflowed or 0
    # the grid reached the branches it is there for
    assert underflowed > 0
    assert clipped > 0 or rule.covers_amax


@pytest.mark.parametrize("name", sorted(IMPLEMENTATION_PRESETS))
def test_every_implementation_preset_casts_the_same_bits_on_both_back_ends(name: str) -> None:
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    # 256 x 256 holds DeepSeek's 128 x 128 blocks and TE's 2D tiles whole
    x = _tensor(256, 256, seed=12, specials=False)
    spec = IMPLEMENTATION_PRESETS[name].cast
    (qt, vt, st), (qn, vn, sn) = _both(x, spec)
    assert _bits_equal(qt, qn) and _bits_equal(vt, vn) and _bits_equal(qt, vt), name
    _same(name, st, sn)
    assert st.underflowed > 0


def test_the_comparison_sees_one_wrong_element() -> None:
    """The checker's planted fault: one element moved by a step of its grid fails the bit
    comparison wherever it is; moved among the largest, it also fails the sums' tolerance."""
    x = _tensor()
    stats, q = cast_stats(x, "mxfp8_e4m3")
    assert q is not None
    kept = torch.isfinite(x) & torch.isfinite(q)  # a block holding NaN is lost whole
    for where in (0, -1):  # the smallest finite nonzero value and the largest
        order = torch.argsort(torch.where(kept & (q != 0), q.abs(), math.inf).flatten())
        i = int(order[where if where == 0 else int((kept & (q != 0)).sum()) - 1])
        bad = q.clone().flatten()
        bad[i] *= 1 + 2.0**-3  # one step of E4M3's grid
        bad = bad.reshape(q.shape)
        assert not _bits_equal(q, bad)
        e_true = float(((q - x)[kept].double() ** 2).sum())
        e_bad = float(((bad - x)[kept].double() ** 2).sum())
        assert stats.ee == pytest.approx(e_true, rel=1e-12)
        assert (e_bad == pytest.approx(e_true, rel=1e-12)) == (where == 0)
