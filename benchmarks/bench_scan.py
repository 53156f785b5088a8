"""A checkpoint scan against one plain read of the same file, side by side in one process.

Builds (once, seeded) a ~1 GB float32 safetensors checkpoint shaped like a small
transformer (an embedding, four layers of attention and MLP matrices, norm
vectors; 39 tensors, heavy-tailed values so that casts clip and underflow), then
times, interleaved round by round after one untimed warm-up (where compilation
happens):

- ``read``: every tensor read through ``safetensors.safe_open`` and summed (safetensors
  maps the file: nothing is copied, a floor no reader that copies can reach);
- ``copy``: the file read into memory in 16 MiB pieces and summed: the plain read the
  target is measured against, as drift's readers copy too;
- ``scan``: ``clip-rate`` with the casts ``fp8_e4m3``, ``mxfp8_e4m3`` and ``nvfp4``
  (the library call behind the command: read, cast three ways, count).

It prints them and the ratios (scan speed / read speed), then runs the real
command (``drift clip-rate FILE -c ... --quiet``) in a child process and reports
its wall time and peak resident memory against the largest tensor, and the time
the provenance sha256 of the input takes (``--fast-hash`` skips it).

Like the command, the process backs large tensors with huge pages where Linux offers them
(:func:`driftcli.memory.use_huge_pages`); ``THP_MEM_ALLOC_ENABLE=0`` turns that off.

Run ``python benchmarks/bench_scan.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from driftcli.measures import MEASURES
from driftcli.memory import use_huge_pages

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_casts import interleaved, machine

CASTS = ("fp8_e4m3", "mxfp8_e4m3", "nvfp4")
TARGET = 0.3  # scan speed / copying read speed
D, FF, VOCAB, LAYERS = 2048, 5504, 24576, 4


def shapes(d: int = D, ff: int = FF, vocab: int = VOCAB, layers: int = LAYERS,
           head_bias: bool = True) -> dict[str, tuple[int, ...]]:
    """A small transformer's tensors: by default 39 tensors, 1.01 GB of float32, the
    embedding the largest (201 MB)."""
    out: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {p + n: (d, d) for n in ("q.weight", "k.weight", "v.weight", "o.weight")}
        out |= {p + "up.weight": (ff, d), p + "gate.weight": (ff, d), p + "down.weight": (d, ff)}
        out |= {p + "norm1.weight": (d,), p + "norm2.weight": (d,)}
    out["norm.weight"] = (d,)
    if head_bias:
        out["lm_head.bias"] = (vocab,)
    return out


def build(path: Path, seed: int = 0) -> None:
    """Seeded heavy-tailed values: normal * exp(normal), scaled per tensor."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (name, shape) in enumerate(shapes().items()):
        x = torch.randn(shape, generator=gen)
        x *= torch.exp(torch.randn(shape, generator=gen))
        tensors[name] = x * 2.0 ** (-(i % 7) - 4)
    save_file(tensors, str(path))


def plain_read(path: Path) -> float:
    """Read every tensor through safetensors and sum it: what any scan must at least do.
    (safetensors maps the file and hands out tensors over the mapping: no copy.)"""
    total = 0.0
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            total += float(f.get_tensor(name).sum())
    return total


def copy_read(path: Path) -> float:
    """The file read into memory in 16 MiB pieces and summed: a read that copies, as
    drift's readers do (they never keep the file mapped).

    It sums on one thread: with two, waking the second after every read made this read
    bimodal from one process to the next (about 3.5 or 10 GB/s here); one thread gives the
    fast one every time."""
    total = 0.0
    buf = bytearray(16 << 20)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with path.open("rb") as fh:
            fh.seek(8 + int.from_bytes(fh.read(8), "little"))
            while n := fh.readinto(buf):
                total += float(torch.frombuffer(buf, dtype=torch.float32, count=n // 4).sum())
    finally:
        torch.set_num_threads(threads)
    return total


PEAK = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module("driftcli", run_name="__main__")
except SystemExit as done:
    if done.code:
        raise
status = open("/proc/self/status").read()
print(next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM")), file=sys.stderr)
"""
# VmHWM, not getrusage: Linux carries the pre-exec high-water mark of the forked copy of
# this (large) process into the child's ru_maxrss


def child(path: Path, fast_hash: bool) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of the real command in a fresh process."""
    cmd = [sys.executable, "-c", PEAK, "drift", "clip-rate", str(path), "--quiet",
           "--out", tempfile.mkdtemp(), *(a for c in CASTS for a in ("-c", c))]
    if fast_hash:
        cmd.append("--fast-hash")
    start = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    return wall, int(done.stderr.strip().splitlines()[-1]) * 1024


def main(argv: list[str] | None = None) -> int:
    """Build the checkpoint if needed, time read and scan, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=Path(tempfile.gettempdir()) /
                        "drift-bench-scan.safetensors", help="checkpoint to build or reuse")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    huge = use_huge_pages()  # as the drift command does, before the first tensor
    if not args.file.exists():
        print(f"building {args.file} …", flush=True)
        build(args.file)
    size = args.file.stat().st_size
    largest = max(torch.Size(s).numel() * 4 for s in shapes().values())
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"{info['threads']} threads, commit {info['commit']}, "
          f"huge pages {'on' if huge else 'off'}")
    print(f"checkpoint: {args.file} ({size / 1e9:.3f} GB, {len(shapes())} tensors, "
          f"largest {largest / 1e6:.0f} MB)")
    measure = MEASURES["clip-rate"]
    calls = {"cast": lambda: measure.run([args.file], list(CASTS)),
             "read": lambda: plain_read(args.file), "copy": lambda: copy_read(args.file)}
    t = interleaved(calls, args.repeat)
    ratio = t["copy"] / t["cast"]
    print(f"mapped read (no copy): {t['read']:.2f} s  ({size / t['read'] / 1e9:.2f} GB/s); "
          f"scan / mapped read speed {t['read'] / t['cast']:.3f}x")
    print(f"copying read: {t['copy']:.2f} s  ({size / t['copy'] / 1e9:.2f} GB/s)")
    print(f"clip-rate {'+'.join(CASTS)}: {t['cast']:.2f} s  ({size / t['cast'] / 1e9:.2f} GB/s)"
          f"  warm-up {t['warmup']:.1f} s")
    print(f"scan / copying read speed: {ratio:.3f}x  (target >= {TARGET}x: "
          f"{'met' if ratio >= TARGET else 'MISSED'})")
    start = time.perf_counter()
    digest = hashlib.sha256()
    with args.file.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    print(f"sha256 of the input (provenance): {time.perf_counter() - start:.2f} s")
    for fast in (False, True):
        wall, peak = child(args.file, fast)
        bound = 3 * largest + 300e6
        print(f"drift clip-rate{' --fast-hash' if fast else ''}: {wall:.1f} s wall "
              f"(incl. start-up and compilation), peak RSS {peak / 1e6:.0f} MB = "
              f"{peak / largest:.2f}x largest tensor (bound 3x + 300 MB = {bound / 1e6:.0f} MB:"
              f" {'met' if peak <= bound else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
