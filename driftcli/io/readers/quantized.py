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
from dataclasses import replace
from pathlib import Path
from typing import Any

from driftcli.errors import DriftError
from driftcli.io.layouts import Library
from driftcli.io.readers.core import Problem, TensorRef, not_regular
from driftcli.io.readers.fp4_packed import FAMILY as FP4
from driftcli.io.readers.fp8_scaled import FAMILY as FP8
from driftcli.io.readers.mx_packed import FAMILY as MX
from driftcli.io.readers.quantized_weight import Config, Family, Layout, weight_ref

FAMILIES = (FP8, FP4, MX)
"""Every layout family, in the order their claims are read."""


_CT_FORMATS = {"float-quantized": Layout.CT_FP8, "nvfp4-pack-quantized": Layout.CT_NVFP4,
               "naive-quantized": Layout.CT_FP8, "mxfp4-pack-quantized": Layout.CT_MXFP4,
               "mxfp8-quantized": Layout.MXFP8}
"""compressed-tensors ``format`` -> layout."""
_MODELOPT_ALGOS = {"NVFP4": Layout.MODELOPT_NVFP4, "NVFP4_AWQ": Layout.MODELOPT_NVFP4,
                   "W4A16_NVFP4": Layout.MODELOPT_NVFP4, "W4A8_NVFP4_FP8": Layout.MODELOPT_NVFP4,
                   "FP8": Layout.CT_FP8, "FP8_PER_CHANNEL_PER_TOKEN": Layout.CT_FP8,
                   "FP8_PB_WO": Layout.CT_FP8, "MXFP8": Layout.MXFP8, "MXFP4": Layout.MXFP4,
                   "W4A8_MXFP4_FP8": Layout.MXFP4, "MIXED_PRECISION": None}
"""ModelOpt ``quant_algo`` -> layout (None: each layer says, its tensors' names tell)."""
_QUARK_DTYPES = {"fp4": Layout.MXFP4, "fp6_e2m3": Layout.MXFP6_E2M3,
                 "fp6_e3m2": Layout.MXFP6_E3M2, "fp8_e4m3": Layout.CT_FP8}
"""amd-quark weight ``dtype`` -> layout (FP8 with ``scale_format: e8m0`` is MXFP8)."""
_QUANT_METHODS = ("fp8", "compressed-tensors", "modelopt", "mxfp4", "quark")


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


def _pair(x: object) -> tuple[int, int] | None:
    return ((x[0], x[1]) if isinstance(x, list) and len(x) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in x)
            else None)


def _group(x: object) -> tuple[int, int] | None:
    """A ``group_size`` as a 1 x g block."""
    return (1, x) if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


def _modelopt(algo: object, group: object, where: Path) -> Config:
    name = str(algo).upper()
    if name not in _MODELOPT_ALGOS:
        return Config(None, library=Library.MODELOPT, notice=(
            f"{where}: quant_algo {algo!r} is not one drift knows ("
            f"{', '.join(a for a in _MODELOPT_ALGOS)}); the weights it recognises by their "
            "names are read"))
    layout = _MODELOPT_ALGOS[name]
    g = _group(group)
    block = (g[1], g[1]) if g is not None and name == "FP8_PB_WO" else g
    return Config(layout, block, library=Library.MODELOPT)


def _quark(q: dict[str, Any], where: Path) -> Config:
    glob = q.get("global_quant_config")
    weight = glob.get("weight") if isinstance(glob, dict) else None
    if not isinstance(weight, dict):
        return Config(None, library=Library.QUARK)  # per-layer configs: the names tell
    dtype, e8m0 = weight.get("dtype"), weight.get("scale_format") == "e8m0"
    layout = _QUARK_DTYPES.get(str(dtype))
    if layout is Layout.CT_FP8 and e8m0:
        layout = Layout.MXFP8
    if layout is None or (layout is not Layout.CT_FP8 and not e8m0):
        return Config(None, library=Library.QUARK, notice=(
            f"{where}: amd-quark weight dtype {dtype!r} with scale_format "
            f"{weight.get('scale_format')!r} is not a layout drift knows; the weights it "
            "recognises by their names are read"))
    return Config(layout, _group(weight.get("group_size")), e8m0, library=Library.QUARK)


def read_config(folder: Path) -> Config | None:
    """The quantization a checkpoint folder declares in ``config.json`` or
    ``hf_quant_config.json``; None where it declares none. One drift does not know is a
    config with a notice and no layout: the weights are then read by their names."""
    hf = _json(folder / "hf_quant_config.json")
    if hf is not None and isinstance(hf.get("quantization"), dict):
        quant = hf["quantization"]
        return _modelopt(quant.get("quant_algo"), quant.get("group_size"),
                         folder / "hf_quant_config.json")
    where = folder / "config.json"
    cfg = _json(where)
    q = cfg.get("quantization_config") if cfg is not None else None
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    blk = _pair(q.get("weight_block_size"))
    pow2 = q.get("scale_fmt") == "ue8m0"
    if method == "fp8":
        given = q.get("weight_block_size")
        # JSON's true is Python's 1: [true, true] must not pass for 1 x 1 blocks
        bad = None if given is None or blk is not None else (
            f"{where}: weight_block_size {json.dumps(given)} is not two positive integers; "
            "fix config.json, or give --layout")
        return Config(Layout.DEEPSEEK_FP8, blk, pow2, block_error=bad)
    if method == "mxfp4":
        return Config(Layout.GPT_OSS_MXFP4, library=Library.TRANSFORMERS)
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        for group in groups.values() if isinstance(groups, dict) else ():
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict):
                blk = _pair(weights.get("block_structure")) or _group(
                    weights.get("group_size")) or blk
        fmt = q.get("format")
        if fmt not in _CT_FORMATS:
            return Config(None, blk, pow2, library=Library.COMPRESSED_TENSORS, notice=(
                f"{where}: compressed-tensors format {fmt!r} is not one drift knows "
                f"({', '.join(_CT_FORMATS)}); the weights it recognises by their names are "
                "read"))
        return Config(_CT_FORMATS[fmt], blk, pow2, library=Library.COMPRESSED_TENSORS)
    if method == "modelopt":
        return _modelopt(q.get("quant_algo"), q.get("group_size"), where)
    if method == "quark":
        return _quark(q, where)
    return Config(None, notice=(
        f"{where}: quantization_config.quant_method {method!r} is not one drift knows "
        f"({', '.join(_QUANT_METHODS)}); the weights it recognises by their names are read, "
        f"or give --layout ({', '.join(Layout)})"))


_ACTIVATION_SCALES = re.compile(r"(^|\.)(input_scale|input_global_scale|k_scale|v_scale|"
                                r"weight_zero_point|output_scale)$")


def assemble(tensors: Sequence[TensorRef], unreadable: set[tuple[Path, str]],
             layout: Layout | str | None = None, configs: bool = True
             ) -> tuple[list[TensorRef], list[tuple[str, Problem]], list[str]]:
    """Put each quantized weight of ``tensors`` in place of its stored tensors.

    ``unreadable`` names (folder, tensor) the listing could not read (their problem is
    recorded already): a weight with one of them is left out, and its other tensors with it.
    ``layout`` overrides what the folders' configs say and what the names suggest; without
    ``configs`` no folder's config is read (tensors in memory have no folder).
    Returns the tensors in listing order (a weight where its codes were), the problems
    (each with the file or folder it is about): a weight whose tensors do not fit together,
    an ambiguous or contradictory weight; the other weights are kept; and the notices: a
    config naming a quantization drift does not know (its weights are read by their names).
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
    notices: list[str] = []
    for folder, refs in folders.items():
        config = read_config(folder) if configs else None
        if config is not None and config.notice is not None:
            notices.append(config.notice)
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
    return out, problems, notices


def _resolve(suggested: set[Layout], forced: Layout | None, declared: Layout | None,
             family: dict[Layout, Family]) -> tuple[Layout | None, str]:
    """The layout of one weight, or None and why it is in doubt. A config naming a layout of
    the family the names suggest is taken (a ``quant_method: fp8`` config with 1 x 32 blocks
    holds what the names call MXFP8): the family's build checks the tensors against it."""
    if forced is not None:
        return forced, ""
    if declared is not None:
        if declared in suggested or all(family[x] is family[declared] for x in suggested):
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
        lay, why = _resolve(suggested, forced, config.layout, families)
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
        if config.library is not None:
            got = replace(got, library=config.library)
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
