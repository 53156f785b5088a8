"""The scan's read ahead (:class:`driftcli.io.readahead.ReadAhead`): a reader thread reads the
next slice while the pass counts the current one, and the rows are those of reading in series,
every column and sum the same bits, a tensor that fails part way included."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from driftcli.io.readahead import Job, PlanMismatch, Read, ReadAhead, Staging
from driftcli.io.readers import ReadError, open_inputs
from driftcli.io.readers.core import ByteRange, TensorRef
from driftcli.measures import MEASURES
from driftcli.measures import scan as scan_module
from driftcli.measures.scan import ScanOptions, scan
from driftcli.measures.stats import finite_amax

CASTS = ["fp8_e4m3", "mxfp8_e4m3", "nvfp4", "float8_e4m3fn:channel", "mxfp4_e2m1:sr"]
"""A tensor scale and a two-level one (each needs the tensor's amax: a first pass over the
slices), blocks, a cast the fused pass does not take (channels) and a stochastic one."""


def _heavy(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    return x * torch.exp(2 * torch.randn(rows, cols, generator=gen))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three files; the middle one holds ``bad``, whose rows from 32 on cannot be read."""
    folder = tmp_path_factory.mktemp("ahead")
    paths = [folder / f"{n}.safetensors" for n in ("first", "middle", "last")]
    save_file({"a": _heavy(48, 64, 1), "h": _heavy(32, 64, 2).to(torch.bfloat16),
               "s": torch.tensor(3.5)}, str(paths[0]))
    save_file({"bad": _heavy(64, 64, 3), "b": _heavy(16, 64, 4)}, str(paths[1]))
    save_file({"z": _heavy(40, 64, 5), "ids": torch.arange(10)}, str(paths[2]))
    return paths


@pytest.fixture()
def planted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, str]]:
    """Every read of a file, as (tensor, start, stop, thread); ``bad``'s rows from 32 on
    fail, as a file damaged after its listing does."""
    made: list[tuple[str, int, int, str]] = []
    real = ByteRange.read

    def read(self: ByteRange, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        made.append((ref.name, start, stop, threading.current_thread().name))
        if ref.name == "bad" and stop > 32:
            raise ReadError(f"{ref.source}: tensor bad: planted damage past row 32")
        return real(self, ref, start, stop, into)

    monkeypatch.setattr(ByteRange, "read", read)
    return made


def _rows(files: list[Path], measure: str, opts: ScanOptions, ahead: bool,
          monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[Any]]:
    """The rows, and their repr: every column, floats to their last bit (NaN equal to NaN)."""
    monkeypatch.setattr(scan_module, "READ_AHEAD_BYTES", 0 if ahead else None)
    got = MEASURES[measure].run(files, CASTS, options=opts)
    return repr(got), got


@pytest.mark.parametrize("measure", ["clip-rate", "error-bias"])
def test_reading_ahead_gives_the_rows_of_reading_in_series(
        files: list[Path], planted: list[tuple[str, int, int, str]], measure: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of 4 and 16 rows read from the file (a first pass for the amax), the tensors
    read whole and cut in memory, one slice a tensor; one and two threads: the same rows,
    ``bad``'s error row among them and the tensors after it measured; the reads made the same,
    on the reader thread."""
    was = torch.get_num_threads()
    slicings = [ScanOptions(chunk_elements=256, whole_bytes=0, draws=2),
                ScanOptions(chunk_elements=1024, whole_bytes=0, draws=2),
                ScanOptions(chunk_elements=256, draws=2), ScanOptions(draws=2)]
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for opts in slicings:
                planted.clear()
                series, _ = _rows(files, measure, opts, False, monkeypatch)
                in_series = list(planted)
                planted.clear()
                ahead, rows = _rows(files, measure, opts, True, monkeypatch)
                assert ahead == series, (threads, opts)
                assert [r[:3] for r in planted] == [r[:3] for r in in_series], (threads, opts)
                assert {r[3] for r in planted} == {"drift-read"}
                assert {r[3] for r in in_series} == {"MainThread"}
    finally:
        torch.set_num_threads(was)
    failed = [r for r in rows if r.error and r.tensor != "*"]  # (not the totals' rows)
    assert {r.tensor for r in failed} == {"bad"} and len(failed) == len(CASTS)
    assert all("planted damage past row 32" in r.error for r in failed)
    measured = {r.tensor for r in rows if not r.error}
    assert {"a", "h", "s", "b", "z"} <= measured


def test_a_failed_tensors_later_reads_are_not_made(
        files: list[Path], planted: list[tuple[str, int, int, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``bad`` read in slices of 4 rows fails at rows 32..36: the reader makes none of its
    reads after that one, and goes on with the next tensor."""
    monkeypatch.setattr(scan_module, "READ_AHEAD_BYTES", 0)
    found = scan(files, ["mxfp8_e4m3"], options=ScanOptions(chunk_elements=256, whole_bytes=0))
    bad = [r for r in planted if r[0] == "bad"]
    assert [r[1:3] for r in bad] == [(a, a + 4) for a in range(0, 36, 4)]
    assert [r.ref.name for r in found.results if r.ref and r.error] == ["bad"]
    assert "planted damage" in (found.errors[0].error or "")
    assert [r.ref.name for r in found.results if r.ref and not r.error] == \
        ["a", "s", "h", "b", "z"]


def test_a_read_out_of_plan_is_refused(files: list[Path]) -> None:
    """The planted fault: the scan takes another read than the next it planned (the plan and
    the reads disagree); the read ahead says so rather than hand back the wrong rows."""
    ref = next(r for r in open_inputs([files[0]]).tensors if r.name == "a")
    jobs = [Job(0, ref, Read(0, 8, 8 * 64 * 4)), Job(0, ref, Read(8, 16, 8 * 64 * 4))]
    with ReadAhead(jobs) as reads:
        rows, amax = reads.take(ref, jobs[0].read)
        assert torch.equal(rows, _heavy(48, 64, 1)[:8]) and amax is None
        with pytest.raises(PlanMismatch):
            reads.take(ref, Read(16, 24, 8 * 64 * 4))


def test_a_scan_of_few_bytes_reads_in_series(
        files: list[Path], planted: list[tuple[str, int, int, str]]) -> None:
    """Below :data:`~driftcli.measures.scan.READ_AHEAD_BYTES` (these files hold a few KB)
    there is no read to hide: every read is made on the scan's own thread."""
    scan(files, ["mxfp8_e4m3"], options=ScanOptions(chunk_elements=256, whole_bytes=0))
    assert planted and {r[3] for r in planted} == {"MainThread"}


@pytest.mark.parametrize("measure", ["clip-rate", "underflow-rate"])
def test_the_amax_taken_as_the_rows_land_is_the_scans_own(
        files: list[Path], measure: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A held float32 tensor's amax, a sliced one's slices' in the first pass, and a one-slice
    tensor's for its fused pass, taken by the reader thread as the rows land: the rows of the
    scan that reads its own amax after the read (its reads given no function for it), and
    taken on the reader thread. (A held half-width tensor's amax is read slice by slice on the
    scan's thread: the files here have none.)"""
    where: list[str] = []

    def amax_of(x: torch.Tensor) -> float:
        where.append(threading.current_thread().name)
        return finite_amax(x)

    casts = ["fp8_e4m3", "mxfp8_e4m3", "nvfp4"]
    for opts in (ScanOptions(chunk_elements=1024), ScanOptions(chunk_elements=1024, whole_bytes=0),
                 ScanOptions()):
        monkeypatch.setattr(scan_module, "READ_AHEAD_BYTES", 0)
        monkeypatch.setattr(scan_module, "finite_amax", amax_of)
        ahead = repr(MEASURES[measure].run(files[1:], casts, options=opts))
        assert where and set(where) == {"drift-read"}
        monkeypatch.setattr(scan_module, "finite_amax", finite_amax)
        monkeypatch.setattr(scan_module, "READ_AHEAD_BYTES", None)
        monkeypatch.setattr(scan_module, "Staging", lambda amax_of=None: Staging(None))
        assert repr(MEASURES[measure].run(files[1:], casts, options=opts)) == ahead
        monkeypatch.undo()
        where.clear()
