"""Four over six (``te/nvfp4_4over6`` and its MSE and fast-error variants): the constructed
cases (a tie between the two errors, a block map-to-4 wins, the 256 bound), both back-ends, the
oracle and the reference transcription (tests/recipe_refs.py ``te_nvfp4_4over6``), and planted
faults each check catches. The boundary data and every stories260K tensor are compared with
the transcription in tests/test_recipes_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from recipe_data import differences, info_of, requires_stories, stories_weights
from recipe_refs import REFERENCES, te_nvfp4_4over6

from driftcli.casts import fouroversix
from driftcli.errors import CastSpecError
from driftcli.kernels import jit
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS
from driftcli.records.modes import Granularity
from driftcli.verify import Plan
from driftcli.verify.compare import to_float
from driftcli.verify.recipes import check_recipe, four_over_six_tile_case, oracle_recipe

FOUR_OVER_SIX = ["te/nvfp4_4over6", "te/nvfp4_4over6_mse", "te/nvfp4_4over6_fast",
                 "te/nvfp4_4over6_mse_fast"]
FP4 = FORMATS["float4_e2m1fn"]


def _block(*head: float) -> torch.Tensor:
    x = torch.zeros(1, 16)
    x[0, : len(head)] = torch.tensor(head)
    return x


TIE = _block(1536.0, 768.0)
"""amax 1536 makes S_enc = 1536 / 1536 = 1: map-to-6 has sb = 256 (1536 -> 6, 768 -> 3), map-to-4
sb = 384 (1536 -> 4, 768 -> 2); both errors are exactly 0, a tie."""
MAP4 = _block(1536.0, 1280.0)
"""1280 = 5 · 256 is an E2M1 tie under map-to-6 (to 4: error 256); under map-to-4 it is 3.33 ->
3, 1152 (error 128): map-to-4 wins."""


def _both_backends(x: torch.Tensor, name: str) -> tuple[object, object]:
    fast = info_of(x, name)
    jit.set_jit("never")
    try:
        slow = info_of(x, name)
    finally:
        jit.set_jit("auto")
    return fast, slow


@pytest.mark.parametrize("name", FOUR_OVER_SIX)
def test_a_tie_between_the_two_errors_keeps_map_to_6(name: str) -> None:
    for got in _both_backends(TIE, name):
        assert got.codes[0, :2].tolist() == [6.0, 3.0]  # map-to-4 would give 4, 2
        assert float(got.scales[0]) == 256.0
        assert got.values[0, :2].tolist() == [1536.0, 768.0]
    values, codes = REFERENCES[name](TIE.numpy())
    assert codes[0, :2].tolist() == [6.0, 3.0] and values[0, 1] == 768.0


@pytest.mark.parametrize("name", FOUR_OVER_SIX)
def test_map_to_4_is_kept_where_its_error_is_smaller(name: str) -> None:
    for got in _both_backends(MAP4, name):
        assert got.codes[0, :2].tolist() == [4.0, 3.0]
        assert float(got.scales[0]) == 384.0
        assert got.values[0, :2].tolist() == [1536.0, 1152.0]
    # te/nvfp4 (one candidate, the 448 bound) rounds 1280 to 1024: 4/6 halves the error
    assert info_of(MAP4, "te/nvfp4").values[0, 1].item() == 1024.0
    values, _ = REFERENCES[name](MAP4.numpy())
    assert values[0, 1] == 1152.0


def test_the_tensor_scale_maps_amax_to_1536_not_2688() -> None:
    """The 256 bound: a lone amax of 1 gives S_enc = 1536 and S_dec = fl(1 / 1536), against
    te/nvfp4's fl(1 / 2688)."""
    x = _block(1.0, 0.5)
    assert info_of(x, "te/nvfp4_4over6").tensor_scale == float(np.float32(1) / np.float32(1536))
    assert info_of(x, "te/nvfp4").tensor_scale == float(np.float32(1) / np.float32(2688))


def _spec(group: str, order: str = "te-4over6-mae") -> str:
    return f"float4_e2m1fn:{group}:float8_e4m3fn:two-level:rne:saturate:amax=fmax,two={order}"


ORDERS = [("te-4over6-mae", False, False), ("te-4over6-mse", True, False),
          ("te-4over6-mae-fp16", False, True), ("te-4over6-mse-fp16", True, True)]


def test_four_over_six_takes_blocks_and_tiles_of_16_only() -> None:
    assert parse_cast(_spec("tile16")) == parse_cast("te/nvfp4_2d_4over6")
    for group in ("tile32", "block32"):
        with pytest.raises(CastSpecError, match=r"1 x 16 blocks \(block16\) or 16 x 16 tiles"):
            parse_cast(_spec(group))


def _tile_data() -> torch.Tensor:
    """The tiles whose choice the order of the sum decides, every drawn one of them, and
    random tiles of spread magnitudes (S_enc != 1), partial tiles at the edges."""
    gen = torch.Generator().manual_seed(5)
    spread = torch.randn(40, 56, generator=gen) * torch.exp2(
        torch.randint(-8, 8, (40, 1), generator=gen).float())
    return [four_over_six_tile_case(keep=None), spread]


@pytest.mark.parametrize(("order", "squared", "fp16"), ORDERS)
def test_tiles_equal_the_transcription_on_both_back_ends(order: str, squared: bool,
                                                         fp16: bool) -> None:
    """reference_nvfp4.py's 2-D 4/6 (tests/recipe_refs.py ``te_nvfp4_4over6`` on tiles), bit
    for bit, zero padded to whole tiles as the reference needs them; the choice is the tile's,
    so it parts from the 1 x 16 cast."""
    spec = _spec("tile16", order)
    for x in _tile_data():
        padded = torch.nn.functional.pad(x, (0, -x.shape[1] % 16, 0, -x.shape[0] % 16))
        values, codes = te_nvfp4_4over6(padded.numpy(), squared, fp16, Granularity.TILE)
        for mode in ("auto", "never"):
            jit.set_jit(mode)
            try:
                got = info_of(padded, spec)
            finally:
                jit.set_jit("auto")
            assert not (differences(got.values, torch.from_numpy(values))
                        | differences(got.codes, torch.from_numpy(codes))).any(), (order, mode)
        assert differences(info_of(padded, spec).values,
                           info_of(padded, _spec("block16", order)).values).any()


def _sequential(rows: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(rows.shape[0], dtype=rows.dtype)
    for r in range(rows.shape[1]):
        acc = acc + rows[:, r]
    return acc


@pytest.mark.parametrize(("order", "squared", "fp16"), [ORDERS[0], ORDERS[1]])
def test_a_planted_sequential_tile_sum_is_caught(order: str, squared: bool, fp16: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The 16 row errors of a tile added in row order instead of by halves: the transcription
    and the exact twin (verify-formats' recipes suite, on its order-parting tiles) both see
    it; honest, both agree bit for bit."""
    c = parse_cast(_spec("tile16", order))
    x = four_over_six_tile_case()

    def apart() -> tuple[int, int]:
        got = info_of(x, c).values.flatten()
        exact, _ = oracle_recipe(x, c)
        want = torch.tensor([to_float(v) for v in exact], dtype=torch.float64)
        values, _ = te_nvfp4_4over6(x.numpy(), squared, fp16, Granularity.TILE)
        return (int(differences(got.reshape(x.shape), torch.from_numpy(values)).sum()),
                int((got.double() != want).sum()))

    assert apart() == (0, 0)
    monkeypatch.setattr(fouroversix, "tile_sum", _sequential)
    to_transcription, to_oracle = apart()
    assert to_transcription > 0 and to_oracle == to_transcription


def _recipe_failures(name: str) -> int:
    return sum(out.n_failed for out in check_recipe(FP4, name, Plan(quick=True)))


def _transcription_failures(name: str, x: torch.Tensor) -> int:
    values, codes = REFERENCES[name](x.numpy())
    got = info_of(x, name)
    return int((differences(got.values, torch.from_numpy(values))
                | differences(got.codes, torch.from_numpy(codes))).sum())


def test_every_four_over_six_preset_passes_the_oracle_and_its_transcription() -> None:
    for name in FOUR_OVER_SIX:
        assert _recipe_failures(name) == 0, name
        for x in (TIE, MAP4):
            assert _transcription_failures(name, x) == 0, name


def test_a_planted_tie_to_map_to_4_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fouroversix, "PREFER_MAP4", torch.le)
    assert _transcription_failures("te/nvfp4_4over6", TIE) == 2  # the two nonzero codes
    # verify-formats' recipes suite holds the ties too (verify.recipes.FOUR_OVER_SIX_BLOCKS)
    assert _recipe_failures("te/nvfp4_4over6") > 0


def test_a_planted_448_bound_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fouroversix, "GLOBAL_MAX", 2688.0)
    assert _transcription_failures("te/nvfp4_4over6", MAP4) > 0
    assert _recipe_failures("te/nvfp4_4over6") > 0


@pytest.mark.parametrize("path", ["numba", "torch"])
def test_a_planted_reversed_error_sum_is_caught(path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The errors summed from the last element, on either back-end: float32 addition is not
    associative, and verify-formats' 4/6 blocks include one, per error path, whose choice the
    order decides."""
    if path == "numba":
        honest_kernel = jit.four_over_six_errors

        def reversed_kernel(blocks: torch.Tensor, *rest: object) -> object:
            return honest_kernel(blocks.flip(1).contiguous(), *rest)  # type: ignore[arg-type]

        monkeypatch.setattr(jit, "four_over_six_errors", reversed_kernel)
    else:
        honest = fouroversix.block_errors

        def reversed_sum(blocks: torch.Tensor, q: torch.Tensor, *rest: object) -> torch.Tensor:
            return honest(blocks.flip(1), q.flip(1), *rest)  # type: ignore[arg-type]

        monkeypatch.setattr(fouroversix, "block_errors", reversed_sum)
        jit.set_jit("never")
    try:
        assert _recipe_failures("te/nvfp4_4over6") > 0
        assert _recipe_failures("te/nvfp4_4over6_fast") > 0
    finally:
        jit.set_jit("auto")


@requires_stories
def test_four_over_six_lowers_the_error_on_stories260k() -> None:
    """Every stories260K weight cast by te/nvfp4 and te/nvfp4_4over6 (MAE, MSE): the squared
    error summed over all 260,032 elements, and the share of blocks that keep map-to-4
    (docs/recipes.md shows these numbers)."""
    sse = dict.fromkeys(["te/nvfp4", *FOUR_OVER_SIX[:2]], 0.0)
    blocks = map4 = 0
    for _, w in stories_weights():
        x = w.float().reshape(-1)
        x = torch.nn.functional.pad(x, (0, -x.numel() % 16)).reshape(-1, 16)
        for name in sse:
            got = info_of(x, name)
            sse[name] += float(((got.values.double() - x.double()) ** 2).sum())
        t = x.abs().max()
        enc, dec = fouroversix.tensor_scales(t)
        sb4, sb6, *_ = fouroversix.candidate_scales(x.abs().amax(dim=1), enc, dec)
        undo4 = (sb4 * t) * (1 / torch.tensor(1536.0))
        chosen = info_of(x, "te/nvfp4_4over6").scales.float()
        blocks += x.shape[0]
        map4 += int(((chosen == undo4) & (sb4 != sb6)).sum())
    ratio_mae = sse["te/nvfp4_4over6"] / sse["te/nvfp4"]
    ratio_mse = sse["te/nvfp4_4over6_mse"] / sse["te/nvfp4"]
    print(f"\nstories260K squared error: te/nvfp4 {sse['te/nvfp4']:.4e}, 4over6 MAE "
          f"{ratio_mae:.3f}x, MSE {ratio_mse:.3f}x; blocks kept at map-to-4 (MAE) "
          f"{map4:,} of {blocks:,}")
    assert 0.5 < ratio_mse < ratio_mae < 1.0
    assert 0 < map4 < blocks


def test_what_drift_makes_of_4over6_with_rht_or_sr() -> None:
    """Transformer Engine refuses 4/6 with RHT or SR (pytorch/quantization.py lines 1712-1719);
    drift's definition (docs/recipes.md): with ``rht=`` the transform, then 4/6 on its output;
    with ``sr`` the choice made from the round-to-nearest candidates, the chosen scales kept,
    only the elements' rounding stochastic (each code one of the two grid neighbours of the
    nearest cast's quotient)."""
    from driftcli.casts.hadamard import transform
    from driftcli.casts.quantization import quantize

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=gen) * torch.exp2(torch.randint(-6, 6, (8, 1),
                                                                    generator=gen).float())
    for name in ("te/nvfp4_4over6", "te/nvfp4_row_4over6"):
        c = parse_cast(f"{name}:rht=te")
        assert c.rht is not None
        assert torch.equal(quantize(x, c), quantize(transform(x, c.rht, -1), name))
        near = info_of(x, name)
        sr = quantize(x, f"{name}:sr", seed=5, return_info=True)
        assert torch.equal(sr.scales, near.scales)
        assert differences(sr.values, near.values).any()  # the draws moved some elements
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        step = {float(v): (float(grid[max(i - 1, 0)]), float(grid[min(i + 1, 7)]))
                for i, v in enumerate(grid)}
        for a, b in zip(near.codes.abs().flatten().tolist(), sr.codes.abs().flatten().tolist(),
                        strict=True):
            assert step[a][0] <= b <= step[a][1]
