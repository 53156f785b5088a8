"""Each quantized layout as the library that writes it writes it (tensor names, dtypes,
shapes, config and packing taken from the library's source, cited in docs/inputs.md; the
library is not installed), read by drift and compared, element by element, with Python
``Fraction``s decoded from the stored bits by this file's own unpacking."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_quantized import (
    BF16,
    E4M3_MAX,
    F32,
    frac_e4m3,
    round_frac,
    same_bits,
    sample,
    write,
)
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.dequantize import dequantize
from driftcli.io.readers import open_inputs
from driftcli.io.readers.quantized_weight import Order, spec_of, unpack_sixes, with_options
from driftcli.measures.inspect import inspect

FP6 = {"e2m3": (2, 3, 1), "e3m2": (3, 2, 3)}
"""OCP FP6 element formats: exponent bits, mantissa bits, bias (no infinity, no NaN)."""


def frac_fp(c: int, ebits: int, mbits: int, bias: int) -> Fraction:
    """A sign-magnitude float code with subnormals and no special values (E2M1, FP6)."""
    sign = -1 if c >> (ebits + mbits) & 1 else 1
    e, m = (c >> mbits) & ((1 << ebits) - 1), c & ((1 << mbits) - 1)
    mag = Fraction(m, 1 << mbits) * Fraction(2) ** (1 - bias) if e == 0 else \
        (1 + Fraction(m, 1 << mbits)) * Fraction(2) ** (e - bias)
    return sign * mag


def nearest_codes(v: torch.Tensor, ebits: int, mbits: int, bias: int) -> torch.Tensor:
    """The nearest code of each value (saturating), sign in the top bit."""
    n = 1 << (ebits + mbits)
    table = torch.tensor([float(frac_fp(c, ebits, mbits, bias)) for c in range(n)])
    idx = (v.abs().unsqueeze(-1) - table).abs().argmin(-1)
    return idx + (v < 0).to(torch.int64) * n


def e8m0_bytes(x: torch.Tensor, rule: str, emax: int) -> torch.Tensor:
    """One E8M0 byte per 32 elements of a row: ``floor`` (OCP MX v1.0: floor(log2 amax) -
    emax), ``modelopt`` (MXFP4QTensor.quantize: ceil(log2(amax / 6)), at least -127) or
    ``ct`` (compressed-tensors generate_mx_scales: amax's float32 bits plus 2**21, the
    mantissa masked off, then log2 - emax)."""
    amax = x.reshape(*x.shape[:-1], -1, 32).abs().amax(-1).float()
    if rule == "modelopt":
        e = torch.ceil(torch.maximum(torch.log2(amax / 6), torch.tensor(-127.0)))
    elif rule == "ct":
        bits = amax.view(torch.int32) + (1 << 21)
        e = torch.floor(torch.log2((bits & ~((1 << 23) - 1)).view(torch.float32))) - emax
    else:
        e = torch.floor(torch.log2(amax)) - emax
    return (e + 127).to(torch.uint8)


def mx_codes(x: torch.Tensor, b: torch.Tensor, fmt: tuple[int, int, int]) -> torch.Tensor:
    s = torch.pow(2.0, b.double() - 127).repeat_interleave(32, -1)
    return nearest_codes((x.double() / s).float(), *fmt)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Element 2i in the low nibble of byte i (compressed-tensors pack_fp4_to_uint8,
    ModelOpt fuse_uint4_to_uint8, quark Pack_fp4.pack)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def pack_sixes(codes: torch.Tensor) -> torch.Tensor:
    """quark Pack_fp6.pack: v3 << 18 | v2 << 12 | v1 << 6 | v0, stored low byte first."""
    c = codes.reshape(*codes.shape[:-1], -1, 4)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = torch.stack([(word >> (8 * k)) & 0xFF for k in range(3)], dim=-1)
    return out.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def my_codes(packed: list[int], six: bool) -> list[int]:
    """This test's own reading of one row of packed bytes."""
    if not six:
        return [n for b in packed for n in (b & 15, b >> 4)]
    out = []
    for i in range(0, len(packed), 3):
        word = packed[i] | packed[i + 1] << 8 | packed[i + 2] << 16
        out += [(word >> (6 * k)) & 63 for k in range(4)]
    return out


def expect_mx(packed: torch.Tensor, scales: torch.Tensor, fmt: tuple[int, int, int],
              six: bool, out: tuple[int, int, int] = F32) -> list[float]:
    want = []
    for row, srow in zip(packed.tolist(), scales.tolist(), strict=True):
        for j, c in enumerate(my_codes(row, six)):
            v = round_frac(frac_fp(c, *fmt) * Fraction(2) ** (srow[j // 32] - 127), *out)
            want.append(math.copysign(v, -1) if c >> (fmt[0] + fmt[1]) and v == 0 else v)
    return want


E2M1 = (2, 1, 1)
MX_LIBRARIES = {
    # name: (codes name, element, scale rule, config.json, hf_quant_config.json)
    "compressed-tensors": ("m.weight_packed", "fp4", "ct", {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
            "symmetric": True, "scale_dtype": "torch.uint8"}}}}, None),
    "modelopt": ("m.weight", "fp4", "modelopt", None,
                 {"producer": {"name": "modelopt"},
                  "quantization": {"quant_algo": "MXFP4", "group_size": 32}}),
    "quark": ("m.weight", "fp4", "floor", {
        "quant_method": "quark", "global_quant_config": {"weight": {
            "dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
            "scale_format": "e8m0", "is_dynamic": False}}}, None),
    "quark-e2m3": ("m.weight", "fp6_e2m3", "floor", {
        "quant_method": "quark", "global_quant_config": {"weight": {
            "dtype": "fp6_e2m3", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
            "scale_format": "e8m0"}}}, None),
    "quark-e3m2": ("m.weight", "fp6_e3m2", "floor", {
        "quant_method": "quark", "global_quant_config": {"weight": {
            "dtype": "fp6_e3m2", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
            "scale_format": "e8m0"}}}, None),
}
LAYOUT_OF = {"compressed-tensors": "ct-mxfp4", "modelopt": "mxfp4", "quark": "mxfp4",
             "quark-e2m3": "mxfp6-e2m3", "quark-e3m2": "mxfp6-e3m2"}


def mx_folder(folder: Path, lib: str, shape: tuple[int, int] = (6, 96), seed: int = 1,
              config: bool = True) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """A Linear weight (and an input scale) written as ``lib`` writes MX."""
    name, element, rule, cfg, hf = MX_LIBRARIES[lib]
    six = element.startswith("fp6")
    fmt = FP6[element[4:]] if six else E2M1
    x = sample(shape, seed, zero_block=False)
    emax = 2 ** fmt[0] - 1 - fmt[2]  # the element's largest exponent
    b = e8m0_bytes(x, rule, emax)
    codes = mx_codes(x, b, fmt)
    packed = pack_sixes(codes) if six else pack_nibbles(codes)
    write(folder, {name: packed, "m.weight_scale": b, "m.input_scale": torch.ones(())},
          cfg if config else None, hf if config else None)
    return packed, b, fmt


@pytest.mark.parametrize("lib", list(MX_LIBRARIES))
def test_mx_layouts_as_each_library_writes_them(tmp_path: Path, lib: str) -> None:
    packed, b, fmt = mx_folder(tmp_path / lib, lib)
    six = MX_LIBRARIES[lib][1].startswith("fp6")
    inputs = open_inputs([tmp_path / lib])
    assert inputs.errors == () and inputs.notices == ()
    (ref,) = inputs.tensors
    spec = spec_of(ref)
    assert spec is not None and ref.name == "m.weight" and ref.shape == (6, 96)
    assert str(spec.layout) == LAYOUT_OF[lib]
    got = ref.read()
    assert got.numel() == 576
    assert same_bits(got, expect_mx(packed, b, fmt, six), torch.float32) == 0
    assert same_bits(with_options(ref, "bfloat16").read(),
                     expect_mx(packed, b, fmt, six, BF16), torch.bfloat16) == 0
    # the library's order: MX scales are powers of two, every library's product is exact
    assert same_bits(with_options(ref, order=Order.LIBRARY).read(),
                     expect_mx(packed, b, fmt, six), torch.float32) == 0
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / lib), "--out",
                                      str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["rows"]
    assert (row["layout"], row["block"], row["scale_format"], row["error"]) == (
        LAYOUT_OF[lib], "1x32", "e8m0", None)
    assert row["n_blocks"] == 18 and row["scales_pow2"] is True


def test_mxfp6_without_its_config_is_refused_in_one_line(tmp_path: Path) -> None:
    packed, b, fmt = mx_folder(tmp_path / "q", "quark-e3m2", config=False)
    inputs = open_inputs([tmp_path / "q"])
    assert inputs.tensors == () and len(inputs.errors) == 1
    assert "fit more than one layout (mxfp6-e2m3, mxfp6-e3m2); give --layout" in \
        inputs.errors[0].message
    (ref,) = open_inputs([tmp_path / "q"], layout="mxfp6-e3m2").tensors
    assert same_bits(ref.read(), expect_mx(packed, b, fmt, True), torch.float32) == 0
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "q"), "--out",
                                      str(tmp_path / "out")])
    assert result.exit_code == 2 and "no quantized weights" not in result.output


def test_packed_mx_garbage_is_never_read(tmp_path: Path) -> None:
    """uint8 codes with float scales, rows that are not whole 6-bit groups, and scales that
    do not cover the weight: each one line naming the tensor, exit 2, nothing measured."""
    b = torch.full((4, 2), 127, dtype=torch.uint8)
    cases = {
        "float": ({"m.weight": torch.zeros(4, 32, dtype=torch.uint8),
                   "m.weight_scale": torch.ones(4, 2)}, None),
        "sixes": ({"m.weight": torch.zeros(4, 47, dtype=torch.uint8), "m.weight_scale": b},
                  {"quant_method": "quark", "global_quant_config": {"weight": {
                      "dtype": "fp6_e2m3", "group_size": 32, "scale_format": "e8m0"}}}),
        "cover": ({"m.weight_packed": torch.zeros(4, 48, dtype=torch.uint8),
                   "m.weight_scale": b}, None),
    }
    why = {"float": "not an FP8 dtype", "sixes": "not whole groups of three bytes",
           "cover": "the scales do not cover the weight"}
    for case, (tensors, cfg) in cases.items():
        write(tmp_path / case, tensors, cfg)
        inputs = open_inputs([tmp_path / case])
        assert inputs.tensors == () and len(inputs.errors) == 1, case
        assert why[case] in inputs.errors[0].message, inputs.errors[0].message
        result = CliRunner().invoke(app, ["clip-rate", str(tmp_path / case), "-c",
                                          "mxfp8_e4m3", "--out", str(tmp_path / "o" / case)])
        assert result.exit_code == 2, result.output


# --- configs that follow the weights ----------------------------------------------------------


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt FP8_PC_PT (to_quantized_weight): one float32 scale per output row, stored
    as ``[rows]``."""
    s = (x.abs().amax(-1) / E4M3_MAX).float()
    return (x / s[:, None]).to(torch.float8_e4m3fn), s


def fp8_blocks(x: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt FP8_PB_WO (FP8QTensor.quantize with block_sizes {-1: b, -2: b}): the
    weight padded to whole blocks, scale = amax / 448 per b x b block, stored as
    ``[R, 1, C, 1]``."""
    r, c = x.shape
    gr, gc = -(-r // b), -(-c // b)
    pad = torch.zeros(gr * b, gc * b)
    pad[:r, :c] = x
    s = (pad.reshape(gr, b, gc, b).abs().amax((1, 3)) / E4M3_MAX).float()
    full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:r, :c]
    return (x / full).to(torch.float8_e4m3fn), s.reshape(gr, 1, gc, 1)


def expect_fp8_grid(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
                    out: tuple[int, int, int] = F32) -> list[float]:
    fs = [[Fraction(float(v)) for v in row] for row in s.tolist()]  # a 2-D grid
    want = []
    for i, row in enumerate(q.view(torch.uint8).tolist()):
        for j, c in enumerate(row):
            e = frac_e4m3(c)
            v = math.nan if e is None else round_frac(e * fs[i // block[0]][j // block[1]],
                                                      *out)
            want.append(math.copysign(v, -1) if c & 0x80 and v == 0 else v)
    return want


def test_modelopt_fp8_per_channel_and_2d_blocks(tmp_path: Path) -> None:
    x = sample((200, 300), 3, zero_block=False)
    q, s = fp8_rows(x)
    write(tmp_path / "pc", {"m.weight": q, "m.weight_scale": s, "m.input_scale": torch.ones(())},
          hf_quant={"quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}})
    qb, sb = fp8_blocks(x, 128)
    assert sb.shape == (2, 1, 3, 1)
    write(tmp_path / "pb", {"m.weight": qb, "m.weight_scale": sb},
          hf_quant={"quantization": {"quant_algo": "fp8_pb_wo"}})
    for case, codes, scale, block in (("pc", q, s, (1, 300)), ("pb", qb, sb, (128, 128))):
        inputs = open_inputs([tmp_path / case])
        assert inputs.errors == () and inputs.notices == (), inputs.errors
        (ref,) = inputs.tensors
        spec = spec_of(ref)
        assert spec is not None and spec.block == block
        grid = scale.reshape(-1, 1) if case == "pc" else scale.reshape(2, 3)
        assert same_bits(ref.read(), expect_fp8_grid(codes, grid, block), torch.float32) == 0
        assert same_bits(with_options(ref, "bfloat16").read(),
                         expect_fp8_grid(codes, grid, block, BF16), torch.bfloat16) == 0
        (row,) = inspect([tmp_path / case]).rows
        assert row.error is None and row.block == f"{block[0]}x{block[1]}"


def _nvfp4_tensors() -> dict[str, torch.Tensor]:
    from test_quantized import nvfp4
    p, ws, gs = nvfp4(sample((4, 64), 9, zero_block=False), False)
    return {"m.weight": p, "m.weight_scale": ws, "m.weight_scale_2": gs}


def _mxfp8_tensors() -> dict[str, torch.Tensor]:
    from test_quantized import mxfp8
    q, b = mxfp8(sample((4, 64), 9, zero_block=False))
    return {"m.weight": q, "m.weight_scale": b}


def test_configs_drift_knows_are_read_and_others_are_a_notice(tmp_path: Path) -> None:
    x = sample((8, 64), 4, zero_block=False)
    q, s = fp8_rows(x)
    mx = {n: t for n, t in zip(("m.weight", "m.weight_scale"),
                               mx_folder(tmp_path / "tmp", "modelopt")[:2], strict=True)}
    folders = {  # every quant_algo / quant_method of the issue, as its writer names it
        "W4A16_NVFP4": (_nvfp4_tensors(), None, {"quant_algo": "W4A16_NVFP4",
                                                  "group_size": 16}),
        "MXFP8": (_mxfp8_tensors(), None, {"quant_algo": "MXFP8", "group_size": 32}),
        "MXFP4": (mx, None, {"quant_algo": "MXFP4", "group_size": 32}),
        "FP8_PER_CHANNEL_PER_TOKEN": ({"m.weight": q, "m.weight_scale": s}, None,
                                      {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}),
        "quark": ({"m.weight": q, "m.weight_scale": s.amax().reshape(())},
                  {"quant_method": "quark", "global_quant_config": {"weight": {
                      "dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}}},
                  None),
        "modelopt-in-config": (_nvfp4_tensors(), {"quant_method": "modelopt",
                                                  "quant_algo": "NVFP4"}, None),
    }
    for case, (tensors, cfg, algo) in folders.items():
        write(tmp_path / case, tensors, cfg, None if algo is None else {"quantization": algo})
        inputs = open_inputs([tmp_path / case])
        assert inputs.errors == () and inputs.notices == (), (case, inputs.errors)
        assert [t.name for t in inputs.tensors] == ["m.weight"], case
        assert spec_of(inputs.tensors[0]) is not None
        found = inspect([tmp_path / case])  # drift inspect on each fixture
        assert found.errors == () and [r.error for r in found.rows] == [None], case
    # a quant_algo drift does not know: one notice; the weights it recognises are read
    write(tmp_path / "unknown", _mxfp8_tensors(), None,
          {"quantization": {"quant_algo": "W4A8_FUTURE"}})
    inputs = open_inputs([tmp_path / "unknown"])
    assert inputs.errors == () and [t.name for t in inputs.tensors] == ["m.weight"]
    (notice,) = inputs.notices
    assert "quant_algo 'W4A8_FUTURE' is not one drift knows" in notice
    result = CliRunner().invoke(app, ["clip-rate", str(tmp_path / "unknown"), "-c",
                                      "mxfp8_e4m3", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0 and "notice: " in result.output, result.output


def test_fp8_block_size_comes_from_the_config(tmp_path: Path) -> None:
    """transformers' fine-grained FP8 with ``weight_block_size: [1, 32]`` and ue8m0
    scales, as float32 powers of two and as E8M0 bytes, under ``weight_scale_inv``."""
    from test_quantized import mxfp8
    q, b = mxfp8(sample((8, 96), 6, zero_block=False))
    floats = torch.pow(2.0, b.float() - 127)
    cfg = {"quant_method": "fp8", "weight_block_size": [1, 32], "scale_fmt": "ue8m0"}
    for case, scale in (("float", floats), ("bytes", b)):
        write(tmp_path / case, {"m.weight": q, "m.weight_scale_inv": scale}, cfg)
        inputs = open_inputs([tmp_path / case])
        assert inputs.errors == (), inputs.errors
        (ref,) = inputs.tensors
        spec = spec_of(ref)
        assert spec is not None and spec.block == (1, 32) and str(spec.layout) == "deepseek-fp8"
        assert same_bits(ref.read(), expect_fp8_grid(q, floats, (1, 32)), torch.float32) == 0
    # --layout overrides the config, and works
    (ref,) = open_inputs([tmp_path / "bytes"], layout="mxfp8").tensors
    assert same_bits(ref.read(), expect_fp8_grid(q, floats, (1, 32)), torch.float32) == 0


def test_dequantize_keeps_tensors_of_every_rank(tmp_path: Path) -> None:
    q, s = fp8_rows(sample((4, 32), 7, zero_block=False))
    others = {"zero_d": torch.tensor(0.7), "one_d": torch.arange(3.0),
              "three_d": torch.ones(2, 1, 3, dtype=torch.bfloat16), "empty": torch.zeros(0, 4)}
    write(tmp_path / "ck", {"m.weight": q, "m.weight_scale": s.reshape(4, 1), **others},
          {"quant_method": "compressed-tensors", "format": "float-quantized"})
    done = dequantize([tmp_path / "ck"], tmp_path / "out.safetensors")
    assert done.weights == 1 and done.copied == 4
    from safetensors.torch import load_file
    back = load_file(tmp_path / "out.safetensors")
    for name, t in others.items():
        assert back[name].shape == t.shape and torch.equal(back[name], t), name
    assert same_bits(back["m.weight"], expect_fp8_grid(q, s.reshape(4, 1), (1, 32)),
                     torch.float32) == 0


# --- each library's decoding order, bit for bit -----------------------------------------------

E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def every_e4m3_scale_block(gs: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An NVFP4 weight whose rows are the 16 E2M1 codes in order, one row per positive
    finite E4M3 block scale (126 of them, 1/8 ... 448)."""
    codes = torch.arange(16).repeat(126, 1)
    ws = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(126, 1)
    del gs
    return pack_nibbles(codes), ws


def ct_nvfp4_decode(packed: torch.Tensor, ws: torch.Tensor, gs: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors NVFP4PackedCompressor.decompress: unpack_fp4_from_uint8 to
    bfloat16 (-0 kept: the magnitude times -1.0), the scale cast to it, ``_dequantize``:
    scale / global_scale (float32), x_q.to(scale.dtype) * scale, then .to(dtype)."""
    c = torch.stack((packed & 15, packed >> 4), -1).reshape(packed.shape[0], -1).long()
    x_q = (E2M1_TABLE[c & 7] * torch.where(c >= 8, -1.0, 1.0)).to(torch.bfloat16)
    scale = ws.to(torch.bfloat16) / gs
    return (x_q.to(scale.dtype) * scale.repeat_interleave(16, -1)).to(dtype)


def modelopt_nvfp4_decode(packed: torch.Tensor, ws: torch.Tensor, gs: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """ModelOpt NVFP4QTensor.dequantize (eager): ws.to(float32) * weights_scaling_factor_2,
    the codes through e2m1_values (whose entry for the -0 code is +0), the product, then
    .to(dtype)."""
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    c = torch.stack((packed & 15, packed >> 4), -1).reshape(packed.shape[0], -1).long()
    per_block = ws.to(torch.float32) * gs
    return (table[c] * per_block.repeat_interleave(16, -1)).to(dtype)


@pytest.mark.parametrize("lib", ["compressed-tensors", "modelopt"])
def test_library_order_nvfp4_bit_for_bit(tmp_path: Path, lib: str) -> None:
    compared = differing = apart = 0
    for k, gs_value in enumerate(torch.rand(6, generator=torch.Generator().manual_seed(3))):
        gs = (gs_value * 3000 + 1).float().reshape(1 if lib != "modelopt" else ())
        packed, ws = every_e4m3_scale_block(float(gs.reshape(-1)[0]))
        if lib == "modelopt":
            tensors = {"m.weight": packed, "m.weight_scale": ws, "m.weight_scale_2": gs}
            write(tmp_path / f"{k}", tensors, None, {"quantization": {"quant_algo": "NVFP4"}})
        else:
            tensors = {"m.weight_packed": packed, "m.weight_scale": ws, "m.weight_global_scale": gs}
            write(tmp_path / f"{k}", tensors, {"quant_method": "compressed-tensors",
                                               "format": "nvfp4-pack-quantized"})
        (ref,) = open_inputs([tmp_path / f"{k}"]).tensors
        decode = ct_nvfp4_decode if lib != "modelopt" else modelopt_nvfp4_decode
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            got = with_options(ref, name, Order.LIBRARY).read()
            want = decode(packed, ws, gs, dtype)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            compared += got.numel()
            differing += int((got.view(bits) != want.view(bits)).sum())
            exact = with_options(ref, name).read()
            apart += int((exact.view(bits) != want.view(bits)).sum())
    assert compared == 6 * 2 * 126 * 16 and differing == 0
    # the orders really part: compressed-tensors in bfloat16 (the float32 product rounded
    # again), ModelOpt also on every -0 code (126 blocks x 1 code x 6 x 2 dtypes = 1,512)
    # (docs/dequantize.md quotes these counts)
    assert apart == {"compressed-tensors": 1146, "modelopt": 2610}[lib], apart
    print(f"\n{lib} NVFP4 library order: {compared} elements, {differing} differ; "
          f"{apart} differ from the exact order")


@pytest.mark.parametrize("lib", ["compressed-tensors", "modelopt", "deepseek"])
def test_library_order_fp8_bit_for_bit(tmp_path: Path, lib: str) -> None:
    """compressed-tensors ``_dequantize``: x_q.to(scale.dtype) * scale (float32), then
    .to(dtype); ModelOpt FP8QTensor.dequantize: quantized_data.to(dtype) *
    scales.to(dtype); DeepSeek weight_dequant: x.to(float32) * s, stored in the output
    dtype. Every E4M3 code (NaN's aside) against 256 float32 scales of full mantissa."""
    g = torch.Generator().manual_seed(5)
    s = (torch.rand(256, 1, generator=g) * 0.01 + 1e-4).float()
    codes = torch.arange(256, dtype=torch.int64).repeat(256, 1)
    codes[(codes & 0x7F) == 0x7F] = 0
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    if lib == "deepseek":
        tensors = {"m.weight": q, "m.weight_scale_inv": s}
        write(tmp_path / lib, tensors, {"quant_method": "fp8", "weight_block_size": [1, 256]})
    elif lib == "modelopt":
        write(tmp_path / lib, {"m.weight": q, "m.weight_scale": s.reshape(256)}, None,
              {"quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}})
    else:
        write(tmp_path / lib, {"m.weight": q, "m.weight_scale": s},
              {"quant_method": "compressed-tensors", "format": "float-quantized"})
    (ref,) = open_inputs([tmp_path / lib]).tensors
    got = with_options(ref, "bfloat16", Order.LIBRARY).read()
    if lib == "modelopt":
        want = q.to(torch.bfloat16) * s.to(torch.bfloat16)
    else:
        want = (q.to(torch.float32) * s).to(torch.bfloat16)
    assert got.numel() == 65536 and int((got.view(torch.int16) != want.view(torch.int16))
                                        .sum()) == 0
    exact = with_options(ref, "bfloat16").read()
    apart = int((exact.view(torch.int16) != want.view(torch.int16)).sum())
    # ModelOpt's bfloat16 scale moves most elements off the exact product; the float32
    # product rounded again to bfloat16 (compressed-tensors, DeepSeek) rarely does: a code
    # has at most 4 significant bits, so few products land next to a bfloat16 tie
    assert apart == (16884 if lib == "modelopt" else 0), apart  # docs/dequantize.md
    f32 = with_options(ref, "float32", Order.LIBRARY).read()
    want32 = q.to(torch.float32) * s  # every library: one float32 rounding
    assert int((f32.view(torch.int32) != want32.view(torch.int32)).sum()) == 0
    print(f"\n{lib} FP8 library order, bfloat16: 65536 elements, 0 differ; {apart} differ "
          "from the exact order")


# --- torchao's own layouts ---------------------------------------------------------------------


def torchao_file(path: Path, kind: str) -> None:
    """What torchao's flatten_tensor_state_dict + safetensors save_file write for a state
    dict holding one ``kind`` weight and a plain bias: the parts as ``0._weight_<name>``,
    the subclass's JSON under ``0.weight`` in the metadata, and ``tensor_names``."""
    if kind == "MXTensor":
        parts = {"qdata": torch.zeros(4, 64, dtype=torch.float8_e4m3fn),
                 "scale": torch.full((4, 2), 127, dtype=torch.uint8)}
        data = {"elem_dtype": {"_type": "torch.dtype", "_data": "float8_e4m3fn"},
                "block_size": 32, "is_swizzled_scales": False}
    else:
        parts = {"qdata": torch.zeros(128, 32, dtype=torch.uint8),
                 "scale": torch.ones(128, 4).to(torch.float8_e4m3fn),
                 "per_tensor_scale": torch.ones(())}
        data = {"block_size": 16, "is_swizzled_scales": True}
    tensors = {f"0._weight_{k}": v for k, v in parts.items()}
    tensors["0.bias"] = torch.ones(4)
    meta = {"0.weight": json.dumps({"_type": kind, "_data": data,
                                    "_tensor_data_names": list(parts)}),
            "0.bias": json.dumps({"_type": "Tensor"}),
            "tensor_names": json.dumps(["0.weight", "0.bias"])}
    save_file(tensors, path, metadata=meta)


@pytest.mark.parametrize("kind", ["MXTensor", "NVFP4Tensor"])
def test_torchao_safetensors_are_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ao.safetensors"
    torchao_file(path, kind)
    inputs = open_inputs([path])
    assert [t.name for t in inputs.tensors] == ["0.bias"]  # the parts are never weights
    (err,) = inputs.errors
    assert err.tensor == "0.weight" and f"is a torchao {kind} flattened by torchao's " \
        "flatten_tensor_state_dict (" in err.message
    assert "0._weight_qdata" in err.message and "0._weight_scale" in err.message
    assert ("swizzled scales" in err.message) == (kind == "NVFP4Tensor")
    for cmd in (["clip-rate", str(path), "-c", "mxfp8_e4m3"], ["inspect", str(path)]):
        result = CliRunner().invoke(app, [*cmd, "--out", str(tmp_path / cmd[0])])
        assert result.exit_code == 2 and "no quantized weights" not in result.output, \
            result.output
    with pytest.raises(Exception, match="torchao"):
        dequantize([path], tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    inputs = open_inputs([path], exclude=["0.weight"])  # --exclude leaves the rest clean
    assert inputs.errors == () and [t.name for t in inputs.tensors] == ["0.bias"]


def test_torchao_earlier_naming_is_refused_too(tmp_path: Path) -> None:
    # torchao's earlier flatten_tensor_state_dict named the parts "0.weight:qdata" and a plain
    # tensor "0.bias:_data": its codes and scale bytes were listed as weights and measured
    tensors = {"0.weight:qdata": torch.zeros(4, 64, dtype=torch.float8_e4m3fn),
               "0.weight:scale": torch.full((4, 2), 127, dtype=torch.uint8),
               "0.bias:_data": torch.ones(4)}
    meta = {"0.weight": json.dumps({"_type": "MXTensor", "_data": {"block_size": 32}}),
            "0.bias": json.dumps({"_type": "Tensor"}),
            "tensor_names": json.dumps(["0.weight", "0.bias"])}
    save_file(tensors, tmp_path / "ao.safetensors", metadata=meta)
    inputs = open_inputs([tmp_path / "ao.safetensors"])
    assert [t.name for t in inputs.tensors] == ["0.bias:_data"]
    (err,) = inputs.errors
    assert err.tensor == "0.weight" and "(0.weight:qdata, 0.weight:scale)" in err.message


def test_torch_save_of_torchao_tensors_advises_dequantizing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types
    name = "torchao.prototype.mx_formats.mx_tensor"
    module = types.ModuleType(name)

    class MXTensor:  # pickles by reference to torchao's class, as the real one does
        pass

    MXTensor.__module__, MXTensor.__qualname__ = name, "MXTensor"
    module.MXTensor = MXTensor  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    torch.save({"0.weight": MXTensor()}, tmp_path / "ao.pt")
    # once torchao is imported, its classes are torch's safe globals and torch.load builds
    # them: the refusal must not depend on that (the same file, allowed and not)
    for allowed in ([], [MXTensor]):
        with torch.serialization.safe_globals(allowed):
            (err,) = open_inputs([tmp_path / "ao.pt"]).errors
        assert f"(it holds {name}.MXTensor)" in err.message
        assert "torchao quantized tensors; save them dequantized" in err.message
        assert "torch.save(model.state_dict()" not in err.message  # what made the file


# --- which scale rule wrote a checkpoint; --requant as the writer computed --------------------


def mxfp8_by_rule(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 E4M3 with each block's exponent chosen by ``rule``: ``floor`` (OCP),
    ``ceil`` (2**ceil(log2(amax / 448)), NVIDIA's), ``ct`` (compressed-tensors)."""
    amax = x.reshape(*x.shape[:-1], -1, 32).abs().amax(-1).float()
    if rule == "ceil":
        e = torch.ceil(torch.log2(amax / E4M3_MAX))
        b = (e + 127).to(torch.uint8)
    else:
        b = e8m0_bytes(x, rule, 8)
    s = torch.pow(2.0, b.double() - 127).repeat_interleave(32, -1)
    return (x.double() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), b


def test_inspect_names_the_scale_rule(tmp_path: Path) -> None:
    x = sample((64, 256), 11, zero_block=False)
    rules: dict[str, list[str]] = {}
    for rule in ("floor", "ceil", "ct"):
        q, b = mxfp8_by_rule(x, rule)
        write(tmp_path / rule, {"m.weight": q, "m.weight_scale": b})
        (row,) = inspect([tmp_path / rule]).rows
        rules[rule] = (row.scale_rules or "").split(", ")
    assert "floor" in rules["floor"] and "floor" not in rules["ceil"]
    assert "ceil" in rules["ceil"] and "even-e2m1" in rules["ct"]
    # E4M3 codes cannot tell ceil from even-e2m1 (both leave largest codes 224 to 448)
    assert "even-e2m1" in rules["ceil"] and "ceil" in rules["ct"]
    print(f"\nscale rules consistent with MXFP8 written by each rule: {rules}")
    # each MX writer of this file: its own rule among those named
    for lib, named in (("compressed-tensors", "even-e2m1"), ("modelopt", "ceil"),
                       ("quark", "floor")):
        mx_folder(tmp_path / lib, lib, (16, 256), seed=12)
        (row,) = inspect([tmp_path / lib]).rows
        assert named in (row.scale_rules or "").split(", "), (lib, row.scale_rules)
    # a planted fault: a block whose largest code is a quarter of what any rule leaves
    q, b = mxfp8_by_rule(x, "floor")
    bad = q.float()
    bad[0, :32] = bad[0, :32] / 8
    write(tmp_path / "bad", {"m.weight": bad.to(torch.float8_e4m3fn), "m.weight_scale": b})
    (row,) = inspect([tmp_path / "bad"]).rows
    assert row.scale_rules == "none"


@pytest.mark.parametrize("divisor", [True, False], ids=["compressed-tensors", "modelopt"])
def test_requant_nvfp4_compares_block_scales_as_written(tmp_path: Path, divisor: bool) -> None:
    """Each library's NVFP4 (test_quantized.nvfp4 writes both conventions): requantized
    with nvfp4, no block scale and no code changes; the recomputed tensor scale, a float32
    step off the stored one, is not a changed block."""
    from test_quantized import nvfp4
    x = sample((64, 256), 13, zero_block=False) * 0.02
    packed, ws, gs = nvfp4(x, divisor)
    names = ("m.weight_packed", "m.weight_scale", "m.weight_global_scale") if divisor else \
        ("m.weight", "m.weight_scale", "m.weight_scale_2")
    write(tmp_path, dict(zip(names, (packed, ws, gs), strict=True)))
    rows = inspect([tmp_path], requant=["nvfp4"]).rows
    (row,) = rows
    assert (row.requant_changed_blocks, row.requant_changed_codes) == (0, 0), row
    assert row.n_blocks == 1024


MXFP8_WRITERS = {
    # library: (its rule in mxfp8_by_rule, its preset for --requant, config.json, hf_quant)
    "compressed-tensors": ("ct", "float8_e4m3fn:block32:even-e2m1", {
        "quant_method": "compressed-tensors", "format": "mxfp8-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "group", "group_size": 32,
            "symmetric": True, "scale_dtype": "torch.uint8"}}}}, None),
    "modelopt": ("ceil", "mxfp8_e4m3_ceil", None, {
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "MXFP8", "group_size": 32}}),
}
"""Each library's MXFP8 as it writes it: compressed-tensors MXFP8QuantizationCompressor
(generate_mx_scales, E4M3 codes in ``weight``), ModelOpt MXFP8QTensor (its float32
``ceil(log2(amax / 448))``)."""


@pytest.mark.parametrize("lib", list(MXFP8_WRITERS))
def test_requant_mxfp8_of_each_library_under_its_own_rule(tmp_path: Path, lib: str) -> None:
    """--requant with the library's rule: 0 changed blocks, codes and values, though the round
    trip moves scales (the rule, run on the dequantized weight, is not idempotent); OCP's
    floor changes blocks; a block whose scale was doubled and codes halved (the same values,
    a scale the rule picks for no amax its codes allow) is 1 changed block."""
    rule, preset, cfg, hf = MXFP8_WRITERS[lib]
    other = "mxfp8_e4m3"
    x = sample((64, 256), 14, zero_block=False)
    q, b = mxfp8_by_rule(x, rule)
    write(tmp_path / "ok", {"m.weight": q, "m.weight_scale": b}, cfg, hf)
    rows = {r.requant: r for r in inspect([tmp_path / "ok"], requant=[preset, other]).rows}
    own = rows[preset]
    assert own.layout == "mxfp8" and own.n_blocks == 512
    assert (own.requant_changed_blocks, own.requant_changed_codes,
            own.requant_changed_values) == (0, 0, 0)
    # docs/inspect.md: the round trip rescales some, floor would not have written 76
    assert own.requant_rescaled_blocks == {"compressed-tensors": 25, "modelopt": 28}[lib]
    assert rows[other].requant_changed_blocks == 76
    assert rule.replace("ct", "even-e2m1") in (own.scale_rules or "").split(", ")
    print(f"\n{lib} MXFP8: --requant {preset}: 0 changed of 512 blocks "
          f"({own.requant_rescaled_blocks} rescaled by the round trip); {other}: "
          f"{rows[other].requant_changed_blocks} changed; scale_rules {own.scale_rules}")
    # the planted fault: block 0 at twice its scale, its codes halved (values kept)
    bad_q = q.float()
    bad_q[0, :32] /= 2
    bad_b = b.clone()
    bad_b[0, 0] += 1
    write(tmp_path / "bad", {"m.weight": bad_q.to(torch.float8_e4m3fn),
                             "m.weight_scale": bad_b}, cfg, hf)
    (row,) = inspect([tmp_path / "bad"], requant=[preset]).rows
    assert row.requant_changed_blocks == 1
    assert row.requant_changed_codes is not None and 0 < row.requant_changed_codes <= 32


def test_each_librarys_mxfp8_is_a_drift_cast(tmp_path: Path) -> None:
    """compressed-tensors' MXFP8 is drift's even-e2m1 cast, ModelOpt's is ceil in its float32
    log2 order, bit for bit (scale bytes and codes), on a block of amax 448 * 2**-3 (where
    ceil and even-e2m1 part) and one just above 448 * 2**-10 (where float32 log2 rounds onto
    -10: exact ceil goes a binade up, ModelOpt does not and clips the largest element); that
    checkpoint still requantizes with 0 changed blocks under exact ceil."""
    from driftcli.casts.quantization import QuantInfo, quantize
    x = sample((8, 256), 15, zero_block=False)
    x[0:2, :32] *= 1e-6
    x[0, 0] = 448.0 * 2**-3
    x[1, 0] = float(torch.nextafter(torch.tensor(448.0 * 2**-10), torch.tensor(1.0)))
    modelopt = "float8_e4m3fn:block32:ceil:amax=ieee,pow2=log2,apply=mul"
    apart = {}
    for spec, rule in (("float8_e4m3fn:block32:even-e2m1", "ct"), (modelopt, "ceil"),
                       ("mxfp8_e4m3_ceil", "ceil"), ("float8_e4m3fn:block32:ceil", "ct")):
        info = quantize(x, spec, return_info=True)
        assert isinstance(info, QuantInfo) and info.codes is not None
        q, b = mxfp8_by_rule(x, rule)
        mine = (torch.log2(info.scales.reshape(b.shape).double()) + 127).to(torch.uint8)
        apart[spec, rule] = (mine != b).nonzero().tolist()
    assert apart[("float8_e4m3fn:block32:even-e2m1", "ct")] == apart[(modelopt, "ceil")] == []
    assert apart[("mxfp8_e4m3_ceil", "ceil")] == [[1, 0]]  # the log2 block
    assert apart[("float8_e4m3fn:block32:ceil", "ct")] == [[0, 0]]  # amax 448 * 2**-3
    q, b = mxfp8_by_rule(x, "ceil")
    write(tmp_path, {"m.weight": q, "m.weight_scale": b}, *MXFP8_WRITERS["modelopt"][2:])
    (row,) = inspect([tmp_path], requant=["mxfp8_e4m3_ceil"]).rows
    block_max = q.float().abs().reshape(8, 8, 32).amax(-1)
    flips = int(((block_max <= 224) & (block_max > 0)).sum())  # ceil's round trip halves these
    assert (row.requant_changed_blocks, row.requant_rescaled_blocks) == (0, flips)
    assert float(block_max[1, 0]) == E4M3_MAX  # the log2 block: saturated, not rescaled


def test_a_tie_belongs_to_the_even_code(tmp_path: Path) -> None:
    """A block whose largest E4M3 code is 240 (odd) held an amax in (232, 248): 248, the tie
    with 256, rounds to 256, and only there does even (248 rounded to 3 mantissa bits is 256)
    pick this scale, so even is not named; a closed span would name it. At 256 (even code)
    the span [248, 272] holds the tie, and even is named."""
    for top, want in ((240.0, "ceil, ceil-amax, even-e2m1"),
                      (256.0, "floor, ceil, even, ceil-amax, even-e2m1")):
        q = torch.full((4, 64), 3.0)
        q[:, 5::32] = top
        write(tmp_path / str(top), {"m.weight": q.to(torch.float8_e4m3fn),
                                    "m.weight_scale": torch.full((4, 2), 127, dtype=torch.uint8)})
        (row,) = inspect([tmp_path / str(top)]).rows
        assert row.scale_rules == want, (top, row.scale_rules)


# --- packed MX weights of no elements ---------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 16), (4, 0)])
def test_packed_mx_weight_of_no_elements_is_a_row(tmp_path: Path,
                                                  shape: tuple[int, int]) -> None:
    # unpacking inferred the last dim (-1) and the block maxima the block count: a weight of
    # no rows or no columns crashed inspect, clip-rate and dequantize (exit 3)
    ck = tmp_path / "ck"
    ck.mkdir()
    rows, packed = shape
    save_file({"l.weight_packed": torch.zeros(rows, packed, dtype=torch.uint8),
               "l.weight_scale": torch.zeros(rows, -(-2 * packed // 32), dtype=torch.uint8)},
              ck / "model.safetensors")
    (ck / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}))
    for cmd in (["inspect"], ["clip-rate", "-c", "mxfp8_e4m3"]):
        result = CliRunner().invoke(app, [*cmd, str(ck), "--out", str(tmp_path / cmd[0])])
        assert result.exit_code == 0, result.output
    # --requant crashed on them too (a block count of 0 divided by, a reshape of -1)
    found = inspect([ck], requant=["mxfp4_e2m1", "mxfp8_e4m3"]).rows
    assert [(r.requant_changed_values, r.requant_changed_codes, r.requant_changed_blocks)
            for r in found] == [(0, 0, 0), (0, None, 0)]
    out = tmp_path / "out.safetensors"
    dequantize([ck], out)
    assert open_inputs([out]).tensors[0].shape == (rows, 2 * packed)
    sixes = torch.zeros(0, 6, dtype=torch.uint8)
    assert tuple(unpack_sixes(sixes).shape) == (0, 8)


def test_a_group_size_wider_than_the_weight_is_its_rows_in_inspect(tmp_path: Path) -> None:
    # the scale rules padded each row to the config's group size: 2**40 asked for 32 TiB and
    # crashed inspect (exit 3); a block wider than a row of 32 is that row, as a block of 32
    rows = []
    for group in (32, 2**40):
        ck = tmp_path / str(group)
        ck.mkdir()
        codes = torch.arange(64, dtype=torch.uint8).reshape(4, 16) * 3
        save_file({"l.weight_packed": codes,
                   "l.weight_scale": torch.tensor([[120], [127], [127], [130]],
                                                  dtype=torch.uint8)},
                  ck / "model.safetensors")
        (ck / "config.json").write_text(json.dumps({"quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float",
                                                "group_size": group}}}}}))
        (row,) = inspect([ck]).rows
        assert row.error is None
        rows.append(row)
    assert rows[1].scale_rules == rows[0].scale_rules is not None
    assert rows[1].zero_blocks == rows[0].zero_blocks
