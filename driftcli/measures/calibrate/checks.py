"""The chosen model checked, never assumed: on seeded random matmuls of several K and three
distributions, the share of outputs it reproduces bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from driftcli.arith.matmul import matmul
from driftcli.measures.calibrate.backends import Backend
from driftcli.measures.calibrate.design import COLUMNS, exact_in
from driftcli.measures.calibrate.family import Model
from driftcli.measures.calibrate.probes import same_bits
from driftcli.records.formats import Format

CHECK_K = (16, 128, 1024, 8192)


CHECK_DISTS = ("normal", "heavy", "cancel")


CHECK_ROWS = 32


def check_operands(fmt: Format, k: int, dist: str, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Seeded operands of a check, exact in ``fmt``: ``normal``; ``heavy`` (a normal over a
    uniform's square root: rare large values); ``cancel`` (each product met by its negation
    times 1 + a few ulps, so sums cancel to a small remainder)."""
    def draw(rows: int, cols: int) -> Tensor:
        x = torch.randn(rows, cols, generator=gen)
        if dist == "heavy":
            x = x / torch.rand(rows, cols, generator=gen).clamp(min=1e-3).sqrt()
        return x

    a, b = draw(CHECK_ROWS, k), draw(k, COLUMNS)
    if dist == "cancel":
        half = k // 2
        a[:, half:2 * half] = -a[:, :half] * (1 + torch.randint(0, 4, (CHECK_ROWS, half),
                                                                generator=gen) * 2.0**-6)
        b[half:2 * half] = b[:half]
    return exact_in(fmt, a), exact_in(fmt, b)


@dataclass(frozen=True)
class Check:
    """One check: K, distribution, outputs compared and reproduced."""

    k: int
    dist: str
    outputs: int
    reproduced: int


def check(be: Backend, model: Model, *, seed: int = 0, ks: Sequence[int] = CHECK_K,
          dists: Sequence[str] = CHECK_DISTS) -> list[Check]:
    """The share of ``be``'s outputs ``model`` reproduces bit for bit, per K and distribution."""
    gen = torch.Generator().manual_seed(seed + 1)
    spec = model.spec(be.inputs, be.output)
    out = []
    for k in ks:
        for dist in dists:
            a, b = check_operands(be.inputs, k, dist, gen)
            same = same_bits(matmul(a, b, spec).double(), be.multiply(a, b))
            out.append(Check(k, dist, same.numel(), int(same.sum())))
    return out
