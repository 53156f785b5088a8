"""What a cast did to a tensor, counted: :class:`CastStats` and :func:`cast_stats`, the numbers
every measurement (clip-rate, underflow-rate, error-bias) and a training run's operand rates
derive from.

The eager path casts with :func:`driftcli.quantization.cast_blocks` and counts from the per-element
masks. The fused path does the same work as compiled passes over the rows of scale groups: the
row amaxes, the row scales, the element cast with its sums, and clipping only on the rows
that can clip (their candidates are known from the scales). Both give the same counts and the
same float64 sums, bit for bit (the tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from driftcli import compiling
from driftcli import rounding as fast
from driftcli.cast import Cast, parse_cast
from driftcli.errors import DriftError
from driftcli.modes import DEFAULT_SR_BITS, Granularity, Overflow, Rounding
from driftcli.quantization import (
    amax_and_nonfinite,
    cast_blocks,
    checked_bits,
    element_masks,
    needs_wide,
    plan_scales,
    tensor_amax_of,
    working,
)
from driftcli.scaling import ScalePlan, block_stats, to_blocks

Tensor = torch.Tensor


def _flat(x: Tensor) -> Tensor:
    return working(x).reshape(-1)


_ROUNDED = ("nonzero", "underflowed", "subnormal", "lost", "xx", "ee", "ex", "e_sum")
"""The :class:`CastStats` fields that need the rounded values (``None`` without them), in
the order :func:`_sums_pass` adds them up."""


def error_terms(x: Tensor, q: Tensor, finite: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """``(valid, e, xv)`` of a cast ``q`` of ``x``, in float64: ``valid`` where both are finite
    (``finite``: ``x``'s mask, when already known), ``e = q - x`` and ``xv = x`` there, 0
    elsewhere. Every error sum of drift (eager, compiled, of an expected cast) is made of these
    terms, in this one way, so that they agree bit for bit."""
    xd, qd = x.double(), q.double()
    valid = (torch.isfinite(xd) if finite is None else finite) & torch.isfinite(qd)
    return valid, torch.where(valid, qd - xd, 0.0), torch.where(valid, xd, 0.0)


def error_sums(e: Tensor, xv: Tensor) -> list[Tensor]:
    """Σx², Σe², Σe·x, Σe of :func:`error_terms` (the ``xx ee ex e_sum`` of CastStats)."""
    return [(xv * xv).sum(), (e * e).sum(), (e * xv).sum(), e.sum()]


def _rounded(blocks: Tensor, bits: Tensor | None, scale: Tensor, *, tgt: fast.Target,
             rounding: Rounding, overflow: Overflow, sr_bits: int, pow2: bool,
             wide: bool) -> Tensor:
    """The element cast of every row, before its scale is multiplied back in for real-valued
    scales (``q / s``), or with it for powers of two (``q``). Stored, not recomputed: a
    compiler otherwise repeats the whole rounding once per sum that reads it."""
    if pow2:
        work = blocks.double() if wide else blocks
        return fast.round_fused(work, tgt, rounding, overflow, bits, scale[:, None],
                                sr_bits).to(blocks.dtype)
    y = blocks / scale[:, None]
    return fast.round_fused(y, tgt, rounding, overflow, bits, None, sr_bits)


def _sums_pass(blocks: Tensor, r: Tensor, scale: Tensor, nonfinite: Tensor, limits: Tensor, *,
               pow2: bool, blocked: bool, elem: tuple[float, ...],
               want_q: bool) -> tuple[Tensor, Tensor | None]:
    """The sums of :class:`CastStats` that need the rounded rows ``r`` of :func:`_rounded`
    (:data:`_ROUNDED`), in one compiled pass: the masks of :func:`element_masks` are never stored.
    Only whole-tensor sums: a per-row reduction among them makes the compiler loop row by
    row, many times slower. (Clipping needs no rounding: :func:`_clip_pass` counts it.)

    ``limits`` holds, per row of a power-of-two scaling, ``max·s``, ``min·s`` and
    ``smallest_normal·s`` (exact in the rounding dtype); ``elem`` the same three unscaled.
    """
    e_small = elem[2]
    if pow2:
        q = r
        subnormal = (q != 0) & (q.to(limits.dtype).abs() < limits[:, 2:3])
    else:
        q = r * scale[:, None]
        subnormal = (r != 0) & (r.abs() < e_small)
    finite = torch.isfinite(blocks)
    if blocked:
        q = torch.where(nonfinite[:, None], torch.nan, q)
    subnormal = subnormal & torch.isfinite(q)
    valid, e, xv = error_terms(blocks, q, finite)
    nonzero = (blocks != 0) & finite
    sums = torch.stack([
        nonzero.sum().double(), (nonzero & (q == 0)).sum().double(), subnormal.sum().double(),
        (finite & ~valid).sum().double(), *error_sums(e, xv)])
    return sums, (q if want_q else None)


def _abs_sum(x: Tensor) -> Tensor:
    """Σ|x| in float64: NaN or inf when ``x`` holds one (then :func:`slice_facts` masks)."""
    return x.abs().double().sum()


@dataclass(frozen=True)
class _ClipRule:
    """How an element pass tells a clip: the constants of its compiled graph."""

    pow2: bool
    """Compare ``x`` with the exact ``M·s`` and ``min·s`` of a power-of-two scale in
    ``limits``; else divide as the cast does."""
    blocked: bool
    """A NaN or inf makes its whole block NaN: none of it clips."""
    e_max: float
    e_min: float
    split: bool = False
    """Sum the excess |x| - M·s as two float32 parts, see :func:`_clip_pass`."""


def _clipped(blocks: Tensor, scale: Tensor, limits: Tensor, rule: _ClipRule) -> Tensor:
    """|x / s| > M, element by element (NaN and inf excluded)."""
    if rule.pow2:
        work = blocks.to(limits.dtype)
        out = (work > limits[:, 0:1]) | (work < limits[:, 1:2])
    else:
        y = blocks / scale[:, None]
        out = (y > rule.e_max) | (y < rule.e_min)
    return out & torch.isfinite(blocks)


def _clip_pass(blocks: Tensor, scale: Tensor, limits: Tensor, nonfinite: Tensor, *,
               rule: _ClipRule) -> Tensor:
    """Clipped elements, Σ over them of |x| - M·s, and how many of them the split sum could
    not take exactly, in one compiled pass of whole-tensor sums (see :func:`_sums_pass` on
    per-row ones).

    Each term |x| - M·s is exact in float64, but float64 work per element is slow.
    With ``rule.split`` (float32 input) it is summed as (|x| - t) - d, ``t`` = M·s rounded
    to float32 and ``d`` = M·s - t: ``|x| - t`` is exact in float32 where |x| <= 2t
    (Sterbenz; |x| > M·s keeps it above t/2), and ``d`` (a few bits) is a float32 unless
    ``t`` is subnormal or infinite. Elements where either fails are counted in the third
    sum, and the caller then sums them all in float64 instead."""
    clipped = _clipped(blocks, scale, limits, rule)
    if rule.blocked:
        clipped = clipped & ~nonfinite[:, None]
    exact = limits[:, 0:1].double() if rule.pow2 else (scale.double() * rule.e_max)[:, None]
    if not rule.split:
        return torch.stack([clipped.sum().double(),
                            torch.where(clipped, blocks.abs().double() - exact, 0.0).sum(),
                            torch.zeros((), dtype=torch.float64, device=blocks.device)])
    t = exact.float()
    d = (exact - t.double()).float()
    mags = blocks.abs()
    whole = (d.double() == exact - t.double()) & torch.isfinite(t) & (t != 0)
    unsafe = clipped & ((mags > 2 * t) | ~whole)
    return torch.stack([clipped.sum().double(),
                        torch.where(clipped, mags - t, 0.0).double().sum()
                        - torch.where(clipped, d, 0.0).double().sum(),
                        unsafe.sum().double()])


GATHER_SHARE = 4
"""Clipping is counted on a copy of the candidate rows when they are fewer than one row in
this many, else on all rows in place (copying then costs more than it saves)."""


def _rows(t: Tensor, rows: Tensor) -> Tensor:
    return t.index_select(0, rows)  # much faster than t[rows] (docs/performance.md)


def _clip_sums(blocks: Tensor, candidates: Tensor, n_candidates: int, scale: Tensor,
               limits: Tensor, nonfinite: Tensor, job: int, rule: _ClipRule) -> Tensor | None:
    """:func:`_clip_pass` over the rows that may clip: no other row can."""
    if n_candidates * GATHER_SHARE >= blocks.shape[0]:
        return compiling.run_compiled(_clip_pass, job, blocks, scale, limits, nonfinite, rule=rule)
    rows = candidates.nonzero()[:, 0]
    return compiling.run_compiled(_clip_pass, job, _rows(blocks, rows), _rows(scale, rows),
                             _rows(limits, rows) if rule.pow2 else limits,
                             _rows(nonfinite, rows), rule=rule)


def _rows_clipping(blocks: Tensor, sure: int, maybe: Tensor, scale: Tensor, limits: Tensor,
                   rule: _ClipRule) -> int:
    """Rows holding a clipped element: the ``sure`` ones of :func:`_row_pass` and those of
    the ``maybe`` rows that do, settled element by element."""
    rows = maybe.nonzero()[:, 0]
    if rows.numel() == 0:
        return sure
    clipped = _clipped(_rows(blocks, rows), _rows(scale, rows),
                       _rows(limits, rows) if rule.pow2 else limits, rule)
    return sure + int(clipped.any(dim=1).sum())


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

    @staticmethod
    def merge(parts: list[CastStats], per_tensor: bool) -> CastStats:
        """The stats of a whole tensor from those of its slices; ``per_tensor`` when the
        cast has one scale for the whole tensor (each slice then counted that one group).
        A field is ``None`` when any slice's is."""
        if not parts:
            return CastStats(*(0 for _ in _STAT_FIELDS))  # type: ignore[arg-type]
        total = {f: _total([getattr(p, f) for p in parts]) for f in _STAT_FIELDS}
        if per_tensor:
            for f in ("groups", "clipped_groups", "scale_clamped", "nonfinite_groups"):
                total[f] = min(total[f], 1)
        return CastStats(**total)


def _total(values: list[Any]) -> Any:
    return None if any(v is None for v in values) else sum(values)


def cast_stats(x: Tensor, cast_or_spec: Cast | str, *, axis: int = -1,
               random_bits: Tensor | None = None, seed: int | None = None,
               sr_bits: int = DEFAULT_SR_BITS, tensor_amax: float | None = None,
               job_elements: int = 0, want_values: bool = True, rounded: bool = True,
               facts: SliceFacts | None = None) -> tuple[CastStats, Tensor | None]:
    """Cast ``x`` and count what happened (:class:`CastStats`); also the dequantized values
    (None with ``want_values=False``).

    ``tensor_amax`` is the amax of the whole tensor when ``x`` is one slice of it (see
    :func:`finite_amax`), so per-tensor and two-level scales match the whole tensor's.
    ``job_elements`` is the size of the whole job the call is part of (a scan of many
    tensors), so the compiler is used when that, not this one tensor, is worth it.
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
    fused = _fused_stats(x, c, axis, random_bits, sr_bits, tensor_amax,
                         max(job_elements, x.numel()), want_values, rounded, facts)
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
        return replace(stats, **dict.fromkeys(_ROUNDED)), None
    return stats, (b.back(b.q).to(x.dtype) if want_values else None)


_STAT_FIELDS = tuple(CastStats.__dataclass_fields__)


def _by_rounding(c: Cast, clipped: int) -> int:
    """The clips that only the rounding of a real scale made: all of a rule's that covers
    amax (every finite |x| is at most amax, so its exact quotient by amax / M is at most M)."""
    rule = c.scaling.rule
    return clipped if rule is not None and rule.covers_amax else 0


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


def _row_amax(blocks: Tensor, job: int, raw: Tensor | None = None,
              all_finite: bool = False) -> tuple[Tensor, Tensor] | None:
    """Each row's amax over its finite elements and which rows hold a NaN or inf (as
    :func:`driftcli.scaling.block_stats`), from one compiled NaN-propagating reduction (or
    its result ``raw``, shared from :class:`SliceFacts`); only the rows that hold a NaN or
    inf are reduced again, masked (none when ``all_finite`` says so). None when the
    compiler is not used."""
    a = raw if raw is not None else compiling.run_compiled(_abs_max, job, blocks)
    if a is None:
        return None
    if all_finite:
        return a, torch.zeros(a.shape, dtype=torch.bool, device=a.device)
    bad = ~torch.isfinite(a)
    rows = bad.nonzero()[:, 0]
    if rows.numel():
        a = a.clone()
        a[rows] = block_stats(blocks.index_select(0, rows)).amax
    return a, bad


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


def run_amax(x: Tensor, chunk: int, job: int = 0) -> Tensor | None:
    """The largest magnitude of each run of ``chunk`` consecutive elements of ``x``
    flattened, NaN or inf where a run holds one (as :attr:`SliceFacts.amax`); None unless
    ``chunk`` divides ``x.numel()``. Compiled when ``job`` makes that worth it."""
    flat = _flat(x)
    if not chunk or not flat.numel() or flat.numel() % chunk:
        return None
    blocks = flat.view(-1, chunk)
    amax = compiling.run_compiled(_abs_max, job, blocks) if job else None
    return amax if amax is not None else _abs_max(blocks)


def slice_facts(x: Tensor, chunk: int = 0, job: int = 0,
                amax: Tensor | None = None) -> SliceFacts:
    """The :class:`SliceFacts` of ``x``: its :func:`run_amax` (given as ``amax``, or
    computed), its finite count and Σ|x|; compiled when ``job`` (elements of the work this
    is part of) makes that worth it.
    """
    flat = _flat(x)
    amax = amax if amax is not None else run_amax(flat, chunk, job)
    total = compiling.run_compiled(_abs_sum, job, flat) if job else None
    total = total if total is not None else _abs_sum(flat)
    if flat.numel() == 0 or bool(torch.isfinite(total)):
        finite, abs_sum = flat.numel(), float(total)
    else:  # a NaN or inf: count and add up the finite elements only
        ok = torch.isfinite(flat)
        finite, abs_sum = int(ok.sum()), float(torch.where(ok, flat.abs(), 0.0).double().sum())
    return SliceFacts(finite, abs_sum, chunk if amax is not None else 0, amax)


def _row_pass(amax: Tensor, row_amax: Tensor, nonfinite: Tensor, tensor_amax: Tensor,
              div: Tensor, *, plan: ScalePlan | None, pow2: bool, wide: bool, blocked: bool,
              ends: tuple[float, float, float]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Everything per row, in one compiled graph: the scales from ``amax`` (2**0 for an
    unscaled cast, ``plan`` None), the limits
    the element passes compare with, counts of the rows whose scale clamped and that hold a
    NaN or inf, and per row which sides of the range its amax lies beyond (1: above ``M``,
    2: below ``min``, 3: both; 0 for a NaN block).

    The cast is monotone and odd, so a row clips if and only if its largest magnitude
    ``row_amax`` does, on the side of its sign: beyond both ``M`` and ``-min`` it surely
    clips, beyond neither it cannot, in between (only where the range is not symmetric, as
    int8's) it may, and :func:`_rows_clipping` looks."""
    if plan is None:
        scale = torch.zeros(amax.shape, dtype=torch.long, device=amax.device)
        clamped = torch.zeros(amax.shape, dtype=torch.bool, device=amax.device)
    else:
        scale, clamped = plan_scales(amax, tensor_amax, div, plan=plan)
    e_max, e_min, e_small = ends
    if pow2:
        # 2**k from its bits: every k a scale format allows is a normal float64
        unit = ((scale.long() + 1023) << 52).view(torch.float64)
        limits = torch.stack([unit * e_max, unit * e_min, unit * e_small], dim=1)
        limits = limits if wide else limits.to(amax.dtype)  # exact: the grid fits float32
        top = row_amax.to(limits.dtype)
        above, below = top > limits[:, 0], -top < limits[:, 1]
    else:
        limits = torch.zeros(1, 3, dtype=amax.dtype, device=amax.device)
        above, below = row_amax / scale > e_max, -row_amax / scale < e_min
    bad = nonfinite if blocked else torch.zeros_like(nonfinite)
    counts = torch.stack([(clamped & ~bad).sum(), bad.sum()])
    # one small output, not three masks: each output of its own re-derives the scales
    side = torch.where(bad, 0, above.to(torch.int8) + 2 * below.to(torch.int8))
    return scale, limits, counts, side


def runs_compiled(job_elements: int) -> bool:
    """Whether :func:`cast_stats` casts in compiled passes in a job of this many elements
    (every cast does where the compiler is used); else it casts eagerly, with float64
    temporaries of several times its input."""
    return compiling.compiled(_sums_pass, job_elements) is not None


def _fused_stats(x: Tensor, c: Cast, axis: int, bits: Tensor | None, sr_bits: int,
                 tensor_amax: float | None, job: int, want_q: bool, rounded: bool,
                 facts: SliceFacts | None) -> tuple[CastStats, Tensor | None] | None:
    """:func:`cast_stats` as compiled passes: row amax, row scales (one row per block, tile
    or channel; an unscaled or tensor-scaled tensor folded into rows of :data:`TENSOR_ROW`),
    the element cast with its sums (when ``rounded``), clipping on the rows that can clip.
    None for an empty input or where the compiler is not used (then the eager path runs)."""
    s, elem = c.scaling, c.format
    one_scale = s.granularity in _WHOLE  # one scale for the tensor, or none
    if x.numel() == 0 or not s.arithmetic.exact or not runs_compiled(job):
        return None  # an implementation's scale arithmetic runs eagerly (driftcli.scalearith)
    work = working(x)
    if one_scale:
        n = work.numel()
        pad = -n % TENSOR_ROW
        flat = work.reshape(-1)
        blocks = (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).reshape(-1, TENSOR_ROW)
        rbits = None if bits is None else torch.nn.functional.pad(
            bits.reshape(-1), (0, pad)).reshape(-1, TENSOR_ROW)

        def back(t: Tensor) -> Tensor:
            return t.reshape(-1)[:n].reshape(x.shape)
    else:
        blocks, back = to_blocks(work, s, axis)
        blocks = blocks.contiguous()
        rbits = None if bits is None else to_blocks(bits, s, axis)[0].contiguous()
    facts = facts or slice_facts(work, job=job)
    got = _row_amax(blocks, job, facts.group_amax(work, c, axis), facts.finite == x.numel())
    if got is None:
        return None
    row_amax, nonfinite = got
    top = tensor_amax_of(row_amax, tensor_amax)
    amax = top.expand_as(row_amax) if one_scale else row_amax
    unscaled = s.granularity is Granularity.NONE
    pow2 = unscaled or bool(s.rule is not None and s.rule.power_of_two)
    wide = pow2 and needs_wide(amax, c)
    plan = None if unscaled else ScalePlan.of(elem, s)
    div = amax.new_zeros(2) if plan is None else plan.divisors(amax)
    ends = (float(elem.max), float(elem.min), float(elem.smallest_normal))
    rows = compiling.run_compiled(_row_pass, job, amax, row_amax, nonfinite, top, div, plan=plan,
                             pow2=pow2, wide=wide, blocked=s.blocked, ends=ends)
    if rows is None:
        return None
    scale, limits, row_counts, side = rows
    n_clamped, n_bad = (int(t) for t in row_counts.tolist())
    candidates = side != 0
    rule = _ClipRule(pow2, s.blocked, ends[0], ends[1])
    n_candidates = int(candidates.sum())
    if ends[1] == -ends[0]:  # a symmetric range: every candidate clips
        clipped_rows = n_candidates
    else:
        clipped_rows = _rows_clipping(blocks, int((side == 3).sum()), candidates & (side != 3),
                                      scale, limits, rule)
    v: dict[str, Any] = dict.fromkeys(_ROUNDED)
    v["abs_sum"], clipped, excess = facts.abs_sum, 0, 0.0
    if clipped_rows:
        part = _clip_sums(blocks, candidates, n_candidates, scale, limits, nonfinite, job,
                          replace(rule, split=work.dtype == torch.float32 and not wide))
        if part is not None and part[2]:
            part = _clip_sums(blocks, candidates, n_candidates, scale, limits, nonfinite, job,
                              rule)
        if part is None:
            return None
        clipped, excess, _ = part.tolist()
    q = None
    if rounded:
        r = compiling.run_compiled(
            _rounded, job, blocks, rbits, scale, tgt=fast.target_of(elem), rounding=c.rounding,
            overflow=c.overflow, sr_bits=sr_bits, pow2=pow2, wide=wide)
        out = None if r is None else compiling.run_compiled(
            _sums_pass, job, blocks, r, scale, nonfinite, limits, pow2=pow2,
            blocked=s.blocked, elem=ends, want_q=want_q)
        if out is None:
            return None
        sums, q = out
        got = dict(zip(_ROUNDED, sums.tolist(), strict=True))
        v |= {k: val if k in ("xx", "ee", "ex", "e_sum") else int(val) for k, val in got.items()}
    clipped = int(clipped)
    stats_ = CastStats(
        numel=x.numel(), nonfinite=x.numel() - facts.finite, nonzero=v["nonzero"],
        groups=1 if one_scale else blocks.shape[0], clipped=clipped,
        clipped_by_rounding=_by_rounding(c, clipped),
        clipped_groups=min(clipped, 1) if one_scale else clipped_rows, clip_excess=excess,
        abs_sum=v["abs_sum"], underflowed=v["underflowed"], subnormal=v["subnormal"],
        scale_clamped=min(n_clamped, 1) if one_scale else n_clamped,
        nonfinite_groups=n_bad, lost=v["lost"], xx=v["xx"], ee=v["ee"], ex=v["ex"],
        e_sum=v["e_sum"])
    return stats_, (None if q is None else back(q).to(x.dtype))


def finite_amax(x: Tensor, job: int = 0, runs: Tensor | None = None) -> float:
    """The largest finite magnitude in ``x`` (0 when there is none), as scales read it, from
    its :func:`run_amax` ``runs`` when given; compiled when ``job`` (elements of the work
    this is part of) makes that worth it."""
    if x.numel() == 0:
        return 0.0
    if runs is not None and runs.numel():
        got = _row_amax(_flat(x).view(runs.numel(), -1), job, runs)
        if got is not None:
            return float(got[0].max())
    flat = _flat(x).view(1, -1)
    got = _row_amax(flat, job) if job else None
    return float((got if got is not None else amax_and_nonfinite(flat))[0][0])
