"""docs/monitor.md's examples, run as they are: every printed line as the page shows it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "monitor.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```\n+```text\n(.*?)```", PAGE, re.S)
HF = [b for b in BLOCKS if "transformers" in b[0]]
PLAIN = [b for b in BLOCKS if b not in HF]


def _run(blocks: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    scope: dict[str, object] = {}
    for code, shown in blocks:
        exec(compile(code, "docs/monitor.md", "exec"), scope)
        assert capsys.readouterr().out.rstrip() == shown.rstrip()


@pytest.mark.slow
def test_the_plain_loop_example_prints_what_the_page_shows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the example writes its tables to ./monitor-run
    assert len(PLAIN) == 3
    _run(PLAIN, capsys)
    assert (tmp_path / "monitor-run" / "monitor-clip-rate").is_dir()


@pytest.mark.slow
def test_the_hf_callback_example_prints_what_the_page_shows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers", reason="the HF example needs driftcli[hf]")
    monkeypatch.chdir(tmp_path)
    assert len(HF) == 1
    _run(HF, capsys)
    assert (tmp_path / "hf-monitor" / "monitor-stats").is_dir()
