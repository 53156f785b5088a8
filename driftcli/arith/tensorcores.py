"""The published tensor-core models as presets, and the recorded GPU dot products that check them.

A :class:`TensorCore` is one GPU's dot-product unit for one input and result type: the
operands' format, the block-FMA unit, the format and rounding of every group's result, and
where the parameters come from. ``tc=h100_e4m3_f32`` in a matmul spec expands to it
(``docs/tensor-cores.md`` lists every preset with its source and what was corrected from the
recordings).
"""

from __future__ import annotations

import gzip
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from driftcli.arith.blockfma import Accumulation, FMAUnit, fma_dot
from driftcli.errors import DriftError, close_matches
from driftcli.records.formats import Format, get_format
from driftcli.records.modes import Rounding


@dataclass(frozen=True)
class TensorCore:
    """One tensor-core dot-product unit: ``d = a·b + c`` for ``a``, ``b`` in ``inputs``."""

    inputs: str
    """The operands' format (its smallest normal exponent floors the terms' exponents)."""
    unit: FMAUnit
    acc: str
    """The format of every group's result (float32, float16, e8m13, ...)."""
    rounding: Rounding
    """How a group's exact sum is rounded into ``acc``."""
    source: str = ""
    """Where the parameters come from."""

    @property
    def input_format(self) -> Format:
        """The operands' :class:`Format`."""
        return get_format(self.inputs)

    def accumulation(self, promote: int = 0) -> Accumulation:
        """The block-FMA accumulation of this unit (promotion every ``promote`` products)."""
        emin = self.input_format.emin
        return Accumulation(self.unit, get_format(self.acc), self.rounding, emin, emin, promote)


def dot(a: Tensor, b: Tensor, c: Tensor, core: TensorCore) -> Tensor:
    """``sum_i a[:, i] * b[:, i] + c`` as ``core`` computes it, one dot product per row.

    ``a`` and ``b`` (rows x K) hold values exact in ``core.inputs``, ``c`` (rows) one exact in
    ``core.acc``; the result is float64, exact in ``core.acc``."""
    if a.shape != b.shape or a.dim() != 2 or c.shape != a.shape[:1]:
        raise DriftError(f"tensor-core dot: a and b must be rows x K and c one per row, not "
                         f"{tuple(a.shape)}, {tuple(b.shape)} and {tuple(c.shape)}")
    return fma_dot(a, b, core.accumulation(), c=c.double())


_KM = ("Khattak and Mikaitis, north-numerical-computing/MATLAB-tensor-core b12b5a7, "
       "models/{gpu}TC.m")
_RZ, _RNE = Rounding.RTZ, Rounding.RNE


def _cores() -> dict[str, TensorCore]:
    """Every GPU, input type and result type with a published model."""
    cores: dict[str, TensorCore] = {}

    def put(name: str, inputs: str, size: int, kept: int, acc: str, rounding: Rounding,
            min_exp: int, source: str, interleave: int = 0) -> None:
        cores[name] = TensorCore(inputs, FMAUnit(size, kept, min_exp, interleave), acc,
                                 rounding, source)

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
    # H200TC.m is H100TC.m; B200TC.m differs in FP8; RTXPRO6000TC.m (Blackwell) is B200TC.m
    for gpu in ("H100", "H200", "B200", "RTXPRO6000"):
        g, src = gpu.lower(), _KM.format(gpu=gpu)
        put(f"{g}_fp16_f32", "float16", 16, 25, "float32", _RZ, -133, src)
        put(f"{g}_fp16_f16", "float16", 16, 25, "float16", _RNE, -21, src)
        put(f"{g}_bf16_f32", "bfloat16", 16, 25, "float32", _RZ, -133, src)
        put(f"{g}_tf32_f32", "e8m10", 8, 25, "float32", _RZ, -133, src)
        for fp8, name in (("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2")):
            if gpu in ("B200", "RTXPRO6000"):  # FP8 keeps 2 extra bits, float32 result only
                put(f"{g}_{name}_f32", fp8, 32, 25, "float32", _RZ, -133, src)
                continue
            put(f"{g}_{name}_f32", fp8, 32, 13, "e8m13", _RZ, -133, src + " (WGMMA)")
            # mma.sync with an fp16 result: two interleaved halves of 16, c added last (the
            # model's v0.1 layout; the only one of the published layouts that reproduces the
            # recordings, see docs/tensor-cores.md)
            put(f"{g}_{name}_f16", fp8, 32, 25, "float16", _RNE, -133,
                src + " v0.1 (interleaved halves)", interleave=2)
            # DeepSeek-V3's report and DeepGEMM issues #37 and #50 say about 14 bits
            put(f"{g}_{name}_f32_14bit", fp8, 32, 14, "e8m14", _RZ, -133,
                "DeepSeek-V3 technical report (arXiv 2412.19437) section 3.3.2 and "
                "deepseek-ai/DeepGEMM issues #37, #50: about 14 bits kept on Hopper's FP8 "
                "tensor cores (the recordings say 13, see docs/tensor-cores.md)")
    return cores


CORES: dict[str, TensorCore] = _cores()
"""Every tensor-core model, by ``gpu_input_result`` (``h100_e4m3_f32``)."""


def tensor_core(name: str) -> TensorCore:
    """The preset ``name``, or an error naming the presets."""
    try:
        return CORES[name.strip()]
    except KeyError:
        raise DriftError(f"unknown tensor-core preset {name!r}"
                         f"{close_matches(name, list(CORES))}; see docs/tensor-cores.md or "
                         "drift formats --tensor-cores") from None


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


MAX_VALUES = 1 << 20
"""Bit patterns one recordings file may hold (1,048,576; the shared recordings' largest holds
160,000: 5,000 dot products of K = 32). Past it the file is refused: a gzip of a few hundred
KB can inflate to gigabytes, every value read is kept, and parsing takes about 1.5 µs a
value."""
MAX_LINES = 1 << 18
"""Lines (blank ones too) one recordings file may hold (262,144; 5,000 in the shared ones):
what bounds the time a file of empty lines takes."""
MAX_LINE = 1 << 20
"""Characters one line may hold (a line is read whole before it is split)."""


def _too_big(path: Path, what: str) -> DriftError:
    return DriftError(f"recordings file {path} holds more than {what}, the most drift reads "
                      "from one file; split the recordings into folders of fewer dot products")


def _bit_patterns(path: Path, base: int, *, first: bool) -> Tensor:
    """The float32 bit patterns of a recordings file, streamed (a ``.gz`` is inflated as it is
    read) and bounded by :data:`MAX_VALUES`, :data:`MAX_LINES` and :data:`MAX_LINE`: every
    word of each line, all lines as long (``first=False``: a and b, hex), or only a line's
    first word (``first=True``: c and d, binary). As float64, (lines, K) or (lines,)."""
    opener = gzip.open if path.suffix == ".gz" else open
    words = array("q")  # 8 bytes a value, not a Python string and int each
    width: int | None = None
    with opener(path, "rt") as fh:
        for n in range(MAX_LINES + 1):
            line = fh.readline(MAX_LINE + 1)
            if not line:
                break
            if n == MAX_LINES:
                raise _too_big(path, f"{MAX_LINES:,} lines")
            if len(line) > MAX_LINE:
                raise _too_big(path, f"{MAX_LINE:,} characters in a line")
            row = line.split()[:1] if first else line.split()
            if not row:
                continue
            if not first and width is not None and len(row) != width:
                raise DriftError("recordings: the rows of a or b differ in length")
            width = len(row)
            if len(words) + len(row) > MAX_VALUES:
                raise _too_big(path, f"{MAX_VALUES:,} values")
            words.extend(int(w, base) for w in row)
    codes = (torch.frombuffer(words, dtype=torch.int64) if words else
             torch.zeros(0, dtype=torch.int64))
    floats = codes.to(torch.int32).view(torch.float32).double()
    return floats if first or width is None else floats.reshape(-1, width)


def _file(folder: Path, stem: str) -> Path:
    """``stem.txt.gz``, or ``stem.txt`` where only that exists (the models' own layout)."""
    plain = folder / f"{stem}.txt"
    return plain if plain.exists() and not (folder / f"{stem}.txt.gz").exists() else \
        folder / f"{stem}.txt.gz"


def read_recordings(folder: Path) -> Recordings:
    """The recordings of one ``GPU/FORMAT`` folder in the layout of Khattak and Mikaitis's
    ``model_validation`` (``a_GPU_FORMAT.txt[.gz]``: K float32 bit patterns in hex per line;
    ``c_GPU_fp32``, ``d_GPU_fp32``, ``d_GPU_fp16``: one float32 bit pattern in binary)."""
    gpu, fmt = folder.parent.name, folder.name
    try:
        a = _bit_patterns(_file(folder, f"a_{gpu}_{fmt}"), 16, first=False)
        b = _bit_patterns(_file(folder, f"b_{gpu}_{fmt}"), 16, first=False)
        c = _bit_patterns(_file(folder, f"c_{gpu}_fp32"), 2, first=True)
        d = {out: _bit_patterns(path, 2, first=True) for out in ("fp32", "fp16")
             if (path := _file(folder, f"d_{gpu}_{out}")).exists()}
    except (OSError, ValueError, OverflowError, EOFError, zlib.error) as exc:
        raise DriftError(f"cannot read the recordings in {folder}: {exc}; expected "
                         f"a_{gpu}_{fmt}.txt.gz, b_..., c_{gpu}_fp32.txt.gz and d_... "
                         "files") from None
    if not d:
        raise DriftError(f"no results in {folder}: expected d_{gpu}_fp32.txt.gz or "
                         f"d_{gpu}_fp16.txt.gz beside the inputs")
    if not (a.shape == b.shape and a.shape[0] == c.shape[0]
            and all(v.shape == c.shape for v in d.values())):
        raise DriftError(f"the recordings in {folder} differ in count: a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, c {tuple(c.shape)}")
    return Recordings(gpu, fmt, a, b, c, d)
