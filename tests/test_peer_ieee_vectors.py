"""Berkeley TestFloat 3e vectors replayed through drift's rounding (read in place from ../shared).

Each vector file is one test: every line is fed to drift in a single vectorized call, and the
number of lines checked must equal the number of lines in the file. What is compared:

* non-NaN results: the exact result bits (so the sign of zero, ±inf and ±max on overflow count);
* NaN results: "is NaN" on both sides, because drift does not model SoftFloat's 8086-SSE
  payload propagation (quieted input payloads, default NaN ``FE00`` / ``FFC00000``);
* the exception flags (last field) are not compared: drift raises no IEEE flags.

Overflow is ``overflow="ieee"``: IEEE 754's directed-rounding results (±max or ±inf), which are
what TestFloat expects. torch on CPU keeps subnormals unless told otherwise, and nothing here
tells it otherwise, so subnormal operands and results reach drift intact.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from peer_data import DATA, mismatches, requires_peer_data

import driftcli as drift
from driftcli.casts import codec

TESTFLOAT = DATA / "testfloat"
pytestmark = requires_peer_data

MODES = {"rnear_even": "rne", "rnear_maxMag": "rna", "rminMag": "rtz", "rmin": "rdown",
         "rmax": "rup"}
"""TestFloat's rounding-mode option -> drift's rounding mode."""

FORMAT = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
HEX_DIGITS = {"f16": 4, "bf16": 4, "f32": 8}
FLAG_DIGITS = 2
# Operands are fed in their own dtype, so drift sees exactly the bits TestFloat wrote.
DTYPES = {"f16": (np.uint16, np.int16, torch.float16),
          "f32": (np.uint32, np.int32, torch.float32)}


@dataclass(frozen=True)
class VectorFile:
    """One ``testfloat_gen`` output: an operation, its types, rounding mode and test level."""

    op: str  # "add", "mul" or "to" (a conversion)
    src: str
    dst: str
    mode: str | None  # None for the exact f16 -> f32 widening
    level: int

    @property
    def name(self) -> str:
        head = f"{self.src}_{self.op}" if self.op != "to" else f"{self.src}_to_{self.dst}"
        return f"{head}_{self.mode}_L{self.level}" if self.mode else f"{head}_L{self.level}"

    @property
    def operands(self) -> int:
        return 1 if self.op == "to" else 2


# The full set generated for the peer folder; spelled out so a missing file fails, not vanishes.
FILES = (
    [VectorFile(op, t, t, m, 1) for t in ("f16", "f32") for op in ("add", "mul") for m in MODES]
    + [VectorFile("to", "f32", t, m, lvl) for t in ("f16", "bf16") for m in MODES
       for lvl in (1, 2)]
    + [VectorFile("to", "f16", "f32", None, 1)]
)

_HEX = np.full(256, -1, dtype=np.int64)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def read_columns(raw: bytes, widths: list[int]) -> list[np.ndarray]:
    """Parse fixed-width lines of space-separated upper-case hex fields into int64 columns.

    The whole file is parsed as one byte matrix; every separator and digit is checked, so a
    malformed line fails here instead of being skipped.
    """
    row = sum(widths) + len(widths)  # each field plus its following space or newline
    assert raw.endswith(b"\n") and len(raw) % row == 0, "lines are not all of fixed width"
    rows = np.frombuffer(raw, np.uint8).reshape(-1, row)
    columns, start = [], 0
    for i, width in enumerate(widths):
        end = start + width
        separator = b"\n" if i == len(widths) - 1 else b" "
        assert (rows[:, end] == separator[0]).all(), f"field {i} is not followed by {separator!r}"
        digits = _HEX[rows[:, start:end]]
        assert (digits >= 0).all(), f"field {i} holds a character that is not upper-case hex"
        columns.append((digits << (4 * np.arange(width - 1, -1, -1))).sum(axis=1))
        start = end + 1
    return columns


def as_tensor(bits: np.ndarray, kind: str) -> torch.Tensor:
    """The raw bit patterns as a tensor of that type (a bit view: no value conversion)."""
    unsigned, signed, ftype = DTYPES[kind]
    return torch.from_numpy(bits.astype(unsigned).view(signed)).view(ftype)


def run_drift(vf: VectorFile, operands: list[torch.Tensor]) -> torch.Tensor:
    """The operation the file names, through drift's public API."""
    # f16 -> f32 is exact, so its file names no mode and any drift mode would do
    rounding = MODES[vf.mode] if vf.mode else "rne"
    if vf.op == "to":
        return drift.round_to_format(operands[0], FORMAT[vf.dst], rounding=rounding,
                                     overflow="ieee")
    fn = drift.add if vf.op == "add" else drift.multiply
    return fn(operands[0], operands[1], FORMAT[vf.dst], rounding=rounding, overflow="ieee")


@pytest.mark.parametrize("vf", FILES, ids=[vf.name for vf in FILES])
def test_testfloat_file(vf: VectorFile) -> None:
    """Every line of one TestFloat file: drift's result bits equal SoftFloat's."""
    raw = gzip.decompress((TESTFLOAT / f"{vf.name}.txt.gz").read_bytes())
    lines = raw.count(b"\n")
    widths = [HEX_DIGITS[vf.src]] * vf.operands + [HEX_DIGITS[vf.dst], FLAG_DIGITS]
    *operand_bits, result_bits, _flags = read_columns(raw, widths)
    got = run_drift(vf, [as_tensor(b, vf.src) for b in operand_bits])

    fmt = FORMAT[vf.dst]
    expected = torch.from_numpy(result_bits)
    # one result per line, nothing dropped or broadcast along the way
    assert got.shape == expected.shape == (lines,) and lines > 0
    expected_nan = codec.decode(expected, fmt).isnan()
    got_nan = got.isnan()
    got_codes = codec.encode(got, fmt)
    bad = (expected_nan != got_nan) | (~expected_nan & (got_codes != expected))

    def describe(i: int) -> str:
        a = " ".join(f"{int(b[i]):0{HEX_DIGITS[vf.src]}X}" for b in operand_bits)
        return (f"line {i + 1}: {a} -> expected {int(expected[i]):0{HEX_DIGITS[vf.dst]}X}, "
                f"drift {int(got_codes[i]):0{HEX_DIGITS[vf.dst]}X}")

    if bool(bad.any()):
        pytest.fail(f"{vf.name}: " + mismatches(bad, describe))


def test_testfloat_every_file_replayed() -> None:
    """No vector file in the folder is left out of the parametrization above."""
    present = {p.name.removesuffix(".txt.gz") for p in TESTFLOAT.glob("*.txt.gz")}
    assert present == {vf.name for vf in FILES}
