"""Implementation presets: the scale arithmetic grammar, conformance with torchao itself (bit for
bit, on boundary-built data and on every weight of stories260K), and each class of difference
between implementations, constructed and shown on every implementation.

torchao 0.18.0 (the dev extra) runs on CPU; every ``torchao/...`` preset is compared with
torchao's own functions element by element: the bits of the dequantized float32 values
everywhere, and the bits of the decoded codes wherever the dequantized value is not NaN (a
group whose scale is NaN is NaN whatever its codes, and torchao's FP4/FP6 packing gives NaN
no code of its own)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from recipe_data import (
    block_of,
    boundary_rows,
    differences,
    info_of,
    requires_stories,
    stories_weights,
    tensors,
)

import driftcli as drift
from driftcli.casts.quantization import QuantInfo
from driftcli.errors import CastSpecError
from driftcli.records.cast import ARITHMETIC_KEYS, Cast, ScaleArithmetic, Scaling
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS, Format
from driftcli.records.modes import (
    AmaxPolicy,
    ElementOp,
    Granularity,
    Guard,
    Pow2,
    Precision,
    ScaleOp,
    ScaleRule,
    SmallestRcp,
    TwoLevelOrder,
)
from driftcli.records.recipes import IMPLEMENTATION_PRESETS, TORCHAO

TORCHAO_PRESETS = [n for n, p in IMPLEMENTATION_PRESETS.items() if p.implementation is TORCHAO]


# --- the grammar ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(IMPLEMENTATION_PRESETS))
def test_every_implementation_preset_round_trips_and_names_its_source(name: str) -> None:
    p = IMPLEMENTATION_PRESETS[name]
    assert parse_cast(name) == p.cast
    assert parse_cast(str(p.cast)) == p.cast
    assert not p.cast.scaling.arithmetic.exact  # drift's exact cast is another one
    assert parse_cast(p.exact).scaling.arithmetic.exact
    assert parse_cast(p.exact).format == p.cast.format
    assert name.startswith(f"{p.implementation.name}/")
    assert re.search(r"\w\.(py|cuh?|h) ", p.source)  # a file and a function


def _arithmetic_for(rule: ScaleRule, scale_format: Format) -> st.SearchStrategy[ScaleArithmetic]:
    number = st.sampled_from([0.0, 1e-12, 1e-4, 2.0**-126, 2.0**-6, 0.1])
    policy = st.sampled_from(list(AmaxPolicy))
    if rule is ScaleRule.TWO_LEVEL:
        return st.builds(ScaleArithmetic, amax=policy, two=st.sampled_from(list(TwoLevelOrder)))
    if rule.power_of_two:
        pow2 = st.sampled_from(list(Pow2) if rule is ScaleRule.CEIL else [Pow2.BITS])
        return pow2.flatmap(lambda p: st.sampled_from(list(ElementOp)).flatmap(
            lambda op: st.builds(
                ScaleArithmetic, amax=policy, pow2=st.just(p),
                scale=st.sampled_from([ScaleOp.DIV] if p is Pow2.BITS
                                      else [ScaleOp.DIV, ScaleOp.MULRCP]),
                apply=st.just(op),
                divmin=number if op is ElementOp.DIV else st.just(0.0),
                rcpmin=st.sampled_from(list(SmallestRcp)) if op is ElementOp.MUL
                else st.just(SmallestRcp.EXACT))))
    log2 = rule is ScaleRule.AMAX_UP and scale_format.name == "float8_e8m0fnu"
    return st.sampled_from(list(ScaleOp)).flatmap(lambda op: st.builds(
        ScaleArithmetic, amax=policy, eps=number, scale=st.just(op),
        prec=st.sampled_from(list(Precision)), guard=st.sampled_from(list(Guard)),
        pow2=st.sampled_from([Pow2.BITS, Pow2.LOG2] if log2 else [Pow2.BITS]),
        smin=st.just(0.0) if op is ScaleOp.RCP else number,
        apply=st.sampled_from(list(ElementOp)), undo=st.sampled_from(list(ElementOp))))


@st.composite
def arithmetic_casts(draw: st.DrawFn) -> Cast:
    rule = draw(st.sampled_from(list(ScaleRule)))
    gran = (draw(st.sampled_from([Granularity.BLOCK, Granularity.TILE]))
            if rule is ScaleRule.TWO_LEVEL else draw(st.sampled_from(
                [Granularity.TENSOR, Granularity.CHANNEL, Granularity.BLOCK])))
    scale = FORMATS["float8_e4m3fn" if rule is ScaleRule.TWO_LEVEL else draw(
        st.sampled_from(["float8_e8m0fnu", "float32", "float8_e4m3fn"]))]
    size = 16 if gran in (Granularity.BLOCK, Granularity.TILE) else 0
    arithmetic = draw(_arithmetic_for(rule, scale))
    if gran is Granularity.TILE and (arithmetic.two.four_over_six
                                     or arithmetic.two.row_scaled):  # 1 x 16 blocks only
        gran = Granularity.BLOCK
    return Cast(FORMATS["float4_e2m1fn"], Scaling(gran, size, scale, rule,
                                                  arithmetic=arithmetic))


@given(arithmetic_casts())
def test_any_scale_arithmetic_round_trips(cast: Cast) -> None:
    assert parse_cast(str(cast)) == cast


def test_the_exact_arithmetic_is_not_written_and_a_changed_one_is() -> None:
    assert str(parse_cast("nvfp4")) == "float4_e2m1fn:block16:float8_e4m3fn:two-level:rne:saturate"
    c = parse_cast("float8_e4m3fn:tensor:amax:undo=div,scale=rcp,eps=2^-40,apply=mul")
    assert str(c).endswith(":rne:saturate:eps=2^-40,scale=rcp,apply=mul,undo=div")
    assert c.scaling.arithmetic.eps == 2.0**-40
    assert list(ARITHMETIC_KEYS)[:3] == ["amax", "eps", "scale"]


@pytest.mark.parametrize(("spec", "message"), [
    ("float8_e4m3fn:block32:floor:eps=1e-4", "eps= does not apply to the floor rule"),
    ("float8_e4m3fn:block32:floor:pow2=log2", "applies to the ceil rule, not floor"),
    ("float8_e4m3fn:block32:ceil:scale=mulrcp", "scale=mulrcp needs pow2=rp or pow2=log2"),
    ("float8_e4m3fn:block32:ceil:pow2=rp,rcpmin=one", "rcpmin=one sets a multiplier"),
    ("float8_e4m3fn:tensor:amax:pow2=log2", "pow2=log2 on a real scale needs the amax-up rule"),
    ("float8_e4m3fn:tensor:amax:scale=rcp,smin=0.5", "with scale=rcp there is none"),
    ("float8_e4m3fn:tensor:amax:two=te", "does not apply to the amax rule"),
    ("float8_e4m3fn:tensor:amax:eps=-1", "is not a non-negative number"),
    ("float8_e4m3fn:tensor:amax:eps=nan", "is not a non-negative number"),
    ("float8_e4m3fn:tensor:amax:epsilon=1", "unknown scale arithmetic key 'epsilon'"),
    ("float8_e4m3fn:tensor:amax:apply=times", "apply='times': choose from div, mul"),
    ("float8_e4m3fn:tensor:amax:apply=mul,apply=div", "given twice"),
    ("float8_e4m3fn:apply=mul", "needs a granularity"),
    ("torchao/mxfp8:apply=div", "a preset fixes its scaling"),
    ("float4_e2m1fn:block16:two-level:two=torch", "choose from drift, torchao, te"),
    ("float4_e2m1fn:tile32:two-level:amax=fmax,two=te-4over6-mae",
     "takes 1 x 16 blocks"),
])
def test_a_bad_scale_arithmetic_is_refused_in_one_line(spec: str, message: str) -> None:
    with pytest.raises(CastSpecError, match=message.replace("(", r"\(").replace("+", r"\+")) as e:
        parse_cast(spec)
    assert "\n" not in str(e.value) and spec in str(e.value)


def test_an_implementation_preset_takes_a_rounding_and_an_overflow() -> None:
    c = parse_cast("torchao/nvfp4:sr:ieee")
    assert c.rounding.value == "sr" and c.overflow.value == "ieee"
    assert c.scaling == parse_cast("torchao/nvfp4").scaling


# --- torchao, run ----------------------------------------------------------------------------

def _torchao() -> dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
    """Each torchao preset's reference: torchao's own functions, returning its dequantized
    float32 values and its codes decoded to float32, for a float32 tensor whose last dimension
    is a multiple of the block (2-D for NVFP4)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.kernels import (
        f4_unpacked_to_f32,
        f6_e2m3_unpacked_to_f32,
        f6_e3m2_unpacked_to_f32,
        unpack_uint4,
    )
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    def fp4_codes(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return f4_unpacked_to_f32(unpack_uint4(packed.contiguous().view(torch.uint8))).reshape(
            shape)

    def float8(dtype: torch.dtype, pow2: bool, axiswise: bool = False) -> Callable[..., tuple]:
        def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kw = ({"scaling_granularity": ScalingGranularity.AXISWISE, "axiswise_dim": -1}
                  if axiswise else {})
            t = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig(),
                                            round_scales_to_power_of_2=pow2, **kw)
            return t.to_original_precision(), t._data.float()
        return run

    elements = {"mxfp8": (torch.float8_e4m3fn, lambda q, s: q.float()),
                "mxfp6_e3m2": (DTYPE_FP6_E3M2, lambda q, s: f6_e3m2_unpacked_to_f32(q)),
                "mxfp6_e2m3": (DTYPE_FP6_E2M3, lambda q, s: f6_e2m3_unpacked_to_f32(q)),
                "mxfp4": (torch.float4_e2m1fn_x2, fp4_codes)}
    modes = {"": ScaleCalculationMode.FLOOR, "_rceil": ScaleCalculationMode.RCEIL,
             "_ceil": ScaleCalculationMode.CEIL, "_even": ScaleCalculationMode.EVEN}

    def mx(dtype: torch.dtype, decode: Callable, mode: ScaleCalculationMode) -> Callable:
        def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            m = MXTensor.to_mx(x, dtype, 32, scaling_mode=mode)
            return m.dequantize(torch.float32), decode(m.qdata, x.shape).reshape(x.shape)
        return run

    def nvfp4(two_level: bool) -> Callable:
        def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            scale = per_tensor_amax_to_scale(torch.max(torch.abs(x))) if two_level else None
            n = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale)
            return n.dequantize(torch.float32), fp4_codes(n.qdata, x.shape)
        return run

    out = {"torchao/float8_tensorwise": float8(torch.float8_e4m3fn, False),
           "torchao/float8_tensorwise_e5m2": float8(torch.float8_e5m2, False),
           "torchao/float8_tensorwise_pow2": float8(torch.float8_e4m3fn, True),
           "torchao/float8_rowwise": float8(torch.float8_e4m3fn, True, axiswise=True),
           "torchao/nvfp4": nvfp4(True), "torchao/nvfp4_1level": nvfp4(False)}
    for (recipe, (dtype, decode)), (suffix, mode) in itertools.product(elements.items(),
                                                                       modes.items()):
        out[f"torchao/{recipe}{suffix}"] = mx(dtype, decode, mode)
    return out


@pytest.fixture(scope="module")
def torchao_refs() -> dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
    return _torchao()


def test_every_torchao_preset_has_its_reference_here(torchao_refs: dict) -> None:
    assert sorted(torchao_refs) == sorted(TORCHAO_PRESETS)


def compare_with_torchao(name: str, x: torch.Tensor, ref: Callable) -> tuple[int, str]:
    """Elements compared and a description of any difference, for ``x`` (2-D float32; the last
    dimension zero padded for torchao to a multiple of the block, compared on ``x``'s own
    elements: padding zeros change no amax)."""
    cols = x.shape[-1]
    pad = -cols % block_of(name)
    want_values, want_codes = ref(torch.nn.functional.pad(x, (0, pad)) if pad else x)
    want_values, want_codes = want_values[..., :cols], want_codes[..., :cols]
    got = info_of(x, name)
    bad_values = differences(got.values, want_values)
    assert got.codes is not None
    bad_codes = differences(got.codes, want_codes) & ~torch.isnan(want_values)
    bad = bad_values | bad_codes
    if not bad.any():
        return x.numel(), ""
    i = int(bad.flatten().nonzero()[0])
    flat = x.flatten()
    return x.numel(), (
        f"{int(bad.sum())} of {x.numel()} differ; first at {i}: x = "
        f"0x{int(flat[i:i + 1].view(torch.int32)) & 0xFFFFFFFF:08x} ({float(flat[i])!r}) "
        f"drift {float(got.values.flatten()[i])!r} (code {float(got.codes.flatten()[i])!r}), "
        f"torchao {float(want_values.flatten()[i])!r} (code {float(want_codes.flatten()[i])!r})")


@pytest.mark.parametrize("name", TORCHAO_PRESETS)
def test_torchao_preset_equals_torchao_on_boundary_data(name: str, torchao_refs: dict) -> None:
    compared = apart = 0
    exact = IMPLEMENTATION_PRESETS[name].exact
    for x in tensors(name, seed=15):
        n, problem = compare_with_torchao(name, x, torchao_refs[name])
        compared += n
        assert not problem, f"{name}: {problem}"
        apart += int(differences(info_of(x, name).values, info_of(x, exact).values).sum())
    print(f"\n{name}: {compared:,} synthetic elements compared with torchao, 0 differences "
          f"({apart:,} differ from drift's exact {exact})")
    assert compared >= 1_000_000
    assert apart  # the data reaches where the implementation and the exact rule part


@requires_stories
@pytest.mark.parametrize("name", TORCHAO_PRESETS)
def test_torchao_preset_equals_torchao_on_every_stories260k_weight(name: str,
                                                                   torchao_refs: dict) -> None:
    compared = tensors = 0
    for key, w in stories_weights():
        x = w.float().reshape(1, -1) if w.dim() == 1 else w.float()
        n, problem = compare_with_torchao(name, x, torchao_refs[name])
        assert not problem, f"{name} on {key}: {problem}"
        compared += n
        tensors += 1
    print(f"\n{name}: {compared:,} elements of {tensors} stories260K tensors compared with "
          "torchao, 0 differences")
    assert tensors == 47 and compared == 260_032  # every parameter


def test_the_torch_kernels_give_the_numba_kernels_bits_on_every_preset() -> None:
    from driftcli.kernels import jit

    xs = [boundary_rows(name, 64, 256, 3) for name in IMPLEMENTATION_PRESETS]
    fast = [info_of(x, name) for x, name in zip(xs, IMPLEMENTATION_PRESETS, strict=True)]
    jit.set_jit("never")
    try:
        slow = [info_of(x, name) for x, name in zip(xs, IMPLEMENTATION_PRESETS, strict=True)]
    finally:
        jit.set_jit("auto")
    for name, a, b in zip(IMPLEMENTATION_PRESETS, fast, slow, strict=True):
        assert not differences(a.values, b.values).any(), name
        assert torch.equal(a.scales.isnan(), b.scales.isnan()), name


# --- each class of difference, constructed ------------------------------------------------------

def _f32(v: float) -> float:
    return float(np.float32(v))


def _te(name: str, t: torch.Tensor,
        where: tuple[int, ...]) -> tuple[QuantInfo, dict[str, object]]:
    """drift's Transformer Engine preset on ``t`` and its kernel transcription, the element at
    ``where`` of each (code, value), checked equal bit for bit."""
    from recipe_refs import REFERENCES

    got = info_of(t, name)
    shaped = t.reshape(1, -1) if t.dim() == 1 else t
    with np.errstate(all="ignore"):
        values, codes = (torch.from_numpy(a).reshape(t.shape)
                         for a in REFERENCES[name](shaped.numpy()))
    assert got.codes is not None
    assert not differences(got.values, values).any() and not differences(got.codes, codes).any()
    return got, {f"drift {name}": (float(got.codes[where]), float(got.values[where])),
                 "Transformer Engine (transcribed)": (float(codes[where]), float(values[where]))}


def _show(title: str, rows: dict[str, object]) -> None:
    print(f"\n{title}")
    for who, what in rows.items():
        print(f"  {who:32} {what}")


def test_the_1_1875_tie_under_one_order_is_1_18749988_under_the_other(
        torchao_refs: dict) -> None:
    """fp8_e4m3 divides by s = fl(amax / 448); torchao multiplies by r = fl(448 / amax). Found
    by a seeded search: an element whose quotient is the E4M3 tie 1.1875 exactly one way (code
    1.25, the even one) and one float32 ulp below it the other way (code 1.125)."""
    rng = np.random.default_rng(0)
    for amax in (rng.uniform(1, 2, 20000) * 2.0 ** rng.integers(-20, 20, 20000)).astype(
            np.float32):
        s, r = np.float32(amax / np.float32(448)), np.float32(np.float64(448) / np.float64(amax))
        x = np.float32(np.float32(1.1875) * s)
        if np.float32(x / s) == 1.1875 and np.float32(x * r) < 1.1875:
            break
    else:
        pytest.fail("no such amax in the search")
    t = torch.tensor([float(amax), float(x)])
    exact, impl = info_of(t, "fp8_e4m3"), info_of(t, "torchao/float8_tensorwise")
    ref_values, ref_codes = torchao_refs["torchao/float8_tensorwise"](t)
    te, te_rows = _te("te/float8_current", t, (1,))
    _show(f"amax {float(amax)!r}, x = {float(x)!r} (0x{int(np.float32(x).view(np.int32)):08x})", {
        "fl(x / s)": float(np.float32(x / s)), "fl(x * r)": float(np.float32(x * r)),
        "drift fp8_e4m3": (float(exact.codes[1]), float(exact.values[1])),
        "drift torchao/float8_tensorwise": (float(impl.codes[1]), float(impl.values[1])),
        "torchao itself": (float(ref_codes[1]), float(ref_values[1])), **te_rows})
    assert float(np.float32(x * r)) == _f32(1.1875 - 2.0**-23)
    assert float(exact.codes[1]) == 1.25 and float(impl.codes[1]) == 1.125
    assert float(te.codes[1]) == 1.125  # Transformer Engine's r = fl32(448 / amax): the same
    assert float(ref_codes[1]) == 1.125 and not differences(impl.values, ref_values).any()


def _nvfp4_block(tensor_amax: float, block: list[float]) -> torch.Tensor:
    """A 2 x 16 tensor: the first block holds ``tensor_amax``, the second ``block``."""
    t = torch.zeros(2, 16)
    t[0, 0] = tensor_amax
    t[1, :len(block)] = torch.tensor(block)
    return t


def test_an_nvfp4_quotient_just_below_0_75_by_division_is_0_75_by_reciprocal(
        torchao_refs: dict) -> None:
    """drift's nvfp4 divides by d = fl(sb · S); torchao multiplies by fl(fl(1 / S) / sb). The
    same block scale, an element one ulp either side of FP4's tie 0.75 (between 0.5 and 1)."""
    rng = np.random.default_rng(1)
    f = np.float32
    for big, amax_b in zip(rng.uniform(1, 1000, 5000).astype(f),
                           rng.uniform(0.01, 1, 5000).astype(f), strict=True):
        amax_b = f(amax_b * big)
        s = f(big / f(2688))
        sb = float(drift.round_to_format(torch.tensor(float(f(f(amax_b / f(6)) / s))),
                                         "float8_e4m3fn"))
        d, a = f(f(sb) * s), f(f(f(1) / s) / f(sb))
        x = f(f(0.75) * d)
        for _ in range(4):
            if f(x / d) < 0.75 <= f(x * a):
                break
            x = np.nextafter(x, f(1)) if f(x / d) < 0.75 and f(x * a) < 0.75 else \
                np.nextafter(x, f(0))
        if f(x / d) < 0.75 and f(x * a) == 0.75 and x < amax_b:
            break
    else:
        pytest.fail("no such block in the search")
    t = _nvfp4_block(float(big), [float(amax_b), float(x)])
    exact, impl = info_of(t, "nvfp4"), info_of(t, "torchao/nvfp4")
    ref_values, ref_codes = torchao_refs["torchao/nvfp4"](t)
    _, te_rows = _te("te/nvfp4", t, (1, 1))
    _show(f"x = {float(x)!r}: fl(x / d) = {float(f(x / d))!r}, fl(x * a) = {float(f(x * a))!r}",
          {"drift nvfp4": (float(exact.codes[1, 1]), float(exact.values[1, 1])),
           "drift torchao/nvfp4": (float(impl.codes[1, 1]), float(impl.values[1, 1])),
           "torchao itself": (float(ref_codes[1, 1]), float(ref_values[1, 1])), **te_rows})
    assert exact.scales[1] == impl.scales[1]  # the same block scale, only the element op parts
    assert float(exact.codes[1, 1]) == 0.5 and float(impl.codes[1, 1]) == 1.0
    assert float(ref_codes[1, 1]) == 1.0 and not differences(impl.values, ref_values).any()


@pytest.mark.parametrize("raw", [2.0**-8, 2.0**-12])
def test_a_raw_block_scale_below_2_to_the_minus_6_and_below_2_to_the_minus_10(
        raw: float, torchao_refs: dict) -> None:
    """A block whose raw scale fl(fl(amax_b / 6) / S) is 2**-8 (a subnormal E4M3 value) or
    2**-12 (below E4M3's smallest, 2**-9): drift keeps 2**-8 and raises 2**-12 to 2**-9
    (counted in scale_clamped), torchao raises both to 2**-6, Transformer Engine keeps 2**-8
    and rounds 2**-12 to a zero scale (its codes saturate to 6, its values are 0)."""
    tensor_amax = 2688.0  # S = 1
    block = [6 * raw, 5 * raw, 3.3 * raw, -raw]
    t = _nvfp4_block(tensor_amax, block)
    exact, impl = info_of(t, "nvfp4"), info_of(t, "torchao/nvfp4")
    ref_values, _ = torchao_refs["torchao/nvfp4"](t)
    te, te_rows = _te("te/nvfp4", t, (1, 0))
    _show(f"raw block scale {raw!r}", {
        **te_rows, "drift te/nvfp4 scale": float(te.scales[1]),
        "drift nvfp4 scale": (float(exact.scales[1]), bool(exact.scale_clamped[1])),
        "drift nvfp4 values": exact.values[1, :4].tolist(),
        "drift torchao/nvfp4 scale": (float(impl.scales[1]), bool(impl.scale_clamped[1])),
        "drift torchao/nvfp4 values": impl.values[1, :4].tolist(),
        "torchao itself values": ref_values[1, :4].tolist()})
    assert float(exact.scales[1]) == max(raw, 2.0**-9)
    assert bool(exact.scale_clamped[1]) == (raw < 2.0**-9)
    assert float(impl.scales[1]) == 2.0**-6 and bool(impl.scale_clamped[1])
    assert not differences(impl.values, ref_values).any()
    if raw < 2.0**-10:  # flushed: a zero scale, codes at FP4's max, values zero
        assert float(te.scales[1]) == 0.0 and float(te.codes[1, 0]) == 6.0
        assert te.values[1, :4].abs().max() == 0.0
    else:
        assert float(te.scales[1]) == raw


def test_the_all_zero_nvfp4_tensor(torchao_refs: dict) -> None:
    """torchao's tensor scale of an all-zero tensor is 0, and 0 / 0 makes everything NaN;
    drift keeps the zeros."""
    t = torch.zeros(2, 16)
    exact, impl = info_of(t, "nvfp4"), info_of(t, "torchao/nvfp4")
    ref_values, _ = torchao_refs["torchao/nvfp4"](t)
    te, te_rows = _te("te/nvfp4", t, (0, 0))
    _show("an all-zero tensor", {"drift nvfp4": exact.values[0, :3].tolist(),
                                  "drift torchao/nvfp4": impl.values[0, :3].tolist(),
                                  "torchao itself": ref_values[0, :3].tolist(), **te_rows})
    assert torch.equal(te.values, t)
    assert torch.equal(exact.values, t) and impl.tensor_scale == 0.0
    assert bool(impl.values.isnan().all()) and bool(ref_values.isnan().all())


def test_an_rceil_block_whose_quotient_is_one_ulp_above_a_power_of_two(
        torchao_refs: dict) -> None:
    """amax one ulp above 448 · 2**5: fl(amax / 448) is 2**5 (1 + 2**-23), whose float32 log2
    rounds to 5.0; torchao's RCEIL takes the scale 2**5 and clips amax, the exact ceil and
    Transformer Engine's cvt.rp take 2**6."""
    amax = float(np.nextafter(np.float32(448 * 32), np.float32(np.inf)))
    quotient = np.float32(np.float32(amax) / np.float32(448))
    assert quotient == np.float32(32) * np.float32(1 + 2.0**-23)
    assert float(torch.log2(torch.tensor(float(quotient)))) == 5.0
    t = torch.full((1, 32), 1.0)
    t[0, 0] = amax
    exact, impl = info_of(t, "mxfp8_e4m3_ceil"), info_of(t, "torchao/mxfp8_rceil")
    ref_values, _ = torchao_refs["torchao/mxfp8_rceil"](t)
    te, te_rows = _te("te/mxfp8", t, (0, 0))
    _show(f"amax {amax!r}", {
        **te_rows, "drift te/mxfp8 scale": float(te.scales[0]),
        "drift mxfp8_e4m3_ceil": (float(exact.scales[0]), float(exact.values[0, 0]),
                                  bool(exact.clipped[0, 0])),
        "drift torchao/mxfp8_rceil": (float(impl.scales[0]), float(impl.values[0, 0]),
                                      bool(impl.clipped[0, 0])),
        "torchao itself": float(ref_values[0, 0])})
    assert float(exact.scales[0]) == 64.0 and not bool(exact.clipped[0, 0])
    assert float(impl.scales[0]) == 32.0 and float(impl.values[0, 0]) == 448 * 32
    assert bool(impl.clipped[0, 0]) and not differences(impl.values, ref_values).any()
    assert float(te.scales[0]) == 64.0  # cvt.rp on the quotient's bits: 2**6, as drift's ceil


def test_the_python_examples_of_recipes_md_print_what_it_shows(
        capsys: pytest.CaptureFixture[str]) -> None:

    text = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    # an output block may carry test_doc_outputs' marker line before it
    examples = re.findall(r"```python\n(.*?)```\n\n(?:<!--[^\n]*-->\n)?```\n(.*?)```", text,
                          re.S)
    assert examples
    for code, shown in examples:
        exec(compile(code, "docs/recipes.md", "exec"), {})
        assert capsys.readouterr().out == shown


# --- verify-formats: the op sequence against its exact evaluation --------------------------------

def test_every_implementation_preset_passes_the_exact_op_sequence_check() -> None:
    """verify-formats' ``recipes`` suite (quick plan) on every implementation preset: values and
    codes against the same op sequence in exact rationals."""
    from driftcli.verify import Plan, check_recipes
    from driftcli.verify.recipes import TRANSFORM_CORES

    checked = set()
    on_cores = 0
    for fmt in {p.cast.format for p in IMPLEMENTATION_PRESETS.values()}:
        for out in check_recipes(fmt, Plan(quick=True)):
            assert out.n_failed == 0, (out.operation, out.failures[:3])
            assert out.n_checked >= 192
            checked.add(out.operation.rsplit(" ", 1)[0])
            on_cores += out.n_checked if ",tc=" in out.operation else 0
    assert on_cores == 1_088  # docs/recipes.md and verify-formats.md: the quick plan's
    # a preset's transform is checked again on each of TRANSFORM_CORES (``name,tc=core``)
    cores = {name for name in checked if ",tc=" in name}
    assert {name.split(",tc=")[0] for name in checked} == set(IMPLEMENTATION_PRESETS)
    assert cores == {f"{name},tc={core}" for name, p in IMPLEMENTATION_PRESETS.items()
                     if p.cast.rht is not None for core in TRANSFORM_CORES}


def _swapped_division(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a fault: scales that are divided by are multiplied by their rounded reciprocal."""
    from driftcli.casts import scalearith
    from driftcli.records.modes import ElementOp

    honest = scalearith._real_scales

    def swapped(*args: object) -> object:
        out = honest(*args)  # type: ignore[arg-type]
        if out.apply_op is not ElementOp.DIV:
            return out
        return scalearith.ArithScales(1 / out.apply, out.undo, out.scale, out.clamped,
                                      out.tensor_scale, ElementOp.MUL, out.undo_op)

    monkeypatch.setattr(scalearith, "_real_scales", swapped)


def _reciprocal_of_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a fault in torchao's NVFP4 order: fl(1 / fl(S · sb)) for fl(fl(1 / S) / sb)."""
    from driftcli.casts import scalearith
    from driftcli.records.modes import TwoLevelOrder

    honest = scalearith._TWO_LEVEL[TwoLevelOrder.TORCHAO]

    def other(amax: torch.Tensor, tensor_amax: torch.Tensor, plan: object) -> object:
        out = honest(amax, tensor_amax, plan)
        return scalearith.ArithScales(1 / out.undo, out.undo, out.scale, out.clamped,
                                      out.tensor_scale, out.apply_op, out.undo_op)

    monkeypatch.setitem(scalearith._TWO_LEVEL, TwoLevelOrder.TORCHAO, other)


@pytest.mark.parametrize(("plant", "preset"), [(_swapped_division, "deepseek/v3"),
                                                (_reciprocal_of_product, "torchao/nvfp4")])
def test_a_planted_swap_of_divide_for_reciprocal_is_caught(
        plant: Callable[[pytest.MonkeyPatch], None], preset: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same preset passes the full plan's check honestly and fails it with the fault."""
    from driftcli.verify import Plan, check_recipe

    fmt = IMPLEMENTATION_PRESETS[preset].cast.format
    honest = [o.n_failed for o in check_recipe(fmt, preset, Plan())]
    plant(monkeypatch)
    planted = list(check_recipe(fmt, preset, Plan()))
    print(f"\n{preset}: {planted[0].n_failed} of {planted[0].n_checked} values caught")
    assert honest == [0, 0]
    assert planted[0].n_failed > 0 and planted[0].failures


# --- clips through the rounding of a scale; drift cast-diff --------------------------------------

def _tie_tensor() -> torch.Tensor:
    """The amax and the element of the 1.1875 tie above (fp8_e4m3 code 1.25, torchao 1.125)."""
    return torch.tensor([244.8327178955078, 0.6489706039428711])


def test_an_amax_clip_counts_as_a_clip_through_rounding_and_a_floor_clip_does_not() -> None:
    """fl(amax / fl(amax / 448)) = 448.00003: the amax element of an fp8_e4m3 cast clips, its
    exact quotient is 448; a floor scale's clip is the rule's own."""
    from driftcli.measures.stats import cast_stats

    x = torch.tensor([2.3, -0.7, 0.01])  # scaling.md: x[0] / s = 448.00003
    amax_cast, _ = cast_stats(x, "fp8_e4m3", want_values=False)
    assert amax_cast.clipped == 1 and amax_cast.clipped_by_rounding == 1
    tanh = torch.full((32,), 0.95)  # floor: scale 2**-9, largest value 0.875: every one clips
    floor_cast, _ = cast_stats(tanh, "mxfp8_e4m3", want_values=False)
    assert floor_cast.clipped == 32 and floor_cast.clipped_by_rounding == 0
    rceil, _ = cast_stats(torch.full((32,), float(np.nextafter(np.float32(448 * 32),
                                                              np.float32(np.inf)))),
                          "torchao/mxfp8_rceil", want_values=False)
    assert rceil.clipped == 32 and rceil.clipped_by_rounding == 32  # log2's binade, not the rule


def test_cast_diff_counts_the_tie_that_parts_two_orders() -> None:
    from driftcli.measures.diffstats import cast_diff_stats

    a, b = parse_cast("fp8_e4m3"), parse_cast("torchao/float8_tensorwise")
    d = cast_diff_stats(_tie_tensor(), a, b)
    assert (d.compared, d.codes_differ, d.nan_differ) == (2, 1, 0)
    assert d.values_differ == 2  # the amax too: q·s against q / r, in the last bit
    # codes 1.25 and 1.125, one E4M3 step at 1.25 (0.125) times the scale: one spacing, up to
    # the float32 rounding of the two decodes (a few ulps of the values, ~1e-7 relative)
    assert abs(d.max_spacings - 1.0) < 1e-5
    same = cast_diff_stats(_tie_tensor(), a, a)
    assert (same.codes_differ, same.values_differ, same.max_spacings) == (0, 0, 0.0)


def test_the_cast_diff_command_writes_its_table(tmp_path: Path) -> None:
    import pandas as pd
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from driftcli.cli import app

    save_file({"tie": _tie_tensor(), "zeros": torch.zeros(4, 16)}, str(tmp_path / "m.safetensors"))
    runner = CliRunner()
    result = runner.invoke(app, ["cast-diff", str(tmp_path / "m.safetensors"), "-c", "fp8_e4m3",
                                 "-c", "torchao/float8_tensorwise", "-c", "te/float8_current",
                                 "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    t = pd.read_parquet(tmp_path / "out" / "cast-diff.parquet").set_index(["tensor", "cast"])
    torchao_spec, te_spec = (str(parse_cast(n)) for n in ("torchao/float8_tensorwise",
                                                          "te/float8_current"))
    assert set(t.against) == {str(parse_cast("fp8_e4m3"))}
    assert t.loc[("tie", torchao_spec), "n_codes_differ"] == 1
    assert t.loc[("tie", te_spec), "n_codes_differ"] == 1  # TE's r = fl32(448 / amax): the same
    assert t.loc[("zeros", te_spec), "n_values_differ"] == 0
    assert t.loc[("*", torchao_spec), "n_codes_differ"] == 1
    assert t.loc[("*", torchao_spec), "codes_differ"] == 1 / 66
    one = runner.invoke(app, ["cast-diff", str(tmp_path / "m.safetensors"), "-c", "nvfp4"])
    assert one.exit_code == 2 and "give two or more" in one.output
    sr = runner.invoke(app, ["cast-diff", str(tmp_path / "m.safetensors"), "-c", "nvfp4",
                             "-c", "nvfp4:sr", "--out", str(tmp_path / "o2")])
    assert sr.exit_code == 2 and "rounds stochastically" in sr.output
