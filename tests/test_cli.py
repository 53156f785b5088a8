"""The drift command line: formats, errors, exit codes, docs for every command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from driftcli import FORMATS
from driftcli.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def test_formats_table_lists_every_format() -> None:
    result = runner.invoke(app, ["formats"])
    assert result.exit_code == 0
    for name in FORMATS:
        assert name in result.output
    row = next(line for line in result.output.splitlines() if "float8_e4m3fn " in line)
    assert re.search(r"\b448\b", row) and "2^-9" in row and "2^-6" in row


def test_formats_json_is_exact() -> None:
    result = runner.invoke(app, ["formats", "--json"])
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["float6_e2m3fn"]["max"] == "15/2"
    assert rows["float8_e4m3fnuz"]["has_neg_zero"] is False
    assert rows["int8"]["min"] == "-128"
    assert rows["float8_e8m0fnu"]["smallest_subnormal"] is None


def test_errors_are_one_line_exit_2_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "driftcli", "verify-formats", "-f", "fp8"],
                          capture_output=True, text=True, check=False, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown format 'fp8'")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_debug_shows_the_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "driftcli", "verify-formats", "-f", "e1m1"],
                          capture_output=True, text=True, check=False, cwd=ROOT,
                          env={"DRIFT_DEBUG": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_every_command_is_documented() -> None:
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert names
    for name in names:
        assert f"drift {name}" in docs, f"docs/ never shows 'drift {name}'"


def test_the_demo_script_runs_registered_commands_with_options_they_accept(
        tmp_path: Path) -> None:
    from driftcli.cli.demo_cmd import CASTS, script

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    lines = script(tmp_path, None)
    assert [argv[0] for argv in lines] == ["train", "dump", "clip-rate", "underflow-rate",
                                           "error-bias", "grad-cosine", "verify-formats",
                                           "report"]
    assert {argv[0] for argv in lines} <= names
    assert "mxfp8_e4m3_floor+1" in CASTS and lines[2].count("-c") == len(CASTS)
    for argv in lines:  # every option is one the command knows: --help of each lists it
        help_text = runner.invoke(app, [argv[0], "--help"], terminal_width=200).output
        for opt in (a for a in argv[1:] if a.startswith("-")):
            assert opt in help_text, f"drift {argv[0]} has no option {opt}"
