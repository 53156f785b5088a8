"""Hostile inputs (issue 31): files that are not regular files, small files that would buy hours
of work, names that are not text, and one bad file among good ones. Each is refused with one
line, or bounded, and the rest of the run goes on. Cases that could hang or explode run in a
subprocess under a memory limit and a timeout, so a regression fails instead of stalling CI."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.readers import open_inputs

ROOT = Path(__file__).resolve().parents[1]


def bounded(code: str, *, memory_gib: float = 2.0, timeout: float = 60.0) -> str:
    """Run ``code`` in a fresh Python under an address-space limit and a timeout; its stdout.
    A hang or a blow-up fails the test (TimeoutExpired, or a non-zero exit with the traceback
    in the message) instead of stalling or swapping the machine."""
    limit = int(memory_gib * (1 << 30))

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=cap, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# --- cast-diff keeps the other tensors --------------------------------------------------------


def test_cast_diff_keeps_the_other_tensors_with_an_error_row_for_a_bad_file(
        tmp_path: Path) -> None:
    import pandas as pd

    save_file({"w": torch.linspace(-3, 3, 128).reshape(4, 32)}, str(tmp_path / "ok.safetensors"))
    (tmp_path / "bad.safetensors").write_bytes(b"garbage!garbage!")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["cast-diff", str(tmp_path), "-c", "mxfp8_e4m3",
                                      "-c", "te/mxfp8", "--out", str(out), "-q"])
    # before the fix: TypeError (against given twice), no table
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 2, result.output  # some input could not be read
    t = pd.read_parquet(out / "cast-diff.parquet").set_index("tensor")
    assert set(t.index) == {"w", "(unreadable file)", "*"}
    bad = t.loc["(unreadable file)"]
    assert bad.source.endswith("bad.safetensors") and "corrupt safetensors header" in bad.error
    assert bad.against == t.loc["w"].against and pd.isna(bad.values_differ)
    assert pd.isna(t.loc["w"].error) and t.loc["w"].n_codes_differ >= 0
    assert t.loc["*"].n_tensors == 1 and "1 tensor(s) or file(s)" in t.loc["*"].error


# --- only regular files are read ----------------------------------------------------------------


def test_a_fifo_in_a_folder_or_given_directly_is_refused_by_stat_not_opened(
        tmp_path: Path) -> None:
    save_file({"w": torch.ones(2, 4)}, str(tmp_path / "a.safetensors"))
    os.mkfifo(tmp_path / "b.safetensors")
    os.mkfifo(tmp_path / "c.npy")
    # before the fix: open() of the FIFO blocks forever (the timeout fails the test)
    out = bounded(f"""
        import json
        from driftcli.io.readers import open_inputs
        for paths in ([{str(tmp_path)!r}], [{str(tmp_path / "b.safetensors")!r},
                                            {str(tmp_path / "a.safetensors")!r}]):
            got = open_inputs(paths)
            print(json.dumps([[r.name for r in got.tensors], [e.message for e in got.errors],
                              [p.name for p in got.files]]))
    """, timeout=30)
    folder, direct = (json.loads(line) for line in out.splitlines())
    assert folder[0] == ["w"] and folder[2] == ["a.safetensors"]  # the FIFOs are not hashed
    assert [m.split(" is ")[1].split(",")[0] for m in folder[1]] == [
        "a FIFO (named pipe)", "a FIFO (named pipe)"]
    assert all("not a regular file" in m and "\n" not in m for m in folder[1])
    assert direct[0] == ["w"] and len(direct[1]) == 1 and "b.safetensors is a FIFO" in direct[1][0]


def test_a_socket_and_an_index_that_is_a_fifo_are_refused(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2, 4)}, str(tmp_path / "a.safetensors"))
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "s.pt"))
        # before the fix: reading the index FIFO blocks forever
        out = bounded(f"""
            import json
            from driftcli.io.readers import open_inputs
            got = open_inputs([{str(tmp_path)!r}])
            print(json.dumps([[r.name for r in got.tensors], [e.message for e in got.errors]]))
        """, timeout=30)
    names, messages = json.loads(out)
    assert names == ["w"]
    kinds = sorted(m.split(" is ")[1].split(",")[0] for m in messages)
    assert kinds == ["a FIFO (named pipe)", "a socket"]


def test_a_symlink_to_dev_zero_in_a_folder_hangs_neither_the_reader_nor_the_hashing(
        tmp_path: Path) -> None:
    import pandas as pd

    save_file({"w": torch.linspace(-1, 1, 64).reshape(2, 32)}, str(tmp_path / "a.safetensors"))
    (tmp_path / "z.safetensors").symlink_to("/dev/zero")
    out = tmp_path / "out"
    # before the fix: the provenance thread hashed /dev/zero at 100 % CPU, forever
    code = bounded(f"""
        import sys
        from typer.testing import CliRunner
        from driftcli.cli import app
        r = CliRunner().invoke(app, ["clip-rate", {str(tmp_path)!r}, "-c", "mxfp8_e4m3",
                                     "--out", {str(out)!r}, "-q"])
        print(r.exit_code)
        print(r.output, file=sys.stderr)
    """, timeout=60)
    assert code.strip() == "2"  # one input could not be read; the rest was measured
    t = pd.read_parquet(out / "clip-rate.parquet")
    bad = t[t.error.notna() & (t.tensor != "*")]
    assert set(t.tensor) == {"w", "(unreadable file)", "*"}
    assert bad.error.iloc[0].endswith(
        "z.safetensors is a character device (through a symbolic link), not a regular file: "
        "drift reads only regular files (a pipe or a device can block or never end); copy the "
        "data into a file")


def test_a_file_replaced_by_a_fifo_after_listing_is_refused_when_read(tmp_path: Path) -> None:
    import numpy as np

    save_file({"w": torch.ones(2, 4)}, str(tmp_path / "a.safetensors"))
    np.save(tmp_path / "b.npy", np.ones((2, 4), np.float32))
    np.savez(tmp_path / "c.npz", c=np.ones((2, 4), np.float32))
    # before the fix: the read's open() blocked forever on the FIFO put in the file's place
    out = bounded(f"""
        import os
        from driftcli.io.readers import ReadError, open_inputs
        got = open_inputs([{str(tmp_path)!r}])
        for ref in got.tensors:
            os.remove(ref.source)
            os.mkfifo(ref.source)
            try:
                ref.read()
            except ReadError as exc:
                print(str(exc).split(": ", 1)[1])
    """, timeout=30)
    assert out.splitlines() == [
        "cannot read tensor w: not a regular file (a pipe or a device can block or never end)",
        "cannot read tensor b: not a regular file (a pipe or a device can block or never end)",
        "cannot read tensor c (OSError: " + str(tmp_path / "c.npz") + " is not a regular file "
        "any more)"]


# --- work bounded by the bytes given ------------------------------------------------------------


def test_a_stride_0_view_of_2_to_the_36_elements_is_refused_not_measured_for_an_hour(
        tmp_path: Path) -> None:
    import pandas as pd

    four = torch.tensor([1.0, 2.0, 3.0, 4.0])
    base = torch.arange(1999, dtype=torch.float32)
    tied = torch.linspace(-1, 1, 64).reshape(2, 32)
    torch.save({"huge": four.as_strided((1 << 18, 1 << 18), (0, 0)),
                "overlap": base.as_strided((1000, 1000), (1, 1)),  # 10^6 over 1,999 elements
                "rows": base[8:72].reshape(2, 32), "tied": tied, "tied_again": tied},
               tmp_path / "bomb.pt")
    assert (tmp_path / "bomb.pt").stat().st_size < 16_000
    out = tmp_path / "out"
    # before the fix: 2^36 elements measured (~50 minutes; the timeout fails the test)
    bounded(f"""
        from driftcli.measures import MEASURES
        from driftcli.io.tables import write_table
        rows = MEASURES["clip-rate"].run([{str(tmp_path / "bomb.pt")!r}], ["mxfp8_e4m3"])
        import pandas as pd
        pd.DataFrame([r.__dict__ for r in rows]).to_parquet({str(out)!r})
    """, timeout=60)
    t = pd.read_parquet(out).set_index("tensor")
    assert t.loc["huge"].error.endswith(
        "tensor huge has 68,719,476,736 elements (shape [262144, 262144], strides [0, 0]) over "
        "a storage of 16 bytes: a view that repeats elements (a stride of 0 or rows that "
        "overlap), so its size is not bounded by the file's bytes and drift refuses it; save "
        "a copy of it (t.contiguous())")
    assert "tensor overlap has 1,000,000 elements" in t.loc["overlap"].error
    # views within their storage are measured: a slice of a larger one, a tensor twice
    assert t.loc[["rows", "tied", "tied_again"]].error.isna().all()
    assert list(t.loc[["rows", "tied", "tied_again"]].n_finite) == [64, 64, 64]



def test_40000_empty_tensors_in_2_mb_cost_seconds_not_minutes(tmp_path: Path) -> None:
    save_file({f"e{i:05d}": torch.zeros(0) for i in range(40_000)} | {"w": torch.ones(2, 32)},
              str(tmp_path / "empty.safetensors"))
    assert (tmp_path / "empty.safetensors").stat().st_size < 2_500_000
    # before the fix: every empty tensor measured at a few ms each (2 minutes and more)
    out = bounded(f"""
        import json
        from driftcli.measures import MEASURES
        rows = MEASURES["clip-rate"].run([{str(tmp_path / "empty.safetensors")!r}],
                                         ["mxfp8_e4m3"])
        print(json.dumps([[r.tensor, r.numel, r.error] for r in rows]))
    """, timeout=45)
    rows = json.loads(out)
    measured = [r for r in rows if r[2] is None and r[0] != "*"]
    assert len(measured) == 1_001 and ["w", 64, None] in measured
    assert sum(r[1] == 0 for r in measured) == 1_000
    (bad,) = [r for r in rows if r[2] is not None and r[0] != "*"]
    assert bad[2] == (f"{tmp_path / 'empty.safetensors'} holds 40,001 tensors, 40,000 of them "
                      "with no elements: over drift's limits of 100,000 tensors and 1,000 empty "
                      "ones a file, so 39,000 (first: e01000) are not measured; split the "
                      "file, or leave out the empty tensors")


def test_tensors_past_the_limit_of_a_file_are_left_out_with_one_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from driftcli.io.readers import core, npy

    monkeypatch.setattr(core, "MAX_ENTRIES", 10)
    monkeypatch.setattr(npy, "MAX_ENTRIES", 10)
    tensors = {f"t{i:02d}": torch.full((2,), float(i)) for i in range(25)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    torch.save(tensors, tmp_path / "b.pt")
    np.savez(tmp_path / "c.npz", **{k: v.numpy() for k, v in tensors.items()})
    got = open_inputs([tmp_path])
    for kind in "abc":
        names = [r.name for r in got.tensors if Path(r.source).stem == kind]
        assert names == [f"t{i:02d}" for i in range(10)], kind
    assert [e.message.split(", so ")[1] for e in got.errors] == [
        "15 (first: t10) are not measured; split the file, or leave out the empty tensors",
        "15 (first: t10) are not measured; split the file, or leave out the empty tensors",
        "15 (first: t10.npy) are not read; split the archive"]


def test_a_storage_under_many_names_is_measured_at_most_four_times_over(tmp_path: Path) -> None:
    big = torch.linspace(-1, 1, 4096).reshape(64, 64)
    flat = torch.arange(128, dtype=torch.float32)
    names = {f"alias{i:02d}": big for i in range(12)}
    torch.save({**names, "lo": flat[:64], "hi": flat[64:], "halves": flat.reshape(2, 64)},
               tmp_path / "many.pt")
    got = open_inputs([tmp_path / "many.pt"])
    # before the fix: 12 names of one storage, 12 times its bytes measured (100,000 names
    # in a file would buy 100,000 times the file's bytes of work)
    assert [r.name for r in got.tensors] == [
        "alias00", "alias01", "alias02", "alias03", "lo", "hi", "halves"]
    assert [e.tensor for e in got.errors] == [f"alias{i:02d}" for i in range(4, 12)]
    assert got.errors[0].message == (
        f"{tmp_path / 'many.pt'}: tensor alias04 is one more view of a storage of 16,384 bytes "
        "that the file's tensors before it already cover 4 times: drift measures a storage at "
        "most 4 times over, so its work stays bounded by the file's bytes; save a copy of it "
        "(t.clone())")

# --- names are data -----------------------------------------------------------------------------


def test_pt_names_that_flatten_alike_are_an_error_naming_both(tmp_path: Path) -> None:
    t = [torch.full((2, 2), float(i)) for i in range(5)]
    torch.save({"a.b": t[0], "a": {"b": t[1], "c": t[2]}, "d": [t[3], t[4]]}, tmp_path / "x.pt")
    got = open_inputs([tmp_path / "x.pt"])
    # before the fix: a.b silently the first tensor, the second dropped
    assert [r.name for r in got.tensors] == ["a.c", "d.0", "d.1"]
    assert [(e.tensor, e.message) for e in got.errors] == [(
        "a.b", f"{tmp_path / 'x.pt'}: tensors ['a.b'] and ['a']['b'] both flatten to the name "
        "a.b, so drift cannot tell them apart and measures neither; rename one (nested keys "
        "are joined with '.')")]
    assert [float(r.read()[0, 0]) for r in got.tensors] == [2.0, 3.0, 4.0]


def test_an_npz_member_read_in_slices_is_inflated_once_not_once_a_slice(tmp_path: Path) -> None:
    import numpy as np

    np.savez_compressed(tmp_path / "z.npz", z=np.zeros((4096, 4096), np.float32))
    assert (tmp_path / "z.npz").stat().st_size < 200_000  # 64 MiB in the member
    # 4,096 reads of one row each: inflated from the member's start each time, that is
    # 128 GiB inflated (minutes; the timeout fails the test); streamed, 64 MiB
    out = bounded(f"""
        import time
        from driftcli.io.readers import open_inputs
        (ref,) = open_inputs([{str(tmp_path / "z.npz")!r}]).tensors
        t = time.perf_counter()
        total = sum(ref.read(i, i + 1).shape[0] for i in range(4096))
        again = ref.read(0, 2)  # a read further back rewinds
        print(total, again.shape[0], time.perf_counter() - t)
    """, timeout=60)
    total, rows, seconds = out.split()
    assert (int(total), int(rows), float(seconds) < 50) == (4096, 2, True)


def test_a_fortran_ordered_npz_member_reads_back(tmp_path: Path) -> None:
    import numpy as np

    a = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    np.savez_compressed(tmp_path / "f.npz", a=a, b=np.arange(5.0))
    got = open_inputs([tmp_path / "f.npz"])
    ref, other = got.tensors
    # before: read_array was handed the stream after the header ("the magic string is not
    # correct")
    assert torch.equal(ref.read(1, 3), torch.from_numpy(np.ascontiguousarray(a[1:3])))
    assert torch.equal(other.read(2, 4), torch.tensor([2.0, 3.0], dtype=torch.float64))
    assert torch.equal(ref.read(), torch.from_numpy(np.ascontiguousarray(a)))


def test_non_utf8_file_names_in_a_folder_and_as_out_are_shown_escaped(tmp_path: Path) -> None:
    import pandas as pd

    folder = tmp_path / "in"
    folder.mkdir()
    save_file({"w": torch.linspace(-1, 1, 64).reshape(2, 32)}, str(folder / "ok.safetensors"))
    bad = os.fsdecode(os.fsencode(folder) + b"/bad\xff.safetensors")  # held as a surrogate
    save_file({"v": torch.linspace(-2, 2, 64).reshape(2, 32)}, bad)
    out = os.fsdecode(os.fsencode(tmp_path) + b"/out\xfe")
    # before the fix: UnicodeEncodeError (the run lost for one name)
    result = CliRunner().invoke(app, ["clip-rate", str(folder), "-c", "mxfp8_e4m3",
                                      "--out", out])
    assert result.exit_code == 0, result.output
    table = Path(out) / "clip-rate.parquet"
    assert f"wrote {tmp_path}/out\\xfe/clip-rate.parquet" in result.output
    with open(table, "rb") as fh:  # (pyarrow opens no path that is not UTF-8)
        t = pd.read_parquet(fh).set_index("tensor")
    assert t.loc["v"].source == f"{folder}/bad\\xff.safetensors"  # shown escaped
    assert t.loc["v"].n_finite == 64 and pd.isna(t.loc["v"].error)  # read by its real name
    assert t.loc["*"].n_tensors == 2


def test_provenance_stats_a_fifo_or_a_device_and_never_reads_it(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "p.npy")
    (tmp_path / "z.safetensors").symlink_to("/dev/zero")
    # before the fix: file_identity hashed /dev/zero forever, or blocked opening the FIFO
    out = bounded(f"""
        import json
        from pathlib import Path
        from driftcli.io.tables import file_identity
        print(json.dumps([sorted(file_identity(Path({str(tmp_path)!r}) / n))
                          for n in ("p.npy", "z.safetensors")]))
    """, timeout=30)
    assert json.loads(out) == [["mtime", "path", "size"], ["mtime", "path", "size"]]


def test_a_te_dump_whose_tensor_is_a_stride_0_view_is_refused(tmp_path: Path) -> None:
    four = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.save({"high_precision": four.as_strided((1 << 18, 1 << 18), (0, 0))},
               tmp_path / "fc1_activation_iter_000001.pt")
    got = open_inputs([tmp_path])
    assert got.tensors == ()
    assert [(e.tensor, e.message.split(" has ")[1][:34]) for e in got.errors] == [
        ("fc1.activation", "68,719,476,736 elements (shape [26")]


def test_a_config_json_that_is_a_fifo_or_dev_zero_is_not_read(tmp_path: Path) -> None:
    for name, make in (("fifo", os.mkfifo), ("zero", lambda p: p.symlink_to("/dev/zero"))):
        folder = tmp_path / name
        folder.mkdir()
        save_file({"w": torch.ones(2, 4)}, str(folder / "model.safetensors"))
        make(folder / "config.json")
    # before the fix: the quantization config was read from the FIFO (blocks) or from
    # /dev/zero (reads until memory runs out)
    out = bounded(f"""
        from driftcli.io.readers import open_inputs
        for name in ("fifo", "zero"):
            got = open_inputs([{str(tmp_path)!r} + "/" + name])
            print(name, [r.name for r in got.tensors], len(got.errors))
    """, memory_gib=2.0, timeout=30)
    assert out.splitlines() == ["fifo ['w'] 0", "zero ['w'] 0"]


def test_a_non_utf8_file_given_by_name_is_measured(tmp_path: Path) -> None:
    bad = os.fsdecode(os.fsencode(tmp_path) + b"/bad\xff.safetensors")
    save_file({"v": torch.linspace(-2, 2, 64).reshape(2, 32)}, bad)
    result = CliRunner().invoke(app, ["clip-rate", bad, "-c", "mxfp8_e4m3",
                                      "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
