"""The random Hadamard transform on a tensor core (``rht=…,tc=<core>`` in a cast spec;
driftcli/casts/hadamard.py ``core_groups``): the grammar, both back-ends of the block-FMA unit
against the exact twin (oracle.hadamard.hadamard16_blockfma) on the groups that part its
roundings, where it parts from ``rht=te`` (the float32 sum in order), planted faults caught by
the transform check verify-formats runs, and the counts docs/recipes.md quotes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from recipe_data import differences, requires_stories, stories_weights
from safetensors.torch import save_file
from test_hadamard import _both
from typer.testing import CliRunner

from driftcli.arith.blockfma import Accumulation, FMAUnit
from driftcli.arith.tensorcores import CORES, TensorCore
from driftcli.casts import hadamard
from driftcli.casts.quantization import quantize
from driftcli.cli import app
from driftcli.errors import CastSpecError
from driftcli.kernels import jit
from driftcli.measures.scan import ScanOptions, scan
from driftcli.records.cast import TE_SIGNS, Rht
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS
from driftcli.records.modes import Rounding
from driftcli.verify.compare import Plan, exact_of_float, to_float
from driftcli.verify.recipes import check_transform, exact_transform, rht_cases

FP4 = FORMATS["float4_e2m1fn"]
DOC = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
H100, A100 = "h100_bf16_f32", "a100_bf16_f32"


def _oracle(x: torch.Tensor, r: Rht) -> torch.Tensor:
    values = [exact_of_float(v) for v in x.flatten().tolist()]
    return torch.tensor([to_float(y) for y in exact_transform(values, r)],
                        dtype=torch.float64).view(x.shape)


def _group(v: list[float], rht: Rht) -> torch.Tensor:
    """The group x_i = 4 s_i v_i, whose output 0 sums the v_i."""
    signs = torch.tensor(rht.signs, dtype=torch.float64)
    return (4 * signs * torch.tensor(v, dtype=torch.float64)).float().view(1, 16)


def test_the_key_round_trips_and_refuses_what_it_cannot_mean() -> None:
    for spec in (f"nvfp4:rht=te,tc={H100}", f"te/nvfp4:rht=random/7,tc={A100}",
                 f"nvfp4:rht=checkpoint,tc={H100}",
                 "float4_e2m1fn:block16:float8_e4m3fn:two-level:amax=fmax,two=te,"
                 "rht=h,tc=b200_bf16_f32"):
        c = parse_cast(spec)
        assert c.rht is not None and c.rht.core and parse_cast(str(c)) == c
    c = parse_cast(f"nvfp4:rht=te,tc={H100}")
    assert c.rht == Rht(TE_SIGNS, "te", H100) and str(c).endswith(f":rht=te,tc={H100}")
    assert c != parse_cast("nvfp4:rht=te")
    for bad, words in ((f"nvfp4:tc={H100}", "tc= names the tensor core"),
                       (f"nvfp4:rht=te,tc={H100},tc={A100}", "tc= names the tensor core"),
                       ("nvfp4:rht=te,tc=H100 bf16", "name a tensor core"),
                       ("nvfp4:rht=te,tc=", "tc= names the tensor core"),  # not ignored
                       (f"te/nvfp4_rht:rht=h,tc={H100}", "a second")):
        with pytest.raises(CastSpecError, match=words):
            parse_cast(bad)
    # the units with bfloat16 operands, read from CORES: the only ones tc= takes
    assert hadamard.transform_cores() == [A100, "ada_bf16_f32", H100, "h200_bf16_f32",
                                          "b200_bf16_f32", "rtxpro6000_bf16_f32"]
    assert all(CORES[n].acc == "float32" for n in hadamard.transform_cores())
    fp8 = parse_cast("nvfp4:rht=te,tc=h100_e4m3_f32")  # a name, checked where it runs
    assert fp8.rht is not None
    hadamard.check_core(c.rht)
    with pytest.raises(CastSpecError, match="not a tensor core with bfloat16 inputs; choose "
                                            "tc= from a100_bf16_f32, ada_bf16_f32"):
        quantize(torch.ones(2, 16), fp8)


def test_a_scan_refuses_a_core_it_cannot_run_before_reading(tmp_path: Path) -> None:
    """One line, exit 2, from the command; no error row per tensor."""
    path = tmp_path / "m.safetensors"
    save_file({"l.weight": torch.ones(4, 16)}, str(path))
    with pytest.raises(CastSpecError, match="'h100_e4m3_f32' is not a tensor core"):
        scan([path], ["nvfp4", "nvfp4:rht=te,tc=h100_e4m3_f32"])
    res = CliRunner().invoke(app, ["clip-rate", str(path), "-c", "nvfp4:rht=h,tc=v100_fp16_f32",
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "'v100_fp16_f32' is not a tensor core with bfloat16 inputs" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("core", "signs"), [(H100, "te"), (A100, "random/7")])
def test_both_back_ends_equal_the_exact_twin_bit_for_bit(core: str, signs: str) -> None:
    """verify's transform groups for a tc= cast (the partings, NaN, inf, overflow, subnormals,
    80 binades of float32 values rounded to bfloat16) and seeded bfloat16 groups."""
    c = parse_cast(f"nvfp4:rht={signs},tc={core}")
    assert c.rht is not None
    gen = torch.Generator().manual_seed(5)
    wide = (torch.randn(32, 16, generator=gen) * torch.exp2(
        torch.randint(-24, 25, (32, 16), generator=gen).float())).bfloat16().float()
    x = torch.cat([*(g.reshape(-1, 16) for g in rht_cases(c, Plan(quick=False))), wide])
    numba, ref = _both(hadamard.transform, x, c.rht)
    want = _oracle(x, c.rht)
    assert not differences(numba, ref).any()
    assert not differences(numba, want.float()).any()
    assert not differences(want.float(), want).any()  # the twin's values are on float32's grid
    assert int(torch.isnan(numba).sum()) > 0 and int(torch.isinf(numba).sum()) > 0
    # and the cast that reads it: quantize on both back-ends, the same values and codes
    q_numba, q_ref = _both(lambda t: quantize(t, c, return_info=True), x)
    assert not differences(q_numba.values, q_ref.values).any()
    assert torch.equal(q_numba.codes.nan_to_num(-9), q_ref.codes.nan_to_num(-9))


@pytest.mark.parametrize(("v", "in_order", "h100", "a100"), [
    # a bfloat16 tie (odd below, even above) less 2**-25: H100 keeps it and rounds toward zero
    ([1.0, 3 * 2.0**-8, -(2.0**-25)] + [0.0] * 13, 1 + 2.0**-6, 1 + 2.0**-7, 1 + 2.0**-6),
    # 1 + 2**-8 and fourteen 2**-25: below half a float32 ulp each in order, all kept on H100
    ([1.0, 2.0**-8] + [2.0**-25] * 14, 1.0, 1 + 2.0**-7, 1.0),
    # a cancellation: the unit aligned the small terms to 2**20 and cut them
    ([2.0**20, -(2.0**20), 2.0**-30, 2.0**-31] + [0.0] * 12, 1.5 * 2.0**-30, 0.0, 0.0),
])
def test_the_tensor_cores_part_from_the_sum_in_order(v: list[float], in_order: float,
                                                     h100: float, a100: float) -> None:
    """The option is observable: output 0 of one group under rht=te and on two units."""
    for spec, want in (("te", in_order), (f"te,tc={H100}", h100), (f"te,tc={A100}", a100)):
        r = parse_cast(f"nvfp4:rht={spec}").rht
        assert r is not None
        for got in _both(hadamard.transform, _group(v, r), r):
            assert got[0, 0].item() == want, spec
        assert to_float(exact_transform([exact_of_float(x) for x in _group(v, r).flatten()
                                         .tolist()], r)[0]) == want


def _planted_rne(self: TensorCore, promote: int = 0) -> Accumulation:
    """The unit's groups rounded to nearest instead of toward zero."""
    e = self.input_format.emin
    return Accumulation(self.unit, FORMATS["float32"], Rounding.RNE, e, e, promote)


def _planted_kept(self: TensorCore, promote: int = 0) -> Accumulation:
    """One bit fewer kept below the group's largest exponent."""
    u, e = self.unit, self.input_format.emin
    return Accumulation(FMAUnit(u.size, u.kept_bits - 1, u.min_exp, u.interleave),
                        FORMATS["float32"], self.rounding, e, e, promote)


def _transform_failures() -> int:
    c = parse_cast(f"te/nvfp4:rht=te,tc={H100}")
    return check_transform(FP4, "te/nvfp4:rht=te,tc=h100_bf16_f32", c, Plan(quick=True)).n_failed


@pytest.mark.parametrize("path", ["numba", "torch"])
def test_the_transform_check_passes_and_catches_planted_faults(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify-formats' transform check (verify.recipes.check_transform, quick plan) on a tc=
    cast: clean it passes; a group rounded to nearest, a bit fewer kept, or tc= ignored (the
    sum in order) fails it, on either back-end."""
    if path == "torch":
        jit.set_jit("never")
    try:
        assert _transform_failures() == 0
        for plant in (_planted_rne, _planted_kept):
            with monkeypatch.context() as m:
                m.setattr(TensorCore, "accumulation", plant)
                assert _transform_failures() > 0, plant.__name__
        with monkeypatch.context() as m:
            m.setattr(hadamard, "core_groups", hadamard.torch_groups)
            assert _transform_failures() > 0
    finally:
        jit.set_jit("auto")


def test_a_checkpoints_signs_keep_the_tensor_core(tmp_path: Path) -> None:
    """rht=checkpoint,tc=: the layer's signs are read in and the transform still runs on the
    unit (the resolution keeps tc=): the counts are rht=te,tc='s, not rht=checkpoint's (the
    float32 weights read as bfloat16 operands there: 76 clipped elements against 79 here)."""
    g = torch.Generator().manual_seed(3)
    path = tmp_path / "m.safetensors"
    save_file({"l.weight": torch.randn(32, 64, generator=g),
               "l._rht_sign_vector": torch.tensor(TE_SIGNS, dtype=torch.int8)}, str(path))
    got = scan([path], [f"nvfp4:rht=checkpoint,tc={H100}", f"nvfp4:rht=te,tc={H100}",
                        "nvfp4:rht=checkpoint"], options=ScanOptions(draws=1))
    assert len(got.results) == 3 and not got.errors
    facts = [(st.clipped, st.ee, st.e_sum) for st in (r.draws[0] for r in got.results)]
    assert facts[0] == facts[1] and facts[0] != facts[2]


def _changed(x: torch.Tensor, core: str) -> tuple[int, int]:
    """Transformed values and NVFP4 codes that differ between rht=te and rht=te,tc=core."""
    ref, tc = parse_cast("nvfp4:rht=te"), parse_cast(f"nvfp4:rht=te,tc={core}")
    assert ref.rht is not None and tc.rht is not None
    values = int((hadamard.transform(x, ref.rht) != hadamard.transform(x, tc.rht)).sum())
    a, b = quantize(x, ref, return_info=True), quantize(x, tc, return_info=True)
    return values, int((a.codes != b.codes).sum())


def _doc_section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("### The random Hadamard transform")
    return re.sub(r"\s+", " ", text[start:text.index("### Where Transformer Engine", start)])


@requires_stories
def test_recipes_md_counts_on_stories260k() -> None:
    """stories260K's weights whose rows are whole groups of 16, rounded to bfloat16 (the
    kernel's operands, so both transforms read the same values): no value and no code moves."""
    total, tensors = 0, 0
    changed = {H100: (0, 0), A100: (0, 0)}
    for _, w in stories_weights():
        if w.dim() < 2 or w.shape[-1] % 16:
            continue
        x = w.bfloat16().float()
        tensors, total = tensors + 1, total + x.numel()
        for core, (v, q) in changed.items():
            dv, dq = _changed(x, core)
            changed[core] = (v + dv, q + dq)
    assert (tensors, total) == (31, 204_288)
    assert changed == {H100: (0, 0), A100: (0, 0)}
    section = _doc_section()
    assert ("31 weight tensors whose rows are whole groups of 16 (204,288 elements, rounded "
            "to bfloat16") in section and "NVFP4 code against `rht=te` (0 and 0)" in section


def test_recipes_md_counts_on_a_seeded_tensor() -> None:
    """262,144 bfloat16 values N(0, 1) · 2**k, k uniform in ±24 (numpy's draws, the same bits
    on every CPU): a few transformed values move, no NVFP4 code."""
    rng = np.random.default_rng(27)
    v = rng.standard_normal((1024, 256)) * np.exp2(rng.integers(-24, 25, (1024, 256)))
    x = torch.from_numpy(v).bfloat16().float()
    assert _changed(x, H100) == (8, 0) and _changed(x, A100) == (10, 0)
    assert ("8 of the 262,144 transformed values on `h100_bf16_f32` and 10 on "
            "`a100_bf16_f32`, and 0 codes") in _doc_section()


def test_recipes_md_lists_the_cores_of_cores() -> None:
    """The table of tc= values in docs/recipes.md: every bfloat16 core of CORES once, each
    row's unit (products, bits kept, floor) its cores' own."""
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines()
            if line.startswith("| `") and "_bf16_f32`" in line]
    listed: list[str] = []
    for row in rows:
        names = re.findall(r"`(\w+_bf16_f32)`", row)
        size, kept, floor = (int(n) for n in re.findall(r"\d+", row.split("|")[2]
                                                         .replace("\u2212", "-")))
        for name in names:
            unit = CORES[name].unit
            assert (unit.size, unit.kept_bits, -unit.min_exp) == (size, kept, floor), name
        listed += names
    assert sorted(listed) == sorted(hadamard.transform_cores())


def test_a_wider_source_is_rounded_once_to_bfloat16_operands() -> None:
    """A float64 1 + 2**-8 + 2**-30 is past a bfloat16 tie: the operand is 1 + 2**-7 when
    rounded once (as .to(torch.bfloat16) does), 1.0 through float32 (where 2**-30 is lost and
    the tie goes to even); on both back-ends and in the twin, and a bfloat16 source is read
    as it is."""
    r = parse_cast(f"nvfp4:rht=h,tc={H100}").rht
    assert r is not None
    x = torch.zeros(1, 16, dtype=torch.float64)
    x[0, 0] = 1 + 2.0**-8 + 2.0**-30
    for got in _both(hadamard.transform, x, r):  # rht=h: every output is x_0 / 4
        assert torch.equal(got, torch.full((1, 16), (1 + 2.0**-7) / 4))
    assert torch.equal(_oracle(x, r).float(), torch.full((1, 16), (1 + 2.0**-7) / 4))
    assert torch.equal(hadamard.transform(x.float(), r), torch.full((1, 16), 0.25))
    y = x.bfloat16()
    assert torch.equal(hadamard.transform(y, r), hadamard.transform(y.float(), r))
