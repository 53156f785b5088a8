"""Row-scaled NVFP4 (``te/nvfp4_row``): each row's own float32 amax in place of the tensor's, on
both back-ends, against the oracle and the reference transcription (tests/recipe_refs.py
``te_nvfp4_row``), with a planted fault caught. Boundary data and every stories260K tensor are
compared with the transcription in tests/test_recipes_kernels.py."""

from __future__ import annotations

import pytest
import torch
from recipe_data import differences, info_of
from recipe_refs import REFERENCES

from driftcli.casts import given, quantization, scalearith
from driftcli.errors import CastSpecError
from driftcli.kernels import jit
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS
from driftcli.verify import Plan
from driftcli.verify.recipes import check_recipe

ROWS = torch.tensor([[448.0 * 6.0] + [0.0] * 15 + [1.0] * 16,
                     [3e-3, 1e-3] + [0.0] * 30])
"""Two rows of two blocks: the first row's amax 2688 makes the tensor's S_enc 1, under which
the second row's block scale 3e-3 / 6 rounds to E4M3's zero; the row's own S_enc (2688 / 3e-3)
gives it sb = 448 and its elements keep their values to E2M1's precision."""


@pytest.mark.parametrize("never", [False, True])
def test_each_row_takes_its_own_amax(never: bool) -> None:
    if never:
        jit.set_jit("never")
    try:
        row = info_of(ROWS, "te/nvfp4_row")
        tensor = info_of(ROWS, "te/nvfp4")
    finally:
        jit.set_jit("auto")
    assert tensor.values[1, :2].tolist() == [0.0, 0.0]  # a zero block scale
    assert row.codes[1, :2].tolist() == [6.0, 2.0]
    assert row.values[1, 0].item() == pytest.approx(3e-3, rel=1e-6)
    assert row.tensor_scale is None  # no one tensor scale
    assert torch.equal(row.values[0], tensor.values[0])  # the row holding the tensor amax


def _failures(x: torch.Tensor) -> int:
    values, codes = REFERENCES["te/nvfp4_row"](x.numpy())
    got = info_of(x, "te/nvfp4_row")
    return int((differences(got.values, torch.from_numpy(values))
                | differences(got.codes, torch.from_numpy(codes))).sum())


def test_row_scaled_nvfp4_passes_the_oracle_and_its_transcription() -> None:
    fp4 = FORMATS["float4_e2m1fn"]
    assert sum(o.n_failed for o in check_recipe(fp4, "te/nvfp4_row", Plan(quick=True))) == 0
    assert _failures(ROWS) == 0


def test_a_planted_tensor_amax_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor's amax for every row (row scaling forgotten): the transcription and
    verify-formats' recipes suite both see it."""
    monkeypatch.setattr(given, "row_amax",
                        lambda amax, *_: amax.max().expand_as(amax).contiguous())
    assert _failures(ROWS) > 0
    fp4 = FORMATS["float4_e2m1fn"]
    assert sum(o.n_failed for o in check_recipe(fp4, "te/nvfp4_row", Plan(quick=True))) > 0


def test_row_scaling_is_refused_on_tiles_in_one_line() -> None:
    with pytest.raises(CastSpecError, match="row-scaled NVFP4"):
        parse_cast("float4_e2m1fn:tile16:float8_e4m3fn:two-level:rne:saturate:amax=fmax,"
                   "two=te-row")


def test_the_row_amax_is_the_largest_block_amax_of_each_row() -> None:
    amax = torch.tensor([1.0, 3.0, 2.0, 0.5, 0.25, 0.0])
    assert scalearith.row_amax(amax, 48, 16).tolist() == [3.0] * 3 + [0.5] * 3
    assert scalearith.row_amax(amax, 40, 16).tolist() == [3.0] * 3 + [0.5] * 3  # padded


def test_a_scan_never_cuts_a_row_of_a_row_scaled_cast() -> None:
    """The scan slices dim 0 where every cast allows; a row-scaled cast's rows lie along the
    block axis, so a 1-D tensor, or blocks along dim 0, are never cut (each row's amax whole)."""
    from driftcli.measures.scan import row_alignment

    row = parse_cast("te/nvfp4_row")
    assert row_alignment((4096,), row, -1) is None
    assert row_alignment((64, 4096), row, 0) is None
    assert row_alignment((64, 4096), row, -1) == 1
    assert row_alignment((4096,), parse_cast("te/nvfp4"), -1) == 16  # a tensor amax is given


# --- row scaling with four over six (te/nvfp4_row_4over6, te-row-4over6-*) ------------------

S = 2.0**-20
ROWS_4OVER6 = torch.tensor([[1536.0, 1280.0] + [0.0] * 14, [1536.0 * S, 1280.0 * S] + [0.0] * 14])
"""Two rows of one block, the second the first times 2**-20. Under its own amax each row has
S_enc = 1536 / amax_row and keeps map-to-4 (1280 -> code 3, 1152: error 128 against
map-to-6's 256); under the tensor's amax the second row's block scales round to E4M3's zero."""
ROW_ORDERS = [("te-row-4over6-mae", False, False), ("te-row-4over6-mse", True, False),
              ("te-row-4over6-mae-fp16", False, True), ("te-row-4over6-mse-fp16", True, True)]


def _row_spec(order: str, group: str = "block16") -> str:
    return f"float4_e2m1fn:{group}:float8_e4m3fn:two-level:rne:saturate:amax=fmax,two={order}"


def _spread() -> torch.Tensor:
    """Rows whose amaxes lie binades apart (so a row's S_enc is not the tensor's), with a zero
    row and a row of one block's worth of subnormal-scale values."""
    gen = torch.Generator().manual_seed(27)
    x = torch.randn(8, 64, generator=gen) * torch.exp2(
        torch.randint(-14, 14, (8, 1), generator=gen).float())
    x[3] = 0.0
    x[5, 16:] = 0.0
    return x


@pytest.mark.parametrize("never", [False, True])
def test_row_scaled_four_over_six_takes_each_rows_amax(never: bool) -> None:
    if never:
        jit.set_jit("never")
    try:
        got = info_of(ROWS_4OVER6, "te/nvfp4_row_4over6")
        tensor = info_of(ROWS_4OVER6, "te/nvfp4_4over6")
        row = info_of(ROWS_4OVER6, "te/nvfp4_row")
    finally:
        jit.set_jit("auto")
    assert got.codes[:, :2].tolist() == [[4.0, 3.0], [4.0, 3.0]]  # map-to-4 in both rows
    assert got.values[:, :2].tolist() == [[1536.0, 1152.0], [1536.0 * S, 1152.0 * S]]
    assert got.scales.tolist() == [384.0, 384.0 * S] and got.tensor_scale is None
    assert tensor.values[1, :2].tolist() == [0.0, 0.0]  # one tensor amax: a zero block scale
    assert row.values[:, 1].tolist() == [1024.0, 1024.0 * S]  # one candidate: 1280 -> 1024
    values, codes = REFERENCES["te/nvfp4_row_4over6"](ROWS_4OVER6.numpy())
    assert values[:, 1].tolist() == [1152.0, 1152.0 * S] and codes[1, 1] == 3.0


@pytest.mark.parametrize(("order", "squared", "fp16"), ROW_ORDERS)
def test_row_scaled_four_over_six_equals_its_transcription_on_both_back_ends(
        order: str, squared: bool, fp16: bool) -> None:
    """reference_nvfp4.py with ``row_scaled_nvfp4`` and ``nvfp4_use_4over6`` (tests/recipe_refs.py
    ``te_nvfp4_4over6(..., row_scaled=True)``), every error path, bit for bit; the values-only
    cast gives the same values."""
    from recipe_refs import te_nvfp4_4over6

    for x in (ROWS_4OVER6, _spread()):
        values, codes = te_nvfp4_4over6(x.numpy(), squared, fp16, row_scaled=True)
        for mode in ("auto", "never"):
            jit.set_jit(mode)
            try:
                got = info_of(x, _row_spec(order))
                plain = quantization.quantize(x, parse_cast(_row_spec(order)))
            finally:
                jit.set_jit("auto")
            assert not (differences(got.values, torch.from_numpy(values))
                        | differences(got.codes, torch.from_numpy(codes))).any(), (order, mode)
            assert not differences(plain, got.values).any(), (order, mode)


def _oracle_apart(x: torch.Tensor, name: str) -> int:
    from driftcli.verify.compare import to_float
    from driftcli.verify.recipes import oracle_recipe

    exact, _ = oracle_recipe(x, parse_cast(name))
    want = torch.tensor([to_float(v) for v in exact], dtype=torch.float64)
    return int(differences(info_of(x, name).values.flatten().double(), want).sum())


def test_row_scaled_four_over_six_passes_the_oracle() -> None:
    fp4 = FORMATS["float4_e2m1fn"]
    for name in ("te/nvfp4_row_4over6", "te/nvfp4_row_4over6_mse"):
        assert sum(o.n_failed for o in check_recipe(fp4, name, Plan(quick=True))) == 0, name
        assert _oracle_apart(_spread(), name) == 0, name


def test_a_planted_tensor_amax_in_the_error_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scales from each row's amax but the candidates' errors from the tensor's (the
    reference's ``error_global_amax`` not taken per row): the transcription and the exact twin
    both see it, on either back-end."""
    from driftcli.casts import fouroversix

    honest = fouroversix.candidate_errors

    def tensor_wide(blocks: torch.Tensor, elem: object, sb4: torch.Tensor, sb6: torch.Tensor,
                    inv4: torch.Tensor, inv6: torch.Tensor, t: torch.Tensor, enc: torch.Tensor,
                    order: object) -> tuple[torch.Tensor, torch.Tensor]:
        top = t.max().expand_as(t).contiguous()
        return honest(blocks, elem, sb4, sb6, inv4, inv6, top,  # type: ignore[arg-type]
                      fouroversix.tensor_scales(top)[0], order)  # type: ignore[arg-type]

    monkeypatch.setattr(fouroversix, "candidate_errors", tensor_wide)
    x = _spread()
    values, _ = REFERENCES["te/nvfp4_row_4over6"](x.numpy())
    for mode in ("auto", "never"):
        jit.set_jit(mode)
        try:
            apart = int(differences(info_of(x, "te/nvfp4_row_4over6").values,
                                    torch.from_numpy(values)).sum())
            assert apart > 0, mode
            assert _oracle_apart(x, "te/nvfp4_row_4over6") == apart, mode
        finally:
            jit.set_jit("auto")


def test_row_scaled_four_over_six_is_refused_on_tiles_in_one_line() -> None:
    with pytest.raises(CastSpecError, match="row-scaled NVFP4"):
        parse_cast(_row_spec("te-row-4over6-mae", "tile16"))
