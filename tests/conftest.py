"""Fixtures shared by test files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
