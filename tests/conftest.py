"""Fixtures shared by test files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The width drift draws tables at comes from $COLUMNS (docs/report.md); pytest-xdist's workers
# set it to the controller's terminal width, which made the printed summaries differ between a
# serial and a parallel run. A test that needs a width sets it.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# Without a terminal (as under CliRunner and in CI) drift prints progress as plain lines every
# 10 s, and a notice when its kernels compile for long (docs/cli.md): lines that depend on the
# machine's speed and its numba cache, which tests comparing a command's output must not see. A
# test of those lines sets the variable itself.
os.environ.setdefault("DRIFT_PROGRESS_EVERY", "0")

# Two xdist workers on two cores (make test): each worker's torch, and drift's jit pool that
# torch's thread count sizes, would start a thread per core and wait on the core the other
# worker holds. One thread a worker, before any test imports torch (measured back to back on
# the quiet 2-core CI machine: test_jit, test_kernels, test_fastcast and test_grad_cosine in
# 61 s with the default threads, 33 s with one). A test that needs more threads sets them itself
# (test_jit.py::test_threads_split_the_work_without_changing_it); a serial run keeps the default.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

ISA_INDEPENDENT = {
    # exact arithmetic only: Python's integers and fractions, numba code compiled for this CPU
    # whatever torch's capability, or both (the oracle; verify-formats' full plan; the
    # calibration searches)
    "test_oracle.py", "test_verify_full.py", "test_calibrate.py",
    # files, tables and their orchestration: readers, writers, engines that must give the serial
    # table (both sides computed in the same process), the command line's errors and docs
    "test_readers.py", "test_reader_fuzz.py", "test_tables.py", "test_engines.py",
    "test_cli.py", "test_cli_outputs.py", "test_architecture.py", "test_findings_doc.py",
    # drift report: pandas and matplotlib over tables the tests write (numpy chooses its own
    # SIMD code; ATEN_CPU_CAPABILITY does not reach it)
    "test_report.py", "test_report_html.py", "test_report_runs.py", "test_report_attention.py",
    "test_trust_report.py",
    # what drift does with hostile folders, outputs and sizes: files, locks, limits, messages
    "test_outputs_safety.py", "test_hostile_inputs.py", "test_hostile_bounds.py",
    "test_hostile_runs.py", "test_hostile_report.py", "test_report_concern.py",
    "test_report_cast_name.py", "test_hostile_io.py",
    # whether a second process finds numba's kernels in the disk cache (files, not values)
    "test_kernel_cache.py",
}
"""Test files whose outcomes no choice of torch's CPU kernels can change. `.ci/run` runs the
suite a second time under another instruction set and one thread (docs/contributing.md) and
leaves these out of that pass (``-m "not isa_independent"``), so it spends its time where a
kernel choice can matter. A file not listed runs in both passes."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).name in ISA_INDEPENDENT:
            item.add_marker(pytest.mark.isa_independent)
    # the tests marked slow first (each a minute or more: the full verify plan, one format per
    # test), so that they start early; `make test` runs xdist's worksteal mode, in which a
    # worker that runs out takes half of the other's queue (xdist's default, load, hands out
    # the first chunk whole: both workers' shares of the slow tests would go to one worker)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """One local Ray cluster of two CPUs for the whole test run (started once: about two
    seconds), shut down at the end; drift's Ray engine finds it running and uses it."""
    ray = pytest.importorskip("ray", reason="the Ray engine's tests need driftcli[ray]")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray
    if started:
        ray.shutdown()
