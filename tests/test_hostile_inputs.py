"""Hostile inputs (issue 31): files that are not regular files, small files that would buy hours
of work, names that are not text, and one bad file among good ones. Each is refused with one
line, or bounded, and the rest of the run goes on. Cases that could hang or explode run in a
subprocess under a memory limit and a timeout, so a regression fails instead of stalling CI."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.cli import app

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
