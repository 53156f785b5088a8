"""Every script in examples/ runs and prints what its comments promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(name: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True,
                          check=True, timeout=120)
    return proc.stdout


def test_rounding_modes_example() -> None:
    lines = _run("rounding_modes.py").splitlines()
    table = {tuple(line.split()[:2]): line for line in lines[1:11]}
    assert "[16.0, 448.0, 448.0, -0.0, 448.0]" in table[("rne", "saturate")]
    assert "[18.0, nan, nan, -0.0, nan]" in table[("rna", "ieee")]
    assert "[16.0, 448.0, 448.0, -0.001953125, nan]" in table[("rdown", "ieee")]
    share = float(lines[-1].split("share rounded up ")[1].split()[0])
    assert abs(share - 0.25) < 0.01
