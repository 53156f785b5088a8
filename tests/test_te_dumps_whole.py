"""Transformer Engine's DumpTensors folders, whole: both layouts, the quantized entry's raw parts
(Float8Tensor, MXFP8Tensor, NVFP4Tensor and their storage classes) read without Transformer
Engine, and TE's bytes compared with drift's presets.

The fixtures are written here: stand-in classes and functions registered under TE's module
and qualified names (in modules the test puts in ``sys.modules`` for the pickler alone), so the
pickles name TE's classes exactly as TE's ``__reduce_ex__`` writes them. TE's bytes are made by
torch's own FP8 casts and the test's FP4 rounding in TE's operation order, not by drift.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from driftcli.io.readers import open_inputs
from driftcli.io.readers.core import ReadError
from driftcli.io.readers.te_dumps import TeClass, dump_name, load_dump, quantized_parts
from driftcli.measures.te_dumps import compare_dump, te_dumps

PKG = "transformer_engine.pytorch.tensor"


@pytest.fixture
def te(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], Any]]:
    """``make(module, qualname)``: a stand-in pickled under that name."""
    modules: dict[str, types.ModuleType] = {}

    def make(module: str, qualname: str, kind: str = "function") -> Any:
        parts = module.split(".")
        for n in range(1, len(parts) + 1):  # the pickler imports every package above it
            name = ".".join(parts[:n])
            if name not in modules:
                modules[name] = types.ModuleType(name)
                monkeypatch.setitem(sys.modules, name, modules[name])
        obj: Any = None
        if kind == "function":
            def obj(*args: object) -> None:
                raise AssertionError("a stand-in is never called")
        else:  # pickled as a plain object: the class, then what __getstate__ gives
            obj = type(qualname, (), {"__getstate__": lambda self: self.__dict__["state"]})
        obj.__module__, obj.__qualname__, obj.__name__ = module, qualname, qualname
        setattr(modules[module], qualname, obj)
        return obj

    yield make


class Reduced:
    """Pickles as ``fn(*args)``: TE's ``__reduce_ex__``."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        return (self.fn, self.args)


def built(cls: type, state: object) -> Any:
    """An object of a stand-in class, pickled as a plain object is: its class (NEWOBJ), then
    ``state`` (BUILD: a storage class's ``__dict__``, an older pybind11 enum's int)."""
    obj: Any = object.__new__(cls)
    obj.__dict__["state"] = state
    return obj


def dtype_tag(te: Any, value: int, style: str = "intenum") -> object:
    """TE's DType as each release pickles it."""
    if style == "intenum":
        return Reduced(te("transformer_engine.pytorch.constants", "DType", "class"), (value,))
    if style == "pybind":
        return Reduced(te("transformer_engine_torch", "DType", "class"), (value,))
    return built(te("transformer_engine_torch", "DType", "class"), value)


# --- TE's bytes, made as TE's kernels make them (torch's casts, TE's order) ----------------

def fp8_current(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8CurrentScaling E4M3: r = fl(448 / amax), codes = cvt.rn.satfinite(x · r),
    scale_inv = fl(1 / r)."""
    r = torch.tensor(448.0) / x.float().abs().amax()
    codes = (x.float() * r).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, (1 / r).reshape(1)


def mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 1 x 32 rowwise: e = cvt.rp to E8M0 of fl(amax · fl(1/448)), x · 2^-(e-127); the
    scales padded to (128, 4) as TE allocates them."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    q = blocks.abs().amax(-1) * (1 / torch.tensor(448.0))
    _, exp = torch.frexp(q)  # q = f · 2^exp, 0.5 <= f < 1: up to a power of two from bits
    up = torch.where(q == torch.ldexp(torch.full_like(q, 0.5), exp), exp - 1, exp)
    e = (up + 127).clamp(0, 254)
    codes = blocks * torch.ldexp(torch.ones_like(q), 127 - e).unsqueeze(-1)
    padded = torch.full((-(-m // 128) * 128, -(-(k // 32) // 4) * 4), 127, dtype=torch.uint8)
    padded[:m, :k // 32] = e.to(torch.uint8)
    return codes.reshape(m, k).to(torch.float8_e4m3fn).view(torch.uint8), padded


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fp4_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest E2M1, ties to even code, saturating (cvt.rn.satfinite.e2m1x2); a
    negative value that rounds to zero keeps its sign (TE's reference ``cast_to_fp4x2``
    gives it code 8)."""
    mag = v.abs().clamp(max=6.0)
    lo = torch.bucketize(mag, FP4, right=True) - 1
    hi = (lo + 1).clamp(max=7)
    dl, dh = mag - FP4[lo], FP4[hi] - mag
    code = torch.where((dh < dl) | ((dh == dl) & (hi % 2 == 0) & (hi != lo)), hi, lo)
    return code + 8 * (v < 0).to(torch.int64)


def nvfp4(x: torch.Tensor, per_row: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 1 x 16 rowwise in TE's order: S_enc = fl(2688 / amax), sb = rn_e4m3(amax_b ·
    fl(S_enc · fl(1/6))), x · fl(1 / fl(sb · fl(1 / S_enc))); codes packed low nibble first,
    sb padded to (128, 4)."""
    m, k = x.shape
    # row-scaled NVFP4: one amax a row, and so one S_enc a row
    amax = x.float().abs().amax(-1, keepdim=True) if per_row else x.float().abs().amax()
    enc = torch.tensor(2688.0) / amax
    blocks = x.float().reshape(m, k // 16, 16)
    sb = (blocks.abs().amax(-1) * (enc * (1 / torch.tensor(6.0)))).to(torch.float8_e4m3fn)
    mult = 1 / (sb.float() * (1 / enc))
    codes = fp4_codes(blocks * mult.unsqueeze(-1)).reshape(m, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    padded = torch.zeros((-(-m // 128) * 128, -(-(k // 16) // 4) * 4), dtype=torch.uint8)
    padded[:m, :k // 16] = sb.view(torch.uint8)
    return packed, padded, amax.reshape(-1)


def sample(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.logspace(-2, 1, shape[1])).bfloat16()


# --- the pickles, as each class's __reduce_ex__ writes them --------------------------------

def float8_tensor(te: Any, x: torch.Tensor, *, old: bool = False,
                  transpose: bool = True) -> object:
    codes, scale_inv = fp8_current(x)
    t = codes.T.contiguous() if transpose else None
    if old:  # before the module-level reconstructor: getattr(Float8Tensor, name), no transpose
        cls = te(f"{PKG}.float8_tensor", "Float8Tensor", "class")
        return Reduced(_ClassMethod(cls), (codes, dtype_tag(te, 7, "pybind"), scale_inv,
                                           x.dtype, x.shape))
    fn = te(f"{PKG}.float8_tensor", "_make_float8_tensor_in_reduce_ex")
    return Reduced(fn, (codes, dtype_tag(te, 7), scale_inv, x.dtype, x.shape, t))


class _ClassMethod:
    """Pickles as ``getattr(cls, '_make_in_reduce_ex')``, a bound classmethod's pickle."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, *args: object) -> None:
        raise AssertionError("a stand-in is never called")

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        return (getattr, (self.cls, "_make_in_reduce_ex"))


def quantizer(te: Any, module: str, name: str, **state: object) -> Any:
    """A quantizer, pickled as a plain object (its settings its state)."""
    return built(te(f"{PKG}.{module}", name, "class"), state)


def mxfp8_tensor(te: Any, x: torch.Tensor) -> Reduced:
    codes, scales = mxfp8(x)
    ccodes, cscales = mxfp8(x.T.contiguous())  # blocks down the columns, in x's layout
    fn = te(f"{PKG}.mxfp8_tensor", "_make_mxfp8_tensor_in_reduce_ex")
    return Reduced(fn, (codes, scales, ccodes.T.contiguous(), cscales.T.contiguous(),
                        dtype_tag(te, 7), x.dtype, x.shape,
                        quantizer(te, "mxfp8_tensor", "MXFP8Quantizer", rowwise_usage=True), False))


def nvfp4_tensor(te: Any, x: torch.Tensor, per_row: bool = False) -> Reduced:
    packed, sb, amax = nvfp4(x, per_row)
    cpacked, csb, camax = nvfp4(x.T.contiguous())
    fn = te(f"{PKG}.nvfp4_tensor", "_make_nvfp4_tensor_in_reduce_ex")
    q = quantizer(te, "nvfp4_tensor", "NVFP4Quantizer", with_rht=False, with_2d_quantization=False,
                  stochastic_rounding=False)
    return Reduced(fn, (x.shape, packed, sb, cpacked, csb, amax, camax, dtype_tag(te, 10),
                        x.dtype, q, False, per_row, False, 448))


def storage(te: Any, x: torch.Tensor, which: str) -> Any:
    """A storage class (``quantizer.internal``): the class, then its ``__dict__``."""
    if which == "float8":
        codes, scale_inv = fp8_current(x)
        cls = te(f"{PKG}.storage.float8_tensor_storage", "Float8TensorStorage", "class")
        return built(cls, {"_data": codes, "_scale_inv": scale_inv, "_transpose": None,
                           "_transpose_invalid": True, "_fp8_dtype": dtype_tag(te, 7, "old"),
                           "_quantizer": None})
    if which == "mxfp8":
        codes, scales = mxfp8(x)
        cls = te(f"{PKG}.storage.mxfp8_tensor_storage", "MXFP8TensorStorage", "class")
        return built(cls, {"_rowwise_data": codes, "_rowwise_scale_inv": scales,
                           "_columnwise_data": None, "_columnwise_scale_inv": None,
                           "_fp8_dtype": dtype_tag(te, 7), "_with_gemm_swizzled_scales": False})
    packed, sb, amax = nvfp4(x)
    cls = te(f"{PKG}.storage.nvfp4_tensor_storage", "NVFP4TensorStorage", "class")
    return built(cls, {"_rowwise_data": packed, "_rowwise_scale_inv": sb,
                       "_amax_rowwise": amax, "_columnwise_data": None,
                       "_fp4_dtype": dtype_tag(te, 10), "_with_gemm_swizzled_scales": False})


def save(path: Path, **entries: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(entries, path)
    return path


X = sample((64, 128), 1)


def test_both_layouts_name_step_rank_layer_and_role(tmp_path: Path, te: Any) -> None:
    root = tmp_path / "tensor_dumps"
    old = save(root / "rank_0" / "decoder.layers.0.fc1_activation_iter_000100.pt",
               high_precision=X)
    new = save(root / "rank_3" / "iter_000200" / "decoder_layers_0_fc2_wgrad.pt",
               high_precision=X * 2)
    save(root / "rank_3" / "notes_weight.pt", high_precision=X)  # in no iter_ folder
    assert dump_name(old) is not None and dump_name(new) is not None
    assert dump_name(root / "rank_3" / "notes_weight.pt") is None
    rows = te_dumps([root])
    got = {(r.step, r.rank, r.layer, r.tensor, r.role, r.direction, r.error) for r in rows}
    assert got == {(100, 0, "decoder.layers.0.fc1", "activation", "activation", "none", None),
                   (200, 3, "decoder_layers_0_fc2", "wgrad", "gradient", "none", None)}
    # the scans read the new layout's high_precision as a drift dump's tensor too
    refs = {t.name: t for t in open_inputs([new]).tensors}
    assert (refs["decoder_layers_0_fc2.wgrad"].step, refs["decoder_layers_0_fc2.wgrad"].role) \
        == (200, "gradient")
    assert torch.equal(refs["decoder_layers_0_fc2.wgrad"].read(), X * 2)


@pytest.mark.parametrize("build,te_class,directions,preset", [
    (lambda te: float8_tensor(te, X), "Float8Tensor", {"rowwise", "columnwise"},
     "te/float8_current"),
    (lambda te: float8_tensor(te, X, old=True), "Float8Tensor", {"rowwise"},
     "te/float8_current"),
    (lambda te: mxfp8_tensor(te, X), "MXFP8Tensor", {"rowwise", "columnwise"}, "te/mxfp8"),
    (lambda te: nvfp4_tensor(te, X), "NVFP4Tensor", {"rowwise", "columnwise"}, "te/nvfp4"),
    (lambda te: nvfp4_tensor(te, X, per_row=True), "NVFP4Tensor", {"rowwise", "columnwise"},
     "te/nvfp4_row"),
    (lambda te: storage(te, X, "float8"), "Float8Tensor", {"rowwise"}, "te/float8_current"),
    (lambda te: storage(te, X, "mxfp8"), "MXFP8Tensor", {"rowwise"}, "te/mxfp8"),
    (lambda te: storage(te, X, "nvfp4"), "NVFP4Tensor", {"rowwise"}, "te/nvfp4"),
], ids=["float8", "float8-classmethod", "mxfp8", "nvfp4", "nvfp4-row-scaled", "float8-storage",
        "mxfp8-storage", "nvfp4-storage"])
def test_every_class_is_read_and_agrees_with_drifts_preset(
        tmp_path: Path, te: Any, build: Callable[[Any], object], te_class: str,
        directions: set[str], preset: str) -> None:
    path = save(tmp_path / "rank_0" / "iter_000007" / "fc1_activation.pt", high_precision=X,
                quantized=build(te))
    parts = quantized_parts(load_dump(path)["quantized"], str(path))
    assert parts.te_class is TeClass(te_class)
    rows = compare_dump(path)
    assert {r.direction for r in rows} == directions
    for r in rows:
        # the columnwise copy of a row-scaled tensor is scaled per tensor (TE: rows only)
        want = "te/nvfp4" if r.direction == "columnwise" and preset == "te/nvfp4_row" \
            else preset
        assert (r.te_class, r.preset, r.error, r.step) == (te_class, want, None, 7), r
        assert r.n_elements == X.numel()
        # TE's bytes, made by torch's casts in TE's order, are drift's preset's, bit for bit
        assert (r.n_codes_differ, r.n_scales_differ) == (0, 0), r
        blocks = {"Float8Tensor": 1, "MXFP8Tensor": X.numel() // 32,
                  "NVFP4Tensor": X.numel() // 16}[te_class]
        assert r.n_blocks == blocks
        if te_class == "NVFP4Tensor":  # the first row's amax where each row has its own
            whole = X.float().abs() if r.preset == "te/nvfp4" else X.float()[0].abs()
            assert r.amax_te == r.amax_drift == float(whole.amax())


@pytest.mark.parametrize("build,flip", [
    (lambda te, x: float8_tensor(te, x), "float8"),
    (lambda te, x: mxfp8_tensor(te, x), "mxfp8"),
    (lambda te, x: nvfp4_tensor(te, x), "nvfp4")])
def test_a_planted_code_and_scale_are_found_and_named(
        tmp_path: Path, te: Any, build: Callable[[Any, torch.Tensor], Any], flip: str) -> None:
    q = build(te, X)
    args = list(q.args)
    data_at, scale_at = {"float8": (0, 2), "mxfp8": (0, 1), "nvfp4": (1, 2)}[flip]
    data, scales = args[data_at].clone(), args[scale_at].clone()
    data[5, 9] ^= 1  # one code's low bit (NVFP4: the element at [5, 18], low nibble)
    if flip == "float8":
        scales[0] = torch.nextafter(scales[0], torch.tensor(1.0))
    else:
        scales[3, 2] += 1  # one block's scale one code up
    args[data_at], args[scale_at] = data, scales
    path = save(tmp_path / "l_weight_iter_000001.pt", high_precision=X,
                quantized=Reduced(q.fn, tuple(args)))
    row = next(r for r in compare_dump(path) if r.direction == "rowwise")
    was = int(q.args[data_at][5, 9]) & (15 if flip == "nvfp4" else 255)
    column = 18 if flip == "nvfp4" else 9
    assert row.n_codes_differ == 1 and row.codes_differ == 1 / X.numel()
    assert row.first_code_differ == f"[5, {column}]: TE {was ^ 1:#04x}, drift {was:#04x}"
    block = "[0, 0]" if flip == "float8" else "[3, 2]"  # Float8's one tensor scale
    assert row.n_scales_differ == 1
    assert str(row.first_scale_differ).startswith(f"{block}: TE ")


def test_nothing_in_the_pickle_runs(tmp_path: Path, te: Any) -> None:
    import os

    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {marker}",))

    # GLOBAL posix.system and REDUCE, as the entry and as a part of a TE tensor's arguments
    fn = te(f"{PKG}.float8_tensor", "_make_float8_tensor_in_reduce_ex")
    a = save(tmp_path / "a_activation_iter_000001.pt", high_precision=X, quantized=Hostile())
    b = save(tmp_path / "b_activation_iter_000001.pt", high_precision=X,
             quantized=Reduced(fn, (Hostile(), dtype_tag(te, 7), torch.ones(1), X.dtype,
                                    X.shape)))
    import pickletools
    import zipfile

    with zipfile.ZipFile(a) as zf:  # the pickle does name os.system and call it
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(pkl)]
    assert ("GLOBAL", f"{os.system.__module__} system") in ops and ("REDUCE", None) in ops
    rows = te_dumps([tmp_path])
    assert not marker.exists()
    errors = {Path(r.source).name: r.error for r in rows}
    assert str(errors[a.name]).startswith("entry 'quantized' is a posix.system, not a Float8Tensor")
    assert errors[b.name] == "the Float8Tensor's _data is a pickled posix.system, not a tensor"
    with pytest.raises(ReadError, match="not a Float8Tensor"):
        quantized_parts(load_dump(a)["quantized"], str(a))


def test_the_command_writes_the_table_and_names_the_difference(tmp_path: Path, te: Any) -> None:
    import json

    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from driftcli.cli import app

    dumps = tmp_path / "tensor_dumps" / "rank_1"
    save(dumps / "iter_000010" / "fc1_activation.pt", high_precision=X,
         quantized=mxfp8_tensor(te, X))
    q = mxfp8_tensor(te, X)
    planted = q.args[0].clone()
    planted[2, 3] ^= 0x80  # the sign bit of one code
    save(dumps / "iter_000020" / "fc1_activation.pt", high_precision=X,
         quantized=Reduced(q.fn, (planted, *q.args[1:])))
    runner = CliRunner()
    result = runner.invoke(app, ["te-dumps", str(tmp_path / "tensor_dumps"), "--out",
                                 str(tmp_path / "out"), "--json"])
    assert result.exit_code == 1, result.output  # a difference found
    summary = json.loads(result.output)
    assert (summary["files"], summary["compared"], summary["n_codes_differ"],
            summary["n_scales_differ"]) == (2, 4, 1, 0)
    was = int(q.args[0][2, 3])
    assert [(Path(d["source"]).parent.name, d["direction"], d["first_code_differ"])
            for d in summary["differ"]] == [
        ("iter_000020", "rowwise", f"[2, 3]: TE {was ^ 0x80:#04x}, drift {was:#04x}")]
    table = pq.read_table(tmp_path / "out" / "te-dumps.parquet").to_pylist()
    assert sorted((r["step"], r["rank"], r["direction"], r["n_codes_differ"]) for r in table) \
        == [(10, 1, "columnwise", 0), (10, 1, "rowwise", 0), (20, 1, "columnwise", 0),
            (20, 1, "rowwise", 1)]
    # drift report gates on the table as on any other
    result = runner.invoke(app, ["report", str(tmp_path / "out"), "--fail-on",
                                 "n_codes_differ > 0 or n_scales_differ > 0"])
    assert result.exit_code == 1 and "1 row(s) of te-dumps" in result.output
    # a folder with no dump: one line, exit 2, nothing written
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["te-dumps", str(empty), "--out", str(tmp_path / "out2")])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: no Transformer Engine dump under {empty}")
    assert not (tmp_path / "out2" / "te-dumps.parquet").exists()


def test_codes_that_do_not_fit_the_tensor_are_an_error_not_a_crash(tmp_path: Path,
                                                                    te: Any) -> None:
    q = mxfp8_tensor(te, X)
    short = q.args[0].reshape(-1)[:100].clone()  # 100 codes for a 64 x 128 tensor
    path = save(tmp_path / "l_weight_iter_000001.pt", high_precision=X,
                quantized=Reduced(q.fn, (short, *q.args[1:])))
    (row,) = compare_dump(path)
    assert (row.te_class, row.direction, row.n_elements) == ("MXFP8Tensor", "none", None)
    assert str(row.error).startswith("TE's codes do not fit the [64, 128] tensor")
