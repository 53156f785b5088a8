"""The family fitted to recorded dot products (one instruction each, with its ``c``): the
search also tries how the recording harness fed ``c``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

from driftcli.arith.blockfma import (
    Accumulation,
    FMAUnit,
    prepare,
)
from driftcli.arith.tensorcores import Recordings, read_recordings
from driftcli.casts.rounding import round_to_format
from driftcli.measures.calibrate.backends import FLOAT32, CalibrateError
from driftcli.measures.calibrate.family import Model, blockfma_models
from driftcli.measures.calibrate.inference import BEST_STRIDE, alternatives, search
from driftcli.measures.calibrate.probes import output_cast, same_bits
from driftcli.records.formats import FORMATS, Format, get_format
from driftcli.records.modes import Rounding

RECORDED_INPUTS = {"fp16": "float16", "bf16": "bfloat16", "tf32": "e8m10",
                   "E4M3": "float8_e4m3fn", "E5M2": "float8_e5m2"}
"""The input format of each recordings folder name."""


C_MODES = ("recorded", "rounded", "zero")
"""How the recording harness fed ``c``: as recorded, rounded to the result format, or 0."""


@dataclass(frozen=True)
class Fit:
    """Models that reproduce recordings: the simplest, how many (and in what they differ),
    and the share reached."""

    model: Model
    c_mode: str
    survivors: int
    share: float
    recordings: int
    seconds: float
    alternatives: str = ""


def _c_for(r: Recordings, output: Format, mode: str) -> Tensor:
    if mode == "zero":
        return torch.zeros_like(r.c)
    if mode == "rounded":
        return round_to_format(r.c, output, rounding=Rounding.RNE).double()
    return r.c


def fit_recordings(r: Recordings, out: str, *, screen: int = 200) -> Fit:
    """Search the block-FMA family for the models that reproduce every recording of ``r``
    with the result format ``out`` (``fp32`` or ``fp16``)."""
    start = time.perf_counter()
    if r.inputs not in RECORDED_INPUTS:
        raise CalibrateError(f"recordings {r.gpu}/{r.inputs}: unknown input format folder; "
                             f"name it one of {', '.join(RECORDED_INPUTS)}")
    inputs = get_format(RECORDED_INPUTS[r.inputs])
    output = FLOAT32 if out == "fp32" else FORMATS["float16"]
    k = r.a.shape[1]
    want = r.d[out]
    sub = torch.arange(min(screen, want.shape[0]))
    models = [m for m in blockfma_models(1)
              if m.unit is not None and m.unit.size <= max(k, 1)]
    found: list[tuple[Model, str]] = []
    for mode in C_MODES:
        c = _c_for(r, output, mode)
        prep = prepare(r.a, r.b, inputs.emin, inputs.emin, c=c)
        found += [(m, mode) for m in search(models, prep, want,
                                            None if output == FLOAT32 else output)]
    best: tuple[float, Model, str] = (-1.0, models[0], C_MODES[0])
    if not found:  # the share of the best: a sample of the family on a screen, then its best
        for mode in C_MODES:
            c = _c_for(r, output, mode)
            part = prepare(r.a[sub], r.b[sub], inputs.emin, inputs.emin, c=c[sub])
            for model in models[::BEST_STRIDE]:
                how = Accumulation(cast(FMAUnit, model.unit), model.acc, model.rounding,
                                   inputs.emin, inputs.emin)
                share = float(same_bits(output_cast(part.run(how), output),
                                        want[sub]).double().mean())
                if share > best[0]:
                    best = (share, model, mode)
        share_all = _recorded_share(r, best[1], best[2], inputs, output, want)
        best = (share_all, best[1], best[2])
    survivors_ = found
    n = int(want.shape[0])
    if survivors_:
        # one recorded instruction: a group as long as it, with the result's own format,
        # is the reading to prefer where the recordings cannot tell models apart
        model, mode = min(survivors_, key=lambda s: (
            s[0].acc != output, -cast(FMAUnit, s[0].unit).size, s[0].simplicity(),
            C_MODES.index(s[1])))
        return Fit(model, mode, len(survivors_), 1.0, n, time.perf_counter() - start,
                   alternatives([m for m, _ in survivors_], [c for _, c in survivors_]))
    return Fit(best[1], best[2], 0, best[0], n, time.perf_counter() - start)


def _recorded_share(r: Recordings, model: Model, mode: str, inputs: Format, output: Format,
                    want: Tensor) -> float:
    c = _c_for(r, output, mode)
    how = Accumulation(cast(FMAUnit, model.unit), model.acc, model.rounding, inputs.emin,
                       inputs.emin)
    got = output_cast(prepare(r.a, r.b, inputs.emin, inputs.emin, c=c).run(how), output)
    return float(same_bits(got, want).double().mean())


def recording_folders(root: Path) -> list[Path]:
    """``root`` itself when it holds recordings (``a_*`` files), else its ``GPU/FORMAT``
    folders that do."""
    def holds(p: Path) -> bool:
        return p.is_dir() and any(p.glob("a_*.txt*"))

    if holds(root):
        return [root]
    found = sorted(f for g in root.iterdir() if g.is_dir() for f in g.iterdir() if holds(f))
    if not found:
        raise CalibrateError(f"no recordings in {root}: expected GPU/FORMAT folders holding "
                             "a_GPU_FORMAT.txt.gz, b_..., c_GPU_fp32.txt.gz and d_... files")
    return found


def read_folder(folder: Path) -> Recordings:
    """The recordings of one folder, with a clear error."""
    return read_recordings(folder)
