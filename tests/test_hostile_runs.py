"""Hostile runs (issue 42): hashing a file that streams past its size, worker processes
outliving a killed parent, a health reference of another model, forged kept units under
``--resume``, checkpoint steps that are not steps, and a crash told apart from a gate by its
exit code. Every case that could hang or blow up runs in a fresh process under a timeout."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import driftcli
from driftcli.cli import app
from driftcli.io.tables import read_table, write_table
from driftcli.models import MLPConfig, save_checkpoint
from driftcli.models.config import TransformerConfig
from driftcli.models.nets import build_model

ROOT = Path(driftcli.__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
PAGEMAP = Path("/proc/self/pagemap")
"""A regular file of size 0 that streams one entry per page of the reader's address space
(about 256 GB on x86-64), readable by its owner."""
EMPTY_SHA = hashlib.sha256(b"").hexdigest()
MEMORY = 4 << 30
"""Address space each process started here may map (torch, numba and a small scan take under
2 GiB): a case that would read a stream into memory fails instead of swapping the machine."""


def capped() -> None:
    """``preexec_fn`` of every process a test starts: the :data:`MEMORY` limit."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def drift_proc(*argv: str | Path, cwd: Path, timeout: float = 60,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``drift ARGV`` in a fresh interpreter held to ``timeout`` seconds (a hang fails)."""
    return subprocess.run([sys.executable, "-m", "driftcli", *map(str, argv)], cwd=cwd,
                          env=env or ENV, capture_output=True, text=True, timeout=timeout,
                          check=False, preexec_fn=capped)


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


# --- 7: hashing reads exactly st_size bytes --------------------------------------------------

def _streaming_file(tmp_path: Path) -> Path:
    """A link in ``tmp_path`` to a file whose stat says 0 bytes but whose reads go on (drift's
    tests run on Linux, which has /proc)."""
    link = tmp_path / "pagemap.safetensors"
    link.symlink_to(PAGEMAP)
    return link


def test_hashing_a_file_that_streams_past_its_size_reads_st_size_bytes(tmp_path: Path) -> None:
    link = _streaming_file(tmp_path)
    # before the fix: sha256_of read the ~256 GB pagemap stream to its end (timeout)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from driftcli.io.tables import file_identity, sha256_of
        print(sha256_of(Path({str(link)!r})))
        print(file_identity(Path({str(link)!r}))["size"])
    """)], env=ENV, capture_output=True, text=True, timeout=30, check=False, preexec_fn=capped)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [EMPTY_SHA, "0"]


def test_a_scan_of_a_folder_linking_pagemap_ends_with_its_table(tmp_path: Path) -> None:
    _streaming_file(tmp_path)
    save_file({"w": torch.linspace(-1, 1, 64).reshape(2, 32)}, str(tmp_path / "a.safetensors"))
    run = drift_proc("clip-rate", tmp_path, "-c", "mxfp8_e4m3", "--out", tmp_path / "out", "-q",
                     cwd=tmp_path, timeout=90)
    assert run.returncode == 2, run.stderr  # the link is no tensor file; the rest measured
    frame, prov = read_table(tmp_path / "out" / "clip-rate.parquet")
    assert "w" in set(frame.tensor)
    hashed = {Path(i["path"]).name: i for i in prov["inputs"]}
    assert hashed["pagemap.safetensors"]["sha256"] == EMPTY_SHA


def test_report_on_a_table_naming_pagemap_does_not_hang(tmp_path: Path) -> None:
    from driftcli.measures.clip_rate import ClipRateRow

    prov = {"drift_version": "0.1.0", "utc": "2020-01-01T00:00:00+00:00",
            "command": ["drift", "clip-rate"],
            "inputs": [{"path": str(PAGEMAP), "size": 0, "sha256": "00" * 32}]}
    row: dict[str, Any] = {f.name: None for f in dataclasses.fields(ClipRateRow)}
    row.update(source=str(PAGEMAP), tensor="w", cast="mxfp8_e4m3", cast_name="mxfp8_e4m3",
               format="float8_e4m3fn",
               granularity="block", block=32, rounding="rne", n_tensors=1, n_skipped=0,
               clip_rate=0.0, clipped=0, n_blocks=1)
    write_table(tmp_path / "clip-rate.parquet", ClipRateRow, [ClipRateRow(**row)], prov)
    # before the fix: the input check hashed the pagemap stream (timeout)
    run = drift_proc("report", tmp_path, cwd=tmp_path, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "pagemap" in run.stdout


def _sparse(path: Path, size: int = 64 << 30) -> Path:
    """A file of ``size`` bytes taking no disk (reads as zeros): a minute of hashing."""
    with path.open("wb") as fh:
        fh.truncate(size)
    return path


def test_an_interrupt_while_waiting_stops_the_background_hash(tmp_path: Path) -> None:
    """Ctrl-C while a notebook waits for the inputs' hashes stops the hashing thread at its
    next read, rather than leaving it reading 64 GiB for a minute in the background."""
    big = _sparse(tmp_path / "big.bin")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, threading, time
        from pathlib import Path
        from driftcli.io.tables import identify_in_background

        def reading():
            # (Thread.is_alive() says False after an interrupted join, whatever the thread
            # does: the file still open is what tells)
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{{fd}}") == {str(big)!r}:
                        return True
                except OSError:
                    pass
            return False

        result = identify_in_background([Path({str(big)!r})])
        time.sleep(0.5)
        was = reading()
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C
        try:
            result()
        except KeyboardInterrupt:
            pass
        stopped = time.monotonic()
        while reading() and time.monotonic() - stopped < 20:
            time.sleep(0.1)
        print(int(was), round(time.monotonic() - stopped, 1), reading())
    """)], env=ENV, capture_output=True, text=True, timeout=60, check=False, preexec_fn=capped)
    assert done.returncode == 0, done.stderr[-2000:]
    was_reading, took, reading = done.stdout.split()
    # before the fix: the thread read on for the whole 64 GiB (still reading after 20 s)
    assert was_reading == "1" and reading == "False" and float(took) < 5, done.stdout


def test_ctrl_c_during_a_long_hash_ends_the_command_at_once(tmp_path: Path) -> None:
    """A large input still hashing when the scan is done: SIGINT ends the command within
    seconds with exit 130, and no table is written."""
    save_file({"w": torch.ones(2, 32)}, str(tmp_path / "a.safetensors"))
    big = _sparse(tmp_path / "big.safetensors")
    proc = subprocess.Popen([sys.executable, "-m", "driftcli", "clip-rate", str(tmp_path), "-c",
                             "mxfp8_e4m3", "--out", str(tmp_path / "out"), "-q"], env=ENV,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=capped)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _reading(proc.pid, big):
            time.sleep(0.2)
        assert _reading(proc.pid, big), "the hash never started"
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "clip-rate.parquet").exists()


def _reading(pid: int, path: Path) -> bool:
    """Whether process ``pid`` holds ``path`` open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


# --- 11: workers die with their parent -------------------------------------------------------

def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_processes_workers_and_tracker_die_with_a_killed_parent(tmp_path: Path) -> None:
    save_file({f"w{i}": torch.randn(256, 1024) for i in range(12)}, str(tmp_path / "m.safetensors"))
    proc = subprocess.Popen([sys.executable, "-m", "driftcli", "error-bias", str(tmp_path),
                             "-c", "mxfp8_e4m3:sr", "--draws", "64", "--engine", "processes",
                             "--workers", "2", "--out", str(tmp_path / "out"), "-q"], env=ENV,
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=capped)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(children) < 3:  # tracker + 2 workers
            children = _children(proc.pid)
            time.sleep(0.2)
        assert len(children) >= 3, children
        time.sleep(1.0)  # the workers past their start
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        left = {c for c in children if _alive(c)}
        # before the fix: both workers and the resource tracker still alive 30 s later
        assert not left, left
    finally:
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)


# --- 12: health --reference of another model -------------------------------------------------

SMALL = MLPConfig(context=8, hidden=16, layers=1)


def _run(folder: Path, config: Any, steps: tuple[Any, ...] = (0, 1), **train: Any) -> Path:
    """Checkpoints of ``config`` at ``steps`` (each a fresh model: health reads their
    weights), the training settings ``train`` recorded."""
    torch.manual_seed(0)
    settings = {"seed": 0, "lr": 0.003, "storage": "float32", **train}
    for n, step in enumerate(steps):
        save_checkpoint(folder / f"step-{n:06d}.safetensors", build_model(config), config,
                        {"step": step, "train": settings})
    return folder


def test_a_reference_of_another_shape_is_refused_naming_the_difference(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", SMALL)
    other = _run(tmp_path / "ref", MLPConfig(context=8, hidden=32, layers=1))
    result = CliRunner().invoke(app, ["health", str(run), "--reference", str(other),
                                      "--out", str(tmp_path / "o")])
    # before the fix: exit 0 with predicted shares from another model's weights
    assert result.exit_code == 2, result.output
    line = one_line(result.stderr)
    assert line.startswith("error: reference ") and "hidden 32 against the run's 16" in line, line


def test_a_transformer_reference_is_one_line_not_a_key_error(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", SMALL)
    other = _run(tmp_path / "ref", TransformerConfig(context=8, d_model=16, layers=1, heads=2))
    result = CliRunner().invoke(app, ["health", str(run), "--reference", str(other),
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.exception  # before: KeyError, exit 1
    assert "model transformer against the run's mlp" in one_line(result.stderr)


def test_a_reference_of_another_seed_and_lr_is_said_in_one_line(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", SMALL, storage="bfloat16")
    other = _run(tmp_path / "ref", SMALL, seed=7, lr=0.01)
    result = CliRunner().invoke(app, ["health", str(run), "--reference", str(other),
                                      "--out", str(tmp_path / "o"), "-q"])
    assert result.exit_code == 0, result.output
    line = one_line(result.stderr)  # the storage, the expected difference, is not named
    assert line.startswith("warning: reference ") and "storage" not in line, line
    assert "lr 0.01 against the run's 0.003, seed 7 against the run's 0" in line, line


# --- 20: checkpoint steps that are not steps ---------------------------------------------------

@pytest.mark.parametrize("command", ["health", "probe"])
@pytest.mark.parametrize("step", ["x", [1], None, 1e308, True, -1])
def test_a_checkpoint_step_that_is_not_a_step_is_one_line_exit_2(
        tmp_path: Path, command: str, step: Any) -> None:
    run = _run(tmp_path / "run", SMALL, steps=(0, step))
    extra = ["-p", "exact"] if command == "probe" else []
    result = CliRunner().invoke(app, [command, str(run), *extra, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, (result.exception, result.output)
    line = one_line(result.stderr)
    assert "step-000001.safetensors" in line and f"step {json.dumps(step)}" in line, line


# --- 15: forged kept units are checked on read ---------------------------------------------

def _forge(folder: Path, change: Any, kind: str = ":CastStats") -> int:
    """Rewrite every kept unit in ``folder`` with ``change`` applied to the fields of each
    value whose type name ends in ``kind``, and a valid checksum (a forger can recompute it);
    the units changed."""
    changed = 0
    for path in folder.iterdir():
        head, _, body = path.read_bytes().partition(b"\n")
        unit = json.loads(body)

        def walk(value: Any) -> None:
            if isinstance(value, dict):
                if str(value.get("$c", "")).endswith(kind):
                    change(value["f"])
                for v in value.values():
                    walk(v)
            elif isinstance(value, list):
                for v in value:
                    walk(v)

        walk(unit["result"])
        new = json.dumps(unit, separators=(",", ":")).encode()
        header = json.loads(head) | {"sha256": hashlib.sha256(new).hexdigest()}
        path.write_bytes(json.dumps(header).encode() + b"\n" + new)
        changed += 1
    return changed


FORGERIES = {
    "clipped_over_numel": lambda f: f.update(clipped=f["numel"] * 2 - 3),
    "numel_a_string": lambda f: f.update(numel="x"),
    "negative_count": lambda f: f.update(nonfinite=-1),
    "nan_sum": lambda f: f.update(abs_sum={"$f": "nan"}),
    "numel_huge": lambda f: f.update(numel=10**30, clipped=10**29),
    "rounding_clips_over_clips": lambda f: f.update(clipped_by_rounding=f["clipped"] + 1),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_kept_unit_is_recomputed_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forgery: str) -> None:
    import driftcli.engines as engines

    x = torch.linspace(-1, 1, 512).reshape(8, 64)
    x[:, 3] *= 1e6  # clips in the blocks of column 3
    save_file({"w": x, "v": torch.ones(4, 64)}, str(tmp_path / "m.safetensors"))
    out = tmp_path / "out"
    args = ["clip-rate", str(tmp_path / "m.safetensors"), "-c", "nvfp4", "-c", "mxfp8_e4m3",
            "--out", str(out), "-q"]
    with monkeypatch.context() as patch:  # the run's units are kept as an interrupted run's
        patch.setattr(engines, "clear_units", lambda folder: None)
        honest = CliRunner().invoke(app, args)
    assert honest.exit_code == 0, honest.output
    expected, _ = read_table(out / "clip-rate.parquet")
    assert expected.clipped.max() > 0  # the forgery changes a real count
    assert _forge(out / ".clip-rate.parquet.units", FORGERIES[forgery]) == 2
    resumed = CliRunner().invoke(app, [*args, "--resume", "--overwrite"])
    # before the fix: clip_rate 1.95 written, a crash, or a count past the tensor
    assert resumed.exit_code == 0, (resumed.exception, resumed.output)
    line = one_line(resumed.stderr)
    assert line.startswith("warning: kept unit ") and "run again" in line, line
    got, prov = read_table(out / "clip-rate.parquet")
    assert prov["resumed_units"] == 0
    assert got.drop(columns="error").equals(expected.drop(columns="error"))


def test_a_kept_unit_of_the_right_counts_is_taken(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The check refuses forgeries, not honest units: a resumed run takes them all."""
    import driftcli.engines as engines

    save_file({"w": torch.linspace(-9, 9, 512).reshape(8, 64)}, str(tmp_path / "m.safetensors"))
    args = ["clip-rate", str(tmp_path / "m.safetensors"), "-c", "nvfp4", "-c", "fp8_e4m3",
            "--out", str(tmp_path / "out"), "-q"]
    with monkeypatch.context() as patch:
        patch.setattr(engines, "clear_units", lambda folder: None)
        assert CliRunner().invoke(app, args).exit_code == 0
    resumed = CliRunner().invoke(app, [*args, "--resume", "--overwrite"])
    assert resumed.exit_code == 0 and resumed.stderr == "", resumed.output
    assert read_table(tmp_path / "out" / "clip-rate.parquet")[1]["resumed_units"] == 1


def test_a_forged_health_unit_is_recomputed_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import driftcli.engines as engines

    run = _run(tmp_path / "run", SMALL, steps=(0, 1, 2))
    args = ["health", str(run), "--out", str(tmp_path / "o"), "-q"]
    with monkeypatch.context() as patch:
        patch.setattr(engines, "clear_units", lambda folder: None)
        assert CliRunner().invoke(app, args).exit_code == 0
        honest = CliRunner().invoke(app, [*args, "--resume", "--overwrite"])
        assert honest.exit_code == 0 and honest.stderr == "", honest.output  # taken
    expected, prov = read_table(tmp_path / "o" / "health.parquet")
    assert prov["resumed_units"] == 1
    assert _forge(tmp_path / "o" / ".health.parquet.units",
                  lambda f: f.update(frozen=f["numel"] + 5), ":_Counts") == 1
    resumed = CliRunner().invoke(app, [*args, "--resume", "--overwrite"])
    # before the fix: a frozen_share above 1 written
    assert resumed.exit_code == 0, (resumed.exception, resumed.output)
    assert "frozen" in one_line(resumed.stderr) and "outside 0.." in resumed.stderr
    got, prov = read_table(tmp_path / "o" / "health.parquet")
    assert prov["resumed_units"] == 0 and got.frozen_share.max() <= 1
    assert got.equals(expected)


@pytest.mark.parametrize("forgery", ["share_above_1", "another_checkpoint", "cosine_above_1"])
def test_a_forged_probe_unit_is_recomputed_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forgery: str) -> None:
    import driftcli.engines as engines

    run = _run(tmp_path / "run", SMALL, steps=(0, 1))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    args = ["probe", str(run), "-p", "exact", "--text", str(text), "--out", str(tmp_path / "o"),
            "-q"]
    with monkeypatch.context() as patch:
        patch.setattr(engines, "clear_units", lambda folder: None)
        assert CliRunner().invoke(app, args).exit_code == 0
    expected, _ = read_table(tmp_path / "o" / "probe.parquet")
    change = {"share_above_1": lambda f: f.update(freeze_share=1.5),
              "another_checkpoint": lambda f: f.update(checkpoint="step-000009.safetensors"),
              "cosine_above_1": lambda f: f.update(cosine=1.25)}[forgery]
    assert _forge(tmp_path / "o" / ".probe.parquet.units", change, ":ProbeRow") == 2
    resumed = CliRunner().invoke(app, [*args, "--resume", "--overwrite"])
    # before the fix: the forged rows written as measured
    assert resumed.exit_code == 0, (resumed.exception, resumed.output)
    assert one_line(resumed.stderr).startswith("warning: kept unit ")
    got, prov = read_table(tmp_path / "o" / "probe.parquet")
    assert prov["resumed_units"] == 0
    assert got.equals(expected)


# --- 22: an unexpected failure is exit 3 and one line ------------------------------------------

PLANTED = """if True:
    import sys
    import driftcli.records.formats as formats
    def planted(*args, **kwargs):
        raise ZeroDivisionError("planted\\nsecond line")
    formats.describe = planted
    from driftcli.cli import main
    sys.argv = ["drift", "formats"]
    main()
"""


def test_an_unexpected_exception_is_exit_3_and_one_line(tmp_path: Path) -> None:
    env = {**ENV, "TMPDIR": str(tmp_path)}
    env.pop("DRIFT_DEBUG", None)
    done = subprocess.run([sys.executable, "-c", PLANTED], env=env, capture_output=True,
                          text=True, timeout=60, check=False, preexec_fn=capped)
    # before the fix: a traceback and exit 1, drift's code for "a rule broke"
    assert done.returncode == 3, done.stderr
    line = one_line(done.stderr)
    assert line.startswith("error: unexpected failure in drift formats: ZeroDivisionError: "
                           "planted\\x0asecond line; this is a drift bug"), line
    saved = Path(line.split("traceback in ")[1].split(";")[0])
    assert saved.parent == tmp_path and "ZeroDivisionError" in saved.read_text()
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_drift_debug_shows_an_unexpected_exceptions_traceback() -> None:
    done = subprocess.run([sys.executable, "-c", PLANTED], env={**ENV, "DRIFT_DEBUG": "1"},
                          capture_output=True, text=True, timeout=60, check=False,
                          preexec_fn=capped)
    assert done.returncode == 1 and "Traceback" in done.stderr
    assert done.stderr.rstrip().endswith("ZeroDivisionError: planted\nsecond line")


def test_an_unexpected_exception_under_the_test_runner_is_exit_3(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import driftcli.records.formats as formats

    def planted(*args: Any, **kwargs: Any) -> None:
        raise KeyError("planted")

    monkeypatch.setattr(formats, "describe", planted)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("DRIFT_DEBUG", raising=False)
    result = CliRunner().invoke(app, ["formats"])
    assert result.exit_code == 3, result.exception
    assert one_line(result.stderr).startswith(
        "error: unexpected failure in drift formats: KeyError: 'planted'")
