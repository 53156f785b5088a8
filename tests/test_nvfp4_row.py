"""Row-scaled NVFP4 (``te/nvfp4_row``): each row's own float32 amax in place of the tensor's, on
both back-ends, against the oracle and the reference transcription (tests/recipe_refs.py
``te_nvfp4_row``), with a planted fault caught. Boundary data and every stories260K tensor are
compared with the transcription in tests/test_recipes_kernels.py."""

from __future__ import annotations

import pytest
import torch
from recipe_data import differences, info_of
from recipe_refs import REFERENCES

from driftcli.casts import quantization, scalearith
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
    monkeypatch.setattr(quantization, "row_amax",
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
