"""torchao's own safetensors layout: a state dict of torchao tensor subclasses flattened by
``torchao.prototype.safetensors.safetensors_support.flatten_tensor_state_dict`` and saved
with ``safetensors.save_file``.

Each subclass weight ``M.W`` is stored as its parts ``M._W_qdata``, ``M._W_scale``, ...
(``_tensor_data_names``; torchao's earlier releases name them ``M.W:qdata``, ``M.W:scale``
and a plain tensor ``M.b:_data``), and the file's ``__metadata__`` holds, under ``M.W``, the JSON
``{"_type": "MXTensor", "_data": {...}, "_tensor_data_names": [...]}`` and, under
``tensor_names``, every weight's name. Measured as plain tensors those parts are codes and
scale bytes, never the weight: drift recognises the layout from the metadata and refuses
each such weight in one line naming it and torchao's type (the parts are not listed); the
file's plain tensors (``_type: Tensor``) are read as usual. ``docs/inputs.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

from driftcli.io.readers.core import Problem

TENSOR_NAMES = "tensor_names"
"""The metadata key listing every tensor of the flattened state dict."""


def _entry(raw: str | None) -> dict[str, object] | None:
    try:
        data = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def torchao_parts(path: Path, meta: dict[str, str] | None,
                  names: set[str]) -> tuple[set[str], list[Problem]]:
    """The stored tensors of ``names`` that are parts of torchao subclass weights (to be left
    unlisted), and one problem per such weight; nothing for a file without torchao's
    metadata."""
    if not meta or TENSOR_NAMES not in meta:
        return set(), []
    try:
        weights = json.loads(meta[TENSOR_NAMES])
    except (ValueError, RecursionError):
        return set(), []
    if not isinstance(weights, list):
        return set(), []
    parts: set[str] = set()
    problems = []
    for weight in weights:
        entry = _entry(meta.get(weight)) if isinstance(weight, str) else None
        kind = entry.get("_type") if entry is not None else None
        if not isinstance(weight, str) or kind in (None, "Tensor"):
            continue
        # both namings torchao has written: "M._W_qdata" and, before, "M.W:qdata"
        prefixes = [f"{weight}:"]
        if "." in weight:
            module, leaf = weight.rsplit(".", 1)
            prefixes.append(f"{module}._{leaf}_")
        mine = sorted(n for n in names if n.startswith(tuple(prefixes)))
        parts.update(mine)
        data = entry.get("_data") if entry is not None else None
        swizzled = isinstance(data, dict) and data.get("is_swizzled_scales") is True
        problems.append(Problem(
            f"{path}: weight {weight} is a torchao {kind} flattened by torchao's "
            f"flatten_tensor_state_dict ({', '.join(mine) or 'no parts in this file'}"
            f"{', swizzled scales' if swizzled else ''}), a layout drift does not decode; "
            "save the weights dequantized (t.dequantize() for each torchao tensor, then "
            "safetensors save_file) to measure them, or --exclude it", weight))
    return parts, problems
