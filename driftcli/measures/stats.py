"""What a cast did to a tensor, counted: :class:`CastStats` and :func:`cast_stats`, the numbers
every measurement (clip-rate, underflow-rate, error-bias) and a training run's operand rates
derive from.

The counting is the cast pipeline's last step (:mod:`driftcli.casts.route`, which chooses the
back-end): :func:`cast_stats` counts one cast (:func:`driftcli.casts.route.count_cast`: on the
torch back-end from the block cast's per-element masks, as the definitions read; on numba's in
one pass after the scales), and :func:`fused_stats` every cast of a slice the fused pass takes
in one read (:func:`driftcli.casts.route.fused_counts`: the same counts, bit for bit, and
float64 sums made per piece in the machine code's vector lanes and the pieces' partials added
exactly, :attr:`CastStats.partials`; :meth:`CastStats.merge` adds slices' exactly too: the same
bits for any thread count and, for slices starting on multiples of :data:`SUM_PIECE`, for any
slicing). This module makes the record of those counts and adds slices'; it composes no route.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from driftcli.casts.route import (
    SUM_PIECE,
    TENSOR_ROW,
    Counts,
    SliceFacts,
    count_cast,
    error_sums,
    error_terms,
    finite_amax,
    fused_counts,
    fused_takes,
    run_amax,
    run_length,
    slice_facts,
)
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import DEFAULT_SR_BITS

__all__ = [
    "EXACT_SUMS", "SUM_PIECE", "TENSOR_ROW", "CastStats", "SliceFacts", "cast_stats",
    "clip_pass_takes", "clip_stats", "error_sums", "error_terms", "exact_sum", "finite_amax",
    "fused_stats", "run_amax", "run_length", "slice_facts",
]
"""The record and its counting, and the cast pipeline's shared reads of a slice
(:mod:`driftcli.casts.route`) that the scan takes with them."""

Tensor = torch.Tensor


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
        if len(parts) == 1:  # a tensor of one slice (most tensors): nothing to add
            return parts[0]._alone(per_tensor)
        total: dict[str, Any] = {f: _total([getattr(p, f) for p in parts])
                                 for f in _COUNT_FIELDS}
        exact = {f: e for f in EXACT_SUMS if (e := exact_sum(parts, f)) is not None}
        total |= {f: math.fsum(exact[f]) if f in exact else None for f in EXACT_SUMS}
        if per_tensor:
            for f in ("groups", "clipped_groups", "scale_clamped", "nonfinite_groups"):
                total[f] = min(total[f], 1)
        return CastStats(**total).exactly(exact)

    def _alone(self, per_tensor: bool) -> CastStats:
        """:meth:`merge` of these stats alone: the same fields (each sum is the correctly
        rounded sum of its partials already, or a float with none) and partials, the group
        counts of a ``per_tensor`` cast at most 1, without the exact additions."""
        fields = {f: getattr(self, f) for f in _COUNT_FIELDS + EXACT_SUMS}
        if per_tensor:
            for f in ("groups", "clipped_groups", "scale_clamped", "nonfinite_groups"):
                fields[f] = min(fields[f], 1)
        own = self.partials or {}
        return CastStats(**fields).exactly(
            {f: own.get(f, (v,)) for f in EXACT_SUMS if (v := fields[f]) is not None})


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


_COUNT_FIELDS = tuple(f for f in CastStats.__dataclass_fields__ if f not in EXACT_SUMS)
"""The count fields of :class:`CastStats`: added as integers by :meth:`CastStats.merge`."""

def _stats(got: Counts) -> CastStats:
    stats = CastStats(**got.fields)
    return stats if got.partials is None else stats.exactly(got.partials)


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
    got = count_cast(x, parse_cast(cast_or_spec), axis=axis, random_bits=random_bits, seed=seed,
                     sr_bits=sr_bits, tensor_amax=tensor_amax, want_values=want_values,
                     rounded=rounded, facts=facts)
    return _stats(got), got.values


def clip_pass_takes(shape: tuple[int, ...], dtype: torch.dtype, casts: Sequence[Cast | str],
                    axis: int = -1, rounded: bool = False) -> bool:
    """Whether :func:`fused_stats` counts every cast of ``casts`` on a tensor of ``shape``
    and ``dtype`` (on the numba back-end; ``rounded`` as there, without seeds: a stochastic
    cast is then not taken): then nothing else reads the tensor for them. (A power-of-two
    grid found out of float32's range sends a cast back to :func:`cast_stats` even so.)"""
    return fused_takes(shape, dtype, [parse_cast(c) for c in casts], axis, rounded)


def clip_stats(x: Tensor, casts: Sequence[Cast | str], *, axis: int = -1,
               tensor_amax: float | None = None) -> dict[int, CastStats]:
    """:func:`cast_stats` with ``rounded=False`` for every cast of ``casts`` the fused pass
    takes (:func:`fused_stats` without the rounding)."""
    return fused_stats(x, casts, axis=axis, tensor_amax=tensor_amax)


def fused_stats(x: Tensor, casts: Sequence[Cast | str], *, axis: int = -1,
                tensor_amax: float | None = None, rounded: bool = False,
                seeds: Sequence[int | None] | None = None,
                sr_bits: int = DEFAULT_SR_BITS,
                rht_amax: dict[int, float] | None = None,
                cast_amax: dict[int, float] | None = None) -> dict[int, CastStats]:
    """:func:`cast_stats` (``rounded`` as there) for every cast of ``casts`` the fused pass
    takes, keyed by the cast's index, in one read of ``x`` for all of them: the counts of
    :func:`driftcli.casts.route.fused_counts` (the same counts as :func:`cast_stats`, bit for
    bit, and the float sums within a few units in their last place; what it takes, and how a
    stochastic or ``rht=`` cast is taken, is said there), as :class:`CastStats`. The casts it
    leaves out :func:`cast_stats` counts."""
    got = fused_counts(x, [parse_cast(c) for c in casts], axis=axis, tensor_amax=tensor_amax,
                       rounded=rounded, seeds=seeds, sr_bits=sr_bits, rht_amax=rht_amax,
                       cast_amax=cast_amax)
    return {i: _stats(g) for i, g in got.items()}
