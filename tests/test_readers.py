"""Readers: every input kind read back bit for bit, row slices, folders, shards, dumps, errors."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import driftcli
from driftcli.errors import DriftError
from driftcli.io.readers import DUMP_KEY, Inputs, ReadError, TensorRef, open_inputs
from driftcli.measures import MEASURES
from driftcli.measures.scan import scan

# a warning here means a reader took a shortcut (e.g. a tensor over a read-only mapping)
pytestmark = pytest.mark.filterwarnings("error")

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def errs(inputs: Inputs) -> tuple[tuple[str, str], ...]:
    """The (source, message) of each error of ``inputs``."""
    return tuple((e.source, e.message) for e in inputs.errors)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as integers, so -0.0 and NaN payloads compare exactly."""
    return t.view(_INT_VIEW[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def from_bits(codes: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor with exactly these bit patterns (NaN payloads, -0.0, inf)."""
    return torch.tensor(codes, dtype=torch.int64).to(_INT_VIEW[dtype.itemsize]).view(dtype)


def seeded(shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
           seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def specials(dtype: torch.dtype) -> torch.Tensor:
    """-0.0, a quiet NaN with a payload, a negative NaN, inf and -inf, then ordinary values."""
    codes = {
        torch.bfloat16: [0x8000, 0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x3F80, 0x0001],
        torch.float16: [0x8000, 0x7E01, 0xFC01, 0x7C00, 0xFC00, 0x3C00, 0x0001],
        torch.float32: [0x80000000, 0x7FA00001, 0xFFC00003, 0x7F800000, 0xFF800000,
                        0x3F800000, 0x00000001],
        torch.float64: [1 << 63, 0x7FF0000000000001, 0xFFF8000000000003, 0x7FF0 << 48,
                        0xFFF0 << 48, 0x3FF0 << 48, 1],
    }[dtype]
    # two's-complement for the signed integer view of patterns with the top bit set
    width = 8 * dtype.itemsize
    return from_bits([c - (1 << width) if c >> (width - 1) else c for c in codes], dtype)


def raw_safetensors(path: Path, header: dict[str, object], data: bytes,
                    length: int | None = None) -> Path:
    """A safetensors file written by hand (for corrupt and unusual headers)."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def names(inputs: Inputs) -> list[str]:
    return [r.name for r in inputs.tensors]


def by_name(inputs: Inputs) -> dict[str, TensorRef]:
    return {r.name: r for r in inputs.tensors}


# --- one writer per kind, so every kind runs through the same checks --------------------


def _write_npy(folder: Path, tensors: dict[str, torch.Tensor],
               convert: Callable[[np.ndarray], np.ndarray]) -> Path:
    folder.mkdir()
    for name, t in tensors.items():
        np.save(folder / f"{name}.npy", convert(t.numpy()))
    return folder


def _fortran(a: np.ndarray) -> np.ndarray:
    return np.asfortranarray(a) if a.ndim >= 2 else a


WRITERS: dict[str, Callable[[Path, dict[str, torch.Tensor]], Path]] = {
    "safetensors": lambda d, ts: (save_file(ts, d / "t.safetensors"), d / "t.safetensors")[1],
    "pt": lambda d, ts: (torch.save(ts, d / "t.pt"), d / "t.pt")[1],
    "pt-legacy": lambda d, ts: (torch.save(ts, d / "t.pt", _use_new_zipfile_serialization=False),
                                d / "t.pt")[1],
    "bin": lambda d, ts: (torch.save(ts, d / "pytorch_model.bin"), d / "pytorch_model.bin")[1],
    "npz": lambda d, ts: (np.savez(d / "t.npz", **{k: v.numpy() for k, v in ts.items()}),
                          d / "t.npz")[1],
    "npz-compressed": lambda d, ts: (
        np.savez_compressed(d / "t.npz", **{k: v.numpy() for k, v in ts.items()}),
        d / "t.npz")[1],
    "npy": lambda d, ts: _write_npy(d / "npy", ts, lambda a: a),
    "npy-fortran": lambda d, ts: _write_npy(d / "npy", ts, _fortran),
    "npy-big-endian": lambda d, ts: _write_npy(
        d / "npy", ts, lambda a: a.astype(a.dtype.newbyteorder(">"))),
}
NUMPY_KINDS = {"npz", "npz-compressed", "npy", "npy-fortran", "npy-big-endian"}
ALL_KINDS = list(WRITERS)


def write(kind: str, folder: Path, tensors: dict[str, torch.Tensor]) -> Inputs:
    return open_inputs([WRITERS[kind](folder, tensors)])


# --- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_every_kind_reads_back_bit_for_bit(tmp_path: Path, kind: str) -> None:
    tensors = {
        "f32": specials(torch.float32), "f16": specials(torch.float16),
        "f64": specials(torch.float64), "w": seeded((4, 3), seed=1),
        "i64": seeded((5,), torch.int64), "i8": seeded((2, 2), torch.int8),
        "u8": torch.tensor([0, 255, 7], dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
    }
    if kind not in NUMPY_KINDS:  # numpy has no bfloat16 or float8
        tensors["bf16"] = specials(torch.bfloat16)
    if kind not in NUMPY_KINDS | {"pt-legacy"}:  # torch cannot load float8 from legacy files
        tensors |= {"e4m3": from_bits(list(range(256)), torch.float8_e4m3fn),
                    "e5m2": from_bits(list(range(256)), torch.float8_e5m2)}
    inputs = write(kind, tmp_path, tensors)
    assert errs(inputs) == () and inputs.excluded == 0
    assert sorted(names(inputs)) == sorted(tensors)
    for ref in inputs.tensors:
        want = tensors[ref.name]
        assert ref.dtype == str(want.dtype).removeprefix("torch.")
        assert ref.shape == tuple(want.shape) and ref.numel == want.numel()
        assert ref.nbytes == want.numel() * want.element_size()
        got = ref.read()
        assert same_bits(got, want), ref.name


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_row_slices_equal_python_slicing(tmp_path: Path, kind: str) -> None:
    full = seeded((5, 3, 2), seed=2)
    ints = seeded((6,), torch.int32, seed=3)
    refs = by_name(write(kind, tmp_path, {"x": full, "n": ints}))
    x, n = refs["x"], refs["n"]
    for start, stop in [(1, 3), (0, 1), (4, None), (-2, None), (2, 99), (4, 2), (5, 5)]:
        assert same_bits(x.read(start, stop), full[start:stop]), (start, stop)
    assert x.read(4, 2).shape == (0, 3, 2)
    assert same_bits(n.read(2, 5), ints[2:5])


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_zero_d_and_empty_tensors(tmp_path: Path, kind: str) -> None:
    tensors = {"scalar": torch.tensor(-0.0), "none": torch.zeros(0, 4),
               "cols": torch.zeros(3, 0, dtype=torch.float16), "nan": torch.tensor(float("nan"))}
    refs = by_name(write(kind, tmp_path, tensors))
    scalar = refs["scalar"]
    assert scalar.shape == () and scalar.numel == 1 and scalar.nbytes == 4
    assert same_bits(scalar.read(), tensors["scalar"])  # -0.0, not +0.0
    assert bits(scalar.read()).item() == -(1 << 31)
    assert torch.isnan(refs["nan"].read()).item()
    assert refs["none"].numel == 0 and refs["none"].nbytes == 0
    assert refs["none"].read().shape == (0, 4)
    assert refs["cols"].read(1, 3).shape == (2, 0)
    assert refs["cols"].read().dtype == torch.float16


@pytest.mark.parametrize("kind", ["safetensors", "pt", "npy", "npy-fortran", "npz",
                                  "npz-compressed"])
def test_a_row_slice_holds_only_its_rows(tmp_path: Path, kind: str) -> None:
    big = seeded((4096, 64), seed=4)  # 1 MiB
    ref = write(kind, tmp_path, {"big": big}).tensors[0]
    part = ref.read(1000, 1010)
    assert same_bits(part, big[1000:1010])
    assert part.untyped_storage().nbytes() == 10 * 64 * 4  # just the slice, not the tensor
    assert part.is_contiguous()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_safetensors_reads_leave_no_mapping_open(tmp_path: Path) -> None:
    ref = write("safetensors", tmp_path, {"w": seeded((64, 64))}).tensors[0]
    part = ref.read(3, 9)
    assert part.shape == (6, 64)
    assert ref.source not in Path("/proc/self/maps").read_text()


def test_int_and_bool_tensors_are_listed_but_not_float(tmp_path: Path) -> None:
    refs = by_name(write("safetensors", tmp_path, {
        "ids": torch.arange(10), "mask": torch.ones(3, dtype=torch.bool),
        "w": seeded((2, 2), torch.bfloat16), "q": torch.zeros(4, dtype=torch.float8_e5m2)}))
    assert not refs["ids"].is_float and refs["ids"].dtype == "int64"
    assert not refs["mask"].is_float and refs["mask"].dtype == "bool"
    assert refs["w"].is_float and refs["q"].is_float
    assert torch.equal(refs["ids"].read(7, 10), torch.tensor([7, 8, 9]))


def test_dtype_codes_torch_lacks_are_listed_and_refuse_to_read(tmp_path: Path) -> None:
    path = raw_safetensors(tmp_path / "odd.safetensors", {
        "f4": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
        "u32": {"dtype": "U32", "shape": [1], "data_offsets": [2, 6]},
    }, b"\x12\x34" + struct.pack("<I", 4_000_000_000))
    refs = by_name(open_inputs([path]))
    assert refs["f4"].dtype == "F4" and not refs["f4"].is_float and refs["f4"].nbytes == 2
    with pytest.raises(ReadError, match=r"tensor f4 is stored as F4"):
        refs["f4"].read()
    assert refs["u32"].dtype == "uint32"
    assert refs["u32"].read().to(torch.int64).item() == 4_000_000_000


# --- PyTorch files --------------------------------------------------------------------------


class Custom:
    """A class only arbitrary unpickling can rebuild."""

    def __init__(self) -> None:
        self.x = 1


def test_nested_pt_is_flattened_to_dotted_names(tmp_path: Path) -> None:
    w0, w1, norm = seeded((3, 2), seed=5), seeded((2, 2), seed=6), seeded((2,), torch.bfloat16)
    state = {"model": {"layers": [{"weight": w0}, {"weight": w1}], "norm": (norm,)},
             "step": 7, "name": "run", "opt": {0: {"exp_avg": w0 * 2}}, "nothing": None}
    torch.save(state, tmp_path / "ckpt.pt")
    torch.save(seeded((4,), seed=7), tmp_path / "bare.pt")
    inputs = open_inputs([tmp_path / "ckpt.pt", tmp_path / "bare.pt"])
    assert names(inputs) == ["model.layers.0.weight", "model.layers.1.weight", "model.norm.0",
                             "opt.0.exp_avg", "bare"]
    refs = by_name(inputs)
    assert same_bits(refs["model.layers.1.weight"].read(1, 2), w1[1:2])
    assert same_bits(refs["model.norm.0"].read(), norm)
    assert same_bits(refs["opt.0.exp_avg"].read(), w0 * 2)
    assert same_bits(refs["bare"].read(), seeded((4,), seed=7))


def test_pt_loads_only_with_weights_only_and_mmap(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    real = torch.load

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", spy)
    torch.save({"a": torch.ones(2)}, tmp_path / "zip.pt")
    torch.save({"a": torch.ones(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    inputs = open_inputs([tmp_path / "zip.pt", tmp_path / "old.pt"])
    assert len(inputs.tensors) == 2
    assert [c["weights_only"] for c in calls] == [True, True]
    assert [c["mmap"] for c in calls] == [True, False]  # old non-zip files cannot be mapped
    assert all(c["map_location"] == "cpu" for c in calls)


@pytest.mark.parametrize("zipped", [True, False])
def test_pickled_custom_class_is_refused_and_others_still_read(tmp_path: Path,
                                                               zipped: bool) -> None:
    torch.save({"w": torch.ones(2), "extra": Custom()}, tmp_path / "a.pt",
               _use_new_zipfile_serialization=zipped)
    torch.save({"w": torch.ones(2)}, tmp_path / "b.pt")
    inputs = open_inputs([tmp_path])
    assert [(r.source, r.name) for r in inputs.tensors] == [(str(tmp_path / "b.pt"), "w")]
    assert inputs.files == (tmp_path / "a.pt", tmp_path / "b.pt")
    [(source, message)] = errs(inputs)
    assert source == str(tmp_path / "a.pt")
    assert "a.pt needs arbitrary unpickling" in message and "Custom" in message
    assert "drift refuses (it can run code)" in message
    assert "torch.save(model.state_dict(), ...)" in message and "\n" not in message


def test_garbage_pt_goes_to_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint" * 8)  # torch: "Unsupported operand"
    (tmp_path / "empty.pt").write_bytes(b"")
    inputs = open_inputs([tmp_path / "junk.bin", tmp_path / "empty.pt"])
    assert inputs.tensors == ()
    assert [s for s, _ in errs(inputs)] == [str(tmp_path / "junk.bin"), str(tmp_path / "empty.pt")]
    assert all("PyTorch file" in m and "\n" not in m for _, m in errs(inputs))
    # neither begins as torch.save's files do: said so, not torch's "Unsupported operand"
    assert all("not a PyTorch file" in m for _, m in errs(inputs))
    assert not any("unpickling" in m for _, m in errs(inputs))


def test_pt_rewritten_after_listing_raises_on_read(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(4)}, path)
    [ref] = open_inputs([path]).tensors
    torch.save({"w": torch.ones(5)}, path)
    os.utime(path, ns=(0, 0))  # a changed mtime even where the clock is coarse
    with pytest.raises(ReadError, match=r"w\.pt: tensor w changed since drift listed it"):
        ref.read()


# --- NumPy files ----------------------------------------------------------------------------


def test_npz_member_names_and_object_arrays_refused(tmp_path: Path) -> None:
    good = seeded((3, 2), seed=8).numpy()
    np.savez(tmp_path / "run.npz", good=good, bad=np.array([{"a": 1}], dtype=object))
    np.save(tmp_path / "objs.npy", np.array([None, 1], dtype=object), allow_pickle=True)
    inputs = open_inputs([tmp_path / "run.npz", tmp_path / "objs.npy"])
    assert names(inputs) == ["good"]
    assert np.array_equal(inputs.tensors[0].read().numpy(), good)
    messages = dict(errs(inputs))
    assert "member bad.npy holds Python objects" in messages[str(tmp_path / "run.npz")]
    assert "arbitrary unpickling" in messages[str(tmp_path / "objs.npy")]


def _npy_bytes(shape: tuple[int, ...], data: bytes, descr: str = "<f4") -> bytes:
    """An .npy file whose header says ``shape`` over whatever ``data`` really is."""
    fh = io.BytesIO()
    np.lib.format.write_array_header_1_0(fh, {"descr": descr, "fortran_order": False,
                                              "shape": shape})
    return fh.getvalue() + data


def test_truncated_npy_is_an_error_naming_the_tensor(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(100, dtype=np.float32))
    data = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "x.npy").write_bytes(data[:-40])
    inputs = open_inputs([tmp_path / "x.npy"])
    assert inputs.tensors == ()
    assert errs(inputs) == ((str(tmp_path / "x.npy"), f"{tmp_path / 'x.npy'}: tensor x needs "
                              "bytes 128..528 but the file has 488 bytes (truncated?); re-save "
                              "or re-download it"),)


def test_npy_truncated_after_listing_raises_on_read(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(100, dtype=np.float32))
    [ref] = open_inputs([tmp_path / "x.npy"]).tensors
    (tmp_path / "x.npy").write_bytes((tmp_path / "x.npy").read_bytes()[:-40])
    with pytest.raises(ReadError, match=r"x\.npy: tensor x needs bytes 128\.\.528 but the file "
                                        r"has 488 bytes"):
        ref.read(0, 2)


@pytest.mark.parametrize(("shape", "error"), [
    ((1 << 40, 1 << 40), "tensor big needs bytes 128..4835703278458516698824832 but the file "
                         "has 136 bytes (truncated?)"),
    ((-1, 2), "corrupt .npy header in {path} (shape (-1, 2) is not a tuple of non-negative "
              "integers)"),
])
def test_npy_shape_is_checked_against_the_bytes_before_any_allocation(
        tmp_path: Path, shape: tuple[int, ...], error: str) -> None:
    path = tmp_path / "big.npy"
    path.write_bytes(_npy_bytes(shape, bytes(8)))
    inputs = open_inputs([path])
    assert inputs.tensors == ()
    [(source, message)] = errs(inputs)
    assert source == str(path) and error.format(path=path) in message


def test_npy_header_that_does_not_parse_is_a_clean_error(tmp_path: Path) -> None:
    head = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4"  # unclosed
    head += " " * (-(len(head) + 11) % 64) + "\n"
    path = tmp_path / "x.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head.encode()
                     + bytes(48))
    # numpy's header parser raises tokenize's TokenError here, which is no ValueError
    [(source, message)] = errs(open_inputs([path]))
    assert source == str(path)
    assert message.startswith(f"corrupt .npy header in {path} (the header does not parse "
                              "(TokenError: ")


_FILE_SIZE, _COMPRESS_SIZE = ("<I", 24), ("<I", 20)
"""Fields of a zip central directory entry: (struct format, offset)."""


def _patch_central(archive: Path, member: str, field: tuple[str, int], value: int) -> None:
    """Set one field of ``member``'s entry in the zip's central directory."""
    data = bytearray(archive.read_bytes())
    at = data.index(b"PK\x01\x02")  # the first entry
    while True:
        (name_len, extra, comment) = struct.unpack_from("<HHH", data, at + 28)
        if data[at + 46:at + 46 + name_len].decode() == member:
            struct.pack_into(field[0], data, at + field[1], value)
            archive.write_bytes(bytes(data))
            return
        at += 46 + name_len + extra + comment


def test_npz_member_sizes_are_checked_and_the_others_still_listed(tmp_path: Path) -> None:
    good = seeded((3, 2), seed=8).numpy()
    path = tmp_path / "run.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("good.npy", _npy_bytes(good.shape, good.tobytes()))
        zf.writestr("liar.npy", _npy_bytes((1 << 40, 1 << 40), bytes(8)))  # shape over 8 bytes
        zf.writestr("claims.npy", _npy_bytes((2,), bytes(8)))
        zf.writestr("packed.npy", _npy_bytes((4,), bytes(16)), zipfile.ZIP_DEFLATED)
        zf.writestr("bz.npy", _npy_bytes((4,), bytes(16)), zipfile.ZIP_BZIP2)
        zf.writestr("notes.txt", b"not an array")
        zf.writestr("long.npy", _npy_bytes((4,), bytes(16)))
    _patch_central(path, "claims.npy", _FILE_SIZE, 1 << 30)  # stored, yet 1 GiB in 136 bytes
    _patch_central(path, "long.npy", _COMPRESS_SIZE, 1 << 20)
    _patch_central(path, "long.npy", _FILE_SIZE, 1 << 20)
    inputs = open_inputs([path])
    assert names(inputs) == ["good", "packed"]
    assert np.array_equal(by_name(inputs)["good"].read().numpy(), good)
    assert by_name(inputs)["packed"].read().tolist() == [0.0] * 4
    size = path.stat().st_size
    assert [m for _, m in errs(inputs)] == [f"{path}: member {m}; re-save it with numpy.savez"
                                             for m in [
        "liar.npy holds 136 bytes, but its header's shape [1099511627776, 1099511627776] "
        "needs 4835703278458516698824832",
        "claims.npy is stored uncompressed, yet claims 1073741824 bytes in 136",
        "bz.npy is compressed with zip method 12; numpy.savez writes stored or deflated "
        "members",
        "notes.txt is not an .npy array",
        f"long.npy runs past the end of the archive ({size} bytes; truncated?)"]]
    assert errs(open_inputs([path], include=["good", "packed"])) == ()


def test_deflated_npz_member_cannot_claim_more_than_deflate_holds(tmp_path: Path) -> None:
    path = tmp_path / "z.npz"
    np.savez_compressed(path, z=np.zeros(1 << 20, np.float32))  # 4 MiB of zeros, deflated
    [ref] = open_inputs([path]).tensors
    assert ref.read(-2).tolist() == [0.0, 0.0]  # a real ratio of about 1000 is fine
    info = zipfile.ZipFile(path).getinfo("z.npy")
    _patch_central(path, "z.npy", _FILE_SIZE, 1033 * info.compress_size)
    [(_, message)] = errs(open_inputs([path]))
    assert f"member z.npy claims {1033 * info.compress_size} bytes, more than its " \
           f"{info.compress_size} deflated bytes can hold" in message


# --- safetensors: the header as strictly as the safetensors library ---------------------


def refused_by_safetensors(path: Path) -> bool:
    """Whether the safetensors library refuses the file (reading every tensor)."""
    try:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                f.get_tensor(key)
    except SafetensorError:
        return True
    return False


def raw_text(path: Path, text: bytes, data: bytes, delta: int = 0) -> Path:
    """A safetensors file from header bytes as they are, its length field off by ``delta``."""
    path.write_bytes(struct.pack("<Q", len(text) + delta) + text + data)
    return path


def _offsets(path: Path) -> tuple[int, dict[str, list[int]]]:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + n])
    return 8 + n, {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}


_TWO = {"u": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "h": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}}
# the data starts with a space, so the JSON still parses with the length one byte too long
_TWO_DATA = b" \x00\x80\x3f" + struct.pack("<2e", 1.5, -2.0)


@pytest.mark.parametrize(("delta", "detail"), [
    (-1, "the file holds 9 bytes of data after the header but the tensors' data_offsets "
         "cover 8 (a wrong header length, or bytes appended)"),
    (1, "the tensors need 8 bytes of data but the file holds 7 after a header that ends in 2 "
        "spaces (truncated, or a header length too long)"),
])
def test_header_length_one_byte_off_is_a_file_error(tmp_path: Path, delta: int,
                                                    detail: str) -> None:
    text = json.dumps(_TWO).encode() + b" "  # one space of padding: it parses one byte short
    sound = raw_text(tmp_path / "sound.safetensors", text, _TWO_DATA)
    assert not refused_by_safetensors(sound)
    refs = by_name(open_inputs([sound]))
    assert refs["u"].read().tolist() == [32, 0, 128, 63] and refs["h"].read().tolist() == [
        1.5, -2.0]
    path = raw_text(tmp_path / "x.safetensors", text, _TWO_DATA, delta)
    assert refused_by_safetensors(path)
    inputs = open_inputs([path])
    assert inputs.tensors == ()  # every tensor would be read one byte off
    assert errs(inputs) == ((str(path), f"corrupt safetensors header in {path}: {detail}; "
                              "re-save or re-download it"),)


@pytest.mark.parametrize(("offsets", "data_len", "detail"), [
    ({"a": [0, 8], "b": [4, 12]}, 12,
     "tensor 'b' (data_offsets [4, 12]) overlaps tensor 'a', which ends at 8"),
    ({"a": [0, 8], "b": [12, 20]}, 20, "bytes 8..12 of the data belong to no tensor (a gap "
                                       "before tensor 'b')"),
    ({"a": [4, 12], "b": [12, 20]}, 20, "bytes 0..4 of the data belong to no tensor (a gap "
                                        "before tensor 'a')"),
    ({"a": [0, 8], "b": [8, 16]}, 20, "the file holds 20 bytes of data after the header but "
                                      "the tensors' data_offsets cover 16"),
    ({"a": [0, 8], "b": [16, 8]}, 16, "tensor 'b' has data_offsets [16, 8], which end before "
                                      "they begin"),
])
def test_offsets_that_do_not_tile_the_data_are_a_file_error(
        tmp_path: Path, offsets: dict[str, list[int]], data_len: int, detail: str) -> None:
    header = {k: {"dtype": "F32", "shape": [2], "data_offsets": v} for k, v in offsets.items()}
    path = raw_safetensors(tmp_path / "x.safetensors", header, bytes(data_len))
    assert refused_by_safetensors(path)
    inputs = open_inputs([path])
    assert inputs.tensors == ()
    [(source, message)] = errs(inputs)
    assert source == str(path)
    assert message.startswith(f"corrupt safetensors header in {path}: {detail}")


def _three(tmp_path: Path, middle: dict[str, object], middle_bytes: int) -> Path:
    """a (F32), the entry under test, c (BF16), in that order, their ranges tiling the data."""
    a, c = struct.pack("<2f", 1.5, -2.0), struct.pack("<2H", 0x3F80, 0xC000)  # bf16 1, -2
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "m": {**middle, "data_offsets": [8, 8 + middle_bytes]},
              "c": {"dtype": "BF16", "shape": [2], "data_offsets": [8 + middle_bytes,
                                                                    12 + middle_bytes]}}
    return raw_safetensors(tmp_path / "x.safetensors", header,
                           a + bytes(range(middle_bytes)) + c)


@pytest.mark.parametrize(("middle", "middle_bytes", "detail"), [
    ({"dtype": "F99", "shape": [2]}, 8, 'has dtype code "F99", which safetensors does not '
                                        "define"),
    ({"dtype": "f32", "shape": [2]}, 8, 'has dtype code "f32", which safetensors does not '
                                        "define"),
    ({"shape": [2]}, 8, "has dtype code null, which safetensors does not define"),
    ({"dtype": "F32", "shape": [3]}, 8, "has 8 data bytes but shape [3] of F32 needs 12"),
    ({"dtype": "F32", "shape": [1]}, 8, "has 8 data bytes but shape [1] of F32 needs 4"),
    ({"dtype": "I64", "shape": [3]}, 16, "has 16 data bytes but shape [3] of I64 needs 24"),
    ({"dtype": "F32", "shape": [-2]}, 8, "has shape [-2], not a list of non-negative "
                                         "integers"),
    ({"dtype": "F32", "shape": [2.0]}, 8, "has shape [2.0], not a list of non-negative "
                                          "integers"),
    ({"dtype": "U8", "shape": [True, 8]}, 8, "has shape [true, 8], not a list of "
                                             "non-negative integers"),
    ({"dtype": "F32", "shape": [1 << 40, 1 << 40]}, 8,
     "has 8 data bytes but shape [1099511627776, 1099511627776] of F32 needs more than 8"),
    ({"dtype": "F4", "shape": [3]}, 2, "has shape [3] of F4, which is not a whole number of "
                                       "bytes"),
])
def test_a_wrong_entry_in_a_sound_layout_is_an_error_for_that_tensor(
        tmp_path: Path, middle: dict[str, object], middle_bytes: int, detail: str) -> None:
    path = _three(tmp_path, middle, middle_bytes)
    assert refused_by_safetensors(path)
    inputs = open_inputs([path])
    # the layout leaves no doubt where the neighbours' bytes are
    assert names(inputs) == ["a", "c"]
    refs = by_name(inputs)
    assert refs["a"].read().tolist() == [1.5, -2.0] and refs["c"].read().tolist() == [1.0, -2.0]
    assert errs(inputs) == ((str(path), f"{path}: tensor 'm' {detail}; the file is corrupt, "
                              "re-save or re-download it"),)
    assert inputs.excluded == 0
    dropped = open_inputs([path], exclude=["m"])  # a broken tensor left out is not an error
    assert errs(dropped) == () and dropped.excluded == 1


def test_scan_gives_an_error_row_for_the_broken_tensor_and_measures_the_others(
        tmp_path: Path) -> None:
    # an integer tensor: scan skips those unread, so only the listing can tell it is broken
    path = _three(tmp_path, {"dtype": "I64", "shape": [3]}, 16)
    found = scan([path], ["fp8_e4m3"])
    assert [(r.ref.name if r.ref else None, r.error is None) for r in found.results] == [
        (None, False), ("a", True), ("c", True)]
    [bad] = found.errors
    assert bad.source == str(path) and "tensor 'm' has 16 data bytes but shape [3] of I64 " \
                                       "needs 24" in (bad.error or "")
    assert found.skipped == {str(path): 0}
    # the table's error row names the tensor, not just the file
    assert bad.name == "m"
    rows = MEASURES["clip-rate"].rows(found)
    assert [(r.tensor, r.error is not None) for r in rows] == [
        ("m", True), ("a", False), ("c", False), ("*", True)]


def test_a_huge_shape_finishes_fast_in_little_memory(tmp_path: Path) -> None:
    path = _three(tmp_path, {"dtype": "F32", "shape": [1 << 40, 1 << 40]}, 16)
    warm = tmp_path / "warm.safetensors"
    save_file({"x": seeded((64, 64))}, warm)
    # a fresh interpreter, warmed up on a sound file (torch's threads and caches), then held
    # to 256 MiB of address space beyond what it has: a buffer (or a list of row ranges)
    # sized from the shape cannot be made there
    code = """if True:
        import json, resource, sys, time
        from driftcli.measures.scan import scan
        scan([sys.argv[2]], ["fp8_e4m3"])
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20),) * 2)
        start = time.perf_counter()
        found = scan([sys.argv[1]], ["fp8_e4m3"])
        print(json.dumps({"seconds": time.perf_counter() - start,
                          "errors": [r.error for r in found.errors],
                          "measured": [r.ref.name for r in found.results if r.error is None]}))
    """
    env = {**os.environ, "PYTHONPATH": str(Path(driftcli.__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", code, str(path), str(warm)],
                         capture_output=True, text=True, timeout=300, check=False, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["measured"] == ["a", "c"]
    assert out["errors"] == [f"{path}: tensor 'm' has 16 data bytes but shape [1099511627776, "
                             "1099511627776] of F32 needs more than 16; the file is corrupt, "
                             "re-save or re-download it"]
    assert out["seconds"] < 5  # refused at listing, in milliseconds; 5 s for a loaded machine


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], int, dict[str, list[int]]]:
    tensors = {k: seeded((4, 8), seed=i) for i, k in enumerate(["a", "b", "cc"])}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    start, offsets = _offsets(path)
    return path, tensors, start, offsets


def test_truncated_safetensors_lists_the_tensors_still_whole(tmp_path: Path) -> None:
    path, tensors, start, offsets = _saved(tmp_path)
    first, second, third = sorted(offsets, key=lambda k: offsets[k][0])
    cut = start + sum(offsets[second]) // 2  # the middle of the 2nd tensor's data
    path.write_bytes(path.read_bytes()[:cut])
    assert refused_by_safetensors(path)
    inputs = open_inputs([path])
    # far more bytes are missing than the header's padding: no header length could explain
    # it, so the layout stands and the first tensor is where it says
    assert names(inputs) == [first]
    assert same_bits(inputs.tensors[0].read(), tensors[first])
    assert errs(inputs) == tuple(
        (str(path), f"{path}: tensor {name} needs bytes {start + offsets[name][0]}.."
                    f"{start + offsets[name][1]} but the file has {cut} bytes (truncated?); "
                    "re-save or re-download it") for name in (second, third))
    assert errs(open_inputs([path], include=[first])) == ()


def test_a_shortfall_a_header_length_could_explain_is_a_file_error(tmp_path: Path) -> None:
    path, _, start, _ = _saved(tmp_path)
    padding = start - 8 - len(path.read_bytes()[8:start].rstrip(b" "))
    assert padding == 7  # the library pads the header to a multiple of 8 with spaces
    data = path.read_bytes()
    for short in range(1, padding + 1):
        # as if the length said `short` bytes more than the header: they would be data
        path.write_bytes(data[:-short])
        assert refused_by_safetensors(path)
        inputs = open_inputs([path])
        assert inputs.tensors == ()
        assert errs(inputs) == ((str(path), f"corrupt safetensors header in {path}: the "
                                  f"tensors need 384 bytes of data but the file holds "
                                  f"{384 - short} after a header that ends in 7 spaces "
                                  "(truncated, or a header length too long); re-save or "
                                  "re-download it"),)
    path.write_bytes(data[:-padding - 1])  # one byte more than any such lie: a truncation
    assert len(open_inputs([path]).tensors) == 2


def test_safetensors_truncated_after_listing_raises_on_read(tmp_path: Path) -> None:
    path, tensors, start, offsets = _saved(tmp_path)
    inputs = open_inputs([path])
    assert errs(inputs) == () and len(inputs.tensors) == 3
    second = sorted(offsets, key=lambda k: offsets[k][0])[1]
    cut = start + sum(offsets[second]) // 2
    path.write_bytes(path.read_bytes()[:cut])
    first, mid, last = inputs.tensors
    assert mid.name == second
    assert same_bits(first.read(), tensors[first.name])
    for ref in (mid, last):
        begin, end = (start + o for o in offsets[ref.name])
        with pytest.raises(ReadError) as err:
            ref.read(0, 1)  # even rows before the cut: the tensor as a whole is damaged
        assert str(err.value) == (f"{path}: tensor {ref.name} needs bytes {begin}..{end} but "
                                  f"the file has {cut} bytes (truncated?); re-save or "
                                  "re-download it")


@pytest.mark.parametrize(("content", "detail"), [
    (struct.pack("<Q", 9) + b"{not json", "the header is not JSON"),
    (struct.pack("<Q", 1 << 40) + b"{}", "header length 1099511627776 runs past the end of "
                                         "the file (10 bytes)"),
    (b"\x01\x02", "the file has 2 bytes, too few for the 8-byte length"),
    (struct.pack("<Q", 2) + b"[]", "the header is not a JSON object"),
    (struct.pack("<Q", 37) + b'{"x": {"dtype": "F32", "shape": [1]}}', "entry 'x' needs dtype"),
    (struct.pack("<Q", 3) + b'"\xff"', "the header is not UTF-8 (byte 1 of it: invalid start "
                                       "byte)"),
    # nested deeper than any recursion limit (inductor raises it to 2000 once it compiles in a
    # process, and then 1000 levels parse)
    (struct.pack("<Q", 100_003) + b"[" * 100_000 + b"]]]",
     "the header is not JSON (RecursionError"),
])
def test_corrupt_safetensors_header_goes_to_errors(tmp_path: Path, content: bytes,
                                                   detail: str) -> None:
    (tmp_path / "bad.safetensors").write_bytes(content)
    save_file({"w": torch.ones(2)}, tmp_path / "good.safetensors")
    inputs = open_inputs([tmp_path])
    assert [(r.source, r.name) for r in inputs.tensors] == [(str(tmp_path / "good.safetensors"),
                                                            "w")]
    assert inputs.files == (tmp_path / "bad.safetensors", tmp_path / "good.safetensors")
    [(source, message)] = errs(inputs)
    assert source == str(tmp_path / "bad.safetensors")
    assert message.startswith(f"corrupt safetensors header in {source}: {detail}")
    assert "\n" not in message


def _header(text: str, encoding: str = "utf-8") -> bytes:
    """Header text with each ``@`` standing for a sound F32 entry over 8 bytes."""
    return text.replace("@", '"dtype": "F32", "shape": [2], "data_offsets": [0, 8]').encode(
        encoding)


# header texts that Python's json reads and serde_json (so safetensors) refuses, or both read
_REFUSED = {
    "utf-16": _header('{"a": {@}}', "utf-16"),
    "byte order mark": _header('\ufeff{"a": {@}}'),
    "NaN in an unknown field": _header('{"a": {@, "note": NaN}}'),
    "number out of range": _header('{"a": {@, "note": 1e400}}'),
    "a field twice": _header('{"a": {"dtype": "F16", @}}'),
    "__metadata__ twice": _header('{"__metadata__": {}, "__metadata__": {}, "a": {@}}'),
    "half a surrogate pair": _header('{"\\ud800": {@}}'),
    "minus zero": _header('{"a": {"dtype": "F32", "shape": [-0, 2], "data_offsets": [0, 0]}, '
                          '"b": {@}}'),
    "metadata not strings": _header('{"__metadata__": {"n": 1}, "a": {@}}'),
    "trailing bytes": _header('{"a": {@}}\x00'),
}
_READ = {
    "spaces around": _header('\n {"a": {@}} \t\r\n'),
    "unknown field": _header('{"a": {@, "note": [1, {"k": null}]}}'),
    "a name twice (the last counts)": _header(
        '{"a": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}, "a": {@}}'),
    "metadata null": _header('{"__metadata__": null, "a": {@}}'),
    "escaped key": _header('{"\\u005f_metadata__": {"k": "v"}, "\\ud83d\\ude00": {@}}'),
}


@pytest.mark.parametrize(("text", "refused"), [
    *((pytest.param(t, True, id=k)) for k, t in _REFUSED.items()),
    *((pytest.param(t, False, id=k)) for k, t in _READ.items()),
])
def test_header_json_is_read_as_safetensors_reads_it(tmp_path: Path, text: bytes,
                                                     refused: bool) -> None:
    path = raw_text(tmp_path / "x.safetensors", text, struct.pack("<2f", 1.5, -2.0))
    assert refused_by_safetensors(path) == refused
    inputs = open_inputs([path])
    if refused:
        assert errs(inputs) != ()
        return
    assert errs(inputs) == ()
    with safe_open(str(path), "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    got = {r.name: r.read() for r in inputs.tensors}
    assert list(got) == list(want) and all(same_bits(got[k], want[k]) for k in want)


def test_a_broken_tensor_in_a_shard_is_its_own_error_not_a_misplaced_one(
        tmp_path: Path) -> None:
    _sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    raw_safetensors(shard, {"head": {"dtype": "Q8", "shape": [2], "data_offsets": [0, 2]},
                            "stray": {"dtype": "Q8", "shape": [2], "data_offsets": [2, 4]}},
                    b"\x01\x02\x03\x04")
    inputs = open_inputs([tmp_path])  # (the index does not put "stray" there: not read)
    assert sorted(names(inputs)) == ["embed", "layer.0"]
    assert errs(inputs) == ((str(shard), f"{shard}: tensor 'head' has dtype code \"Q8\", which "
                              "safetensors does not define; the file is corrupt, re-save or "
                              "re-download it"),)


# --- PyTorch zip archives -------------------------------------------------------------------


def test_truncated_or_damaged_pt_archive_is_a_clean_error(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": seeded((8, 8))}, path)
    whole = path.read_bytes()
    for cut in (4, 100, len(whole) // 2, len(whole) - 23, len(whole) - 1):
        path.write_bytes(whole[:cut])
        [(source, message)] = errs(open_inputs([path]))
        assert source == str(path)
        assert message.startswith(f"{path} is a truncated or damaged zip archive ("), cut
        assert message.endswith("); re-save it with torch.save or re-download it")
    # a directory entry whose member would run past the end of the file
    data = bytearray(whole)
    at = data.index(b"PK\x01\x02")
    struct.pack_into("<I", data, at + 20, len(whole) + 1)  # its compressed size
    path.write_bytes(bytes(data))
    [(_, message)] = errs(open_inputs([path]))
    assert "truncated or damaged zip archive" in message and "runs past the end" in message
    # a directory entry needing a zip version zipfile lacks: NotImplementedError there
    data = bytearray(whole)
    struct.pack_into("<H", data, at + 6, 147)
    path.write_bytes(bytes(data))
    [(_, message)] = errs(open_inputs([path]))
    assert message.startswith(f"{path} is a truncated or damaged zip archive "
                              "(NotImplementedError: zip file version 14.7)")


# --- folders and shards ---------------------------------------------------------------------


def _sharded(folder: Path) -> dict[str, torch.Tensor]:
    folder.mkdir(exist_ok=True)
    tensors = {"embed": seeded((6, 4), seed=10), "layer.0": seeded((4, 4), seed=11),
               "head": seeded((4, 6), torch.bfloat16, seed=12)}
    save_file({k: tensors[k] for k in ("embed", "layer.0")},
              folder / "model-00001-of-00002.safetensors")
    save_file({"head": tensors["head"]}, folder / "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 0}, "weight_map": {
        "embed": "model-00001-of-00002.safetensors", "layer.0": "model-00001-of-00002.safetensors",
        "head": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text("{}")
    return tensors


def test_sharded_folder_reads_each_shard_once(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path / "ckpt")
    shard1 = tmp_path / "ckpt" / "model-00001-of-00002.safetensors"
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    for paths in ([tmp_path / "ckpt"], [index], [tmp_path / "ckpt", tmp_path / "ckpt"],
                  [shard1, tmp_path / "ckpt"], [tmp_path / "ckpt", shard1, index]):
        inputs = open_inputs(paths)
        assert sorted(names(inputs)) == sorted(tensors), paths  # nothing counted twice
        assert len(inputs.files) == len(set(inputs.files)) == 3
        assert errs(inputs) == ()
    refs = by_name(open_inputs([tmp_path / "ckpt"]))
    assert refs["head"].source == str(tmp_path / "ckpt" / "model-00002-of-00002.safetensors")
    assert same_bits(refs["head"].read(1, 3), tensors["head"][1:3])
    assert same_bits(refs["embed"].read(), tensors["embed"])


def test_index_with_a_missing_shard_or_misplaced_tensor(tmp_path: Path) -> None:
    _sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    wmap = json.loads(index.read_text())
    wmap["weight_map"]["lost"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(wmap))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    inputs = open_inputs([tmp_path])
    assert sorted(names(inputs)) == ["embed", "layer.0"]
    assert [s for s, _ in errs(inputs)] == [str(index), str(index)]
    misplaced, missing = (m for _, m in errs(inputs))  # in shard order
    assert "puts 1 tensor(s) in model-00001-of-00002.safetensors, which does not hold them " \
           "(first: lost)" in misplaced
    assert "lists shard model-00002-of-00002.safetensors, which does not exist" in missing


def test_unreadable_index_leaves_its_shards_to_be_read_directly(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    inputs = open_inputs([tmp_path])
    assert sorted(names(inputs)) == sorted(tensors)
    [(source, message)] = errs(inputs)
    assert source.endswith("model.safetensors.index.json") and "not JSON" in message


def test_hugging_face_folder_ignores_non_tensor_files(tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
                 "generation_config.json", "merges.txt"):
        (tmp_path / name).write_text("{}")
    weights = {"model.embed_tokens.weight": seeded((8, 4), torch.bfloat16, seed=13)}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    inputs = open_inputs([tmp_path])
    assert inputs.files == (tmp_path / "model.safetensors",) and errs(inputs) == ()
    [ref] = inputs.tensors
    assert ref.name == "model.embed_tokens.weight" and ref.role is None
    assert same_bits(ref.read(), weights[ref.name])


def test_run_folder_recurses_in_sorted_order(tmp_path: Path) -> None:
    for step in (10, 2):
        (tmp_path / f"step_{step:03d}").mkdir()
        save_file({"x": torch.full((2,), float(step))},
                  tmp_path / f"step_{step:03d}" / "acts.safetensors")
    np.save(tmp_path / "a.npy", np.ones(2, np.float32))
    inputs = open_inputs([tmp_path])
    assert [Path(r.source).relative_to(tmp_path).as_posix() for r in inputs.tensors] == [
        "a.npy", "step_002/acts.safetensors", "step_010/acts.safetensors"]
    assert [r.read()[0].item() for r in inputs.tensors] == [1.0, 2.0, 10.0]


# --- paths that cannot be used --------------------------------------------------------------


def test_missing_paths_and_empty_folders_raise_at_once(tmp_path: Path) -> None:
    save_file({"w": torch.ones(1)}, tmp_path / "ok.safetensors")
    with pytest.raises(ReadError, match=r"nope\.safetensors does not exist; check the path"):
        open_inputs([tmp_path / "ok.safetensors", tmp_path / "nope.safetensors"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReadError, match=r"no tensor files \(\.safetensors.*\.npy\) under .*empty"):
        open_inputs([tmp_path / "empty"])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ReadError, match="no tensor files"):
        open_inputs([tmp_path / "hf"])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ReadError, match=r"notes\.txt is not a tensor file: drift reads "
                                        r"\(\.safetensors.*\.pt.*\.npz, \.npy\)"):
        open_inputs([tmp_path / "notes.txt"])
    with pytest.raises(ReadError, match="no inputs given"):
        open_inputs([])
    assert issubclass(ReadError, DriftError)


def test_a_new_kind_of_file_is_one_entry_in_the_kinds(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind of file is a FileKind (its endings, and how one file is listed) in
    collect.KINDS: with that one entry folders find it, messages name it, and its tensors are
    listed and read like any other's."""
    from driftcli.io.readers import collect
    from driftcli.io.readers.core import ByteRange, FileKind

    def raw_refs(path: Path) -> tuple[list[TensorRef], list]:  # raw float32, one per file
        n = path.stat().st_size
        return [TensorRef(str(path), path.stem, "float32", (n // 4,),
                          _reader=ByteRange(path, 0, n))], []

    run = tmp_path / "run"
    run.mkdir()
    values = seeded((6,))
    (run / "w.raw").write_bytes(values.numpy().tobytes())
    (tmp_path / "notes.txt").write_text("x")
    known = (r"\(\.safetensors, \.safetensors\.index\.json, \.pt, \.pth, \.bin, \.ckpt, \.npz, "
             r"\.npy")
    with pytest.raises(ReadError, match=rf"no tensor files {known}\) under"):
        open_inputs([run])
    monkeypatch.setattr(collect, "KINDS", [*collect.KINDS, FileKind("raw", (".raw",), raw_refs)])
    inputs = open_inputs([run])
    assert [(r.source, r.name) for r in inputs.tensors] == [(str(run / "w.raw"), "w")]
    assert same_bits(inputs.tensors[0].read(), values)
    assert same_bits(inputs.tensors[0].read(2, 5), values[2:5])
    with pytest.raises(ReadError, match=rf"drift reads {known}, \.raw\) files"):
        open_inputs([tmp_path / "notes.txt"])


# --- selection and dumps --------------------------------------------------------------------


def test_include_and_exclude_globs(tmp_path: Path) -> None:
    names_in = ["model.layers.0.weight", "model.layers.0.bias", "model.layers.1.weight",
                "lm_head.weight"]
    path = tmp_path / "m.safetensors"
    save_file({n: torch.ones(1) for n in names_in}, path)
    kept = open_inputs([path], include=["model.*"], exclude=["*.bias"])
    assert sorted(names(kept)) == ["model.layers.0.weight", "model.layers.1.weight"]
    assert kept.excluded == 2
    either = open_inputs([path], include=["lm_head.*", "*.1.*"])
    assert sorted(names(either)) == ["lm_head.weight", "model.layers.1.weight"]
    assert open_inputs([path], include=["MODEL.*"]).excluded == 4  # case-sensitive
    assert open_inputs([path], exclude=["*weight"]).excluded == 3


def _dump_meta(tensors: dict[str, object], version: object = 1) -> dict[str, str]:
    return {DUMP_KEY: json.dumps({"version": version, "tensors": tensors}), "note": "x"}


def test_dump_metadata_fills_role_layer_operand_step(tmp_path: Path) -> None:
    path = tmp_path / "dump.safetensors"
    save_file({"l0.x": seeded((2, 3)), "l0.w": seeded((3, 3)), "l0.dy": seeded((2, 3)),
               "extra": torch.zeros(1)}, path, metadata=_dump_meta({
                   "l0.x": {"role": "activation", "layer": "l0", "operand": "a", "step": 3},
                   "l0.w": {"role": "weight", "layer": "l0", "operand": "b", "step": None},
                   "l0.dy": {"role": "gradient", "layer": "l0", "operand": "grad_output",
                             "step": 3}}))
    inputs = open_inputs([path])
    assert errs(inputs) == ()
    refs = by_name(inputs)
    assert (refs["l0.x"].role, refs["l0.x"].layer, refs["l0.x"].operand, refs["l0.x"].step) == (
        "activation", "l0", "a", 3)
    assert (refs["l0.w"].role, refs["l0.w"].operand, refs["l0.w"].step) == ("weight", "b", None)
    assert (refs["l0.dy"].role, refs["l0.dy"].operand) == ("gradient", "grad_output")
    assert refs["extra"].role is None and refs["extra"].layer is None


@pytest.mark.parametrize(("meta", "detail"), [
    (_dump_meta({"x": {"role": "act", "layer": "l0", "operand": "a", "step": 0}}),
     "tensor 'x' needs role in activation/weight/gradient"),
    (_dump_meta({"x": {"role": "weight", "layer": "l0", "operand": "a", "step": "1"}}),
     "tensor 'x' needs role"),
    (_dump_meta({}, version=2), "has version 2; this drift reads version 1"),
    ({DUMP_KEY: "{broken"}, "is not JSON"),
])
def test_bad_dump_metadata_is_reported_and_tensors_kept(tmp_path: Path, meta: dict[str, str],
                                                       detail: str) -> None:
    path = tmp_path / "dump.safetensors"
    save_file({"x": torch.ones(2)}, path, metadata=meta)
    inputs = open_inputs([path])
    [ref] = inputs.tensors
    assert ref.role is None and ref.read().tolist() == [1.0, 1.0]
    [(source, message)] = errs(inputs)
    assert source == str(path) and detail in message
    assert message.endswith("its tensors are listed without role, layer, operand and step")


def test_tensor_ref_compares_on_public_fields(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"w": torch.ones(2)}, path)
    a, b = open_inputs([path]).tensors[0], open_inputs([path]).tensors[0]
    assert a == b and hash(a) == hash(b) and "_reader" not in repr(a)
    with pytest.raises(ReadError, match="was not listed by open_inputs"):
        TensorRef(str(path), "w", "float32", (2,)).read()



def test_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "inputs.md").read_text()
    [code] = [block.split("```")[0] for block in text.split("```python\n")[1:]]
    run = tmp_path / "checkpoints" / "run1"
    run.mkdir(parents=True)
    save_file({"model.layers.0.weight": seeded((2500, 2)), "model.layers.0.bias": seeded((2,)),
               "model.layers.1.steps": torch.arange(3), "lm_head.weight": seeded((2, 2))},
              run / "model.safetensors")
    torch.save({"x": Custom()}, run / "training_args.bin")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/inputs.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "skipped: checkpoints/run1/training_args.bin"
    assert [line.split()[1:] for line in lines[1:]] == [
        ["model.layers.0.weight", str(s), *shape, "torch.float32"]
        for s, shape in [(0, ["(1024,", "2)"]), (1024, ["(1024,", "2)"]), (2048, ["(452,", "2)"])]]
