"""Pre-quantized checkpoints: each layout written here by an encoder that follows the
layout's published description (not drift's decoder), read back through drift's readers
and checked, element by element, against the exact product computed with Fractions and
rounded once to the output dtype."""

from __future__ import annotations

import importlib.util
import json
import math
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.readers import ReadError, open_inputs
from driftcli.io.readers.quantized_weight import Order, spec_of, with_options
from driftcli.measures.inspect import InspectRow, inspect

E4M3_MAX = 448.0
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

# --- exact reference: codes and scales as Fractions, one rounding ---------------------------


def frac_e4m3(c: int) -> Fraction | None:
    """OCP FP8 E4M3 (fn): bias 7, subnormals, S.1111.111 NaN, no infinity."""
    sign = -1 if c & 0x80 else 1
    e, m = (c >> 3) & 0xF, c & 7
    if e == 15 and m == 7:
        return None
    mag = Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * \
        Fraction(2) ** (e - 7)
    return sign * mag


def frac_e2m1(c: int) -> Fraction:
    """OCP FP4 E2M1: bias 1, one subnormal (0.5), no NaN."""
    sign = -1 if c & 8 else 1
    e, m = (c >> 1) & 3, c & 1
    mag = Fraction(m, 2) if e == 0 else (1 + Fraction(m, 2)) * Fraction(2) ** (e - 1)
    return sign * mag


def frac_e8m0(b: int) -> Fraction | None:
    return None if b == 255 else Fraction(2) ** (b - 127)


def round_frac(q: Fraction, mbits: int, emin: int, emax: int) -> float:
    """``q`` rounded to nearest even on a binary grid of ``mbits`` fraction bits with
    normal exponents ``emin..emax`` (subnormals below), overflowing to infinity."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, emin)
    ulp = Fraction(2) ** (e - mbits)
    n = a / ulp
    r = math.floor(n)
    rest = n - r
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and r % 2 == 1):
        r += 1
    value = r * ulp
    if value >= Fraction(2) ** (emax + 1):
        return sign * math.inf
    return sign * float(value)


F32 = (23, -126, 127)
BF16 = (7, -126, 127)


def same_bits(got: torch.Tensor, want: list[float], dtype: torch.dtype) -> int:
    """How many elements of ``got`` differ in bits from ``want`` (NaN matches NaN)."""
    exp = torch.tensor(want, dtype=torch.float64).to(dtype)
    g = got.reshape(-1)
    both_nan = g.isnan() & exp.isnan()
    int_t = torch.int32 if dtype == torch.float32 else torch.int16
    return int(((g.view(int_t) != exp.view(int_t)) & ~both_nan).sum())


# --- encoders from the layouts' descriptions -------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sample(shape: tuple[int, ...], seed: int, zero_block: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)
    if zero_block:
        x[..., :16, :32] = 0  # an all-zero block for every block shape used here
    return x


def deepseek_fp8(x: torch.Tensor, block: int = 128,
                 ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 weight_quant: per block, s = amax / 448, codes = fp8(x / s); ue8m0
    rounds s up to a power of two (V3.1). An all-zero block gets s = 1."""
    r, c = x.shape
    s = torch.ones(_cdiv(r, block), _cdiv(c, block))
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = x[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = float(blk.abs().max())
            if amax > 0:
                sv = torch.tensor(amax, dtype=torch.float32) / E4M3_MAX
                if ue8m0:
                    sv = torch.tensor(2.0 ** math.ceil(math.log2(float(sv))))
                s[i, j] = sv
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
                (blk / s[i, j]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def mx_scales(x: torch.Tensor, emax: int) -> torch.Tensor:
    """OCP MX v1.0: per 32 elements of a row, shared exponent floor(log2(amax)) - emax of
    the element format, stored biased by 127 (a zero block: 127)."""
    *lead, c = x.shape
    g = _cdiv(c, 32)
    pad = torch.zeros(*lead, g * 32)
    pad[..., :c] = x
    amax = pad.reshape(*lead, g, 32).abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - emax, torch.zeros_like(amax))
    return (exp + 127).to(torch.uint8)


def mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = mx_scales(x, 8)
    s = torch.pow(2.0, b.float() - 127).repeat_interleave(32, -1)[..., :x.shape[-1]]
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), b


def fp4_codes(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (sign in bit 3, index into 0, .5, 1, 1.5, 2, 3, 4, 6), saturating."""
    table = torch.tensor(FP4_VALUES)
    idx = (v.abs().unsqueeze(-1) - table).abs().argmin(-1)
    return idx + (v < 0).to(torch.int64) * 8


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Element 2i in the low nibble of byte i, element 2i+1 in the high nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def nvfp4(x: torch.Tensor, divisor: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 per 16: a float32 global scale (compressed-tensors: 448 * 6 / amax, divided by;
    ModelOpt: amax / (448 * 6), multiplied by), E4M3 block scales of amax_block / 6 in the
    global scale's units, elements of x over the combined scale."""
    r, c = x.shape
    amax = float(x.abs().max())
    gs = torch.tensor(E4M3_MAX * 6 / amax if divisor else amax / (E4M3_MAX * 6),
                      dtype=torch.float32)
    bam = x.reshape(r, c // 16, 16).abs().amax(-1) / 6
    ws = (bam * gs if divisor else bam / gs).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    wsf = ws.float()
    combined = (wsf / gs if divisor else wsf * gs).repeat_interleave(16, -1)
    v = torch.where(combined > 0, x / combined, torch.zeros_like(x))
    return pack(fp4_codes(v)), ws, gs.reshape(1) if divisor else gs.reshape(())


def gpt_oss(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss MXFP4: E8M0 scales per 32 (emax 2), nibbles low-first, blocks [..., G, 16]."""
    b = mx_scales(x, 2)
    s = torch.pow(2.0, b.float() - 127).repeat_interleave(32, -1)
    codes = fp4_codes(x / s)
    packed = pack(codes)
    return packed.reshape(*x.shape[:-1], x.shape[-1] // 32, 16), b


def write(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None = None,
          hf_quant: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    if config is not None:
        (folder / "config.json").write_text(json.dumps({"quantization_config": config}))
    if hf_quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return folder


# --- expected values ---------------------------------------------------------------------------


def expect_fp8(q: torch.Tensor, s: list[list[Fraction | None]], block: tuple[int, int],
               fmt: tuple[int, int, int] = F32) -> list[float]:
    r, c = q.shape
    codes = q.view(torch.uint8).tolist()
    out = []
    seen: dict[tuple[int, Fraction | None], float] = {}  # each (code, scale) pair once
    for i in range(r):
        for j in range(c):
            code, sc = codes[i][j], s[i // block[0]][j // block[1]]
            if (code, sc) not in seen:
                e = frac_e4m3(code)
                v = math.nan if e is None or sc is None else round_frac(e * sc, *fmt)
                seen[code, sc] = math.copysign(v, -1) if code & 0x80 and v == 0 else v
            out.append(seen[code, sc])
    return out


def expect_fp4(packed: torch.Tensor, block_scale: list[list[Fraction | None]],
               glob: Fraction | None, divide: bool, fmt: tuple[int, int, int] = F32,
               block: int = 16) -> list[float]:
    rows = packed.reshape(-1, packed.shape[-1]).tolist()
    out = []
    for i, row in enumerate(rows):
        codes = [n for b in row for n in (b & 15, b >> 4)]
        for j, c in enumerate(codes):
            sc = block_scale[i][j // block]
            if sc is None:
                out.append(math.nan)
                continue
            v = frac_e2m1(c) * sc
            if glob is not None:
                v = v / glob if divide else v * glob
            r = round_frac(v, *fmt)
            out.append(math.copysign(r, -1) if c & 8 and r == 0 else r)
    return out


def listed(folder: Path, **kw: object) -> dict[str, torch.Tensor]:
    inputs = open_inputs([folder], **kw)  # type: ignore[arg-type]
    assert not inputs.errors, inputs.errors
    return {t.name: t for t in inputs.tensors}


# --- (1) exact dequantization of each layout ---------------------------------------------------


@pytest.mark.parametrize("shape", [(200, 300), (130, 257), (128, 128)])
def test_deepseek_fp8_exact(tmp_path: Path, shape: tuple[int, int]) -> None:
    x = sample(shape, 1)
    x[150 % shape[0], 7] = 1e6  # a block whose max is far from the rest: codes at 448
    q, s = deepseek_fp8(x)
    folder = write(tmp_path / "ds", {"model.layers.0.mlp.down_proj.weight": q,
                                     "model.layers.0.mlp.down_proj.weight_scale_inv": s,
                                     "model.norm.weight": torch.ones(8)},
                   {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"})
    refs = listed(folder)
    assert sorted(refs) == ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    ref = refs["model.layers.0.mlp.down_proj.weight"]
    assert ref.shape == shape and ref.dtype == "float32"
    got = ref.read()
    fs = [[Fraction(float(v)) for v in row] for row in s.tolist()]
    assert same_bits(got, expect_fp8(q, fs, (128, 128)), torch.float32) == 0
    assert int((q.view(torch.uint8) & 0x7F == 0x7E).sum()) >= 1  # a code at the max, 448
    # rows read in pieces that start and stop inside a block equal the whole
    assert torch.equal(ref.read(100, 170), got[100:170])
    bf = with_options(ref, "bfloat16").read()
    assert same_bits(bf, expect_fp8(q, fs, (128, 128), BF16), torch.bfloat16) == 0


def test_deepseek_ue8m0_and_e8m0_bytes(tmp_path: Path) -> None:
    x = sample((200, 300), 2)
    q, s = deepseek_fp8(x, ue8m0=True)
    assert all(math.log2(v).is_integer() for v in s.reshape(-1).tolist())
    byte = (torch.log2(s) + 127).to(torch.uint8)  # V4: the same scales as E8M0 bytes
    f1 = write(tmp_path / "v31", {"a.weight": q, "a.weight_scale_inv": s},
               {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"})
    f2 = write(tmp_path / "v4", {"a.weight": q, "a.weight_scale_inv": byte})  # by names
    a, b = listed(f1)["a.weight"], listed(f2)["a.weight"]
    spec = spec_of(b)
    assert spec is not None and spec.scale_format == "e8m0" and spec.block == (128, 128)
    fs = [[frac_e8m0(v) for v in row] for row in byte.tolist()]
    want = expect_fp8(q, fs, (128, 128))
    assert same_bits(a.read(), want, torch.float32) == 0
    assert same_bits(b.read(), want, torch.float32) == 0


def test_mxfp8_u8_scales(tmp_path: Path) -> None:
    x = sample((40, 100), 3)  # 100 is not a multiple of 32: a partial last block
    q, b = mxfp8(x)
    folder = write(tmp_path / "mx", {"l.weight": q, "l.weight_scale": b})
    ref = listed(folder)["l.weight"]
    spec = spec_of(ref)
    assert spec is not None and spec.layout == "mxfp8"
    fs = [[frac_e8m0(v) for v in row] for row in b.tolist()]
    assert same_bits(ref.read(), expect_fp8(q, fs, (1, 32)), torch.float32) == 0
    # the decoded scale is 2**(byte - 127): read as a plain integer it would be far off
    assert float(ref.read().abs().max()) < 1e5


@pytest.mark.parametrize("per", ["tensor", "channel"])
def test_compressed_tensors_fp8(tmp_path: Path, per: str) -> None:
    x = sample((33, 70), 4, zero_block=False)
    amax = x.abs().amax(-1, keepdim=True) if per == "channel" else x.abs().max().reshape(1)
    s = (amax / E4M3_MAX).float()
    q = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    folder = write(tmp_path / per, {"p.weight": q, "p.weight_scale": s,
                                    "p.input_scale": torch.ones(1)},
                   {"quant_method": "compressed-tensors", "format": "float-quantized"})
    refs = listed(folder)
    assert list(refs) == ["p.weight"]  # input_scale is an activation's, never a weight
    sl = s.reshape(-1).tolist()
    fs = [[Fraction(sl[i] if per == "channel" else sl[0])] for i in range(33)]
    assert same_bits(refs["p.weight"].read(), expect_fp8(q, fs, (1, 70)), torch.float32) == 0


@pytest.mark.parametrize("layout", ["ct", "modelopt"])
def test_nvfp4_exact_and_library_order(tmp_path: Path, layout: str) -> None:
    x = sample((24, 64), 5)
    divide = layout == "ct"
    packed, ws, gs = nvfp4(x, divide)
    if divide:
        tensors = {"m.weight_packed": packed, "m.weight_scale": ws, "m.weight_global_scale": gs}
        folder = write(tmp_path / layout, tensors,
                       {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"})
    else:
        tensors = {"m.weight": packed, "m.weight_scale": ws, "m.weight_scale_2": gs,
                   "m.input_scale": torch.ones(())}
        folder = write(tmp_path / layout, tensors,
                       hf_quant={"quantization": {"quant_algo": "NVFP4", "group_size": 16}})
    refs = listed(folder)
    assert list(refs) == ["m.weight"]
    ref = refs["m.weight"]
    assert ref.shape == (24, 64)
    fs = [[frac_e4m3(v) for v in row] for row in ws.view(torch.uint8).tolist()]
    g = Fraction(float(gs.reshape(-1)[0]))
    want = expect_fp4(packed, fs, g, divide)
    got = ref.read()
    assert same_bits(got, want, torch.float32) == 0
    assert same_bits(with_options(ref, "bfloat16").read(),
                     expect_fp4(packed, fs, g, divide, BF16), torch.bfloat16) == 0
    # the library's order: the combined scale rounded to float32 first, then the product
    lib = with_options(ref, order=Order.LIBRARY).read()
    comb = [[Fraction(float(torch.tensor(float(a / g if divide else a * g),
                                         dtype=torch.float32))) for a in row] for row in fs]
    want_lib = expect_fp4(packed, comb, None, divide)
    if not divide:  # ModelOpt's table decodes the code for -0 as +0.0
        want_lib = [0.0 if v == 0 else v for v in want_lib]
    assert same_bits(lib, want_lib, torch.float32) == 0


def test_gpt_oss_mxfp4_experts(tmp_path: Path) -> None:
    x = sample((3, 5, 96), 6)  # 3 experts, 5 rows, 3 blocks of 32
    x[1, 2, 40] = 6 * 2.0 ** 5  # a code at the max, 6
    blocks, scales = gpt_oss(x)
    folder = write(tmp_path / "oss", {"model.layers.0.mlp.experts.down_proj_blocks": blocks,
                                      "model.layers.0.mlp.experts.down_proj_scales": scales},
                   {"quant_method": "mxfp4"})
    refs = listed(folder)
    assert list(refs) == ["model.layers.0.mlp.experts.down_proj"]
    ref = refs["model.layers.0.mlp.experts.down_proj"]
    assert ref.shape == (3, 5, 96)
    fs = [[frac_e8m0(v) for v in row] for row in scales.reshape(15, 3).tolist()]
    got = ref.read()
    assert same_bits(got, expect_fp4(blocks.reshape(15, 48), fs, None, False, block=32),
                     torch.float32) == 0
    assert float(got[1, 2, 40]) == 6 * 2.0 ** 5
    assert torch.equal(ref.read(1, 3), got[1:3])
    # the nibble order matters: swapped nibbles give another weight
    swapped = ((blocks & 15) << 4) | (blocks >> 4)
    f2 = write(tmp_path / "swapped", {"e.down_proj_blocks": swapped,
                                      "e.down_proj_scales": scales})
    assert not torch.equal(listed(f2)["e.down_proj"].read(), got)


# --- (2) readers: names, configs, bad files ----------------------------------------------------


def _ds_folder(folder: Path, scale: torch.Tensor | None = None,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = deepseek_fp8(sample((200, 300), 7))
    write(folder, {"a.weight": q, "a.weight_scale_inv": s if scale is None else scale,
                   "b.weight": torch.randn(4, 4)},
          config if config is not None else {"quant_method": "fp8"})
    return q, s


def _errors(folder: Path, **kw: object) -> tuple[list[str], list[str]]:
    inputs = open_inputs([folder], **kw)  # type: ignore[arg-type]
    return [t.name for t in inputs.tensors], [e.message for e in inputs.errors]


def test_scale_shapes_that_do_not_cover_the_weight(tmp_path: Path) -> None:
    # transformers' block size from rows / scale rows would take 200 / 1 = 200 here
    _ds_folder(tmp_path, scale=torch.ones(1, 3))
    names, errors = _errors(tmp_path)
    assert names == ["b.weight"]  # the weight left out, its scale never listed, b measured
    assert len(errors) == 1 and "a.weight_scale_inv has shape [1, 3]" in errors[0]
    assert "needs [2, 3]" in errors[0] and "\n" not in errors[0]


def test_nan_scale_is_an_error_naming_the_weight(tmp_path: Path) -> None:
    _, s = deepseek_fp8(sample((200, 300), 7))
    s[1, 2] = math.nan
    _ds_folder(tmp_path, scale=s)
    (ref,) = [t for t in open_inputs([tmp_path]).tensors if t.name == "a.weight"]
    with pytest.raises(ReadError, match=r"a\.weight_scale_inv holds a NaN scale, so weight "
                                        r"a\.weight"):
        ref.read()
    ref.read(0, 128)  # rows whose scales are sound still read


def test_blocks_without_scales_and_unknown_quant_method(tmp_path: Path) -> None:
    blocks, _ = gpt_oss(sample((2, 4, 64), 8))
    write(tmp_path / "a", {"e.gate_up_proj_blocks": blocks, "e.bias": torch.ones(3)})
    names, errors = _errors(tmp_path / "a")
    assert names == ["e.bias"]
    assert errors == [f"{tmp_path / 'a' / 'model.safetensors'}: tensor e.gate_up_proj_blocks "
                      "has no e.gate_up_proj_scales beside it; gpt-oss MXFP4 weights need both "
                      "(re-download the checkpoint)"]
    _ds_folder(tmp_path / "b", config={"quant_method": "gptq"})
    names, errors = _errors(tmp_path / "b")
    assert sorted(names) == ["a.weight", "b.weight"] and errors == []  # read by their names
    notices = open_inputs([tmp_path / "b"]).notices
    assert len(notices) == 1 and "quant_method 'gptq' is not one drift knows" in notices[0]


def test_orphan_parts_are_errors_not_weights(tmp_path: Path) -> None:
    """In a quantized folder, a scale whose weight is missing and FP8 codes whose scale is
    missing are each an error naming the tensor, never measured; the rest still read."""
    q, s = deepseek_fp8(sample((200, 300), 9))
    mq, mb = mxfp8(sample((4, 64), 10))
    folder = write(tmp_path / "o", {"a.weight": q, "a.weight_scale_inv": s,
                                    "b.wieght_scale_inv": s.clone(), "c.weight": mq.clone(),
                                    "d.weight": mq, "d.weight_scale": mb,
                                    "n.weight": torch.randn(3)})
    names, errors = _errors(folder)
    assert sorted(names) == ["a.weight", "d.weight", "n.weight"]
    f = folder / "model.safetensors"
    assert sorted(errors) == [
        f"{f}: tensor b.wieght_scale_inv is a weight's scale_inv part, but no weight "
        "b.wieght is beside it to take it; drift measures weights, never their parts: "
        "re-export the checkpoint, or --exclude it",
        f"{f}: tensor c.weight holds FP8 codes with no scale beside it, and would be measured "
        "without its scale; drift measures weights, never their parts: re-export the "
        "checkpoint, or --exclude it"]
    # a folder with no quantized weight and no quantization config: FP8 tensors are tensors
    write(tmp_path / "p", {"c.weight": mq.clone(), "w": torch.ones(2)})
    names, errors = _errors(tmp_path / "p")
    assert sorted(names) == ["c.weight", "w"] and errors == []


def test_truncated_packed_tensor(tmp_path: Path) -> None:
    packed, ws, gs = nvfp4(sample((24, 64), 9), True)
    write(tmp_path, {"m.weight_packed": packed, "m.weight_scale": ws,
                     "m.weight_global_scale": gs, "n.weight": torch.randn(5, 5)},
          {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"})
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-(ws.numel() + 10)])  # into the packed bytes
    names, errors = _errors(tmp_path)
    assert names == ["n.weight"]  # no scale of m measured as a weight
    assert any("m.weight_packed" in e and "truncated" in e for e in errors)


def test_ambiguous_and_contradictory_layouts(tmp_path: Path) -> None:
    q, s = deepseek_fp8(sample((200, 300), 10))
    write(tmp_path / "amb", {"a.weight": q, "a.weight_scale_inv": s,
                             "a.weight_scale": torch.ones(1)})
    names, errors = _errors(tmp_path / "amb")
    assert names == [] and len(errors) == 1
    assert "a.weight_scale, a.weight_scale_inv" in errors[0]
    assert "fit more than one layout (ct-fp8, deepseek-fp8); give --layout" in errors[0]
    names, errors = _errors(tmp_path / "amb", layout="deepseek-fp8")
    assert names == ["a.weight"] and errors == []
    blocks, scales = gpt_oss(sample((2, 4, 64), 8))
    write(tmp_path / "con", {"e.down_proj_blocks": blocks, "e.down_proj_scales": scales},
          {"quant_method": "fp8"})
    names, errors = _errors(tmp_path / "con")
    assert names == [] and "are gpt-oss-mxfp4 but the checkpoint's config says " \
                           "deepseek-fp8" in errors[0]


def test_scan_commands_take_layout(tmp_path: Path) -> None:
    """The ambiguous folder's error names --layout, and every scan command takes it."""
    from driftcli.cli.run import LAYOUTS
    from driftcli.io.readers.quantized_weight import Layout

    assert tuple(Layout) == LAYOUTS  # --help lists them without importing torch
    q, s = deepseek_fp8(sample((200, 300), 10))
    folder = write(tmp_path / "amb", {"a.weight": q, "a.weight_scale_inv": s,
                                      "a.weight_scale": torch.ones(1),
                                      "b.weight": torch.randn(4, 4)})
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["clip-rate", str(folder), "-c", "mxfp8_e4m3",
                                      "--out", str(out / "none"), "-q"])
    assert result.exit_code == 2 and "give --layout" in result.output
    assert "b.weight" in pq.read_table(out / "none" / "clip-rate.parquet")["tensor"].to_pylist()
    want = listed(folder, layout="deepseek-fp8")["a.weight"].read()
    for cmd, casts in [("clip-rate", ["-c", "mxfp8_e4m3"]), ("underflow-rate", ["-c", "nvfp4"]),
                       ("error-bias", ["-c", "mxfp8_e4m3"]),
                       ("cast-diff", ["-c", "mxfp8_e4m3", "-c", "fp8_e4m3"])]:
        result = CliRunner().invoke(app, [cmd, str(folder), *casts, "--layout", "deepseek-fp8",
                                          "--out", str(out / cmd), "-q"])
        assert result.exit_code == 0, (cmd, result.output)
        table = pq.read_table(out / cmd / f"{cmd}.parquet").to_pydict()
        assert sorted(set(table["tensor"]) - {"*"}) == ["a.weight", "b.weight"], cmd
        numel = {t: n for t, n in zip(table["tensor"], table["numel"], strict=True)}
        assert numel["a.weight"] == want.numel() == 60_000
    # the weight measured is the dequantized one: its clip rate is the library call's
    from driftcli.measures import MEASURES

    rows = MEASURES["clip-rate"].run([folder], ["float8_e4m3fn:none"], layout="deepseek-fp8",
                                     include=["a.weight"])
    clipped = int((want.abs() > 448).sum())
    assert clipped > 0
    got = next(r for r in rows if r.tensor == "a.weight")
    assert got.clip_rate == clipped / want.numel()
    result = CliRunner().invoke(app, ["clip-rate", str(folder), "-c", "mxfp8_e4m3",
                                      "--layout", "fp9", "--out", str(out / "bad"), "-q"])
    assert result.exit_code == 2 and "--layout 'fp9' is not a layout" in result.output


def test_clip_rate_lists_weights_under_their_names(tmp_path: Path) -> None:
    q, s = deepseek_fp8(sample((200, 300), 11))
    blocks, scales = gpt_oss(sample((2, 4, 64), 12))
    write(tmp_path / "ck", {"l.weight": q, "l.weight_scale_inv": s,
                            "e.down_proj_blocks": blocks, "e.down_proj_scales": scales,
                            "n.weight": torch.randn(4, 4)})
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["clip-rate", str(tmp_path / "ck"), "-c", "mxfp8_e4m3",
                                      "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "clip-rate.parquet").to_pydict()
    assert sorted(set(table["tensor"]) - {"*"}) == ["e.down_proj", "l.weight", "n.weight"]
    # a scale NaN: exit 2 naming the weight, the others still measured
    s[0, 0] = math.nan
    write(tmp_path / "bad", {"l.weight": q, "l.weight_scale_inv": s,
                             "n.weight": torch.randn(4, 4)})
    result = CliRunner().invoke(app, ["clip-rate", str(tmp_path / "bad"), "-c", "mxfp8_e4m3",
                                      "--out", str(out / "bad"), "-q"])
    assert result.exit_code == 2 and "weight l.weight cannot be dequantized" in result.output
    table = pq.read_table(out / "bad" / "clip-rate.parquet").to_pydict()
    assert "n.weight" in table["tensor"]


# --- (3) drift dequantize ------------------------------------------------------------------------


def _all_layouts(folder: Path) -> Path:
    """One checkpoint holding a weight of every layout (names tell them apart)."""
    q, s = deepseek_fp8(sample((200, 300), 20))
    mq, mb = mxfp8(sample((40, 100), 21))
    cp, cws, cgs = nvfp4(sample((24, 64), 22), True)
    mp, mws, mgs = nvfp4(sample((24, 64), 23), False)
    blocks, scales = gpt_oss(sample((3, 5, 96), 24))
    return write(folder, {
        "ds.weight": q, "ds.weight_scale_inv": s, "mx.weight": mq, "mx.weight_scale": mb,
        "ct.weight_packed": cp, "ct.weight_scale": cws, "ct.weight_global_scale": cgs,
        "mo.weight": mp, "mo.weight_scale": mws, "mo.weight_scale_2": mgs,
        "ex.down_proj_blocks": blocks, "ex.down_proj_scales": scales,
        "norm.weight": torch.randn(7).bfloat16()})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantize_writes_what_the_readers_read(tmp_path: Path, dtype: str) -> None:
    from safetensors import safe_open

    folder = _all_layouts(tmp_path / "in")
    refs = listed(folder)
    assert sorted(refs) == ["ct.weight", "ds.weight", "ex.down_proj", "mo.weight",
                            "mx.weight", "norm.weight"]
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(app, ["dequantize", str(folder), "--out", str(out),
                                      "--dtype", dtype])
    assert result.exit_code == 0, result.output
    assert "dequantized 5 weight(s)" in result.output
    with safe_open(out, "pt") as f:
        assert sorted(f.keys()) == sorted(refs)
        for name, ref in refs.items():
            got = f.get_tensor(name)
            want = with_options(ref, dtype).read() if spec_of(ref) else ref.read()
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8),
                                                           want.view(torch.uint8)), name
        meta = json.loads(f.metadata()["drift.dequantized"])
    assert meta["ct.weight"] == {"layout": "ct-nvfp4", "dtype": dtype, "order": "exact"}


def test_dequantize_sharded_and_nothing_half_written(tmp_path: Path) -> None:
    q, s = deepseek_fp8(sample((200, 300), 25))
    src = tmp_path / "in"
    src.mkdir()
    save_file({"a.weight": q, "a.weight_scale_inv": s}, src / "model-00001-of-00002.safetensors")
    save_file({"b.weight": torch.randn(3, 3)}, src / "model-00002-of-00002.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors",
        "a.weight_scale_inv": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors"}}))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["dequantize", str(src), "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a.weight": "model-00001-of-00002.safetensors",
                                   "b.weight": "model-00002-of-00002.safetensors"}
    assert listed(out)["a.weight"].read().equal(listed(src)["a.weight"].read())
    # a NaN scale in one weight: exit 2 naming it, and no file written at all
    s[1, 0] = math.nan
    save_file({"a.weight": q, "a.weight_scale_inv": s}, src / "model-00001-of-00002.safetensors")
    bad = tmp_path / "bad"
    result = CliRunner().invoke(app, ["dequantize", str(src), "--out", str(bad)])
    assert result.exit_code == 2
    assert "weight a.weight cannot be dequantized" in result.output
    assert "nothing was written" in result.output
    assert not bad.exists() or list(bad.iterdir()) == []


# --- (4) drift inspect: counts and lints ---------------------------------------------------------


def _rows(folder: Path, **kw: object) -> dict[str, InspectRow]:
    found = inspect([folder], **kw)  # type: ignore[arg-type]
    assert not found.errors, found.errors
    return {r.tensor: r for r in found.rows}


def _zero_blocks(mag: list[int], cols: int, block: tuple[int, int]) -> int:
    """Blocks (rows x cols tiles of a row-major matrix, edges partial) all of zero codes."""
    rows = len(mag) // cols
    tiles: dict[tuple[int, int], bool] = {}
    for i in range(rows):
        for j in range(cols):
            key = (i // block[0], j // block[1])
            tiles[key] = tiles.get(key, True) and mag[i * cols + j] == 0
    return sum(tiles.values())


def _independent(codes_mag: list[int], max_mag: int, scales: list[float],
                 blocks_zero: int) -> dict[str, object]:
    """Counts from the codes' magnitude bits and the scales as Python floats."""
    finite = [s for s in scales if math.isfinite(s)]
    nz = [s for s in finite if s != 0]
    return {"max_codes": sum(m == max_mag for m in codes_mag),
            "zero_codes": sum(m == 0 for m in codes_mag),
            "zero_blocks": blocks_zero, "scale_min": min(finite), "scale_max": max(finite),
            "scale_exponents": len({math.frexp(s)[1] for s in nz}),
            "scales_pow2": all(math.frexp(s)[0] in (0.5, -0.5) for s in nz)}


def _got(row: InspectRow) -> dict[str, object]:
    return {k: getattr(row, k) for k in ("max_codes", "zero_codes", "zero_blocks", "scale_min",
                                         "scale_max", "scale_exponents", "scales_pow2")}


def test_inspect_counts_every_layout(tmp_path: Path) -> None:
    folder = _all_layouts(tmp_path)
    rows = _rows(folder)
    assert sorted(rows) == ["ct.weight", "ds.weight", "ex.down_proj", "mo.weight",
                            "mx.weight"]
    from safetensors.torch import load_file
    raw = load_file(folder / "model.safetensors")
    # deepseek-fp8: E4M3 codes, magnitude bits 0x7E is 448; the 16 x 32 zero corner is not
    # a whole 128 x 128 block
    ds = raw["ds.weight"].view(torch.uint8).reshape(-1).tolist()
    want = _independent([c & 0x7F for c in ds], 0x7E,
                        raw["ds.weight_scale_inv"].reshape(-1).tolist(), 0)
    assert _zero_blocks([c & 0x7F for c in ds], 300, (128, 128)) == 0
    assert _got(rows["ds.weight"]) == want and want["max_codes"] >= 1
    # mxfp8: E8M0 bytes; 16 rows x one block of 32 are all zero
    mx = raw["mx.weight"].view(torch.uint8).reshape(-1).tolist()
    sc = [2.0 ** (b - 127) for b in raw["mx.weight_scale"].reshape(-1).tolist()]
    mag = [c & 0x7F for c in mx]
    assert _got(rows["mx.weight"]) == _independent(mag, 0x7E, sc,
                                                   _zero_blocks(mag, 100, (1, 32)))
    assert rows["mx.weight"].zero_blocks >= 16
    assert rows["mx.weight"].scales_pow2 and rows["mx.weight"].pow2_declared
    # NVFP4 layouts: nibbles, magnitude bits 7 is 6; E4M3 block scales
    for name, key in (("ct.weight", "ct.weight_packed"), ("mo.weight", "mo.weight")):
        nib = [n for b in raw[key].reshape(-1).tolist() for n in (b & 15, b >> 4)]
        sc = raw[name + "_scale"].float().reshape(-1).tolist()
        mag = [n & 7 for n in nib]
        assert _got(rows[name]) == _independent(mag, 7, sc, _zero_blocks(mag, 64, (1, 16)))
        assert rows[name].zero_blocks >= 32
        assert rows[name].global_scale == ("divisor" if name == "ct.weight" else "multiplier")
        assert rows[name].order_differs is not None
    # gpt-oss: 3 experts x 5 rows, each row's first block of 32 zeroed
    nib = [n for b in raw["ex.down_proj_blocks"].reshape(-1).tolist() for n in (b & 15, b >> 4)]
    sc = [2.0 ** (b - 127) for b in raw["ex.down_proj_scales"].reshape(-1).tolist()]
    mag = [n & 7 for n in nib]
    assert _got(rows["ex.down_proj"]) == _independent(mag, 7, sc, _zero_blocks(mag, 96, (1, 32)))
    assert rows["ex.down_proj"].zero_blocks >= 15
    for r in rows.values():  # clean files: no lint but the planted zero blocks
        assert not r.lint_pow2 and not r.lint_nan_scales and r.lint_magnitude is False


def test_inspect_lints_fire_on_planted_cases(tmp_path: Path) -> None:
    # trained weights' magnitudes (RMS about 0.02): a global scale inverted is then off by
    # its square, about 1e8
    g = torch.Generator().manual_seed(30)
    q, b = mxfp8(torch.randn(64, 128, generator=g) * 0.02)
    cp, cws, cgs = nvfp4(torch.randn(64, 128, generator=g) * 0.02, True)
    qd, sd = deepseek_fp8(torch.randn(200, 300, generator=g) * 0.02, ue8m0=True)
    sd[0, 1] = sd[0, 1] * 1.5  # not a power of two in a ue8m0 checkpoint
    plain = {f"plain{i}.weight": torch.randn(64, 64, generator=g) * 0.02 for i in range(4)}
    # a writer that stored the scale value itself (2**e as an integer byte), not its E8M0
    # code: decoded as E8M0 it is about 2**-120 times too small
    wrong = torch.pow(2.0, b.float() - 127).clamp(max=255).round().to(torch.uint8)
    write(tmp_path / "bad", {**plain, "mx.weight": q, "mx.weight_scale": wrong,
                             "ct.weight_packed": cp, "ct.weight_scale": cws,
                             "ct.weight_global_scale": 1 / cgs,  # inverted
                             "ds.weight": qd, "ds.weight_scale_inv": sd,
                             "z.weight": torch.zeros(64, 64, dtype=torch.float8_e4m3fn),
                             "z.weight_scale": torch.ones(1)})
    rows = _rows(tmp_path / "bad", layout=None)
    assert rows["mx.weight"].lint_magnitude is True
    assert rows["ct.weight"].lint_magnitude is True
    assert rows["ds.weight"].lint_magnitude is False
    ds = [r for r in inspect([tmp_path / "bad"]).findings if r.tensor == "ds.weight"]
    assert [f.lint for f in ds] == []  # the config is missing: float32 scales, none declared
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}))
    found = inspect([tmp_path / "bad"], include=["ds.*"])
    assert [(f.tensor, f.lint) for f in found.findings] == [("ds.weight", "lint_pow2")]
    (tmp_path / "bad" / "config.json").unlink()
    z = _rows(tmp_path / "bad")["z.weight"]
    assert z.lint_zero_blocks and z.zero_blocks == 1 and z.zero_codes == 64 * 64
    # the clean twins: silent
    write(tmp_path / "good", {**plain, "mx.weight": q, "mx.weight_scale": b,
                              "ct.weight_packed": cp, "ct.weight_scale": cws,
                              "ct.weight_global_scale": cgs})
    found = inspect([tmp_path / "good"])
    assert found.findings == () and all(r.lint_magnitude is False for r in found.rows)
    # NaN scales: a lint, and the CLI's one-line finding
    b2 = b.clone()
    b2[0, 0] = 255
    write(tmp_path / "nan", {**plain, "mx.weight": q, "mx.weight_scale": b2})
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "nan"), "--out",
                                      str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "lint_nan_scales mx.weight: 1 NaN or infinite scale(s)" in result.output
    table = pq.read_table(tmp_path / "o" / "inspect.parquet")
    assert table.schema.metadata[b"drift.table"] == b"inspect"
    assert table.to_pydict()["nan_scales"] == [1]


# --- (5) --requant: requantization stability ------------------------------------------------------


def test_requant_is_zero_on_a_presets_own_output(tmp_path: Path) -> None:
    q, b = mxfp8(sample((32, 256), 40))  # OCP MX floor rule: what mxfp8_e4m3 does
    blocks, scales = gpt_oss(sample((2, 8, 64), 41))
    write(tmp_path, {"mx.weight": q, "mx.weight_scale": b,
                     "ex.down_proj_blocks": blocks, "ex.down_proj_scales": scales})
    rows = inspect([tmp_path], requant=["mxfp8_e4m3", "mxfp4_e2m1"]).rows
    got = {(r.tensor, r.requant): (r.requant_changed_blocks, r.requant_changed_codes,
                                   r.requant_changed_values) for r in rows}
    assert got[("mx.weight", "mxfp8_e4m3")] == (0, 0, 0)
    assert got[("ex.down_proj", "mxfp4_e2m1")] == (0, 0, 0)
    # across element formats: no code comparison, the values do change
    _, codes_, values_ = got[("mx.weight", "mxfp4_e2m1")]
    assert codes_ is None and values_ > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_requant_judges_power_of_two_scales_stored_as_floats(tmp_path: Path,
                                                             dtype: torch.dtype) -> None:
    """A power-of-two preset whose scale format is the stored float dtype: the writer's
    consistency is judged on the scales' values (it read them as E8M0 bytes, 2 or 4 per
    scale, and crashed). A scale that is no power of two is one the rule cannot have written."""
    from driftcli.casts.quantization import QuantInfo, quantize

    preset = f"float8_e4m3fn:block128:{str(dtype).removeprefix('torch.')}:floor"
    info = quantize(sample((16, 128), 43), preset, return_info=True)
    assert isinstance(info, QuantInfo) and info.codes is not None
    codes, scales = info.codes.to(torch.float8_e4m3fn), info.scales.reshape(16, 1).to(dtype)
    write(tmp_path / "own", {"w.weight": codes, "w.weight_scale": scales})
    (row,) = inspect([tmp_path / "own"], requant=[preset]).rows
    assert (row.requant_changed_blocks, row.requant_rescaled_blocks, row.requant_changed_codes,
            row.requant_changed_values) == (0, 0, 0, 0)
    planted = scales.clone()
    planted[5] *= 1.5  # row 5: 1.5 x its power of two
    write(tmp_path / "planted", {"w.weight": codes, "w.weight_scale": planted})
    (row,) = inspect([tmp_path / "planted"], requant=[preset]).rows
    assert (row.requant_changed_blocks, row.requant_rescaled_blocks) == (1, 1)


def test_requant_does_not_judge_block_scales_under_a_global_scale(tmp_path: Path) -> None:
    """ModelOpt NVFP4 (E4M3 block scales times a float32 global scale) requantized by a
    power-of-two preset into E4M3 scales: the block scale alone is not what the codes were
    divided by, so no block is taken as the preset's own (2b56df6 read the E4M3 bytes as E8M0
    and reported 0 changed values of 378)."""
    from driftcli.casts.quantization import QuantInfo, quantize

    packed, ws, gs = nvfp4(sample((24, 64), 5), False)
    write(tmp_path, {"m.weight": packed, "m.weight_scale": ws, "m.weight_scale_2": gs,
                     "m.input_scale": torch.ones(())},
          hf_quant={"quantization": {"quant_algo": "NVFP4", "group_size": 16}})
    preset = "float4_e2m1fn:block16:float8_e4m3fn:floor"
    (row,) = inspect([tmp_path], requant=[preset]).rows
    weight = listed(tmp_path)["m.weight"].read().float()
    info = quantize(weight, preset, return_info=True)
    assert isinstance(info, QuantInfo)
    moved = int((info.values != weight).sum())  # independent: every element the preset moves
    assert moved > 0 and row.requant_changed_values == moved
    assert row.requant_changed_blocks == row.requant_rescaled_blocks > 0


def test_requant_refuses_a_stochastic_preset_naming_it(tmp_path: Path) -> None:
    # it was "stochastic rounding needs seed= or random_bits=", naming neither the option
    # nor the fix
    q, b = mxfp8(sample((32, 256), 40))
    write(tmp_path, {"mx.weight": q, "mx.weight_scale": b})
    result = CliRunner().invoke(app, ["inspect", str(tmp_path), "--requant", "mxfp8_e4m3:sr",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "error: --requant mxfp8_e4m3:sr: a stochastic cast" in result.output
    assert "round-to-nearest" in result.output and not (tmp_path / "out").exists()


def test_requant_reproduces_the_megatron_scale_flip(tmp_path: Path) -> None:
    """MXFP8 with the ceil rule (2**ceil(log2(amax / 448))) -> BF16 -> MXFP8: a block whose
    dequantized max is at most 224 * s gets s / 2 the second time."""
    from driftcli.casts.quantization import QuantInfo, quantize

    x = sample((16, 128), 42, zero_block=False)
    x[3, 40:64] = 0.1
    x[3, 37] = 224.5  # block (3, 1): amax / 448 just over 1/2 -> s = 1, its code rounds to 224
    info = quantize(x, "mxfp8_e4m3_ceil", return_info=True)
    assert isinstance(info, QuantInfo) and info.codes is not None
    scales = info.scales.reshape(16, 4)
    codes = info.codes.to(torch.float8_e4m3fn)
    byte = (torch.log2(scales) + 127).to(torch.uint8)
    assert float(scales[3, 1]) == 1.0 and float(info.codes[3, 37]) == 224.0
    write(tmp_path, {"w.weight": codes, "w.weight_scale": byte})
    (row,) = inspect([tmp_path], requant=["mxfp8_e4m3_ceil"]).rows
    block_max = info.codes.abs().reshape(16, 4, 32).amax(-1)
    flips = int(((block_max <= 224) & (block_max > 0)).sum())  # independent count
    assert flips >= 1 and row.requant_rescaled_blocks == flips
    assert row.requant_changed_values == 0  # the codes double where the scale halves
    # ceil wrote every block as stored (its amax could lie above 224 * s): nothing changed
    assert (row.requant_changed_blocks, row.requant_changed_codes) == (0, 0)


# --- the docs' examples ---------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs"


def make_v31_example(folder: Path) -> Path:
    """The folder docs/inspect.md and docs/dequantize.md show: DeepSeek-V3.1-style (FP8,
    ue8m0 128 x 128 scales) with one o_proj scale that is not a power of two."""
    g = torch.Generator().manual_seed(31)
    q1, s1 = deepseek_fp8(torch.randn(256, 384, generator=g) * 0.02, ue8m0=True)
    q2, s2 = deepseek_fp8(torch.randn(200, 300, generator=g) * 0.02, ue8m0=True)
    s2[1, 2] = s2[1, 2] * 1.25
    return write(folder, {
        "model.layers.0.mlp.down_proj.weight": q1,
        "model.layers.0.mlp.down_proj.weight_scale_inv": s1,
        "model.layers.0.self_attn.o_proj.weight": q2,
        "model.layers.0.self_attn.o_proj.weight_scale_inv": s2,
        "lm_head.weight": (torch.randn(64, 384, generator=g) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(384).bfloat16()},
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
         "scale_fmt": "ue8m0", "activation_scheme": "dynamic"})


def _doc_block(page: str, starts: str) -> list[str]:
    """The lines of the page's first text block whose first line starts with ``starts``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    for block in text.split("```text\n")[1:]:
        lines = block.split("```")[0].splitlines()
        if lines and lines[0].startswith(starts):
            return lines
    raise AssertionError(f"docs/{page} has no example starting {starts!r}")


def test_docs_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    make_v31_example(Path("v31"))
    block = _doc_block("inspect.md", "$ drift inspect v31")
    result = CliRunner().invoke(app, block[0].removeprefix("$ drift ").split())
    assert result.exit_code == 0, result.output
    printed = [line for line in result.output.splitlines() if line.startswith(("lint_", "wrote"))]
    assert printed == [line for line in block if line.startswith(("lint_", "wrote"))]
    block = _doc_block("dequantize.md", "$ drift dequantize v31")
    result = CliRunner().invoke(app, block[0].removeprefix("$ drift ").split())
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == block[1:]


# --- the reader fuzz, on quantized layouts --------------------------------------------------------

_PARTS = ("_scale_inv", "_scale", "_global_scale", "_scale_2", "_scales", "_blocks", "_packed")


def test_damaged_quantized_files_are_errors_never_crashes(tmp_path: Path) -> None:
    """test_reader_fuzz's safetensors mutants of a small file holding a weight of three
    layouts, read by its worker (scan, then every listed tensor, under an address-space
    limit): no crash, no scale tensor ever listed, a file the library refuses never measured
    clean, and a weight whose tensors the mutation left alone read as in the sound file."""
    import os
    import random
    import subprocess
    import sys

    import test_reader_fuzz as fuzz

    q, s = deepseek_fp8(sample((130, 20), 50, zero_block=False))
    cp, cws, cgs = nvfp4(sample((4, 32), 51, zero_block=False), True)
    blocks, scales = gpt_oss(sample((2, 2, 32), 52, zero_block=False))
    mq, mb = mxfp8(sample((3, 40), 53, zero_block=False))
    mp, mws, mgs = nvfp4(sample((2, 32), 54, zero_block=False), False)
    kb, ks = gpt_oss(sample((3, 64), 56, zero_block=False))  # MXFP4 packed as gpt-oss packs
    xb, xs = gpt_oss(sample((2, 32), 57, zero_block=False))
    x = sample((3, 8), 55, zero_block=False)
    fs = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).float()
    fq = (x / fs).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    sound = tmp_path / "sound.safetensors"
    # a weight of every layout (names and dtypes tell them apart), and a plain tensor
    save_file({"d.weight": q, "d.weight_scale_inv": s, "c.weight_packed": cp,
               "c.weight_scale": cws, "c.weight_global_scale": cgs,
               "e.down_proj_blocks": blocks, "e.down_proj_scales": scales,
               "m.weight": mq, "m.weight_scale": mb, "o.weight": mp, "o.weight_scale": mws,
               "o.weight_scale_2": mgs, "f.weight": fq, "f.weight_scale": fs,
               "k.weight_packed": kb.reshape(3, 32), "k.weight_scale": ks,
               "x.weight": xb.reshape(2, 16), "x.weight_scale": xs,
               "n.weight": torch.randn(3, 4)}, sound)
    weights = {"d.weight": ("d.weight", "d.weight_scale_inv"),
               "c.weight": ("c.weight_packed", "c.weight_scale", "c.weight_global_scale"),
               "e.down_proj": ("e.down_proj_blocks", "e.down_proj_scales"),
               "m.weight": ("m.weight", "m.weight_scale"),
               "o.weight": ("o.weight", "o.weight_scale", "o.weight_scale_2"),
               "f.weight": ("f.weight", "f.weight_scale"),
               "k.weight": ("k.weight_packed", "k.weight_scale"),
               "x.weight": ("x.weight", "x.weight_scale"),
               "n.weight": ("n.weight",)}
    from driftcli.io.readers.quantized_weight import Layout

    layouts = {spec.layout for t in open_inputs([sound]).tensors
               if (spec := spec_of(t)) is not None}
    # the fuzz covers every layout the names tell (MXFP6's E2M3 and E3M2 differ only in what
    # the config says; their family's tensors are MXFP4's, with 6-bit codes)
    assert layouts == set(Layout) - {Layout.MXFP6_E2M3, Layout.MXFP6_E3M2}
    base = {t.name: fuzz.digest(t.read()) for t in open_inputs([sound]).tensors}
    assert sorted(base) == sorted(weights)
    rng = random.Random(fuzz.SEED)
    mutants, seen = [], {sound.read_bytes()}
    for m in fuzz.safetensors_mutants(sound.read_bytes(), rng):
        if m.data not in seen:
            seen.add(m.data)
            mutants.append(m)
    mutants = mutants[::2]  # every other: each kind of damage stays, in half the time
    folders = []
    for i, m in enumerate(mutants):  # one folder each: a weight's tensors are read together
        folders.append(tmp_path / f"m{i:04d}")
        folders[-1].mkdir()
        (folders[-1] / "model.safetensors").write_bytes(m.data)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps([str(f) for f in folders]))
    env = {**os.environ, "PYTHONPATH": str(Path(fuzz.__file__).parents[1])}
    run = subprocess.run([sys.executable, fuzz.__file__, str(manifest), str(sound)],
                         capture_output=True, text=True, timeout=600, check=False, env=env)
    results = {r["id"]: r for r in map(json.loads, run.stdout.splitlines()) if "id" in r}
    assert run.returncode == 0 and len(results) == len(mutants), run.stderr[-3000:]
    wrong = [f"{mutants[i].label}: {r['crash']}" for i, r in results.items() if "crash" in r]
    outcomes: Counter[str] = Counter()
    for i, m in enumerate(mutants):
        got = results[i]
        outcomes[fuzz.outcome(got)] += 1
        listed_names = set(got["tensors"])
        if any(n.endswith(_PARTS) for n in listed_names):
            wrong.append(f"{m.label}: a stored part listed as a tensor: {sorted(listed_names)}")
        refused = fuzz.library_reads(folders[i] / "model.safetensors") is None
        if refused and fuzz.outcome(got) == "clean":
            wrong.append(f"{m.label}: the library refuses it, drift measured it all")
        wrong += [f"{m.label}: {name} reads otherwise than in the sound file"
                  for name, parts in weights.items()
                  if m.untouched is not None and set(parts) <= m.untouched
                  and name in got["tensors"] and got["tensors"][name][2] != base[name]]
        if got["seconds"] > fuzz.CASE_SECONDS:
            wrong.append(f"{m.label}: {got['seconds']:.1f} s")
    assert wrong == [], "\n".join(wrong[:20])
    print(f"\nquantized fuzz: {len(mutants)} mutants, {dict(outcomes)}")
    # every outcome reached; most damage to a file of seven weights' parts is an error, so
    # clean mutants (a metadata edit, damage the header's padding absorbs) are the fewest
    assert len(mutants) > 900 and outcomes["clean"] >= 15, outcomes
    assert min(outcomes["file error"], outcomes["tensor error"]) >= 100, outcomes


# --- Transformer Engine DumpTensors files --------------------------------------------------------


class FakeFloat8Tensor:
    """Pickles as Transformer Engine's Float8Tensor does: through a classmethod of its own."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.data, self.scale_inv = data, scale_inv

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        return (FakeFloat8Tensor.make, (self.data, self.scale_inv, torch.bfloat16))

    @classmethod
    def make(cls, data: torch.Tensor, scale_inv: torch.Tensor,
             dtype: torch.dtype) -> FakeFloat8Tensor:
        return cls(data, scale_inv)


class Hostile:
    """A pickle that would run a shell command if it were unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        import os
        return (os.system, (f"touch {self.marker}",))


def test_te_dump_tensors(tmp_path: Path) -> None:
    hp = sample((8, 64), 60, zero_block=False).bfloat16()
    marker = tmp_path / "ran"
    torch.save({"high_precision": hp,
                "quantized": FakeFloat8Tensor(hp.float().to(torch.float8_e4m3fn),
                                              torch.tensor(1.0)),
                "data": hp.float().to(torch.float8_e4m3fn), "scale_inv": torch.tensor(1.0)},
               tmp_path / "decoder.layers.0.fc1_activation_iter_000100.pt")
    torch.save({"high_precision": hp * 2},
               tmp_path / "decoder.layers.0.fc2_weight_iter_000200.pt")
    torch.save({"high_precision": hp, "quantized": Hostile(marker)},
               tmp_path / "decoder.layers.1.fc1_gradient_iter_000300.pt")
    torch.save({"w": hp}, tmp_path / "plain_weight_iter_000001.pt")  # named so, a state dict
    inputs = open_inputs([tmp_path])
    got = {t.name: t for t in inputs.tensors}
    assert sorted(got) == ["decoder.layers.0.fc1.activation", "decoder.layers.0.fc2.weight",
                           "decoder.layers.1.fc1.gradient", "w"]
    a = got["decoder.layers.0.fc1.activation"]
    assert (a.role, a.layer, a.step, a.dtype) == ("activation", "decoder.layers.0.fc1", 100,
                                                   "bfloat16")
    assert torch.equal(a.read(), hp) and torch.equal(a.read(2, 5), hp[2:5])
    assert torch.equal(got["decoder.layers.0.fc2.weight"].read(), hp * 2)
    assert not marker.exists()  # the hostile pickle's command never ran
    errors = sorted((e.tensor, e.message.split(": ", 1)[1]) for e in inputs.errors)
    assert errors == [
        ("decoder.layers.0.fc1.activation.quantized",
         "entry 'quantized' is a pickled test_quantized.FakeFloat8Tensor.make, which drift "
         "does not unpickle (it would run Transformer Engine's code); the high_precision "
         "tensor is read (dump with quantized_tensor: False to leave it out)"),
        ("decoder.layers.1.fc1.gradient.quantized",
         "entry 'quantized' is a pickled posix.system, which drift does not unpickle (it "
         "would run Transformer Engine's code); the high_precision tensor is read (dump with "
         "quantized_tensor: False to leave it out)")]


def test_reads_in_chunks_equal_the_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import driftcli.io.readers.quantized_weight as quantized

    q, s = deepseek_fp8(sample((300, 260), 70))
    blocks, scales = gpt_oss(sample((3, 5, 96), 71))
    write(tmp_path, {"a.weight": q, "a.weight_scale_inv": s,
                     "e.down_proj_blocks": blocks, "e.down_proj_scales": scales})
    refs = listed(tmp_path)
    whole = {k: r.read() for k, r in refs.items()}
    for chunk in (1000, 260 * 130, 100):  # 3 rows (under a block), 128 rows, 1 row
        monkeypatch.setattr(quantized, "CHUNK_ELEMENTS", chunk)
        for k, r in refs.items():
            assert torch.equal(r.read(), whole[k]), (k, chunk)
            assert torch.equal(r.read(1, 3 if k == "e.down_proj" else 290),
                               whole[k][1:3 if k == "e.down_proj" else 290]), (k, chunk)


def test_compressed_tensors_fp8_blocks(tmp_path: Path) -> None:
    q, s = deepseek_fp8(sample((130, 70), 80), block=64)  # 64 x 64 blocks, partial edges
    write(tmp_path, {"p.weight": q, "p.weight_scale": s},
          {"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"group_0": {"weights": {"strategy": "block",
                                                     "block_structure": [64, 64]}}}})
    ref = listed(tmp_path)["p.weight"]
    spec = spec_of(ref)
    assert spec is not None and spec.block == (64, 64) and spec.layout == "ct-fp8"
    fs = [[Fraction(float(v)) for v in row] for row in s.tolist()]
    assert same_bits(ref.read(), expect_fp8(q, fs, (64, 64)), torch.float32) == 0


def test_inspect_on_a_plain_checkpoint_says_so(tmp_path: Path) -> None:
    save_file({"w": torch.randn(4, 4)}, tmp_path / "model.safetensors")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "no quantized weights in the inputs" in result.output
    assert pq.read_table(tmp_path / "o" / "inspect.parquet").num_rows == 0


def test_requant_nvfp4_on_its_own_output(tmp_path: Path) -> None:
    """A ModelOpt-layout checkpoint holding what drift's nvfp4 preset stores (E4M3 block
    scales of amax / 6 over the float32 tensor scale, which is weight_scale_2): requantized
    with nvfp4 nothing changes, compared as the preset computes (combined scale in float32)."""
    from driftcli.casts.quantization import QuantInfo, quantize

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(90)) * 0.02
    info = quantize(x, "nvfp4", return_info=True)
    assert isinstance(info, QuantInfo) and info.codes is not None
    ts = info.tensor_scale
    assert ts is not None
    ws = (x.reshape(64, 16, 16).abs().amax(-1).double() / 6 / ts).to(torch.float8_e4m3fn)
    write(tmp_path, {"m.weight": pack(fp4_codes(info.codes.float())), "m.weight_scale": ws,
                     "m.weight_scale_2": torch.tensor(ts, dtype=torch.float32)})
    (row,) = inspect([tmp_path], requant=["nvfp4"]).rows
    assert (row.requant_changed_blocks, row.requant_changed_codes,
            row.requant_changed_values) == (0, 0, 0)
    assert row.order_differs is not None and row.order_differs > 0  # the orders do part


# --- a pre-quantized model runs: grad-cosine and dump on a Hugging Face folder -----------------

STORIES = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "stories260K-hf"
NO_MODEL = importlib.util.find_spec("transformers") is None or not STORIES.is_dir()
NO_MODEL_REASON = ("needs transformers (driftcli[hf]) and ../shared/data/models/stories260K-hf "
                   "(a fresh clone outside the workspace)")


def _quantized_stories(folder: Path, nan: bool = False) -> Path:
    """stories260K with every projection stored as DeepSeek FP8 (128 x 128 scales; the
    projections are 32 to 172 wide, so every block is a partial edge block)."""
    from safetensors.torch import load_file

    stored: dict[str, torch.Tensor] = {}
    for name, w in load_file(STORIES / "model.safetensors").items():
        if name.endswith("proj.weight"):
            stored[name], stored[name + "_scale_inv"] = deepseek_fp8(w.float())
        else:
            stored[name] = w
    if nan:
        stored["model.layers.1.mlp.up_proj.weight_scale_inv"][0, 0] = math.nan
    config = json.loads((STORIES / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    folder.mkdir()
    save_file(stored, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (folder / f).write_bytes((STORIES / f).read_bytes())
    return folder


@pytest.mark.skipif(NO_MODEL, reason=NO_MODEL_REASON)
def test_a_quantized_model_folder_runs(tmp_path: Path) -> None:
    """The model holds the weights the scans read (exact product, rounded once to float32),
    computes what the same weights written plain compute, and grad-cosine runs on it."""
    from driftcli.io.dequantize import dequantize
    from driftcli.models.loaders import load_causal_lm

    folder = _quantized_stories(tmp_path / "q")
    lm = load_causal_lm(folder, float64_copies=4)
    held = lm.model.state_dict()
    read = {t.name: t.read() for t in open_inputs([folder]).tensors}
    assert len(read) == 48 - 1  # the tied head is not stored
    for name, want in read.items():
        assert held[name].dtype == torch.float32 and torch.equal(held[name], want.float()), name
    assert torch.equal(held["lm_head.weight"], held["model.embed_tokens.weight"])
    q = "model.layers.0.self_attn.q_proj.weight"
    from safetensors.torch import load_file

    plain_w = load_file(STORIES / "model.safetensors")[q]
    assert not torch.equal(held[q], plain_w)  # it is the FP8 weight, not the original
    # the same weights written plain, loaded by transformers: the same logits, bit for bit
    # (one machine, one process, the same float32 kernels on the same values)
    plain = tmp_path / "plain"
    plain.mkdir()
    dequantize([folder], plain / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    ids = torch.tensor([[1, 200, 31, 7, 400, 12, 99, 5]])
    other = load_causal_lm(plain)
    with torch.no_grad():
        assert torch.equal(lm.logits(lm.model, ids), other.logits(other.model, ids))
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a little dog who liked to run in the park. " * 3)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["grad-cosine", str(folder), "-p", "exact", "-p",
                                      "mxfp8_e4m3", "--text", str(text), "--tokens", "16",
                                      "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "grad-cosine.parquet").to_pydict()
    assert q in table["parameter"] and q + "_scale_inv" not in table["parameter"]
    exact = [c for p, c in zip(table["policy"], table["cosine"], strict=True) if p == "exact"]
    # the exact policy's gradient is the reference itself: its cosine is 1 up to the float64
    # roundings of the dot product and the norms (a few ulps, kernel-dependent)
    assert exact and all(abs(c - 1.0) < 1e-12 for c in exact if c is not None)


@pytest.mark.skipif(NO_MODEL, reason=NO_MODEL_REASON)
def test_a_quantized_model_with_a_nan_scale_is_refused(tmp_path: Path) -> None:
    from driftcli.models.loaders import CheckpointError, load_causal_lm

    folder = _quantized_stories(tmp_path / "q", nan=True)
    with pytest.raises(CheckpointError) as info:
        load_causal_lm(folder)
    message = str(info.value)
    assert "\n" not in message
    assert ("tensor model.layers.1.mlp.up_proj.weight_scale_inv holds a NaN scale, so weight "
            "model.layers.1.mlp.up_proj.weight cannot be dequantized") in message
    assert message.endswith("the model needs every weight")
