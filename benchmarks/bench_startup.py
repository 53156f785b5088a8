"""Fresh-process start-up of every drift command that does no work: ``drift --help``, each
``drift CMD --help`` and ``drift formats``, beside a bare Python and ``import torch`` measured
in the same run, so the figures are ratios against this machine's own floor and ceiling.

Each command runs ``--runs`` times in a new process (the console script, as a user runs it);
the table gives the median wall time, its ratio to ``python -c pass`` and to ``import torch``,
and whether torch was imported (read from ``-X importtime``).

Then the fixed start of a command that does work: ``drift clip-rate`` on a 10 MB safetensors
checkpoint (five 512 x 1024 float32 tensors, two casts, one of them MXFP8) in a fresh process,
against ``import torch``: import, kernel loading and the scan itself, which at this size is
a few milliseconds of arithmetic (the target: at most 2 s over ``import torch``).

    python benchmarks/bench_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
DRIFT = shutil.which("drift", path=str(BIN)) or "drift"
COMMANDS = ("clip-rate", "underflow-rate", "error-bias", "accum-error", "grad-cosine",
            "verify-formats", "formats", "report", "train", "dump", "probe", "demo")


def _wall(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _imports_torch(argv: list[str]) -> bool:
    proc = subprocess.run([sys.executable, "-X", "importtime", DRIFT, *argv[1:]],
                          capture_output=True, text=True, check=True)
    return any(line.rstrip().endswith("| torch") for line in proc.stderr.splitlines())


def main() -> None:
    """Print the table (markdown) of start-up times."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    bare = _wall([sys.executable, "-c", "pass"], runs)
    torch = _wall([sys.executable, "-c", "import torch"], runs)
    cases = [[DRIFT, "--help"], [DRIFT, "formats"],
             *([DRIFT, name, "--help"] for name in COMMANDS)]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; median of {runs} fresh processes")
    print(f"python -c pass: {bare:.3f} s; python -c 'import torch': {torch:.3f} s\n")
    print("| command | s | x bare python | x import torch | imports torch |")
    print("|---|---:|---:|---:|---|")
    for argv in cases:
        t = _wall(argv, runs)
        label = " ".join(["drift", *argv[1:]])
        print(f"| `{label}` | {t:.3f} | {t / bare:.1f} | {t / torch:.2f} | "
              f"{'yes' if _imports_torch(argv) else 'no'} |")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = _checkpoint(Path(tmp))
        argv = [DRIFT, "clip-rate", str(checkpoint), "-c", "mxfp8_e4m3", "-c", "fp8_e4m3",
                "--out", str(Path(tmp) / "out"), "--overwrite"]  # run again into one folder
        # this VM's speed drifts by half within minutes: each run is paired with an
        # `import torch` just before it, and the figure is the median of the differences
        pairs = [(_wall(argv, 1), _wall([sys.executable, "-c", "import torch"], 1))
                 for _ in range(max(5, runs // 2))]
        size = checkpoint.stat().st_size / 1e6
    t = statistics.median(c for c, _ in pairs)
    over = statistics.median(c - b for c, b in pairs)
    print(f"\n`drift clip-rate` on a {size:.1f} MB checkpoint, fresh process, {len(pairs)} runs "
          f"each after an `import torch`: median {t:.3f} s, {over:.3f} s over import torch "
          f"(differences {min(c - b for c, b in pairs):.3f} to "
          f"{max(c - b for c, b in pairs):.3f} s; target <= 2 s)")


def _checkpoint(folder: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(512, 1024, generator=gen) for i in range(5)}
    path = folder / "model.safetensors"
    save_file(tensors, str(path))
    return path


if __name__ == "__main__":
    main()
