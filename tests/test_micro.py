"""Multi-level (micro-exponent) block casts: HiFloat4 (docs/formats.md#hifloat4).

The cast against its exact twin (:func:`driftcli.oracle.quantization.cast_micro_block`) on both
back-ends,
planted faults that verify-formats' block suite catches, and conformance with a numpy
transcription of the HiFloat4 reference quantizer (written here from its facts)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from recipe_data import requires_stories, stories_weights

from driftcli import oracle
from driftcli.casts import microscale, quantization
from driftcli.casts.quantization import QuantInfo, quantize
from driftcli.casts.rounding import jit_params, source_of, target_of
from driftcli.errors import CastSpecError
from driftcli.kernels import jit
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS, Exact
from driftcli.records.presets import PRESETS, UE6M2
from driftcli.verify import blocks
from driftcli.verify.compare import Plan

HIF4 = parse_cast("hifloat4")
F32, BF16 = FORMATS["float32"], FORMATS["bfloat16"]


@pytest.fixture(params=["auto", "never"])
def backend(request: pytest.FixtureRequest) -> object:
    jit.set_jit(request.param)
    yield request.param
    jit.set_jit("auto")


def _oracle(x: torch.Tensor, c: object = HIF4) -> torch.Tensor:
    out = []
    for row in x.reshape(-1, 64).tolist():
        vals = [Exact.of(Fraction(v)) if np.isfinite(v) else
                Exact.of(0) for v in row]
        deq, _, _ = oracle.quantization.cast_micro_block(vals, HIF4.format, HIF4.micro, F32, BF16,
                                            HIF4.rounding, HIF4.overflow)
        out += [float(v.value) for v in deq]
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


def test_the_spec_and_preset() -> None:
    assert "hifloat4" in PRESETS
    assert str(HIF4) == "hifloat4:rna:saturate"
    assert parse_cast(str(HIF4)) == HIF4
    assert parse_cast("hifloat4:rne").rounding.value == "rne"
    assert HIF4.micro is not None and HIF4.micro.steps == 2
    assert [lv.size for lv in HIF4.micro.levels] == [8, 4]
    # 4.5 bits a value: 4 per element, 8 per 64 for the scale, one bit per 8 and per 4
    assert (4 * 64 + UE6M2.bits + 64 // 8 + 64 // 4) / 64 == 4.5
    assert (UE6M2.max, UE6M2.smallest_positive) == (Fraction(49152), Fraction(1, 2**48))
    with pytest.raises(CastSpecError, match="fixes its scaling"):
        parse_cast("hifloat4:ue5m3")


def test_a_worked_block(backend: object) -> None:
    """By hand: amax 7 gives bf16(7 · bf16(1/7)) = bf16(511/512) = 1 (a tie, to even), so
    s = 1 and r = 1; the run of 8 holding 7 gets x2 (7 >= 4) and its run of 4 holding 7
    x2 again (7/2 >= 2); 7/4 = 1.75 is a code. A run of 4 at 1.3 under runs at most 3:
    3 >= 2 in its run of 8 (x1): 1.3 → 1.25 (nearest quarter); 0.375 → 0.5 (a tie, away)."""
    x = torch.zeros(64)
    x[0], x[5], x[9], x[12], x[13] = 7.0, 3.0, 1.3, 0.375, -0.125
    got = quantize(x, HIF4)
    assert got[0] == 7.0  # 1.75 · 2 · 2
    assert got[5] == 3.0  # its run of 4 (4..7) x2 (3 >= 2), its run of 8 x2: 0.75 · 4
    assert got[9] == 1.25 and got[12] == 0.5 and got[13] == -0.25  # runs 8..11, 12..15: x1
    assert torch.equal(got, _oracle(x))


def _boundary_blocks() -> torch.Tensor:
    c = HIF4
    cases = [b.reshape(-1, 64) for b in blocks.constructed_cases(c.format, c)
             if b.numel() % 64 == 0 and torch.isfinite(b).all()]
    return torch.cat([*cases, blocks.random_blocks(64, 64, 5)])


def test_both_back_ends_equal_the_oracle_on_boundary_blocks(backend: object) -> None:
    x = _boundary_blocks()
    assert torch.equal(quantize(x, HIF4), _oracle(x))


def test_a_nonfinite_member_makes_the_block_nan_and_masks_count(backend: object) -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    x[1, 7] = float("inf")
    info = quantize(x, HIF4, return_info=True)
    assert isinstance(info, QuantInfo)
    assert torch.isnan(info.values[1]).all() and torch.isfinite(info.values[[0, 2]]).all()
    assert info.nonfinite_blocks.tolist() == [False, True, False]
    assert torch.isnan(info.scales[1]) and float(info.scales[0]) > 0
    # a block clamped at the scale format's top: its elements clip, and are counted
    y = torch.full((64,), 1e9)
    info = quantize(y, HIF4, return_info=True)
    assert isinstance(info, QuantInfo)
    assert bool(info.scale_clamped[0]) and int(info.clipped.sum()) == 64
    assert float(info.values[0]) == 1.75 * 4 * 49152


# --- planted faults: verify-formats' block suite catches each --------------------------------

def _failed() -> int:
    return sum(o.n_failed for o in blocks.check_cast(HIF4.format, HIF4, Plan(quick=True)))


def test_the_block_suite_passes_on_both_back_ends(backend: object) -> None:
    assert _failed() == 0


def test_a_micro_exponent_from_the_wrong_run_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted fault: each run of 4 reads its neighbour's amax (torch back-end)."""
    jit.set_jit("never")
    real = microscale.torch_scales

    def shifted(b: torch.Tensor, elem: object, micro: object) -> microscale.MicroScales:
        sc = real(b, elem, micro)  # type: ignore[arg-type]
        return microscale.MicroScales(sc.s, sc.r, sc.bad, sc.clamped, sc.exps.roll(4, dims=1))

    monkeypatch.setattr(microscale, "torch_scales", shifted)
    try:
        assert _failed() > 0
    finally:
        jit.set_jit("auto")


def test_a_numba_micro_exponent_fault_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted fault in the numba back-end's one-pass cast: the inner micro-exponent read
    over runs of 8, not 4."""
    real = jit.micro_cast

    def wide_runs(b, bits, levels, ints, consts, p):  # type: ignore[no-untyped-def]
        return real(b, bits, np.array([[8, 1], [8, 1]], dtype=np.int64), ints, consts, p)

    monkeypatch.setattr(jit, "micro_cast", wide_runs)
    assert _failed() > 0


def test_a_float32_first_scale_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted fault of the torch transcription (hifx.py): amax · bf16(1/7) rounded to
    float32 before bf16, a double rounding, in place of the exact product."""
    real = microscale._round_significand

    def via_float32(v: torch.Tensor, bits: int) -> torch.Tensor:
        return real(v.float().double() if bits == 8 else v, bits)

    monkeypatch.setattr(microscale, "_round_significand", via_float32)
    jit.set_jit("never")
    try:
        assert _failed() > 0  # the block suite's amaxes beside the bf16 ties catch it
    finally:
        jit.set_jit("auto")


# --- conformance: the HiFloat4 reference quantizer, transcribed ------------------------------
# global-computing-consortium/HiFloat4 at 6d937b6, hif4_gpu/HiF4_NVFP4_v14f16.py: To_BF16
# (lines 127-134), BF16_to_E6MX (163-175), To_HiFX (177-258). Our own numpy code from its
# steps, vectorised over groups of 64 along the last axis; float64 throughout, as there.

def _to_bf16(x: np.ndarray) -> np.ndarray:
    """Lines 127-134: nearest even on 8 significant bits, the exponent floored at -126."""
    e = np.maximum(np.floor(np.log2(np.abs(x) + 2.0**-1000)), -126)
    return np.round(x * 2.0 ** (-e + 7)) * 2.0 ** (e - 7)


def _to_e6m2(x: np.ndarray) -> np.ndarray:
    """Lines 163-175: clamp to [2^-48, 1.5 · 2^15], then nearest even on 3 significant bits."""
    x = np.clip(x, 2.0**-48, 2.0**15 * 1.5)
    e = np.floor(np.log2(x))
    return np.round(x * 2.0 ** (-e + 2)) * 2.0 ** (e - 2)


def reference_hifx(x: np.ndarray) -> np.ndarray:
    """To_HiFX (N = 4, M = 2, G = 64) over the last axis (a multiple of 64)."""
    g = x.astype(np.float64).reshape(-1, 16, 4)
    sign = np.where(g < 0, -1.0, 1.0)
    mag = np.abs(g)
    v16 = mag.max(axis=2)  # runs of 4
    v8 = v16.reshape(-1, 8, 2).max(axis=2)  # runs of 8
    vmax = v8.max(axis=1)
    scale = _to_e6m2(_to_bf16(vmax * _to_bf16(np.array(1 / 7.0))))
    rec = _to_bf16(1 / scale)[:, None]
    e8 = (v8 * rec >= 4).astype(np.float64)
    e8x2 = np.repeat(e8, 2, axis=1)
    e16 = (v16 * rec * 2.0**-e8x2 >= 2).astype(np.float64)
    de = (e16 + e8x2)[:, :, None]
    q = np.floor(mag * rec[:, :, None] * 2.0 ** (-de + 2) + 0.5) * 2.0**-2
    q = np.where(q >= 2, 2 - 2.0**-2, q)
    out = sign * scale[:, None, None] * 2.0**de * q
    return out.reshape(x.shape)


def _padded(t: torch.Tensor) -> torch.Tensor:
    t = t.float().reshape(-1, t.shape[-1]) if t.dim() else t.float().reshape(1, 1)
    return torch.nn.functional.pad(t, (0, -t.shape[-1] % 64))


def test_the_transcription_reads_its_worked_block() -> None:
    """The transcription itself, on the worked block (so it could fail on its own)."""
    x = np.zeros(64)
    x[0], x[5], x[9], x[12] = 7.0, 3.0, 1.3, 0.375
    out = reference_hifx(x)
    assert (out[0], out[5], out[9], out[12]) == (7.0, 3.0, 1.25, 0.5)


def test_hifloat4_matches_the_reference_on_boundary_blocks(backend: object) -> None:
    """0 differences on blocks at every boundary: all-zero blocks, first-level scales at and
    beside the E6M2 and bf16 ties and both clamps, runs at every micro-exponent threshold,
    elements on ties."""
    x = _boundary_blocks()
    x = torch.cat([x, torch.zeros(2, 64), torch.full((1, 64), 1e-30), torch.full((1, 64), 1e30)])
    ref = torch.from_numpy(reference_hifx(x.numpy().astype(np.float64))).float()
    assert int((quantize(x, HIF4) != ref).sum()) == 0


def test_nonfinite_blocks_are_nan_in_both() -> None:
    """A NaN or inf member makes the reference's whole group NaN (its To_BF16 reads the
    exponent of an infinite amax as inf, and inf · 2**-inf is NaN), as drift makes a block
    holding NaN or inf NaN for every block scaling."""
    x = np.zeros((3, 64))
    x[:, 1] = 1.0
    x[0, 0], x[1, 5], x[2, 63] = np.inf, -np.inf, np.nan
    with np.errstate(invalid="ignore"):
        ref = reference_hifx(x)
    assert np.isnan(ref).all()
    assert torch.isnan(quantize(torch.from_numpy(x).float(), HIF4)).all()


@requires_stories
def test_hifloat4_matches_the_reference_on_every_stories260k_tensor() -> None:
    n = 0
    for _, t in stories_weights():
        x = _padded(t)
        ref = torch.from_numpy(reference_hifx(x.numpy())).float()
        assert torch.equal(quantize(x, HIF4), ref)
        n += t.numel()
    assert n == 260_032


def test_quantization_routes_micro_casts_off_the_single_level_fast_path() -> None:
    assert not quantization.fused_block_cast_applies(torch.zeros(64), HIF4)


# --- MX6 and MX9: a one-bit micro-exponent per pair under an E8M0 exponent -------------------

MX6, MX9 = parse_cast("mx6"), parse_cast("mx9")


def test_mx6_and_mx9_specs() -> None:
    for c, elem in ((MX6, "float5_e1m3"), (MX9, "float8_e1m6")):
        assert c.format.name == elem and c.micro is not None
        assert parse_cast(str(c)) == c and c.micro.block == 16
        assert [(lv.size, lv.top) for lv in c.micro.levels] == [(2, 1)]
    # 6 and 9 bits a value: the element, 8 exponent bits per 16, one bit per pair
    assert (MX6.format.bits * 16 + 8 + 8) / 16 == 6
    assert (MX9.format.bits * 16 + 8 + 8) / 16 == 9


def test_an_mx6_worked_block(backend: object) -> None:
    """amax 5 (binade 2): the shared exponent is 2 - 0 - 1 = 1; the pair holding 5 gets +1
    (5 / 2 >= 2): 5 / 4 = 1.25 is a code; the pair (1.9, 0.3) keeps 2**1: 1.9 / 2 = 0.95 →
    1.0 (the nearest eighth), 0.3 / 2 = 0.15 → 0.125."""
    x = torch.zeros(16)
    x[0], x[2], x[3] = 5.0, 1.9, 0.3
    got = quantize(x, MX6)
    assert (float(got[0]), float(got[2]), float(got[3])) == (5.0, 2.0, 0.25)


def _mx_oracle(x: torch.Tensor, c: Cast) -> torch.Tensor:
    assert c.micro is not None
    out = []
    for row in x.reshape(-1, 16).tolist():
        vals = [Exact.of(Fraction(v)) for v in row]
        deq, _, _ = oracle.quantization.cast_micro_block(
            vals, c.format, c.micro, F32, BF16, c.rounding, c.overflow
        )
        out += [float(v.value) for v in deq]
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


def _mx_boundary(c: Cast) -> torch.Tensor:
    cases = [b.reshape(-1, 16) for b in blocks.constructed_cases(c.format, c)
             if b.numel() % 16 == 0 and torch.isfinite(b).all()]
    return torch.cat([*cases, blocks.random_blocks(64, 16, 6)])


@pytest.mark.parametrize("name", ["mx6", "mx9"])
def test_mx_both_back_ends_equal_the_oracle(name: str, backend: object) -> None:
    c = parse_cast(name)
    x = _mx_boundary(c)
    assert torch.equal(quantize(x, c), _mx_oracle(x, c))
    assert sum(o.n_failed for o in blocks.check_cast(c.format, c, Plan(quick=True))) == 0


def test_an_mx_pair_exponent_from_the_wrong_run_is_caught(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The planted fault: MX6's micro-exponent read over runs of 4, not pairs (numba)."""
    real = jit.micro_cast

    def quads(b, bits, levels, ints, consts, p):  # type: ignore[no-untyped-def]
        return real(b, bits, np.array([[4, 1]], dtype=np.int64), ints, consts, p)

    monkeypatch.setattr(jit, "micro_cast", quads)
    assert sum(o.n_failed for o in blocks.check_cast(MX6.format, MX6, Plan(quick=True))) > 0


# AMD/Huawei's MXN in the HiFloat4 reference file (global-computing-consortium/HiFloat4 at
# 6d937b6, hif4_gpu/HiF4_NVFP4_v14f16.py, To_MXN, lines 48-89: "{E8 + 8*E1} + S1PN",
# MX6 = N 6, G 16); our own numpy code from its steps, over groups of 16 along the last axis.

def reference_mxn(x: np.ndarray, n: int) -> np.ndarray:
    """To_MXN: per element E = floor(log2(|x| + 2^-1000)); the block's E8 = max E - 1; each
    pair's exponent max(E8, its max E); elements floor(|x| · 2^(Ng - EG) + 0.5) / 2^Ng with
    Ng = N - 3, 2 → 2 - 2^-Ng."""
    g = x.astype(np.float64).reshape(-1, 8, 2)
    sign = np.where(g < 0, -1.0, 1.0)
    mag = np.abs(g)
    e = np.floor(np.log2(mag + 2.0**-1000))
    e8 = e.max(axis=(1, 2)) - 1
    eg = np.maximum(e.max(axis=2), e8[:, None])[:, :, None]
    ng = n - 3
    q = np.floor(mag * 2.0 ** (-eg + ng) + 0.5) * 2.0**-ng
    q = np.where(q >= 2, 2 - 2.0**-ng, q)
    return (sign * q * 2.0**eg).reshape(x.shape)


def _padded16(t: torch.Tensor) -> torch.Tensor:
    t = t.float().reshape(-1, t.shape[-1]) if t.dim() else t.float().reshape(1, 1)
    return torch.nn.functional.pad(t, (0, -t.shape[-1] % 16))


@pytest.mark.parametrize(("name", "n"), [("mx6", 6), ("mx9", 9)])
def test_mx_matches_the_reference_on_boundary_blocks(name: str, n: int) -> None:
    """0 differences on blocks whose amax is at least 2^-126 (below it the reference's shared
    exponent leaves E8M0's range, which drift clamps at 2^-127: the next test)."""
    c = parse_cast(name)
    x = _mx_boundary(c)
    x = x[x.abs().amax(dim=1) >= 2.0**-126]
    x = torch.cat([x, torch.zeros(2, 16)])
    ref = torch.from_numpy(reference_mxn(x.numpy(), n)).float()
    assert len(x) > 100 and torch.equal(quantize(x, c), ref)


def test_mx_below_e8m0s_range_departs_from_the_reference_as_documented() -> None:
    """A block of amax 2^-130: the reference's shared exponent is -131, below E8M0's range;
    drift clamps it to -127, where 2^-130 is 0.125 (a code) but 3·2^-133 is 0.047 and
    rounds to 0; the reference keeps it."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 2.0**-130, 3 * 2.0**-133
    ref = reference_mxn(x.double().numpy(), 6)
    got = quantize(x, MX6)
    assert float(got[0, 0]) == 2.0**-130 and float(got[0, 1]) == 0.0
    assert ref[0, 1] == 3 * 2.0**-133


@requires_stories
@pytest.mark.parametrize(("name", "n"), [("mx6", 6), ("mx9", 9)])
def test_mx_matches_the_reference_on_every_stories260k_tensor(name: str, n: int) -> None:
    c = parse_cast(name)
    for key, t in stories_weights():
        x = _padded16(t)
        ref = torch.from_numpy(reference_mxn(x.numpy(), n)).float()
        assert torch.equal(quantize(x, c), ref), key


# --- the numba scale choice alone (the masks path, verify's scale cells) ---------------------
# row_scales is the one copy both numba callers inline; the one-pass cast is checked above, the
# scales alone here, field by field against the torch back-end (every field is exact: powers of
# two, 8-bit significands, integers and flags).

def _with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a NaN, an inf and a -inf planted in three rows (their finite members still
    choose the scales)."""
    x = x.clone()
    x[0, 1], x[1, -1], x[2, 3] = float("nan"), float("inf"), float("-inf")
    return x


def _scale_mismatches(x: torch.Tensor, c: Cast) -> int:
    assert c.micro is not None
    want = microscale.torch_scales(x, c.format, c.micro)
    got = jit.micro_block_scales(x.contiguous(), *microscale._consts(c.format, c.micro))
    pairs = zip((want.s, want.r, want.bad, want.clamped, want.exps), got, strict=True)
    return sum(int((a != b).sum()) for a, b in pairs)


@pytest.mark.parametrize("name", ["hifloat4", "mx6", "mx9"])
def test_the_numba_scales_equal_torch_field_by_field(name: str) -> None:
    c = parse_cast(name)
    x = _with_nonfinite(_boundary_blocks() if c == HIF4 else _mx_boundary(c))
    assert c.micro is not None
    sc = microscale.micro_scales(x, c.format, c.micro)  # the numba back-end, via dispatch
    assert sc.bad[:3].all() and not sc.bad[3:].any()
    assert sc.clamped.any() and sc.exps.max() == c.micro.steps and sc.exps.min() == 0
    assert _scale_mismatches(x, c) == 0


def test_a_numba_scale_fault_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted fault in the shared scale choice as the masks path calls it: HiFloat4's
    inner micro-exponent read over runs of 8, not 4."""
    real = jit.micro_block_scales

    def wide_runs(b, levels, ints, consts):  # type: ignore[no-untyped-def]
        return real(b, np.array([[8, 1], [8, 1]], dtype=np.int64), ints, consts)

    monkeypatch.setattr(jit, "micro_block_scales", wide_runs)
    assert _scale_mismatches(_with_nonfinite(_boundary_blocks()), HIF4) > 0


# --- the one-pass cast's nearest rounding (microcode.round_nearest_wide) ---------------------
# The cast rounds its elements to nearest by exact float steps where the grid allows
# (wide_nearest_applies) and by jitcode.round_one elsewhere; on the same kernel, both must give
# the same bits (compared as int32, so that a lost negative zero counts).

def _tie_blocks(c: Cast) -> torch.Tensor:
    """Boundary blocks, and blocks of exact ties, carries into the next binade, values at and
    beyond the grid's top and negative zeros and tiny negatives, all under one amax 1."""
    assert c.micro is not None
    cols = c.micro.block
    x = _boundary_blocks() if c.micro.block == 64 else _mx_boundary(c)
    m = c.format.mbits
    g = torch.Generator().manual_seed(7)
    # under MX6's and MX9's amax 4 (s = 2, pairs without it at 2**0) the grid's quantum is
    # 2**-m of x / 2: these are ties, below the top code
    ties = (torch.randint(0, 2 ** (m + 1), (64, cols), generator=g) + 0.5) / 2 ** (m - 1)
    ties *= torch.where(torch.rand(64, cols, generator=g) < 0.5, -1.0, 1.0)
    ties[:, 0] = 4.0  # one amax per block, so that the ties stay ties under every scale
    ties[:8, 1:4] = torch.tensor([-0.0, -(2.0**-40), 2.0**-40])
    return torch.cat([x, ties.float()]).contiguous()


def _one_pass(x: torch.Tensor, c: Cast, wide: bool, levels: np.ndarray | None = None
              ) -> torch.Tensor:
    import driftcli.kernels.microcode as code  # numba, as the kernels import it

    assert c.micro is not None
    own, ints, consts = microscale._consts(c.format, c.micro)
    levels = own if levels is None else levels
    p = jit_params(src=source_of(torch.float64), tgt=target_of(c.format), rounding=c.rounding,
                   overflow=c.overflow, sr_bits=8)
    rows, cols = x.shape
    out = np.empty(rows * cols, dtype=np.float32)
    kernel = code.cast_kernel(p[13], p[14], False, wide, cols, int(levels[-1, 0]))
    flat = x.reshape(-1).numpy()
    kernel(flat, flat.view(np.int32), cols, levels, ints, consts, np.asarray(p, dtype=np.int64),
           np.empty(0, dtype=np.int64), out, 0, rows)
    return torch.from_numpy(out).view(rows, cols)


@pytest.mark.parametrize("spec", ["hifloat4", "hifloat4:rne", "mx6", "mx6:rne", "mx9",
                                  "mx9:rne", "mx6:rne:ieee"])
def test_the_wide_nearest_rounding_equals_round_one(spec: str) -> None:
    import driftcli.kernels.microcode as code  # numba, as the kernels import it

    c = parse_cast(spec)
    p = jit_params(src=source_of(torch.float64), tgt=target_of(c.format), rounding=c.rounding,
                   overflow=c.overflow, sr_bits=8)
    assert code.wide_nearest_applies(p, p[13], False)
    x = _tie_blocks(c)
    fast, general = _one_pass(x, c, True), _one_pass(x, c, False)
    assert torch.equal(fast.view(torch.int32), general.view(torch.int32))
    assert int((fast.view(torch.int32) == -(2**31)).sum()) >= 16  # negative zeros kept
    # and the cast, through quantize, equals the torch back-end bit for bit
    jit.set_jit("never")
    try:
        want = quantize(x, c)
    finally:
        jit.set_jit("auto")
    assert torch.equal(quantize(x, c).view(torch.int32), want.view(torch.int32))


def test_the_wide_nearest_rounding_tells_ties_apart() -> None:
    """The planted fault: ties away asked of the nearest-even kernel (one flag of the fast
    path). The tie blocks hold ties on both kinds of code, so the two differ, and the fast
    path's even rounding is the general path's, not the away one."""
    import driftcli.kernels.microcode as code  # numba, as the kernels import it

    even = parse_cast("mx6:rne")
    x = _tie_blocks(even)
    right = _one_pass(x, even, True)
    away = _one_pass(x, MX6, True)
    assert int((right != away).sum()) > 100
    p = jit_params(src=source_of(torch.float64), tgt=target_of(MX6.format),
                   rounding=even.rounding, overflow=even.overflow, sr_bits=8)
    # the fast path stands aside where its steps do not hold: stochastic rounding, directed
    assert not code.wide_nearest_applies(p, p[13], True)
    assert not code.wide_nearest_applies(p, 2, False)
