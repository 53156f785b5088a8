"""``te-dumps``: Transformer Engine's ``DumpTensors`` folders, whole. Each dump's
``high_precision`` tensor is cast with drift's preset of the recipe that made its ``quantized``
entry, and the codes and scales TE's kernel wrote are compared with drift's, element by element
and block by block, rowwise and columnwise: where a real GPU and drift's model of it disagree,
on the user's own data (docs/te-dumps.md).

The quantized entry is read by drift's own unpickler (``io/readers/te_dumps``): inert records,
no Transformer Engine installed, nothing of it run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch

from driftcli.casts.codec import decode, encode
from driftcli.casts.quantization import QuantInfo, quantize
from driftcli.errors import DriftError
from driftcli.io.readers.core import ReadError, not_regular
from driftcli.io.readers.te_dumps import (
    DumpName,
    QuantizedParts,
    Refused,
    TeClass,
    dump_name,
    load_dump,
    quantized_parts,
)
from driftcli.io.tables import column
from driftcli.progress import Progress
from driftcli.records.castspec import parse_cast

Tensor = torch.Tensor

TE_DUMPS_FILE = "te-dumps.parquet"


@dataclass(frozen=True)
class TeDumpRow:
    """One dump file in one direction: TE's quantized bytes against drift's preset."""

    TABLE: ClassVar[str] = "te-dumps"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "direction")
    HEADLINE: ClassVar[str] = "codes_differ"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    source: str = column("The dump file")
    step: int | None = column("The iteration (from iter_NNNNNN)")
    rank: int | None = column("The rank (from rank_R); null outside a rank folder")
    layer: str | None = column("The layer as TE named the file")
    tensor: str | None = column("TE's tensor name: activation, weight, gradient, output, wgrad "
                                "or dgrad")
    role: str | None = column("activation, weight or gradient")
    dtype: str | None = column("The high_precision tensor's dtype")
    shape: str | None = column("The high_precision tensor's shape as a JSON list")
    te_class: str | None = column("Float8Tensor, MXFP8Tensor or NVFP4Tensor (its storage class "
                                  "too); null with no quantized entry")
    direction: str = column("rowwise or columnwise (the quantized copy of the transpose, or "
                            "MXFP8's blocks down the columns); 'none' with no quantized entry")
    preset: str | None = column("drift's preset the bytes are compared with (te/...)")
    n_elements: int | None = column("Codes compared")
    n_codes_differ: int | None = column("Elements whose code (bits) TE and drift differ in")
    codes_differ: float | None = column("n_codes_differ / n_elements")
    n_blocks: int | None = column("Scales compared (blocks; 1 for a tensor scale)")
    n_scales_differ: int | None = column(
        "Blocks whose decoding scale differs (float32 bits: Float8's scale_inv, MXFP8's 2^(e-127), "
        "NVFP4's fl(fl(sb·amax)·fl(1/2688)) from TE's bytes against drift's)")
    scales_differ: float | None = column("n_scales_differ / n_blocks")
    amax_te: float | None = column("NVFP4: the (first) amax TE stored for this direction")
    amax_drift: float | None = column("NVFP4: the amax drift's cast read from high_precision")
    first_code_differ: str | None = column(
        "The first differing element: its index (row, column of the tensor) and both codes")
    first_scale_differ: str | None = column(
        "The first differing block: its index (row, block) and both scales")
    error: str | None = column("Why this dump or direction was not compared; null when it was")


@dataclass(frozen=True)
class _Side:
    """One direction's bytes, as 2-D (rows along which blocks run) tensors in TE's layout."""

    direction: str
    codes: Tensor
    """int64 codes, one an element, (rows, columns) of the cast tensor."""
    scales: Tensor | None
    """The raw scale tensor TE stored, padded (None: none stored)."""
    amax: Tensor | None
    preset: str


def _preset(parts: QuantizedParts, columnwise: bool) -> str:
    """drift's preset for the recipe that made ``parts`` (docs/te-dumps.md#presets)."""
    if parts.te_class is TeClass.FLOAT8:
        return "te/float8_current_e5m2" if parts.element == "float8_e5m2" else \
            "te/float8_current"
    if parts.te_class is TeClass.MXFP8:
        return "te/mxfp8"
    if parts.flag("with_2d_quantization") is True:
        return "te/nvfp4_2d_4over6" if parts.flag("_nvfp4_use_4over6") is True else \
            "te/nvfp4_2d"
    if columnwise and parts.flag("with_rht") is True:
        return "te/nvfp4_rht"
    row = "_row" if parts.flag("_row_scaled_nvfp4") is True and not columnwise else ""
    four = "_4over6" if parts.flag("_nvfp4_use_4over6") is True else ""
    if four and str(parts.flag("nvfp4_4over6_err_mode")).upper() == "MSE":
        four += "_mse"
    return f"te/nvfp4{row}{four}"


def _unpacked(data: Tensor, columns: int) -> Tensor:
    """FP4 codes two a byte, the first in the low nibble, as one int64 code each."""
    b = data.reshape(data.shape[0], -1).to(torch.int64)
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(b.shape[0], -1)[:, :columns]


def _sides(parts: QuantizedParts, rows: int, cols: int) -> list[_Side]:
    """Each direction TE stored, its codes shaped as the tensor it cast: rowwise (rows, cols);
    columnwise (cols, rows), the transpose, blocks along its rows."""
    sides = []
    for columnwise, data, scales, amax in (
            (False, parts.rowwise_data, parts.rowwise_scale_inv, parts.amax_rowwise),
            (True, parts.columnwise_data, parts.columnwise_scale_inv, parts.amax_columnwise)):
        if data is None:
            continue
        shape = (cols, rows) if columnwise else (rows, cols)
        raw = data.contiguous().view(torch.uint8)
        if parts.te_class is TeClass.NVFP4:
            codes = _unpacked(raw, shape[1])
        elif parts.te_class is TeClass.MXFP8 and columnwise:
            # MXFP8 keeps the columnwise copy in the tensor's layout, its blocks down columns
            codes = raw.reshape(rows, cols).to(torch.int64).T
        else:
            codes = raw.reshape(shape).to(torch.int64)
        sides.append(_Side("columnwise" if columnwise else "rowwise", codes, scales, amax,
                           _preset(parts, columnwise)))
    return sides


def _te_scales(parts: QuantizedParts, side: _Side, n_rows: int, n_blocks: int) -> Tensor:
    """TE's decoding scale of each block, float64, (rows, blocks) of the cast tensor."""
    s = side.scales
    if s is None:
        raise ReadError("no scale_inv stored")
    if parts.te_class is TeClass.FLOAT8:
        return s.reshape(-1)[:1].to(torch.float32).to(torch.float64).reshape(1, 1)
    raw = s.contiguous().view(torch.uint8)
    if parts.te_class is TeClass.MXFP8:
        if side.direction == "columnwise":  # (blocks down the columns, columns), padded
            grid = raw.reshape(-1, raw.shape[-1])[:n_blocks, :n_rows].T
        else:
            grid = raw.reshape(-1, raw.shape[-1])[:n_rows, :n_blocks]
        return decode(grid, "float8_e8m0fnu").to(torch.float64)
    sb = decode(raw.reshape(-1, raw.shape[-1])[:n_rows, :n_blocks], "float8_e4m3fn")
    if side.amax is None:
        raise ReadError("no amax stored beside the NVFP4 scales")
    amax = side.amax.to(torch.float32).reshape(-1)
    amax = amax[:n_rows].reshape(-1, 1) if amax.numel() > 1 else amax[:1].reshape(1, 1)
    # TE's dequantize kernel: fl(fl(sb · amax) · fl(1 / 2688)) in float32
    return ((sb * amax) * (1 / torch.tensor(2688.0))).to(torch.float64)


def _first(mask: Tensor, describe: Callable[[int, int], str]) -> str | None:
    where = mask.nonzero()
    return None if where.numel() == 0 else describe(int(where[0, 0]), int(where[0, 1]))


def _compare(x: Tensor, parts: QuantizedParts, side: _Side) -> dict[str, object]:
    """One direction's counts: codes element by element, decoding scales block by block."""
    cast = parse_cast(side.preset)
    info = quantize(x, cast, return_info=True)
    if not isinstance(info, QuantInfo) or info.codes is None:
        raise ReadError(f"{side.preset} gives no codes to compare")
    mine = encode(info.codes, parts.element)
    theirs = side.codes
    if theirs.shape != mine.shape:
        raise ReadError(f"TE's {side.direction} codes are {list(theirs.shape)}, the tensor "
                        f"cast is {list(mine.shape)}")
    differ = theirs != mine
    out: dict[str, object] = {
        "n_elements": mine.numel(), "n_codes_differ": int(differ.sum()),
        "first_code_differ": _first(differ, lambda r, c: (
            f"[{r}, {c}]: TE {int(theirs[r, c]):#04x}, drift {int(mine[r, c]):#04x}"))}
    rows = x.shape[0]
    per_row = 1 if parts.te_class is TeClass.FLOAT8 else x.shape[1] // cast.scaling.block
    if parts.te_class is TeClass.FLOAT8:
        drift_scales = info.scales.reshape(1, 1)
    elif cast.scaling.granularity.value == "tile":  # one scale a 16 x 16 tile, TE's per row
        tiles = info.scales.reshape(-1, per_row)
        drift_scales = tiles.repeat_interleave(cast.scaling.block, dim=0)[:rows]
    else:
        drift_scales = info.scales.reshape(rows, per_row)
    if parts.swizzled:
        out["error"] = ("the scales are in cuBLAS's GEMM-swizzled order: codes compared, "
                        "scales not (dump before the GEMM swizzles them)")
        return out
    te = _te_scales(parts, side, rows, per_row)
    if parts.te_class is TeClass.NVFP4:
        amax = x.abs().amax(dim=1) if side.preset.startswith("te/nvfp4_row") else x.abs().amax()
        out["amax_te"] = float(side.amax.reshape(-1)[0]) if side.amax is not None else None
        out["amax_drift"] = float(amax.reshape(-1)[0])
    bad = (te != drift_scales) & ~(te.isnan() & drift_scales.isnan())
    out.update({"n_blocks": drift_scales.numel(), "n_scales_differ": int(bad.sum()),
                "first_scale_differ": _first(bad, lambda r, b: (
                    f"[{r}, {b}]: TE {float(te[r, b])!r}, drift {float(drift_scales[r, b])!r}"))})
    return out


def compare_dump(path: Path, name: DumpName | None = None) -> list[TeDumpRow]:
    """One dump file's rows: one a direction TE stored, or one ``none`` row (no quantized
    entry, or an error naming why)."""
    name = name or dump_name(path)
    base: dict[str, object] = {
        "source": str(path), "step": name.step if name else None,
        "rank": name.rank if name else None, "layer": name.layer if name else None,
        "tensor": name.tensor if name else None, "role": name.role if name else None}
    empty: dict[str, object] = {**dict.fromkeys(f.name for f in fields(TeDumpRow)),
                                "direction": "none"}

    def row(**cols: object) -> TeDumpRow:
        return TeDumpRow(**{**empty, **base, **cols})  # type: ignore[arg-type]

    try:
        obj = load_dump(path)
    except ReadError as exc:
        return [row(error=str(exc))]
    hp = dict.get(obj, "high_precision")
    q = dict.get(obj, "quantized")
    if isinstance(hp, torch.Tensor):
        base.update(dtype=str(hp.dtype).removeprefix("torch."), shape=json.dumps(list(hp.shape)))
    if q is None:
        return [row(error=None if isinstance(hp, torch.Tensor) else
                    "no high_precision entry and no quantized entry")]
    if not isinstance(q, Refused):
        return [row(error=f"entry 'quantized' is a {type(q).__name__}, not a pickled Transformer "
                          "Engine tensor")]
    try:
        parts = quantized_parts(q, str(path))
    except ReadError as exc:
        return [row(error=str(exc).removeprefix(f"{path}: "))]
    base["te_class"] = parts.te_class.value
    if not isinstance(hp, torch.Tensor):
        return [row(error="no high_precision entry to cast (dump with high_precision_tensor: "
                          "True)")]
    cols = hp.shape[-1] if hp.dim() else 1
    x = hp.reshape(-1, cols)
    try:
        sides = _sides(parts, x.shape[0], cols)
    except RuntimeError as exc:  # bytes that do not fit the tensor's shape
        return [row(error=f"TE's codes do not fit the {list(hp.shape)} tensor ({exc})")]
    rows = []
    for side in sides:
        try:
            target = x if side.direction == "rowwise" else x.T.contiguous()
            got = _compare(target, parts, side)
        except (ReadError, DriftError, RuntimeError, ValueError) as exc:
            got = {"error": f"{side.direction}: {exc}"}
        n, d = got.get("n_elements"), got.get("n_codes_differ")
        nb, ds = got.get("n_blocks"), got.get("n_scales_differ")
        rows.append(row(direction=side.direction, preset=side.preset, **got,
                        codes_differ=d / n if isinstance(d, int) and isinstance(n, int) and n
                        else None,
                        scales_differ=ds / nb if isinstance(ds, int) and isinstance(nb, int) and nb
                        else None))
    return rows


def dump_files(paths: Sequence[Path]) -> list[tuple[Path, DumpName]]:
    """The DumpTensors files under ``paths`` (either layout), sorted; a :class:`ReadError`
    for a path that holds none or is not a regular file."""
    found: list[tuple[Path, DumpName]] = []
    for given in paths:
        files = sorted(Path(root) / n for root, _dirs, names in os.walk(given) for n in names) \
            if given.is_dir() else [given]
        mine = [(p, n) for p in files if (n := dump_name(p)) is not None]
        if not mine:
            raise ReadError(f"no Transformer Engine dump under {given} (files named "
                            "LAYER_TENSOR_iter_NNNNNN.pt, or LAYER_TENSOR.pt in iter_NNNNNN/); "
                            "point drift at the tensor_dumps folder")
        for p, _ in mine:
            why = not_regular(p)
            if why is not None:
                raise ReadError(why)
        found += mine
    return found


def te_dumps(paths: Sequence[Path], progress: Progress | None = None) -> list[TeDumpRow]:
    """Every dump under ``paths``: its rows (:func:`compare_dump`), file by file."""
    rows: list[TeDumpRow] = []
    found = dump_files(paths)
    for done, (path, name) in enumerate(found, 1):
        rows += compare_dump(path, name)
        if progress is not None:
            progress(done, len(found), path.name)
    return rows


def summary(rows: Sequence[TeDumpRow]) -> dict[str, object]:
    """Totals over the rows compared, and the rows that differ or failed."""
    done = [r for r in rows if r.n_elements is not None]
    return {
        "files": len({r.source for r in rows}), "compared": len(done),
        "n_elements": sum(r.n_elements or 0 for r in done),
        "n_codes_differ": sum(r.n_codes_differ or 0 for r in done),
        "n_blocks": sum(r.n_blocks or 0 for r in done),
        "n_scales_differ": sum(r.n_scales_differ or 0 for r in done),
        "differ": [{"source": r.source, "direction": r.direction, "preset": r.preset,
                    "n_codes_differ": r.n_codes_differ, "n_scales_differ": r.n_scales_differ,
                    "first_code_differ": r.first_code_differ,
                    "first_scale_differ": r.first_scale_differ}
                   for r in done if r.n_codes_differ or r.n_scales_differ],
        "errors": [{"source": r.source, "direction": r.direction, "error": r.error}
                   for r in rows if r.error is not None]}

