"""Data the implementation presets are checked on: boundary-built tensors and stories260K."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import driftcli as drift
from driftcli.casts.quantization import QuantInfo
from driftcli.casts.scaling import to_blocks
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import Format, Kind
from driftcli.records.modes import Granularity, ScaleRule

STORIES = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "stories260K-hf"
requires_stories = pytest.mark.skipif(
    not STORIES.is_dir(), reason="../shared/data/models/stories260K-hf not present (a fresh "
    "clone outside the workspace)")


def info_of(x: torch.Tensor, spec: object, **kw: object) -> QuantInfo:
    out = drift.quantize(x, spec, return_info=True, **kw)  # type: ignore[arg-type]
    assert isinstance(out, QuantInfo)
    return out


def block_of(name: str) -> int:
    """The block size of a cast with block granularity, else 1."""
    s = parse_cast(name).scaling
    return s.block if s.granularity is Granularity.BLOCK else 1


def differences(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where two float32 tensors differ in their bits (any NaN equals any NaN)."""
    g, w = got.float(), want.float()
    same = (g.view(torch.int32) == w.view(torch.int32)) | (torch.isnan(g) & torch.isnan(w))
    return ~same


def _ulps(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``x`` moved ``n`` float32 ulps away from zero (toward zero for negative ``n``)."""
    bits = x.view(torch.int32)
    moved = bits + torch.where(bits < 0, -n, n).to(torch.int32)
    return torch.where(x == 0, x, moved.view(torch.float32))


def _grid_and_midpoints(fmt: Format) -> torch.Tensor:
    values = sorted({float(v.value) for _, v in fmt.values() if v.kind is Kind.FINITE
                     and v.value >= 0})
    mids = [(a + b) / 2 for a, b in itertools.pairwise(values)]
    top = values[-1]
    return torch.tensor(values + mids + [top * 1.03, top * 1.1], dtype=torch.float64)


def _amax_candidates(fmt: Format, gen: torch.Generator, n: int) -> torch.Tensor:
    """Block or tensor amaxes: one ulp either side of powers of two and of M·2**k (k across
    the whole E8M0 range, so block scales reach their smallest codes), and log-uniform ones."""
    m = float(fmt.max)
    ks = torch.randint(-133, 120, (n,), generator=gen).double()
    base = torch.where(torch.rand(n, generator=gen) < 0.5, 1.0, m)
    near = (base * torch.exp2(ks)).float()
    near = torch.where(torch.isfinite(near) & (near > 0), near, torch.ones_like(near))
    steps = torch.randint(-2, 3, (n,), generator=gen)
    near = _ulps(near, steps)
    wide = torch.exp2(torch.rand(n, generator=gen) * 60 - 30).float()
    return torch.where(torch.rand(n, generator=gen) < 0.7, near, wide)


def boundary_rows(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows of ``cols`` (scale groups: each row its own blocks): the first element of each block
    sets its amax (see :func:`_amax_candidates`); the others sit on the element grid and its
    midpoints (ties) times the scale the preset gives that block, and 1 to 3 ulps either side,
    with both signs, never above the amax. Plus rows holding zeros, NaN, inf, and float32
    subnormals."""
    gen = torch.Generator().manual_seed(seed)
    c = parse_cast(name)
    k = block_of(name) if c.scaling.granularity is Granularity.BLOCK else cols
    n_blocks = rows * cols // k
    amax = _amax_candidates(c.format, gen, n_blocks)
    filler = (torch.rand(n_blocks, k, generator=gen) * amax[:, None]).float()
    filler[:, 0] = amax
    first = filler.reshape(rows, cols)
    scales = info_of(first, name).scales  # the preset's scale of each block (or row, tensor)
    grid = _grid_and_midpoints(c.format)
    pick = grid[torch.randint(0, len(grid), (n_blocks, k), generator=gen)].float()
    if c.scaling.granularity is Granularity.TILE:  # each element its tile's scale
        b, back = to_blocks(first, c.scaling, -1)
        x = pick * back(scales.float()[:, None].expand(b.shape).contiguous()).reshape(n_blocks, k)
    else:
        per_block = scales.float().reshape(-1)
        per_block = (per_block.repeat_interleave(n_blocks // per_block.numel())
                     if per_block.numel() < n_blocks else per_block[:n_blocks])
        x = pick * per_block[:, None]
    x = _ulps(x, torch.randint(-3, 4, (n_blocks, k), generator=gen))
    x = torch.where(x.abs() <= amax[:, None], x, filler)
    x = x * torch.where(torch.rand(n_blocks, k, generator=gen) < 0.5, -1.0, 1.0)
    x[:, 0] = amax * torch.where(torch.rand(n_blocks, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.where(torch.isfinite(x), x, filler).reshape(rows, cols)
    # special rows: zero, NaN, inf, -inf, subnormal
    specials = x[-5:]
    specials[0] = 0.0
    specials[1, 3] = math.nan
    specials[2, 1] = math.inf
    specials[3, 5] = -math.inf
    specials[4] = torch.rand(cols, generator=gen) * 2.0**-130
    return x


def tensors(name: str, seed: int) -> Iterator[torch.Tensor]:
    """The synthetic tensors of one preset: one large many-block tensor for block and channel
    scalings (and a special one per class), many smaller ones where the scale is the tensor's
    (tensorwise, and NVFP4's tensor scale)."""
    c = parse_cast(name)
    per_tensor = (c.scaling.granularity is Granularity.TENSOR
                  or c.scaling.rule is ScaleRule.TWO_LEVEL)
    if not per_tensor:
        yield boundary_rows(name, 4096, 256, seed)
        return
    gen = torch.Generator().manual_seed(seed)
    rows = 37 if c.scaling.granularity is Granularity.TILE else 32  # 32 left in whole tiles
    for i in range(160):
        x = boundary_rows(name, rows, 256, seed + 1 + i)
        if c.scaling.rule is ScaleRule.TWO_LEVEL:  # blocks far below the tensor's amax
            x[:8] *= torch.exp2(-torch.randint(0, 24, (8, 1), generator=gen).float())
        yield x[:-5] if i % 4 else x  # most tensors without the special rows (one NaN is all)
    yield torch.zeros(16, 64)
    yield torch.full((16, 64), -0.0)


def stories_weights() -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of stories260K, read in place from the shared folder."""
    from safetensors import safe_open

    with safe_open(STORIES / "model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield key, f.get_tensor(key)


