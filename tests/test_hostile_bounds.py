"""Hostile inputs outside the readers (issue 31): names that are markup or terminal sequences,
recorded inputs that are not regular files, and small files that claim huge work (a Parquet
table of 50 M rows, a checkpoint claiming a huge model, a gzip of recordings, a huge
``accum-error`` shape). Each case runs ``drift`` in a fresh process under an address-space
limit and a timeout, so a bomb fails the test instead of the machine."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import driftcli

LIMIT = 3 << 30
"""Address space a drift command gets here: a clip-rate run of a small file needs under
1.5 GiB; every bomb below asks for more than 4 GiB."""
TIMEOUT = 60
"""Seconds a case may take on a loaded 2-core machine (each takes a few)."""
RAW = (b"\x1b", b"\x07", b"\r", b"\x9b")
"""Bytes that must never reach the terminal from a name."""


def drift(*argv: str, cwd: Path, limit: int = LIMIT,
          timeout: float = TIMEOUT) -> subprocess.CompletedProcess[bytes]:
    """``drift ARGV`` in ``cwd``, in a fresh interpreter held to ``limit`` bytes of address
    space and ``timeout`` seconds; its output as bytes (to see raw control bytes)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(Path(driftcli.__file__).parents[1]),
           "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "driftcli", *argv], cwd=cwd, env=env,
                          capture_output=True, timeout=timeout, preexec_fn=cap, check=False)


def no_raw(proc: subprocess.CompletedProcess[bytes]) -> None:
    for stream in (proc.stdout, proc.stderr):
        for byte in RAW:
            assert byte not in stream, (byte, stream[-2000:])


# --- names are data ---------------------------------------------------------------------------

NAMES = ("[/]", "[bold red]x[/]", "osc\x1b]52;c;aGk=\x07", "cr\rfake\x1b[2K")
BAD_FILE = "bad[red]\x1b]52;c;aGk=\x07.safetensors"
"""A file name with markup and an OSC 52 clipboard write (a name cannot hold ``/``)."""


def _hostile_names(tmp_path: Path) -> None:
    save_file({n: torch.linspace(-1000, 1000, 128).reshape(8, 16) for n in (*NAMES, "plain")},
              tmp_path / "m.safetensors")
    (tmp_path / BAD_FILE).write_bytes(b"garbage!")


def test_markup_and_escapes_in_names_are_printed_as_text(tmp_path: Path) -> None:
    _hostile_names(tmp_path)
    run = drift("clip-rate", ".", "-c", "fp8_e4m3", "--out", "out", cwd=tmp_path)
    no_raw(run)
    out, err = run.stdout.decode(), run.stderr.decode()
    # the summary, the error lines and the exit code all survive the names
    assert run.returncode == 2, err
    assert "[/] 0" in out and "[bold red]x[/] 0" in out and "cr\\x0dfake\\x1b[2K 0" in out
    assert "wrote out/clip-rate.parquet" in out
    assert "not measured bad[red]\\x1b]52;c;aGk=\\x07.safetensors (unreadable file)" in out
    assert err.startswith("error: 1 tensor(s) or file(s) could not be read, first "
                          "bad[red]\\x1b]52;c;aGk=\\x07.safetensors (unreadable file)")

    report = drift("report", "out", cwd=tmp_path)
    no_raw(report)
    text = report.stdout.decode()
    assert report.returncode == 0, report.stderr.decode()
    assert "inputs: bad[red]\\x1b]52;c;aGk=\\x07.safetensors, m.safetensors" in text
    assert text.rstrip().endswith("1 table(s) summarized")


def test_the_escaping_function() -> None:
    from driftcli.escaping import for_terminal

    assert for_terminal("[/]") == "\\[/]"
    assert for_terminal("a\x1b[2Kb\rc\x9b\u202ed", markup=False) == "a\\x1b[2Kb\\x0dc\\x9b\\u202ed"
    # a non-UTF-8 byte of a file name (surrogateescape) is shown as the byte
    assert for_terminal(b"n\xff".decode("utf-8", "surrogateescape"), markup=False) == "n\\xff"
    assert for_terminal("plain name.safetensors") == "plain name.safetensors"
