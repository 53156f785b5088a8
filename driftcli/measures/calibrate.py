"""``calibrate``: infer how a matmul backend accumulates, from designed probes, and check it.

A backend is anything that multiplies matrices: ``torch:cpu:bfloat16``, ``torch:cuda:…`` on a
GPU (FP8 through ``torch._scaled_mm`` with unit scales), or ``drift:<matmul spec>``, a
simulated one. The family of models is drift's own matmul specs over the backend's input
format and output format:

- ``blockfma``: a tensor core's block-FMA unit (group size 1-64, interleave 0, 1 or 2, 4-48
  kept bits, a group's result rounded to nearest or toward zero into ``e8mM`` or float16,
  promotion into float32 every P products or none);
- ``sequential``, ``pairwise`` and ``chunked:N``: one rounding per addition in float32,
  bfloat16 or float16, rounded to nearest or toward zero (a CPU's FMA chains; N any multiple of
  32 up to 512 or a power of two, a BLAS's K blocking).

The probes follow the published method (Fasi, Higham, Mikaitis and Pranesh, PeerJ CS 2021;
Khattak and Mikaitis, IEEE HPEC 2025): rows built from powers of two, each multiplied by
sixteen columns, whose results expose one feature at a time: where a group ends (a large
term, its negation and a tiny one: the tiny one is lost inside the large ones' group and kept
outside it), which positions share a half of an interleaved group, how many bits past the
largest exponent survive (``1 - 1 + 2**-j``), the accumulator's precision and rounding
(``1 + 2**-j``, ``1 + 3·2**-(j+1)``, their negatives), carries into a higher binade, and
seeded random rows. The backend computes them once; every model of the family computes them
too, and a model survives only if it gives every probe's bits. Long probes (K to 8,192: a
large first term, then small ones) then decide the promotion interval.

The survivor (the simplest where several give the same bits: no interleave, no promotion,
fewest kept bits, a named accumulator) is then checked, never assumed: on seeded random
matmuls of several K and three distributions (normal, heavy-tailed, cancelling), the share of
outputs it reproduces bit for bit. Where no model survives, the best one's share of the probes
is reported, and its checks say by how much it misses.

``calibrate_recordings`` does the same from recorded dot products (the layout of
``../shared/data/hw-tensor-cores``): one instruction each, with its ``c``, so the search also
tries the harness's handling of ``c`` (as recorded, rounded to the result format, or 0).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, cast

import torch
from torch import Tensor

from driftcli.arith.blockfma import (
    DOUBLE_BITS,
    NO_FLOOR,
    Accumulation,
    FMAUnit,
    Prepared,
    prepare,
    survivors,
)
from driftcli.arith.matmul import MatmulSpec, Order, input_emin, matmul, matmul_spec
from driftcli.arith.tensorcores import Recordings, read_recordings
from driftcli.castspec import parse_cast
from driftcli.errors import DriftError
from driftcli.formats import FORMATS, Format, get_format
from driftcli.io.tables import column
from driftcli.modes import Overflow, Rounding
from driftcli.progress import Progress
from driftcli.rounding import round_to_format

FLOAT32 = FORMATS["float32"]
SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Group sizes of the family."""
INTERLEAVES = (0, 1, 2)
"""Interleaves of the family: none, odd/even positions (AMD CDNA3's FP8), pairs (Hopper's FP8
``mma.sync`` with an fp16 result)."""
KEPT = range(4, 49)
"""Kept bits of the family."""
ACC_BITS = range(4, 24)
"""Fraction bits of the family's ``e8mM`` accumulators (``e8m23`` is float32)."""
CLASSIC_ACCS = ("float32", "bfloat16", "float16")
ROUNDINGS = (Rounding.RTZ, Rounding.RNE)
PROBE_K = 128
"""K of the structure probes (two groups of the largest size)."""
LONG_K = (1024, 8192)
"""K of the promotion probes."""
COLUMNS = 16
RANDOM_ROWS = 64
"""Seeded random rows among the structure probes (the last rows)."""
CHECK_K = (16, 128, 1024, 8192)
CHECK_DISTS = ("normal", "heavy", "cancel")
CHECK_ROWS = 32


class CalibrateError(DriftError, ValueError):
    """A backend or a recordings folder that cannot be calibrated as asked."""


# --- backends ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    """A matmul to calibrate: what it multiplies (operands exact in ``inputs``) and the format
    of its results."""

    name: str
    inputs: Format
    output: Format
    multiply: Callable[[Tensor, Tensor], Tensor]
    """``(M, K) x (K, N)`` float32 values exact in ``inputs`` -> the results as float64."""


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn,
                 "float8_e5m2": torch.float8_e5m2}


def _torch_backend(text: str, device: str, dtype_name: str) -> Backend:
    if dtype_name not in _TORCH_DTYPES:
        raise CalibrateError(f"backend {text!r}: no torch dtype {dtype_name!r}; use one of "
                             f"{', '.join(_TORCH_DTYPES)}")
    dtype = _TORCH_DTYPES[dtype_name]
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if device == "cuda" and not torch.cuda.is_available():
        raise CalibrateError(f"backend {text!r}: no CUDA device here; use torch:cpu:<dtype> or "
                             "drift:<matmul spec>")
    if fp8 and device != "cuda":
        raise CalibrateError(f"backend {text!r}: FP8 matmuls run on a GPU only "
                             "(torch._scaled_mm); use torch:cuda:{dtype_name}")

    def multiply(a: Tensor, b: Tensor) -> Tensor:
        x, y = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
        if fp8:
            rows = a.shape[0]
            pad = -rows % 16  # _scaled_mm takes multiples of 16: zero rows, dropped after
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
            one = torch.ones((), device=device)
            # _scaled_mm wants B column-major; unit scales leave the tensor core's own sum
            out = torch._scaled_mm(x, y.t().contiguous().t(), scale_a=one, scale_b=one,
                                   out_dtype=torch.float32)[:rows]
        else:
            out = torch.matmul(x, y)
        return out.double().cpu()

    output = FLOAT32 if fp8 or dtype == torch.float32 else get_format(dtype_name)
    return Backend(text, get_format(dtype_name), output, multiply)


def _drift_backend(text: str, spec_text: str) -> Backend:
    spec = matmul_spec_of(spec_text, text)
    formats = set()
    for side, c in (("lhs", spec.lhs), ("rhs", spec.rhs)):
        if c is not None and c.scaling.rule is not None:
            raise CalibrateError(f"backend {text!r}: the {side} cast {c} is scaled; a backend's "
                                 "operands are values of one format: give an unscaled cast "
                                 "such as lhs=float8_e4m3fn")
        formats.add(FLOAT32 if c is None else c.format)
    if len(formats) != 1:
        raise CalibrateError(f"backend {text!r}: lhs and rhs are cast to different formats; "
                             "calibrate one input format at a time")
    if spec.out is not None and spec.out.scaling.rule is not None:
        raise CalibrateError(f"backend {text!r}: the output cast {spec.out} is scaled; give an "
                             "unscaled one or none")
    output = FLOAT32 if spec.out is None else spec.out.format
    return Backend(text, formats.pop(), output, lambda a, b: matmul(a, b, spec).double())


def matmul_spec_of(spec_text: str, where: str) -> MatmulSpec:
    """A matmul spec from text, its error naming ``where``."""
    from driftcli.arith.matmul import parse_matmul_spec

    try:
        return parse_matmul_spec(spec_text)
    except DriftError as err:
        raise CalibrateError(f"backend {where!r}: {err}") from None


def backend(text: str) -> Backend:
    """A backend from its name: ``torch:cpu:<dtype>``, ``torch:cuda:<dtype>`` or
    ``drift:<matmul spec>``."""
    kind, _, rest = text.strip().partition(":")
    if kind == "drift" and rest:
        return _drift_backend(text, rest)
    if kind == "torch":
        device, _, dtype = rest.partition(":")
        if device in ("cpu", "cuda") and dtype:
            return _torch_backend(text, device, dtype)
    raise CalibrateError(f"unknown backend {text!r}; give torch:cpu:bfloat16, "
                         "torch:cuda:float8_e4m3fn or drift:<matmul spec> (e.g. "
                         "drift:tc=h100_e4m3_f32)")


# --- the family ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    """One model of the family (see the module docs)."""

    order: Order
    acc: Format
    rounding: Rounding
    unit: FMAUnit | None = None
    chunk: int = 0
    """The promotion interval of ``blockfma``, the chunk of ``chunked``; 0 for none."""

    def spec(self, inputs: Format, output: Format) -> MatmulSpec:
        """The matmul spec of this model for a backend's formats."""
        plain = None if inputs == FLOAT32 else parse_cast(inputs.name)
        # a conversion of the result overflows to inf, as IEEE (and torch's .to) does
        out = None if output == FLOAT32 else parse_cast(f"{output.name}:none:rne:ieee")
        return matmul_spec(lhs=plain, rhs=plain, accumulator=self.acc,
                           acc_rounding=self.rounding, order=self.order, chunk=self.chunk,
                           unit=self.unit, out=out)

    def simplicity(self) -> tuple[int, ...]:
        """Sort key among models that give the same bits: the simplest first."""
        unit = self.unit or FMAUnit(1, 1)
        named = self.acc.name in CLASSIC_ACCS
        # one rounding per addition is the fewest parameters: it goes first
        return (self.order is Order.BLOCKFMA, unit.interleave, self.chunk > 0, unit.size,
                unit.kept_bits, not named, -self.acc.mbits, self.rounding is Rounding.RNE)


def acc_format(mbits: int) -> Format:
    """The ``e8mM`` accumulator of ``mbits`` fraction bits (float32 and bfloat16 by name)."""
    return {23: FLOAT32, 7: FORMATS["bfloat16"]}.get(mbits) or get_format(f"e8m{mbits}")


def blockfma_models(max_k: int) -> Iterator[Model]:
    """Every block-FMA model of the family whose promotion interval is below ``max_k``, with
    accumulators no wider than can be seen: a group's result has at most ``kept + 3 +
    log2(size + 1)`` significant bits, so wider accumulators give the same bits."""
    accs = [*(acc_format(m) for m in ACC_BITS), FORMATS["float16"]]
    for size in SIZES:
        for il in INTERLEAVES:
            if il and size % (2 * il):
                continue
            promotions = [0, *(p for p in (size << i for i in range(14)) if p < max_k)]
            for kept in KEPT:
                if kept + 3 + (size + 1).bit_length() > DOUBLE_BITS:
                    continue
                unit = FMAUnit(size, kept, interleave=il)
                seen = kept + 2 + (size + 1).bit_length()
                for acc in accs:
                    if acc.mbits + 1 >= seen and acc.ebits == FLOAT32.ebits and acc != FLOAT32:
                        continue  # never rounds a group's sum: float32 stands for it
                    for rounding in ROUNDINGS:
                        for chunk in promotions:
                            yield Model(Order.BLOCKFMA, acc, rounding, unit, chunk)


def classic_models(max_k: int) -> Iterator[Model]:
    """The one-rounding-per-addition models of the family."""
    for name in CLASSIC_ACCS:
        acc = FORMATS[name]
        for rounding in ROUNDINGS:
            yield Model(Order.SEQUENTIAL, acc, rounding)
            yield Model(Order.PAIRWISE, acc, rounding)
            for i in range(1, 14):
                if (1 << i) < max_k:
                    yield Model(Order.CHUNKED, acc, rounding, chunk=1 << i)


# --- probes ---------------------------------------------------------------------------------------

def _exponent_range(fmt: Format) -> tuple[int, int]:
    """The exponents of powers of two exact in ``fmt`` that leave headroom: from the smallest
    normal to a quarter of the largest finite (two of them, and a sum of 32, stay finite)."""
    top = math.floor(math.log2(float(fmt.max))) - 2 if fmt != FLOAT32 else 60
    return max(fmt.emin, -60), max(min(top, 60), fmt.emin)


def _exact_in(fmt: Format, x: Tensor) -> Tensor:
    """``x`` rounded to ``fmt`` (saturating), float32."""
    return round_to_format(x, fmt, rounding=Rounding.RNE).float()


def probe_columns(fmt: Format, k: int, gen: torch.Generator) -> Tensor:
    """B (K x 16): ones; the top and bottom powers of two; a large first entry over ones and
    over tiny ones; alternating signs; a ramp; a large first entry, six ones, tiny ones; eight
    seeded random columns."""
    lo, hi = _exponent_range(fmt)
    one, big, small = 1.0, 2.0**hi, 2.0**lo
    cols = torch.ones(k, COLUMNS)
    cols[:, 1] = big
    cols[:, 2] = small
    cols[:, 3], cols[0, 3] = one, big
    cols[:, 4], cols[0, 4] = small, big
    cols[:, 5] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    cols[:, 6] = 1 + torch.arange(k) % 4 * 0.25
    # three tiers: a row's first entry scaled up, its next six kept, the rest scaled down
    cols[:, 7] = torch.where(torch.arange(k) < 7, one, small)
    cols[0, 7] = big
    scale = torch.exp2(torch.randint(-3, 4, (k, 8), generator=gen).float())
    cols[:, 8:] = torch.randn(k, 8, generator=gen) * scale
    return _exact_in(fmt, cols)


def probe_rows(fmt: Format, k: int, gen: torch.Generator) -> Tensor:
    """A (rows x K) of the structure probes (see the module docs), exact in ``fmt``; each
    family at two anchors, 1 and the top power of two, so that the columns' large and tiny
    entries stretch the gaps a row can hold."""
    lo, hi = _exponent_range(fmt)
    tiny = fmt.smallest_positive
    bottom = max(tiny.numerator.bit_length() - tiny.denominator.bit_length(), -80)
    rows: list[Tensor] = []

    def row(**at: float) -> None:
        r = torch.zeros(k)
        for pos, v in at.items():
            r[int(pos[1:])] = v
        rows.append(r)

    big = 2.0**hi
    for q in (1, 2, 4, 8):  # where groups and halves end
        for p in range(1, min(k, 2 * max(SIZES) + 2)):
            if p != q:
                row(**{"p0": big, f"p{q}": -big, f"p{p}": 2.0**lo})
    for x in (0, hi):
        gap = min(x - bottom, 50)
        for q, p in ((1, 2), (2, 3), (4, 5), (1, 9), (3, 33)):  # kept bits
            for j in range(1, gap + 1):
                row(**{"p0": 2.0**x, f"p{q}": -(2.0**x), f"p{p}": 2.0**(x - j)})
        for p in (1, 5):  # precision and rounding
            for j in range(1, min(gap, 30) + 1):
                for m in (1.0, 1.5):
                    for sign in (1.0, -1.0):
                        row(**{"p0": sign * 2.0**x, f"p{p}": sign * m * 2.0**(x - j)})
                    row(**{"p0": 2.0**x, f"p{p}": -m * 2.0**(x - j)})
        for p, q in ((1, 2), (3, 7)):  # a tie, and a tail past the kept bits that breaks it
            for j in range(1, min(gap, 24) + 1):
                for d in (1, 3, 8, 14, 20, 26, 32):
                    if j + d <= gap:
                        for sign in (1.0, -1.0):
                            row(**{"p0": 2.0**x, f"p{p}": 2.0**(x - j),
                                   f"p{q}": sign * 2.0**(x - j - d)})
    for n in (2, 3, 4, 7, 8, 15, 16, 31, 32, 63):  # carries
        for j in (1, 3, 8, 12, 20):
            r = torch.zeros(k)
            r[:n] = 1.0
            r[n] = 2.0**-j
            rows.append(r)
    scale = torch.exp2(torch.randint(-6, 7, (RANDOM_ROWS, k), generator=gen).float())
    rows.extend(torch.randn(RANDOM_ROWS, k, generator=gen) * scale)  # seeded random rows
    return _exact_in(fmt, torch.stack(rows))


def long_rows(fmt: Format, k: int, gen: torch.Generator) -> Tensor:
    """A (rows x K) of the promotion probes: a large first term then small ones (kept only
    where the chain restarts from zero), and seeded random rows."""
    lo, hi = _exponent_range(fmt)
    rows = []
    for j in (4, 8, 12, 16, 24):
        r = torch.full((k,), 2.0**max(hi - j, lo))
        r[0] = 2.0**hi
        rows.append(r)
    rows.extend(torch.randn(8, k, generator=gen))
    return _exact_in(fmt, torch.stack(rows))


# --- the search -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Observed:
    """Probes and the backend's results on them."""

    a: Tensor
    b: Tensor
    results: Tensor
    """(rows x 16) float64."""
    prepared: Prepared | None = field(default=None, compare=False)


def same_bits(x: Tensor, y: Tensor) -> Tensor:
    """Element-wise: the same float32 bit pattern (NaN payloads aside, the sign of zero too)."""
    xf, yf = x.float(), y.float()
    return (xf.view(torch.int32) == yf.view(torch.int32)) | (xf.isnan() & yf.isnan())


def _observe(be: Backend, a: Tensor, b: Tensor) -> Observed:
    emin = input_emin(None if be.inputs == FLOAT32 else parse_cast(be.inputs.name), False)
    prep = prepare(a, b.T.contiguous(), emin, emin, shape=(1, a.shape[0], b.shape[1]))
    return Observed(a, b, be.multiply(a, b), prep)


def model_results(model: Model, be: Backend, obs: Observed) -> Tensor:
    """What ``model`` computes for the probes of ``obs``."""
    if model.order is Order.BLOCKFMA and obs.prepared is not None:
        emin = obs.prepared.emin
        how = Accumulation(model.unit or FMAUnit(1, 1), model.acc, model.rounding, emin[0],
                           emin[1], model.chunk)
        return output_cast(obs.prepared.run(how).reshape(obs.results.shape), be.output)
    return matmul(obs.a, obs.b, model.spec(be.inputs, be.output)).double()


def output_cast(x: Tensor, output: Format) -> Tensor:
    """Results rounded to the backend's output format as a plain cast does (to nearest,
    overflowing as IEEE conversion does), float64."""
    if output == FLOAT32:
        return x
    return round_to_format(x, output, rounding=Rounding.RNE, overflow=Overflow.IEEE).double()


def _share(model: Model, be: Backend, obs: Observed) -> float:
    return float(same_bits(model_results(model, be, obs), obs.results).double().mean())


@dataclass(frozen=True)
class Inference:
    """What the probes say: the chosen model, how many models gave every probe's bits (and
    in what they differ), and the best share of probes reproduced where none did."""

    model: Model
    survivors: int
    probe_share: float
    probes: int
    seconds: float
    alternatives: str = ""


def alternatives(models: Sequence[Model], c_modes: Sequence[str] = ()) -> str:
    """In what models that give the same bits differ, e.g. ``kept_bits 17-48; acc e8m10,
    float16`` (empty for one model)."""
    if len(models) < 2:
        return ""
    fields: dict[str, list[str]] = {
        "order": [m.order.value for m in models],
        "fma_size": [str(m.unit.size) if m.unit else "-" for m in models],
        "interleave": [str(m.unit.interleave) if m.unit else "-" for m in models],
        "kept_bits": [str(m.unit.kept_bits) if m.unit else "-" for m in models],
        "acc": [m.acc.name for m in models],
        "acc_rounding": [m.rounding.value for m in models],
        "promote": [str(m.chunk) for m in models],
        "c": list(c_modes)}
    parts = []
    for name, values in fields.items():
        distinct = set(values)
        if len(distinct) < 2:
            continue
        numbers = sorted(int(v) for v in distinct if v.lstrip("-").isdigit())
        words = sorted(v for v in distinct if not v.lstrip("-").isdigit())
        shown = ([f"{numbers[0]}-{numbers[-1]}"] if len(numbers) > 2 else
                 [str(n) for n in numbers]) + [w if w != "-" else "none" for w in words]
        parts.append(f"{name} {', '.join(shown)}")
    return "; ".join(parts)


def search(models: Sequence[Model], prep: Prepared, want: Tensor,
           output: Format | None) -> list[Model]:
    """The block-FMA models among ``models`` that give every result of ``want`` on the
    prepared operands (grouped by unit shape, each group one search in numba)."""
    shapes: dict[tuple[int, int], list[Model]] = {}
    for m in models:
        if m.order is Order.BLOCKFMA and m.unit is not None:
            shapes.setdefault((m.unit.size, m.unit.interleave), []).append(m)
    found = []
    for (size, il), group in shapes.items():
        ok = survivors(prep, size, il, [(cast(FMAUnit, m.unit).kept_bits, m.acc, m.rounding,
                                          m.chunk) for m in group], want, output)
        found += [m for m, good in zip(group, ok, strict=True) if good]
    return found


def infer(be: Backend, *, seed: int = 0, max_k: int = max(LONG_K)) -> Inference:
    """The simplest model of the family that gives every probe's bits on ``be`` (see the
    module docs), or the one that gives the most."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    rows = probe_rows(be.inputs, PROBE_K, gen)
    cols = probe_columns(be.inputs, PROBE_K, gen)
    # the random rows first: they tell most models apart within a few results
    rows = torch.cat([rows[-RANDOM_ROWS:], rows[:-RANDOM_ROWS]])
    full = _observe(be, rows, cols)
    output = None if be.output == FLOAT32 else be.output
    blockfma = list(blockfma_models(PROBE_K))
    classic = list(classic_models(PROBE_K))
    found = search(blockfma, cast(Prepared, full.prepared), full.results, output)
    screen = _observe(be, rows[:RANDOM_ROWS], cols)  # the random rows
    for model in classic:
        if bool(same_bits(model_results(model, be, screen), screen.results).all()) and \
                _share(model, be, full) == 1.0:
            found.append(model)
    survivors_ = _long(be, found, gen, max_k)
    probes = full.results.numel()
    if survivors_:
        chosen = _floor(be, min(survivors_, key=Model.simplicity))
        return Inference(chosen, len(survivors_), 1.0, probes, time.perf_counter() - start,
                         alternatives(survivors_))
    if found:  # the short probes have models, the long ones none: the simplest, and how far
        best = min(found, key=Model.simplicity)
        k = max(k for k in LONG_K if k <= max_k) if any(k <= max_k for k in LONG_K) else 0
        if k:
            obs = _observe(be, long_rows(be.inputs, k, gen), probe_columns(be.inputs, k, gen))
            share = _share(best, be, obs)
            note = (f"{len(found)} model(s) give every K={PROBE_K} probe; the simplest gives "
                    f"{share:.4%} of the K={k} probes")
            return Inference(best, 0, share, obs.results.numel(),
                             time.perf_counter() - start, note)
    best, share = _best([*blockfma, *classic], be, screen, full)
    return Inference(best, 0, share, probes, time.perf_counter() - start)


BEST_STRIDE = 41
"""Where no model fits, every this-many-th model of the family is scored (about 3,000)."""
MIN_EXPS = range(-160, -99)
"""Exponent floors tried once a block-FMA model is chosen."""


def tiny_rows(fmt: Format, k: int) -> Tensor:
    """Rows of a term, one 9 binades below it and a negative one 12 to 30 below, at every
    exponent of ``fmt``'s range (the columns scale them into float32's subnormals): a floor
    under a group's exponent cuts the negative tail where it lies below the floor's kept
    bits, and the result, rounded toward zero or to nearest, shows it."""
    tiny = fmt.smallest_positive
    bottom = tiny.numerator.bit_length() - tiny.denominator.bit_length()
    top = _exponent_range(fmt)[1]
    rows = []
    for d in (12, 18, 24, 30):
        for x in range(bottom + d, top + 1):
            r = torch.zeros(k)
            r[0], r[1], r[2] = 2.0**x, 2.0**(x - 9), -(2.0**(x - d))
            rows.append(r)
    return _exact_in(fmt, torch.stack(rows))


def _floor(be: Backend, model: Model) -> Model:
    """``model`` with the exponent floor the tiny probes show (none where none is needed)."""
    if model.order is not Order.BLOCKFMA or model.unit is None:
        return model
    gen = torch.Generator().manual_seed(1)
    obs = _observe(be, tiny_rows(be.inputs, PROBE_K), probe_columns(be.inputs, PROBE_K, gen))
    unit = model.unit
    for floor in (NO_FLOOR, *MIN_EXPS):
        trial = Model(model.order, model.acc, model.rounding,
                      FMAUnit(unit.size, unit.kept_bits, floor, unit.interleave), model.chunk)
        if _share(trial, be, obs) == 1.0:
            return trial
    return model


def _best(models: Sequence[Model], be: Backend, screen: Observed,
          full: Observed) -> tuple[Model, float]:
    """The best model found: a pass over every ``BEST_STRIDE``-th model on the screen's
    probes, then the twenty best of it on all of them (a report of how far the family is
    from the backend, not a search for a fit: none exists)."""
    step = BEST_STRIDE
    coarse = sorted(((_share(m, be, screen), i) for i, m in enumerate(models[::step])),
                    reverse=True)[:20]
    scored = [(_share(models[step * i], be, full), models[step * i]) for _, i in coarse]
    share, model = max(scored, key=lambda s: s[0])
    return model, share


def _long(be: Backend, survivors: list[Model], gen: torch.Generator,
          max_k: int) -> list[Model]:
    """The survivors of the structure probes, with every promotion interval up to ``max_k``,
    kept where they give the long probes' bits."""
    if not survivors:
        return []
    kept = survivors
    for k in (k for k in LONG_K if k <= max_k):
        obs = _observe(be, long_rows(be.inputs, k, gen), probe_columns(be.inputs, k, gen))
        trials = {m for m in kept}
        for m in kept:
            if m.order is Order.BLOCKFMA and m.unit is not None and m.chunk == 0:
                trials.update(Model(m.order, m.acc, m.rounding, m.unit, p)
                              for p in (m.unit.size << i for i in range(16))
                              if PROBE_K <= p < k)
            elif m.order is Order.CHUNKED or (m.order is Order.SEQUENTIAL):
                # a BLAS's K blocking: any multiple of 32 up to 512 (192 on this machine's
                # float32 matmul), and the powers of two beyond
                sizes = {*range(PROBE_K, 513, 32), *(1 << i for i in range(10, 14))}
                trials.update(Model(Order.CHUNKED, m.acc, m.rounding, chunk=p)
                              for p in sizes if p < k)
        kept = [m for m in sorted(trials, key=Model.simplicity) if _share(m, be, obs) == 1.0]
    return kept


# --- checking -------------------------------------------------------------------------------------

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
    return _exact_in(fmt, a), _exact_in(fmt, b)


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


# --- recordings -----------------------------------------------------------------------------------

RECORDED_INPUTS = {"fp16": "float16", "bf16": "bfloat16", "tf32": "e8m10",
                   "E4M3": "float8_e4m3fn", "E5M2": "float8_e5m2"}
"""The input format of each recordings folder name."""
C_MODES = ("recorded", "rounded", "zero")
"""How the recording harness fed ``c``: as recorded, rounded to the result format, or 0."""


@dataclass(frozen=True)
class Fit:
    """Models that reproduce recordings: the simplest, how many (and in what they differ),
    and the share reached."""

    model: Model
    c_mode: str
    survivors: int
    share: float
    recordings: int
    seconds: float
    alternatives: str = ""


def _c_for(r: Recordings, output: Format, mode: str) -> Tensor:
    if mode == "zero":
        return torch.zeros_like(r.c)
    if mode == "rounded":
        return round_to_format(r.c, output, rounding=Rounding.RNE).double()
    return r.c


def fit_recordings(r: Recordings, out: str, *, screen: int = 200) -> Fit:
    """Search the block-FMA family for the models that reproduce every recording of ``r``
    with the result format ``out`` (``fp32`` or ``fp16``)."""
    start = time.perf_counter()
    if r.inputs not in RECORDED_INPUTS:
        raise CalibrateError(f"recordings {r.gpu}/{r.inputs}: unknown input format folder; "
                             f"name it one of {', '.join(RECORDED_INPUTS)}")
    inputs = get_format(RECORDED_INPUTS[r.inputs])
    output = FLOAT32 if out == "fp32" else FORMATS["float16"]
    k = r.a.shape[1]
    want = r.d[out]
    sub = torch.arange(min(screen, want.shape[0]))
    models = [m for m in blockfma_models(1)
              if m.unit is not None and m.unit.size <= max(k, 1)]
    found: list[tuple[Model, str]] = []
    for mode in C_MODES:
        c = _c_for(r, output, mode)
        prep = prepare(r.a, r.b, inputs.emin, inputs.emin, c=c)
        found += [(m, mode) for m in search(models, prep, want,
                                            None if output == FLOAT32 else output)]
    best: tuple[float, Model, str] = (-1.0, models[0], C_MODES[0])
    if not found:  # the share of the best: a sample of the family on a screen, then its best
        for mode in C_MODES:
            c = _c_for(r, output, mode)
            part = prepare(r.a[sub], r.b[sub], inputs.emin, inputs.emin, c=c[sub])
            for model in models[::BEST_STRIDE]:
                how = Accumulation(cast(FMAUnit, model.unit), model.acc, model.rounding,
                                   inputs.emin, inputs.emin)
                share = float(same_bits(output_cast(part.run(how), output),
                                        want[sub]).double().mean())
                if share > best[0]:
                    best = (share, model, mode)
        share_all = _recorded_share(r, best[1], best[2], inputs, output, want)
        best = (share_all, best[1], best[2])
    survivors_ = found
    n = int(want.shape[0])
    if survivors_:
        # one recorded instruction: a group as long as it, with the result's own format,
        # is the reading to prefer where the recordings cannot tell models apart
        model, mode = min(survivors_, key=lambda s: (
            s[0].acc != output, -cast(FMAUnit, s[0].unit).size, s[0].simplicity(),
            C_MODES.index(s[1])))
        return Fit(model, mode, len(survivors_), 1.0, n, time.perf_counter() - start,
                   alternatives([m for m, _ in survivors_], [c for _, c in survivors_]))
    return Fit(best[1], best[2], 0, best[0], n, time.perf_counter() - start)


def _recorded_share(r: Recordings, model: Model, mode: str, inputs: Format, output: Format,
                    want: Tensor) -> float:
    c = _c_for(r, output, mode)
    how = Accumulation(cast(FMAUnit, model.unit), model.acc, model.rounding, inputs.emin,
                       inputs.emin)
    got = output_cast(prepare(r.a, r.b, inputs.emin, inputs.emin, c=c).run(how), output)
    return float(same_bits(got, want).double().mean())


def recording_folders(root: Path) -> list[Path]:
    """``root`` itself when it holds recordings (``a_*`` files), else its ``GPU/FORMAT``
    folders that do."""
    def holds(p: Path) -> bool:
        return p.is_dir() and any(p.glob("a_*.txt*"))

    if holds(root):
        return [root]
    found = sorted(f for g in root.iterdir() if g.is_dir() for f in g.iterdir() if holds(f))
    if not found:
        raise CalibrateError(f"no recordings in {root}: expected GPU/FORMAT folders holding "
                             "a_GPU_FORMAT.txt.gz, b_..., c_GPU_fp32.txt.gz and d_... files")
    return found


def read_folder(folder: Path) -> Recordings:
    """The recordings of one folder, with a clear error."""
    return read_recordings(folder)


# --- the table ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CalibrateRow:
    """One line of a calibration: the probes (``kind`` = ``probes``), a check of the chosen
    model on random matmuls (``check``), or a recordings folder (``recordings``)."""

    TABLE: ClassVar[str] = "calibrate"
    KEYS: ClassVar[tuple[str, ...]] = ("backend", "kind", "k", "dist")
    HEADLINE: ClassVar[str] = "share"
    HIGHER_IS_WORSE: ClassVar[bool] = False

    backend: str = column("The backend (torch:cpu:bfloat16, drift:<spec>) or recordings folder "
                          "(GPU/FORMAT, with the result format)")
    kind: str = column("probes: the designed probes; check: random matmuls; recordings: "
                       "recorded dot products")
    k: int = column("Products per dot product (the probes' K for kind probes)")
    dist: str = column("Operand distribution of a check (normal, heavy, cancel); 'designed' "
                       "for probes, 'recorded' for recordings")
    outputs: int = column("Outputs compared")
    reproduced: int = column("Outputs the model gives bit for bit")
    share: float = column("reproduced / outputs")
    model: str = column("The inferred model as a matmul spec (the best one where none "
                        "reproduces every probe)")
    fits: bool = column("Whether the model gave every probe's (or recording's) bits")
    survivors: int = column("Models of the family that gave every probe's bits (0: none did)")
    alternatives: str = column("In what those models differ (e.g. 'kept_bits 25-44'): what the "
                               "probes cannot tell apart; empty for one")
    order: str = column("The model's order: blockfma, sequential, pairwise or chunked")
    fma_size: int | None = column("Products per group of a block-FMA model")
    kept_bits: int | None = column("Bits a term keeps below the group's largest exponent")
    interleave: int | None = column("A group's halves dealt k positions at a time (0: none)")
    accumulator: str = column("The format every group's (or addition's) result is rounded to")
    acc_rounding: str = column("rne or rtz")
    promote: int = column("Products between promotions into float32 (block-FMA) or the chunk "
                          "of chunked; 0 for none")
    c_mode: str | None = column("Recordings: how c was fed (recorded, rounded, zero)")
    seconds: float | None = column("Wall time of the inference or search (probes, recordings)")


def _row(name: str, kind: str, k: int, dist: str, outputs: int, reproduced: int, model: Model,
         spec: str, fits: bool, survivors: int, others: str = "", c_mode: str | None = None,
         seconds: float | None = None) -> CalibrateRow:
    unit = model.unit
    return CalibrateRow(
        backend=name, kind=kind, k=k, dist=dist, outputs=outputs, reproduced=reproduced,
        share=reproduced / outputs if outputs else 0.0, model=spec, fits=fits,
        survivors=survivors, alternatives=others, order=model.order.value,
        fma_size=None if unit is None else unit.size,
        kept_bits=None if unit is None else unit.kept_bits,
        interleave=None if unit is None else unit.interleave, accumulator=model.acc.name,
        acc_rounding=model.rounding.value, promote=model.chunk, c_mode=c_mode, seconds=seconds)


def calibrate(name: str, *, seed: int = 0, max_k: int = max(CHECK_K),
              progress: Progress | None = None) -> list[CalibrateRow]:
    """Infer the model of backend ``name`` from the probes, then check it on random matmuls
    (K of :data:`CHECK_K` up to ``max_k``): one ``probes`` row and one ``check`` row per K
    and distribution."""
    be = backend(name)
    if progress is not None:
        progress(0, 2, f"{name}: probes")
    inf = infer(be, seed=seed, max_k=max_k)
    if progress is not None:
        progress(1, 2, f"{name}: checks")
    spec = str(inf.model.spec(be.inputs, be.output))
    fits = inf.survivors > 0
    rows = [_row(name, "probes", PROBE_K, "designed", inf.probes,
                 round(inf.probe_share * inf.probes), inf.model, spec, fits, inf.survivors,
                 inf.alternatives, seconds=inf.seconds)]
    for c in check(be, inf.model, seed=seed, ks=[k for k in CHECK_K if k <= max_k]):
        rows.append(_row(name, "check", c.k, c.dist, c.outputs, c.reproduced, inf.model, spec,
                         fits, inf.survivors, inf.alternatives))
    if progress is not None:
        progress(2, 2, name)
    return rows


def calibrate_recordings(root: Path, *, progress: Progress | None = None) -> list[CalibrateRow]:
    """Search the family for each recordings folder under ``root`` and result format: one
    ``recordings`` row each."""
    rows = []
    folders = recording_folders(root)
    for i, folder in enumerate(folders):
        if progress is not None:
            progress(i, len(folders), str(folder))
        r = read_folder(folder)
        inputs = get_format(RECORDED_INPUTS.get(r.inputs, "float32"))
        for out in r.d:
            fit = fit_recordings(r, out)
            output = FLOAT32 if out == "fp32" else FORMATS["float16"]
            spec = str(fit.model.spec(inputs, output))
            rows.append(_row(f"{r.gpu}/{r.inputs} -> {out}", "recordings", r.a.shape[1],
                             "recorded", fit.recordings, round(fit.share * fit.recordings),
                             fit.model, spec, fit.survivors > 0, fit.survivors,
                             fit.alternatives, fit.c_mode, fit.seconds))
    return rows
