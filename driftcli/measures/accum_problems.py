"""The matmuls ``accum-error`` measures: seeded synthetic operands (:class:`Dist`), or the
forward, dgrad and wgrad matmuls of a drift dump, paired from the operands it recorded (for a
linear layer ``y = x·Wᵀ``: the forward ``A = x, B = Wᵀ``, the dgrad ``A = dY, B = W``, the wgrad
``A = dYᵀ, B = x``; for ``C = A·B``: ``A·B``, ``dC·Bᵀ`` and ``Aᵀ·dC``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

from driftcli.choices import Dist, parse_choice
from driftcli.errors import DriftError
from driftcli.io.readers import TensorRef, open_inputs

Tensor = torch.Tensor

SYNTHETIC = "synthetic"
"""The ``source`` of rows measured on generated operands."""
DEFAULT_SHAPE = (32, 32)
"""(M, N) of the synthetic matmuls when no shape is given."""
DEFAULT_KS = (64, 256, 1024)
"""The K values of the synthetic matmuls when no shape or K is given."""


def sample(dist: Dist, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """A float32 tensor of ``shape`` drawn from ``dist``."""
    if dist is Dist.UNIFORM:
        return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1).float()
    z = torch.randn(shape, generator=generator, dtype=torch.float64)
    if dist is Dist.NORMAL:
        return z.float()
    if dist is Dist.HALFNORMAL:
        return z.abs().float()
    if dist is Dist.TANH:
        return torch.tanh(2 * z).float()
    # LOGNORMAL: the sign from a second, independent draw
    sign = torch.randn(shape, generator=generator, dtype=torch.float64).sign()
    return (sign * torch.exp(z)).float()


@dataclass(frozen=True, eq=False)
class Problem:
    """One matmul to measure: its operands and what names it in the table."""

    source: str
    matmul: str
    a: Tensor | None
    """A (..., M, K); None with ``error``."""
    b: Tensor | None
    """B (..., K, N); None with ``error``."""
    dist: str | None = None
    layer: str | None = None
    role: str | None = None
    step: int | None = None
    error: str | None = None
    shape: tuple[int, int, int, int] = field(default=(1, 0, 0, 0))
    """(batch, M, K, N); filled from the operands when they are given."""

    @staticmethod
    def of(source: str, matmul_name: str, a: Tensor, b: Tensor, **names: Any) -> Problem:
        """A problem whose shape is read from its operands (checked to agree along K)."""
        if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
            return Problem(source, matmul_name, None, None, error=(
                f"operand shapes {list(a.shape)} and {list(b.shape)} do not make a matmul "
                "(..., M, K)·(..., K, N)"), **names)
        try:
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except RuntimeError:
            return Problem(source, matmul_name, None, None, error=(
                f"batch dimensions {list(a.shape[:-2])} and {list(b.shape[:-2])} do not "
                "broadcast"), **names)
        return Problem(source, matmul_name, a, b, shape=(
            math.prod(batch), a.shape[-2], a.shape[-1], b.shape[-1]), **names)


def parse_shape(text: str) -> tuple[int, int, int]:
    """``MxKxN`` (e.g. ``64x1024x64``) as ``(M, K, N)``."""
    parts = text.strip().lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise DriftError(f"shape {text!r}: write MxKxN with positive integers, e.g. 64x1024x64")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def synthetic_shapes(shapes: Sequence[tuple[int, int, int]] = (),
                     ks: Sequence[int] = ()) -> tuple[tuple[int, int, int], ...]:
    """The (M, K, N) to measure: ``shapes`` as given; with ``ks``, every (M, N) of ``shapes``
    (default :data:`DEFAULT_SHAPE`) with every K of ``ks``; with neither, every K of
    :data:`DEFAULT_KS` at :data:`DEFAULT_SHAPE`."""
    for k in ks:
        if k < 1:
            raise DriftError(f"K = {k}: give a positive contraction length, e.g. --k 1024")
    if not ks:
        return tuple(shapes) or tuple((DEFAULT_SHAPE[0], k, DEFAULT_SHAPE[1])
                                      for k in DEFAULT_KS)
    pairs = list(dict.fromkeys((m, n) for m, _, n in shapes)) or [DEFAULT_SHAPE]
    return tuple((m, k, n) for m, n in pairs for k in ks)


def synthetic_problems(shapes: Sequence[tuple[int, int, int]], dists: Sequence[Dist | str],
                       seed: int) -> Iterator[Problem]:
    """Seeded operands: for each distribution and shape a generator seeded with ``seed`` draws
    A (M×K), then B (K×N), so a row can be rebuilt from the seed alone."""
    for dist in (parse_choice(Dist, d, "distribution") for d in dists):
        for m, k, n in shapes:
            gen = torch.Generator().manual_seed(seed)
            a = sample(dist, (m, k), gen)
            b = sample(dist, (k, n), gen)
            yield Problem.of(SYNTHETIC, dist.value, a, b, dist=dist.value)


# --- dumps ----------------------------------------------------------------------------------

@dataclass
class _Site:
    """The tensors recorded at one matmul call of a dump."""

    layer: str
    step: int | None
    lhs: TensorRef | None = None
    rhs: TensorRef | None = None
    grads: list[TensorRef] = field(default_factory=list)


def _site_key(ref: TensorRef) -> tuple[str, str | None, str | None]:
    """(layer, call, index) of a dump name ``LAYER[#CALL][/INDEX]/LABEL`` (docs/capture.md)."""
    parts = ref.name.split("/")
    head, index = parts[0], (parts[1] if len(parts) > 2 else None)
    _, _, call = head.partition("#")
    return cast(str, ref.layer), call or None, index


def _site_name(key: tuple[str, str | None, str | None]) -> str:
    layer, call, index = key
    head = f"{layer}#{call}" if call else layer
    return f"{head}/{index}" if index is not None else head


def _read(ref: TensorRef) -> Tensor:
    return ref.read().to(torch.float32)


def _sites(refs: Sequence[TensorRef]) -> dict[tuple[str, str | None, str | None], _Site]:
    """Group a dump's tensors by the matmul call they belong to. A weight is recorded once per
    layer without a call index and joins every call of its layer at its matmul index; one that
    has a call index (different weights at one place, see docs/capture.md) joins that call."""
    sites: dict[tuple[str, str | None, str | None], _Site] = {}
    weights: dict[tuple[str, str | None, str | None], list[TensorRef]] = {}
    for ref in refs:
        if ref.role is None or ref.operand is None or ref.layer is None or not ref.is_float:
            continue
        key = _site_key(ref)
        if ref.role == "weight":
            weights.setdefault(key, []).append(ref)
            continue
        site = sites.setdefault(key, _Site(ref.layer, ref.step))
        tokens = ref.operand.split()
        if ref.role == "gradient":
            site.grads.append(ref)
        elif "forward.lhs" in tokens:
            site.lhs = ref
        elif "forward.rhs" in tokens:
            site.rhs = ref
    for key, site in sites.items():
        for w in [*weights.get(key, []), *weights.get((key[0], None, key[2]), [])]:
            tokens = cast(str, w.operand).split()
            if "forward.lhs" in tokens and site.lhs is None:
                site.lhs = w
            elif "forward.rhs" in tokens and site.rhs is None:
                site.rhs = w
    return sites


def _is_linear(site: _Site) -> bool:
    """F.linear (y = x·Wᵀ) feeds its lhs to wgrad as the rhs and its output gradient to wgrad
    as the lhs; a plain matmul the other way round (docs/capture.md)."""
    if site.lhs is not None:
        return "wgrad.rhs" in cast(str, site.lhs.operand).split()
    return bool(site.grads) and "wgrad.lhs" in cast(str, site.grads[0].operand).split()


def _site_problems(source: str, name: str, site: _Site) -> Iterator[Problem]:
    """The forward, dgrad and wgrad matmuls whose operands the site recorded."""
    names: dict[str, Any] = {"layer": site.layer, "step": site.step}
    try:
        x = _read(site.lhs) if site.lhs is not None else None
        w = _read(site.rhs) if site.rhs is not None else None
        grads = [_read(g) for g in site.grads]
    except DriftError as err:  # a corrupt or truncated tensor: this site only
        yield Problem(source, f"{name}/forward", None, None, role="forward", error=str(err),
                      **names)
        return
    linear = _is_linear(site)
    vectors = [t for t in (x, w, *grads) if t is not None and t.dim() < 2]
    if vectors and not linear:
        yield Problem(source, f"{name}/forward", None, None, role="forward", error=(
            f"an operand of shape {list(vectors[0].shape)} is a vector; accum-error measures "
            "matrix products only (leave this matmul out with --exclude)"), **names)
        return
    if linear:
        # y = x·Wᵀ with W (out, in): the leading dims of x and dY are one token axis
        x = None if x is None else x.reshape(-1, x.shape[-1])
        grads = [g.reshape(-1, g.shape[-1]) for g in grads]
    for i, dy in enumerate([None, *grads]):
        suffix = "" if len(grads) <= 1 or dy is None else f".{i - 1}"
        if dy is None:
            if x is None or w is None:
                continue
            pairs = [("forward", x, w.transpose(-1, -2) if linear else w)]
        else:
            pairs = []
            if w is not None:
                pairs.append(("dgrad", dy, w if linear else w.transpose(-1, -2)))
            if x is not None:
                pairs.append(("wgrad", dy.transpose(-1, -2), x) if linear
                             else ("wgrad", x.transpose(-1, -2), dy))
        for role, a, b in pairs:
            yield Problem.of(source, f"{name}/{role}{suffix}", a.contiguous(), b.contiguous(),
                             role=role, **names)


def checked(p: Problem) -> Problem:
    """Refuse operands holding inf or NaN: their exact product is undefined."""
    if p.a is None or p.b is None:
        return p
    bad = [f"{side} has {n} non-finite value(s)" for side, t in (("A", p.a), ("B", p.b))
           if (n := int((~torch.isfinite(t)).sum()))]
    if not bad:
        return p
    return replace(p, a=None, b=None, error="; ".join(bad) + ": the exact product is "
                   "undefined; clean the dump or leave the tensor out with --exclude")


def dump_problems(paths: Sequence[str | Path], include: Sequence[str] = (),
                  exclude: Sequence[str] = ()) -> Iterator[Problem]:
    """The matmuls recorded in drift dumps (written by :func:`driftcli.io.capture.capture`),
    in file order; a file or tensor that cannot be read becomes a problem with ``error``."""
    found = open_inputs(paths, include, exclude)
    for e in found.errors:
        yield Problem(e.source, e.tensor or "(unreadable file)", None, None, error=e.message)
    by_source: dict[str, list[TensorRef]] = {}
    for ref in found.tensors:
        by_source.setdefault(ref.source, []).append(ref)
    dumps = 0
    for source, refs in by_source.items():
        sites = _sites(refs)
        dumps += bool(sites)
        for key, site in sites.items():
            yield from _site_problems(source, _site_name(key), site)
    if not dumps and not found.errors:
        raise DriftError(
            f"no drift dump operands in {', '.join(str(p) for p in paths)}: accum-error reads "
            "dumps whose metadata names each tensor's matmul operand; write one with "
            "driftcli.io.capture.capture (see docs/capture.md), or measure synthetic operands "
            "with --shape/--dist")
