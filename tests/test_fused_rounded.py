"""The fused pass with the rounding (:func:`driftcli.measures.stats.fused_stats` with
``rounded=True``: one read of a slice for every cast of underflow-rate and error-bias) against
the torch back-end's :func:`~driftcli.measures.stats.cast_stats` and against exact sums.

Counts are compared exactly. The float64 sums Σx², Σe², Σe·x, Σe are made per piece of 4,096
elements in the vector lanes the pass's machine code holds, and the pieces' partials (and a
scan's slices') added exactly, rounded once: the same bits for any thread count and any slicing
on pieces, compared with ``==``; torch adds them pairwise. Each term is one or two float64
roundings of an exact value (relative 2^-52 at most), and n additions in any order move a sum
by at most n·2^-53 of the sum of its terms' magnitudes: with n ≤ 8,192 here that is under 1e-12
of Σ|term|, the bound :func:`_near` holds the sums to (against each other and against the
exact ``Fraction`` sums).
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from test_fused_clips import _specs
from test_kernels import _tensor

from driftcli import kernels
from driftcli.io.readers.memory import Held
from driftcli.measures import stats
from driftcli.measures.scan import ScanOptions, piece_alignment, scan
from driftcli.measures.stats import EXACT_SUMS, SUM_PIECE, CastStats, cast_stats, fused_stats
from driftcli.records.modes import Rounding

SUMS = ("xx", "ee", "ex", "e_sum")
THREE = ["fp8_e4m3", "mxfp8_e4m3", "nvfp4"]


def _torch(x: torch.Tensor, spec: str, seed: int | None, tensor_amax: float | None = None
           ) -> tuple[CastStats, torch.Tensor]:
    kernels.set_jit("never")
    try:
        st, q = cast_stats(x, spec, seed=seed, tensor_amax=tensor_amax)
    finally:
        kernels.set_jit("auto")
    assert q is not None
    return st, q


def _exact(x: torch.Tensor, q: torch.Tensor) -> dict[str, tuple[Fraction, Fraction]]:
    """Each sum of :data:`SUMS`, exactly, and the sum of its terms' magnitudes, over the
    elements where ``x`` and its cast ``q`` are finite."""
    out = {f: (Fraction(0), Fraction(0)) for f in SUMS}
    for v, w in zip(x.reshape(-1).tolist(), q.reshape(-1).double().tolist(), strict=True):
        if not (math.isfinite(v) and math.isfinite(w)):
            continue
        xv, e = Fraction(v), Fraction(w) - Fraction(v)
        for f, t in zip(SUMS, (xv * xv, e * e, e * xv, e), strict=True):
            s, m = out[f]
            out[f] = (s + t, m + abs(t))
    return out


def _near(got: float, want: float, magnitude: float, what: str) -> None:
    assert abs(got - want) <= 1e-12 * magnitude + 1e-300, f"{what}: {got} != {want}"


def _counts_and_sums(spec: str, want: CastStats, got: CastStats) -> None:
    """Every count the same; the sums to 1e-12 of their terms' magnitudes (Σx² bounds Σe·x
    and Σe² for a cast that keeps the values' size; |Σe| by the others: see the module)."""
    for f in want.__dataclass_fields__:
        u, v = getattr(want, f), getattr(got, f)
        if f in SUMS:
            scale = max(abs(u), want.xx or 0.0, math.sqrt((want.ee or 0.0) * got.numel))
            _near(v, u, scale, f"{spec}: {f}")
        elif isinstance(u, float):
            assert v == pytest.approx(u, rel=1e-12, abs=1e-300), f"{spec}: {f} {u} != {v}"
        else:
            assert u == v, f"{spec}: {f} {u} != {v}"


@pytest.mark.parametrize("rounding", [pytest.param(r, marks=() if r in (Rounding.RNE, Rounding.SR)
                                                   else pytest.mark.slow) for r in Rounding],
                         ids=lambda r: r.value)
def test_every_cast_the_pass_takes_rounds_and_counts_as_the_torch_back_end(
        rounding: Rounding) -> None:
    """Every element format x scale rule x granularity x overflow policy the pass takes, under
    one rounding (stochastic draws seeded as cast_stats seeds them), with NaN and inf planted
    in one of two tensors: the torch back-end's counts, bit for bit."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    specs = [s.replace(":rne:", f":{rounding.value}:") for s in _specs()]
    seeds = [100 + i for i in range(len(specs))]
    taken = 0
    for specials in (False, True):
        x = _tensor(seed=7, specials=specials)  # 64 x 128
        got = fused_stats(x, specs, rounded=True, seeds=seeds)
        taken += len(got)
        for i, st in got.items():
            _counts_and_sums(specs[i], _torch(x, specs[i], seeds[i])[0], st)
        assert any(st.underflowed for st in got.values())
        # lost: an overflow under ieee (none toward zero), or a NaN block
        assert any(st.lost for st in got.values()) != (rounding is Rounding.RTZ and not specials)
        assert any(st.nonfinite_groups for st in got.values()) == specials
    assert taken > len(specs)  # more than half of them, in each tensor


def test_the_sums_are_the_exact_sums_within_their_bound() -> None:
    """The three casts' Σx², Σe², Σe·x and Σe against the exact sums (``Fraction``) of the
    torch back-end's values over two pieces and a short third one."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 1024, generator=gen) * torch.exp(2 * torch.randn(9, 1024, generator=gen))
    x[4, :32] = 1e-30  # a block that underflows whole
    got = fused_stats(x, THREE, rounded=True)
    assert sorted(got) == [0, 1, 2]
    for i, spec in enumerate(THREE):
        want, q = _torch(x, spec, None)
        assert got[i].underflowed == want.underflowed and (want.underflowed or 0) > 0
        for f, (exact, magnitude) in _exact(x, q).items():
            _near(getattr(got[i], f), float(exact), float(magnitude), f"{spec}: {f}")


def _heavy(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, cols,
                                                                          generator=gen))


def _sliced(x: torch.Tensor, step: int) -> dict[int, CastStats]:
    """The three casts of ``x`` (rows of 4,096 elements: every row starts a piece) in slices
    of ``step`` rows, merged as the scan merges them."""
    amax = float(x.abs().max())
    parts = [fused_stats(x[a:a + step], THREE, rounded=True, tensor_amax=amax)
             for a in range(0, x.shape[0], step)]
    return {i: CastStats.merge([p[i] for p in parts], per_tensor=i == 0) for i in range(3)}


def _differing(runs: list[dict[int, CastStats]]) -> list[str]:
    """The sums (and counts) of ``runs`` that are not the same bits as the first run's."""
    return [f"{THREE[i]}: {f} {getattr(runs[0][i], f)!r} != {getattr(r[i], f)!r}"
            for r in runs[1:] for i in range(3) for f in runs[0][i].__dataclass_fields__
            if getattr(r[i], f) != getattr(runs[0][i], f)]


def _threads_and_slicings(x: torch.Tensor) -> list[dict[int, CastStats]]:
    """The whole pass and slicings of 37, 8 and 3 rows, each on one, two and three threads."""
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(fused_stats(x, THREE, rounded=True))
            runs.extend(_sliced(x, step) for step in (37, 8, 3))
    finally:
        torch.set_num_threads(threads)
    return runs


def test_the_sums_are_the_same_bits_for_any_thread_count_and_slicing() -> None:
    """Each piece's partials depend only on its elements and the pieces (and slices) add
    exactly: one, two or three threads, the whole tensor or slices starting on pieces of 37, 8
    or 3 rows, every count and sum the same bits."""
    runs = _threads_and_slicings(_heavy(96, 4096, 5))
    assert len(runs) == 12 and _differing(runs) == []


def test_the_checker_catches_slices_added_in_float(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted fault: slices' sums added by plain float addition (as before), not
    exactly; some slicing then differs in its last bits."""
    def plain(parts: list[CastStats], name: str) -> tuple[float, ...] | None:
        values = [getattr(p, name) for p in parts]
        return None if None in values else (sum(values),)

    monkeypatch.setattr(stats, "exact_sum", plain)
    assert _differing(_threads_and_slicings(_heavy(96, 4096, 5)))


def test_the_sums_are_the_correctly_rounded_sums_of_the_pieces_partials() -> None:
    """Each sum is the exact (``Fraction``) sum of the per-piece partials, rounded once: a
    piece's partials are the pass over that piece alone (one row of 4,096 elements)."""
    x = _heavy(24, 4096, 8)
    amax = float(x.abs().max())
    whole = fused_stats(x, THREE, rounded=True)
    pieces = [fused_stats(x[k:k + 1], THREE, rounded=True, tensor_amax=amax) for k in range(24)]
    for i, spec in enumerate(THREE):
        for f in EXACT_SUMS:
            exact = sum((Fraction(getattr(p[i], f)) for p in pieces), Fraction(0))
            assert getattr(whole[i], f) == float(exact), f"{spec}: {f}"


def test_slices_past_float64s_range_add_as_plain_addition() -> None:
    """An inf in a slice's sum (a float64 tensor's square past the range, the torch back-end's),
    or slices whose exact sum rounds past it, merge to inf as plain addition does, not NaN; a
    finite one keeps its exact sum (1 + 2^-60 - 1 is 2^-60, where plain addition gives 0)."""
    one = replace(fused_stats(torch.ones(64), ["mxfp8_e4m3"], rounded=True)[0], xx=1.0)

    def xx(*values: float) -> float | None:
        return CastStats.merge([replace(one, xx=v) for v in values], False).xx

    assert xx(1.0, math.inf, -3.0) == math.inf
    assert xx(1.7e308, 1.7e308) == math.inf
    assert math.isnan(xx(math.inf, -math.inf) or 0.0)
    assert xx(1.0, 2.0**-60, -1.0) == 2.0**-60


def test_a_pieces_sums_do_not_depend_on_the_buffers_address() -> None:
    """The vector lanes' order is the machine code's, fixed by a piece's length, not by where
    it lies: the tensor read from a buffer 4 and 12 bytes off its alignment, the same bits."""
    x = _heavy(8, 4096, 9)
    want = fused_stats(x, THREE, rounded=True)
    for off in (1, 3):
        big = torch.empty(x.numel() + off)
        big[off:] = x.reshape(-1)
        moved = big[off:].view(x.shape)
        assert moved.data_ptr() % 16 != x.data_ptr() % 16
        assert _differing([want, fused_stats(moved, THREE, rounded=True)]) == []


def test_the_scans_slices_start_on_pieces_where_the_width_allows() -> None:
    """A scan cuts rows so that slices start on the pass's pieces: its sums are then the
    same bits for any slice size. A width whose smallest such slicing exceeds the slice size
    (4,128 = 32 x 129: 128 rows) is cut at rows as before, its sums within their bound."""
    assert piece_alignment(4096, 1 << 15, 1) == 1
    assert piece_alignment(4128, 1 << 20, 1) == 128 and 128 * 4128 % SUM_PIECE == 0
    assert piece_alignment(4128, 1 << 15, 1) == 1  # 528,384 elements: too many for a slice
    assert piece_alignment(768, 1 << 15, 4) == 16
    x = _heavy(96, 4096, 5)
    runs = [{i: r.draws[0] for i, r in enumerate(scan(
        [Held("t", {"w": x})], THREE, options=ScanOptions(chunk_elements=chunk)).results)}
        for chunk in (None, 8 * 4096, 37 * 4096 + 5)]
    assert _differing(runs) == []
    y = _heavy(64, 4128, 6)
    whole, cut = ({i: r.draws[0] for i, r in enumerate(scan(
        [Held("t", {"w": y})], THREE, options=ScanOptions(chunk_elements=chunk)).results)}
        for chunk in (None, 1 << 15))
    for i, spec in enumerate(THREE):
        _counts_and_sums(spec, whole[i], cut[i])


def test_planted_underflows_and_losses_are_counted() -> None:
    """The checker's planted faults: one element far below its block's grid is the one
    underflow; a NaN makes its block of 32 lost (31 finite elements) under MXFP8, and only
    itself non-finite under a tensor scale."""
    x = torch.ones(4, 64)
    x[1, 3] = 2.0**-40
    got = fused_stats(x, ["mxfp8_e4m3", "fp8_e4m3"], rounded=True)
    assert got[0].underflowed == got[1].underflowed == 1
    assert got[0].lost == got[1].lost == 0 and got[0].ee == got[1].ee == 2.0**-80
    x[2, 40] = math.nan
    got = fused_stats(x, ["mxfp8_e4m3", "fp8_e4m3"], rounded=True)
    assert (got[0].lost, got[0].nonfinite_groups, got[1].lost) == (31, 1, 0)


def test_a_grid_out_of_float32s_range_is_left_to_cast_stats() -> None:
    """Float32 subnormals under E5M2 with float32 power-of-two scales (per block, per tensor)
    scale below float32's grid (rounded in float64 on the other paths): the rounded pass
    leaves the casts out, the clip pass still takes them, and larger values are taken."""
    specs = ["float8_e5m2:block32:float32:floor", "float8_e5m2:tensor:float32:floor"]
    x = torch.full((2, 64), 1e-39)
    assert fused_stats(x, specs, rounded=True) == {}
    assert sorted(fused_stats(x, specs)) == [0, 1]
    assert sorted(fused_stats(x * 2.0**100, specs, rounded=True)) == [0, 1]


def test_a_stochastic_cast_without_a_seed_is_left_out() -> None:
    """Its draws are made from its seed: without one, cast_stats counts it (and asks)."""
    x = _tensor(seed=2, specials=False)
    assert sorted(fused_stats(x, ["mxfp8_e4m3:sr", "mxfp8_e4m3"], rounded=True)) == [1]


@pytest.mark.parametrize("axis", [0, -2])
def test_blocks_along_another_axis_count_as_the_torch_back_end(axis: int) -> None:
    """Blocks down the columns (the monitor's operands in their weight-gradient direction):
    the pass reads a copy with that axis last, a stochastic cast's draws moved with it."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(32, 64, 96, generator=gen) * torch.exp(2 * torch.randn(32, 64, 96,
                                                                          generator=gen))
    x[1, 5, 7] = math.nan
    specs = [*THREE, "mxfp8_e4m3:sr", "nvfp4:sr"]
    seeds = [None, None, None, 11, 12]
    got = fused_stats(x, specs, axis=axis, rounded=True, seeds=seeds)
    assert sorted(got) == [0, 1, 2, 3, 4]
    for i, spec in enumerate(specs):
        kernels.set_jit("never")
        try:
            want, _ = cast_stats(x, spec, axis=axis, seed=seeds[i], want_values=False)
        finally:
            kernels.set_jit("auto")
        _counts_and_sums(spec, want, got[i])
    assert got[1].nonfinite_groups == 1 and got[1].lost == 31


def test_a_column_holding_an_inf_adds_plainly() -> None:
    """The pieces' exact addition keeps an infinite sum infinite (two infinities of one sign
    would make NaN of the error-free steps: a scale made infinite by a tensor amax of inf gives
    every clip an excess of -inf), NaN where infinities of both signs meet, and finite columns
    exact."""
    import numpy as np

    from driftcli.kernels import statcode

    terms = np.array([[-math.inf, math.inf, 1e16, math.nan],
                      [-math.inf, -math.inf, 1.0, 2.0],
                      [3.0, 1.0, -1e16, 1.0],
                      [-3.0, 0.0, 0.0, 0.0]])
    parts, lens = statcode.expansions(terms)
    assert [lens[0], lens[1], lens[3]] == [1, 1, 1]
    assert parts[0, 0] == -math.inf
    assert math.isnan(parts[1, 0]) and math.isnan(parts[3, 0])
    assert math.fsum(parts[2, :lens[2]]) == 1.0  # 1e16 + 1 - 1e16: 1, exactly
