"""Transformer Engine and DeepSeek presets against numpy transcriptions of their kernels
(tests/recipe_refs.py: each kernel's op sequence in numpy float32, with its file, lines and
commit; nothing of drift's rounding or scale code), on boundary-built data and every weight of
stories260K. ``examples/gpu/compare_te.py`` compares with Transformer Engine itself where a GPU
is at hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from recipe_data import (
    differences,
    info_of,
    requires_stories,
    stories_weights,
    tensors,
)
from recipe_refs import REFERENCES

from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Granularity
from driftcli.records.recipes import DEEPSEEK, IMPLEMENTATION_PRESETS, TE

KERNEL_PRESETS = [n for n, p in IMPLEMENTATION_PRESETS.items()
                  if p.implementation in (TE, DEEPSEEK)]


def test_every_te_and_deepseek_preset_has_a_transcription() -> None:
    assert sorted(REFERENCES) == sorted(KERNEL_PRESETS)


def _leaves_out(name: str, x: torch.Tensor) -> torch.Tensor:
    """Inputs the transcriptions do not settle: a NaN under NVFP4 (what ``cvt.rn.satfinite``
    to E2M1 makes of NaN is not documented; drift gives NaN), and a NaN in a DeepGEMM ue8m0
    tile (``ceil_to_ue8m0`` turns the NaN scale into 2**127; drift keeps it NaN)."""
    if name.startswith("te/nvfp4") or name == "deepseek/v3_ue8m0_weight":
        return torch.where(torch.isnan(x), 0.0, x)
    return x


def compare(name: str, x: torch.Tensor) -> tuple[int, str]:
    """Elements compared and the first difference, between a preset and its transcription
    (dequantized bits everywhere; codes where the dequantized value is not NaN)."""
    with np.errstate(all="ignore"):  # inf and NaN arise as the kernels make them
        values, codes = REFERENCES[name](x.numpy())
    want_values, want_codes = (torch.from_numpy(np.ascontiguousarray(a))
                               for a in (values, codes))
    got = info_of(x, name)
    assert got.codes is not None
    bad = differences(got.values, want_values) | (
        differences(got.codes, want_codes) & ~torch.isnan(want_values))
    if not bad.any():
        return x.numel(), ""
    i = int(bad.flatten().nonzero()[0])
    return x.numel(), (
        f"{int(bad.sum())} of {x.numel()} differ; first at {i}: x = {float(x.flatten()[i])!r} "
        f"drift {float(got.values.flatten()[i])!r} (code {float(got.codes.flatten()[i])!r}), "
        f"transcription {float(want_values.flatten()[i])!r} "
        f"(code {float(want_codes.flatten()[i])!r})")


def _shaped(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` cut to dimensions that are multiples of the preset's tile (the transcriptions, as
    the kernels, need whole tiles)."""
    s = parse_cast(name).scaling
    k = s.block if s.granularity is Granularity.TILE else 1
    r, c = x.shape
    return x[r % k:, : c - c % k].contiguous() if k > 1 else x  # the special rows are last


@pytest.mark.parametrize("name", KERNEL_PRESETS)
def test_preset_equals_its_kernel_transcription_on_boundary_data(name: str) -> None:
    compared = apart = 0
    exact = IMPLEMENTATION_PRESETS[name].exact
    for x in tensors(name, seed=16):
        x = _leaves_out(name, _shaped(name, x))
        n, problem = compare(name, x)
        compared += n
        assert not problem, f"{name}: {problem}"
        apart += int(differences(info_of(x, name).values, info_of(x, exact).values).sum())
    print(f"\n{name}: {compared:,} synthetic elements compared with its transcription, "
          f"0 differences ({apart:,} differ from drift's exact {exact})")
    assert compared >= 1_000_000 and apart


@requires_stories
@pytest.mark.parametrize("name", KERNEL_PRESETS)
def test_preset_equals_its_kernel_transcription_on_every_stories260k_weight(name: str) -> None:
    """Every tensor, zero padded to whole groups (padding zeros change no amax)."""
    s = parse_cast(name).scaling
    k = s.block if s.granularity in (Granularity.BLOCK, Granularity.TILE) else 1
    compared = 0
    for key, w in stories_weights():
        x = w.float().reshape(1, -1) if w.dim() == 1 else w.float()
        rows = -x.shape[0] % k if s.granularity is Granularity.TILE else 0
        x = torch.nn.functional.pad(x, (0, -x.shape[1] % k, 0, rows))
        _, problem = compare(name, x)
        assert not problem, f"{name} on {key}: {problem}"
        compared += w.numel()
    print(f"\n{name}: {compared:,} stories260K elements compared with its transcription, "
          "0 differences")
    assert compared == 260_032


def test_the_gpu_comparison_script_names_what_it_needs_where_it_cannot_run() -> None:
    """examples/gpu/compare_te.py compares with Transformer Engine itself; without a GPU (or
    without Transformer Engine) it says which is missing and exits 2."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "gpu" / "compare_te.py"
    import os

    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as on a machine without a GPU
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          check=False, timeout=120, env=hidden)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: this comparison needs an NVIDIA GPU "
                                   "(torch.cuda.is_available() is False)")
