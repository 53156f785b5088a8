"""Block-FMA accumulation: the dot product of a tensor core, as the published models describe it.

A tensor core does not add products one at a time. It takes a block of ``fma`` products
(exact) together with the running sum ``c``, finds the largest exponent among them, keeps
each term only to a fixed number of bits below that exponent (the rest is cut off, toward
zero), adds the cut terms exactly and rounds the total once into its accumulator format. A
longer dot product chains blocks in index order, each block's rounded result the next one's
``c``. Fasi, Higham, Mikaitis and Pranesh measured this on NVIDIA's tensor cores ("Numerical
behavior of NVIDIA tensor cores", PeerJ CS 2021); Khattak and Mikaitis parametrised it per GPU
(IEEE HPEC 2025; north-numerical-computing/MATLAB-tensor-core). The presets and their sources
are in ``docs/tensor-cores.md``.

Every step here is exact in float64: products of significands of at most 11 bits, terms that
are integers below 2**34 once scaled by the cut, and one rounding by drift's exact kernel.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from driftcli.errors import DriftError
from driftcli.formats import Format, get_format
from driftcli.modes import Overflow, Rounding
from driftcli.rounding import add, round_to_format

_NONE = -(1 << 20)
"""The exponent of a term that is not there (a zero product, a zero ``c``): below any other."""
_C_EMIN = -126
_TOP_FLOOR = -900
"""A floor under a block's reference exponent below which no term lies (float32 operands' products
reach 2**-298): an empty block's ``min_exp`` of -1024 would scale its zeros by 2**1047, which is
inf, and 0 * inf is NaN."""
"""The running sum's exponent is read as a float32's, whatever its format (the models' rule)."""


@dataclass(frozen=True)
class BlockFMA:
    """One tensor-core dot-product unit: the parameters of the published block-FMA models.

    ``kept_bits`` is how many bits below the block's reference exponent every term keeps
    (the models' 23 + ``neab``: 24 on A100, 25 on H100, 13 for FP8 inputs on Hopper).
    ``min_exp`` is a floor under that exponent. With ``interleave`` = k > 0 a block is dealt
    into two halves by position, k products at a time (positions i with (i // k) even
    first): each half is summed and rounded on its own, the first from zero, the second onto
    the first, and ``c`` is added last with one correctly rounded addition.
    """

    inputs: str
    """The operands' format (its smallest normal exponent decides the terms' exponents)."""
    fma: int
    """Products per block."""
    kept_bits: int
    acc: str
    """The format of every block's result (float32, float16, e8m13, ...)."""
    rounding: Rounding
    """How a block's exact sum is rounded into ``acc``."""
    min_exp: int = -1024
    interleave: int = 0
    source: str = ""
    """Where the parameters come from."""

    def __post_init__(self) -> None:
        if self.fma < 1 or self.kept_bits < 1:
            raise DriftError(f"block FMA: fma ({self.fma}) and kept bits ({self.kept_bits}) "
                             "must be at least 1")
        if self.kept_bits + 3 + (self.fma + 1).bit_length() > 53:
            # a term below 2**(kept + 3), fma + 1 of them: their sum must be exact in float64
            raise DriftError(f"block FMA: {self.kept_bits} kept bits in blocks of {self.fma} "
                             "do not fit float64's 53 bits; keep fewer")
        if self.interleave and self.fma % (2 * self.interleave):
            raise DriftError(f"block FMA: an interleave of {self.interleave} needs a block of "
                             f"a multiple of {2 * self.interleave} products, not {self.fma}")

    @property
    def input_format(self) -> Format:
        """The operands' :class:`Format`."""
        return get_format(self.inputs)


def _exponents(x: Tensor, emin: int) -> Tensor:
    """The models' exponent of each value: floor(log2 |x|) read from the bits, at least
    ``emin`` (a subnormal keeps its format's smallest normal exponent), :data:`_NONE` for 0."""
    e = torch.frexp(x)[1].to(torch.int64) - 1
    return torch.where(x == 0, _NONE, torch.clamp(e, min=emin))


def _block(prods: Tensor, exps: Tensor, c: Tensor, m: BlockFMA) -> Tensor:
    """One block: ``prods`` (rows x n, exact) with their exponents, and ``c`` (rows), summed
    with every term cut toward zero to a multiple of 2**(E - kept_bits), E the largest
    exponent (at least ``min_exp``), then rounded once into ``acc``."""
    c_exp = _exponents(c, _C_EMIN)
    top = torch.maximum(exps.max(dim=1).values, c_exp)
    top = torch.clamp(top, min=max(m.min_exp, _TOP_FLOOR))
    shift = (m.kept_bits - top).to(torch.float64)
    # x * 2**(kept - E) is exact (a power-of-two scaling within float64's range), and its
    # truncation is the cut; the cut terms are integers below 2**(kept + 3), so their sum
    # (at most a few dozen) is exact in any order
    cut = torch.trunc(torch.ldexp(prods, shift[:, None])).sum(dim=1)
    cut = cut + torch.trunc(torch.ldexp(c, shift))
    exact = torch.ldexp(cut, -shift)
    return round_to_format(exact, m.acc, rounding=m.rounding, overflow=Overflow.IEEE)


def dot(a: Tensor, b: Tensor, c: Tensor, m: BlockFMA) -> Tensor:
    """``sum_i a[:, i] * b[:, i] + c`` as the unit ``m`` computes it, one dot product per row.

    ``a`` and ``b`` (rows x K) hold values exact in ``m.inputs``, ``c`` (rows) one exact in
    ``m.acc``; the result is float64, exact in ``m.acc``. NaN and infinity follow IEEE
    arithmetic on the exact products (the models check them before any block)."""
    a, b, c = a.double(), b.double(), c.double()
    if a.shape != b.shape or a.dim() != 2 or c.shape != a.shape[:1]:
        raise DriftError(f"block FMA dot: a and b must be rows x K and c one per row, not "
                         f"{tuple(a.shape)}, {tuple(b.shape)} and {tuple(c.shape)}")
    emin = m.input_format.emin
    rows, k = a.shape
    blocks = max(1, math.ceil(k / m.fma))
    pad = blocks * m.fma - k
    if pad:
        zeros = a.new_zeros(rows, pad)
        a, b = torch.cat([a, zeros], dim=1), torch.cat([b, zeros], dim=1)
    prods = a * b  # exact: significands of at most 11 bits each
    exps = torch.where(prods == 0, _NONE, _exponents(a, emin) + _exponents(b, emin))
    special = ~torch.isfinite(prods).all(dim=1) | ~torch.isfinite(c)
    acc = torch.where(special, 0.0, c)
    if m.interleave:
        position = torch.arange(m.fma)
        first = (position // m.interleave) % 2 == 0
        halves = (position[first], position[~first])
    for j in range(blocks):
        p = prods[:, j * m.fma:(j + 1) * m.fma].nan_to_num(0.0, 0.0, 0.0)
        e = exps[:, j * m.fma:(j + 1) * m.fma]
        if not m.interleave:
            acc = _block(p, e, acc, m)
            continue
        part = _block(p[:, halves[0]], e[:, halves[0]], torch.zeros_like(acc), m)
        part = _block(p[:, halves[1]], e[:, halves[1]], part, m)
        acc = add(part, acc, m.acc, rounding=Rounding.RNE, overflow=Overflow.IEEE).double()
    if special.any():
        # IEEE on the exact terms: NaN from a NaN or opposite infinities, else the infinity
        total = prods.sum(dim=1) + c
        acc = torch.where(special, total, acc)
    return acc


_KM = ("Khattak and Mikaitis, north-numerical-computing/MATLAB-tensor-core b12b5a7, "
       "models/{gpu}TC.m")
_RZ, _RNE = Rounding.RTZ, Rounding.RNE


def _units() -> dict[str, BlockFMA]:
    """The presets: every GPU, input type and result type with a published model."""
    units: dict[str, BlockFMA] = {}

    def put(name: str, inputs: str, fma: int, kept: int, acc: str, rounding: Rounding,
            min_exp: int, source: str, interleave: int = 0) -> None:
        units[name] = BlockFMA(inputs, fma, kept, acc, rounding, min_exp, interleave, source)

    put("v100_fp16_f32", "float16", 4, 23, "float32", _RZ, -1024, _KM.format(gpu="V100"))
    put("v100_fp16_f16", "float16", 4, 23, "float16", _RNE, -19, _KM.format(gpu="V100"))
    for gpu in ("A100", "Ada"):  # Ada: models/AdaTC.m (L40STC.m has the same parameters)
        g, src = gpu.lower(), _KM.format(gpu=gpu)
        put(f"{g}_fp16_f32", "float16", 8, 24, "float32", _RZ, -132, src)
        put(f"{g}_fp16_f16", "float16", 8, 24, "float16", _RNE, -20, src)
        put(f"{g}_bf16_f32", "bfloat16", 8, 24, "float32", _RZ, -132, src)
        put(f"{g}_tf32_f32", "e8m10", 4, 24, "float32", _RZ, -132, src)
    for fp8, name in (("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2")):
        src = _KM.format(gpu="Ada")
        # FP8 keeps 13 bits past the largest exponent and the float32 result 13 fraction
        # bits (an e8m13 accumulator); an fp16 result is rounded to nearest from those bits
        # (the model before its commit 00415cd, which also cut the fp16 result to 0 bits)
        put(f"ada_{name}_f32", fp8, 16, 13, "e8m13", _RZ, -132, src)
        put(f"ada_{name}_f16", fp8, 16, 13, "float16", _RNE, -132,
            src + ", fp16 result as before its commit 00415cd")
    for gpu in ("H100", "H200", "B200"):  # H200TC.m is H100TC.m; B200TC.m differs in FP8
        g, src = gpu.lower(), _KM.format(gpu=gpu)
        put(f"{g}_fp16_f32", "float16", 16, 25, "float32", _RZ, -133, src)
        put(f"{g}_fp16_f16", "float16", 16, 25, "float16", _RNE, -21, src)
        put(f"{g}_bf16_f32", "bfloat16", 16, 25, "float32", _RZ, -133, src)
        put(f"{g}_tf32_f32", "e8m10", 8, 25, "float32", _RZ, -133, src)
        for fp8, name in (("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2")):
            if gpu == "B200":  # FP8 keeps 2 extra bits, float32 result only
                put(f"{g}_{name}_f32", fp8, 32, 25, "float32", _RZ, -133, src)
                continue
            put(f"{g}_{name}_f32", fp8, 32, 13, "e8m13", _RZ, -133, src + " (WGMMA)")
            # mma.sync with an fp16 result: two interleaved halves of 16, c added last (the
            # model's v0.1 layout; the only one of the published layouts that reproduces the
            # recordings, see docs/tensor-cores.md)
            put(f"{g}_{name}_f16", fp8, 32, 25, "float16", _RNE, -133,
                src + " v0.1 (interleaved halves)", interleave=2)
    return units


PRESETS: dict[str, BlockFMA] = _units()
"""Every published tensor-core model, by ``gpu_input_result`` (``h100_e4m3_f32``)."""


@dataclass(frozen=True)
class Recordings:
    """Dot products recorded on a GPU, with their inputs: ``a`` and ``b`` (n x K, float64),
    the accumulator input ``c`` as recorded (n, float32 values), and the results ``d`` by
    result format (``fp32``, ``fp16``; n, float64)."""

    gpu: str
    inputs: str
    a: Tensor
    b: Tensor
    c: Tensor
    d: dict[str, Tensor]


def _lines(path: Path) -> list[list[str]]:
    with gzip.open(path, "rt") as fh:
        return [line.split() for line in fh if line.strip()]


def _hex_floats(rows: list[list[str]]) -> Tensor:
    words = [[int(w, 16) for w in row] for row in rows]
    if len({len(r) for r in words}) > 1:
        raise DriftError("recordings: the rows of a or b differ in length")
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32).double()


def _binary_floats(rows: list[list[str]]) -> Tensor:
    words = [int(row[0], 2) for row in rows]
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32).double()


def read_recordings(folder: Path) -> Recordings:
    """The recordings of one ``GPU/FORMAT`` folder in the layout of Khattak and Mikaitis's
    ``model_validation`` (``a_GPU_FORMAT.txt.gz``: K float32 bit patterns in hex per line;
    ``c_GPU_fp32``, ``d_GPU_fp32``, ``d_GPU_fp16``: one float32 bit pattern in binary)."""
    gpu, fmt = folder.parent.name, folder.name
    try:
        a = _hex_floats(_lines(folder / f"a_{gpu}_{fmt}.txt.gz"))
        b = _hex_floats(_lines(folder / f"b_{gpu}_{fmt}.txt.gz"))
        c = _binary_floats(_lines(folder / f"c_{gpu}_fp32.txt.gz"))
        d = {out: _binary_floats(_lines(path)) for out in ("fp32", "fp16")
             if (path := folder / f"d_{gpu}_{out}.txt.gz").exists()}
    except (OSError, ValueError) as exc:
        raise DriftError(f"cannot read the recordings in {folder}: {exc}; expected "
                         f"a_{gpu}_{fmt}.txt.gz, b_..., c_{gpu}_fp32.txt.gz and d_... "
                         "files") from None
    if not (a.shape == b.shape and a.shape[0] == c.shape[0]
            and all(v.shape == c.shape for v in d.values())):
        raise DriftError(f"the recordings in {folder} differ in count: a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, c {tuple(c.shape)}")
    return Recordings(gpu, fmt, a, b, c, d)
