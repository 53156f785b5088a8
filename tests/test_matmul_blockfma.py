"""Order ``blockfma``: the spec grammar, the numba and torch implementations bit for bit, the
exact reference, promotion and block scales by hand, and a planted fault verify-formats
catches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from driftcli.arith.blockfma import Accumulation, FMAUnit, fma_dot, parse_unit
from driftcli.arith.matmul import MatmulSpecError, matmul, matmul_spec, parse_matmul_spec
from driftcli.arith.tensorcores import CORES
from driftcli.casts.rounding import round_to_format
from driftcli.kernels import jit
from driftcli.records.formats import FORMATS
from driftcli.records.modes import Rounding
from driftcli.verify import matmuls
from driftcli.verify.compare import Plan


def test_the_spec_round_trips_and_a_preset_is_written_out() -> None:
    spec = parse_matmul_spec("tc=h100_e4m3_f32,order=blockfma:128")
    assert str(spec) == ("lhs=float8_e4m3fn:none:rne:saturate,rhs=float8_e4m3fn:none:rne:saturate,"
                         "acc=e8m13:rtz,order=blockfma:128,fma=32:13:e-133,scale=dequantized,"
                         "out=none")
    assert parse_matmul_spec(str(spec)) == spec
    core = CORES["h100_e4m3_f16"]
    inter = parse_matmul_spec("tc=h100_e4m3_f16,lhs=mxfp8_e4m3")
    assert inter.unit == core.unit and inter.unit.interleave == 2
    assert inter.accumulator == FORMATS["float16"] and inter.acc_rounding is Rounding.RNE
    assert inter.lhs is not None and inter.lhs.scaling.block == 32  # an operand given stays
    assert str(parse_unit("32:25:i2:e-133")) == "32:25:i2:e-133"
    assert parse_unit("16:13") == FMAUnit(16, 13)


@pytest.mark.parametrize(("text", "match"), [
    ("order=blockfma", "needs a unit"),
    ("order=sequential,fma=32:13", "needs order=blockfma"),
    ("order=blockfma:48,fma=32:13", "not a whole number of groups of 32"),
    ("tc=h100_e4m3_f32,acc=float32", "tc=h100_e4m3_f32 sets acc"),
    ("tc=h100_e4m3_f32,order=pairwise", "its order is blockfma"),
    ("tc=h101_e4m3_f32", "h100_e4m3_f32"),
    ("order=blockfma,fma=32", "SIZE:KEPT"),
    ("order=blockfma,fma=6:25:i2", "multiple of 4"),
    # above the numba kernel's ceiling on E, where it once disagreed with the torch path and
    # the reference (2**127 * 2**127 under fma=2:47:e400: inf against +0)
    ("order=blockfma,fma=2:47:e400", "min_exp 400 is above 300"),
    ("order=blockfma,fma=32:13,acc=float32:rup", "not supported"),
    ("lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,order=blockfma,fma=32:13,scale=block", "blockfma:32"),
    # operands without block scales are named first (once: "write order=blockfma:BLOCK (the
    # block size), not blockfma:32", which asked for what was already given)
    ("tc=h100_e4m3_f32,order=blockfma:32,scale=block", "needs block-scaled casts on both"),
    ("tc=h100_e4m3_f32,lhs=mxfp8_e4m3,scale=block", "rhs is float8_e4m3fn"),
])
def test_bad_blockfma_specs_name_the_fix(text: str, match: str) -> None:
    with pytest.raises(MatmulSpecError, match=match):
        parse_matmul_spec(text)


def _operands(gen: torch.Generator, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values over 2**-14..2**2 with zeros, so that terms are cut, groups cancel and some
    groups are all zero (and fp16 results stay finite)."""
    def draw(rows: int, cols: int) -> torch.Tensor:
        mags = torch.exp2(torch.randint(-14, 3, (rows, cols), generator=gen).float())
        x = torch.randn(rows, cols, generator=gen) * mags
        return torch.where(torch.rand(rows, cols, generator=gen) < 0.15, 0.0, x)

    return draw(m, k), draw(k, n)


SPECS = (
    "tc=h100_e4m3_f32", "tc=h100_e4m3_f16", "tc=v100_fp16_f16", "tc=a100_tf32_f32",
    "tc=ada_e5m2_f16,order=blockfma:64", "tc=b200_bf16_f32,order=blockfma:32",
    "lhs=bf16,rhs=bf16,acc=bfloat16:rtz,order=blockfma,fma=8:9:i2:e-30",
    "lhs=none,rhs=none,acc=float32:rne,order=blockfma,fma=1:48",
    "lhs=mxfp4_e2m1,rhs=mxfp4_e2m1,acc=e8m13:rtz,order=blockfma:32,fma=16:13,scale=block",
    "lhs=nvfp4,rhs=fp8_e4m3,acc=float16:rtz,order=blockfma,fma=4:12",
)


def _both(a: torch.Tensor, b: torch.Tensor, spec: str) -> torch.Tensor:
    """The numba implementation's result, checked bit for bit against the torch one's."""
    got = matmul(a, b, spec)
    jit.set_jit("never")
    try:
        want = matmul(a, b, spec)
    finally:
        jit.set_jit("auto")
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), spec
    return got


@pytest.mark.parametrize("text", SPECS)
def test_numba_and_torch_give_the_same_bits(text: str) -> None:
    gen = torch.Generator().manual_seed(7)
    a, b = _operands(gen, 2 * 9, 83, 7)
    got = _both(a.reshape(2, 9, 83), b, text)  # a batch of two, b broadcast
    assert (got.isfinite() & (got != 0)).sum() > 100  # not a degenerate case


def test_specials_overflow_and_zeros_agree_in_both_implementations() -> None:
    a = torch.tensor([[float("inf"), 1.0, 2.0, 3.0], [1.0, float("nan"), 0.0, 0.0],
                      [6e4, 6e4, 6e4, 6e4], [-6e4, -6e4, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0],
                      [2.0**-24, -(2.0**-24), 0.0, 2.0**-25]])
    b = torch.ones(4, 3)
    b[:, 1] = -1.0
    b[0, 2] = 0.0  # inf * 0: NaN
    for spec in ("lhs=fp16,rhs=fp16,acc=float16:rne,order=blockfma,fma=2:20",
                 "lhs=fp16,rhs=fp16,acc=float16:rtz,order=blockfma:2,fma=2:20"):
        got = _both(a, b, spec)
        assert got[0, 0] == float("inf") and got[0, 1] == float("-inf") and got[0, 2].isnan()
        assert got[1].isnan().all()
        assert torch.equal(got[4].view(torch.int32), torch.zeros(3, dtype=torch.int32))  # +0
    # rne overflows fp16 to inf; rtz stops at 65504; promotion into float32 keeps the sum
    assert matmul(a[2:3], b[:, :1], "lhs=fp16,rhs=fp16,acc=float16:rne,order=blockfma,"
                  "fma=2:20").item() == float("inf")
    assert matmul(a[2:3], b[:, :1], "lhs=fp16,rhs=fp16,acc=float16:rtz,order=blockfma,"
                  "fma=2:20").item() == 65504.0
    assert matmul(a[2:3], b[:, :1], "lhs=fp16,rhs=fp16,acc=float16:rtz,order=blockfma:2,"
                  "fma=2:20").item() == 65504.0 + 65504.0  # each pair saturates, then float32


def test_promotion_by_hand() -> None:
    """Four groups of two: 1 + 2**-12 per group. In an e8m10 accumulator with 12 kept bits
    each group after the first loses its 2**-12 against the running sum; promoted every
    group, float32 keeps them all."""
    a = torch.tensor([[1.0, 2.0**-12] * 4])
    b = torch.ones(8, 1)
    base = "lhs=none,rhs=none,acc=e8m10:rne,fma=2:12,order="
    # group 1: 1 + 2**-12 rounds to 1 (e8m10 keeps 10 fraction bits); then 2, 3, 4
    assert matmul(a, b, base + "blockfma").item() == 4.0
    # promotion every group: each group's 1 + 2**-12 rounds to 1 in e8m10, then float32 adds
    assert matmul(a, b, base + "blockfma:2").item() == 4.0
    wide = "lhs=none,rhs=none,acc=float32:rne,fma=2:12,order="
    # float32 groups keep 1 + 2**-12, and promoted every group all four reach the master
    assert matmul(a, b, wide + "blockfma:2").item() == 4.0 + 4 * 2.0**-12
    # chained, the first two groups keep theirs (2 + 2**-11); from the third the running sum
    # is at least 2, its cut is 2**-11, and each 2**-12 is lost
    assert matmul(a, b, wide + "blockfma").item() == 4.0 + 2.0**-11


def test_block_scales_meet_each_blocks_partial_sum() -> None:
    """scale=block: the unit sums element values, each 32-block's partial sum times its two
    scales (powers of two) joins a float32 master: here every product is exact, so the
    result is the exact sum."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(-4, 5, (3, 96), generator=gen).float() * torch.exp2(
        torch.randint(-30, 30, (3, 3), generator=gen).float()).repeat_interleave(32, dim=1)
    b = torch.randint(-4, 5, (96, 2), generator=gen).float()
    got = matmul(a, b, "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=float32:rtz,order=blockfma:32,"
                 "fma=32:24,scale=block")
    exact = (a.double() @ b.double()).float()  # a few terms per block: exact in float32
    assert torch.equal(got, exact)


def test_the_paired_form_is_the_matmul_form() -> None:
    gen = torch.Generator().manual_seed(11)
    a = round_to_format(torch.randn(5, 70, generator=gen), "float8_e5m2")
    b = round_to_format(torch.randn(70, 4, generator=gen), "float8_e5m2")
    how = CORES["ada_e5m2_f32"].accumulation(promote=32)
    table = fma_dot(a, b.T, how, shape=(1, 5, 4)).reshape(5, 4)
    rows = fma_dot(a.repeat_interleave(4, 0), b.T.repeat(5, 1), how).reshape(5, 4)
    assert torch.equal(table, rows)
    assert torch.equal(table.float(), matmul(a, b, "tc=ada_e5m2_f32,order=blockfma:32"))
    with pytest.raises(ValueError, match="rne or rtz"):
        Accumulation(FMAUnit(4, 10), FORMATS["float32"], Rounding.RUP)


def test_verify_formats_catches_one_alignment_bit_too_many(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted fault of the block-FMA cells: the fast path keeps one bit more than the
    spec's unit says."""
    import dataclasses

    real = matmuls.matmul_fast

    def one_bit_more(a: torch.Tensor, b: torch.Tensor, spec: object) -> torch.Tensor:
        s = parse_matmul_spec(spec)  # type: ignore[arg-type]
        if s.unit is not None:
            s = dataclasses.replace(s, unit=dataclasses.replace(s.unit,
                                                                kept_bits=s.unit.kept_bits + 1))
        return real(a, b, s)

    def failed(fmt: str) -> int:
        return sum(o.n_failed for o in matmuls.check_matmul(FORMATS[fmt], Plan(quick=True))
                   if "blockfma" in o.operation)

    assert failed("e8m13") == 0
    monkeypatch.setattr(matmuls, "matmul_fast", one_bit_more)
    assert failed("e8m13") > 0
    assert failed("float16") > 0


def test_every_blockfma_cell_of_the_quick_plan_agrees() -> None:
    for fmt in matmuls.BLOCKFMA_ACCUMULATORS:
        outcomes = [o for o in matmuls.check_matmul(FORMATS[fmt], Plan(quick=True))
                    if "blockfma" in o.operation]
        assert len(outcomes) == 4 and all(o.n_checked >= 22 for o in outcomes), fmt
        assert sum(o.n_failed for o in outcomes) == 0, fmt


def test_blockfma_runs_wherever_a_matmul_spec_does(tmp_path: Path) -> None:
    """A policy file naming a tensor core: the interception mode runs it, gradients flow."""
    from driftcli.arith.mode import arithmetic
    from driftcli.arith.policy import get_policy

    toml = tmp_path / "h100.toml"
    toml.write_text('[forward]\ntc = "h100_e4m3_f32"\norder = "blockfma:128"\n')
    pol = get_policy(toml)
    assert pol.forward == matmul_spec(tc="h100_e4m3_f32", order="blockfma:128")
    assert pol.dgrad is None and pol.wgrad is None
    lin = torch.nn.Linear(256, 8)
    x = torch.randn(4, 256)
    with arithmetic(pol):
        y = lin(x)
    y.sum().backward()
    assert lin.weight.grad is not None and y.shape == (4, 8)
    assert not torch.equal(y, lin(x))  # the FP8 casts and the 13-bit unit changed something


def test_an_accumulator_without_infinity_keeps_its_nan_in_the_reference() -> None:
    """float8_e4m3fn has no infinity: a group's sum past 448 rounds to NaN under rne, and the
    chain stays NaN in both implementations and the exact reference (which once read the NaN
    chain as 0); under rtz it stops at 448."""
    a = torch.tensor([[300.0, 300.0, 1.0, 1.0]])
    b = torch.ones(4, 1)
    ref = matmuls._MatmulOracle()
    for fma, mode, want in (("2:20", "rne", float("nan")), ("4:20:i1", "rne", float("nan")),
                            ("2:20", "rtz", 448.0)):
        spec = parse_matmul_spec(f"lhs=none,rhs=none,acc=float8_e4m3fn:{mode},order=blockfma,"
                                 f"fma={fma}")
        got = _both(a, b, str(spec)).item()
        exact = ref.result(matmuls.MatmulCase("nan chain", a, b), spec)
        assert len(exact) == 1
        if want != want:
            assert got != got and exact[0].kind.value == "nan", (fma, mode)
        else:
            assert got == want and exact[0].kind.value == "finite" and exact[0].mag == 448


def test_a_floor_up_to_the_kernels_ceiling_agrees_in_both_implementations() -> None:
    """``min_exp`` may reach the numba kernel's ceiling on E (``TOP_CEIL``) and no further:
    there both implementations read the same E."""
    from driftcli.arith import blockfma
    from driftcli.kernels import fmacode as fmakernels

    assert blockfma.TOP_CEIL == fmakernels.TOP_CEIL == 300
    a = torch.tensor([[2.0**127, 2.0**127], [2.0**100, 2.0**100]])
    b = torch.tensor([[2.0**127], [-(2.0**126)]])
    # E = 300, 47 kept bits: multiples of 2**253; 2**254 - 2**253 keeps 2**253 (inf in
    # float32, its max under rtz); 2**200 - 2**199 is cut to +0
    got = _both(a, b, "lhs=none,rhs=none,acc=float32:rne,order=blockfma,fma=2:47:e300")
    assert got[0, 0].item() == float("inf") and got[1, 0].item() == 0.0
    got = _both(a, b, "lhs=none,rhs=none,acc=float32:rtz,order=blockfma,fma=2:47:e300")
    assert got[0, 0].item() == torch.finfo(torch.float32).max


def test_a_policy_table_with_tc_refuses_acc_and_fma_and_a_role_can_leave_blockfma() -> None:
    """``tc`` beside ``acc`` or ``fma`` in one policy table is refused, as in a spec string
    (the table once dropped them silently for the preset's); a role whose own table gives
    another order drops the unit it inherits from ``[matmul]`` (TOML cannot unset a key)."""
    from driftcli.arith.policy import PolicyError, policy_from_dict

    for key, value in (("acc", "float32:rne"), ("fma", "16:25")):
        with pytest.raises(PolicyError, match=f"tc=h100_e4m3_f32 sets {key}"):
            policy_from_dict({"forward": {"tc": "h100_e4m3_f32", key: value}})
    pol = policy_from_dict({"matmul": {"tc": "h100_e4m3_f32", "order": "blockfma:128"},
                            "dgrad": {"order": "pairwise"}, "wgrad": {"lhs": "fp8_e5m2"}})
    assert pol.forward == matmul_spec(tc="h100_e4m3_f32", order="blockfma:128")
    assert pol.dgrad is not None and pol.dgrad.order.value == "pairwise"
    assert pol.dgrad.unit is None and pol.dgrad.accumulator == FORMATS["e8m13"]
    assert pol.wgrad is not None and pol.wgrad.unit == CORES["h100_e4m3_f32"].unit
    with pytest.raises(PolicyError, match="needs order=blockfma, not pairwise"):
        policy_from_dict({"matmul": {"tc": "h100_e4m3_f32"},
                          "dgrad": {"order": "pairwise", "fma": "32:13"}})


@pytest.mark.parametrize("text", [
    "lhs=fp16,rhs=fp16,acc=float16:rtz,order=blockfma:8,fma=4:12",
    "lhs=fp16,rhs=fp16,acc=float16:rne,order=blockfma,fma=4:12:i1",
    "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=float32:rtz,order=blockfma:32,fma=8:12,scale=block",
])
def test_an_empty_matmul_is_zeros_as_in_every_other_order(text: str) -> None:
    """K = 0 gives +0 everywhere (it once failed to reshape the operands' rows); M = 0 and
    N = 0 give empty results."""
    got = _both(torch.zeros(2, 0), torch.zeros(0, 3), text)
    assert got.shape == (2, 3)
    assert torch.equal(got.view(torch.int32), torch.zeros(2, 3, dtype=torch.int32))
    assert _both(torch.zeros(0, 40), torch.ones(40, 3), text).shape == (0, 3)
    assert _both(torch.ones(2, 40), torch.zeros(40, 0), text).shape == (2, 0)
