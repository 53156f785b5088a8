"""Where the peer conformance vectors live: read in place, never copied into the repository.

The vectors are fetched-origin data kept in the workspace's ``shared/`` folder, the
repository's sibling. A fresh clone elsewhere has no such folder, and the peer tests skip.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "peer"

requires_peer_data = pytest.mark.skipif(
    not DATA.exists(), reason="../shared/data/peer not present (fresh clone outside the workspace)")


def mismatches(bad: torch.Tensor, describe: Callable[[int], str], *, limit: int = 8) -> str:
    """The failing elements of a flat mask, the first ``limit`` spelled out by ``describe``."""
    where = bad.flatten().nonzero().flatten().tolist()
    more = f"\n  ... and {len(where) - limit} more" if len(where) > limit else ""
    return (f"{len(where)} of {bad.numel()} mismatch:\n  "
            + "\n  ".join(describe(i) for i in where[:limit]) + more)
