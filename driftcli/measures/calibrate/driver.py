"""The table (:class:`CalibrateRow`) and the drivers: :func:`calibrate` (probes, then checks)
and :func:`calibrate_recordings` (one row per recordings folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from driftcli.io.tables import column
from driftcli.measures.calibrate.backends import FLOAT32, backend
from driftcli.measures.calibrate.checks import CHECK_K, check
from driftcli.measures.calibrate.design import PROBE_K
from driftcli.measures.calibrate.family import Model
from driftcli.measures.calibrate.inference import infer
from driftcli.measures.calibrate.recordings import (
    RECORDED_INPUTS,
    fit_recordings,
    read_folder,
    recording_folders,
)
from driftcli.progress import Progress
from driftcli.records.formats import FORMATS, get_format


@dataclass(frozen=True)
class CalibrateRow:
    """One line of a calibration: the probes (``kind`` = ``probes``), a check of the chosen
    model on random matmuls (``check``), or a recordings folder (``recordings``)."""

    TABLE: ClassVar[str] = "calibrate"
    KEYS: ClassVar[tuple[str, ...]] = ("backend", "kind", "k", "dist")
    HEADLINE: ClassVar[str] = "share"
    HIGHER_IS_WORSE: ClassVar[bool] = False

    backend: str = column("The backend (torch:cpu:bfloat16, drift:<spec>) or recordings folder "
                          "(GPU/FORMAT, with the result format)")
    kind: str = column("probes: the designed probes; check: random matmuls; recordings: "
                       "recorded dot products")
    k: int = column("Products per dot product (the probes' K for kind probes)")
    dist: str = column("Operand distribution of a check (normal, heavy, cancel); 'designed' "
                       "for probes, 'recorded' for recordings")
    outputs: int = column("Outputs compared")
    reproduced: int = column("Outputs the model gives bit for bit")
    share: float = column("reproduced / outputs")
    model: str = column("The inferred model as a matmul spec (the best one where none "
                        "reproduces every probe)")
    fits: bool = column("Whether the model gave every probe's (or recording's) bits")
    survivors: int = column("Models of the family that gave every probe's bits (0: none did)")
    alternatives: str = column("In what those models differ (e.g. 'kept_bits 25-44'): what the "
                               "probes cannot tell apart; empty for one")
    order: str = column("The model's order: blockfma, sequential, pairwise or chunked")
    fma_size: int | None = column("Products per group of a block-FMA model")
    kept_bits: int | None = column("Bits a term keeps below the group's largest exponent")
    interleave: int | None = column("A group's halves dealt k positions at a time (0: none)")
    accumulator: str = column("The format every group's (or addition's) result is rounded to")
    acc_rounding: str = column("rne or rtz")
    promote: int = column("Products between promotions into float32 (block-FMA) or the chunk "
                          "of chunked; 0 for none")
    c_mode: str | None = column("Recordings: how c was fed (recorded, rounded, zero)")
    seconds: float | None = column("Wall time of the inference or search (probes, recordings)")


def _row(name: str, kind: str, k: int, dist: str, outputs: int, reproduced: int, model: Model,
         spec: str, fits: bool, survivors: int, others: str = "", c_mode: str | None = None,
         seconds: float | None = None) -> CalibrateRow:
    unit = model.unit
    return CalibrateRow(
        backend=name, kind=kind, k=k, dist=dist, outputs=outputs, reproduced=reproduced,
        share=reproduced / outputs if outputs else 0.0, model=spec, fits=fits,
        survivors=survivors, alternatives=others, order=model.order.value,
        fma_size=None if unit is None else unit.size,
        kept_bits=None if unit is None else unit.kept_bits,
        interleave=None if unit is None else unit.interleave, accumulator=model.acc.name,
        acc_rounding=model.rounding.value, promote=model.chunk, c_mode=c_mode, seconds=seconds)


def calibrate(name: str, *, seed: int = 0, max_k: int = max(CHECK_K),
              progress: Progress | None = None) -> list[CalibrateRow]:
    """Infer the model of backend ``name`` from the probes, then check it on random matmuls
    (K of :data:`CHECK_K` up to ``max_k``): one ``probes`` row and one ``check`` row per K
    and distribution."""
    be = backend(name)
    if progress is not None:
        progress(0, 2, f"{name}: probes")
    inf = infer(be, seed=seed, max_k=max_k)
    if progress is not None:
        progress(1, 2, f"{name}: checks")
    spec = str(inf.model.spec(be.inputs, be.output))
    fits = inf.survivors > 0
    rows = [_row(name, "probes", PROBE_K, "designed", inf.probes,
                 round(inf.probe_share * inf.probes), inf.model, spec, fits, inf.survivors,
                 inf.alternatives, seconds=inf.seconds)]
    for c in check(be, inf.model, seed=seed, ks=[k for k in CHECK_K if k <= max_k]):
        rows.append(_row(name, "check", c.k, c.dist, c.outputs, c.reproduced, inf.model, spec,
                         fits, inf.survivors, inf.alternatives))
    if progress is not None:
        progress(2, 2, name)
    return rows


def calibrate_recordings(root: Path, *, progress: Progress | None = None) -> list[CalibrateRow]:
    """Search the family for each recordings folder under ``root`` and result format: one
    ``recordings`` row each."""
    rows = []
    folders = recording_folders(root)
    for i, folder in enumerate(folders):
        if progress is not None:
            progress(i, len(folders), str(folder))
        r = read_folder(folder)
        inputs = get_format(RECORDED_INPUTS.get(r.inputs, "float32"))
        for out in r.d:
            fit = fit_recordings(r, out)
            output = FLOAT32 if out == "fp32" else FORMATS["float16"]
            spec = str(fit.model.spec(inputs, output))
            rows.append(_row(f"{r.gpu}/{r.inputs} -> {out}", "recordings", r.a.shape[1],
                             "recorded", fit.recordings, round(fit.share * fit.recordings),
                             fit.model, spec, fit.survivors > 0, fit.survivors,
                             fit.alternatives, fit.c_mode, fit.seconds))
    return rows
