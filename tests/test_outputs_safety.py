"""Output folders a user can trust (issues 26 and 31): kept units that cannot run code and are
checked before they are taken, no table overwritten silently, one writer per table, nothing
outside ``--out`` touched through a symlink, nothing lost to a full disk."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import test_train
import torch
from safetensors.torch import save_file
from test_train import trained
from typer.testing import CliRunner

import driftcli
from driftcli import engines
from driftcli.cli import app
from driftcli.engines import Execution, Manifest, UnitNotice, UnitsError
from driftcli.io.tables import WriteError, atomic_write, read_table, table_lock, write_text
from driftcli.measures.scan import scan

runner = CliRunner()
CASTS = ["mxfp8_e4m3", "nvfp4"]
TENSORS = 4


def drift(*args: str | Path) -> tuple[int, str, str]:
    """Run a drift command in this process; (exit code, stdout, stderr)."""
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def drift_process(*args: str | Path, cwd: Path, fsize: int | None = None,
                  timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``drift ARGS`` in a fresh interpreter; with ``fsize``, no file it writes may grow past
    that many bytes (a full disk at that size: a write past it fails with EFBIG)."""

    def cap() -> None:
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death by signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = {**os.environ, "PYTHONPATH": str(Path(driftcli.__file__).parents[1]),
           "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "driftcli", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=cap, check=False)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(3)
    path = tmp_path / "a.safetensors"
    save_file({f"w{i}": torch.randn(48, 64, generator=gen) * 10 for i in range(TENSORS)}, path)
    return path


def units_of(out: Path, table: str = "clip-rate") -> Path:
    return out / f".{table}.parquet.units"


def kept_run(ckpt: Path, out: Path) -> Path:
    """The units an interrupted ``clip-rate`` run into ``out`` left: every tensor finished,
    the table not yet written."""
    units = units_of(out)
    scan([ckpt], CASTS, rounded=False, execution=Execution(resume=units))
    assert len(list(units.iterdir())) == TENSORS
    return units


def clip(ckpt: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    return drift("clip-rate", ckpt, *(a for c in CASTS for a in ("-c", c)), "--out", out,
                 "-q", *extra)


def table_rows(path: Path) -> list[tuple]:
    df, _ = read_table(path)
    return [tuple(r) for r in df.astype(str).itertuples(index=False)]


# --- kept units: no code, checked --------------------------------------------------------------

class Payload:
    """What a tampered output folder would hold: unpickling it runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_nothing_in_drift_unpickles_a_file() -> None:
    root = Path(driftcli.__file__).parent
    found = [f"{p.relative_to(root)}:{n}" for p in root.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if "pickle.load" in line]
    assert found == []  # (the .pt reader refuses pickles through torch's weights_only load)


def test_a_kept_unit_is_json_with_its_checksum_and_input_sha256(ckpt: Path,
                                                                tmp_path: Path) -> None:
    unit = next(kept_run(ckpt, tmp_path / "out").iterdir())
    head, body = unit.read_bytes().split(b"\n", 1)
    header = json.loads(head)
    assert header == {"format": engines.UNIT_FORMAT,
                      "sha256": hashlib.sha256(body).hexdigest()}
    record = json.loads(body)
    assert record["inputs"] == [[str(ckpt.resolve()),
                                 hashlib.sha256(ckpt.read_bytes()).hexdigest()]]
    assert unit.name == hashlib.sha256(record["key"].encode()).hexdigest()


def test_a_planted_pickle_payload_is_not_run_and_the_unit_is_recomputed(
        ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    units = kept_run(ckpt, out)
    marker = tmp_path / "pwned"
    for unit in units.iterdir():
        unit.write_bytes(pickle.dumps(Payload(marker)))
    code, _, err = clip(ckpt, out, "--resume")
    assert code == 0, err
    assert not marker.exists()
    assert re.search(r"^warning: kept unit \S+ is not taken \(not a drift-unit/1 file\)", err,
                     re.M), err
    assert err.count("warning:") == 1  # one line for the run, not one per unit
    code, _, err = clip(ckpt, tmp_path / "fresh")
    assert table_rows(out / "clip-rate.parquet") == table_rows(
        tmp_path / "fresh" / "clip-rate.parquet")
    assert not units.exists()  # cleared once the table holds them


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-40])


def _zero_counts(p: Path) -> None:
    """Edit the clip counts to 0, keeping the file well formed (but its checksum stale)."""
    p.write_bytes(re.sub(rb'"clipped":\d+', b'"clipped":0', p.read_bytes()))


DAMAGE = {
    "empty": lambda p: p.write_bytes(b""),
    "truncated": _truncate,
    "garbage": lambda p: p.write_bytes(os.urandom(300)),
    "edited counts": _zero_counts,
    "a folder": lambda p: (p.unlink(), p.mkdir(), (p / "x").write_text("x")),
    "a symlink": lambda p: (p.unlink(), p.symlink_to("/etc/hostname")),
    "a fifo": lambda p: (p.unlink(), os.mkfifo(p)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_unit_is_recomputed_with_a_notice(damage: str, ckpt: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    units = kept_run(ckpt, out)
    fresh = scan([ckpt], CASTS, rounded=False)
    first = sorted(units.iterdir())[0]
    if damage == "edited counts":
        assert re.search(rb'"clipped":[1-9]', first.read_bytes())  # the edit changes counts
    DAMAGE[damage](first)
    with pytest.warns(UnitNotice, match=r"kept unit .* is not taken"):
        resumed = scan([ckpt], CASTS, rounded=False, execution=Execution(resume=units))
    assert resumed.results == fresh.results  # the damaged one ran again; the others taken
    assert engines.units_taken(units) >= TENSORS - 1


def test_edited_units_are_caught_by_the_gate_s_table(ckpt: Path, tmp_path: Path) -> None:
    """The issue's case: clip counts set to 0 in every kept unit used to pass a gate."""
    out = tmp_path / "out"
    for unit in kept_run(ckpt, out).iterdir():
        _zero_counts(unit)
    code, _, err = clip(ckpt, out, "--resume")
    assert code == 0 and "checksum does not match" in err, err
    df, prov = read_table(out / "clip-rate.parquet")
    assert (df["clipped"] > 0).any()
    assert prov["resumed_units"] == 0


def test_units_folder_a_file_or_holding_a_folder(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    units_of(out).write_text("not a folder")
    code, _, err = clip(ckpt, out, "--resume")
    assert code == 0, err
    assert (out / "clip-rate.parquet").is_file() and not units_of(out).exists()
    # a folder inside the units folder is left where it is, and the run completes
    units = kept_run(ckpt, tmp_path / "out2")
    (units / "stray").mkdir()
    code, _, err = clip(ckpt, tmp_path / "out2", "--resume")
    assert code == 0, err
    assert (units / "stray").is_dir() and len(list(units.iterdir())) == 1


def test_an_input_rewritten_with_the_same_size_and_mtime_is_recomputed(
        ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    kept_run(ckpt, out)
    before = ckpt.stat()
    gen = torch.Generator().manual_seed(99)  # other values, the same layout and size
    save_file({f"w{i}": torch.randn(48, 64, generator=gen) for i in range(TENSORS)}, ckpt)
    os.utime(ckpt, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert ckpt.stat().st_size == before.st_size
    code, _, err = clip(ckpt, out, "--resume")
    assert code == 0 and "changed since" in err, err
    code, _, err = clip(ckpt, tmp_path / "fresh")
    assert table_rows(out / "clip-rate.parquet") == table_rows(
        tmp_path / "fresh" / "clip-rate.parquet")
    assert read_table(out / "clip-rate.parquet")[1]["resumed_units"] == 0


def test_provenance_counts_the_units_taken_from_a_resume(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    kept_run(ckpt, out)
    code, _, err = clip(ckpt, out, "--resume")
    assert code == 0 and "warning" not in err, err
    assert read_table(out / "clip-rate.parquet")[1]["resumed_units"] == TENSORS
    code, _, err = clip(ckpt, out, "--overwrite")
    assert read_table(out / "clip-rate.parquet")[1]["resumed_units"] == 0


# --- symlinks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("resume", [False, True])
def test_a_symlinked_units_folder_is_refused_and_its_target_survives(
        resume: bool, ckpt: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (victim / ("0" * 64)).write_text("named like a unit")
    out = tmp_path / "out"
    out.mkdir()
    units_of(out).symlink_to(victim)
    code, _, err = clip(ckpt, out, *(["--resume"] if resume else []))
    assert code == 2
    assert err.strip() == (f"error: the units folder {units_of(out)} is a symlink; drift never "
                           "follows a link in an output folder (clearing it would remove "
                           "files elsewhere): remove the link")
    assert sorted(p.name for p in victim.iterdir()) == ["0" * 64, "precious.txt"]
    with pytest.raises(UnitsError):
        Manifest(units_of(out)).clear()
    assert (victim / "precious.txt").read_text() == "keep me"


def test_a_symlink_planted_at_the_table_or_its_lock_writes_nothing_through_it(
        ckpt: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".clip-rate.parquet.lock").symlink_to(victim)
    code, _, err = clip(ckpt, out)
    assert code == 2 and "lock file" in err and "symlink" in err, err
    (out / ".clip-rate.parquet.lock").unlink()
    (out / "clip-rate.parquet").symlink_to(victim)
    code, _, err = clip(ckpt, out, "--overwrite")
    assert code == 0, err
    assert victim.read_text() == "keep me"  # the link was replaced by the table, not followed
    assert not (out / "clip-rate.parquet").is_symlink()


# --- no silent overwrite, one writer -----------------------------------------------------------

def test_a_second_run_into_one_out_keeps_the_table_unless_overwrite(ckpt: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert clip(ckpt, out)[0] == 0
    table = out / "clip-rate.parquet"
    before = table.read_bytes()
    code, stdout, err = drift("clip-rate", ckpt, "-c", "fp8_e4m3", "--out", out, "-q")
    assert code == 2 and stdout == ""
    assert err.strip() == (f"error: {table} exists (an earlier run's table); give --overwrite "
                           "to replace it, --append to merge into it, or another --out")
    assert table.read_bytes() == before
    code, _, err = drift("clip-rate", ckpt, "-c", "fp8_e4m3", "--out", out, "-q", "--overwrite")
    assert code == 0, err
    assert read_table(table)[1]["casts"] == ["fp8_e4m3"]
    assert sorted(p.name for p in out.iterdir()) == ["clip-rate.parquet"]  # no lock left


def test_a_run_while_another_writes_the_table_refuses_with_one_line(ckpt: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    with table_lock(out / "clip-rate.parquet"):
        code, _, err = clip(ckpt, out)
    assert code == 2
    assert re.fullmatch(rf"error: {re.escape(str(out / 'clip-rate.parquet'))} is being written "
                        rf"by another drift run \(pid {os.getpid()}\); wait for it to finish, "
                        r"or give this run another --out\n", err), err
    assert clip(ckpt, out)[0] == 0  # released: the next run writes


def test_two_concurrent_runs_into_one_out(ckpt: Path, tmp_path: Path) -> None:
    args = ["clip-rate", ckpt, "-c", "mxfp8_e4m3", "--out", "out", "-q", "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(Path(driftcli.__file__).parents[1]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "driftcli", *map(str, args)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [(p.wait(timeout=120), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    for code, err in done:
        assert code == 0 or (code == 2 and "is being written by another drift run" in err), err
        assert "Errno" not in err and "Traceback" not in err, err
    assert any(code == 0 for code, _ in done)
    assert len(read_table(tmp_path / "out" / "clip-rate.parquet")[0]) > 0


text = test_train.text  # the made-up verse of test_train, a module fixture here too


def test_probe_writes_to_out_with_the_same_checks(text: Path, tmp_path: Path) -> None:
    run = trained(tmp_path / "run", text, "--steps", "2", "--checkpoint-every", "2")
    probe = ["probe", run, "-p", "exact", "--draws", "1", "--batch", "2", "-q"]
    assert drift(*probe)[0] == 0  # default: the run folder
    before = (run / "probe.parquet").read_bytes()
    code, _, err = drift(*probe, "--checkpoints", "step-000002*")  # a subset
    assert code == 2 and err.strip() == (
        f"error: {run / 'probe.parquet'} exists (an earlier run's table); give --overwrite to "
        "replace it, or another --out")
    assert (run / "probe.parquet").read_bytes() == before
    code, _, err = drift(*probe, "--checkpoints", "step-000002*", "--out", tmp_path / "sub")
    assert code == 0, err
    assert set(read_table(tmp_path / "sub" / "probe.parquet")[0].step) == {2}
    assert set(read_table(run / "probe.parquet")[0].step) == {0, 2}
    assert drift(*probe, "--overwrite")[0] == 0


# --- a full disk -------------------------------------------------------------------------------

def test_a_full_disk_at_the_table_write_keeps_the_units_and_the_earlier_table(
        ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert clip(ckpt, out)[0] == 0
    earlier = (out / "clip-rate.parquet").read_bytes()
    kept_run(ckpt, out)
    unit_size = max(p.stat().st_size for p in units_of(out).iterdir())
    assert unit_size < len(earlier) // 2
    proc = drift_process("clip-rate", ckpt, "-c", CASTS[0], "-c", CASTS[1], "--out", out, "-q",
                         "--overwrite", "--resume", cwd=tmp_path, fsize=len(earlier) // 2)
    assert proc.returncode == 2, proc.stderr
    table = out / "clip-rate.parquet"
    assert proc.stderr.startswith(f"error: cannot write {table}: File too large"), proc.stderr
    assert f"the finished units are kept in {units_of(out)}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert table.read_bytes() == earlier
    assert len(list(units_of(out).iterdir())) == TENSORS
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []
    code, _, err = clip(ckpt, out, "--overwrite", "--resume")  # room again: all taken
    assert code == 0 and "warning" not in err, err
    assert read_table(table)[1]["resumed_units"] == TENSORS


def test_a_full_disk_on_a_report_rewrite_keeps_the_old_report(ckpt: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert clip(ckpt, out)[0] == 0
    html = tmp_path / "r.html"
    code, _, err = drift("report", out, "--html", html)
    assert code == 0, err
    old = html.read_bytes()
    proc = drift_process("report", out, "--html", html, cwd=tmp_path, fsize=len(old) // 2)
    assert proc.returncode == 2, proc.stderr
    assert f"error: cannot write {html}: File too large" in proc.stderr, proc.stderr
    assert "the earlier file is kept as it was" in proc.stderr
    assert html.read_bytes() == old


def test_atomic_write_keeps_the_earlier_file_on_any_failure(tmp_path: Path) -> None:
    path = tmp_path / "report.md"
    write_text(path, "old report\n")

    def fails(fh: object) -> None:
        fh.write(b"half a new rep")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    with pytest.raises(WriteError, match=rf"^cannot write {re.escape(str(path))}: No space left "
                                         r"on device \(the disk or the file size limit is "
                                         r"full\); the earlier file is kept as it was$"):
        atomic_write(path, fails)
    assert path.read_text() == "old report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_units_of_a_non_utf8_file_name_are_kept_and_taken(tmp_path: Path) -> None:
    bad = Path(os.fsdecode(os.fsencode(tmp_path) + b"/bad\xff.safetensors"))
    save_file({"v": torch.linspace(-2, 2, 64).reshape(2, 32)}, bad)
    out = tmp_path / "out"
    scan([bad], CASTS, rounded=False, execution=Execution(resume=units_of(out)))
    assert len(list(units_of(out).iterdir())) == 1
    code, _, err = clip(bad, out, "--resume")
    assert code == 0 and "warning" not in err, err
    df, prov = read_table(out / "clip-rate.parquet")
    assert prov["resumed_units"] == 1
    assert set(df.source) == {f"{tmp_path}/bad\\xff.safetensors"}  # the byte, escaped


def test_append_merges_rows_by_source_tensor_and_cast(ckpt: Path, tmp_path: Path) -> None:
    other = tmp_path / "b.safetensors"
    save_file({"v": torch.linspace(-300, 300, 256).reshape(4, 64)}, other)
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    runs = [(ckpt, "mxfp8_e4m3"), (other, "mxfp8_e4m3"), (ckpt, "nvfp4"), (ckpt, "mxfp8_e4m3")]
    for i, (path, cast) in enumerate(runs):
        code, _, err = drift("clip-rate", path, "-c", cast, "--out", out, "-q",
                             *(["--append"] if i else []))
        assert code == 0, err
        code, _, err = drift("clip-rate", path, "-c", cast, "--out", fresh / str(i), "-q")
        assert code == 0, err
    want = {row for i in range(3) for row in table_rows(fresh / str(i) / "clip-rate.parquet")}
    got = table_rows(out / "clip-rate.parquet")
    assert len(got) == len(want) and set(got) == want  # the 4th run replaced the 1st's rows
    prov = read_table(out / "clip-rate.parquet")[1]
    assert {i["path"] for i in prov["inputs"]} == {str(ckpt), str(other)}
    assert prov["casts"] == ["mxfp8_e4m3", "nvfp4"]
    n0, n1, n2 = (len(table_rows(fresh / str(i) / "clip-rate.parquet")) for i in range(3))
    assert [a["rows_kept"] for a in prov["appended_to"]] == [n0, n0 + n1, n1 + n2]
    code, _, err = drift("clip-rate", ckpt, "-c", "nvfp4", "--out", out, "-q", "--append",
                         "--overwrite")
    assert code == 2 and err.strip() == ("error: give --overwrite (replace the table) or "
                                         "--append (merge into it), not both")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "clip-rate.parquet").write_bytes(
        (out / "clip-rate.parquet").read_bytes()[:100])
    code, _, err = drift("clip-rate", ckpt, "-c", "nvfp4", "--out", tmp_path / "other", "-q",
                         "--append")
    assert code == 2 and err.startswith(f"error: cannot read {tmp_path / 'other'}"), err
