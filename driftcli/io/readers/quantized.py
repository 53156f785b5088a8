"""Pre-quantized checkpoints: finding the weights of a listing.

:func:`assemble` finds the quantized weights of a listing (the layout from ``config.json`` /
``hf_quant_config.json``, from ``--layout``, or recognised from the tensor names) and puts
one :class:`~driftcli.io.readers.core.TensorRef` per weight, under the weight's own name, in
place of its stored tensors. Each layout family (:mod:`~driftcli.io.readers.fp8_scaled`,
:mod:`~driftcli.io.readers.fp4_packed`) says which tensors a weight of its layouts claims and
builds its :class:`~driftcli.io.readers.quantized_weight.QuantSpec`; a new layout is a
family's entry there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from driftcli.errors import DriftError
from driftcli.io.readers.core import Problem, TensorRef, not_regular
from driftcli.io.readers.fp4_packed import FAMILY as FP4
from driftcli.io.readers.fp8_scaled import FAMILY as FP8
from driftcli.io.readers.quantized_weight import Config, Family, Layout, weight_ref

FAMILIES = (FP8, FP4)
"""Every layout family, in the order their claims are read."""


_QUANT_METHODS = {"fp8": Layout.DEEPSEEK_FP8, "mxfp4": Layout.GPT_OSS_MXFP4}
_CT_FORMATS = {"float-quantized": Layout.CT_FP8, "nvfp4-pack-quantized": Layout.CT_NVFP4,
               "naive-quantized": Layout.CT_FP8}


_MAX_CONFIG = 16 << 20
"""A config larger than this is not read (a real one is a few kilobytes)."""


def _json(path: Path) -> dict[str, Any] | None:
    try:
        # a FIFO or device (a config.json -> /dev/zero) would block or never end
        if not_regular(path) is not None or path.stat().st_size > _MAX_CONFIG:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_config(folder: Path) -> Config | None:
    """The quantization a checkpoint folder declares in ``config.json`` or
    ``hf_quant_config.json``; None where it declares none."""
    hf = _json(folder / "hf_quant_config.json")
    if hf is not None and isinstance(hf.get("quantization"), dict):
        algo = str(hf["quantization"].get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return Config(Layout.MODELOPT_NVFP4)
        if algo == "FP8":
            return Config(Layout.CT_FP8)
        return Config(None, error=f"{folder / 'hf_quant_config.json'}: quant_algo {algo!r} "
                                  "is not a layout drift reads (NVFP4, FP8); its tensors are "
                                  "read by their names, or give --layout")
    cfg = _json(folder / "config.json")
    q = cfg.get("quantization_config") if cfg is not None else None
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    block = q.get("weight_block_size")
    blk = (tuple(block) if isinstance(block, list) and len(block) == 2
           and all(isinstance(b, int) and b > 0 for b in block) else None)
    pow2 = q.get("scale_fmt") == "ue8m0"
    if method in _QUANT_METHODS:
        return Config(_QUANT_METHODS[method], blk, pow2)
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        for group in groups.values() if isinstance(groups, dict) else ():
            weights = group.get("weights") if isinstance(group, dict) else None
            shape = weights.get("block_structure") if isinstance(weights, dict) else None
            if isinstance(shape, list) and len(shape) == 2 and all(
                    isinstance(b, int) and b > 0 for b in shape):
                blk = (shape[0], shape[1])
        return Config(_CT_FORMATS.get(str(q.get("format"))), blk, pow2)
    if method == "modelopt":
        algo = str(q.get("quant_algo", "")).upper()
        return Config(Layout.MODELOPT_NVFP4 if algo == "NVFP4" else Layout.CT_FP8
                      if algo == "FP8" else None)
    return Config(None, error=f"{folder / 'config.json'}: quantization_config.quant_method "
                              f"{method!r} is not a layout drift reads (fp8, "
                              "compressed-tensors, modelopt, mxfp4); its tensors are read by "
                              f"their names, or give --layout ({', '.join(Layout)})")


_ACTIVATION_SCALES = re.compile(r"(^|\.)(input_scale|input_global_scale|k_scale|v_scale|"
                                r"weight_zero_point|output_scale)$")


def assemble(tensors: Sequence[TensorRef], unreadable: set[tuple[Path, str]],
             layout: Layout | str | None = None, configs: bool = True
             ) -> tuple[list[TensorRef], list[tuple[str, Problem]]]:
    """Put each quantized weight of ``tensors`` in place of its stored tensors.

    ``unreadable`` names (folder, tensor) the listing could not read (their problem is
    recorded already): a weight with one of them is left out, and its other tensors with it.
    ``layout`` overrides what the folders' configs say and what the names suggest; without
    ``configs`` no folder's config is read (tensors in memory have no folder).
    Returns the tensors in listing order (a weight where its codes were) and the problems
    (each with the file or folder it is about):
    a weight whose tensors do not fit together, an ambiguous or contradictory weight, an
    unknown ``quant_method``; the other weights are kept.
    """
    forced = None
    if layout is not None:
        try:
            forced = Layout(layout)
        except ValueError:
            raise DriftError(f"--layout {layout!r} is not a layout drift reads; use one of "
                             f"{', '.join(Layout)}") from None
    folders: dict[Path, list[TensorRef]] = {}
    for ref in tensors:
        folders.setdefault(Path(ref.source).parent, []).append(ref)
    replaced: dict[str, TensorRef | None] = {}  # "source\0name" -> its weight, or dropped
    problems: list[tuple[str, Problem]] = []
    for folder, refs in folders.items():
        config = read_config(folder) if configs else None
        if config is not None and config.error is not None:
            problems.append((str(folder), Problem(config.error)))
        found: list[Problem] = []
        _assemble_folder(refs, {n for f, n in unreadable if f == folder}, config, forced,
                         replaced, found)
        problems.extend((refs[0].source, p) for p in found)
    out: list[TensorRef] = []
    for ref in tensors:
        key = f"{ref.source}\0{ref.name}"
        if key not in replaced:
            out.append(ref)
        elif (weight := replaced[key]) is not None:
            out.append(weight)
    return out, problems


def _resolve(suggested: set[Layout], forced: Layout | None,
             declared: Layout | None) -> tuple[Layout | None, str]:
    """The layout of one weight, or None and why it is in doubt."""
    if forced is not None:
        return forced, ""
    if declared is not None:
        if declared in suggested:
            return declared, ""
        return None, (f"are {'/'.join(sorted(suggested))} but the checkpoint's config "
                      f"says {declared}")
    if len(suggested) == 1:
        return next(iter(suggested)), ""
    return None, f"fit more than one layout ({', '.join(sorted(suggested))})"


def _assemble_folder(refs: list[TensorRef], unreadable: set[str], config: Config | None,
                     forced: Layout | None, replaced: dict[str, TensorRef | None],
                     problems: list[Problem]) -> None:
    families = {lay: fam for fam in FAMILIES for lay in fam.layouts}
    by_name = {r.name: r for r in refs}
    stems: dict[str, set[Layout]] = {}
    for fam in dict.fromkeys(families.values()):
        for stem, lays in fam.claims(by_name, unreadable).items():
            stems.setdefault(stem, set()).update(lays)
    config = config or Config(None)
    quantized = bool(stems) or config.layout is not None
    source = refs[0].source

    def drop(names: Sequence[str]) -> None:
        for n in names:
            if n in by_name:
                replaced[f"{by_name[n].source}\0{n}"] = None

    for stem, suggested in sorted(stems.items()):
        parts = sorted({p for x in suggested | ({forced} if forced else set())
                        for p in families[x].parts(x, stem) if p in by_name or p in unreadable})
        lay, why = _resolve(suggested, forced, config.layout)
        if lay is None:
            problems.append(Problem(f"{source}: the tensors of weight {stem} "
                                    f"({', '.join(parts)}) {why}; give --layout "
                                    f"({', '.join(Layout)}) to say which", stem))
            drop(parts)
            continue
        fam = families[lay]
        if any(p in unreadable for p in fam.parts(lay, stem)):
            drop(parts)  # the unreadable tensor's own problem names it
            continue
        got = fam.build(lay, stem, by_name, config)
        if isinstance(got, str):
            problems.append(Problem(f"{source}: {got}", stem))
            drop(parts)
            continue
        drop(parts)
        replaced[f"{got.codes.source}\0{got.codes.name}"] = weight_ref(got)
    if quantized:  # activation scales and zero points are never weights
        drop([r.name for r in refs if _ACTIVATION_SCALES.search(r.name)])
        _orphans(refs, families, replaced, problems)


def _orphans(refs: list[TensorRef], families: dict[Layout, Family],
             replaced: dict[str, TensorRef | None], problems: list[Problem]) -> None:
    """In a quantized folder, the tensors no weight took that are a weight's part by name
    (a scale whose weight is not there) or FP8 codes without a scale: each is a problem and
    left out, since measuring a scale as a weight, or codes without their scale, is the
    silent garbage these readers exist to prevent."""
    suffixes = tuple(sorted({p for lay, fam in families.items() for p in fam.parts(lay, "")
                             if p}, key=len, reverse=True))
    for r in refs:
        key = f"{r.source}\0{r.name}"
        if key in replaced:
            continue
        part = next((x for x in suffixes if r.name.endswith(x)), None)
        if part is not None:
            why = (f"is a weight's {part.lstrip('_.')} part, but no weight "
                   f"{r.name.removesuffix(part)} is beside it to take it")
        elif r.dtype.startswith("float8"):
            why = ("holds FP8 codes with no scale beside it, and would be measured without "
                   "its scale")
        else:
            continue
        problems.append(Problem(f"{r.source}: tensor {r.name} {why}; drift measures weights, "
                                "never their parts: re-export the checkpoint, or --exclude it",
                                r.name))
        replaced[key] = None
