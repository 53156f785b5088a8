"""One pass over named tensors under several casts: the engine behind clip-rate,
underflow-rate and error-bias, and behind :func:`driftcli.measure` in memory.

The unit is a named tensor with its metadata (:class:`~driftcli.io.readers.TensorRef`: its
source, its name, a dump's layer, role and step). Sources yield them: a path (a file or a
folder, through the readers) or tensors in memory (:class:`~driftcli.io.readers.memory.Held`,
a state dict or a module's, read where they lie: no file, no lock). The scan is the same for
every source, so the same tensors under the same names give the same results, stochastic
draws included (:func:`draw_seed`).

Each tensor is read once, in row slices of about :data:`CHUNK_ELEMENTS` elements
aligned to the cast's scale groups and, where the row width allows, to the fused pass's pieces
(so that its float64 sums are the same bits for any slicing: :func:`piece_alignment`; a held
tensor whose channels span its first dimension is cut along its last), and
every cast is applied to each slice while it is in memory, so memory stays
bounded by a slice and a held tensor (:data:`WHOLE_BYTES`), not a checkpoint. Per-tensor
and two-level scales need the whole tensor's amax first: a held tensor gives it at
once, a larger one is read once more for it. A tensor that cannot be read becomes a
result with an error; the others are still measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from driftcli import engines
from driftcli.casts.hadamard import check_core, rht_problem, transformed
from driftcli.casts.quantization import working_dtype
from driftcli.casts.route import combined_amax, policy_amax
from driftcli.choices import Device, Engine
from driftcli.engines import Execution
from driftcli.errors import DriftError
from driftcli.io import rht_signs
from driftcli.io.readahead import Job, Read, ReadAhead, Reads, Staging
from driftcli.io.readers import InputError, Inputs, ReadError, TensorRef, open_inputs
from driftcli.io.readers.core import torch_dtype
from driftcli.io.readers.memory import Held
from driftcli.measures.diffstats import DiffStats, cast_diff_stats
from driftcli.measures.stats import (
    SUM_PIECE,
    CastStats,
    cast_stats,
    clip_pass_takes,
    error_sums,
    error_terms,
    finite_amax,
    fused_stats,
    run_amax,
    run_length,
    slice_facts,
)
from driftcli.progress import Progress
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import AmaxPolicy, Granularity, Rounding, ScaleRule

Tensor = torch.Tensor

CHUNK_ELEMENTS = 1 << 22
"""Elements per slice (16 MiB of float32): large enough to amortise per-call costs, small
enough that the torch back-end's float64 temporaries of a slice are nothing next to a
checkpoint (the numba back-end's passes keep none)."""

WHOLE_BYTES = 1 << 28
"""A tensor of up to this many stored bytes (256 MiB) is read once, whole, and sliced in
memory; a larger one is read slice by slice, and once more first where a cast needs its
amax. Reading twice costs more than the casts of clip-rate; holding a tensor of this size
keeps a scan within three times the largest tensor, beyond what the process needs anyway."""


READ_AHEAD_BYTES: int | None = 1 << 24
"""A serial scan whose reads from files add up to at least this many bytes reads each slice on
a reader thread while the one before it is counted (:class:`~driftcli.io.readahead.ReadAhead`;
None: never): the same reads and results either way (``tests/test_readahead.py`` compares
them), the read's time hidden behind the pass where a core is free for it. Below a slice's
bytes (the default) the reads take a few milliseconds in all, and handing each tensor between
two threads would cost more than it hides; tensors in memory are read where they lie, with
nothing to hide."""


@dataclass(frozen=True)
class ScanOptions:
    """How tensors are cast and read."""

    axis: int = -1
    """The axis blocks run along (the contraction axis of the matmul a tensor feeds)."""
    draws: int = 1
    """Stochastic casts: independent draws per tensor (deterministic casts draw once)."""
    seed: int = 0
    """Seed of the stochastic draws."""
    device: Device = Device.CPU
    """Where the casts run."""
    chunk_elements: int | None = None
    """Elements per slice of a large tensor; None: :data:`CHUNK_ELEMENTS`."""
    whole_bytes: int = WHOLE_BYTES
    """Stored bytes up to which a tensor is read whole (see :data:`WHOLE_BYTES`)."""
    compare: bool = False
    """Also compare every cast with the first, element by element, on each slice
    (:func:`driftcli.measures.diffstats.cast_diff_stats`; ``drift cast-diff``)."""


@dataclass(frozen=True)
class Result:
    """One tensor under one cast: stats per draw, and of the mean of the draws."""

    input: str
    """The input path as given (a file or a folder)."""
    ref: TensorRef | None
    """The tensor; ``None`` for a file that could not be opened at all."""
    source: str
    cast: Cast
    draws: tuple[CastStats, ...]
    """One per draw (one for a deterministic cast); empty when ``error`` is set."""
    expected: CastStats | None
    """A stochastic cast: the error sums of the mean of the draws (counts as draw 0)."""
    error: str | None = None
    name: str | None = None
    """For an error without ``ref`` (the tensor could not even be listed): its name, if the
    error is about one tensor."""
    diff: DiffStats | None = None
    """With :attr:`ScanOptions.compare`: this cast against the scan's first (None for the first
    itself)."""


def _per_tensor(c: Cast) -> bool:
    return c.scaling.granularity in (Granularity.NONE, Granularity.TENSOR)


def _needs_tensor_amax(c: Cast) -> bool:
    return c.scaling.granularity is Granularity.TENSOR or c.scaling.rule is ScaleRule.TWO_LEVEL


def row_alignment(shape: tuple[int, ...], c: Cast, axis: int) -> int | None:
    """How many rows of dim 0 a slice must be a multiple of so no scale group straddles
    two slices; ``None`` when dim 0 cannot be split (one channel spans it)."""
    nd = len(shape)
    if nd == 0:
        return None
    a = axis % nd
    g, k = c.scaling.granularity, c.scaling.block
    if g is Granularity.CHANNEL or c.scaling.arithmetic.two.row_scaled:
        # a channel, or a row-scaled cast's row (its amax), spans the axis whole
        return None if a == 0 else 1
    if g is Granularity.BLOCK:
        return k if a == 0 else 1
    if g is Granularity.TILE:
        # tiles span the axis and the last other axis
        return k if a == 0 or nd == 2 else 1
    return 1


def column_alignment(c: Cast) -> int:
    """How many entries of the last dimension a slice along it must be a multiple of, for
    scale groups along the first (``--axis 0``): a tile spans the last dimension too; a
    block or channel lies within one entry of it."""
    return c.scaling.block if c.scaling.granularity is Granularity.TILE else 1


@dataclass(frozen=True)
class _Slicing:
    """Where a tensor is cut: ranges of its first dimension, or of its last (``dim`` -1)."""

    dim: int
    ranges: list[tuple[int, int]]


def _ranges(n: int, per_entry: int, chunk: int, align: int) -> list[tuple[int, int]]:
    step = max(align, chunk // per_entry // align * align)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def piece_alignment(per_entry: int, chunk: int, align: int) -> int:
    """``align`` (entries of the cut dimension a slice must be a multiple of), raised so that
    every slice of entries of ``per_entry`` elements starts on a multiple of the fused pass's
    :data:`SUM_PIECE` of the flattened tensor: its sums are then the whole tensor's, bit for bit
    (each piece's partials depend only on its elements, and slices add exactly). Where the
    smallest such slice holds more than ``chunk`` elements and more than ``align`` entries do
    (a row width with few factors of two, such as an odd vocabulary), ``align`` as given:
    memory stays bounded, and the sums then depend on the slicing within their bound."""
    raised = math.lcm(align, SUM_PIECE // math.gcd(SUM_PIECE, max(per_entry, 1)))
    return raised if raised * per_entry <= max(chunk, align * per_entry) else align


def _slices(ref: TensorRef, casts: Sequence[Cast], opts: ScanOptions) -> _Slicing:
    """Ranges that every cast can take separately: of dim 0, or, where a channel spans dim 0
    (``--axis 0``) and the tensor is held whole, of the last dim; else the whole tensor."""
    shape, chunk = ref.shape, opts.chunk_elements or CHUNK_ELEMENTS
    whole = _Slicing(0, [(0, shape[0] if shape else 0)])
    if len(shape) == 0 or ref.numel <= chunk:
        return whole
    aligns = [row_alignment(shape, c, opts.axis) for c in casts]
    if all(a is not None for a in aligns):
        row = ref.numel // shape[0]
        align = math.lcm(*(a for a in aligns if a is not None))
        return _Slicing(0, _ranges(shape[0], row, chunk, piece_alignment(row, chunk, align)))
    if len(shape) < 2 or ref.nbytes > opts.whole_bytes:
        return whole  # one channel is the whole tensor, or it is read whole anyway
    # each channel is a fibre along dim 0: cutting the last dim keeps it whole, and the held
    # tensor's transposed copy (for the cast's rows) is then made one slice at a time
    columns = _ranges(shape[-1], ref.numel // shape[-1], chunk,
                      math.lcm(*(column_alignment(c) for c in casts)))
    return _Slicing(-1, columns) if len(columns) > 1 else whole  # (one tile spans it)


def _widen(x: Tensor, device: Device) -> Tensor:
    """Exact widening: half-width floats to float32 (float64 stays float64), in one copy
    onto the scan's device."""
    return x.to(device=device.value, dtype=working_dtype(x.dtype))


Source = str | Path | Held
"""What a scan measures: a path (a file or a folder, read as the command reads it), or named
tensors in memory."""


def open_source(source: Source, include: Sequence[str] = (), exclude: Sequence[str] = (),
                layout: str | None = None) -> Inputs:
    """The selected tensors of one source, listed (no tensor data read)."""
    if isinstance(source, Held):
        return source.open(include, exclude, layout)
    return open_inputs([source], include, exclude, layout)


def source_label(source: Source) -> str:
    """A source as its rows name it: the path as given, or the name of tensors in memory."""
    return source.name if isinstance(source, Held) else str(source)


def source_name(ref: TensorRef) -> str:
    """The name of a file's source for the stochastic draws: the file's name without its
    folder and its suffix (``model`` for ``ckpt/model.safetensors``), the name a bare tensor
    of it is given and the ``name`` under which the same tensors in memory give the same
    draws."""
    return Path(ref.source).stem


def draw_seed(seed: int, source: str, tensor: str, *parts: object) -> int:
    """The seed of one stochastic draw: of (seed, source name, tensor name) and the cast, draw
    and slice it is for; independent of the order they run in, of the folder a file is read
    from and of whether the tensor came from a file or from memory."""
    text = "/".join(str(p) for p in (seed, source, tensor, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _error_sums(x: Tensor, mean: Tensor, base: CastStats) -> CastStats:
    """``base`` with its error sums replaced by those of ``mean`` (the expected cast)."""
    _, e, xv = error_terms(x, mean)
    xx, ee, ex, e_sum = (float(t) for t in error_sums(e, xv))
    return dataclasses.replace(base, xx=xx, ee=ee, ex=ex, e_sum=e_sum)


def _with_chunk(opts: ScanOptions) -> ScanOptions:
    return opts if opts.chunk_elements is not None else \
        dataclasses.replace(opts, chunk_elements=CHUNK_ELEMENTS)


@dataclass(frozen=True)
class _Plan:
    """How one tensor is read for its casts: where it is cut, whether it is held (read whole
    once, cut in memory), and every read it makes from its file, in order."""

    slicing: _Slicing
    held: bool
    need_amax: bool
    """Whether the casts need the whole tensor's amax before its slices (read first for it)."""
    rht: tuple[int, ...]
    """The casts (by index) that need the amax of the transformed tensor, each read for it."""
    fused_all: bool
    """Whether the fused pass takes every cast (:func:`clip_pass_takes`)."""
    chunk: int
    """The run length of the amaxes the casts the fused pass leaves share (0: none)."""
    reads: tuple[Read, ...]
    """The reads from the file. Those a tensor's amax is read from (a held tensor's one read,
    the first pass over a sliced one's slices, a one-slice tensor's read for its fused pass)
    take it as the rows land (:attr:`Read.amax`) where the rows are float32 on the CPU as read:
    off the pass's path where the read is ahead of it."""


def _plan(ref: TensorRef, casts: Sequence[Cast], opts: ScanOptions, rounded: bool) -> _Plan:
    """The :class:`_Plan` of ``ref`` under ``casts`` (``opts.chunk_elements`` set)."""
    slicing = _slices(ref, casts, opts)
    slices = slicing.ranges
    by_rows = slicing.dim == 0
    # cuts of the last dim are only ever taken from the held tensor (the reader reads rows)
    held = len(slices) > 1 and (ref.nbytes <= opts.whole_bytes or not by_rows)
    need_amax = len(slices) > 1 and any(_needs_tensor_amax(c) for c in casts)
    rht = tuple(ci for ci, c in enumerate(casts)
                if need_amax and c.rht is not None and _needs_tensor_amax(c))
    # runs of the flattened tensor are not runs of a slice of its last dim; clip_stats'
    # fused pass reads its own
    stored = torch_dtype(ref.dtype)
    fused_all = opts.device is Device.CPU and stored is not None and \
        clip_pass_takes(tuple(ref.shape), working_dtype(stored), casts, opts.axis, rounded)
    chunk = _facts_chunk(ref, casts, opts, slices) if by_rows and not fused_all else 0
    # the amax as the rows land: of rows the scan takes as read (float32 on the CPU: no
    # widened copy), for a held tensor's casts, the first pass over a sliced one's or a
    # one-slice tensor's fused pass
    as_read = opts.device is Device.CPU and stored is torch.float32
    if held:
        return _Plan(slicing, True, need_amax, rht, fused_all, chunk,
                     (Read(0, ref.shape[0], ref.nbytes, as_read and need_amax and not chunk),))
    row_bytes = ref.nbytes // max(1, ref.shape[0] if ref.shape else 1)
    slice_bytes = max(b - a for a, b in slices) * row_bytes if by_rows else ref.nbytes
    one = as_read and len(slices) == 1 and fused_all and \
        any(_needs_tensor_amax(c) for c in casts)
    # a pass over the slices for the tensor's amax, one per rht= cast for its transform's,
    # then the pass that counts
    first = [Read(a, b, slice_bytes, as_read) for a, b in slices] if need_amax else []
    again = [Read(a, b, slice_bytes) for _ in rht for a, b in slices]
    return _Plan(slicing, False, need_amax, rht, fused_all, chunk,
                 (*first, *again, *(Read(a, b, slice_bytes, one) for a, b in slices)))


def _tensor_results(inp: str, ref: TensorRef, casts: Sequence[Cast], opts: ScanOptions,
                    rounded: bool, reads: Reads, advance: Callable[[int], None],
                    seed_name: str) -> list[Result]:
    """Every cast of one tensor, reading it slice by slice as :func:`_plan` says, from
    ``reads``; without ``rounded``, only what needs no rounding (one draw: clipping does not
    depend on it). ``advance`` is told the tensor's bytes done after each slice;
    ``seed_name`` is its source's name for the draws."""
    opts = _with_chunk(opts)
    plan = _plan(ref, casts, opts, rounded)
    slices = plan.slicing.ranges
    by_rows = plan.slicing.dim == 0
    whole, whole_amax = reads.take(ref, plan.reads[0]) if plan.held else (None, None)
    planned = iter(() if plan.held else plan.reads)
    landed: list[float | None] = [None]  # the amax of the last rows read, where taken

    def read(start: int, stop: int) -> Tensor:
        if whole is not None:
            return _widen(whole[start:stop] if by_rows else whole[..., start:stop], opts.device)
        rows, landed[0] = reads.take(ref, next(planned))
        return _widen(rows, opts.device)

    chunk, need_amax = plan.chunk, plan.need_amax
    # the held tensor's run amaxes: its amax and every slice's share them. Only where it is
    # already the working dtype on the scan's device: a half-width tensor's float32 copy
    # would hold twice its bytes beside it (and the read ahead), so its slices widen their own
    same = whole is not None and opts.device is Device.CPU and \
        whole.dtype == working_dtype(whole.dtype)
    wide_whole = whole if same and (chunk or need_amax) and whole_amax is None else None
    runs = None if wide_whole is None else run_amax(wide_whole, chunk)
    amax = whole_amax
    rht_amax: dict[int, float] = {}
    # a scale arithmetic whose amax lets NaN or inf through reads the tensor's amax its way
    policies = {ci: c.scaling.arithmetic.amax for ci, c in enumerate(casts)
                if c.rht is None and _needs_tensor_amax(c) and
                c.scaling.arithmetic.amax is not AmaxPolicy.FINITE}
    cast_amax: dict[int, float] = {}
    if need_amax:
        # one slice is the whole tensor, and a cast reads its own amax
        if whole is not None:
            cast_amax = {ci: policy_amax(whole, p) for ci, p in policies.items()}
        if amax is None and wide_whole is not None:
            amax = finite_amax(wide_whole, runs)
        elif amax is None:
            tops: list[float] = []
            seen: dict[int, list[float]] = {ci: [] for ci in policies}
            for a, b in slices:
                rows = read(a, b)
                tops.append(_landed_amax(rows, landed))
                for ci, p in policies.items():
                    seen[ci].append(policy_amax(rows, p))
            amax = max(tops)
            cast_amax = {ci: combined_amax(v) for ci, v in seen.items()}
        for ci in plan.rht:  # an rht= cast reads the transformed tensor's amax
            rht_amax[ci] = max(finite_amax(transformed(read(a, b), casts[ci], opts.axis))
                               for a, b in slices)
    del wide_whole
    row_elems = ref.numel // ref.shape[0] if ref.shape and ref.shape[0] else 1
    n_draws = [_n_draws(c, opts) if rounded else 1 for c in casts]
    parts: list[list[list[CastStats]]] = [[[] for _ in range(n)] for n in n_draws]
    expected: list[list[CastStats]] = [[] for _ in casts]
    diffs: list[list[DiffStats]] = [[] for _ in casts]
    extent = slices[-1][1] or 1  # the length of the dimension the slices cut
    for start, stop in slices:
        x = read(start, stop)
        own = None if runs is None else \
            runs[start * row_elems // chunk:stop * row_elems // chunk]
        # every cast the fused pass takes, in one read of the slice (a stochastic one needs
        # its values for the expected cast: cast_stats gives them)
        # (a one-slice tensor's amax, taken as it landed, is the pass's own first read's)
        if not need_amax:  # the slice is the tensor
            cast_amax = {ci: policy_amax(x, p) for ci, p in policies.items()}
        fused = fused_stats(x, list(casts), axis=opts.axis, rounded=rounded,
                            tensor_amax=amax if amax is not None else landed[0],
                            rht_amax=rht_amax, cast_amax=cast_amax)
        facts = slice_facts(x, chunk, own) if len(fused) < len(casts) else None
        for ci, c in enumerate(casts):
            n = n_draws[ci]
            if ci in fused:
                parts[ci][0].append(fused[ci])
                n = 0
            total: Tensor | None = None
            first: CastStats | None = None
            for d in range(n):
                seed = draw_seed(opts.seed, seed_name, ref.name, c, d, start)
                sr = rounded and c.rounding is Rounding.SR
                st, q = cast_stats(x, c, axis=opts.axis,
                                   tensor_amax=cast_amax.get(ci, rht_amax.get(ci, amax)),
                                   seed=seed if sr else None,
                                   want_values=sr, rounded=rounded, facts=facts)
                parts[ci][d].append(st)
                if q is not None and sr:
                    total = q.double() if total is None else total + q.double()
                    first = first or st
            if total is not None and first is not None:
                # an rht= cast's values are the transform's: its errors are against that
                expected[ci].append(_error_sums(transformed(x, c, opts.axis), total / n, first))
            if opts.compare and ci:
                diffs[ci].append(cast_diff_stats(x, casts[0], c, opts.axis, amax))
        advance(ref.nbytes * stop // extent)
    out: list[Result] = []
    for ci, c in enumerate(casts):
        draws = tuple(CastStats.merge(p, _per_tensor(c)) for p in parts[ci])
        exp = CastStats.merge(expected[ci], _per_tensor(c)) if expected[ci] else None
        diff = DiffStats.merge(diffs[ci]) if opts.compare and ci else None
        out.append(Result(inp, ref, ref.source, c, draws, exp, diff=diff))
    return out


def _landed_amax(x: Tensor, landed: list[float | None]) -> float:
    """The amax of ``x``, the rows last read: as it was taken when they landed, if it was."""
    return landed[0] if landed[0] is not None else finite_amax(x)


def _facts_chunk(ref: TensorRef, casts: Sequence[Cast], opts: ScanOptions,
                 slices: list[tuple[int, int]]) -> int:
    """The run length whose amaxes every flat layout among ``casts`` (a tensor scale, blocks
    along the last axis) is made of, dividing every slice; 0 when there is none worth a
    pass of its own."""
    shape = ref.shape
    runs = [k for c in casts if (k := run_length(shape, c, opts.axis))]
    if not runs:
        return 0
    row = ref.numel // shape[0] if shape[0] else 1
    chunk = math.gcd(*runs, *((b - a) * row for a, b in slices))
    return chunk if chunk >= MIN_RUN else 0


MIN_RUN = 8
"""Shorter runs share too little to be worth their own pass: each cast then reads its own."""


def _n_draws(c: Cast, opts: ScanOptions) -> int:
    return opts.draws if c.rounding is Rounding.SR else 1


@dataclass(frozen=True)
class Scan:
    """What a scan found: results per tensor and cast, and what it left out."""

    results: tuple[Result, ...]
    skipped: dict[str, int]
    """Per input: tensors skipped because they are not floating point."""
    inputs: tuple[Inputs, ...]
    names: dict[str, str] = dataclasses.field(default_factory=dict)
    """Each cast's canonical spec → the text it was given as (a preset), for the rows'
    ``cast_name``."""

    @property
    def files(self) -> list[Path]:
        """Every file read, for provenance."""
        return [f for i in self.inputs for f in i.files]

    @property
    def errors(self) -> list[Result]:
        """Results that could not be measured."""
        return [r for r in self.results if r.error is not None]


class NothingToMeasure(DriftError):
    """No input holds a selected floating-point tensor: a scan would write an empty table."""


def nothing_to_measure(inp: str, inputs: Inputs) -> str | None:
    """Why ``inp`` gives the scan nothing to measure (no selected floating-point tensor and
    no file that failed), or None when it does."""
    if inputs.errors or any(r.is_float for r in inputs.tensors):
        return None
    if not inputs.tensors:
        return (f"no tensor of {inp} is selected (--include/--exclude left out all "
                f"{inputs.excluded}); loosen the globs")
    dtypes = ", ".join(sorted({r.dtype for r in inputs.tensors}))
    return (f"no floating-point tensors in {inp} ({len(inputs.tensors)} skipped: dtypes "
            f"{dtypes}); drift measures float tensors only")


def _check_device(device: Device) -> None:
    if device is Device.CUDA and not torch.cuda.is_available():
        raise DriftError("--device cuda: no CUDA device is available here; use --device cpu")


@dataclass(frozen=True)
class TensorUnit:
    """One tensor of a scan under every cast: the work unit an engine runs (it pickles, so it
    can run in a worker process or on a cluster node)."""

    input: str
    ref: TensorRef
    casts: tuple[Cast, ...]
    options: ScanOptions
    rounded: bool
    source_name: str | None = None
    """The source's name for the stochastic draws; None: that of the tensor's file
    (:func:`source_name`)."""

    def key(self) -> str:
        """Everything the unit's results depend on, its file's stamp included (the manifest's
        name for them; see :mod:`driftcli.engines`), and the source name that seeds its draws
        (units kept before draws were seeded by it, by the file's path, are not taken)."""
        ref = self.ref
        return (f"scan|{self.input}|{engines.stamp(ref.source)}|{ref.name}|{ref.dtype}|"
                f"{list(ref.shape)}|{[str(c) for c in self.casts]}|{self.options}|{self.rounded}"
                f"|seeds={self.source_name or source_name(ref)}")

    def check_kept(self, results: object) -> str | None:
        """Why ``results``, a kept unit read back under ``--resume``, cannot be this unit's
        (see :meth:`driftcli.engines.Manifest.get`), or None: one result per cast, of this
        tensor and cast, and counts within the tensor's elements (:meth:`CastStats.problem`)."""
        if not (isinstance(results, list) and len(results) == len(self.casts)
                and all(isinstance(r, Result) for r in results)):
            return f"not {len(self.casts)} results, one per cast"
        for r, c in zip(results, self.casts, strict=True):
            if r.ref != self.ref or r.input != self.input or str(r.cast) != str(c):
                return f"a result of another tensor or cast than {self.ref.name} under {c}"
            if r.error is None and not 1 <= len(r.draws) <= max(1, self.options.draws):
                return f"{len(r.draws)} draws of {c}"
            for st in (*r.draws, *([r.expected] if r.expected is not None else [])):
                if (why := st.problem(self.ref.numel)) is not None:
                    return f"{self.ref.name} under {c}: {why}"
        return None


_WORKER_STAGING = Staging(finite_amax)
"""The byte buffer of a worker process's reads, kept between its units (a serial scan has its
own for the scan's length)."""


def _refused(unit: TensorUnit) -> dict[Cast, str]:
    """The unit's casts whose transform cannot run on its tensor's shape, and why."""
    return {c: why for c in unit.casts
            if (why := rht_problem(c.rht, tuple(unit.ref.shape), unit.options.axis))}


def unit_reads(unit: TensorUnit) -> tuple[Read, ...]:
    """Every read :func:`scan_unit` makes of the unit's tensor, in order (none where no cast
    can run on it): what a :class:`~driftcli.io.readahead.ReadAhead` reads ahead."""
    refused = _refused(unit)
    casts = [c for c in unit.casts if c not in refused]
    return _plan(unit.ref, casts, _with_chunk(unit.options), unit.rounded).reads \
        if casts else ()


def scan_unit(unit: TensorUnit, advance: Callable[[int], None] | None = None,
              reads: Reads = _WORKER_STAGING) -> list[Result]:
    """Every cast of one tensor: its results, or an error result per cast when it cannot be
    read. ``advance`` is told the tensor's bytes done after each slice (serial scans);
    ``reads`` gives the reads :func:`unit_reads` lists, in that order."""
    refused = _refused(unit)
    casts = [c for c in unit.casts if c not in refused]
    try:
        done = iter(_tensor_results(unit.input, unit.ref, casts, unit.options, unit.rounded,
                                    reads, advance or (lambda within: None),
                                    unit.source_name or source_name(unit.ref))
                    if casts else [])
    except ReadError as err:
        return [Result(unit.input, unit.ref, unit.ref.source, c, (), None, str(err))
                for c in unit.casts]
    # a cast whose transform cannot run on this tensor's shape is an error row; the others
    # keep their results, in the scan's cast order
    return [Result(unit.input, unit.ref, unit.ref.source, c, (), None, refused[c])
            if c in refused else next(done) for c in unit.casts]


def scan(paths: Sequence[Source], casts: Sequence[Cast | str], *,
         options: ScanOptions | None = None, include: Sequence[str] = (),
         exclude: Sequence[str] = (), progress: Progress | None = None,
         rounded: bool = True, on_open: Callable[[list[Path]], None] | None = None,
         execution: Execution | None = None, layout: str | None = None) -> Scan:
    """Cast every selected floating-point tensor of ``paths`` (files, folders, tensors in
    memory: :data:`Source`) with every cast and count.

    ``rounded=False`` counts only what needs no rounding (see
    :func:`driftcli.measures.stats.cast_stats`): what clip-rate needs, several times faster.
    ``on_open`` is called with every file the scan reads (:attr:`Scan.files`) once all are
    open, before the first tensor is read: the command starts hashing them then.
    ``execution`` runs the tensors (one :class:`TensorUnit` each) on an engine; every engine
    gives the same results in the same order (see :mod:`driftcli.engines`).
    ``layout`` names the layout of pre-quantized weights where a checkpoint's config and
    tensor names leave it in doubt (:func:`driftcli.io.readers.open_inputs`).

    Missing paths and folders without tensor files raise at once; a file or tensor that
    cannot be read becomes a :class:`Result` with ``error`` set and the rest go on.
    """
    if not casts:
        raise DriftError("no cast given; add --cast SPEC (a preset such as mxfp8_e4m3, "
                         "see drift formats --presets)")
    options = options or ScanOptions()
    execution = execution or Execution()
    if options.draws < 1:
        raise DriftError(f"--draws must be at least 1, not {options.draws}")
    _check_device(options.device)
    parsed = tuple(parse_cast(c) for c in casts)
    for c in parsed:  # tc= beside rht= names a tensor core: refused before anything is read
        check_core(c.rht)
    opened = [(source_label(p), open_source(p, include, exclude, layout)) for p in paths]
    empty = {inp: why for inp, inputs in opened if (why := nothing_to_measure(inp, inputs))}
    if len(empty) == len(opened):
        raise NothingToMeasure("; ".join(empty.values()))
    todo = total_bytes([i for _, i in opened])
    if on_open is not None:
        on_open([f for _, i in opened for f in i.files])
    # rht=checkpoint: each tensor's own casts, its layer's signs read in (refused at once, in
    # one line, where a layer has none); the results keep the spec as given
    vectors = {source_label(p): rht_signs.sign_vectors(open_source(p, (), (), layout).tensors)
               for p in paths} if rht_signs.needs_signs(parsed) else {}
    names = {source_label(p): p.name for p in paths if isinstance(p, Held)}
    units = [TensorUnit(inp, ref, rht_signs.resolve(parsed, ref, vectors.get(inp, {})),
                        options, rounded, names.get(inp))
             for inp, inputs in opened for ref in inputs.tensors if ref.is_float]
    if execution.engine is Engine.SERIAL:
        per_unit = _serial(units, todo, progress, execution.resume,
                           [unit.input in names for unit in units])
    else:
        failed: list[str] = []

        def noted(done: int, total: int, name: str) -> None:
            if progress is not None:
                progress(done, total, f"{name} ({len(failed)} failed)" if failed else name)

        def checked(unit: TensorUnit, result: list[Result]) -> None:
            if any(r.error is not None for r in result):
                failed.append(unit.ref.name)

        per_unit = engines.run(units, scan_unit, execution, progress=noted,
                               label=lambda u: u.ref.name, size=lambda u: u.ref.nbytes,
                               on_result=checked)
    found = iter(per_unit)
    results: list[Result] = []
    skipped: dict[str, int] = {}
    for inp, inputs in opened:
        for e in [*inputs.errors, *([InputError(inp, empty[inp])] if inp in empty else [])]:
            results.extend(Result(inp, None, e.source, c, (), None, e.message, e.tensor)
                           for c in parsed)
        skipped[inp] = sum(not ref.is_float for ref in inputs.tensors)
        for _ in (ref for ref in inputs.tensors if ref.is_float):
            results.extend(dataclasses.replace(r, cast=c)
                           for r, c in zip(next(found), parsed, strict=True))
    return Scan(tuple(results), skipped, tuple(i for _, i in opened),
                {str(p): c for c, p in zip(casts, parsed, strict=True) if isinstance(c, str)})


def _serial(units: Sequence[TensorUnit], todo: int, progress: Progress | None,
            kept: Path | None, in_memory: Sequence[bool]) -> list[list[Result]]:
    """The units one after another in this process, the bar moving after every slice (as
    :func:`driftcli.engines.run` does, with the finished units ``kept`` there). With
    :data:`READ_AHEAD_BYTES`, a reader thread reads each slice while the one before it is
    counted (not under ``--resume``, whose kept units are not read, nor where a unit's tensor
    is in memory, ``in_memory``)."""
    manifest = engines.Manifest(kept) if kept is not None else None
    jobs = [Job(n, unit.ref, r) for n, unit in enumerate(units) for r in unit_reads(unit)] \
        if READ_AHEAD_BYTES is not None and manifest is None and not any(in_memory) else []
    ahead = len(jobs) > 1 and sum(j.read.nbytes for j in jobs) >= (READ_AHEAD_BYTES or 0)
    with ReadAhead(jobs, finite_amax) if ahead else \
            contextlib.nullcontext(Staging(finite_amax)) as reads:
        return _each(units, todo, progress, manifest, reads)


def _each(units: Sequence[TensorUnit], todo: int, progress: Progress | None,
          manifest: engines.Manifest | None, reads: Reads) -> list[list[Result]]:
    out: list[list[Result]] = []
    done = 0
    keys = [unit.key() for unit in units] if manifest is not None else []
    for n, unit in enumerate(units):
        def advance(within: int, before: int = done, unit: TensorUnit = unit) -> None:
            if progress is not None:
                progress(before + within, todo, unit.ref.name)

        found, kept = (manifest.get(keys[n], unit.check_kept) if manifest is not None
                       else (False, None))
        result: list[Result] = (cast(list[Result], kept) if found
                                else scan_unit(unit, advance, reads))
        reads.done(n)
        if not found and manifest is not None:
            manifest.put(keys[n], result)
        out.append(result)
        advance(unit.ref.nbytes)  # also for a tensor that failed part way
        done += unit.ref.nbytes
    return out


def total_bytes(scan_inputs: Sequence[Inputs]) -> int:
    """Bytes of the floating-point tensors a scan will read (for a progress bar)."""
    return sum(r.nbytes for i in scan_inputs for r in i.tensors if r.is_float)


def iter_groups(s: Scan) -> Iterator[tuple[str, Cast, list[Result]]]:
    """The measured results of each (input, cast), in input then cast order."""
    keys: dict[tuple[str, str], tuple[str, Cast, list[Result]]] = {}
    for r in s.results:
        key = (r.input, str(r.cast))
        if key not in keys:
            keys[key] = (r.input, r.cast, [])
        if r.error is None:
            keys[key][2].append(r)
    yield from keys.values()
