"""docs/findings.md and the script that makes its numbers, examples/findings.sh (no training)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "findings.md"
SCRIPT = ROOT / "examples" / "findings.sh"


def _normalize(text: str) -> str:
    """Join backslash-continued lines and collapse runs of whitespace."""
    return re.sub(r"\s+", " ", text.replace("\\\n", " ")).strip()


def _quoted_commands(doc: str) -> list[str]:
    """Every `drift ...` command line the doc quotes: in fenced blocks and in inline code."""
    commands = []
    in_block = False
    block_lines: list[str] = []
    for line in doc.splitlines():
        if line.lstrip().startswith("```"):
            if in_block:
                joined = "\n".join(block_lines).replace("\\\n", " ")
                for cmd in joined.splitlines():
                    cmd = cmd.strip()
                    if cmd.startswith("$ "):
                        cmd = cmd[2:].lstrip()
                    if cmd.startswith("drift "):
                        commands.append(cmd)
                block_lines = []
            in_block = not in_block
            continue
        if in_block:
            block_lines.append(line)
        else:
            commands += [c for c in re.findall(r"`([^`\n]+)`", line) if c.startswith("drift ")]
    return [_normalize(c) for c in commands]


def test_findings_doc_exists_with_numbers():
    assert DOC.is_file(), "docs/findings.md is missing"
    text = DOC.read_text(encoding="utf-8")
    assert "examples/findings.sh" in text
    assert re.search(r"\d\.\d{3}", text), "the findings quote no measured numbers"
    for part in ("(a)", "(b)", "(c)", "(d)"):
        assert part in text, f"no section {part}"
    # claims 1-7: a section each, the study's words beside drift's numbers, and a verdict
    sections = re.split(r"\n## ", text)
    for n in range(1, 8):
        found = [s for s in sections if s.startswith(f"Claim {n}:")]
        assert len(found) == 1, f"no section for claim {n}"
        assert "**Verdict" in found[0] and re.search(r"\d\.\d{2}", found[0]), n
    assert re.search(r"\*\*Wall time: \d+ min \d+ s\*\*", text), "the script's wall time"
    figures = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert len(figures) >= 9 and all((DOC.parent / f).is_file() for f in figures), figures


def test_every_quoted_drift_command_is_in_the_script():
    commands = _quoted_commands(DOC.read_text(encoding="utf-8"))
    assert commands, "the doc quotes no drift command"
    script = _normalize(SCRIPT.read_text(encoding="utf-8"))
    missing = [c for c in commands if c not in script]
    assert not missing, (
        f"commands quoted in docs/findings.md but not run by examples/findings.sh: {missing}")


@pytest.mark.skipif(shutil.which("bash") is None, reason="the script is bash; no bash here")
def test_script_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    head = SCRIPT.read_text(encoding="utf-8").splitlines()[:12]
    assert any(line.strip() == "set -euo pipefail" for line in head)
