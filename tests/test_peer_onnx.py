"""ONNX v1.22 low-precision node-test vectors replayed through drift (read in place from ../shared).

Each of the 96 ONNX cases (Cast, CastLike, its expanded Cast, QuantizeLinear, DequantizeLinear
for FP8 E4M3FN / E4M3FNUZ / E5M2 / E5M2FNUZ, FP4 E2M1 and E8M0) is one test. ONNX's attributes
map onto drift's two choices:

* rounding: round-to-nearest-even, except E8M0 casts, whose ``round_mode="up"`` is ``rup``;
* overflow: ``saturate=1`` (the default) is ``overflow="saturate"`` (±inf also -> ±max);
  ``saturate=0`` is ``overflow="ieee"`` (E4M3FN / fnuz overflow -> NaN, E5M2 -> ±inf).
  ``saturate`` only governs FP8 and E8M0 targets: FP4 always saturates, and a cast to
  FLOAT / FLOAT16 follows IEEE.

What is compared, element by element, is the output code (the raw bits for FLOAT / FLOAT16):
drift's output goes through ``codec.encode`` and must equal ONNX's code exactly, the sign of
zero included. NaN is compared as "both NaN" plus the code with the sign bit cleared: drift's
NaN carries no sign (its canonical code), while ONNX keeps it (E4M3FN -inf with
``saturate=0`` is ``0xFF``, fnuz NaN widens to ``0xFFC00000``).

One deliberate difference is encoded explicitly: ONNX casts NaN to FP4 as code ``0x8`` (−0),
since FP4 has no NaN; drift keeps such an element NaN, so it is recorded as non-finite
instead of silently becoming zero.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from peer_data import DATA, mismatches, requires_peer_data

import driftcli as drift
from driftcli.casts import codec
from driftcli.records.formats import get_format

ONNX = DATA / "onnx-lowp-casts"
pytestmark = requires_peer_data

FORMAT = {
    "FLOAT": "float32",
    "FLOAT16": "float16",
    "FLOAT8E4M3FN": "float8_e4m3fn",
    "FLOAT8E4M3FNUZ": "float8_e4m3fnuz",
    "FLOAT8E5M2": "float8_e5m2",
    "FLOAT8E5M2FNUZ": "float8_e5m2fnuz",
    "FLOAT4E2M1": "float4_e2m1fn",
    "FLOAT8E8M0": "float8_e8m0fnu",
}
"""ONNX type name -> drift format."""

TO_ENUM = {1: "FLOAT", 10: "FLOAT16", 17: "FLOAT8E4M3FN", 18: "FLOAT8E4M3FNUZ", 19: "FLOAT8E5M2",
           20: "FLOAT8E5M2FNUZ", 23: "FLOAT4E2M1", 24: "FLOAT8E8M0"}
"""The ``to`` attribute's TensorProto enum -> ONNX type name."""

WIDE = {"FLOAT", "FLOAT16"}  # stored as values; every other type is stored as raw codes
FP4 = "FLOAT4E2M1"
FP4_NAN_CODE = 0x8  # ONNX writes NaN as FP4's −0 code, for want of a NaN code

# Only "up" occurs in these vectors; an unmapped mode fails with KeyError instead of guessing.
E8M0_ROUND_MODE = {"up": "rup"}

Case = dict[str, Any]


@cache
def arrays() -> dict[str, np.ndarray]:
    """Every array of the npz, by ``<case>/<file stem>`` (a plain npz: no pickle)."""
    with np.load(ONNX / "onnx_lowp_vectors.npz", allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def load_cases() -> list[Case]:
    """The case list, or none where the data folder is absent (the module is skipped then)."""
    if not DATA.exists():
        return []
    return json.loads((ONNX / "onnx_lowp_vectors.json").read_text())


CASES = load_cases()


def tensor(case: Case, i: int) -> tuple[np.ndarray, str]:
    """Array ``i`` of a case (inputs in file order, output last) and its ONNX type name."""
    entry = case["tensors"][i]
    return arrays()[f"{case['case']}/{entry['file'].removesuffix('.pb')}"], entry["dtype"]


def values(array: np.ndarray, onnx_type: str) -> torch.Tensor:
    """The values a stored array stands for: floats as they are, codes decoded by drift."""
    if onnx_type in WIDE:
        return torch.from_numpy(array.copy())
    return codec.decode(torch.from_numpy(array.astype(np.int64)), FORMAT[onnx_type])


def codes(array: np.ndarray, onnx_type: str) -> torch.Tensor:
    """The codes of a stored array as int64: raw bits for floats, the stored codes otherwise."""
    if onnx_type == "FLOAT":
        array = array.view(np.uint32)
    elif onnx_type == "FLOAT16":
        array = array.view(np.uint16)
    return torch.from_numpy(array.astype(np.int64))


def per_axis(param: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """A scale or zero point shaped to broadcast along ``axis`` of ``x`` (per-tensor if 1 value)."""
    if param.numel() == 1:
        return param.reshape(())
    shape = [1] * x.dim()
    shape[axis] = -1
    return param.reshape(shape)


def cast(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast / CastLike: (the values rounded, drift's result)."""
    x_array, x_type = tensor(case, 0)
    _, out_type = tensor(case, -1)
    if "to" in case["attrs"]:
        assert TO_ENUM[case["attrs"]["to"]] == out_type
    saturate = case["attrs"].get("saturate", 1) == 1
    rounding = "rne"
    if out_type in WIDE:
        overflow = "ieee"  # ONNX's saturate only governs FP8 / E8M0 targets
    elif out_type == FP4:
        overflow = "saturate"  # FP4 has no inf: ONNX always clamps to ±6
    else:
        overflow = "saturate" if saturate else "ieee"
        if out_type == "FLOAT8E8M0":
            rounding = E8M0_ROUND_MODE[case["attrs"].get("round_mode", "up")]
    x = values(x_array, x_type)
    return x, drift.round_to_format(x, FORMAT[out_type], rounding=rounding, overflow=overflow)


def quantize(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """QuantizeLinear: cast(x / scale + zero_point) with RNE, saturating (FP8 default, FP4 always).

    The division and the addition are float32 operations, as in ONNX; adding the zero point
    (+0) before rounding is what turns x = −0 into +0.
    """
    (x_array, x_type), (s_array, s_type), (zp_array, zp_type) = (tensor(case, i) for i in range(3))
    assert case["attrs"].get("saturate", 1) == 1
    axis = case["attrs"].get("axis", 1)
    x = values(x_array, x_type).float()
    scale = per_axis(values(s_array, s_type), x, axis)
    zero_point = per_axis(values(zp_array, zp_type), x, axis)
    y = x / scale + zero_point
    assert y.dtype == torch.float32
    return y, drift.round_to_format(y, FORMAT[zp_type], rounding="rne", overflow="saturate")


def dequantize(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """DequantizeLinear: (x − zero_point) · scale, the product rounded once onto the output type.

    The difference is exact in float32 (two FP8 / FP4 values); drift.multiply rounds the
    exact product, so a FLOAT16 scale gives a correctly rounded FLOAT16 output.
    """
    x_array, x_type = tensor(case, 0)
    s_array, s_type = tensor(case, 1)
    _, out_type = tensor(case, -1)
    axis = case["attrs"].get("axis", 1)
    x = values(x_array, x_type)
    zero_point = torch.zeros(())
    if len(case["tensors"]) == 4:
        zp_array, zp_type = tensor(case, 2)
        assert zp_type == x_type
        zero_point = values(zp_array, zp_type)
    scale = per_axis(values(s_array, s_type), x, axis)
    difference = x - per_axis(zero_point, x, axis)
    return difference, drift.multiply(difference, scale, FORMAT[out_type], rounding="rne",
                                      overflow="ieee")


OPS = {"Cast": cast, "CastLike": cast, "QuantizeLinear": quantize, "DequantizeLinear": dequantize}


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_onnx_case(case: Case) -> None:
    """Every output element of one ONNX case: drift's code equals ONNX's."""
    rounded, got = OPS[case["op"]](case)
    out_array, out_type = tensor(case, -1)
    fmt = get_format(FORMAT[out_type])
    expected = codes(out_array, out_type).flatten()
    rounded, got = rounded.flatten(), got.flatten()
    assert got.shape == expected.shape

    # The documented difference: NaN into FP4. ONNX gives 0x8 (−0); drift keeps NaN.
    fp4_nan = rounded.isnan() if out_type == FP4 else torch.zeros_like(expected, dtype=torch.bool)
    assert (expected[fp4_nan] == FP4_NAN_CODE).all(), "ONNX no longer writes FP4 NaN as 0x8"
    assert got[fp4_nan].isnan().all(), "drift turned a NaN into an FP4 number"

    got_codes = codec.encode(torch.where(fp4_nan, 0.0, got), fmt)  # FP4 has no NaN code
    expected_nan = codec.decode(expected, fmt).isnan()
    got_nan = got.isnan() & ~fp4_nan
    sign = 1 << (fmt.bits - 1) if fmt.signed else 0
    same = torch.where(expected_nan, got_nan & ((got_codes | sign) == (expected | sign)),
                       ~got_nan & (got_codes == expected))
    bad = ~same & ~fp4_nan

    in_array, in_type = tensor(case, 0)
    inputs = in_array.flatten()
    digits = (fmt.bits + 3) // 4

    def describe(i: int) -> str:
        shown = f"{int(inputs[i]):02X}" if in_type not in WIDE else repr(float(inputs[i]))
        return (f"[{i}] {in_type} {shown} -> expected {int(expected[i]):0{digits}X}, "
                f"drift {int(got_codes[i]):0{digits}X} ({float(got[i])!r})")

    if bool(bad.any()):
        pytest.fail(f"{case['case']}: " + mismatches(bad, describe))


def test_onnx_every_case_and_array_replayed() -> None:
    """All 96 cases are parametrized, each has a known op, and every npz array belongs to one."""
    assert len(CASES) == 96
    assert {c["op"] for c in CASES} <= set(OPS)
    listed = {f"{c['case']}/{t['file'].removesuffix('.pb')}" for c in CASES for t in c["tensors"]}
    assert listed == set(arrays())
