"""What a cast did to a tensor, counted: :class:`CastStats` and :func:`cast_stats`, the numbers
every measurement (clip-rate, underflow-rate, error-bias) and a training run's operand rates
derive from.

Two back-ends count (:mod:`driftcli.kernels` chooses): the torch back-end casts with
:func:`driftcli.casts.quantization.cast_blocks` and counts from the per-element masks, as the
definitions read; the numba back-end (:func:`_numba_stats`) reads each scale group's amax from
one shared pass over the slice, computes the groups' scales, then casts and counts every element
in one more pass, with the same rounding kernel as :func:`driftcli.quantize`. Both give the same
counts, bit for bit; their float64 sums are added in different orders, and agree to the last
few bits (the tests compare them at a relative 1e-12).

The scan has one more numba path, :func:`fused_stats`: one read of a slice for every cast
whose route :func:`driftcli.casts.route.flat_route` gives (a tensor scale, MX power-of-two
rules, NVFP4's two-level scales, blocks along the last axis), each block's scale and clips
counted from the runs' amaxes read once and, for underflow-rate and error-bias, each piece of
4,096 elements rounded once per cast and counted in the same pass
(:func:`driftcli.kernels.jit.clip_counts`); the same counts as :func:`cast_stats`, bit for bit,
and float64 sums made per piece in the machine code's vector lanes and the pieces' partials added
exactly (:attr:`CastStats.partials`; :meth:`CastStats.merge` adds slices' exactly too): the same
bits for any thread count and, for slices starting on multiples of :data:`SUM_PIECE`, for any
slicing (:func:`clip_stats` is the pass without the rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from driftcli import kernels
from driftcli.casts import rounding
from driftcli.casts.given import given_counts, given_route, rht_groups, without_rht
from driftcli.casts.hadamard import transform
from driftcli.casts.quantization import (
    amax_and_nonfinite,
    cast_blocks,
    checked_bits,
    element_masks,
    fused_block_cast_applies,
    needs_wide,
    plan_scales,
    pow2_rule,
    tensor_amax_of,
    two_level_consts,
    working,
)
from driftcli.casts.route import flat_route, one_scale
from driftcli.casts.scaling import ScalePlan, block_stats, to_blocks
from driftcli.errors import DriftError
from driftcli.kernels import jit
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import DEFAULT_SR_BITS, Granularity, Rounding, ScaleRule

Tensor = torch.Tensor


def _flat(x: Tensor) -> Tensor:
    return working(x).reshape(-1)


_ROUNDED = ("nonzero", "underflowed", "subnormal", "lost", "xx", "ee", "ex", "e_sum")
"""The :class:`CastStats` fields that need the rounded values (``None`` without them), in
the order :func:`_numba_stats` reads them."""


def error_terms(x: Tensor, q: Tensor, finite: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """``(valid, e, xv)`` of a cast ``q`` of ``x``, in float64: ``valid`` where both are finite
    (``finite``: ``x``'s mask, when already known), ``e = q - x`` and ``xv = x`` there, 0
    elsewhere. Every error sum of the torch back-end (of a cast, of an expected cast) is made
    of these terms, in this one way, so that they agree bit for bit."""
    xd, qd = x.double(), q.double()
    valid = (torch.isfinite(xd) if finite is None else finite) & torch.isfinite(qd)
    return valid, torch.where(valid, qd - xd, 0.0), torch.where(valid, xd, 0.0)


def error_sums(e: Tensor, xv: Tensor) -> list[Tensor]:
    """Σx², Σe², Σe·x, Σe of :func:`error_terms` (the ``xx ee ex e_sum`` of CastStats), the
    same bits for any thread count: torch splits a CPU sum across its threads, and a float64
    sum's last bits follow the split, so on the CPU numpy's pairwise sum (one thread) adds."""
    terms = [xv * xv, e * e, e * xv, e]
    if e.device.type != "cpu":
        return [t.sum() for t in terms]
    return [torch.tensor(t.contiguous().numpy().sum(), dtype=torch.float64) for t in terms]


def _abs_sum(x: Tensor) -> Tensor:
    """Σ|x| in float64: NaN or inf when ``x`` holds one (then :func:`slice_facts` masks)."""
    return x.abs().double().sum()


@dataclass(frozen=True)
class CastStats:
    """Exact counts and float64 sums of one cast over a tensor or one slice of it.

    ``x`` is the input, ``q`` its cast, ``s`` the scale of each element's group, ``M``
    the element format's largest finite value, ``e = q - x``. Slices of one tensor add
    with :meth:`merge`. The fields that need ``q`` are ``None`` when the counting skipped
    the rounding (``cast_stats(..., rounded=False)``).
    """

    numel: int
    """Elements of the input."""
    nonfinite: int
    """Input elements that are NaN or ±inf."""
    nonzero: int | None
    """Finite, nonzero input elements."""
    groups: int
    """Scale groups: blocks, tiles, channels; 1 for a tensor scale or no scaling."""
    clipped: int
    """Finite elements with |x / s| > M."""
    clipped_by_rounding: int
    """Of ``clipped``, those whose exact quotient by the rule's real scale ``amax / M`` is at
    most M: every clip of a rule that covers amax (see ``ScaleRule.covers_amax``), none of
    ``floor``'s and ``even``'s."""
    clipped_groups: int
    """Scale groups holding at least one clipped element."""
    clip_excess: float
    """Σ over clipped elements of |x| - M·s."""
    abs_sum: float
    """Σ |x| over finite elements."""
    underflowed: int | None
    """x finite and nonzero, q zero."""
    subnormal: int | None
    """q finite and nonzero with |q / s| below the element format's smallest normal."""
    scale_clamped: int
    """Scale groups whose scale fell outside the scale format and was clamped."""
    nonfinite_groups: int
    """Scale groups holding a NaN or inf (block scalings make the whole group NaN)."""
    lost: int | None
    """Finite elements whose cast is not finite (a NaN block, or overflow under ``ieee``)."""
    xx: float | None
    """Σ x² over elements where x and q are finite."""
    ee: float | None
    """Σ e² over the same elements."""
    ex: float | None
    """Σ e·x over the same elements."""
    e_sum: float | None
    """Σ e over the same elements."""

    @property
    def partials(self) -> dict[str, tuple[float, ...]] | None:
        """Where a float64 sum of :data:`EXACT_SUMS` is known exactly (the fused pass's: the
        exact sum of its pieces' partials), that sum as non-overlapping float64 partials (the
        field is ``math.fsum`` of them, the correctly rounded sum) by field name; None, or a field
        left out, where only the float is known. :meth:`merge` adds them exactly. Not a field:
        two slicings give the same sums in different partials, and a copy with other sums
        (``dataclasses.replace``) must not keep them; set by :meth:`exactly` only."""
        got: dict[str, tuple[float, ...]] | None = self.__dict__.get("_partials")
        return got

    def exactly(self, partials: dict[str, tuple[float, ...]]) -> CastStats:
        """These stats, their sums known exactly as ``partials`` (see :attr:`partials`);
        called on stats just made."""
        object.__setattr__(self, "_partials", partials)
        return self

    def problem(self, numel: int) -> str | None:
        """Why these counts cannot be a cast of a tensor of ``numel`` elements (a kept unit
        read back under ``--resume``, see :mod:`driftcli.engines`), or None: every count
        within what it counts (clips among the finite elements, clipped groups among the
        groups, ...) and every sum of magnitudes or squares a non-negative number."""
        finite = self.numel - self.nonfinite
        groups = self.groups
        bounds = (("numel", self.numel, numel, numel), ("nonfinite", self.nonfinite, 0, numel),
                  ("groups", groups, 0, max(numel, 1)), ("clipped", self.clipped, 0, finite),
                  ("clipped_by_rounding", self.clipped_by_rounding, 0, self.clipped),
                  ("clipped_groups", self.clipped_groups, 0, groups),
                  ("scale_clamped", self.scale_clamped, 0, groups),
                  ("nonfinite_groups", self.nonfinite_groups, 0, groups),
                  ("nonzero", self.nonzero, 0, finite), ("subnormal", self.subnormal, 0, finite),
                  ("underflowed", self.underflowed, 0, finite), ("lost", self.lost, 0, finite))
        for name, value, low, high in bounds:
            if value is not None and not low <= value <= high:
                return f"{name} {value} outside {low}..{high} for {numel} elements"
        for name in ("clip_excess", "abs_sum", "xx", "ee", "ex", "e_sum"):
            value = getattr(self, name)
            if value is not None and (math.isnan(value)
                                      or (name not in ("ex", "e_sum") and value < 0)):
                return f"{name} {value}"
        return None

    @staticmethod
    def merge(parts: list[CastStats], per_tensor: bool) -> CastStats:
        """The stats of a whole tensor from those of its slices; ``per_tensor`` when the
        cast has one scale for the whole tensor (each slice then counted that one group).
        A field is ``None`` when any slice's is. The float64 sums are added exactly (each
        slice's :attr:`partials` where it has them, else its float) and rounded once: the
        same bits in any order and grouping of the slices."""
        if not parts:
            zeros: dict[str, Any] = dict.fromkeys(_COUNT_FIELDS + EXACT_SUMS, 0)
            return CastStats(**zeros)
        total: dict[str, Any] = {f: _total([getattr(p, f) for p in parts])
                                 for f in _COUNT_FIELDS}
        exact = {f: e for f in EXACT_SUMS if (e := exact_sum(parts, f)) is not None}
        total |= {f: math.fsum(exact[f]) if f in exact else None for f in EXACT_SUMS}
        if per_tensor:
            for f in ("groups", "clipped_groups", "scale_clamped", "nonfinite_groups"):
                total[f] = min(total[f], 1)
        return CastStats(**total).exactly(exact)


EXACT_SUMS = ("clip_excess", "abs_sum", "xx", "ee", "ex", "e_sum")
"""The float64 sums of :class:`CastStats`: :meth:`CastStats.merge` adds them exactly."""


def _total(values: list[Any]) -> Any:
    return None if any(v is None for v in values) else sum(values)


def _grow(partials: list[float], x: float) -> None:
    """Add ``x`` exactly to the non-overlapping ``partials`` (smallest first), in place:
    Shewchuk's step, as :func:`driftcli.kernels.statcode.expansions` takes it."""
    i = 0
    for y in partials:
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo:
            partials[i] = lo
            i += 1
        x = hi
    partials[i:] = [x]


def exact_sum(parts: Sequence[CastStats], name: str) -> tuple[float, ...] | None:
    """The exact sum of field ``name`` (one of :data:`EXACT_SUMS`) over ``parts``, as
    non-overlapping partials (``math.fsum`` rounds it): each part's :attr:`CastStats.partials`
    where it has them, else its float; None when any part's field is None. A part's inf or NaN
    (a float64 input's square past its range), or a sum past float64's range, is added as plain
    addition adds it: one partial, inf or NaN."""
    values = [getattr(p, name) for p in parts]
    if any(v is None for v in values):
        return None
    acc: list[float] = []
    for p, value in zip(parts, values, strict=True):
        for t in (p.partials or {}).get(name, (value,)):
            _grow(acc, t)
    try:
        if all(math.isfinite(t) for t in acc) and math.isfinite(math.fsum(acc)):
            return tuple(acc)
    except OverflowError:  # the correctly rounded sum is past float64's range
        pass
    return (sum(values),)


def cast_stats(x: Tensor, cast_or_spec: Cast | str, *, axis: int = -1,
               random_bits: Tensor | None = None, seed: int | None = None,
               sr_bits: int = DEFAULT_SR_BITS, tensor_amax: float | None = None,
               want_values: bool = True, rounded: bool = True,
               facts: SliceFacts | None = None) -> tuple[CastStats, Tensor | None]:
    """Cast ``x`` and count what happened (:class:`CastStats`); also the dequantized values
    (None with ``want_values=False``).

    ``tensor_amax`` is the amax of the whole tensor when ``x`` is one slice of it (see
    :func:`finite_amax`), so per-tensor and two-level scales match the whole tensor's.
    A cast with ``rht=`` counts the cast of ``x``'s transform (and its values are the
    transform's; ``tensor_amax`` is then the transformed whole tensor's).
    ``rounded=False`` counts only what needs no rounding (clipping, scales, non-finite
    inputs): several times faster; the other fields are ``None`` and no values come back,
    and a stochastic cast needs no seed. ``facts`` are ``x``'s :func:`slice_facts`, when
    several casts of ``x`` share them.
    """
    c = parse_cast(cast_or_spec)
    if not rounded:
        if want_values:
            raise DriftError("cast_stats: values need the rounding; pass want_values=False "
                             "with rounded=False")
        c = replace(c, rounding=Rounding.RTZ)  # clipping and scales do not depend on it
        seed = random_bits = None
    random_bits = checked_bits("cast_stats", x, c, seed, random_bits, sr_bits)
    if c.rht is not None:  # count the cast of what it reads: the transform of x
        x, c, facts = transform(x, c.rht, axis), replace(c, rht=None), None
    fused = _numba_stats(x, c, axis, random_bits, sr_bits, tensor_amax, want_values, rounded,
                         facts)
    if fused is not None:
        return fused
    b = cast_blocks(x, c, axis, random_bits, sr_bits, tensor_amax)
    m = element_masks(b, c, sr_bits)
    xd = b.blocks.double()
    scale = b.scales[:, None]
    valid, e, xv = error_terms(b.blocks, b.q, m.finite)
    xx, ee, ex, e_sum = (float(t) for t in error_sums(e, xv))
    mags = torch.where(m.finite, xd.abs(), 0.0)
    excess = torch.where(m.clipped, mags - float(c.format.max) * scale, 0.0)
    n_nonfinite = int((~m.finite).sum())
    stats = CastStats(
        numel=x.numel(), nonfinite=n_nonfinite,
        nonzero=int(((xd != 0) & m.finite).sum()), groups=b.blocks.shape[0] if x.numel() else 0,
        clipped=int(m.clipped.sum()), clipped_by_rounding=_by_rounding(c, int(m.clipped.sum())),
        clipped_groups=int(m.clipped.any(dim=1).sum()),
        clip_excess=float(excess.sum()), abs_sum=float(mags.sum()),
        underflowed=int(m.underflowed.sum()), subnormal=int(m.subnormal.sum()),
        scale_clamped=int(b.clamped.sum()), nonfinite_groups=int(b.bad_blocks.sum()),
        lost=int((m.finite & ~valid).sum()), xx=xx, ee=ee, ex=ex, e_sum=e_sum)
    if not rounded:
        nulls: dict[str, Any] = dict.fromkeys(_ROUNDED)
        return replace(stats, **nulls), None
    return stats, (b.back(b.q).to(x.dtype) if want_values else None)


_COUNT_FIELDS = tuple(f for f in CastStats.__dataclass_fields__ if f not in EXACT_SUMS)


def _by_rounding(c: Cast, clipped: int) -> int:
    """The clips that only the rounding of a real scale made: all of a rule's that covers
    amax (every finite |x| is at most amax, so its exact quotient by amax / M is at most M)."""
    rule = c.scaling.rule
    return clipped if rule is not None and rule.covers_amax else 0


SUM_PIECE = jit.PIECE
"""Elements per piece of the fused pass's float64 sums, counted from a slice's first element:
a slice starting on a multiple of it in the tensor has the tensor's pieces."""

TENSOR_ROW = 1 << 12
"""Row length a per-tensor scaled tensor is folded into for the fused pass (zero padded:
zeros add nothing to any sum)."""

_WHOLE = (Granularity.TENSOR, Granularity.NONE)
"""Granularities whose one scale (a tensor's, or 2**0) the fused pass folds into rows of
:data:`TENSOR_ROW`."""


def _abs_max(blocks: Tensor) -> Tensor:
    """Each row's largest magnitude: NaN where the row holds a NaN, inf where it holds an
    inf and no NaN (max propagates NaN)."""
    return blocks.abs().amax(dim=1)


def _row_amax(blocks: Tensor, raw: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each row's amax over its finite elements and which rows hold a NaN or inf (as
    :func:`driftcli.casts.scaling.block_stats`), from the rows' NaN-propagating amax ``raw`` when
    given (shared from :class:`SliceFacts`): only the rows that hold a NaN or inf are then
    reduced again, masked."""
    if raw is None:
        return jit.block_amax(blocks) if kernels.numba_runs(blocks) else \
            amax_and_nonfinite(blocks)
    bad = ~torch.isfinite(raw)
    rows = bad.nonzero()[:, 0]
    if rows.numel():
        raw = raw.clone()
        raw[rows] = block_stats(blocks.index_select(0, rows)).amax
    return raw, bad


def run_length(shape: tuple[int, ...], c: Cast, axis: int) -> int:
    """How many consecutive elements of the flattened tensor each of ``c``'s scale groups
    is (a last one zero padded): :data:`TENSOR_ROW` for a tensor scale or none (as the fused
    pass folds them), the block for blocks along the last axis that divide it; 0 for any other
    layout (tiles, channels, blocks along another axis)."""
    s = c.scaling
    if not shape:
        return 0
    if s.granularity in _WHOLE:
        return TENSOR_ROW
    if s.granularity is Granularity.BLOCK and axis % len(shape) == len(shape) - 1 and \
            shape[-1] % s.block == 0:
        return s.block
    return 0


@dataclass(frozen=True)
class SliceFacts:
    """What every cast of one tensor, or one slice of it, shares: read from it once (see
    :func:`slice_facts`) instead of once per cast."""

    finite: int
    """Finite elements."""
    abs_sum: float
    """Σ|x| over them, in float64."""
    chunk: int = 0
    """Elements per entry of ``amax``; 0 without it."""
    amax: Tensor | None = None
    """Per run of ``chunk`` consecutive elements of the flattened input, its largest
    magnitude: NaN where the run holds a NaN, inf where an inf (as :func:`_abs_max`).
    A cast whose scale groups are whole runs of these (blocks along the last axis, a
    tensor scale) takes its groups' amax from it."""

    def group_amax(self, x: Tensor, c: Cast, axis: int) -> Tensor | None:
        """The raw amax of each row of ``c``'s block layout of ``x``, or None where the
        layout is not made of whole runs."""
        k = run_length(tuple(x.shape), c, axis)
        if self.amax is None or not k or k % self.chunk:
            return None
        r = k // self.chunk
        a = self.amax
        if a.numel() % r:  # a tensor scale's last row is zero padded, and so is this
            a = torch.nn.functional.pad(a, (0, -a.numel() % r))
        return a.view(-1, r).amax(dim=1) if r > 1 else a


def run_amax(x: Tensor, chunk: int) -> Tensor | None:
    """The largest magnitude of each run of ``chunk`` consecutive elements of ``x``
    flattened, NaN or inf where a run holds one (as :attr:`SliceFacts.amax`); None unless
    ``chunk`` divides ``x.numel()``."""
    flat = _flat(x)
    if not chunk or not flat.numel() or flat.numel() % chunk:
        return None
    if kernels.numba_runs(flat):
        return jit.slice_facts(flat, chunk)[0]
    return _abs_max(flat.view(-1, chunk))


def slice_facts(x: Tensor, chunk: int = 0, amax: Tensor | None = None) -> SliceFacts:
    """The :class:`SliceFacts` of ``x``: its :func:`run_amax` (given as ``amax``, or
    computed), its finite count and Σ|x|, in one read of ``x`` on the numba back-end."""
    flat = _flat(x)
    if kernels.numba_runs(flat) and flat.numel():
        runs, finite, abs_sum = jit.slice_facts(flat, 0 if amax is not None else chunk)
        amax = amax if amax is not None else runs
        return SliceFacts(finite, abs_sum, chunk if amax is not None else 0, amax)
    amax = amax if amax is not None else run_amax(flat, chunk)
    total = _abs_sum(flat)
    if flat.numel() == 0 or bool(torch.isfinite(total)):
        finite, abs_sum = flat.numel(), float(total)
    else:  # a NaN or inf: count and add up the finite elements only
        ok = torch.isfinite(flat)
        finite, abs_sum = int(ok.sum()), float(torch.where(ok, flat.abs(), 0.0).double().sum())
    return SliceFacts(finite, abs_sum, chunk if amax is not None else 0, amax)


def finite_amax(x: Tensor, runs: Tensor | None = None) -> float:
    """The largest finite magnitude in ``x`` (0 when there is none), as scales read it, from
    its :func:`run_amax` ``runs`` when given."""
    if x.numel() == 0:
        return 0.0
    flat = _flat(x)
    if runs is not None and runs.numel():
        return float(_row_amax(flat.view(runs.numel(), -1), runs)[0].max())
    n = flat.numel()
    rows = flat.view(-1, TENSOR_ROW) if n % TENSOR_ROW == 0 else flat.view(1, -1)
    return float(_row_amax(rows)[0].max())


def clip_pass_takes(shape: tuple[int, ...], dtype: torch.dtype, casts: Sequence[Cast | str],
                    axis: int = -1, rounded: bool = False) -> bool:
    """Whether :func:`fused_stats` counts every cast of ``casts`` on a tensor of ``shape``
    and ``dtype`` (on the numba back-end; ``rounded`` as there, without seeds: a stochastic
    cast is then not taken): then nothing else reads the tensor for them. (A power-of-two
    grid found out of float32's range sends a cast back to :func:`cast_stats` even so.)"""
    parsed = [parse_cast(c) for c in casts]
    moved = _axis_last(shape, axis)[0]
    rht = {i for m in rht_groups(parsed, shape, axis, dtype).values() for i in m}
    return dtype == torch.float32 and kernels.jit_unavailable() is None and all(
        (flat_route(c, moved, -1, dtype) is not None or i in rht or
         given_route(c, shape, axis, dtype) is not None) and
        not (rounded and c.rounding is Rounding.SR) for i, c in enumerate(parsed))


def clip_stats(x: Tensor, casts: Sequence[Cast | str], *, axis: int = -1,
               tensor_amax: float | None = None) -> dict[int, CastStats]:
    """:func:`cast_stats` with ``rounded=False`` for every cast of ``casts`` the fused pass
    takes (:func:`fused_stats` without the rounding)."""
    return fused_stats(x, casts, axis=axis, tensor_amax=tensor_amax)


def fused_stats(x: Tensor, casts: Sequence[Cast | str], *, axis: int = -1,
                tensor_amax: float | None = None, rounded: bool = False,
                seeds: Sequence[int | None] | None = None,
                sr_bits: int = DEFAULT_SR_BITS,
                rht_amax: dict[int, float] | None = None) -> dict[int, CastStats]:
    """:func:`cast_stats` (``rounded`` as there) for every cast of ``casts`` the fused pass
    takes (:func:`driftcli.casts.route.flat_route`), keyed by the cast's index, in one read of
    ``x`` for all of them (and one first read for the tensor's amax where a cast needs it and
    ``tensor_amax`` is not given); the same counts, bit for bit, and the float sums within a few
    units in their last place (summed per piece in lanes, the pieces added exactly). A
    stochastic cast is taken with its ``seeds`` entry (its draws made as :func:`cast_stats`
    makes them); the casts of one rounding mode and overflow policy share a pass. The casts
    whose scales the pass does not make (a scale arithmetic, micro-exponents) are counted with
    the operands their scale steps give (:mod:`driftcli.casts.given`), an ``rht=`` cast on the
    slice's transform (``rht_amax``: by cast index, the transformed tensor's amax where ``x``
    is a slice of it). The casts it does not take, and every cast on the torch back-end, are
    left out: :func:`cast_stats` counts them."""
    if x.numel() == 0 or x.dtype != torch.float32 or not kernels.numba_runs(x):
        return {}
    parsed = [parse_cast(c) for c in casts]
    shape, last = _axis_last(tuple(x.shape), axis)
    if not any(c.scaling.granularity is Granularity.BLOCK for c in parsed):
        shape, last = tuple(x.shape), None  # one scale: the layout does not matter
    found = {i: r for i, c in enumerate(parsed)
             if (r := flat_route(c, shape, -1, x.dtype)) is not None and
             (not rounded or c.rounding is not Rounding.SR or
              (seeds is not None and seeds[i] is not None))}
    moved = x if last is None else x.movedim(last, -1)
    flat = moved.reshape(-1).contiguous()
    top = tensor_amax
    if top is None and any(r.needs_amax for r in found.values()):
        top = jit.finite_top(flat)
    scales = {i: one_scale(parsed[i], r, top or 0.0) if not r.block else (0, 1.0, False)
              for i, r in found.items()}
    if rounded:  # a tensor's power-of-two grid out of float32's range: the torch back-end's
        found = {i: r for i, r in found.items() if not r.tensor_pow2 or
                 not needs_wide(torch.tensor([top or 0.0]), parsed[i])}
    # a pass per rounding mode and overflow policy, and per two-level scale rounding (both
    # constants of its code): every other cast joins the first pass of its mode
    passes: list[tuple[Any, list[Any], dict[int, Any]]] = []
    for i, r in found.items():
        c = parsed[i]
        mode = (c.rounding, c.overflow) if rounded else None
        q = [tuple(int(v) for v in r.q)] if r.two_level else []
        into = next((p for p in passes if p[0] == mode and (not q or p[1] in ([], q))), None)
        if into is None:
            into = (mode, q, {})
            passes.append(into)
        if q:
            into[1][:] = q
        into[2][i] = r
    out: dict[int, CastStats] = {}
    for _, _, group in passes:
        out |= _fused_pass(x, flat, parsed, group, scales, top, rounded, seeds, sr_bits, last)
    # the casts whose scale steps give the pass their operands, and those reading a transform
    given = [i for i, c in enumerate(parsed) if i not in found and
             given_route(c, tuple(x.shape), axis, x.dtype) is not None and
             (not rounded or c.rounding is not Rounding.SR or
              (seeds is not None and seeds[i] is not None))]
    for i, g in given_counts(x, parsed, given, axis=axis, tensor_amax=tensor_amax,
                             rounded=rounded, seeds=seeds, sr_bits=sr_bits).items():
        fields: dict[str, Any] = dict.fromkeys(_ROUNDED)
        fields |= g.fields | {f: math.fsum(e) for f, e in g.exact.items()}
        out[i] = CastStats(**fields, clipped_by_rounding=_by_rounding(parsed[i], fields["clipped"])
                           ).exactly(g.exact)
    for rht, members in rht_groups(parsed, tuple(x.shape), axis, x.dtype).items():
        got = fused_stats(transform(x, rht, axis), [without_rht(parsed[i]) for i in members],
                          axis=axis, rounded=rounded, sr_bits=sr_bits,
                          tensor_amax=next((rht_amax[i] for i in members
                                            if rht_amax and i in rht_amax), None),
                          seeds=None if seeds is None else [seeds[i] for i in members])
        out |= {members[j]: st for j, st in got.items()}
    return dict(sorted(out.items()))


def _moved_bits(bits: Tensor | None, last: int | None) -> Tensor | None:
    return bits if bits is None or last is None else bits.movedim(last, -1).reshape(-1)


def _axis_last(shape: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], int | None]:
    """``shape`` with dimension ``axis`` moved last, and that dimension (None where it is
    last already): blocks along another axis are runs of a copy laid out so (the counts do
    not depend on the elements' order; a stochastic cast's draws move with them)."""
    if not shape or axis % len(shape) == len(shape) - 1:
        return shape, None
    dim = axis % len(shape)
    return (*shape[:dim], *shape[dim + 1:], shape[dim]), dim


def _fused_pass(x: Tensor, flat: Tensor, parsed: list[Cast], found: dict[int, Any],
                scales: dict[int, tuple[int, float, bool]], top: float | None, rounded: bool,
                seeds: Sequence[int | None] | None, sr_bits: int,
                last: int | None) -> dict[int, CastStats]:
    """One pass of :func:`fused_stats` over the casts ``found`` (their indices and routes) on
    ``flat``, ``x`` with dimension ``last`` moved last (when not None) and flattened."""
    how = None
    if rounded:
        src = rounding.source_of(torch.float32)
        how = jit.Rounded(
            [rounding.jit_params(src=src, tgt=rounding.target_of(parsed[i].format),
                                 rounding=parsed[i].rounding, overflow=parsed[i].overflow,
                                 sr_bits=sr_bits) for i in found],
            [_moved_bits(checked_bits("fused_stats", x, parsed[i], seeds[i], None, sr_bits),
                         last)
             if parsed[i].rounding is Rounding.SR and seeds is not None else None
             for i in found],
            [(parsed[i].format.qmin, parsed[i].format.emax) for i in found])
    got = jit.clip_counts(flat, list(found.values()), [scales[i][0] for i in found],
                          [scales[i][1] for i in found], top or 0.0, how)
    out = {}
    for n, (i, r) in enumerate(found.items()):
        clipped, clipped_groups, clamped, n_bad = got.counts[n]
        extra: dict[str, Any] = dict.fromkeys(_ROUNDED)
        exact: dict[str, tuple[float, ...]] = {"clip_excess": got.excess[n],
                                               "abs_sum": got.abs_sum}
        if rounded:
            nonzero, under, sub, lost, n_wide = got.rounded[n]
            if n_wide:  # a block's grid out of float32's range: the torch back-end's
                continue
            extra = dict(zip(_ROUNDED[:4], (nonzero, under, sub, lost), strict=True))
            exact |= dict(zip(_ROUNDED[4:], got.sums[n], strict=True))
        one = not r.block
        sums: dict[str, Any] = {f: math.fsum(e) for f, e in exact.items()}
        out[i] = CastStats(
            numel=x.numel(), nonfinite=x.numel() - got.finite,
            groups=1 if one else x.numel() // r.block, clipped=clipped,
            clipped_by_rounding=_by_rounding(parsed[i], clipped),
            clipped_groups=min(clipped, 1) if one else clipped_groups,
            scale_clamped=int(scales[i][2]) if one else clamped, nonfinite_groups=n_bad,
            **extra, **sums).exactly(exact)
    return out


def _numba_stats(x: Tensor, c: Cast, axis: int, bits: Tensor | None, sr_bits: int,
                 tensor_amax: float | None, want_q: bool, rounded: bool,
                 facts: SliceFacts | None) -> tuple[CastStats, Tensor | None] | None:
    """:func:`cast_stats` on the numba back-end, fused: the rows' amax (from ``facts`` where
    they hold it), the rows' scales (:func:`driftcli.casts.quantization.plan_scales`, one per scale
    group, on torch), then one pass that casts every element and counts
    (:func:`driftcli.kernels.jit.cast_counts`). None where the torch back-end runs instead:
    an empty input, an implementation's scale arithmetic (:mod:`driftcli.casts.scalearith`), a
    float32 input whose scaled grid leaves float32's range, or tensors numba does not take."""
    s, elem = c.scaling, c.format
    if x.numel() == 0 or not s.arithmetic.exact or not kernels.numba_runs(x, bits):
        return None
    if c.micro is not None:  # micro-exponents: counted from cast_blocks' masks
        return None
    one_scale = s.granularity in _WHOLE  # one scale for the tensor, or none
    work = working(x)
    back: Callable[[Tensor], Tensor]
    if one_scale:
        blocks = work.reshape(1, -1).contiguous()
        rbits = None if bits is None else bits.reshape(1, -1)

        def back(t: Tensor) -> Tensor:
            return t.reshape(x.shape)
    else:
        blocks, back = to_blocks(work, s, axis)
        blocks = blocks.contiguous()
        rbits = None if bits is None else to_blocks(bits, s, axis)[0].contiguous()
    fused = _fused_scales(blocks, c, tensor_amax)
    if fused is not None:  # the scales in one numba pass over the blocks, as quantize's
        if fused is _OUT_OF_RANGE:
            return None
        facts = facts or slice_facts(work)
        return _count(x, c, blocks, back, rbits, fused.scale, fused.bad, fused.amax,
                      s.rule is not None and s.rule.power_of_two, fused.clamped, facts,
                      sr_bits, rounded, want_q, one_scale=False)
    facts = facts or slice_facts(work, run_length(tuple(work.shape), c, axis))
    if one_scale:
        # the runs' largest magnitudes are the finite amax where every element is finite
        runs = facts.amax if facts.finite == x.numel() else None
        a = float(runs.max()) if runs is not None and runs.numel() else finite_amax(work)
        row_amax = torch.tensor([a], dtype=work.dtype)
        nonfinite = torch.tensor([facts.finite < x.numel()])
    else:
        row_amax, nonfinite = _row_amax(blocks, facts.group_amax(work, c, axis))
    top = tensor_amax_of(row_amax, tensor_amax)
    amax = top.expand_as(row_amax) if one_scale else row_amax
    unscaled = s.granularity is Granularity.NONE
    pow2 = unscaled or bool(s.rule is not None and s.rule.power_of_two)
    if pow2 and work.dtype == torch.float32 and needs_wide(amax, c):
        return None  # rounded in float64, then stored as float32: the torch back-end's steps
    if unscaled:
        scale = torch.zeros(1, dtype=torch.long)
        clamped = torch.zeros(1, dtype=torch.bool)
    else:
        plan = ScalePlan.of(elem, s)
        scale, clamped = plan_scales(amax.contiguous(), top, plan.divisors(amax), plan=plan)
    bad = nonfinite if s.blocked else None
    n_clamped = int((clamped if bad is None else clamped & ~bad).sum())
    return _count(x, c, blocks, back, rbits, scale, bad, row_amax, pow2, n_clamped, facts,
                  sr_bits, rounded, want_q, one_scale=one_scale)


_OUT_OF_RANGE = jit.BlockScales(torch.empty(0), torch.empty(0), torch.empty(0), 0, 0, 0)
"""What :func:`_fused_scales` returns where the blocks' power-of-two grid leaves float32's
range (the torch back-end rounds those in float64)."""


def _fused_scales(blocks: Tensor, c: Cast,
                  tensor_amax: float | None) -> jit.BlockScales | None:
    """The scales of float32 blocks in one numba pass (the kernels of quantize's fused block
    cast, :func:`driftcli.casts.quantization.fused_block_cast_applies`); None where that does not
    apply (the scales are then planned on torch from the rows' amax)."""
    if not fused_block_cast_applies(blocks, c):
        return None
    if c.scaling.rule is ScaleRule.TWO_LEVEL:
        consts, q = two_level_consts(c)
        return jit.two_level_block_scales(blocks, consts, q, tensor_amax)
    rule = pow2_rule(c)
    if rule is None:
        return None
    got = jit.pow2_block_scales(blocks, rule)
    if (got.kmin != jit.NO_ROW and got.kmin + c.format.qmin < -149) or \
            got.kmax + c.format.emax >= 128:
        return _OUT_OF_RANGE
    return got


def _count(x: Tensor, c: Cast, blocks: Tensor, back: Any, rbits: Tensor | None, scale: Tensor,
           bad: Tensor | None, row_amax: Tensor, pow2: bool, n_clamped: int, facts: SliceFacts,
           sr_bits: int, rounded: bool, want_q: bool, *,
           one_scale: bool) -> tuple[CastStats, Tensor | None]:
    """The numba pass that casts every element of ``blocks`` under its row's scale and counts
    (:func:`driftcli.kernels.jit.cast_counts`), as :class:`CastStats`."""
    elem = c.format
    n_bad = 0 if bad is None else int(bad.sum())
    p = rounding.jit_params(src=rounding.source_of(blocks.dtype), tgt=rounding.target_of(elem),
                            rounding=c.rounding, overflow=c.overflow, sr_bits=sr_bits)
    counts, sums, q = jit.cast_counts(
        blocks, blocks.shape[1], rbits, scale if pow2 else None, None if pow2 else scale, bad,
        row_amax, p, (float(elem.max), float(elem.min), float(elem.smallest_normal)),
        rounded, want_q)
    clipped, clipped_groups, nonzero, under, sub, lost = counts
    if one_scale:  # pieces are not groups here: the one group clips or not
        clipped_groups = min(clipped, 1)
    excess, xx, ee, ex, e_sum = sums
    got = dict(zip(_ROUNDED, (nonzero, under, sub, lost, xx, ee, ex, e_sum), strict=True)) \
        if rounded else dict.fromkeys(_ROUNDED)
    stats_ = CastStats(
        numel=x.numel(), nonfinite=x.numel() - facts.finite, groups=blocks.shape[0],
        clipped=clipped, clipped_by_rounding=_by_rounding(c, clipped),
        clipped_groups=clipped_groups, clip_excess=excess, abs_sum=facts.abs_sum,
        scale_clamped=n_clamped, nonfinite_groups=n_bad, **got)
    return stats_, (None if q is None else back(q).to(x.dtype))
