"""quantize's two-pass block casts on the numba back-end (driftcli.kernels.castcode) give the
general steps' bits: element rounding against the jit kernel on every float32 exponent and the
mantissas around every cut, each power-of-two rule's threshold against the rule's own
implementation, whole casts against the general steps (cast_blocks) and the torch back-end on
constructed tensors, and a 20-step training run on both back-ends."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from driftcli import kernels
from driftcli.casts import rounding
from driftcli.casts.quantization import cast_blocks, fused_block_cast_applies, quantize
from driftcli.casts.rounding import draw_random_bits
from driftcli.casts.route import cast_route, cast_values
from driftcli.casts.scaling import ScalePlan, plan_pow2_exponents, pow2_range, rule_threshold
from driftcli.kernels import castcode as castkernels
from driftcli.kernels import jit
from driftcli.models import TransformerConfig
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS
from driftcli.records.modes import DEFAULT_SR_BITS, Overflow, Rounding, ScaleRule
from driftcli.runs import TrainConfig, train

ELEMENT_FORMATS = [n for n, f in FORMATS.items() if f.signed and f.has_zero and f.bits <= 16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def sweep_bits() -> np.ndarray:
    """Finite float32 bit patterns: every exponent field, with the mantissas on both sides of
    every possible cut (all ones below bit s, the half, one either side of it), both signs."""
    mantissas = {0, 1, 2, 3, 0x7FFFFF, 0x7FFFFE}
    for s in range(1, 24):
        half = 1 << (s - 1)
        mantissas |= {(1 << s) - 1, half, half - 1, half + 1, 3 * half,
                      (0x7FFFFF >> s) << s, ((0x7FFFFF >> s) << s) | half}
    mants = np.array(sorted(m & 0x7FFFFF for m in mantissas), dtype=np.int64)
    fields = np.arange(0, 255, dtype=np.int64)
    mags = (fields[:, None] << 23 | mants[None, :]).reshape(-1)
    signed = np.concatenate([mags, mags | (1 << 31)])
    return signed.astype(np.uint32).view(np.int32)


# --- element rounding ---------------------------------------------------------------------------

@pytest.mark.parametrize("overflow", [Overflow.SATURATE, Overflow.IEEE])
@pytest.mark.parametrize("mode", [Rounding.RNE, Rounding.SR])
@pytest.mark.parametrize("name", ELEMENT_FORMATS)
def test_pow2_rounding_is_round_lean_bit_for_bit(name: str, mode: Rounding,
                                                 overflow: Overflow) -> None:
    """Every exponent field and every cut's neighbourhood, under every scale exponent whose
    grid stays within float32's range (the others take the float64 path), against the jit
    kernel quantize runs; stochastic draws at 0, the top and random."""
    fmt = FORMATS[name]
    values = sweep_bits()
    cols = 32
    values = np.concatenate([values, np.zeros(-values.size % cols, dtype=np.int32)])
    rows = values.size // cols
    low, high = -127, 127
    ks_ok = [k for k in range(low, high + 1) if k + fmt.qmin >= -149 and k + fmt.emax < 128]
    # every row under every admissible k, by rotating the rows' exponents
    x = torch.from_numpy(np.tile(values, 3)).view(torch.float32).reshape(-1, cols)
    rows = x.shape[0]
    ks = torch.tensor([ks_ok[(7 * r) % len(ks_ok)] for r in range(rows)], dtype=torch.int64)
    bad = torch.zeros(rows, dtype=torch.bool)
    bad[::97] = True
    draws = None
    if mode is Rounding.SR:
        gen = torch.Generator().manual_seed(1)
        draws = torch.randint(0, 1 << 8, x.shape, generator=gen, dtype=torch.int32)
        draws[0::3] = 0
        draws[1::3] = 255
    p = rounding.jit_params(src=rounding.source_of(torch.float32), tgt=rounding.target_of(fmt),
                            rounding=mode, overflow=overflow, sr_bits=8)
    want = jit.round_bits(x, None, draws, ks[:, None], p, bad)
    kernel = castkernels.pow2_round_kernel(p[13], p[14], draws is not None)
    got = np.empty(x.numel(), dtype=np.int32)
    empty = np.empty(0, dtype=np.int32)
    kernel(_bits(x).reshape(-1).numpy(), empty if draws is None else draws.reshape(-1).numpy(),
           ks.numpy(), bad.numpy(), cols, got, p, 0, rows)
    expected = _bits(want).reshape(-1).numpy()
    wrong = np.flatnonzero(got != expected)
    assert wrong.size == 0, (f"{wrong.size} of {got.size} differ, first input "
                             f"{_bits(x).reshape(-1)[wrong[0]]:#x} k {ks[wrong[0] // cols]}")
    # the general steps ran on some rows: the grid reached below float32's normals
    assert any(k + fmt.emin < -126 for k in ks.tolist()) or fmt.emin > 0 or name == "float32"


# --- power-of-two rules ---------------------------------------------------------------------------

@pytest.mark.parametrize(("rule", "headroom"),
                         [*((r, 0) for r in ScaleRule if r.power_of_two),
                          (ScaleRule.FLOOR, 1), (ScaleRule.FLOOR, 3)])
def test_rule_thresholds_match_the_rules_own_implementation(rule: ScaleRule,
                                                            headroom: int) -> None:
    """Every power-of-two rule has a threshold, and the kernel's exponent equals the rule's
    FAST_RULES exponent for amax at every binade (subnormal ones too) with significands at,
    and one float32 step either side of, 1, the threshold and 2."""
    for name in ELEMENT_FORMATS:
        fmt = FORMATS[name]
        spec = f"{name}:block32:{rule.value}" + (f"+{headroom}" if headroom else "")
        c = parse_cast(spec)
        plan = ScalePlan.of(fmt, c.scaling)
        found = rule_threshold(plan)
        assert found is not None, spec
        fracs = {0, 1, 0x7FFFFF, 0x7FFFFE, found[0] - 1, found[0], found[0] + 1}
        fracs = sorted(f for f in fracs if 0 <= f <= 0x7FFFFF)
        mags = [(e << 23) | f for e in range(1, 255) for f in fracs]
        mags += [1, 2, 3, 0x400000, 0x7FFFFF, 0x123456]  # subnormal amax
        mags += [0]
        x = torch.tensor(mags, dtype=torch.int64).to(torch.int32).view(torch.float32)
        # one row per amax: the row's only nonzero element
        blocks = torch.zeros(x.numel(), 32)
        blocks[:, 5] = x
        ks = np.empty(x.numel(), dtype=np.int64)
        bad = np.empty(x.numel(), dtype=np.bool_)
        low, high = pow2_range(c.scaling.scale_format)  # type: ignore[arg-type]
        rule_vec = np.array([plan.elem_emax, found[0], int(found[1]), plan.headroom, low,
                             high], dtype=np.int64)
        tops = np.empty(x.numel(), dtype=np.int32)
        _, _, clamped = castkernels.pow2_scales(_bits(blocks).reshape(-1).numpy(), 32, ks, bad,
                                                rule_vec, tops)
        want, want_clamped = plan_pow2_exponents(x, plan)
        assert ks.tolist() == want.tolist(), spec
        assert clamped == int(want_clamped.sum()) > 0, spec  # the binades reach both ends
        assert tops.view(np.float32).tolist() == x.abs().tolist()
        assert not bad.any()


# --- whole casts --------------------------------------------------------------------------------

CASTS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8",
         "mxfp8_e4m3_ceil", "mxfp8_e4m3_floor+1", "float8_e4m3fn:block32:even",
         "float8_e4m3fn:block32:ceil-amax", "float4_e2m1fn:block16:floor:rtz", "nvfp4",
         "mxfp4_e2m1:sr", "mxfp8_e4m3:sr", "nvfp4:sr"]
SHAPES = [((64, 96), -1), ((64, 96), -2), ((4, 3, 20, 16), -1), ((4, 3, 16, 20), -2),
          ((7, 45), -1), ((3, 5, 70), -2)]


def constructed(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Inputs that reach every branch: normal values, heavy tails, an all-zero stretch, NaN and
    inf, signed zeros, values that underflow the grid, and float32 subnormals."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(shape, generator=gen)
    heavy = normal * torch.exp(3 * torch.randn(shape, generator=gen))
    special = normal.clone().reshape(-1)
    special[:40] = 0
    special[40] = -0.0
    special[41] = float("nan")
    special[90] = float("inf")
    special[150] = -float("inf")
    special[200::13] *= 1e-6
    tiny = torch.randn(shape, generator=gen) * 1e-41  # float32 subnormals
    huge = torch.randn(shape, generator=gen) * 3e37
    return [normal, heavy, special.reshape(shape), tiny, huge, torch.zeros(shape), -normal * 0]


def fast_cast(x: torch.Tensor, c: object, axis: int,
              bits: torch.Tensor | None) -> torch.Tensor | None:
    """The one-pass values step of quantize's route (None where it has none or declines)."""
    route = cast_route(c, x, axis, bits)  # type: ignore[arg-type]
    return cast_values(x, c, axis, bits, DEFAULT_SR_BITS, route)  # type: ignore[arg-type]


def general(x: torch.Tensor, c: object, axis: int, bits: torch.Tensor | None) -> torch.Tensor:
    """The general steps of quantize: block amax, the rule's own scales, the rounding."""
    b = cast_blocks(x, c, axis, bits, DEFAULT_SR_BITS, None)  # type: ignore[arg-type]
    return b.back(b.q).to(x.dtype)


@pytest.mark.parametrize("spec", CASTS)
def test_two_pass_block_cast_is_the_general_steps_bit_for_bit(spec: str) -> None:
    c = parse_cast(spec)
    for i, (shape, axis) in enumerate(SHAPES):
        for j, x in enumerate(constructed(shape, i)):
            bits = draw_random_bits(shape, 10 * i + j) if c.rounding is Rounding.SR else None
            got = fast_cast(x, c, axis, bits)
            want = general(x, c, axis, bits)
            assert got is not None, (spec, shape, j)
            assert torch.equal(_bits(got), _bits(want)), (spec, shape, axis, j)
            assert got.stride() == want.stride()  # the matmul reads the same layout
            assert torch.equal(_bits(quantize(x, c, axis=axis, random_bits=bits)), _bits(got))


def test_what_the_two_pass_cast_leaves_to_the_general_steps() -> None:
    x = torch.randn(8, 64)
    assert fast_cast(x.double(), parse_cast("mxfp8_e4m3"), -1, None) is None
    assert fast_cast(x, parse_cast("fp8_e4m3"), -1, None) is None  # one scale per tensor
    assert fast_cast(x, parse_cast("nvfp4_2d"), -1, None) is None  # tiles
    assert fast_cast(x, parse_cast("torchao/mxfp8"), -1, None) is None  # its arithmetic
    # a grid that leaves float32's range: the general path rounds it in float64
    wide = parse_cast("float8_e4m3fn:block32:floor+100")
    assert fused_block_cast_applies(x, wide) and fast_cast(x * 1e20, wide, -1, None) is None
    kernels.set_jit("never")
    try:
        assert fast_cast(x, parse_cast("mxfp8_e4m3"), -1, None) is None
    finally:
        kernels.set_jit("auto")


# --- a training run on both back-ends ------------------------------------------------------------

@pytest.mark.parametrize("policy", ["mxfp8_e4m3", "nvfp4:sr"])
def test_twenty_steps_on_both_back_ends_are_the_same_run(policy: str, tmp_path: Path) -> None:
    """The transformer (attention's matmuls included), 20 steps, logging every 5: the same
    table and the same checkpoint bytes whichever back-end casts."""
    text = tmp_path / "t.txt"
    text.write_text("to be, or not to be, that is the question: whether 'tis nobler in "
                    "the mind to suffer the slings and arrows of outrageous fortune\n" * 60)
    config = TrainConfig(TransformerConfig(context=16, d_model=32, layers=2, heads=2,
                                           activation="tanh"),
                         policy=policy, steps=20, batch=4, log_every=5, eval_every=10,
                         lr=1e-2)
    runs = {}
    for fused in (True, False):
        kernels.set_jit("auto" if fused else "never")
        try:
            runs[fused] = train(config, tmp_path / str(fused) / "run", text)
        finally:
            kernels.set_jit("auto")
    fused, general_ = runs[True], runs[False]
    assert len(fused.rows) == 20
    assert fused.rows == general_.rows  # every column: losses, norms, operand rates
    for a, b in zip(fused.checkpoints, general_.checkpoints, strict=True):
        assert load_file(a).keys() == load_file(b).keys()
        for key, t in load_file(a).items():
            assert torch.equal(t, load_file(b)[key]), key
    assert json.loads((fused.run / "run.json").read_text())["steps_done"] == 20
