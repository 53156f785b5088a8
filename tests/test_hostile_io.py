"""Hostile inputs and outputs of the quantized readers, ``drift dequantize``, ``drift inspect``
and the Transformer Engine unpickler (issue 42): nothing overwritten, nothing read from
outside, every bomb bounded, every crash one line. Cases that could hang or explode run in a
subprocess under a memory limit and a timeout (``bounded``)."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_hostile_inputs import bounded
from test_outputs_safety import drift_process
from test_quantized import _all_layouts, deepseek_fp8, mxfp8, nvfp4, sample, write
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.readers import open_inputs
from driftcli.measures.inspect import inspect

runner = CliRunner()


def drift(*args: str | Path) -> tuple[int, str]:
    """Run a drift command in this process; (exit code, stdout and stderr)."""
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def one_line(code: int, out: str, *parts: str) -> str:
    """The command failed with exit 2 and one ``error:`` line holding every part."""
    assert code == 2, out
    lines = [ln for ln in out.strip().splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in out, out
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def ds_file(path: Path, seed: int = 1, **extra: torch.Tensor) -> Path:
    """A one-file DeepSeek FP8 checkpoint (a 200 x 300 weight and a plain tensor)."""
    q, s = deepseek_fp8(sample((200, 300), seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"a.weight": q, "a.weight_scale_inv": s, "b.weight": torch.randn(4, 4),
               **extra}, str(path))
    return path


def sharded(folder: Path, seed: int = 2) -> Path:
    """A DeepSeek FP8 checkpoint in two shards read through an index."""
    folder.mkdir(parents=True, exist_ok=True)
    q, s = deepseek_fp8(sample((200, 300), seed))
    save_file({"a.weight": q, "a.weight_scale_inv": s}, folder / "m-1.safetensors")
    q2, s2 = deepseek_fp8(sample((130, 140), seed + 1))
    save_file({"c.weight": q2, "c.weight_scale_inv": s2, "b.weight": torch.randn(3, 3)},
              folder / "m-2.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "m-1.safetensors", "a.weight_scale_inv": "m-1.safetensors",
        "c.weight": "m-2.safetensors", "c.weight_scale_inv": "m-2.safetensors",
        "b.weight": "m-2.safetensors"}}))
    (folder / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def weight_dtypes(folder: Path) -> set[str]:
    """The dtypes of the dequantized weights of an output folder."""
    got = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            names = [k for k in fh.keys() if k != "b.weight"]  # noqa: SIM118 (not a dict)
            got |= {str(fh.get_slice(k).get_dtype()) for k in names}
    return got


# --- (1) nothing overwritten: an existing target, an input as target --------------------------


def test_dequantize_refuses_an_existing_target_without_overwrite(tmp_path: Path) -> None:
    src = ds_file(tmp_path / "ck.safetensors")
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"an earlier file")
    # before the fix: replaced in silence, exit 0
    one_line(*drift("dequantize", src, "--out", out), f"{out} exists", "--overwrite")
    assert out.read_bytes() == b"an earlier file"
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    one_line(*drift("dequantize", sharded(tmp_path / "sh"), "--out", folder), "--overwrite")
    assert snapshot(folder) == {"keep.txt": b"mine"}
    # with --overwrite, a file is replaced; a folder of files drift did not write is not
    assert drift("dequantize", src, "--out", out, "--overwrite", "-q")[0] == 0
    assert len(open_inputs([out]).tensors) == 2
    one_line(*drift("dequantize", tmp_path / "sh", "--out", folder, "--overwrite"),
             "keep.txt", "drift dequantize did not write")
    assert snapshot(folder) == {"keep.txt": b"mine"}


def test_dequantize_never_writes_over_its_input(tmp_path: Path) -> None:
    src = ds_file(tmp_path / "ck.safetensors")
    before = src.read_bytes()
    # before the fix: the quantized original destroyed, exit 0
    for extra in ((), ("--overwrite",)):
        one_line(*drift("dequantize", src, "--out", src, *extra), "is an input")
        assert src.read_bytes() == before
    folder = sharded(tmp_path / "sh")
    kept = snapshot(folder)
    # before the fix: its shards and index rewritten in place under its fp8 config.json
    for extra in ((), ("--overwrite",)):
        one_line(*drift("dequantize", folder, "--out", folder, *extra), "input")
        one_line(*drift("dequantize", folder, "--out", tmp_path, *extra), "input")
    assert snapshot(folder) == kept


# --- (2) two inputs, one output name ----------------------------------------------------------


def test_two_inputs_with_one_stem_are_refused_not_merged(tmp_path: Path) -> None:
    ds_file(tmp_path / "in" / "model.safetensors")
    torch.save({"p": torch.randn(3, 5)}, tmp_path / "in" / "model.pt")
    out = tmp_path / "out"
    # before the fix: both wrote out/model.safetensors, one file's tensors lost, exit 0
    one_line(*drift("dequantize", tmp_path / "in", "--out", out), "model.safetensors",
             "model.pt")
    assert not out.exists() or snapshot(out) == {}
    assert [p.name for p in tmp_path.iterdir()] == ["in"]  # no temporary left beside it


# --- (3, 4, 16) index entries: confined, resolved once, tensor files only ---------------------


def test_index_entries_outside_the_folder_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere" / "secret.safetensors"
    secret.parent.mkdir()
    save_file({"secret": torch.full((2, 2), 7.0)}, str(secret))
    for entry in (str(secret), "../elsewhere/secret.safetensors"):
        folder = tmp_path / f"ck{len(entry)}"
        folder.mkdir()
        save_file({"w": torch.ones(2, 2)}, str(folder / "a.safetensors"))
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"w": "a.safetensors", "secret": entry}}))
        got = open_inputs([folder])
        # before the fix: the secret was read (and dequantize copied it into the output)
        assert [t.name for t in got.tensors] == ["w"], entry
        assert len(got.errors) == 1 and "outside" in got.errors[0].message
        assert entry in got.errors[0].message and "\n" not in got.errors[0].message
        code, out = drift("dequantize", folder, "--out", tmp_path / f"o{len(entry)}")
        one_line(code, out, "outside")
        assert not (tmp_path / f"o{len(entry)}").exists()


def test_index_naming_one_shard_twice_reads_every_tensor(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    save_file({"x": torch.ones(2, 2), "y": torch.full((2, 2), 2.0)},
              str(tmp_path / "a.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "a.safetensors", "y": "sub/../a.safetensors"}}))
    got = open_inputs([tmp_path])
    # before the fix: y dropped in silence (its spelling resolved to a file already read)
    assert sorted(t.name for t in got.tensors) == ["x", "y"] and got.errors == ()


def test_index_shard_that_is_not_a_tensor_file_is_one_line(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "a.safetensors"))
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "a.safetensors", "v": "notes.txt"}}))
    got = open_inputs([tmp_path])  # before the fix: StopIteration
    assert [t.name for t in got.tensors] == ["w"]
    assert len(got.errors) == 1 and "notes.txt" in got.errors[0].message
    assert "not a tensor file" in got.errors[0].message


# --- (5) the output committed whole: swap, lock, stale temporaries ----------------------------


def test_an_interrupted_overwrite_leaves_one_whole_output(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from driftcli.io.dequantize import dequantize

    src = sharded(tmp_path / "sh")
    out = tmp_path / "out"
    dequantize([src], out, dtype="bfloat16")
    for k in (1, 2, 3):
        calls = {"n": 0}
        real_replace, real_rename = os.replace, os.rename

        def interrupted(real, k=k, calls=calls):
            def call(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] == k:
                    raise KeyboardInterrupt  # a kill at this rename
                return real(*args, **kwargs)
            return call

        monkeypatch.setattr(os, "replace", interrupted(real_replace))
        monkeypatch.setattr(os, "rename", interrupted(real_rename))
        # (a run whose k-th rename never comes finishes)
        with contextlib.suppress(KeyboardInterrupt):
            dequantize([src], out, dtype="float32", overwrite=True)
        monkeypatch.setattr(os, "replace", real_replace)
        monkeypatch.setattr(os, "rename", real_rename)
        # before the fix: bfloat16 and float32 shards under one new index
        assert weight_dtypes(out) in ({"BF16"}, {"F32"}), k
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == ["m-1.safetensors",
                                                             "m-2.safetensors"]
        dequantize([src], out, dtype="bfloat16", overwrite=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sh"], k


def test_a_second_run_into_one_out_refuses(tmp_path: Path) -> None:
    from driftcli.io.tables import table_lock

    src = sharded(tmp_path / "sh")
    out = tmp_path / "out"
    with table_lock(out):  # another drift run writing it
        # before the fix: both runs exit 0, with shards from both
        one_line(*drift("dequantize", src, "--out", out), "another drift run")
        assert not out.exists()


def test_stale_temporaries_of_a_killed_run_are_removed(tmp_path: Path) -> None:
    src = sharded(tmp_path / "sh")
    out = tmp_path / "out"
    (tmp_path / ".out.k1ll3d.tmp").mkdir()  # a killed run's folder, written beside
    (tmp_path / ".out.k1ll3d.tmp" / "m-1.safetensors").write_bytes(b"\0" * 4096)
    one = tmp_path / "one.safetensors"
    stale = tmp_path / ".one.safetensors.x7y8.tmp"  # a killed one-file run's temporary
    stale.write_bytes(b"\0" * 4096)
    assert drift("dequantize", src, "--out", out, "-q")[0] == 0
    assert drift("dequantize", ds_file(tmp_path / "in" / "ck.safetensors"), "--out", one,
                 "-q")[0] == 0
    # before the fix: both left forever
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "one.safetensors", "out", "sh"]


# --- (23) a full disk -------------------------------------------------------------------------


def test_a_full_disk_names_the_file_and_keeps_the_earlier_output(tmp_path: Path) -> None:
    src = ds_file(tmp_path / "ck.safetensors", seed=3)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"the earlier output")
    # 60,000 float32 values need 240 kB: the disk is full at 100 kB
    done = drift_process("dequantize", src, "--out", out, "--overwrite", cwd=tmp_path,
                         fsize=100_000)
    # before the fix: "error: [Errno 27] File too large", naming no file
    one_line(done.returncode, done.stderr, f"cannot write {out}: File too large (the disk "
             "or the file size limit is full); the earlier file is kept as it was")
    assert out.read_bytes() == b"the earlier output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.safetensors", "out.safetensors"]
    # a folder output: the shard named, the earlier folder whole, no temporary folder left
    src = sharded(tmp_path / "sh")
    folder = tmp_path / "deq"
    assert drift("dequantize", src, "--out", folder, "--dtype", "bfloat16", "-q")[0] == 0
    kept = snapshot(folder)
    done = drift_process("dequantize", src, "--out", folder, "--overwrite", cwd=tmp_path,
                         fsize=100_000)
    one_line(done.returncode, done.stderr, f"cannot write {folder / 'm-1.safetensors'}: File "
             f"too large", f"the earlier {folder} is kept as it was")
    assert snapshot(folder) == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.safetensors", "deq",
                                                          "out.safetensors", "sh"]


# --- (13) non-finite outputs from finite inputs -----------------------------------------------


def _nonfinite_cases(folder: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    big = torch.full((4, 32), 448.0).to(torch.float8_e4m3fn)
    cases: dict[str, tuple[Path, tuple[str, ...]]] = {}
    cases["scale 3e38"] = (write(folder / "s", {"w.weight": big,
                                                "w.weight_scale": torch.tensor([3e38])}), ())
    cases["e8m0 254"] = (write(folder / "e", {"w.weight": big, "w.weight_scale": torch.full(
        (4, 1), 254, dtype=torch.uint8)}), ())
    cp, cws, _ = nvfp4(sample((4, 32), 5, zero_block=False), True)
    cases["global 1e-45"] = (write(folder / "g", {
        "w.weight_packed": cp, "w.weight_scale": cws,
        "w.weight_global_scale": torch.tensor([1e-45])}), ())
    cases["float16"] = (write(folder / "h", {"w.weight": big,
                                             "w.weight_scale": torch.tensor([1000.0])}),
                        ("--dtype", "float16"))
    nan = big.clone().view(torch.uint8)
    nan[0, 0] = 0x7F  # E4M3's NaN code
    cases["nan code"] = (write(folder / "n", {"w.weight": nan.view(torch.float8_e4m3fn),
                                              "w.weight_scale": torch.tensor([1.0])}), ())
    return cases


@pytest.mark.parametrize("case", ["scale 3e38", "e8m0 254", "global 1e-45", "float16",
                                  "nan code"])
def test_dequantize_refuses_non_finite_values_from_finite_inputs(tmp_path: Path,
                                                                 case: str) -> None:
    folder, opts = _nonfinite_cases(tmp_path)[case]
    out = tmp_path / "out.safetensors"
    # before the fix: inf or NaN written, exit 0
    line = one_line(*drift("dequantize", folder, "--out", out, *opts), "w.weight",
                    "nothing was written")
    assert "infinite" in line or "NaN" in line
    if case == "float16":  # the example of docs/dequantize.md
        assert "weight w.weight dequantizes to 128 infinite and 0 NaN value(s) in float16 " \
               "from finite scales" in line
    assert not out.exists()


# --- (14) negative and zero scales ------------------------------------------------------------


def test_negative_and_zero_scales_are_linted(tmp_path: Path) -> None:
    q = torch.full((4, 64), 2.0).to(torch.float8_e4m3fn)
    write(tmp_path / "n", {"w.weight": q, "w.weight_scale": torch.tensor([[1.0], [-1.0],
                                                                          [1.0], [1.0]])})
    write(tmp_path / "z", {"w.weight": q, "w.weight_scale": torch.tensor([[1.0], [0.0],
                                                                          [1.0], [1.0]])})
    qz = q.clone()
    qz[1] = 0  # a zero scale over a block of zero codes loses nothing: silent
    write(tmp_path / "ok", {"w.weight": qz, "w.weight_scale": torch.tensor([[1.0], [0.0],
                                                                           [1.0], [1.0]])})
    lints = {}
    for case in ("n", "z", "ok"):
        found = inspect([tmp_path / case])
        assert found.errors == ()
        lints[case] = sorted(f.lint for f in found.findings)
    # before the fix: no lint for either
    assert lints == {"n": ["lint_negative_scales"], "z": ["lint_zero_scales"],
                     "ok": ["lint_zero_blocks"]}
    (row,) = inspect([tmp_path / "n"]).rows
    assert row.negative_scales == 1 and row.zero_scales == 0 and row.lint_negative_scales
    (row,) = inspect([tmp_path / "ok"]).rows
    assert row.zero_scales == 1 and row.lint_zero_scales is False


# --- (6) the TE unpickler reads each storage once ---------------------------------------------


def test_te_storage_referenced_many_times_is_read_once(tmp_path: Path) -> None:
    t = torch.randn(1 << 20)  # 4 MiB
    path = tmp_path / "l_activation_iter_000001.pt"
    torch.save({"high_precision": t[:64].reshape(8, 8),
                "views": [t[i:i + 1] for i in range(600)]}, path)
    # before the fix: 600 copies of the 4 MiB storage (2.4 GB) under a 2 GiB limit
    out = bounded(f"""
        from driftcli.io.readers import open_inputs
        got = open_inputs([{str(path)!r}])
        assert not got.errors, got.errors  # before the fix: ... (MemoryError)
        print(got.tensors[0].name, float(got.tensors[0].read().sum()))
    """, timeout=60)
    name, total = out.split()
    assert name == "l.activation"
    assert math.isclose(float(total), float(t[:64].sum()), rel_tol=1e-5)  # float32 sums


# --- (8, 24) block sizes from config ----------------------------------------------------------


def test_a_huge_config_block_size_is_bounded(tmp_path: Path) -> None:
    q, _ = deepseek_fp8(sample((200, 300), 9))
    s = torch.linspace(0.5, 2, 300).reshape(1, 300)  # one scale per column: [2^24, 1] blocks
    write(tmp_path, {"a.weight": q, "a.weight_scale_inv": s},
          {"quant_method": "fp8", "weight_block_size": [1 << 24, 1]})
    want = q.float() * s  # exact: 4-bit codes times float32 scales
    torch.save(want, tmp_path.parent / "want.pt")
    # before the fix: 32 GiB allocated, the process killed
    out = bounded(f"""
        import torch
        from driftcli.io.readers import open_inputs
        from driftcli.measures.inspect import inspect
        got = open_inputs([{str(tmp_path)!r}])
        w = {{t.name: t for t in got.tensors}}["a.weight"].read()
        want = torch.load({str(tmp_path.parent / "want.pt")!r})
        (row,) = inspect([{str(tmp_path)!r}]).rows
        print(torch.equal(w, want), row.n_blocks, row.error)
    """, memory_gib=3.0, timeout=60)
    assert out.split() == ["True", "300", "None"]


def test_boolean_block_sizes_are_refused(tmp_path: Path) -> None:
    _q, _s = deepseek_fp8(sample((200, 300), 9))
    write(tmp_path, {"a.weight": _q, "a.weight_scale_inv": torch.ones(200, 300)},
          {"quant_method": "fp8", "weight_block_size": [True, True]})
    got = open_inputs([tmp_path])
    # before the fix: read as 1 x 1 blocks ("True x True blocks")
    assert got.tensors == ()
    assert len(got.errors) == 1 and "weight_block_size" in got.errors[0].message
    assert "True x True" not in got.errors[0].message


# --- (10, 17) inspect: memory and empty weights -----------------------------------------------


def test_inspect_memory_is_bounded_by_the_weight(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    rows, cols = 2048, 4096  # 8 Mi elements, 8 MiB of codes
    codes = torch.randint(0, 126, (rows, cols), dtype=torch.uint8, generator=g)
    big = write(tmp_path / "big", {"w.weight": codes.view(torch.float8_e4m3fn),
                                   "w.weight_scale": torch.full((rows, cols // 32), 120,
                                                                dtype=torch.uint8)})
    del codes
    q, b = mxfp8(sample((64, 64), 5))
    small = write(tmp_path / "small", {"w.weight": q, "w.weight_scale": b})
    out = bounded(f"""
        import resource
        from driftcli.measures.inspect import inspect
        inspect([{str(small)!r}])  # imports and first allocations done
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        (row,) = inspect([{str(big)!r}]).rows
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(row.numel, row.error, (after - before) * 1024)
    """, memory_gib=4.0, timeout=120)
    numel, error, grown = out.split()
    assert (int(numel), error) == (rows * cols, "None")
    # before the fix: about 90 bytes an element (720 MiB); the bound is 10 x the stored bytes
    assert int(grown) < 10 * rows * cols, f"inspect grew by {int(grown) / 2**20:.0f} MiB"


def test_inspect_a_weight_with_no_elements(tmp_path: Path) -> None:
    write(tmp_path, {"w.weight": torch.zeros(0, 64, dtype=torch.float8_e4m3fn),
                     "w.weight_scale": torch.zeros(0, 1)})
    found = inspect([tmp_path])  # before the fix: ZeroDivisionError
    (row,) = found.rows
    assert found.errors == () and row.error is None
    assert (row.numel, row.max_codes, row.max_code_rate, row.n_blocks) == (0, 0, None, 0)


# --- (18) nesting limits ----------------------------------------------------------------------


def test_a_pt_nested_thousands_deep_is_one_error(tmp_path: Path) -> None:
    obj: object = torch.ones(2)
    for _ in range(5000):
        obj = {"a": obj}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)
    try:
        torch.save(obj, tmp_path / "deep.pt")
    finally:
        sys.setrecursionlimit(limit)
    del obj
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "ok.safetensors"))
    got = open_inputs([tmp_path])  # before the fix: RecursionError, the whole run lost
    assert [t.name for t in got.tensors] == ["w"]
    assert len(got.errors) == 1 and "deep.pt" in got.errors[0].message
    assert "nest" in got.errors[0].message and "\n" not in got.errors[0].message


# --- (19, 24) TE dumps: an OrderedDict's own get, requires_grad -------------------------------


class _OwnGet:
    """Pickles as an OrderedDict whose instance attribute ``get`` is an allowed callable."""

    def __init__(self, items: dict[str, torch.Tensor]) -> None:
        self.items = items

    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        return (collections.OrderedDict, (), {"get": torch._utils._rebuild_tensor_v2}, None,
                iter(self.items.items()))


def test_te_dump_ordered_dict_with_its_own_get(tmp_path: Path) -> None:
    hp = torch.randn(4, 8)
    path = tmp_path / "l_weight_iter_000002.pt"
    torch.save(_OwnGet({"high_precision": hp}), path)
    got = open_inputs([path])  # before the fix: TypeError
    assert [t.name for t in got.tensors] == ["l.weight"] and got.errors == ()
    assert torch.equal(got.tensors[0].read(), hp)


def test_te_tensor_saved_with_requires_grad_is_plain_data(tmp_path: Path) -> None:
    hp = torch.randn(4, 64, requires_grad=True)
    torch.save({"high_precision": hp}, tmp_path / "l_activation_iter_000001.pt")
    (ref,) = open_inputs([tmp_path]).tensors
    t = ref.read()
    # before the fix: requires_grad, and autograd recorded every cast
    assert not t.requires_grad and t.grad_fn is None and torch.equal(t, hp.detach())
    code, out = drift("clip-rate", tmp_path, "-c", "mxfp8_e4m3", "--out", tmp_path / "o",
                      "-q")
    assert code == 0 and "requires_grad" not in out, out


def test_inspect_in_chunks_equals_inspect_whole(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed counts do not depend on the chunk: chunks smaller than a block row, a
    block's rows split across chunks (128 x 128 blocks, 1 x 32, experts), and whole."""
    import dataclasses

    import driftcli.measures.inspect as inspect_mod

    folder = _all_layouts(tmp_path)
    z = torch.zeros(300, 260, dtype=torch.float8_e4m3fn)
    z[5, 7] = 1.0  # one nonzero block among zero ones, split by small chunks
    save_file({"z.weight": z, "z.weight_scale_inv": torch.ones(3, 3)},
              str(folder / "z.safetensors"))
    whole = {r.tensor: r for r in inspect([folder]).rows}
    # DeepSeek's decoder rounds the product to float32 once: at float32 it is the exact order
    assert whole["z.weight"].zero_blocks == 8 and whole["ds.weight"].order_differs == 0
    for chunk in (100, 260 * 130, 3000):
        monkeypatch.setattr(inspect_mod, "CHUNK_ELEMENTS", chunk)
        for r in inspect([folder]).rows:
            w = whole[r.tensor]
            assert r.rms is not None and w.rms is not None
            assert math.isclose(r.rms, w.rms, rel_tol=1e-12), (chunk, r.tensor)  # sum order
            assert dataclasses.replace(r, rms=w.rms) == w, (chunk, r.tensor)
