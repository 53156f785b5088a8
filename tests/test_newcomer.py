"""A newcomer's first hour (issue 45): installing from the README, a first run that says it is
compiling, interrupts and plain progress, empty paths, one count per checkpoint, and messages
for what drift does not read."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from driftcli.cli import app
from driftcli.io.readers import open_inputs

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT.parent / "shared" / "data" / "models"


def drift(*args: str) -> tuple[int, str]:
    """Exit code and output (stdout and stderr together) of ``drift ARGS`` in this process."""
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(32, 32,
                                                                                generator=g)}


# --- 4. no empty path -------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["", "   "])
def test_an_empty_input_path_is_refused_before_anything_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str) -> None:
    # an unset $CHECKPOINT in CI: before, "" was the current folder, walked and measured
    save_file(_weights(), str(tmp_path / "here.safetensors"))
    monkeypatch.chdir(tmp_path)
    code, out = drift("clip-rate", given, "-c", "mxfp8_e4m3", "--out", "o")
    assert code == 2, out
    assert out.count("\n") == 1 and "error:" in out and "INPUT" in out and "empty" in out, out
    assert not (tmp_path / "o").exists()  # nothing measured, nothing written


def test_an_empty_path_among_good_ones_and_in_an_option_is_refused(tmp_path: Path) -> None:
    save_file(_weights(), str(tmp_path / "w.safetensors"))
    code, out = drift("inspect", str(tmp_path / "w.safetensors"), "")
    assert code == 2 and "INPUT" in out and "empty" in out, out
    code, out = drift("report", str(tmp_path), "--html", " ")
    assert code == 2 and "--html" in out and "empty" in out, out


@pytest.mark.parametrize("given", ["", " ", ["w.safetensors", ""]])
def test_the_library_refuses_an_empty_path_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               given: str | list[str]) -> None:
    # only the CLI refused it: drift.measure("") (a notebook's unset variable) measured the
    # current folder
    from driftcli import DriftError, measure

    save_file(_weights(), str(tmp_path / "w.safetensors"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DriftError, match=r"an input path is empty \('\s*'\)"):
        measure(given, "mxfp8_e4m3")


# --- 7. one checkpoint, one count ---------------------------------------------------------------


def test_a_folder_with_safetensors_and_bin_of_the_same_weights_is_read_once(
        tmp_path: Path) -> None:
    w = _weights()
    save_file(w, str(tmp_path / "model.safetensors"))
    torch.save(w, tmp_path / "pytorch_model.bin")
    found = open_inputs([tmp_path])
    # before: 4 tensors, each name twice
    assert sorted(r.name for r in found.tensors) == ["a.weight", "b.weight"]
    assert {Path(r.source).name for r in found.tensors} == {"model.safetensors"}
    assert found.duplicates == ((tmp_path / "pytorch_model.bin", tmp_path / "model.safetensors"),)
    code, out = drift("clip-rate", str(tmp_path), "-c", "mxfp8_e4m3", "--out",
                      str(tmp_path / "o"))
    assert code == 0, out
    said = [line for line in out.splitlines() if "pytorch_model.bin" in line]
    assert len(said) == 1 and "model.safetensors" in said[0], out


def test_dequantize_and_inspect_say_which_twin_they_left_unread(tmp_path: Path) -> None:
    # only the measure commands said it: dequantize wrote no output for pytorch_model.bin
    # and inspect left it out, both in silence
    ck = tmp_path / "ck"
    ck.mkdir()
    w = {"l.weight": torch.ones(4, 8).to(torch.float8_e4m3fn), "l.weight_scale": torch.ones(())}
    save_file(w, str(ck / "model.safetensors"))
    torch.save(w, ck / "pytorch_model.bin")
    for cmd in (["dequantize", str(ck), "--out", str(tmp_path / "deq")],
                ["inspect", str(ck), "--out", str(tmp_path / "ins")]):
        code, out = drift(*cmd)
        assert code == 0, out
        said = [line for line in out.splitlines() if "pytorch_model.bin" in line]
        assert len(said) == 1 and "the same weights as" in said[0], out


def test_shards_of_both_formats_are_read_once_from_the_safetensors(tmp_path: Path) -> None:
    w = _weights()
    save_file({"a.weight": w["a.weight"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": w["b.weight"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors"}}))
    torch.save({"a.weight": w["a.weight"]}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b.weight": w["b.weight"]}, tmp_path / "pytorch_model-00002-of-00002.bin")
    found = open_inputs([tmp_path])
    assert sorted(r.name for r in found.tensors) == ["a.weight", "b.weight"]
    assert all(r.source.endswith(".safetensors") for r in found.tensors)
    assert [p.name for p, _ in found.duplicates] == ["pytorch_model-00001-of-00002.bin",
                                                      "pytorch_model-00002-of-00002.bin"]
    # a .bin alone, or named on its own beside the safetensors, is still read
    only = tmp_path / "only"
    only.mkdir()
    torch.save(w, only / "pytorch_model.bin")
    assert len(open_inputs([only]).tensors) == 2
    named = open_inputs([tmp_path / "pytorch_model-00001-of-00002.bin"])
    assert [r.name for r in named.tensors] == ["a.weight"] and not named.duplicates


def test_the_worst_list_names_the_file_when_tensor_names_repeat(tmp_path: Path) -> None:
    for n in (1, 2):
        (tmp_path / f"ckpt-{n}").mkdir()
        save_file(_weights(n), str(tmp_path / f"ckpt-{n}" / "model.safetensors"))
    code, out = drift("clip-rate", str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-2"),
                      "-c", "mxfp8_e4m3", "--out", str(tmp_path / "o"), "--json")
    assert code == 0, out
    casts = json.loads(out)["casts"]
    shown = [w["shown"] for c in casts for w in c["worst"]]
    # each worst tensor is named with its file, since a.weight and b.weight are in both
    assert all(re.fullmatch(r"[ab]\.weight \(.*ckpt-[12]/model\.safetensors\)", s)
               for s in shown), shown
    code, out = drift("clip-rate", str(tmp_path / "ckpt-1"), "-c", "mxfp8_e4m3", "--out",
                      str(tmp_path / "o1"), "--json")
    assert {w["shown"] for c in json.loads(out)["casts"] for w in c["worst"]} <= {
        "a.weight", "b.weight"}


def test_each_input_s_row_lists_its_own_worst_tensors_and_names_its_input(
        tmp_path: Path) -> None:
    for n in (1, 2):
        (tmp_path / f"ckpt-{n}").mkdir()
        save_file(_weights(n), str(tmp_path / f"ckpt-{n}" / "model.safetensors"))
    args = ("clip-rate", str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-2"), "-c", "mxfp8_e4m3")
    code, out = drift(*args, "--out", str(tmp_path / "o"), "--json")
    assert code == 0, out
    rows = json.loads(out)["casts"]
    # one row per input and cast, each listing only the tensors of its own input
    assert [Path(r["input"]).name for r in rows] == ["ckpt-1", "ckpt-2"]
    assert all(Path(w["source"]).parent == Path(r["input"]) for r in rows for w in r["worst"])
    assert [len(r["worst"]) for r in rows] == [2, 2]
    code, out = drift(*args, "--out", str(tmp_path / "o2"))
    assert code == 0, out
    lines = [ln for ln in out.splitlines() if "mxfp8_e4m3" in ln and ln.startswith("│")]
    # the terminal rows say which input they are (two rows alike would be a puzzle)
    assert len(lines) == 2 and "ckpt-1" in lines[0] and "ckpt-2" in lines[1], out


# --- 8. messages for what drift does not read ---------------------------------------------------


def test_a_gguf_file_says_drift_does_not_read_it_and_what_to_convert_with(
        tmp_path: Path) -> None:
    gguf = tmp_path / "model-Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    code, out = drift("clip-rate", str(gguf), "-c", "mxfp8_e4m3")
    assert code == 2 and "GGUF" in out and "does not read" in out and "gguf_file" in out, out
    # a folder holding only a GGUF says the same
    code, out = drift("clip-rate", str(tmp_path), "-c", "mxfp8_e4m3")
    assert code == 2 and "GGUF" in out and "model-Q8_0.gguf" in out, out


def test_a_ckpt_is_read_when_it_is_a_torch_zip(tmp_path: Path) -> None:
    w = _weights()
    torch.save({"state_dict": w, "epoch": 3}, tmp_path / "last.ckpt")
    found = open_inputs([tmp_path / "last.ckpt"])
    assert sorted(r.name for r in found.tensors) == ["state_dict.a.weight", "state_dict.b.weight"]
    assert len(open_inputs([tmp_path]).tensors) == 2  # found in a folder too
    (tmp_path / "tf.ckpt").write_bytes(b"\x00\x01tensorflow" * 4)
    code, out = drift("clip-rate", str(tmp_path / "tf.ckpt"), "-c", "mxfp8_e4m3")
    assert code == 2 and "torch" in out and "zip" in out, out


def test_a_bin_that_torch_did_not_write_says_so(tmp_path: Path) -> None:
    raw = tmp_path / "weights.bin"
    raw.write_bytes(bytes(range(94, 200)) * 8)  # before: "Unsupported operand 94"
    found = open_inputs([raw])
    (err,) = found.errors
    assert "Unsupported operand" not in err.message
    assert "not a PyTorch file" in err.message and "torch.save" in err.message, err.message
    # a pickle that is torch's old format still goes to torch
    legacy = tmp_path / "legacy.bin"
    torch.save(_weights(), legacy, _use_new_zipfile_serialization=False)
    assert len(open_inputs([legacy]).tensors) == 2


def test_integer_tensors_skipped_are_named_with_a_hint_when_they_look_quantized(
        tmp_path: Path) -> None:
    save_file({"w.weight": torch.randn(64, 32),
               "q.weight": torch.randint(-128, 127, (64, 32), dtype=torch.int8),
               "position_ids": torch.arange(16).reshape(1, 16)},
              str(tmp_path / "m.safetensors"))
    code, out = drift("clip-rate", str(tmp_path / "m.safetensors"), "-c", "mxfp8_e4m3",
                      "--out", str(tmp_path / "o"))
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("skipped 2"))
    assert "q.weight (int8)" in line and "position_ids (int64)" in line, line
    assert "drift inspect" in out, out
    # integers that do not look quantized get no hint
    save_file({"w": torch.randn(64, 32), "ids": torch.arange(16)},
              str(tmp_path / "n.safetensors"))
    code, out = drift("clip-rate", str(tmp_path / "n.safetensors"), "-c", "mxfp8_e4m3",
                      "--out", str(tmp_path / "o2"))
    assert "skipped 1 integer tensor(s), not measured: ids (int64)" in out
    assert "drift inspect" not in out, out


def test_probe_on_a_checkpoint_folder_says_it_takes_only_drifts_runs(tmp_path: Path) -> None:
    save_file(_weights(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    code, out = drift("probe", str(tmp_path), "-p", "mxfp8_e4m3")
    assert code == 2, out
    assert "drift train" in out and "clip-rate" in out and "--checkpoint-every" not in out, out


def test_a_cast_in_capitals_gets_a_suggestion() -> None:
    code, out = drift("formats", "--cast", "MXFP8_E4M3")
    assert code == 2 and "did you mean mxfp8_e4m3" in out, out
    code, out = drift("formats", "--cast", "FLOAT8_E4M3FN:tensor")
    assert code == 2 and "did you mean float8_e4m3fn" in out, out


# --- 2. a first run that speaks -----------------------------------------------------------------


def test_a_long_compile_gives_one_notice_and_the_cli_prints_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from numba import njit

    from driftcli.cli.run import Bar, progress_bar
    from driftcli.kernels import compiling
    from driftcli.kernels.jit import jit_unavailable
    from driftcli.progress import notify

    assert jit_unavailable() is None  # numba's compile events are watched from here on
    # a fresh watch that counts any compile as long (a real first run takes minutes)
    monkeypatch.setattr(compiling, "_WATCH", compiling._Watch())
    monkeypatch.setattr(compiling, "NOTICE_AFTER_S", 0.0)
    monkeypatch.setenv("DRIFT_PROGRESS_EVERY", "10")

    @njit(cache=False)
    def never_compiled_before(x: float) -> float:  # compiled by this call, not cached
        return x * 3.0 + 1.0

    with progress_bar("measuring", Bar.ITEMS, quiet=True):
        assert never_compiled_before(2.0) == 7.0
        assert never_compiled_before(2) == 7.0  # a second compile: no second line
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "compiling drift's kernels" in err[0] and "minutes" in err[0], err
    # the library alone prints nothing: with no listener a notice goes nowhere
    notify("unheard")
    assert capsys.readouterr() == ("", "")


# --- 3. interrupts and progress -----------------------------------------------------------------


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, units: int | None) -> None:
    """Make the next scan raise KeyboardInterrupt (Ctrl-C) once ``units`` units finished."""
    from driftcli.measures import scan as scan_module

    real = getattr(scan_module.scan, "real", scan_module.scan)  # not an earlier wrapper

    def scan(*args: object, progress: object = None, **kw: object) -> object:
        seen = [0]

        def tick(done: int, total: int, name: str) -> None:
            seen[0] += 1
            if units is not None and seen[0] >= units:
                raise KeyboardInterrupt
        return real(*args, progress=tick, **kw)

    scan.real = real  # type: ignore[attr-defined]
    monkeypatch.setattr(scan_module, "scan", scan)


def test_ctrl_c_says_what_was_kept_and_how_to_go_on(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for n in range(3):
        save_file(_weights(n), str(tmp_path / f"c{n}.safetensors"))
        files.append(str(tmp_path / f"c{n}.safetensors"))
    argv = ["clip-rate", *files, "-c", "mxfp8_e4m3", "--out", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/drift", *argv])
    units = tmp_path / "o" / ".clip-rate.parquet.units"
    _interrupt_after(monkeypatch, 2)
    code, out = drift(*argv)
    assert code == 130, out  # before: "error: aborted", exit 1, and nothing about --resume
    (line,) = out.splitlines()
    # the units kept so far (one may still wait for its input's sha256 when Ctrl-C comes)
    kept = len(list(units.iterdir()))
    assert kept >= 1
    assert line == (f"interrupted: {kept} finished unit(s) kept in {units}; to go on from them: "
                    f"drift {' '.join(argv)} --resume"), line
    # a run that forgot --resume keeps them, says so, and leaves them for a later --resume
    _interrupt_after(monkeypatch, 1)
    code, out = drift(*argv)
    assert code == 130, out
    assert f"note: {kept} unit(s) an earlier run finished are kept" in out, out
    assert f"interrupted: {kept} finished unit(s) (an earlier run's) kept" in out, out
    assert len(list(units.iterdir())) == kept
    _interrupt_after(monkeypatch, None)
    code, out = drift(*argv, "--resume", "--json")
    assert code == 0, out
    from driftcli.io.tables import read_table

    assert read_table(tmp_path / "o" / "clip-rate.parquet")[1]["resumed_units"] == kept


def test_without_a_terminal_progress_is_plain_lines_at_an_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from driftcli.cli.run import Bar, PlainProgress

    now = [0.0]
    shown: list[str] = []
    monkeypatch.setattr("typer.echo", lambda text, err=False: shown.append(text))
    lines = PlainProgress("grad-cosine", Bar.ITEMS, 10.0, clock=lambda: now[0])
    for step in range(1, 31):  # a unit every 1.5 s: a line every 10 s, not one per unit
        now[0] = 1.5 * step
        lines(step, 30, f"policy {step}")
    assert shown == ["grad-cosine: 7 of 30 (23 %), at policy 7",
                     "grad-cosine: 14 of 30 (47 %), at policy 14",
                     "grad-cosine: 21 of 30 (70 %), at policy 21",
                     "grad-cosine: 28 of 30 (93 %), at policy 28"]
    # through the command: CliRunner's stderr is no terminal, as in CI
    save_file(_weights(), str(tmp_path / "w.safetensors"))
    monkeypatch.undo()
    monkeypatch.setenv("DRIFT_PROGRESS_EVERY", "0.000001")
    code, out = drift("clip-rate", str(tmp_path / "w.safetensors"), "-c", "mxfp8_e4m3",
                      "--out", str(tmp_path / "o"))
    assert code == 0 and re.search(r"^scanning: [\d.]+ of [\d.]+ MiB \(\d+ %\), at ", out,
                                   re.M), out
    monkeypatch.setenv("DRIFT_PROGRESS_EVERY", "0")
    code, out = drift("clip-rate", str(tmp_path / "w.safetensors"), "-c", "mxfp8_e4m3",
                      "--out", str(tmp_path / "o"), "--overwrite")
    assert code == 0 and "scanning:" not in out, out


# --- 1. install, and the CI examples ------------------------------------------------------------


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _install_lines() -> list[str]:
    """The README's install commands: the first ```sh block of its Install section, less
    comments."""
    block = _section("Install").split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def _tracked_copy(dest: Path) -> None:
    """The repository's tracked files as they are in this work tree (a clone of it)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes((ROOT / name).read_bytes())


@pytest.mark.slow
def test_the_readme_install_lines_install_drift_beside_the_torch_there(tmp_path: Path) -> None:
    """A fresh environment with torch, then the README's own lines: drift runs, torch is the
    one that was there; and make's set-up keeps a torch its python has."""
    lines = _install_lines()
    clone, pip, check = lines  # git clone URL FOLDER; pip install ./FOLDER; drift --help
    assert clone.startswith("git clone ") and pip.startswith("pip install ") and check == (
        "drift --help"), lines
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    path = {**os.environ, "PATH": f"{env / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    path.pop("PYTHONPATH", None)
    # this machine holds torch 2.13.0 as a local wheel (the Makefile's pin)
    subprocess.run(["pip", "install", "-q", "torch==2.13.0"], env=path, check=True, timeout=300)
    version = [str(env / "bin" / "python"), "-c", "import torch; print(torch.__version__)"]
    before = subprocess.run(version, capture_output=True, text=True, check=True).stdout
    _tracked_copy(tmp_path / clone.split()[-1])  # the clone, without the network
    for line in (pip, check):
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=path, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{line}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert "Measure" in done.stdout and "clip-rate" in done.stdout, done.stdout
    assert subprocess.run(version, capture_output=True, text=True).stdout == before
    # make's set-up with this environment's python: the venv sees its torch, pip fetches none
    dev = tmp_path / "dev"
    # under `make test` this make is a sub-make: it would print "make[1]: Entering directory"
    # lines among the commands, so it is told not to, and forgets the parent's flags
    alone = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    plan = subprocess.run(["make", "--no-print-directory", "-n", "setup",
                           f"PYTHON={env / 'bin' / 'python'}", f"VENV={dev}"], cwd=ROOT,
                          capture_output=True, text=True, check=True,
                          env=alone).stdout.replace("\\\n", "")
    steps = [s for s in plan.splitlines() if s and not s.startswith("#") and "-e '.[dev]'" not in s
             and not s.startswith("touch")]
    ran = subprocess.run(["bash", "-ec", "\n".join(steps)], capture_output=True, text=True,
                         env=path, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert not list(dev.glob("lib/python*/site-packages/torch"))  # none installed there
    where = subprocess.run([str(dev / "bin" / "python"), "-c",
                            "import torch; print(torch.__file__)"],
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(env)), where


def test_the_readme_names_extras_that_exist_and_its_quick_start_is_run_by_the_docs_test() -> None:
    import tomllib

    from test_doc_outputs import parse

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = re.findall(r"driftcli\[([\w,]+)\]|\./drift\[([\w,]+)\]", _section("Install"))
    assert named and all(e in extras for pair in named for e in ",".join(pair).split(",") if e)
    # every command of the quick start is in a block the docs test runs and compares
    quick = _section("Quick start")
    blocks, unmarked = parse(quick, "README.md")
    run = {c for b in blocks for c in b.commands}
    shown = [line[2:] for line in quick.splitlines() if line.startswith("$ ")]
    assert shown and set(shown) <= run and not unmarked, (shown, run)


def test_the_ci_workflow_installs_drift_itself_with_the_scripts_rules() -> None:
    yml = (ROOT / "examples" / "ci" / "drift.yml").read_text()
    sh = (ROOT / "examples" / "ci" / "drift.sh").read_text()
    # before: "pip install ." installed the user's repository, and drift was not found
    assert not re.search(r"pip install \.\s*$", yml, re.M)
    assert re.search(r'pip install "driftcli @ \$DRIFT"', yml)
    rules = re.compile(r"--fail-on '([^']+)'")
    assert rules.findall(yml) == rules.findall(sh) and len(rules.findall(sh)) == 3


def test_the_ci_rules_hold_on_a_stock_checkpoint(tmp_path: Path) -> None:
    """The script's rules, as shipped, on a real model nobody here trained (stories260K, a
    Llama-architecture checkpoint): its norm gains clip up to 19 % under MXFP8 tensor by
    tensor, which a per-tensor rule failed on; the rules judge the all-tensors rows."""
    model = MODELS / "stories260K-hf" / "model.safetensors"
    env = {**os.environ, "CHECKPOINT": str(model),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", str(ROOT / "examples" / "ci" / "drift.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "OK: 3 rule(s) hold" in done.stdout
    assert "model.layers.2.post_attention_layernorm.weight 0.1875" in done.stdout
