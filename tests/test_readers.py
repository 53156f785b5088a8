"""Readers: every input kind read back bit for bit, row slices, folders, shards, dumps, errors."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from driftcli.errors import DriftError
from driftcli.io.readers import DUMP_KEY, Inputs, ReadError, TensorRef, open_inputs

# a warning here means a reader took a shortcut (e.g. a tensor over a read-only mapping)
pytestmark = pytest.mark.filterwarnings("error")

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    assert inputs.errors == () and inputs.excluded == 0
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
    [(source, message)] = inputs.errors
    assert source == str(tmp_path / "a.pt")
    assert "a.pt needs arbitrary unpickling" in message and "Custom" in message
    assert "drift refuses (it can run code)" in message
    assert "torch.save(model.state_dict(), ...)" in message and "\n" not in message


def test_garbage_pt_goes_to_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint" * 8)  # torch: "Unsupported operand"
    (tmp_path / "empty.pt").write_bytes(b"")
    inputs = open_inputs([tmp_path / "junk.bin", tmp_path / "empty.pt"])
    assert inputs.tensors == ()
    assert [s for s, _ in inputs.errors] == [str(tmp_path / "junk.bin"), str(tmp_path / "empty.pt")]
    assert all("as a PyTorch file" in m and "\n" not in m for _, m in inputs.errors)
    assert "Unsupported operand" in inputs.errors[0][1]  # damaged, not refused
    assert not any("unpickling" in m for _, m in inputs.errors)


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
    messages = dict(inputs.errors)
    assert "member bad.npy holds Python objects" in messages[str(tmp_path / "run.npz")]
    assert "arbitrary unpickling" in messages[str(tmp_path / "objs.npy")]


def test_truncated_npy_lists_the_tensor_and_read_raises(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(100, dtype=np.float32))
    data = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "x.npy").write_bytes(data[:-40])
    [ref] = open_inputs([tmp_path / "x.npy"]).tensors
    assert ref.shape == (100,)
    with pytest.raises(ReadError, match=r"x\.npy: tensor x needs bytes \d+\.\.\d+ but the file"):
        ref.read(0, 2)


# --- safetensors: truncation and corruption -------------------------------------------------


def _offsets(path: Path) -> tuple[int, dict[str, list[int]]]:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + n])
    return 8 + n, {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}


def test_truncated_safetensors(tmp_path: Path) -> None:
    tensors = {k: seeded((4, 8), seed=i) for i, k in enumerate(["a", "b", "c"])}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    start, offsets = _offsets(path)
    second = sorted(offsets, key=lambda k: offsets[k][0])[1]
    cut = start + sum(offsets[second]) // 2  # the middle of the 2nd tensor's data
    path.write_bytes(path.read_bytes()[:cut])
    inputs = open_inputs([path])
    assert inputs.errors == () and len(inputs.tensors) == 3  # still listed
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


def test_offsets_that_disagree_with_shape_raise_on_read(tmp_path: Path) -> None:
    path = raw_safetensors(tmp_path / "x.safetensors", {
        "ok": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
        "short": {"dtype": "F32", "shape": [2, 2], "data_offsets": [4, 16]},
    }, struct.pack("<2e", 1.5, -2.0) + bytes(12))
    refs = by_name(open_inputs([path]))
    assert refs["ok"].read().tolist() == [1.5, -2.0]
    with pytest.raises(ReadError, match=r"tensor short has 12 data bytes but shape \[2, 2\] "
                                        r"of float32 needs 16"):
        refs["short"].read()


@pytest.mark.parametrize(("content", "detail"), [
    (struct.pack("<Q", 9) + b"{not json", "the header is not JSON"),
    (struct.pack("<Q", 1 << 40) + b"{}", "header length 1099511627776 runs past the end of "
                                         "the file (10 bytes)"),
    (b"\x01\x02", "the file has 2 bytes, too few for the 8-byte length"),
    (struct.pack("<Q", 2) + b"[]", "the header is not a JSON object"),
    (struct.pack("<Q", 37) + b'{"x": {"dtype": "F32", "shape": [1]}}', "entry 'x' needs dtype"),
    (struct.pack("<Q", 3) + b'"\xff"', "the header is not JSON"),
])
def test_corrupt_safetensors_header_goes_to_errors(tmp_path: Path, content: bytes,
                                                   detail: str) -> None:
    (tmp_path / "bad.safetensors").write_bytes(content)
    save_file({"w": torch.ones(2)}, tmp_path / "good.safetensors")
    inputs = open_inputs([tmp_path])
    assert [(r.source, r.name) for r in inputs.tensors] == [(str(tmp_path / "good.safetensors"),
                                                            "w")]
    assert inputs.files == (tmp_path / "bad.safetensors", tmp_path / "good.safetensors")
    [(source, message)] = inputs.errors
    assert source == str(tmp_path / "bad.safetensors")
    assert message.startswith(f"corrupt safetensors header in {source}: {detail}")
    assert "\n" not in message


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
        assert inputs.errors == ()
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
    assert [s for s, _ in inputs.errors] == [str(index), str(index)]
    misplaced, missing = (m for _, m in inputs.errors)  # in shard order
    assert "puts 1 tensor(s) in model-00001-of-00002.safetensors, which does not hold them " \
           "(first: lost)" in misplaced
    assert "lists shard model-00002-of-00002.safetensors, which does not exist" in missing


def test_unreadable_index_leaves_its_shards_to_be_read_directly(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    inputs = open_inputs([tmp_path])
    assert sorted(names(inputs)) == sorted(tensors)
    [(source, message)] = inputs.errors
    assert source.endswith("model.safetensors.index.json") and "not JSON" in message


def test_hugging_face_folder_ignores_non_tensor_files(tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
                 "generation_config.json", "merges.txt"):
        (tmp_path / name).write_text("{}")
    weights = {"model.embed_tokens.weight": seeded((8, 4), torch.bfloat16, seed=13)}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    inputs = open_inputs([tmp_path])
    assert inputs.files == (tmp_path / "model.safetensors",) and inputs.errors == ()
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
    assert inputs.errors == ()
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
    [(source, message)] = inputs.errors
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
    assert lines[0].startswith("not read: checkpoints/run1/training_args.bin ")
    assert [line.split()[1:] for line in lines[1:]] == [
        ["model.layers.0.weight", str(s), *shape, "torch.float32"]
        for s, shape in [(0, ["(1024,", "2)"]), (1024, ["(1024,", "2)"]), (2048, ["(452,", "2)"])]]
