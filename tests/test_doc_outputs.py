"""Every block of command output in README.md and docs/*.md that drift produces deterministically
is what the command prints today: a marker before the block names the command, the test runs
it and compares (docs/contributing.md, "Numbers in the docs").

A marker is an HTML comment on the line(s) right before the opening fence:

    <!-- setup: python examples/make_checkpoint.py drift-out/example.safetensors -->
    <!-- output -->                  the block is a transcript: `$ CMD` lines, each followed by
                                     what CMD prints
    <!-- output: drift formats -->   the block is what that command prints (no `$` line shown)
    <!-- output: python-above -->     the block is what the ```python block above it prints
    <!-- output exit=1 abridged -->  options: the commands' exit code (default 0; `exit=0,2`
                                     one per command), and `abridged` (the block's lines are
                                     lines of the output, in order; a line `...` stands for
                                     lines left out)

Commands run in a temporary folder holding a link to examples/, with $COLUMNS=160: `drift ...`
in this process through typer's CliRunner (stdout and stderr interleaved, as a terminal shows
them), anything else (`python ...`) as a subprocess. Setup steps and commands are cached by the
sequence of steps that leads to them, so a command shared by several blocks runs once.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from driftcli.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = {"docs/cli-reference.md"}
"""Pages written by a command and compared whole elsewhere (tests/test_cli.py checks the
reference against the commands' --help), so their blocks need no markers."""
WIDTH = "160"

PYTHON_ABOVE = "python-above"
"""The command of a block that shows what the nearest ```python block above it prints."""
SNIPPETS: dict[str, str] = {}
"""The code of each python-above command, by its name in the steps."""

MARKER = re.compile(r"^<!--\s*(setup|output|not-run)\b(.*?)-->\s*$")
OPTIONS = re.compile(r"^((?:\s+(?:abridged|exit=\d+(?:,\d+)*))*)\s*(?::\s*(.*?))?\s*$")

# What changes from run to run and is masked on both sides: the provenance line's version,
# commit and time.
MASKS = [
    (re.compile(r"written by drift \S+?(?: \([0-9a-f]+\))?, "
                r"\d{4}-\d\d-\d\dT[\d:.]+(?:[+-]\d\d:\d\d|Z)?"),
     "written by drift <version>, <time>"),
]


@dataclass(frozen=True)
class Block:
    """One marked block: where it is, the steps that run before it, and what it shows."""

    doc: str
    line: int
    setup: tuple[str, ...]
    commands: tuple[str, ...]
    outputs: tuple[str, ...]
    exit_codes: tuple[int, ...]
    abridged: bool

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _transcript(body: list[str]) -> tuple[list[str], list[str]]:
    """Split a block into its `$ ` commands (continued with a trailing backslash) and the
    output that follows each."""
    commands: list[str] = []
    outputs: list[list[str]] = []
    i = 0
    while i < len(body):
        line = body[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\") and i + 1 < len(body):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + body[i].strip()
            commands.append(cmd.strip())
            outputs.append([])
        elif outputs:
            outputs[-1].append(line)
        else:
            raise ValueError(f"a transcript starts with `$ COMMAND`, not {line!r}")
        i += 1
    return commands, ["\n".join(o) for o in outputs]


def parse(text: str, doc: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The marked blocks of one Markdown page, and its fenced blocks that look like drift's
    output (a `$ drift` line or a drawn table) but carry no marker: (line, first line)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    unmarked: list[tuple[int, str]] = []
    python_above = ""
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        start = i
        end = start + 1
        while end < len(lines) and not lines[end].lstrip().startswith("```"):
            end += 1
        indent = len(lines[start]) - len(lines[start].lstrip())  # a block in a list item
        body = [line[indent:] if not line[:indent].strip() else line
                for line in lines[start + 1:end]]
        if lines[start].strip() == "```python":
            python_above = "\n".join(body)
        markers = []
        j = start - 1
        while j >= 0 and MARKER.match(lines[j].strip()):
            markers.insert(0, MARKER.match(lines[j].strip()))
            j -= 1
        setup = tuple(m.group(2).lstrip(": ").strip() for m in markers if m.group(1) == "setup")
        out = [m for m in markers if m.group(1) == "output"]
        if len(out) > 1:
            raise ValueError(f"{doc}:{start + 1}: more than one output marker")
        if out:
            opts = OPTIONS.match(out[0].group(2))
            if opts is None:
                raise ValueError(f"{doc}:{start + 1}: cannot read the marker {out[0].group(0)}")
            flags = opts.group(1).split()
            codes = next((f[5:] for f in flags if f.startswith("exit=")), "0").split(",")
            if opts.group(2) == PYTHON_ABOVE:
                commands = [f"{PYTHON_ABOVE} {zlib.crc32(python_above.encode()):08x}"]
                outputs = ["\n".join(body)]
                SNIPPETS[commands[0]] = python_above
            elif opts.group(2):
                commands, outputs = [opts.group(2)], ["\n".join(body)]
            else:
                commands, outputs = _transcript(body)
            if len(codes) == 1:
                codes *= len(commands)
            if len(codes) != len(commands):
                raise ValueError(f"{doc}:{start + 1}: exit= names {len(codes)} codes for "
                                 f"{len(commands)} commands")
            blocks.append(Block(doc, start + 1, setup, tuple(commands), tuple(outputs),
                                tuple(int(c) for c in codes), "abridged" in flags))
        elif not any(m.group(1) == "not-run" for m in markers):
            first = body[0] if body else ""
            shows_output = any(line.strip() and not line.startswith(("$ ", " ")) for line in body)
            if (first.startswith("$ drift ") and shows_output) or any(
                    ch in "\n".join(body) for ch in "┏┃"):
                unmarked.append((start + 1, first))
        i = end + 1
    return blocks, unmarked


def normalize(text: str) -> list[str]:
    """The lines compared: run-to-run values masked, trailing spaces and blank lines at either
    end dropped (editors strip them; rich pads centred titles)."""
    for pattern, repl in MASKS:
        text = pattern.sub(repl, text)
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def compare(expected: str, actual: str, abridged: bool) -> str | None:
    """None when the block shows what the command printed, else the first difference."""
    want, got = normalize(expected), normalize(actual)
    if not abridged:
        if want == got:
            return None
        for n, (a, b) in enumerate(zip(want, got, strict=False)):
            if a != b:
                return f"line {n + 1}: the doc shows\n  {a}\nthe command printed\n  {b}"
        return (f"the doc shows {len(want)} lines, the command printed {len(got)}:\n"
                + "\n".join(got))
    k = 0
    for line in want:
        if line.strip() in ("...", "…"):
            continue
        while k < len(got) and " ".join(got[k].split()) != " ".join(line.split()):
            k += 1
        if k == len(got):
            return f"not in the output (in this order):\n  {line}\noutput:\n" + "\n".join(got)
        k += 1
    return None


@dataclass(frozen=True)
class Ran:
    """What one step printed, and its exit code."""

    output: str
    exit_code: int


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    before = os.getcwd()
    width = os.environ.get("COLUMNS")
    os.chdir(folder)
    os.environ["COLUMNS"] = WIDTH
    try:
        yield
    finally:
        os.chdir(before)
        if width is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = width


def run_step(command: str, folder: Path) -> Ran:
    """Run one doc command in ``folder``: drift in this process, anything else as a
    subprocess (`python` is this interpreter, and its folder, which holds `drift`, leads
    $PATH for scripts such as examples/ci/drift.sh)."""
    if command.startswith(f"{PYTHON_ABOVE} "):
        return _run_snippet(SNIPPETS[command], folder)
    argv = shlex.split(command)
    if argv[0] == "drift":
        saved = sys.argv
        sys.argv = argv  # provenance records the command line from sys.argv
        try:
            with _inside(folder):
                result = CliRunner().invoke(app, argv[1:], env={"COLUMNS": WIDTH})
        finally:
            sys.argv = saved
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return Ran(result.output, result.exit_code)
    if argv[0] == "python":
        argv[0] = sys.executable
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    proc = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": WIDTH, "PATH": path})
    return Ran(proc.stdout + proc.stderr, proc.returncode)


def _run_snippet(code: str, folder: Path) -> Ran:
    """A doc's Python example, run in this process in ``folder``: what it prints, and exit
    code 1 with the traceback where it raises."""
    out = io.StringIO()
    status = 0
    with _inside(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
        except Exception:  # whatever the example raises is what the test reports
            out.write(traceback.format_exc())
            status = 1
    return Ran(out.getvalue(), status)


class Steps:
    """Folders and outputs after each sequence of steps, each sequence run once."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.folders: dict[tuple[str, ...], Path] = {}
        self.outputs: dict[tuple[str, ...], Ran] = {}

    def after(self, steps: tuple[str, ...]) -> Path:
        """The folder after ``steps`` ran in order from an empty one (with examples/ linked)."""
        if steps in self.folders:
            return self.folders[steps]
        if steps:
            before = self.after(steps[:-1])
            folder = self.base / f"s{len(self.folders)}"
            shutil.copytree(before, folder, symlinks=True)
            self.outputs[steps] = run_step(steps[-1], folder)
        else:
            folder = self.base / "s0"
            folder.mkdir()
            (folder / "examples").symlink_to(ROOT / "examples")
        self.folders[steps] = folder
        return folder

    def output(self, steps: tuple[str, ...]) -> Ran:
        """What the last of ``steps`` printed."""
        self.after(steps)
        return self.outputs[steps]


def _blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        found, _ = parse(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
        blocks += found
    return blocks


BLOCKS = _blocks()


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Steps:
    return Steps(tmp_path_factory.mktemp("doc-outputs"))


def check(block: Block, steps: Steps) -> list[str]:
    """Every difference between ``block`` and real runs of its commands."""
    problems = []
    for k, (command, shown) in enumerate(zip(block.commands, block.outputs, strict=True)):
        sequence = block.setup + block.commands[:k + 1]
        for n in range(1, len(block.setup) + 1):
            ran = steps.output(sequence[:n])
            if ran.exit_code != 0:
                problems.append(f"`{sequence[n - 1]}` exited {ran.exit_code}:\n{ran.output}")
                return problems
        ran = steps.output(sequence)
        want = block.exit_codes[k]
        if ran.exit_code != want:
            problems.append(f"`{command}` exited {ran.exit_code}, the doc says {want}:\n"
                            f"{ran.output}")
            continue
        diff = compare(shown, ran.output, block.abridged)
        if diff is not None:
            problems.append(f"`{command}`: {diff}")
    return problems


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block_is_what_the_command_prints(block: Block, steps: Steps) -> None:
    problems = check(block, steps)
    assert not problems, f"{block.id} is stale (the run is the truth):\n" + "\n".join(problems)


def test_every_drift_transcript_in_the_docs_is_marked() -> None:
    """A new `$ drift ...` block or drawn table is run by this file or says why not
    (`<!-- not-run: REASON -->`), so no figure goes stale unseen."""
    missing = []
    for path in DOCS:
        if str(path.relative_to(ROOT)) in GENERATED:
            continue
        _, unmarked = parse(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
        missing += [f"{path.relative_to(ROOT)}:{line}: {first}" for line, first in unmarked]
    assert not missing, "blocks of drift output with no marker:\n" + "\n".join(missing)


# --- the checker itself ---------------------------------------------------------------------

PLANTED = """\
Some prose.

<!-- output -->
```
$ drift formats --cast mxfp8_e4m3 --cast nvfp4
mxfp8_e4m3 = float8_e4m3fn:block32:float8_e8m0fnu:floor:rne:saturate
nvfp4 = float4_e2m1fn:block16:float8_e4m3fn:two-level:rne:saturate
```
"""


def test_a_planted_digit_is_caught(steps: Steps) -> None:
    (good,), _ = parse(PLANTED, "planted.md")
    assert check(good, steps) == []
    (bad,), _ = parse(PLANTED.replace("block32", "block33"), "planted.md")
    problems = check(bad, steps)
    assert len(problems) == 1 and "block33" in problems[0] and "block32" in problems[0]
    # an abridged block is held to its numbers as well
    abridged = PLANTED.replace("<!-- output -->", "<!-- output abridged -->")
    left_out = abridged.replace(
        "nvfp4 = float4_e2m1fn:block16:float8_e4m3fn:two-level:rne:saturate", "...")
    (short,), _ = parse(left_out, "p.md")
    assert check(short, steps) == []
    (wrong,), _ = parse(abridged.replace("block16", "block18"), "p.md")
    assert len(check(wrong, steps)) == 1


def test_a_marker_whose_command_fails_is_caught(steps: Steps) -> None:
    text = "<!-- output: drift formats --cast float8_e4m3fn:blok32 -->\n```\nanything\n```\n"
    (block,), _ = parse(text, "planted.md")
    problems = check(block, steps)
    assert len(problems) == 1 and "exited 2, the doc says 0" in problems[0]
    failing_setup = "<!-- setup: drift clip-rate no-such-file.safetensors -c nvfp4 -->\n" + text
    (block,), _ = parse(failing_setup, "planted.md")
    problems = check(block, steps)
    assert len(problems) == 1 and "`drift clip-rate no-such-file" in problems[0]
    assert "exited 2" in problems[0]


def test_unmarked_output_is_found() -> None:
    text = "```\n$ drift formats --cast nvfp4\nnvfp4 = ...\n```\n\n<!-- not-run: GPU -->\n" \
           "```\n$ drift calibrate -b torch:cuda\n```\n"
    blocks, unmarked = parse(text, "planted.md")
    assert blocks == [] and unmarked == [(1, "$ drift formats --cast nvfp4")]


def test_provenance_time_and_commit_are_masked() -> None:
    doc = "  file x.parquet, 5 rows, written by drift 0.1.0, 2026-12-04T05:25:20+00:00"
    run = "  file x.parquet, 5 rows, written by drift 0.1.0 (2ee4ba2365), 2026-12-05T09:52:49+00:00"
    assert compare(doc, run, abridged=False) is None
    assert compare(doc.replace("5 rows", "6 rows"), run, abridged=False) is not None


# --- numbers in prose ----------------------------------------------------------------------

README_CLIP = (
    "python examples/make_checkpoint.py drift-out/example.safetensors",
    "drift clip-rate drift-out/example.safetensors -c fp8_e4m3 -c mxfp8_e4m3 -c mxfp8_e4m3_ceil "
    "-c nvfp4",
)


def test_readme_clip_rate_prose_cites_the_marked_block(steps: Steps) -> None:
    """"clips 60 % of the tanh activations", "NVFP4's 2.8 %": the README's clip-rate block."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert any(b.setup + b.commands == README_CLIP for b in BLOCKS), "the block is not marked"
    printed = steps.output(README_CLIP).output
    tanh = float(re.search(r"mxfp8_e4m3 .*? activations\.tanh ([\d.]+)", printed).group(1))
    nvfp4 = float(re.search(r"│ nvfp4 +│ +\d+ │ +([\d.]+) │", printed).group(1))
    assert f"clips {round(100 * tanh)} % of the tanh activations" in readme
    assert f"NVFP4's {100 * nvfp4:.1f} % saturate" in readme


def test_readme_tensor_core_prose_is_what_accum_error_measures(steps: Steps) -> None:
    """"loses 22 % ... keeps the loss at 6e-4": accum_rel_error of the README's command; the
    same cells of tensor-cores.md's table and prose."""
    import pandas as pd

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"\$ (drift accum-error [^\n]*?)\\\n\s*([^\n]*)\n", readme)
    assert match is not None, "the README's accum-error command"
    command = f"{match.group(1).strip()} {match.group(2).strip()} --out ae"
    ran = steps.output((command,))
    assert ran.exit_code == 0, ran.output
    table = pd.read_parquet(steps.after((command,)) / "ae" / "accum-error.parquet")
    plain, promoted = table["accum_rel_error"].tolist()
    assert f"loses {round(100 * plain)} % of a sum of 16,384 positive" in readme
    assert f"keeps the loss at {promoted:.0e}".replace("e-04", "e-4") in readme
    # tensor-cores.md's table holds the same two cells (halfnormal, K = 16,384) and prose
    page = _doc("tensor-cores.md")
    cells = {}
    for line in page.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(parts) == 7 and parts[3]:
            cells[parts[0]] = parts[3].replace("*", "").split()[0]
    assert cells["`h100_e4m3_f32` (32:13, e8m13 rtz)"] == f"{plain:.1e}"
    assert cells["the same, promoted every 128 (DeepSeek-V3)"] == f"{promoted:.1e}"
    assert f"without promotion loses {round(100 * plain)} % of a sum of 16,384" in page
    assert f"holds the loss at {promoted:.0e}".replace("e-04", "e-4") in page


EXAMPLE = "python examples/make_checkpoint.py drift-out/example.safetensors"
FOUR_CASTS = "drift-out/example.safetensors -c fp8_e4m3 -c mxfp8_e4m3 -c mxfp8_e4m3_ceil -c nvfp4"


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def _headline(printed: str, cast: str) -> float:
    """A summary's first figure (all tensors) on ``cast``'s row."""
    return float(re.search(rf"│ {re.escape(cast)} +│ +\d+ │ +([-\d.e]+) │", printed).group(1))


def _worst(printed: str, cast: str, tensor: str) -> float:
    """``tensor``'s figure among the worst tensors on ``cast``'s row."""
    row = re.search(rf"│ {re.escape(cast)} +│[^\n]*", printed).group(0)
    return float(re.search(rf"{re.escape(tensor)} ([-\d.e]+)", row).group(1))


def test_scan_pages_prose_cites_their_blocks(steps: Steps) -> None:
    """clip-rate.md's 60 % and 2.8 %, underflow-rate.md's 60 %: their marked blocks."""
    clip = steps.output((EXAMPLE, f"drift clip-rate {FOUR_CASTS}")).output
    page = _doc("clip-rate.md")
    assert f"clips {round(100 * _worst(clip, 'mxfp8_e4m3', 'activations.tanh'))} % of the " \
           "tanh activations" in page
    assert f"NVFP4 clips {100 * _headline(clip, 'nvfp4'):.1f} % of the" in page
    assert re.search(r"│ nvfp4 +│ +\d+ │ +[\d.]+ │ +0 │", clip), "nvfp4's exact_clip_rate 0"
    under = steps.output((EXAMPLE, f"drift underflow-rate {FOUR_CASTS}")).output
    flushed = _worst(under, "nvfp4", "gradients.layers.1")
    assert f"NVFP4 flushes {round(100 * flushed)} % of the small gradients" in \
           _doc("underflow-rate.md")


def test_error_bias_sr_table_is_the_marked_runs_table(steps: Steps) -> None:
    """error-bias.md's per-tensor table and its 0.0892 and −0.88: the SR block's Parquet."""
    import pandas as pd

    block = next(b for b in BLOCKS if b.doc == "docs/error-bias.md" and "--draws 16" in
                 b.commands[0])
    sequence = block.setup + block.commands
    assert steps.output(sequence).exit_code == 0
    table = pd.read_parquet(steps.after(sequence) / "sr" / "error-bias.parquet")
    page = _doc("error-bias.md").replace("−", "-")
    shown = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1] in ("rne", "sr"):
            shown[cells[0], cells[1]] = cells[2:]
    assert len(shown) == 4
    for row in table[table.tensor != "*"].itertuples():
        rounding = "sr" if ":sr:" in row.cast else "rne"
        want = [f"{row.rel_error:.4f}", f"{row.bias:.4f}", f"{row.alignment:.4f}",
                "" if rounding == "rne" else f"{row.expected_rel_error:.4f}"]
        assert shown[row.tensor, rounding] == want, (row.tensor, rounding)
        if row.tensor == "layers.0.mlp.up.weight" and rounding == "sr":
            assert f"({row.expected_rel_error:.4f} after 16 draws" in page
        if row.tensor == "activations.tanh" and rounding == "rne":
            assert f"aligned\nwith the signal ({row.alignment:.2f})" in page


def test_report_prose_cites_the_ci_example(steps: Steps) -> None:
    """report.md: "fp8_e4m3's per-tensor scale saturates 0.0014 % of the elements through its
    rounding alone" is the CI example's fp8_e4m3 clip_rate, whose exact_clip_rate is 0."""
    printed = steps.output(("bash examples/ci/drift.sh",)).output
    row = re.search(r"│ fp8_e4m3 +│ +\d+ │ +([-\d.e]+) │ +([-\d.e]+) │", printed)
    assert row is not None and float(row.group(2)) == 0
    assert f"scale saturates {100 * float(row.group(1)):.4f} % of the elements" in _doc("report.md")


def test_accum_error_cast_table_is_the_commands_table(steps: Steps) -> None:
    """accum-error.md's table of MXFP8 operands under two accumulators and orders, and its
    "20 % short" and "leaves 1.1 %": the Parquet of the command the page shows."""
    import pandas as pd

    page = _doc("accum-error.md")
    match = re.search(r"\$ (drift accum-error --shape 32x1024x32 [^\n]*?)\\\n\s*([^\n]*)\n", page)
    assert match is not None, "the page's command"
    command = f"{match.group(1).strip()} {match.group(2).strip()}"
    ran = steps.output((command,))
    assert ran.exit_code == 0, ran.output
    table = pd.read_parquet(steps.after((command,)) / "drift-out" / "accum-error.parquet")
    shown = {}
    for line in page.replace("−", "-").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in ("normal", "halfnormal"):
            shown[cells[0], cells[1], cells[2]] = cells[3:]
    assert len(shown) == len(table) == 8
    for row in table.itertuples():
        key = (row.dist, row.accumulator.split(":")[0], row.order)
        want = [f"{row.rel_error:.4g}", f"{row.cast_rel_error:.4g}",
                f"{row.accum_rel_error:.4g}", f"{row.bias:.3g}", f"{row.accum_bias:.3g}"]
        assert shown[key] == want, key
    lost = table[(table.dist == "halfnormal") & table.accumulator.str.startswith("bfloat16")]
    sequential, chunked = (lost[lost.order == o].iloc[0] for o in ("sequential", "chunked:128"))
    assert f"the result is {round(-100 * sequential.bias)} % short (bias " \
           f"{sequential.bias:.2f}".replace("-", "−") in page
    assert f"leaves {100 * chunked.accum_rel_error:.1f} %" in page  # the accumulation's own
