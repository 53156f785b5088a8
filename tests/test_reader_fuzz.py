"""Seeded fuzz of the readers: over a thousand damaged files built from small sound ones.

Each mutant of one small safetensors file (header-length lies, offset, shape, dtype and
metadata edits, truncations at every boundary, random byte damage) and of a few ``.npy``,
``.npz`` and ``.pt`` files is read the way the measurement commands read it
(:func:`driftcli.measures.scan.scan`, then every listed tensor read whole), all in one
subprocess under an address-space limit, which reports one JSON line per mutant. The
reference library (``safetensors.safe_open`` reading every tensor, ``numpy.load``,
``torch.load``) reads each mutant here. The checks:

- no mutant crashes drift (no exception but drift's own, no signal), exceeds the limit,
  or takes more than a few seconds;
- every mutant the library refuses gets an error from drift, for the file or for a tensor
  (never a clean measurement of everything);
- where the file's layout was left alone but one entry was edited, every tensor drift
  still lists is exactly the sound file's tensor (no neighbour read from a shifted place);
- every safetensors mutant the library reads, drift reads the same: same tensors, dtypes,
  shapes and bytes, and no error;
- the mutants reach every outcome (file error, tensor error, clean), so none of this holds
  for want of cases.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import resource
import struct
import subprocess
import sys
import time
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import driftcli

SEED = 20261201
CAST = "mxfp8_e4m3"
HEADROOM = 512 << 20
"""Address space the worker may take beyond what it holds after its imports and a warm-up
read: torch reserves a lot of address space it never touches, so the limit is set above
the worker's own baseline rather than as an absolute figure; every mutant is under 2 KiB,
so a buffer sized from a lying shape is what this catches."""
CASE_SECONDS = 5.0
"""Per mutant; drift takes milliseconds, the rest is room for a loaded CI machine."""

# every dtype code safetensors defines (its crate's Dtype), and some it does not
ST_CODES = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
            "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
            "C64", "F64", "I64", "U64"]
BAD_CODES: list[Any] = ["F99", "f32", "", "F8", "F32 ", 5, None, ["F32"]]
SUB_BYTE = {"F4", "F6_E2M3", "F6_E3M2"}


@dataclass(frozen=True)
class Mutant:
    """One damaged file, and what it changed."""

    label: str
    data: bytes
    suffix: str
    untouched: frozenset[str] | None = None
    """Tensors whose entries and bytes the mutation left alone (their place too), so that
    drift may list them only as they are in the sound file; None where unknown."""


# --- the sound files ------------------------------------------------------------------------


def sound_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return {
        "w": torch.randn(3, 4, generator=g),
        "h": torch.randn(5, generator=g).half(),
        "b": torch.randn(2, 3, generator=g).bfloat16(),
        "q": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "ids": torch.randint(-9, 9, (3,), generator=g),
        "d": torch.randn(2, generator=g).double(),
        "s": torch.tensor(-0.0),
    }


def digest(t: torch.Tensor) -> str:
    """The tensor's bytes, hashed (a 0-d tensor as one element)."""
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _split(raw: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """A sound safetensors file as its header, its header text, and its data."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8:8 + n], raw[8 + n:]


def _pack(header: dict[str, Any], data: bytes) -> bytes:
    """A safetensors file as the library writes it: the header padded with spaces to a
    multiple of 8 bytes."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


# --- safetensors mutants --------------------------------------------------------------------


Edit = Callable[[dict[str, Any]], object]
"""Changes a copy of the header in place."""


def _edited(header: dict[str, Any], data: bytes, label: str, names: set[str],
            edit: Edit) -> Mutant:
    h = json.loads(json.dumps(header))
    edit(h)
    tensors = {k for k in header if k != "__metadata__"}
    return Mutant(label, _pack(h, data), ".safetensors", frozenset(tensors - names))


def _set(name: str, key: str, value: Any, index: int | None = None) -> Edit:
    def edit(h: dict[str, Any]) -> None:
        if index is None:
            h[name][key] = value
        else:
            h[name][key][index] = value
    return edit


def safetensors_mutants(raw: bytes, rng: random.Random) -> Iterator[Mutant]:
    header, text, data = _split(raw)
    names = [k for k in header if k != "__metadata__"]
    everything = frozenset(names)
    n, size = len(text), len(raw)
    # header-length lies: the same bytes, the length field off
    lengths = [n + d for d in range(-16, 17) if d] + [
        0, 1, 2, 7, 8, size - 8, size - 7, size, 1 << 32, 100_000_001, (1 << 63) + n,
        (1 << 64) - 1]
    for length in lengths:
        yield Mutant(f"length {length}", struct.pack("<Q", length) + text + data,
                     ".safetensors", everything)
    # truncations at every byte of the prefix and around every boundary, and bytes appended
    cuts = set(range(0, 17)) | {8 + n + d for d in (-2, -1, 0, 1, 2)} | {size - 1}
    for name in names:
        for edge in header[name]["data_offsets"]:
            cuts |= {8 + n + edge + d for d in (-1, 0, 1)}
    for cut in sorted(c for c in cuts if 0 <= c < size):
        yield Mutant(f"cut at {cut}", raw[:cut], ".safetensors", everything)
    for extra in (b"\0", b" ", bytes(8)):
        yield Mutant(f"append {extra!r}", raw + extra, ".safetensors", everything)
    for name in names:
        begin, end = header[name]["data_offsets"]
        one = {name}
        # offsets: each end moved, set to edges, to impossible values, to other types
        for index, at in ((0, begin), (1, end)):
            values: list[Any] = [at + d for d in (-8, -4, -2, -1, 1, 2, 4, 8)]
            values += [0, len(data), len(data) + 1, 1 << 40, 1 << 64, -1, 1.5, "8", None]
            for v in values:
                yield _edited(header, data, f"{name} offset[{index}]={v!r}", one,
                              _set(name, "data_offsets", v, index))
        for d in (-4, -1, 1, 4, 8):
            yield _edited(header, data, f"{name} offsets shifted {d}", one,
                          _set(name, "data_offsets", [begin + d, end + d]))
        for v in ([begin], [begin, end, end], [end, begin], "0-8", None, {}):
            yield _edited(header, data, f"{name} offsets={v!r}", one,
                          _set(name, "data_offsets", v))
        yield _edited(header, data, f"{name} dropped", one, lambda h, k=name: h.pop(k))
        yield _edited(header, data, f"{name} cloned", set(),
                      lambda h, k=name: h.__setitem__("zz", dict(h[k])))
        yield _edited(header, data, f"{name} without data_offsets", one,
                      lambda h, k=name: h[k].pop("data_offsets"))
        yield _edited(header, data, f"{name} not an object", one,
                      lambda h, k=name: h.__setitem__(k, 5))
        # shapes: sizes off by one, huge, negative, of other types; some still sound
        shape = header[name]["shape"]
        shapes: list[Any] = [[*shape, 1], shape[::-1], [], [0], [-1], [1 << 40, 1 << 40],
                             [1 << 64], [1 << 62, 4], "3", None, [2.0], [True]]
        if shape:
            shapes += [[shape[0] + 1, *shape[1:]], [max(shape[0] - 1, 0), *shape[1:]],
                       [*shape[:-1], -shape[-1]], [float(d) for d in shape]]
        for v in shapes:
            yield _edited(header, data, f"{name} shape={v!r}", one, _set(name, "shape", v))
        # dtypes: every code there is (same-size ones are sound), and codes there are not
        for code in [c for c in ST_CODES if c != header[name]["dtype"]] + BAD_CODES:
            yield _edited(header, data, f"{name} dtype={code!r}", one, _set(name, "dtype", code))
    for a, b in [(names[i], names[j]) for i in range(len(names)) for j in range(i)]:
        def swap(h: dict[str, Any], a: str = a, b: str = b) -> None:
            h[a]["data_offsets"], h[b]["data_offsets"] = (h[b]["data_offsets"],
                                                          h[a]["data_offsets"])
        yield _edited(header, data, f"offsets of {a} and {b} swapped", {a, b}, swap)
    for meta in ([], {"k": 1}, {"k": ["v"]}, None, {"k": "v", "drift.dump": "{"}, "x"):
        yield _edited(header, data, f"metadata={meta!r}", set(),
                      lambda h, m=meta: h.__setitem__("__metadata__", m))
    # damage: the JSON text edited with its length kept right, then random bytes anywhere
    for i in range(60):
        t = bytearray(text)
        at = rng.randrange(len(t))
        op = i % 3
        if op == 0:
            del t[at]
        elif op == 1:
            t.insert(at, rng.choice(b'{}[]",:0123456789-. e\\'))
        else:
            t[at] = rng.randrange(256)
        yield Mutant(f"text {['delete', 'insert', 'replace'][op]} at {at}",
                     struct.pack("<Q", len(t)) + bytes(t) + data, ".safetensors")
    for i in range(240):
        b = bytearray(raw)
        where = 8 + n if i % 2 else len(b)  # half in the prefix and header, half anywhere
        spots = [rng.randrange(where) for _ in range(rng.randint(1, 4))]
        for at in spots:
            b[at] = rng.randrange(256)
        yield Mutant(f"damage {i} at {sorted(spots)}", bytes(b), ".safetensors")


# --- numpy and torch mutants ----------------------------------------------------------------


def _npy(shape: Any, data: bytes, descr: str = "<f4") -> bytes:
    head = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    head += " " * (-(len(head) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head.encode() + data


def numpy_mutants(rng: random.Random) -> Iterator[Mutant]:
    w = sound_tensors()["w"].numpy()
    fh = io.BytesIO()
    np.save(fh, w)
    raw = fh.getvalue()
    start = raw.index(b"\n") + 1
    for cut in sorted({*range(0, 12), *range(start - 3, start + 3), *range(start, len(raw), 7),
                       len(raw) - 1}):
        yield Mutant(f"npy cut at {cut}", raw[:cut], ".npy")
    for shape in [(3, 5), (4, 4), (12,), (3, 4, 1), (), (0,), (-1, 4), (1 << 40, 1 << 40),
                  (1 << 62, 4), (3.0, 4), (True, 4), "(3, 4)"]:
        yield Mutant(f"npy shape={shape!r}", _npy(shape, w.tobytes()), ".npy")
    for descr in ["<f8", ">f4", "|u1", "<c8", "<f2", "|b1", "O", "|V0", "<U1", "|S0", "<f16",
                  "xx", "<i8"]:
        yield Mutant(f"npy descr={descr!r}", _npy((3, 4), w.tobytes(), descr), ".npy")
    for i in range(40):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(start if i % 2 else len(b))] = rng.randrange(256)
        yield Mutant(f"npy damage {i}", bytes(b), ".npy")
    for compress in (False, True):
        fh = io.BytesIO()
        (np.savez_compressed if compress else np.savez)(
            fh, w=w, h=sound_tensors()["h"].numpy())
        raw = fh.getvalue()
        kind = "npz-deflated" if compress else "npz"
        for cut in sorted({*range(0, len(raw), max(1, len(raw) // 40)), len(raw) - 1,
                           len(raw) - 22}):
            yield Mutant(f"{kind} cut at {cut}", raw[:cut], ".npz")
        for i in range(40):
            b = bytearray(raw)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            yield Mutant(f"{kind} damage {i}", bytes(b), ".npz")
    for shape in [(3, 5), (1 << 40, 1 << 40), (-1, 4)]:  # a member whose header lies
        fh = io.BytesIO()
        with zipfile.ZipFile(fh, "w") as zf:
            zf.writestr("w.npy", _npy(shape, w.tobytes()))
            zf.writestr("h.npy", _npy((3, 4), w.tobytes()))
        yield Mutant(f"npz member shape={shape!r}", fh.getvalue(), ".npz")


def torch_mutants(rng: random.Random) -> Iterator[Mutant]:
    fh = io.BytesIO()
    torch.save(sound_tensors(), fh)
    raw = fh.getvalue()
    for cut in sorted({*range(0, len(raw), max(1, len(raw) // 30)), len(raw) - 1}):
        yield Mutant(f"pt cut at {cut}", raw[:cut], ".pt")
    for i in range(40):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        yield Mutant(f"pt damage {i}", bytes(b), ".pt")


# --- what the reference libraries make of a file --------------------------------------------


def library_reads(path: Path) -> dict[str, list[Any]] | None:
    """Every tensor the format's own library reads from ``path`` (dtype, shape, bytes), or
    None where it refuses the file."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), "pt") as f:
                got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        elif path.suffix == ".pt":
            got = torch.load(path, weights_only=True, map_location="cpu")
            if not isinstance(got, dict):
                return None
        else:
            if path.suffix == ".npy":
                # mapped: numpy then checks the size first, where a plain load would
                # allocate whatever the header claims (and warns of the overflow on a
                # huge one, which is no news here)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    arrays = {path.stem: np.load(path, allow_pickle=False, mmap_mode="r")}
            else:
                with open(path, "rb") as fh:  # numpy leaves its own open where it fails
                    arrays = dict(np.load(fh, allow_pickle=False).items())
            return {k: [a.dtype.str, list(a.shape), None] for k, a in arrays.items()}
    except Exception:  # any refusal, whatever the library raises
        return None
    return {k: [str(t.dtype).removeprefix("torch."), list(t.shape), digest(t)]
            for k, t in got.items() if isinstance(t, torch.Tensor)}


# --- the worker: drift on every mutant, under a memory limit ------------------------------


def _vm_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmSize:")[1].split()[0]) * 1024


def _drift(path: str) -> dict[str, Any]:
    from driftcli.io.readers import ReadError
    from driftcli.measures.scan import scan

    found = scan([path], [CAST])
    tensors: dict[str, list[Any]] = {}
    for ref in found.inputs[0].tensors:
        try:
            tensors[ref.name] = [ref.dtype, list(ref.shape), digest(ref.read())]
        except ReadError:  # a dtype torch has no element type for (F4, F6)
            tensors[ref.name] = [ref.dtype, list(ref.shape), None]
    return {"tensors": tensors,
            "errors": [[r.ref.name if r.ref else None, r.error] for r in found.errors],
            "measured": sorted({r.ref.name for r in found.results
                                if r.error is None and r.ref is not None})}


def _worker(manifest: str, warm: str) -> None:
    """Read every mutant listed in ``manifest``; one JSON line per mutant on stdout."""
    from driftcli.errors import DriftError

    _drift(warm)  # first calls set up torch's thread pool and caches: not the mutants' cost
    limit = _vm_bytes() + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"limit": limit, "base_rss_kb": base_rss}), flush=True)
    for i, path in enumerate(json.loads(Path(manifest).read_text())):
        print(json.dumps({"start": i}), flush=True)  # so a crash names its mutant
        t = time.perf_counter()
        try:
            out: dict[str, Any] = {"id": i, **_drift(path)}
        except DriftError as exc:  # scan refusing at once is an error for the file too
            out = {"id": i, "tensors": {}, "errors": [[None, str(exc)]], "measured": []}
        except BaseException as exc:  # a crash is what this test looks for
            out = {"id": i, "crash": f"{type(exc).__name__}: {exc}"[:300]}
        out["seconds"] = time.perf_counter() - t
        print(json.dumps(out), flush=True)
    print(json.dumps({"peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}),
          flush=True)


# --- the test -------------------------------------------------------------------------------


def comparable(tensors: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Listed tensors with the packed sub-byte ones as their code alone: torch holds F4 as
    two values a byte (``float4_e2m1fn_x2``, half the shape), drift as its code, unread."""
    packed = {"float4_e2m1fn_x2": "F4"}
    return {k: [packed.get(v[0], v[0]), None, None] if v[0] in SUB_BYTE or v[0] in packed
            else v for k, v in tensors.items()}


def outcome(result: dict[str, Any]) -> str:
    if result["errors"] and not result["tensors"]:
        return "file error"
    return "tensor error" if result["errors"] else "clean"


def test_damaged_files_are_errors_never_crashes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    started = time.perf_counter()
    sound = tmp_path / "sound.safetensors"
    save_file(sound_tensors(), sound, metadata={"format": "pt"})
    base = library_reads(sound)
    assert base is not None
    rng = random.Random(SEED)
    mutants, seen = [], {sound.read_bytes()}
    for m in [*safetensors_mutants(sound.read_bytes(), rng), *numpy_mutants(rng),
              *torch_mutants(rng)]:
        if m.data not in seen:  # one of each distinct file
            seen.add(m.data)
            mutants.append(m)
    paths = []
    for i, m in enumerate(mutants):
        paths.append(tmp_path / f"m{i:04d}{m.suffix}")
        paths[-1].write_bytes(m.data)
    (tmp_path / "manifest.json").write_text(json.dumps([str(p) for p in paths]))
    # the worker imports the driftcli this test runs against; every ResourceWarning is
    # shown: a file left open on some error path is a fault too
    env = {**os.environ, "PYTHONPATH": str(Path(driftcli.__file__).parents[1])}
    run = subprocess.run([sys.executable, "-W", "always::ResourceWarning", __file__,
                          str(tmp_path / "manifest.json"), str(sound)],
                         capture_output=True, text=True, timeout=600, check=False, env=env)
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    results = {r["id"]: r for r in lines if "id" in r}
    last = max((r["start"] for r in lines if "start" in r), default=None)
    assert run.returncode == 0 and len(results) == len(mutants), (
        f"worker exited {run.returncode} at mutant {last} "
        f"({mutants[last].label if last is not None else '-'}): {run.stderr[-3000:]}")
    assert run.stderr == "", run.stderr[-3000:]
    crashes = [f"{mutants[i].label}: {r['crash']}" for i, r in results.items() if "crash" in r]
    assert crashes == [], "\n".join(crashes)
    slow = [(mutants[i].label, r["seconds"]) for i, r in results.items()
            if r["seconds"] > CASE_SECONDS]
    assert slow == []

    wrong: list[str] = []
    counts: dict[str, Counter[str]] = {}
    for i, m in enumerate(mutants):
        got, want = results[i], library_reads(paths[i])
        kind = m.suffix.lstrip(".")
        counts.setdefault(kind, Counter())[outcome(got)] += 1
        counts[kind]["mutants"] += 1
        counts[kind]["refused by its library"] += want is None
        if want is None and outcome(got) == "clean":
            wrong.append(f"{m.label}: the library refuses it, drift measured it all")
        if m.untouched is not None:
            for name, entry in got["tensors"].items():
                if name in m.untouched and entry != base[name]:
                    wrong.append(f"{m.label}: drift lists {name} as {entry}, not {base[name]}")
        # (drift's own dump metadata is drift's to check: safetensors does not read it)
        errors = [e for _, e in got["errors"] if "drift dump metadata" not in e]
        if m.suffix == ".safetensors" and want is not None and (
                errors or comparable(got["tensors"]) != comparable(want)):
            wrong.append(f"{m.label}: safetensors reads {want}, drift {got}")
    assert wrong == [], "\n".join(wrong)

    meta = {k: v for line in lines for k, v in line.items()
            if k in ("limit", "base_rss_kb", "peak_rss_kb")}
    slowest = max(results.values(), key=lambda r: r["seconds"])
    summary = {kind: dict(c) for kind, c in counts.items()}
    print(f"\nfuzz: {json.dumps(summary)}; worker baseline RSS {meta['base_rss_kb'] // 1024} "
          f"MiB, peak {meta['peak_rss_kb'] // 1024} MiB, address-space limit "
          f"{meta['limit'] >> 20} MiB; slowest case {slowest['seconds']:.3f} s "
          f"({mutants[slowest['id']].label}); {time.perf_counter() - started:.1f} s in all")
    assert sum(c["mutants"] for c in counts.values()) == len(mutants) > 800
    # the mutants reach every outcome: none of the checks above held for want of cases
    st = counts["safetensors"]
    assert min(st["file error"], st["tensor error"], st["clean"]) >= 40
    assert st["refused by its library"] >= 900


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
