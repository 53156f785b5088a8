"""The drift command line: formats, errors, exit codes, docs for every command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
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
    from driftcli.cli.demo_cmd import NEXT

    for argv in [*lines, *NEXT]:  # every option is one the command knows: its --help lists it
        help_text = runner.invoke(app, [argv[0], "--help"], terminal_width=200).output
        for opt in (a for a in argv[1:] if a.startswith("-")):
            assert opt in help_text, f"drift {argv[0]} has no option {opt}"


def _commands() -> list[str]:
    from driftcli.cli import SECTIONS

    return [name for _, names in SECTIONS for name in names]


def test_help_groups_every_command_once_in_sections() -> None:
    from driftcli.cli import SECTIONS

    registered = {c.name for c in app.registered_commands}
    assert sorted(_commands()) == sorted(registered)  # each in exactly one section
    text = runner.invoke(app, ["--help"], terminal_width=100).output
    where = [text.index(f"\n{title}:\n") for title, _ in SECTIONS]
    assert where == sorted(where) and "Commands:" not in text
    for (title, names), start in zip(SECTIONS, where, strict=True):
        block = text[start + 1:].split("\n\n")[0]
        assert [line.split()[0] for line in block.splitlines()[1:]] == list(names), title


def test_usage_lines_and_arguments_read_as_unix_tools_write_them() -> None:
    for name in _commands():
        text = runner.invoke(app, [name, "--help"], terminal_width=100).output
        usage = text.splitlines()[0]
        assert usage.startswith(f"Usage: drift {name} [OPTIONS]"), usage
        for odd in ("{", "}", "[[", "]...]", "<list[", "<Path>", "<path>"):
            assert odd not in text, f"drift {name} --help shows {odd!r}"
    assert runner.invoke(app, ["clip-rate", "--help"]).output.startswith(
        "Usage: drift clip-rate [OPTIONS] INPUT...\n")
    assert runner.invoke(app, ["accum-error", "--help"]).output.startswith(
        "Usage: drift accum-error [OPTIONS] [DUMP]...\n")
    assert runner.invoke(app, ["probe", "--help"]).output.startswith(
        "Usage: drift probe [OPTIONS] RUN\n")


def test_every_option_and_argument_has_help() -> None:
    import typer

    group = typer.main.get_command(app)
    ctx = group.make_context("drift", [], resilient_parsing=True)
    missing = [f"{name} {p.name}" for name in _commands()
               for p in group.get_command(ctx, name).params if not getattr(p, "help", None)]
    assert not missing


def test_short_help_is_one_whole_sentence() -> None:
    text = runner.invoke(app, ["--help"], terminal_width=80).output
    listed = [line for line in text.split("Options:")[1].splitlines()
              if line.startswith("  ") and "--help" not in line and "--version" not in line]
    assert len(listed) == len(_commands())
    assert all(line.endswith(".") and not line.endswith("...") for line in listed), listed


@pytest.mark.parametrize(("argv", "message"), [
    (["probe", "/no/such/run", "-p", "exact"],
     "error: Invalid value for 'RUN': dir '/no/such/run' does not exist; see drift probe --help"),
    (["probe", ".", "-p", "exact", "--storage", "fp8"],
     "error: Invalid value for '--storage': Value error, 'fp8' is not one of 'bfloat16', "
     "'float16', 'float32'; see drift probe --help"),
    (["probe", ".", "-p", "exact", "--draws", "0"],
     "error: Invalid value for '--draws': Input should be greater than or equal to 1; see "
     "drift probe --help"),
    (["train"], "error: Missing option '--out'; see drift train --help"),
    (["no-such-command"], "error: No such command 'no-such-command'; see drift --help"),
])
def test_usage_errors_are_one_error_line(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "driftcli", *argv], capture_output=True,
                          text=True, check=False, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr == message + "\n" and proc.stdout == ""


def test_the_cli_reference_is_what_the_commands_print() -> None:
    from driftcli.cli.reference import reference

    page = (ROOT / "docs" / "cli-reference.md").read_text(encoding="utf-8")
    assert page == reference(), ("docs/cli-reference.md is stale: run "
                                 "python -m driftcli.cli.reference > docs/cli-reference.md")
    for name in _commands():
        assert f"$ drift {name} --help" in page


HEAVY = ("torch", "pandas", "pyarrow", "numpy", "matplotlib", "safetensors")
NO_TORCH = """
import sys
sys.argv = ["drift", *sys.argv[1:]]
from driftcli.cli import main
try:
    main()
except SystemExit as done:
    code = done.code
print("\\nEXIT", code, [m for m in {heavy!r} if m in sys.modules])
"""


@pytest.mark.parametrize("argv", [["--help"], ["formats"], ["formats", "--presets"],
                                  ["formats", "--cast", "nvfp4"],
                                  *([name, "--help"] for name in _commands())],
                         ids=" ".join)
def test_help_and_formats_never_import_torch(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", NO_TORCH.format(heavy=HEAVY), *argv],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    assert proc.stdout.splitlines()[-1] == "EXIT 0 []", proc.stdout[-300:] + proc.stderr


def test_a_warning_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    import driftcli.records.castspec

    real = driftcli.records.castspec.parse_cast

    def warned(spec: str) -> object:
        warnings.warn("something to know", UserWarning, stacklevel=1)
        return real(spec)

    monkeypatch.setattr(driftcli.records.castspec, "parse_cast", warned)
    result = runner.invoke(app, ["formats", "--cast", "nvfp4"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0] == "warning: something to know" and "UserWarning" not in result.output
    assert lines[1].startswith("nvfp4 = float4_e2m1fn:block16")


def test_the_error_examples_in_the_docs_are_what_the_cli_prints() -> None:
    import itertools
    import shlex

    examples = []
    for page in ("cli.md", "formats.md"):
        lines = (ROOT / "docs" / page).read_text(encoding="utf-8").splitlines()
        examples += [(line[2:], nxt) for line, nxt in itertools.pairwise(lines)
                     if line.startswith("$ drift ") and nxt.startswith("error: ")]
    assert len(examples) >= 6
    for command, error in examples:
        proc = subprocess.run([sys.executable, "-m", "driftcli", *shlex.split(command)[1:]],
                              capture_output=True, text=True, check=False, cwd=ROOT)
        assert proc.returncode == 2, command
        assert proc.stderr.rstrip("\n") == error, command


def test_the_demo_ends_with_what_to_run_on_your_own_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from driftcli.cli import demo_cmd

    monkeypatch.setattr(demo_cmd, "script", lambda out, text: [["formats", "--cast", "nvfp4"]])
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be.")
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "out"), "--text", str(text)])
    assert result.exit_code == 0
    tail = result.output.splitlines()[-4:]
    assert tail[0].startswith("next, on your own checkpoint")
    assert tail[1:] == [
        "  drift clip-rate MODEL.safetensors -c mxfp8_e4m3 -c mxfp8_e4m3_ceil -c nvfp4 --out "
        "my-drift-out",
        "  drift error-bias MODEL.safetensors -c mxfp8_e4m3 -c nvfp4 --out my-drift-out",
        "  drift report my-drift-out --fail-on 'clip-rate:clip_rate > 0.01'"]


LEAVE = """
import atexit, sys
from pathlib import Path
import torch  # loaded: leave() skips the interpreter's teardown
from driftcli.cli.app import leave
atexit.register(lambda: Path(sys.argv[1]).write_text("ran"))
print("buffered, not yet flushed", end="")
leave(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
"""


@pytest.mark.parametrize(("code", "status"), [("0", 0), ("3", 3), ("no input", 1)])
def test_leaving_early_keeps_the_exit_handlers_output_and_status(
        tmp_path: Path, code: str, status: int) -> None:
    mark = tmp_path / "handler"
    proc = subprocess.run([sys.executable, "-c", LEAVE, str(mark), code], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == status
    assert proc.stdout == "buffered, not yet flushed"
    assert mark.read_text() == "ran"
    assert proc.stderr == ("" if code.isdigit() else "no input\n")


def _click_commands() -> tuple[object, dict[str, object]]:
    import typer

    group = typer.main.get_group(app)
    ctx = group.make_context("drift", [], resilient_parsing=True)
    return ctx, {name: group.get_command(ctx, name) for name in _commands()}


def _unnamed_readers(help_text: str) -> list[str]:
    """The reader kinds (their endings, or their name where they have none) a help text leaves
    out: it is kept by hand, because the readers' registry imports torch and --help must not."""
    from driftcli.io.readers.collect import KINDS

    return [w for kind in KINDS for w in (kind.suffixes or (kind.name,))
            if not re.search(rf"(?<!\w){re.escape(w.lstrip('.'))}s?(?!\w)", help_text)]


def test_the_inputs_help_check_catches_a_stale_list() -> None:
    # the help as it was before issue 30: .pth files and Transformer Engine dumps unnamed
    stale = ("safetensors (or its .index.json folder), .pt/.bin state dicts, .npz/.npy, or "
             "folders of these; drift dumps too.")
    assert _unnamed_readers(stale) == ["Transformer Engine dump", ".pth", ".ckpt"]


def test_help_names_every_reader_engine_and_layout() -> None:
    from driftcli.choices import Engine
    from driftcli.cli.measure_cmds import Inputs
    from driftcli.io.layouts import Layout

    every_reader = Inputs.__metadata__[0].help
    assert _unnamed_readers(every_reader) == []
    seen = {"inputs": 0, "engine": 0, "layout": 0}
    ctx, commands = _click_commands()
    for name, command in commands.items():
        for param in command.params:  # type: ignore[attr-defined]
            if param.name == "inputs" and param.help == every_reader:
                seen["inputs"] += 1
            elif param.name == "engine":
                shown = param.get_help_record(ctx)[0]  # '--engine <serial|processes|ray>'
                assert shown.endswith(f"<{'|'.join(Engine)}>"), name
                assert [e for e in Engine if e.means not in param.help] == [], name
                seen["engine"] += 1
            elif param.name == "layout":
                assert [v for v in Layout if v.value not in param.help] == [], name
                seen["layout"] += 1
    # the four scans and block-stats take these inputs; ten commands run on the engines (health
    # the tenth); the scans and the two quantized-weight commands take --layout
    assert seen == {"inputs": 5, "engine": 10, "layout": 6}


def test_the_scan_commands_share_one_option_bundle() -> None:
    import dataclasses

    from driftcli.cli.measure_cmds import ScanArgs

    bundle = [f.name for f in dataclasses.fields(ScanArgs)]
    _, commands = _click_commands()
    own = {"clip-rate": [], "underflow-rate": [], "cast-diff": [], "error-bias": ["draws", "seed"]}
    for name, extra in own.items():
        names = [p.name for p in commands[name].params]  # type: ignore[attr-defined]
        assert names == [*bundle[:4], *extra, *bundle[4:]], name
