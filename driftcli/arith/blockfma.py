"""Block-FMA accumulation: the dot product of a tensor core, as the published models describe it.

A tensor core does not add products one at a time. It takes a group of ``size`` products
(exact) together with the running sum ``c``, finds the largest exponent among them, keeps
each term only to ``kept_bits`` bits below that exponent (the rest is cut off, toward zero,
with no sticky bit), adds the cut terms exactly and rounds the total once into its
accumulator format. A longer dot product chains groups in index order, each group's rounded
result the next one's ``c``; with promotion, every ``promote`` products the chain's value is
added into a float32 master sum (rounded to nearest) and the chain starts again from zero, as
DeepSeek-V3's FP8 GEMMs and CUTLASS's two-accumulator mode do. Fasi, Higham, Mikaitis and
Pranesh measured the unit on NVIDIA's tensor cores ("Numerical behavior of NVIDIA tensor
cores", PeerJ CS 2021); Khattak and Mikaitis parametrised it per GPU (IEEE HPEC 2025;
north-numerical-computing/MATLAB-tensor-core). The GPU presets and their sources are in
:mod:`driftcli.arith.tensorcores` and ``docs/tensor-cores.md``.

Every step is exact in float64: products of two float32 values, terms that are integers below
``2**(kept_bits + 2)`` once scaled by the cut, and one rounding by drift's exact kernel per
group. Two implementations give the same bits: a numba kernel (the default on the CPU) and
torch ops (CUDA tensors, ``DRIFT_JIT=never``); :mod:`driftcli.oracle.blockfma` is the exact
reference that ``drift verify-formats`` checks both against.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import cast

import numpy as np
import torch
from torch import Tensor

from driftcli import kernels
from driftcli.casts.rounding import add, jit_params, round_to_format, source_of, target_of
from driftcli.errors import DriftError
from driftcli.kernels import jit
from driftcli.records.formats import FORMATS, Format
from driftcli.records.modes import Overflow, Rounding

NO_FLOOR = -1024
"""``min_exp`` of a unit with no floor under its reference exponent."""
NONE_EXP = -(1 << 20)
"""The exponent of a term that is not there (a zero product, a zero ``c``): below any other."""
C_EMIN = -126
"""The running sum's exponent is read as a float32's, at least -126, whatever its format (the
published models' rule)."""
TOP_FLOOR = -400
"""A floor under a group's reference exponent below which no term lies (products of float32
values reach 2**-298): it keeps ``2**(kept - E)``, ``2**(E - kept)`` and an operand times
either finite and normal in float64 for an all-zero group, whatever ``min_exp`` says."""
TOP_CEIL = 300
"""The highest ``min_exp`` a unit may have, and the ceiling the numba kernel puts on a running
sum's exponent (``kernels.fmacode.TOP_CEIL``): above every finite term's exponent (products of
float32 values stay below 2**256), so that ``2**(kept - E)`` stays normal in float64."""
SPECIALISE_WORK = 1 << 24
"""Products in one call from which the numba kernel is compiled for the unit's own group size
and interleave (about three times faster per product than the generic kernel)."""
TILE_BYTES = 1 << 18
"""Bytes of ``b``'s rows the numba kernel keeps in cache at once."""
DOUBLE_BITS = 53
MASTER = FORMATS["float32"]
"""The format of the master sum that promotion adds into, rounded to nearest even."""


class FMAUnitError(DriftError, ValueError):
    """A block-FMA unit that cannot be built as asked."""


@dataclass(frozen=True)
class FMAUnit:
    """The alignment parameters of a block-FMA unit (the published models' ``fma``, ``neab``,
    ``min_exp_limit`` and interleaving); its accumulator format and rounding are the matmul's.

    With ``interleave`` = k > 0 a group is dealt into two halves by position, k products at a
    time (positions i with (i // k) even first): each half is summed and rounded on its own,
    the first from zero, the second onto the first, and ``c`` is added last with one correctly
    rounded addition (Hopper's FP8 ``mma.sync`` with an fp16 result).
    """

    size: int
    """Products per group (the FMA size)."""
    kept_bits: int
    """Bits every term keeps below the group's reference exponent E (the largest term
    exponent, ``c``'s included): each term is cut toward zero to a multiple of
    ``2**(E - kept_bits)``. The published models' 23 + ``neab``."""
    min_exp: int = NO_FLOOR
    """A floor under E (the models' ``min_exp_limit``)."""
    interleave: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or self.kept_bits < 1:
            raise FMAUnitError(f"block FMA: the group size ({self.size}) and kept bits "
                               f"({self.kept_bits}) must be at least 1")
        if self.kept_bits + 3 + (self.size + 1).bit_length() > DOUBLE_BITS:
            # a cut term is below 2**(kept + 2) in units of the cut; size + 1 of them are summed
            raise FMAUnitError(f"block FMA: {self.kept_bits} kept bits in groups of {self.size} "
                               f"do not fit float64's {DOUBLE_BITS} bits; keep fewer")
        if self.interleave < 0 or (self.interleave and self.size % (2 * self.interleave)):
            raise FMAUnitError(f"block FMA: an interleave of {self.interleave} needs a group of "
                               f"a multiple of {2 * self.interleave} products, not {self.size}")
        if self.min_exp < NO_FLOOR:
            raise FMAUnitError(f"block FMA: min_exp {self.min_exp} is below {NO_FLOOR} "
                               "(no floor); omit it for none")
        if self.min_exp > TOP_CEIL:
            raise FMAUnitError(f"block FMA: min_exp {self.min_exp} is above {TOP_CEIL}, above "
                               "every term's exponent (products of float32 values stay below "
                               "2**256)")

    def __str__(self) -> str:
        text = f"{self.size}:{self.kept_bits}"
        if self.interleave:
            text += f":i{self.interleave}"
        if self.min_exp != NO_FLOOR:
            text += f":e{self.min_exp}"
        return text


_UNIT = re.compile(r"^(\d+):(\d+)((?::i\d+)|(?::e-?\d+))*$")


def parse_unit(text: str | FMAUnit) -> FMAUnit:
    """An :class:`FMAUnit` from ``SIZE:KEPT[:iK][:eMIN]`` (``32:13``, ``32:25:i2``,
    ``16:25:e-133``); units pass through."""
    if isinstance(text, FMAUnit):
        return text
    t = text.strip()
    if not _UNIT.match(t):
        raise FMAUnitError(f"block FMA unit {text!r}: write SIZE:KEPT with optional :iK "
                           "(interleave) and :eMIN (exponent floor), e.g. 32:13 or 16:25:e-133")
    size, kept, *rest = t.split(":")
    options = {part[0]: int(part[1:]) for part in rest}
    if len(options) != len(rest):
        raise FMAUnitError(f"block FMA unit {text!r}: an option is given twice")
    return FMAUnit(int(size), int(kept), options.get("e", NO_FLOOR), options.get("i", 0))


def exponents(x: Tensor, emin: int) -> Tensor:
    """The models' exponent of each value: floor(log2 |x|) read from the bits, at least
    ``emin`` (a subnormal input keeps its format's smallest normal exponent), int32, and
    :data:`NONE_EXP` for 0."""
    e = torch.frexp(x)[1].to(torch.int32) - 1
    return torch.where(x == 0, NONE_EXP, torch.clamp(e, min=emin))


@dataclass(frozen=True)
class Accumulation:
    """Everything about a block-FMA dot product but its operands: the unit, the format every
    group's result is rounded into and how, the operands' exponent floors (their formats'
    smallest normal exponents) and the promotion interval (products; 0: none)."""

    unit: FMAUnit
    acc: Format
    rounding: Rounding
    emin_a: int = C_EMIN
    emin_b: int = C_EMIN
    promote: int = 0

    def __post_init__(self) -> None:
        if self.rounding not in (Rounding.RNE, Rounding.RTZ):
            raise FMAUnitError(f"block FMA: a group's result rounds with rne or rtz, not "
                               f"{self.rounding.value}")
        if self.promote < 0 or self.promote % self.unit.size:
            raise FMAUnitError(f"block FMA: promotion every {self.promote} products is not a "
                               f"whole number of groups of {self.unit.size}")


def fma_dot(a: Tensor, b: Tensor, how: Accumulation, *, c: Tensor | None = None,
            scales: tuple[Tensor, Tensor] | None = None, shape: tuple[int, int, int] | None = None
            ) -> Tensor:
    """Block-FMA dot products, float64, each exact in ``how.acc`` (float32 with promotion).

    ``a`` (rows_a, K) and ``b`` (rows_b, K) hold values exact in float32. Without ``shape``
    row i of ``a`` meets row i of ``b`` (one dot product per row). With ``shape`` = (batch, M,
    N), ``a`` holds batch*M rows and ``b`` batch*N, and the result is every row of a batch's
    ``a`` against every row of its ``b``: (batch*M*N,), row-major (a matmul with ``b``
    transposed). ``c`` (one per result) starts each dot product's chain (default +0).
    ``scales`` = (sa, sb), one factor per row and promotion interval each, multiply every
    promoted partial sum (block scales; they must be powers of two, so the product is exact).

    NaN and infinity follow IEEE arithmetic on the exact products (the models check them
    before any group). An exact zero is +0, as in the published models.
    """
    return prepare(a, b, how.emin_a, how.emin_b, c=c, scales=scales, shape=shape).run(how)


@dataclass(frozen=True)
class Prepared:
    """Operands made ready for :func:`fma_dot` once, to run under many accumulations with the
    same exponent floors (what ``drift calibrate`` does for every candidate model)."""

    a: Tensor
    b: Tensor
    emin: tuple[int, int]
    c: Tensor | None
    scales: tuple[Tensor, Tensor] | None
    shape: tuple[int, int, int]
    paired: bool
    arrays: tuple[np.ndarray, ...] | None
    """The numba kernel's flat arrays; None where the torch implementation runs."""

    def run(self, how: Accumulation) -> Tensor:
        """:func:`fma_dot` of these operands under ``how`` (whose floors must be these)."""
        if (how.emin_a, how.emin_b) != self.emin:
            raise DriftError(f"block FMA: operands prepared for exponent floors {self.emin}, "
                             f"not {(how.emin_a, how.emin_b)}")
        if self.arrays is None:
            return _torch(self.a, self.b, how, self.c, self.scales, self.shape, self.paired)
        return _numba(self, how)


def prepare(a: Tensor, b: Tensor, emin_a: int, emin_b: int, *, c: Tensor | None = None,
            scales: tuple[Tensor, Tensor] | None = None,
            shape: tuple[int, int, int] | None = None) -> Prepared:
    """The operands of :func:`fma_dot`, checked and made ready to run (see there)."""
    a, b = a.double().contiguous(), b.double().contiguous()
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise DriftError(f"block FMA: a and b must be rows x K with one K, not "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    batch, M, N = shape if shape is not None else (a.shape[0], 1, 1)
    if (a.shape[0], b.shape[0]) != (batch * M, batch * N):
        raise DriftError(f"block FMA: {tuple(a.shape)} and {tuple(b.shape)} do not hold "
                         f"{batch} batch(es) of {M} and {N} rows")
    count = batch * M * N
    if c is not None and c.shape != (count,):
        raise DriftError(f"block FMA: c must hold one value per result ({count}), not "
                         f"{tuple(c.shape)}")
    c = None if c is None else c.double().contiguous()
    arrays = None
    if kernels.numba_runs(a, b, c):
        empty = np.empty(0, dtype=np.float64)
        arrays = (a.float().reshape(-1).numpy(), exponents(a, emin_a).reshape(-1).numpy(),
                  b.float().reshape(-1).numpy(), exponents(b, emin_b).reshape(-1).numpy(),
                  (~torch.isfinite(a)).any(dim=1).numpy(), (~torch.isfinite(b)).any(dim=1).numpy(),
                  empty if c is None else c.numpy(),
                  empty if scales is None else scales[0].double().reshape(-1).numpy(),
                  empty if scales is None else scales[1].double().reshape(-1).numpy())
    return Prepared(a, b, (emin_a, emin_b), c, scales, (batch, M, N), shape is None, arrays)


def _groups(k: int, size: int) -> int:
    return max(1, math.ceil(k / size))


# --- the torch implementation ------------------------------------------------------------------

ROWS_AT_ONCE = 1 << 22
"""Products held at once by the torch implementation."""


def _pairs(a: Tensor, b: Tensor, shape: tuple[int, int, int], paired: bool, start: int,
           stop: int) -> tuple[Tensor, Tensor]:
    """The rows of ``a`` and ``b`` that results ``start:stop`` multiply."""
    index = torch.arange(start, stop, device=a.device)
    if paired:
        return index, index
    _, M, N = shape
    batch, rest = index // (M * N), index % (M * N)
    return batch * M + rest // N, batch * N + rest % N


def _torch(a: Tensor, b: Tensor, how: Accumulation, c: Tensor | None,
           scales: tuple[Tensor, Tensor] | None, shape: tuple[int, int, int],
           paired: bool) -> Tensor:
    count = shape[0] * shape[1] * shape[2]
    out = torch.empty(count, dtype=torch.float64, device=a.device)
    ea, eb = exponents(a, how.emin_a), exponents(b, how.emin_b)
    step = max(1, ROWS_AT_ONCE // max(1, a.shape[1]))
    for start in range(0, count, step):
        stop = min(count, start + step)
        ia, ib = _pairs(a, b, shape, paired, start, stop)
        part_c = None if c is None else c[start:stop].double()
        part_s = None if scales is None else (scales[0][ia].double() * scales[1][ib].double())
        out[start:stop] = _torch_rows(a[ia], b[ib], ea[ia], eb[ib], how, part_c, part_s)
    return out


def _torch_rows(a: Tensor, b: Tensor, ea: Tensor, eb: Tensor, how: Accumulation,
                c: Tensor | None, scale: Tensor | None) -> Tensor:
    """:func:`fma_dot` for paired rows, vectorized over them."""
    unit = how.unit
    rows, k = a.shape
    groups = _groups(k, unit.size)
    pad = groups * unit.size - k
    prods = a * b  # exact: two float32 values
    exps = (ea + eb).clamp(min=NONE_EXP)  # a zero operand's NONE stays below every exponent
    if pad:
        prods = torch.nn.functional.pad(prods, (0, pad))
        exps = torch.nn.functional.pad(exps, (0, pad), value=NONE_EXP)
    zero = torch.zeros(rows, dtype=torch.float64, device=a.device)
    c = zero if c is None else c
    special = ~torch.isfinite(prods).all(dim=1) | ~torch.isfinite(c)
    acc = torch.where(special, 0.0, c)
    master = zero
    per = how.promote // unit.size
    if unit.interleave:
        position = torch.arange(unit.size, device=a.device)
        first = (position // unit.interleave) % 2 == 0
        halves = (position[first], position[~first])
    for g in range(groups):
        p = prods[:, g * unit.size:(g + 1) * unit.size].nan_to_num(0.0, 0.0, 0.0)
        e = exps[:, g * unit.size:(g + 1) * unit.size]
        if not unit.interleave:
            acc = _torch_group(p, e, acc, how)
        else:
            part = _torch_group(p[:, halves[0]], e[:, halves[0]], zero, how)
            part = _torch_group(p[:, halves[1]], e[:, halves[1]], part, how)
            acc = add(part, acc, how.acc, rounding=Rounding.RNE, overflow=Overflow.IEEE).double()
        if per and ((g + 1) % per == 0 or g == groups - 1):
            term = acc if scale is None else acc * scale[:, g // per]
            master = add(master, term, MASTER, rounding=Rounding.RNE,
                         overflow=Overflow.IEEE).double()
            acc = zero
    result = master if per else acc
    if special.any():
        # IEEE on the exact terms: NaN from a NaN or opposite infinities, else the infinity
        result = torch.where(special, prods.sum(dim=1) + c, result)
    return result


def _torch_group(prods: Tensor, exps: Tensor, c: Tensor, how: Accumulation) -> Tensor:
    """One group: ``prods`` (rows x n, exact) with their exponents, and ``c`` (rows), summed
    with every term cut toward zero to a multiple of 2**(E - kept_bits), E the largest
    exponent (at least ``min_exp``), then rounded once into ``acc``."""
    c_exp = torch.where(c == 0, NONE_EXP, exponents(c, C_EMIN))
    top = torch.maximum(exps.max(dim=1).values, c_exp)
    top = torch.clamp(top, min=max(how.unit.min_exp, TOP_FLOOR))
    shift = (how.unit.kept_bits - top).to(torch.float64)
    # x * 2**(kept - E) is exact (a power-of-two scaling within float64's range), and its
    # truncation is the cut; the cut terms are integers below 2**(kept + 2), so their sum is
    # exact in any order
    cut = torch.trunc(torch.ldexp(prods, shift[:, None])).sum(dim=1)
    cut = cut + torch.trunc(torch.ldexp(c, shift))
    exact = torch.ldexp(torch.where(cut == 0, 0.0, cut), -shift)  # an exact zero is +0
    return round_to_format(exact, how.acc, rounding=how.rounding, overflow=Overflow.IEEE)


# --- the numba implementation ------------------------------------------------------------------

@cache
def _params(fmt: Format, rounding: Rounding) -> np.ndarray:
    """The rounding kernel's parameter vector for float64 values onto ``fmt``."""
    return np.array(jit_params(src=source_of(torch.float64), tgt=target_of(fmt),
                               rounding=rounding, overflow=Overflow.IEEE, sr_bits=1),
                    dtype=np.int64)


def _numba(prep: Prepared, how: Accumulation) -> Tensor:
    from driftcli.kernels import fmacode as fmakernels  # numba, on first use only

    unit = how.unit
    batch, M, N = prep.shape
    count = batch * M * N
    out = np.empty(count, dtype=np.float64)
    if count == 0:
        return torch.from_numpy(out)
    k = prep.a.shape[1]
    # a kernel of its own for each unit pays for its compile (seconds, once per machine) on
    # large matmuls only; smaller work runs the generic one
    size = unit.size if count * k >= SPECIALISE_WORK else 0
    kernel = fmakernels.fma_kernel(size, unit.interleave if size else 0, prep.c is not None,
                                   prep.scales is not None, prep.paired)
    rows, per_row = (count, k) if prep.paired else (batch * M, N * k)
    # rows of b that stay in cache (float32 values and int32 exponents) while a's rows pass
    tile = max(1, TILE_BYTES // (8 * max(k, 1)))
    jit.spread(kernel, rows, max(per_row, 1), *cast(tuple[np.ndarray, ...], prep.arrays), k, M,
               N, unit.size, unit.interleave, unit.kept_bits, max(unit.min_exp, TOP_FLOOR),
               how.promote // unit.size, tile, _params(how.acc, how.rounding),
               _params(how.acc, Rounding.RNE), _params(MASTER, Rounding.RNE), out)
    return torch.from_numpy(out)


def survivors(prep: Prepared, size: int, interleave: int,
              candidates: Sequence[tuple[int, Format, Rounding, int]], want: Tensor,
              output: Format | None = None, min_exp: int = NO_FLOOR) -> list[bool]:
    """Which of ``candidates`` (kept bits, accumulator, its rounding, promotion interval), each
    a unit of ``size`` and ``interleave``, give every result of ``want`` bit for bit on the
    prepared operands (results rounded to ``output`` to nearest, overflowing as IEEE, when
    given). What ``drift calibrate`` searches with: in numba, a candidate stops at its first
    miss."""
    want = want.double().reshape(-1).contiguous()
    if prep.arrays is None:  # no numba: every candidate in full
        out: list[bool] = []
        for kept, acc, rounding, promote in candidates:
            how = Accumulation(FMAUnit(size, kept, min_exp, interleave), acc, rounding,
                               prep.emin[0], prep.emin[1], promote)
            got = prep.run(how)
            if output is not None:
                got = round_to_format(got, output, rounding=Rounding.RNE,
                                      overflow=Overflow.IEEE).double()
            same = (got.float().view(torch.int32) == want.float().view(torch.int32)) | (
                got.isnan() & want.isnan())
            out.append(bool(same.all()))
        return out
    from driftcli.kernels import fmacode as fmakernels  # numba, on first use only

    for kept, _, _, promote in candidates:
        FMAUnit(size, kept, min_exp, interleave)  # each checked as a unit
        if promote % size:
            raise FMAUnitError(f"block FMA: promotion every {promote} products is not a whole "
                               f"number of groups of {size}")
    _, M, N = prep.shape
    a, ea, b, eb, bad_a, bad_b, c = prep.arrays[:7]
    kernel = fmakernels.search_kernel(prep.c is not None, prep.paired, output is not None)
    n = len(candidates)
    kept_all = np.array([cand[0] for cand in candidates], dtype=np.int64)
    per = np.array([cand[3] // size for cand in candidates], dtype=np.int64)
    p_acc = np.stack([_params(cand[1], cand[2]) for cand in candidates]) if n else \
        np.empty((0, 16), dtype=np.int64)
    p_near = np.stack([_params(cand[1], Rounding.RNE) for cand in candidates]) if n else p_acc
    p_out = _params(output or MASTER, Rounding.RNE)
    ok = np.zeros(n, dtype=np.bool_)
    if n:
        jit.spread(kernel, n, max(1, want.numel() // 8), a, ea, b, eb, bad_a, bad_b, c,
                   prep.a.shape[1], M, N, size, interleave, max(min_exp, TOP_FLOOR), kept_all,
                   per, p_acc, p_near,
                   _params(MASTER, Rounding.RNE), p_out, want.numpy(), ok)
    return [bool(x) for x in ok]
