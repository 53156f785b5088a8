"""Hostile inputs outside the readers (issue 31): names that are markup or terminal sequences,
recorded inputs that are not regular files, and small files that claim huge work (a Parquet
table of 50 M rows, a checkpoint claiming a huge model, a gzip of recordings, a huge
``accum-error`` shape). Each case runs ``drift`` in a fresh process under an address-space
limit and a timeout, so a bomb fails the test instead of the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import driftcli

HEADROOM = 2 << 30
"""Address space a drift command gets beyond what it maps once torch and the CLI are imported
(about 650 MB with a CPU build of torch, more with a CUDA one, so the limit is relative): a
clip-rate run of a small file takes under 1 GiB more; every bomb below asks for more than
3 GiB."""
TIMEOUT = 60
"""Seconds a case may take on a loaded 2-core machine (each takes a few)."""
RAW = (b"\x1b", b"\x07", b"\r", b"\x9b")
"""Bytes that must never reach the terminal from a name."""
HELD = """if True:
    import resource, sys
    import torch
    from driftcli.cli import main
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]),) * 2)
    sys.argv = ["drift", *sys.argv[2:]]
    main()
"""
"""``drift`` held to its imports' address space and a headroom (``python -c HELD HEADROOM
ARGV...``)."""


def drift(*argv: str, cwd: Path, headroom: int = HEADROOM,
          timeout: float = TIMEOUT) -> subprocess.CompletedProcess[bytes]:
    """``drift ARGV`` in ``cwd``, in a fresh interpreter held to ``headroom`` bytes of address
    space beyond its imports and to ``timeout`` seconds; its output as bytes (to see raw
    control bytes)."""
    env = {**os.environ, "PYTHONPATH": str(Path(driftcli.__file__).parents[1]),
           "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-c", HELD, str(headroom), *argv], cwd=cwd,
                          env=env, capture_output=True, timeout=timeout, check=False)


def no_raw(proc: subprocess.CompletedProcess[bytes]) -> None:
    for stream in (proc.stdout, proc.stderr):
        for byte in RAW:
            assert byte not in stream, (byte, stream[-2000:])


# --- names are data ---------------------------------------------------------------------------

NAMES = ("[/]", "[bold red]x[/]", "osc\x1b]52;c;aGk=\x07", "cr\rfake\x1b[2K")
BAD_FILE = "bad[red]\x1b]52;c;aGk=\x07.safetensors"
"""A file name with markup and an OSC 52 clipboard write (a name cannot hold ``/``)."""


def _hostile_names(tmp_path: Path) -> None:
    save_file({n: torch.linspace(-1000, 1000, 128).reshape(8, 16) for n in (*NAMES, "plain")},
              tmp_path / "m.safetensors")
    (tmp_path / BAD_FILE).write_bytes(b"garbage!")
    (tmp_path / "rng_state\x1b[2K.pth").write_bytes(b"training state, skipped unread")


def test_markup_and_escapes_in_names_are_printed_as_text(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _hostile_names(tmp_path)
    run = drift("clip-rate", ".", "-c", "fp8_e4m3", "--out", "out", cwd=tmp_path)
    no_raw(run)
    out, err = run.stdout.decode(), run.stderr.decode()
    # the summary, the error lines and the exit code all survive the names
    assert run.returncode == 2, err
    assert "[/] 0" in out and "[bold red]x[/] 0" in out and "cr\\x0dfake\\x1b[2K 0" in out
    assert "wrote out/clip-rate.parquet" in out
    assert "skipped rng_state\\x1b[2K.pth: holds no weights (training state)" in out
    assert "not measured bad[red]\\x1b]52;c;aGk=\\x07.safetensors (unreadable file)" in out
    assert err.startswith("error: 1 tensor(s) or file(s) could not be read, first "
                          "bad[red]\\x1b]52;c;aGk=\\x07.safetensors (unreadable file)")

    # the report of that table, rendered here (a second drift process would double the time)
    import io

    from rich.console import Console

    from driftcli.report import Options, make_report
    from driftcli.report.terminal import render

    shown = io.StringIO()
    monkeypatch.chdir(tmp_path)  # the recorded inputs are relative to the run's folder
    render(make_report([Path("out")], Options()),
           Console(file=shown, width=160, highlight=False, soft_wrap=True))
    text = shown.getvalue()
    assert not any(c in text for c in ("\x1b", "\x07", "\r")), text
    assert "inputs: bad[red]\\x1b]52;c;aGk=\\x07.safetensors, m.safetensors" in text
    assert text.rstrip().endswith("1 table(s) summarized")


def test_the_escaping_function() -> None:
    from driftcli.escaping import for_terminal

    assert for_terminal("[/]") == "\\[/]"
    assert for_terminal("a\x1b[2Kb\rc\x9b\u202ed", markup=False) == "a\\x1b[2Kb\\x0dc\\x9b\\u202ed"
    # a non-UTF-8 byte of a file name (surrogateescape) is shown as the byte
    assert for_terminal(b"n\xff".decode("utf-8", "surrogateescape"), markup=False) == "n\\xff"
    assert for_terminal("plain name.safetensors") == "plain name.safetensors"


# --- drift report: recorded inputs that are not files, tables that claim millions of rows -------


def _table(path: Path, prov: dict[str, Any], rows: int = 2, repeat: int = 1) -> Path:
    """A drift table of a kind this drift does not know (summarized from its metadata):
    ``rows`` × ``repeat`` rows of one repeated key and value, written ``rows`` at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = {b"drift.table": b"bomb", b"drift.keys": b'["tensor"]', b"drift.headline": b"v",
            b"drift.higher_is_worse": b"true", b"drift": json.dumps(prov).encode()}
    keys = pa.DictionaryArray.from_arrays(np.zeros(rows, np.int8), pa.array(["t"]))
    chunk = pa.table({"tensor": keys, "v": pa.array(np.zeros(rows))}).replace_schema_metadata(
        meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, chunk.schema) as writer:
        for _ in range(repeat):
            writer.write_table(chunk)
    return path


def test_report_stats_never_reads_a_recorded_input_that_is_not_a_file(tmp_path: Path) -> None:
    fifo = tmp_path / "dump.safetensors"
    os.mkfifo(fifo)
    # hashed long ago, and the files at those paths changed since: the check would hash them
    inputs = [{"path": str(fifo), "size": 0, "sha256": "0" * 64},
              {"path": "/dev/zero", "size": 0, "sha256": "0" * 64}]
    _table(tmp_path / "t" / "bomb.parquet", {"inputs": inputs, "utc": "2000-01-01T00:00:00+00:00"})
    run = drift("report", "t", cwd=tmp_path, timeout=30)
    out = run.stdout.decode()
    assert run.returncode == 0, run.stderr.decode()
    assert (f"stale: {fifo} is not the file this table measured (now a FIFO, not a regular "
            "file)") in out
    assert ("stale: /dev/zero is not the file this table measured (now a character device, "
            "not a regular file)") in out


def test_report_refuses_a_table_of_more_rows_than_its_budget(tmp_path: Path) -> None:
    # 50 M rows of one repeated key and value: 330 KB on disk; read, 4 GB
    _table(tmp_path / "t" / "bomb.parquet", {}, rows=10_000_000, repeat=5)
    assert (tmp_path / "t" / "bomb.parquet").stat().st_size < 1 << 20
    start = time.perf_counter()
    run = drift("report", "t", cwd=tmp_path)
    assert time.perf_counter() - start < 20  # refused from the footer: the start-up's time
    assert run.returncode == 2
    assert run.stderr.decode() == (
        "error: t/bomb.parquet holds 50,000,000 rows, beyond the 1,000,000 rows a report "
        "reads; report fewer tables at a time, or set DRIFT_REPORT_MAX_ROWS higher if this "
        "machine has the memory (about 700 bytes a row)\n")


def test_the_row_budget_counts_every_table_and_is_set_by_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from driftcli.errors import DriftError
    from driftcli.report.load import TooManyRowsError, load

    first = _table(tmp_path / "a" / "bomb.parquet", {}, rows=2)
    second = _table(tmp_path / "b" / "bomb.parquet", {}, rows=2)
    monkeypatch.setenv("DRIFT_REPORT_MAX_ROWS", "4")
    assert [len(t.frame) for t in load([first, second]).tables] == [2, 2]
    monkeypatch.setenv("DRIFT_REPORT_MAX_ROWS", "3")
    with pytest.raises(TooManyRowsError, match=r"b/bomb.parquet holds 2 rows, with the 2 of "
                                               r"the tables before it, beyond the 3 rows"):
        load([first, second])
    monkeypatch.setenv("DRIFT_REPORT_MAX_ROWS", "many")
    with pytest.raises(DriftError, match="DRIFT_REPORT_MAX_ROWS='many' is not a positive"):
        load([first])


# --- drift checkpoints: the config is the file's word -------------------------------------------


def test_a_checkpoint_claiming_a_huge_model_is_refused_before_it_is_built(tmp_path: Path) -> None:
    # 50 layers of 200,000 × 200,000: 160 GB of float32 in a file of a few hundred bytes
    config = {"kind": "mlp", "hidden": 200_000, "layers": 50}
    save_file({"x": torch.zeros(1)}, tmp_path / "ck.safetensors", metadata={
        "drift.model": json.dumps({"version": 1, "config": config, "state": {}})})
    assert (tmp_path / "ck.safetensors").stat().st_size < 300
    (tmp_path / "t.txt").write_text("to be or not to be, " * 40)
    run = drift("grad-cosine", "ck.safetensors", "-p", "exact", "--text", "t.txt",
                "--tokens", "8", "--out", "out", cwd=tmp_path)
    err = run.stderr.decode()
    assert run.returncode == 2, err
    assert err == ("error: ck.safetensors: the weights do not fit its mlp config (embed.weight "
                   "of shape [256, 16] is not in the file); the file was not written by drift "
                   "train, or its metadata was edited\n")
    assert not (tmp_path / "out" / "grad-cosine.parquet").exists()


def test_a_checkpoint_is_checked_against_its_weights_and_the_memory(tmp_path: Path) -> None:
    from driftcli.models.checkpoint import CheckpointFileError, check_sizes, load_checkpoint
    from driftcli.models.config import MLPConfig
    from driftcli.models.nets import build_model

    config = MLPConfig(hidden=8, layers=1, context=4, embed=2)
    model = build_model(config)
    path = tmp_path / "ck.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path, metadata={
        "drift.model": json.dumps({"version": 1, "config": config.to_json(), "state": {}})})
    assert load_checkpoint(path).config == config  # what fits loads
    need = sum(v.numel() * 4 for v in model.state_dict().values())
    with pytest.raises(CheckpointFileError, match=f"its mlp model takes {need:,} bytes, and "
                       f"loading holds it twice \\({2 * need:,}\\), more than the 1,000 bytes"):
        check_sizes(path, config, memory=1_000)
    wider = MLPConfig(hidden=9, layers=1, context=4, embed=2)
    with pytest.raises(CheckpointFileError, match=r"hidden.0.weight: the config needs \[9, 8\], "
                                                  r"the file holds \[8, 8\]"):
        check_sizes(path, wider)


# --- calibrate --recordings: a gzip that inflates to half a gigabyte ----------------------------


def test_compressed_recordings_are_read_streaming_with_a_bound(tmp_path: Path) -> None:
    import gzip

    folder = tmp_path / "rec" / "H100" / "E4M3"
    folder.mkdir(parents=True)
    line = (" ".join(["3f800000"] * 32) + "\n").encode()
    # one 16 MiB member, repeated: 512 MiB of 32-value lines (58 M values) in 2.3 MB
    member = gzip.compress(line * ((16 << 20) // len(line)), compresslevel=9)
    (folder / "a_H100_E4M3.txt.gz").write_bytes(member * 32)
    for name in ("b_H100_E4M3", "c_H100_fp32", "d_H100_fp32"):
        (folder / f"{name}.txt.gz").write_bytes(gzip.compress(b"0\n"))
    start = time.perf_counter()
    run = drift("calibrate", "--recordings", "rec/H100/E4M3", "--out", "out", cwd=tmp_path)
    assert time.perf_counter() - start < 30  # 1 M values parsed, then refused
    assert run.returncode == 2, run.stderr.decode()[-2000:]
    assert run.stderr.decode() == (
        "error: recordings file rec/H100/E4M3/a_H100_E4M3.txt.gz holds more than 1,048,576 "
        "values, the most drift reads from one file; split the recordings into folders of "
        "fewer dot products\n")


def test_recordings_are_bounded_in_lines_and_line_length(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from driftcli.arith import tensorcores as tc
    from driftcli.errors import DriftError

    folder = tmp_path / "H100" / "E4M3"
    folder.mkdir(parents=True)
    (folder / "a_H100_E4M3.txt").write_text("\n" * 11 + "3f800000\n")
    monkeypatch.setattr(tc, "MAX_LINES", 10)
    with pytest.raises(DriftError, match=r"a_H100_E4M3.txt holds more than 10 lines"):
        tc.read_recordings(folder)
    (folder / "a_H100_E4M3.txt").write_text("3f800000 " * 4 + "\n")
    monkeypatch.setattr(tc, "MAX_LINE", 20)
    with pytest.raises(DriftError, match=r"more than 20 characters in a line"):
        tc.read_recordings(folder)


# --- accum-error: shapes against memory ----------------------------------------------------------


def test_accum_error_refuses_a_shape_larger_than_memory(tmp_path: Path) -> None:
    run = drift("accum-error", "--shape", "100000x100000x100000", "--out", "out", cwd=tmp_path)
    err = run.stderr.decode()
    assert run.returncode == 2, err[-2000:]
    assert err.startswith("error: shape 100000x100000x100000: measuring it takes about "
                          "2,384.2 GiB (operands, the exact product's float64 sums), more "
                          "than the "), err
    assert err.endswith(" GiB of memory available; give smaller shapes\n") and err.count("\n") == 1


def test_a_dump_matmul_larger_than_memory_is_a_row_error_and_the_others_are_measured() -> None:
    from driftcli.errors import DriftError
    from driftcli.measures.accum_error import DEFAULT_SPECS, check_shapes, matmul_bytes, measure
    from driftcli.measures.accum_problems import Problem

    # 8 MB of operands, 10^12 outputs
    wide = Problem.of("d.safetensors", "outer", torch.ones(1_000_000, 1), torch.ones(1, 1_000_000))
    rows = measure(wide, DEFAULT_SPECS[:1])
    assert rows[0].rel_error is None and rows[0].error is not None
    assert rows[0].error.startswith("a 1x1000000x1x1000000 matmul takes about 119,209.4 GiB to "
                                    "measure, more than the ")
    small = Problem.of("d.safetensors", "small", torch.ones(4, 8), torch.ones(8, 2))
    assert measure(small, DEFAULT_SPECS[:1])[0].rel_error == 0.0
    assert matmul_bytes(1, 64, 1024, 64) == 64 * 2 * 64 * 1024 + 128 * 64 * 64  # 8.5 MB
    check_shapes([(64, 1024, 64)], memory=10 << 20)
    with pytest.raises(DriftError, match=r"shape 64x1024x64: measuring it takes about 0\.0 GiB"):
        check_shapes([(64, 1024, 64)], memory=1 << 20)


def test_a_live_progress_bar_prints_names_as_text(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from driftcli.cli.run import Bar, progress_bar

    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # Rich draws the bar as on a terminal
    # a label is a run folder's name, a description a tensor's: markup, braces, an OSC 52
    with progress_bar("train {0} [/]", Bar.ITEMS, quiet=False) as advance:
        advance(1, 2, "[bold red]x[/] osc\x1b]52;c;aGk=\x07")
    with progress_bar("scanning", Bar.BYTES, quiet=False) as advance:
        advance(1, 2, "[/]")
    err = capsys.readouterr().err
    assert "train {0} [/]" in err and "[bold red]x[/] osc\\x1b]52;c;aGk=\\x07" in err
    assert "\x1b]52" not in err and "\x07" not in err
