"""``drift inspect``: what a pre-quantized checkpoint's codes and scales hold, one row per
quantized weight, with lints for the conventions that go silently wrong.

Counts are made on the stored codes and the decoded scales (never on a float copy): codes
at the element format's largest magnitude (what saturated when the weight was quantized),
zero and NaN codes, blocks whose every code is zero, the scales' range, their distinct
exponents, those in the scale format's subnormal range, and whether every scale is a power
of two. The lints:

- ``lint_pow2``: the layout declares power-of-two scales (ue8m0, E8M0) and holds some that
  are not;
- ``lint_magnitude``: the dequantized weight's RMS is over 1,000 times off the median RMS of
  the checkpoint's 2-D tensors, itself included (a divisor read as a multiplier, scales not
  decoded); null with fewer than three;
- ``lint_nan_scales``: NaN (or infinite) scales;
- ``lint_zero_blocks``: blocks whose every code is zero;
- ``lint_negative_scales``: scales below zero;
- ``lint_zero_scales``: a zero scale over a block holding a nonzero code.

The per-element counts are made a chunk of rows at a time (:data:`CHUNK_ELEMENTS`), so a
weight costs its scales and a bounded work area, whatever its size.

``scale_rules`` names the power-of-two rules every E8M0 block scale is consistent with.
``requant`` presets (``--requant``) quantize the dequantized weight again and count the
blocks the preset would not have written as stored (its rule, for no amax the block's codes
allow), the elements whose code or value changes in them, and the blocks the round trip
rescales. See ``docs/inspect.md``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from driftcli.errors import DriftError
from driftcli.io.readers import ReadError, TensorRef, open_inputs
from driftcli.io.readers.collect import twins_skipped
from driftcli.io.readers.quantized_weight import (
    Layout,
    LibraryOrder,
    Order,
    QuantSpec,
    element_values,
    scale_values,
    spec_of,
    stored_scale_format,
    unpack_codes,
    weight_ref,
)
from driftcli.io.tables import column
from driftcli.oracle.scaling import EXACT_RULES, ExponentRule
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import Format, Kind, get_format, pow2
from driftcli.records.modes import Rounding, ScaleRule

MAGNITUDE_FACTOR = 1000.0
"""How far a weight's RMS may sit from the median RMS of the checkpoint's other 2-D
tensors before ``lint_magnitude`` fires: trained layers differ by tens, a wrong scale
convention by the square of a global scale or 2**100."""

MIN_TENSORS = 3
"""2-D tensors a checkpoint needs (quantized or not) for ``lint_magnitude`` to judge."""

_SUBNORMAL_BELOW = {"float32": 2.0 ** -126, "bfloat16": 2.0 ** -126, "float16": 2.0 ** -14,
                    "float8_e4m3fn": 2.0 ** -6, "e8m0": 0.0}
"""Where a scale format's normals start (E8M0 has no subnormals)."""


def _opt(doc: str) -> Any:
    """A nullable column, null unless set (most are null for a weight that fails)."""
    return column(doc, default=None)


@dataclass(frozen=True)
class InspectRow:
    """One quantized weight (and one ``--requant`` preset, where given)."""

    TABLE: ClassVar[str] = "inspect"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "tensor", "requant")
    HEADLINE: ClassVar[str] = "max_code_rate"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    source: str = column("File holding the weight's codes")
    tensor: str = column("The weight's own name (its scale tensors are not rows)")
    layout: str | None = _opt("Quantized layout (--layout): deepseek-fp8, mxfp8, ct-fp8, "
                                "ct-nvfp4, modelopt-nvfp4, gpt-oss-mxfp4, ct-mxfp4, mxfp4, "
                                "mxfp6-e2m3, mxfp6-e3m2")
    element_format: str | None = _opt("Element format of the codes")
    scale_format: str | None = _opt("How the scales are stored: float32, bfloat16, "
                                      "float8_e4m3fn, or e8m0 (bytes 2**(b-127))")
    block: str | None = _opt("Rows x columns one scale covers, e.g. 128x128 or 1x32")
    global_scale: str | None = _opt("multiplier or divisor (NVFP4), null where there is none")
    shape: str | None = _opt("Shape of the dequantized weight as a JSON list")
    numel: int | None = _opt("Elements")
    max_codes: int | None = _opt("Codes at the element format's largest magnitude "
                                   "(saturated when quantized)")
    max_code_rate: float | None = _opt("max_codes / elements")
    zero_codes: int | None = _opt("Codes that are +0 or -0")
    nan_codes: int | None = _opt("NaN codes")
    n_blocks: int | None = _opt("Scales (blocks) of the weight")
    zero_blocks: int | None = _opt("Blocks whose every code is zero")
    scale_min: float | None = _opt("Smallest finite scale")
    scale_max: float | None = _opt("Largest finite scale")
    scale_exponents: int | None = _opt("Distinct binary exponents among the finite nonzero "
                                         "scales")
    subnormal_scales: int | None = _opt("Nonzero scales in the scale format's subnormal "
                                          "range")
    nan_scales: int | None = _opt("NaN or infinite scales")
    negative_scales: int | None = _opt("Finite scales below zero")
    zero_scales: int | None = _opt("Scales that are zero")
    scales_pow2: bool | None = _opt("Whether every finite nonzero scale is a power of two")
    pow2_declared: bool | None = _opt("Whether the layout declares power-of-two scales "
                                        "(ue8m0, E8M0)")
    rms: float | None = _opt("RMS of the dequantized weight (exact, float64)")
    order_differs: int | None = _opt("Elements whose float32 value differs between the "
                                       "exact order and the library's (--order library); "
                                       "null where the library's decoder rounds nothing "
                                       "before the output")
    lint_pow2: bool | None = _opt("Lint: power-of-two scales declared, some are not")
    lint_magnitude: bool | None = _opt("Lint: RMS over 1,000x off the median RMS of the "
                                       "checkpoint's 2-D tensors (null: fewer than 3)")
    lint_nan_scales: bool | None = _opt("Lint: NaN or infinite scales")
    lint_negative_scales: bool | None = _opt("Lint: scales below zero")
    lint_zero_scales: bool | None = _opt("Lint: a zero scale over a block holding a nonzero "
                                         "code")
    lint_zero_blocks: bool | None = _opt("Lint: blocks whose every code is zero")
    scale_rules: str | None = _opt("Power-of-two scale rules every block's E8M0 scale is "
                                     "consistent with (floor, ceil, even, ceil-amax, "
                                     "even-e2m1; none: no rule fits); null for other scales")
    requant: str | None = _opt("Preset the weight was quantized again with (--requant); "
                                 "null without")
    requant_changed_blocks: int | None = _opt("Blocks whose scale the preset would not have "
                                              "written (a power-of-two rule: for no amax its "
                                              "codes allow; a two-level scale: its block "
                                              "scale, the tensor scale aside; all-zero blocks "
                                              "not counted); null where its blocks are not "
                                              "the layout's")
    requant_rescaled_blocks: int | None = _opt("Blocks whose scale the preset, run on the "
                                               "dequantized weight, changes (a round trip: "
                                               "the ceil rules' flip); null where its blocks "
                                               "are not the layout's")
    requant_changed_codes: int | None = _opt("Elements whose code the preset changes (none "
                                               "in a block it would have written as stored); "
                                               "null where its element format is not the "
                                               "layout's")
    requant_changed_values: int | None = _opt("Elements whose value the preset changes (none "
                                                "in a block it would have written as stored)")
    error: str | None = _opt("Why this weight could not be inspected; null when it was")


@dataclass(frozen=True)
class Finding:
    """One lint that fired, for the terminal."""

    tensor: str
    lint: str
    message: str


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect` found."""

    rows: tuple[InspectRow, ...]
    findings: tuple[Finding, ...]
    files: tuple[Path, ...]
    errors: tuple[str, ...]
    """Inputs or weights that could not be read."""
    notices: tuple[str, ...] = ()
    """Configs naming a quantization drift does not know (their weights read by name), and
    torch files left unread beside the same weights in safetensors."""


def _codes(spec: QuantSpec, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The stored codes of rows ``[start, stop)`` (of dim 0) as int64, shaped like the
    dequantized weight's rows."""
    return unpack_codes(spec.codes.read(start, stop), spec)


CHUNK_ELEMENTS = 1 << 18
"""Elements inspected at a time: the per-element work (codes as int64, their decoded and
dequantized values in float64, the comparisons) peaks near 200 bytes each, so a weight of
any size costs some tens of MiB beside its scales (``docs/inputs.md``)."""


def _chunks(spec: QuantSpec) -> list[tuple[int, int]]:
    """Row ranges (of dim 0) of about :data:`CHUNK_ELEMENTS` elements, whole block rows of a
    2-D weight where a block row fits."""
    rows = spec.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(math.prod(spec.shape[1:]), 1))
    if len(spec.shape) == 2 and step > spec.block[0]:
        step -= step % spec.block[0]
    return [(at, min(at + step, rows)) for at in range(0, rows, step)]


def _all_zero_into(mask: torch.Tensor, zero: torch.Tensor, block: tuple[int, int],
                   row0: int) -> None:
    """AND the rows of ``zero`` (rows ``row0..`` of the last-but-one dim) into ``mask``, one
    bool per block of ``block`` (edges partial): True while every element seen is zero.
    Never pads rows to a whole block: a block of 2^24 rows costs the rows seen."""
    *lead, r, c = zero.shape
    br, bc = block
    gc = mask.shape[-1]
    cols = torch.ones(*lead, r, gc * bc, dtype=torch.bool)
    cols[..., :c] = zero
    per_row = cols.reshape(*lead, r, gc, bc).all(-1)
    first, last = row0 // br, (row0 + r - 1) // br
    if last - first < 3:  # a chunk within a few blocks: each block's rows at once
        for b in range(first, last + 1):
            a, z = max(b * br - row0, 0), min((b + 1) * br - row0, r)
            mask[..., b, :] &= per_row[..., a:z, :].all(-2)
        return
    # whole blocks in between: pad the chunk to block edges (under 2 x its rows)
    off = row0 - first * br
    pad = torch.ones(*lead, (last - first + 1) * br, gc, dtype=torch.bool)
    pad[..., off:off + r, :] = per_row
    mask[..., first:last + 1, :] &= pad.reshape(*lead, last - first + 1, br, gc).all(-2)


def _per_block_all_zero(zero: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per block of ``block`` over the last two dims (edges partial): every element zero."""
    *lead, r, c = zero.shape
    br, bc = min(block[0], r), min(block[1], c)
    gr, gc = -(-r // br), -(-c // bc)
    pad = torch.ones(*lead, gr * br, gc * bc, dtype=torch.bool)
    pad[..., :r, :c] = zero
    return pad.reshape(*lead, gr, br, gc, bc).all(-1).all(-2)


def _scales(spec: QuantSpec) -> torch.Tensor:
    return scale_values(spec.scale.read(), spec.scale_format).reshape(-1)


def _requant(spec: QuantSpec, values: torch.Tensor, codes_vals: torch.Tensor,
             scales: torch.Tensor, preset: str) -> dict[str, int | None]:
    from driftcli.casts.quantization import QuantInfo, quantize

    cast_ = parse_cast(preset)
    info = quantize(values.float(), cast_, return_info=True)
    if not isinstance(info, QuantInfo):  # return_info always gives one
        raise TypeError("quantize did not return its info")
    s = cast_.scaling
    aligned = (s.granularity.value == "block" and spec.block == (1, s.block)
               and info.scales.numel() == scales.numel())
    # as the writer computed it: a power-of-two rule's block keeps its scale and codes where
    # the rule picks that scale for some amax its largest code allows (the amax is gone)
    kept = torch.zeros(values.shape, dtype=torch.bool)
    fits = None
    # (a global scale multiplies the block's: the codes then bound no single power of two)
    if (aligned and s.rule is not None and s.rule.power_of_two and s.scale_format is not None
            and spec.global_scale is None and s.scale_format == stored_scale_format(spec)
            and cast_.format == get_format(spec.element)):
        fits = _consistent(cast(ExponentRule, EXACT_RULES[s.rule]), s.headroom,
                           cast_.format, _block_maxima(codes_vals, s.block), scales,
                           s.scale_format)
        width = values.shape[-1]
        kept = fits.reshape(*values.shape[:-1], -1).repeat_interleave(s.block, -1)[..., :width]
    same_val = (info.values.double() == values) | (info.values.isnan() & values.isnan())
    out: dict[str, int | None] = {"requant_changed_values": int((~same_val & ~kept).sum()),
                                  "requant_changed_codes": None,
                                  "requant_changed_blocks": None,
                                  "requant_rescaled_blocks": None}
    if info.codes is not None and cast_.format == get_format(spec.element):
        c = info.codes.double()
        same = (c == codes_vals) | (c.isnan() & codes_vals.isnan())
        out["requant_changed_codes"] = int((~same & ~kept).sum())
    if aligned:
        mine = info.scales.double().reshape(-1)
        if spec.global_scale is not None and info.tensor_scale:
            # compared as the writer computed it: the block scale in its own format, the
            # float32 tensor scale (recomputed from the dequantized amax, a float32 step
            # off the stored one) aside; the preset's divisor is fl32(block x tensor scale),
            # so dividing the tensor scale back out and rounding recovers its block scale
            from driftcli.casts.rounding import round_to_format
            mine = round_to_format(mine / info.tensor_scale, spec.scale_format).double()
        # an all-zero block is the same whatever its scale: only the others can change
        live = ~_per_block_all_zero(codes_vals == 0, spec.block).reshape(-1)
        moved = (mine != scales) & live
        out["requant_rescaled_blocks"] = int(moved.sum())
        out["requant_changed_blocks"] = int((moved if fits is None else ~fits & live).sum())
    return out


SCALE_RULES: dict[str, ExponentRule] = {
    str(r): cast(ExponentRule, EXACT_RULES[r]) for r in ScaleRule if r.power_of_two}
"""The power-of-two scale rules ``scale_rules`` judges, by name: ``floor`` (OCP), ``ceil``
(NVIDIA's RCEIL, ModelOpt's MXFP4 and MXFP8 ``ceil(log2(amax / M))`` in exact arithmetic),
``even``, ``ceil-amax`` (torchao's CEIL) and ``even-e2m1`` (compressed-tensors')."""

NUDGE = Fraction(1, 1 << 80)
"""An open end of a code's span is judged this far (relatively) inside it: every rule's
thresholds and every span's ends are dyadic numbers of a few bits, so nothing lies between."""


def _spans(elem: Format) -> dict[float, tuple[Fraction, Fraction | None]]:
    """For each positive code magnitude of ``elem``, the smallest and largest amax (scale
    2**0) that round to it to nearest even: half-way to each neighbour, the half-way point
    included where the code is even; without end above the largest (saturation)."""
    code_of: dict[Fraction, int] = {}
    for c, v in elem.values():
        if v.kind is Kind.FINITE:
            code_of.setdefault(v.mag, c)
    grid = sorted(code_of)
    out: dict[float, tuple[Fraction, Fraction | None]] = {}
    for i, mag in enumerate(grid[1:], 1):
        inward = 0 if code_of[mag] % 2 == 0 else NUDGE
        low = (grid[i - 1] + mag) / 2 * (1 + inward)
        high = (mag + grid[i + 1]) / 2 * (1 - inward) if i + 1 < len(grid) else None
        out[float(mag)] = (low, high)
    return out


def _block_maxima(codes_vals: torch.Tensor, width: int) -> torch.Tensor:
    """Each 1 x ``width`` block's largest code magnitude (NaN codes as 0), flattened."""
    *lead, c = codes_vals.shape
    # a block wider than the row is the row: a config's group_size (2**40) padded to its
    # width would allocate terabytes
    width = min(width, max(c, 1))
    g = -(-c // width)
    pad = torch.zeros(*lead, g * width, dtype=torch.float64)
    pad[..., :c] = codes_vals.abs().nan_to_num(0.0)
    return pad.reshape(-1, width).amax(-1)  # (rows, g, width) in order; no -1 over g = 0


def _consistent(rule: ExponentRule, headroom: int, elem: Format, maxima: torch.Tensor,
                scales: torch.Tensor, scale_format: Format) -> torch.Tensor:
    """Per block, whether ``rule`` (plus ``headroom``, clamped to ``scale_format``'s powers of
    two) picks the stored scale 2**k (``scales``: their values, float64) for some amax that
    rounds to the block's largest code: the writer's amax is gone, its codes bound it. A
    power-of-two rule moves with amax's binade and is monotone in steps of one, so it fits
    where it gives at most k at the span's low end and at least k at its high end (or k is the
    clamp's bound). All-zero blocks and NaN scales fit; a scale that is no power of two never
    does."""
    v = scales.reshape(-1)
    power = torch.frexp(v).mantissa == 0.5  # v = 0.5 * 2**e: a positive power of two
    top = v == float(pow2(scale_format.emax))
    bottom = v == float(scale_format.smallest_positive)
    ok = (maxima == 0) | v.isnan()
    spans = _spans(elem)
    for m in maxima[~ok].unique().tolist():
        low, high = spans[m]
        at = (maxima == m) & ~ok
        fits_low = rule(low, elem) + headroom <= 0
        fits_high = high is None or rule(high, elem) + headroom >= 0
        ok |= at & power & (torch.tensor(fits_low) | top) & (torch.tensor(fits_high) | bottom)
    return ok


def _scale_rules(spec: QuantSpec, codes_vals: torch.Tensor, raw_scales: torch.Tensor
                 ) -> list[str] | None:
    """The rules every block's E8M0 scale is consistent with (:func:`_consistent`).
    ``codes_vals`` and ``raw_scales`` are the same rows of the weight and its scales (a
    chunk: the blocks are rows of one)."""
    if spec.scale_format != "e8m0" or spec.global_scale is not None or spec.block[0] != 1:
        return None
    maxima = _block_maxima(codes_vals, spec.block[1])
    elem = get_format(spec.element)
    stored = stored_scale_format(spec)
    if stored is None:  # e8m0 bytes are OCP's E8M0: never
        raise DriftError(f"{spec.name}: no format record for its {spec.scale_format} scales")
    values = scale_values(raw_scales, spec.scale_format)
    names = [n for n, rule in SCALE_RULES.items()
             if bool(_consistent(rule, 0, elem, maxima, values, stored).all())]
    return names


@dataclass
class _Tally:
    """What the chunks of one weight add up to."""

    max_codes: int = 0
    zero_codes: int = 0
    nan_codes: int = 0
    squares: float = 0.0
    finite: int = 0
    order_differs: int = 0

    def values(self, x: torch.Tensor) -> None:
        """Add the finite values of ``x`` to the sum of squares (for the RMS)."""
        x = x.double()
        x = x[torch.isfinite(x)]
        self.squares += float((x * x).sum())
        self.finite += x.numel()

    @property
    def rms(self) -> float:
        return math.sqrt(self.squares / self.finite) if self.finite else math.nan


def _rms_streamed(ref: TensorRef) -> float:
    """The RMS of a stored tensor's finite values, read a chunk of rows at a time."""
    tally = _Tally()
    rows = ref.shape[0] if ref.shape else 1
    step = max(1, CHUNK_ELEMENTS // max(math.prod(ref.shape[1:]), 1))
    for at in range(0, rows, step):
        tally.values(ref.read(at, at + step))
    return tally.rms


def _inspect_weight(ref: TensorRef, spec: QuantSpec) -> tuple[InspectRow, float]:
    fmt = get_format(spec.element)
    scales = _scales(spec)
    finite = scales[torch.isfinite(scales)]
    nonzero = finite[finite != 0]
    mant, exps = torch.frexp(nonzero) if nonzero.numel() else (nonzero, nonzero.long())
    numel = math.prod(spec.shape)
    block = spec.block if spec.scale.numel != 1 else (spec.shape[-2], spec.shape[-1])
    rows, cols = spec.shape[-2], spec.shape[-1]
    eff = (max(1, min(block[0], rows)), max(1, min(block[1], cols)))
    all_zero = torch.ones(*spec.shape[:-2], -(-rows // eff[0]), -(-cols // eff[1]),
                          dtype=torch.bool)
    nan_scales = int(scales.numel() - finite.numel())
    exact = weight_ref(replace(spec, out_dtype="float32"))
    library = (weight_ref(replace(spec, out_dtype="float32", order=Order.LIBRARY))
               if spec.library_order != LibraryOrder() else None)  # it rounds in between
    raw_scales = spec.scale.read() if spec.scale.numel != 1 else None
    # the rules every chunk's blocks fit (None: the weight's scales are not per-row E8M0)
    rules: list[str] | None = list(SCALE_RULES) if raw_scales is not None else None
    tally = _Tally()
    for start, stop in _chunks(spec):  # every per-element count a chunk at a time
        vals = element_values(_codes(spec, start, stop), spec.element)
        if rules is not None and raw_scales is not None:
            fit = _scale_rules(spec, vals, raw_scales[start:stop])
            rules = None if fit is None else [n for n in rules if n in fit]
        tally.max_codes += int((vals.abs() == float(fmt.max)).sum())
        zero = vals == 0
        tally.zero_codes += int(zero.sum())
        tally.nan_codes += int(vals.isnan().sum())
        del vals
        if len(spec.shape) == 2:
            _all_zero_into(all_zero, zero, eff, start)
        else:  # dim 0 leads (experts): the blocks tile the last two dims of each
            _all_zero_into(all_zero[start:stop], zero, eff, 0)
        del zero
        if nan_scales:
            continue  # the weight cannot be dequantized
        got = exact.read(start, stop)
        tally.values(got)
        if library is not None:
            lib = library.read(start, stop)
            tally.order_differs += int(((lib.view(torch.int32) != got.view(torch.int32))
                                        & ~(lib.isnan() & got.isnan())).sum())
    zero_blocks = int(all_zero.sum())
    pow2 = bool((mant.abs() == 0.5).all()) if nonzero.numel() else True
    below = _SUBNORMAL_BELOW.get(spec.scale_format, 0.0)
    negative = int((finite < 0).sum())
    zeros = int((finite == 0).sum())
    lost = _zero_scales_over_codes(scales, all_zero)
    row = InspectRow(
        source=ref.source, tensor=spec.name, layout=str(spec.layout),
        element_format=spec.element, scale_format=spec.scale_format,
        block=f"{block[0]}x{block[1]}",
        global_scale=None if spec.global_scale is None else
        "divisor" if spec.global_divides else "multiplier",
        shape=json.dumps(list(spec.shape)), numel=numel, max_codes=tally.max_codes,
        max_code_rate=tally.max_codes / numel if numel else None,
        zero_codes=tally.zero_codes, nan_codes=tally.nan_codes,
        n_blocks=scales.numel(), zero_blocks=zero_blocks,
        scale_min=float(finite.min()) if finite.numel() else None,
        scale_max=float(finite.max()) if finite.numel() else None,
        scale_exponents=int(torch.unique(exps).numel()),
        subnormal_scales=int((nonzero.abs() < below).sum()),
        nan_scales=nan_scales, negative_scales=negative, zero_scales=zeros,
        scales_pow2=pow2, pow2_declared=spec.pow2_declared,
        lint_pow2=spec.pow2_declared and not pow2, lint_nan_scales=nan_scales > 0,
        lint_negative_scales=negative > 0, lint_zero_scales=lost > 0,
        lint_zero_blocks=zero_blocks > 0,
        scale_rules=None if rules is None else ", ".join(rules) or "none")
    if nan_scales:
        return row, math.nan
    row = replace(row, rms=tally.rms,
                  order_differs=tally.order_differs if library is not None else None)
    return row, tally.rms


def _zero_scales_over_codes(scales: torch.Tensor, all_zero: torch.Tensor) -> int:
    """Zero scales whose block holds a nonzero code (its values all dequantize to 0). A zero
    scale over an all-zero block loses nothing (NVFP4 writers give those 0)."""
    zero = scales == 0
    if scales.numel() == all_zero.numel():
        return int((zero & ~all_zero.reshape(-1)).sum())
    if scales.numel() == 1:  # one scale for every block
        return int(zero.sum()) if not bool(all_zero.all()) else 0
    return int(zero.sum())


def inspect(paths: Sequence[str | Path], *, requant: Sequence[str] = (),
            layout: Layout | str | None = None, include: Sequence[str] = (),
            exclude: Sequence[str] = ()) -> Inspection:
    """One :class:`InspectRow` per quantized weight of ``paths`` (one per weight and
    ``requant`` preset where presets are given), the lints that fired, and the errors.

    A weight that cannot be read is a row with ``error`` set; the others are inspected.
    """
    for preset in requant:  # a bad preset fails before anything is read
        if parse_cast(preset).rounding is Rounding.SR:
            raise DriftError(f"--requant {preset}: a stochastic cast gives other codes on "
                             "every draw, so it cannot say what a writer changed; give it "
                             "with round-to-nearest (without :sr)")
    inputs = open_inputs(paths, include, exclude, layout=layout)
    errors = [f"{e.source}: {e.message}" if not e.message.startswith(e.source) else e.message
              for e in inputs.errors]
    rows: list[InspectRow] = []
    rms_of: list[float] = []
    others: list[float] = []
    for ref in inputs.tensors:
        spec = spec_of(ref)
        if spec is None:
            if ref.is_float and len(ref.shape) >= 2:
                try:
                    others.append(_rms_streamed(ref))
                except ReadError as exc:
                    errors.append(str(exc))
            continue
        try:
            row, rms = _inspect_weight(ref, spec)
        except ReadError as exc:
            errors.append(str(exc))
            rows.append(InspectRow(source=ref.source, tensor=spec.name, error=str(exc)))
            continue
        rows.append(row)
        rms_of.append(rms)
    rows = _magnitude_lint(rows, rms_of, others)
    if requant:
        rows = _with_requant(rows, inputs.tensors, requant)
    findings = tuple(f for r in rows if r.requant in (None, requant[0] if requant else None)
                     for f in _findings(r))
    return Inspection(tuple(rows), findings, inputs.files, tuple(errors),
                      (*inputs.notices, *twins_skipped(inputs)))


def _magnitude_lint(rows: list[InspectRow], rms_of: list[float],
                    others: list[float]) -> list[InspectRow]:
    # the median of every 2-D tensor (this weight among them): with three or more, one
    # wrong weight cannot move it far; with fewer there is nothing to judge against
    pool = [v for v in [*rms_of, *others] if math.isfinite(v) and v > 0]
    median = statistics.median(pool) if len(pool) >= MIN_TENSORS else None
    out = []
    for row in rows:
        if row.error is not None or row.rms is None:
            out.append(row)
        elif median is None or not math.isfinite(row.rms):
            out.append(replace(row, lint_magnitude=None))
        else:
            ratio = row.rms / median if row.rms > 0 else math.inf
            out.append(replace(row, lint_magnitude=not (1 / MAGNITUDE_FACTOR <= ratio
                                                        <= MAGNITUDE_FACTOR)))
    return out


def _with_requant(rows: list[InspectRow], tensors: Sequence[TensorRef],
                  presets: Sequence[str]) -> list[InspectRow]:
    refs = {(r.source, r.name): r for r in tensors}
    out = []
    for row in rows:
        ref = refs.get((row.source, row.tensor))
        spec = spec_of(ref) if ref is not None else None
        for preset in presets:
            if spec is None or row.error is not None or row.nan_scales:
                out.append(replace(row, requant=preset))
                continue
            if not math.prod(spec.shape):  # no elements: nothing changes (no block to count)
                same = parse_cast(preset).format.name == spec.element
                out.append(replace(row, requant=preset, requant_changed_values=0,
                                   requant_changed_codes=0 if same else None,
                                   requant_changed_blocks=0, requant_rescaled_blocks=0))
                continue
            # a two-level layout's weight is requantized as the preset computes it: the
            # combined scale rounded to float32 first (drift's nvfp4 and the libraries alike)
            order = Order.LIBRARY if spec.global_scale is not None else Order.EXACT
            values = weight_ref(replace(spec, order=order)).read().double()
            codes_vals = element_values(_codes(spec), spec.element)
            counts: dict[str, Any] = _requant(spec, values, codes_vals, _scales(spec), preset)
            out.append(replace(row, requant=preset, **counts))
    return out


def _findings(row: InspectRow) -> list[Finding]:
    found = []
    if row.lint_pow2:
        found.append(Finding(row.tensor, "lint_pow2", f"{row.layout} declares power-of-two "
                             "scales but some are not powers of two"))
    if row.lint_nan_scales:
        found.append(Finding(row.tensor, "lint_nan_scales", f"{row.nan_scales} NaN or "
                             "infinite scale(s): the weight cannot be dequantized"))
    if row.lint_negative_scales:
        found.append(Finding(row.tensor, "lint_negative_scales", f"{row.negative_scales} "
                             "negative scale(s): a scale is a magnitude (a sign bit set by "
                             "a writer, or a scale negated?)"))
    if row.lint_zero_scales:
        found.append(Finding(row.tensor, "lint_zero_scales", "zero scale(s) over blocks "
                             "holding nonzero codes: those values dequantize to 0"))
    if row.lint_magnitude:
        found.append(Finding(row.tensor, "lint_magnitude", f"RMS {row.rms:.3g} is over "
                             f"{MAGNITUDE_FACTOR:,.0f}x off the median of the checkpoint's 2-D "
                             "tensors (a global scale inverted? scales not decoded?)"))
    if row.lint_zero_blocks:
        found.append(Finding(row.tensor, "lint_zero_blocks", f"{row.zero_blocks} block(s) "
                             "whose every code is zero"))
    return found
