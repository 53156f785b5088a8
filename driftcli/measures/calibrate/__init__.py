"""``calibrate``: infer how a matmul backend accumulates, from designed probes, and check it.

A backend is anything that multiplies matrices: ``torch:cpu:bfloat16``, ``torch:cuda:…`` on a
GPU (FP8 through ``torch._scaled_mm`` with unit scales), or ``drift:<matmul spec>``, a
simulated one. The family of models is drift's own matmul specs over the backend's input
format and output format:

- ``blockfma``: a tensor core's block-FMA unit (group size 1-64, interleave 0, 1 or 2, 4-48
  kept bits, a group's result rounded to nearest or toward zero into ``e8mM`` or float16,
  promotion into float32 every P products or none);
- ``sequential``, ``pairwise`` and ``chunked:N``: one rounding per addition in float32,
  bfloat16 or float16, rounded to nearest or toward zero (a CPU's FMA chains; N any multiple of
  32 up to 512 or a power of two, a BLAS's K blocking).

The probes follow the published method (Fasi, Higham, Mikaitis and Pranesh, PeerJ CS 2021;
Khattak and Mikaitis, IEEE HPEC 2025): rows built from powers of two, each multiplied by
sixteen columns, whose results expose one feature at a time: where a group ends (a large
term, its negation and a tiny one: the tiny one is lost inside the large ones' group and kept
outside it), which positions share a half of an interleaved group, how many bits past the
largest exponent survive (``1 - 1 + 2**-j``), the accumulator's precision and rounding
(``1 + 2**-j``, ``1 + 3·2**-(j+1)``, their negatives), carries into a higher binade, and
seeded random rows. The backend computes them once; every model of the family computes them
too, and a model survives only if it gives every probe's bits. Long probes (K to 8,192: a
large first term, then small ones) then decide the promotion interval.

The survivor (the simplest where several give the same bits: no interleave, no promotion,
fewest kept bits, a named accumulator) is then checked, never assumed: on seeded random
matmuls of several K and three distributions (normal, heavy-tailed, cancelling), the share of
outputs it reproduces bit for bit. Where no model survives, the best one's share of the probes
is reported, and its checks say by how much it misses.

``calibrate_recordings`` does the same from recorded dot products (the folder layout of
docs/tensor-cores.md#against-real-hardware): one instruction each, with its ``c``, so the
search also tries the harness's handling of ``c`` (as recorded, rounded to the result format, or 0).

The package, one module per part, in the order the driver runs them: :mod:`.backends` (what
is multiplied), :mod:`.family` (the models), :mod:`.design` (the probes' rows and columns),
:mod:`.probes` (a backend's and a model's results compared), :mod:`.inference` (the search),
:mod:`.checks`, :mod:`.recordings` (the fit to recorded dot products) and :mod:`.driver`
(the table and :func:`calibrate`).
"""

from __future__ import annotations

from driftcli.measures.calibrate.backends import (
    FLOAT32,
    Backend,
    CalibrateError,
    backend,
    matmul_spec_of,
)
from driftcli.measures.calibrate.checks import (
    CHECK_DISTS,
    CHECK_K,
    CHECK_ROWS,
    Check,
    check,
    check_operands,
)
from driftcli.measures.calibrate.design import (
    COLUMNS,
    LONG_K,
    PROBE_K,
    RANDOM_ROWS,
    long_rows,
    probe_columns,
    probe_rows,
    tiny_rows,
)
from driftcli.measures.calibrate.driver import CalibrateRow, calibrate, calibrate_recordings
from driftcli.measures.calibrate.family import (
    ACC_BITS,
    CLASSIC_ACCS,
    INTERLEAVES,
    KEPT,
    ROUNDINGS,
    SIZES,
    Model,
    acc_format,
    blockfma_models,
    classic_models,
)
from driftcli.measures.calibrate.inference import (
    BEST_STRIDE,
    MIN_EXPS,
    Inference,
    alternatives,
    infer,
    search,
)
from driftcli.measures.calibrate.probes import Observed, model_results, output_cast, same_bits
from driftcli.measures.calibrate.recordings import (
    C_MODES,
    RECORDED_INPUTS,
    Fit,
    fit_recordings,
    read_folder,
    recording_folders,
)
from driftcli.records.formats import FORMATS

__all__ = [
    "ACC_BITS", "BEST_STRIDE", "CHECK_DISTS", "CHECK_K", "CHECK_ROWS", "CLASSIC_ACCS",
    "COLUMNS", "C_MODES", "FLOAT32", "FORMATS", "INTERLEAVES", "KEPT", "LONG_K", "MIN_EXPS",
    "PROBE_K", "RANDOM_ROWS", "RECORDED_INPUTS", "ROUNDINGS", "SIZES", "Backend",
    "CalibrateError", "CalibrateRow", "Check", "Fit", "Inference", "Model", "Observed",
    "acc_format", "alternatives", "backend", "blockfma_models", "calibrate",
    "calibrate_recordings", "check", "check_operands", "classic_models", "fit_recordings",
    "infer", "long_rows", "matmul_spec_of", "model_results", "output_cast", "probe_columns",
    "probe_rows", "read_folder", "recording_folders", "same_bits", "search", "tiny_rows",
]
