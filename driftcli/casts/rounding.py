"""Vectorized rounding of torch tensors onto any format's grid.

The work happens on the integer bits of the input, never on a floating
``log2``: the binade exponent and the significand are read from the bit
fields, the significand is cut at the target quantum with the mode's
round/sticky decision made on the dropped bits, and the result's bits are
assembled again by integer arithmetic. No step depends on floating-point
semantics (NaN tests, signed zeros, denormal flushing), so an optimizing
compiler cannot change the answer.

The rules are those of :mod:`driftcli.oracle`, which ``drift verify-formats``
uses to check this module on every code and every pair of codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import torch

from driftcli import kernels
from driftcli.casts.twosum import two_sum
from driftcli.choices import parse_choice
from driftcli.errors import DriftError
from driftcli.kernels import jit
from driftcli.records.formats import FORMATS, Format, get_format
from driftcli.records.modes import DEFAULT_SR_BITS, Overflow, Rounding

Tensor = torch.Tensor
MAX_SR_BITS = 30


@dataclass(frozen=True)
class _Source:
    """Bit layout of the working float dtype the rounding reads and writes."""

    fdtype: torch.dtype
    idtype: torch.dtype
    ebits: int
    mbits: int

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1

    @property
    def width(self) -> int:
        return 1 + self.ebits + self.mbits


_F32 = _Source(torch.float32, torch.int32, 8, 23)
_F64 = _Source(torch.float64, torch.int64, 11, 52)


@dataclass(frozen=True)
class Target:
    """The integers of a format that the kernel needs; hashable, so compiled kernels cache on it."""

    emin: int
    mbits: int
    qmax: int
    max_sig: int
    min_sig: int
    signed: bool
    has_inf: bool
    has_nan: bool
    has_zero: bool
    has_neg_zero: bool
    smallest_exp: int  # exponent of the smallest positive value, a power of two
    widths: tuple[int, ...] = ()  # a tapered format's mantissa width per binade from emin
    taper_lo: int = 0  # the same widths as numba reads them: see taper_masks
    taper_hi: int = 0

    @classmethod
    @cache
    def of(cls, fmt: Format) -> Target:
        smallest = fmt.smallest_positive
        # emin is the grid's floor: the lowest binade with a quantum of its own
        widths = tuple(fmt.mbits_at(e) for e in range(fmt.grid_emin, fmt.emax + 1)) \
            if fmt.taper is not None else ()
        lo, hi = taper_masks(fmt.mbits, widths)
        return cls(fmt.grid_emin, fmt.mbits, fmt.qmax, fmt.max_significand,
                   fmt.min_significand, fmt.signed, fmt.has_inf, fmt.has_nan, fmt.has_zero,
                   fmt.has_neg_zero,
                   smallest.numerator.bit_length() - smallest.denominator.bit_length(),
                   widths, lo, hi)


TAPER_SPAN = 63
"""Binades (from the grid's floor) whose widths the numba kernels' two masks hold; the top
binade's width stands for every one above."""


def taper_masks(mbits: int, widths: tuple[int, ...]) -> tuple[int, int]:
    """Two integers whose bits ``i`` are the low and high bit of ``mbits - width`` of the
    binade ``grid_emin + i`` (0, 0 for a fixed width): a tapered format's widths as two of
    the numba kernels' integer parameters."""
    if not widths:
        return 0, 0
    if len(widths) > TAPER_SPAN or any(not 0 <= mbits - w <= 3 for w in widths):
        raise DriftError(f"a tapered format of {len(widths)} binades and widths {widths} does "
                         f"not fit the kernels' masks (at most {TAPER_SPAN} binades, each at "
                         "most 3 mantissa bits narrower than the widest)")
    lo = hi = 0
    for i in range(TAPER_SPAN):
        narrower = mbits - widths[min(i, len(widths) - 1)]
        lo |= (narrower & 1) << i
        hi |= (narrower >> 1) << i
    return lo, hi


def _pow2_bits(src: _Source, exp: int) -> int:
    """Bits of the working float ``2**exp`` (normal or subnormal)."""
    if exp >= 1 - src.bias:
        return (exp + src.bias) << src.mbits
    return 1 << (exp - (1 - src.bias - src.mbits))


def _magnitude_bits(src: _Source, sig: int, qexp: int) -> int:
    """Bits of the working float ``sig * 2**qexp`` (a value known to be representable)."""
    if sig == 0:
        return 0
    top = sig.bit_length() - 1
    exp = top + qexp
    if exp >= 1 - src.bias:
        fraction = (sig << (src.mbits - top)) & ((1 << src.mbits) - 1)
        return ((exp + src.bias) << src.mbits) | fraction
    return sig << (qexp - (1 - src.bias - src.mbits))


def _assemble(src: _Source, mag: Tensor, qexp: Tensor) -> Tensor:
    """Bits of the working float ``mag * 2**qexp`` (mag < 2**(mbits + 2), a representable value).

    int -> float is exact for such ``mag``; the exponent is then shifted in the bits, or, for a
    subnormal result, the integer is shifted into place.
    """
    W = src.width - 1
    as_float = mag.to(src.fdtype).view(src.idtype)
    new_exp = (as_float >> src.mbits) + qexp
    denorm_shift = torch.clamp(qexp - (1 - src.bias - src.mbits), min=0, max=W - 1)
    normal = (new_exp >= 1) & (mag != 0)  # zero is all-zero bits whatever the exponent
    return torch.where(normal, as_float + qexp * (1 << src.mbits), mag << denorm_shift)


def _kernel(x: Tensor, residual: Tensor | None, random: Tensor | None, scale_exp: Tensor | None,
            *, src: _Source, tgt: Target, rounding: Rounding, overflow: Overflow,
            sr_bits: int) -> Tensor:
    """Round ``x`` (+ ``residual``, a sticky tail below x's last bit) onto the target grid.

    The residual is folded in as a sticky bit below the first dropped bit, so it is exact
    only when the rounding drops at least one bit of ``x``: the source must be wider than
    the target at ``x``'s binade (``add`` rounds float64 sums onto formats of at most 24
    significant bits; a float32 ``x`` with a residual onto float32 is not supported).

    With ``scale_exp`` the grid of each element is the format's grid times ``2**scale_exp``:
    the cast of ``x / 2**k`` followed by the multiplication back, with no rounding in either.
    """
    it = src.idtype
    W = src.width - 1
    sign_mask = -(1 << W)  # the sign bit as a signed integer
    abs_mask = (1 << W) - 1
    man_mask = (1 << src.mbits) - 1
    exp_all = (1 << src.ebits) - 1

    bits = x.view(it)
    neg = bits < 0
    u = bits & abs_mask
    nonfinite = (u >> src.mbits) == exp_all
    is_nan = nonfinite & ((u & man_mask) != 0)
    sticky = torch.zeros_like(neg)
    if residual is not None:
        # x + r with r below x's last bit: step x one ulp toward zero when r points that way,
        # so the exact value always lies just above |x| (x's bits plus a sticky bit).
        rbits = residual.view(it)
        sticky = (rbits & abs_mask) != 0
        u = u - (sticky & ((rbits < 0) != neg)).to(it)
    exp_field = u >> src.mbits
    sig = (u & man_mask) | ((exp_field > 0).to(it) << src.mbits)
    q_src = torch.clamp(exp_field, min=1) - (src.bias + src.mbits)  # sig's quantum exponent
    # the binade of |x|; for a subnormal input it is read off the bits of float(sig), exact
    sig_binade = (sig.to(src.fdtype).view(it) >> src.mbits) - src.bias
    e = torch.where(exp_field == 0, sig_binade + q_src, q_src + src.mbits)
    emin = tgt.emin if scale_exp is None else scale_exp + tgt.emin
    floor_e = torch.maximum(e, torch.as_tensor(emin, dtype=it))
    t_mbits: Tensor | int = tgt.mbits
    if tgt.widths:  # tapered: the mantissa width of the binade
        index = torch.clamp(floor_e - emin, min=0, max=len(tgt.widths) - 1)
        t_mbits = torch.tensor(tgt.widths, dtype=it)[index]
    s = torch.clamp(floor_e - t_mbits - q_src, min=0)  # bits dropped
    qexp = q_src + s
    sc = torch.clamp(s, max=W - 1)
    kept = sig >> sc
    dropped = sig - (kept << sc)
    inexact = (dropped != 0) | sticky

    if rounding is Rounding.RNE or rounding is Rounding.RNA:
        two_d, full = dropped << 1, torch.ones_like(sc) << sc
        if rounding is Rounding.RNA:
            away = two_d >= full
        else:
            odd = (kept & 1) == 1
            if (tgt.mbits == 0 or tgt.widths) and tgt.has_zero:
                # Format.ties_by_code, a tapered format's denormals: the binade's parity
                by_code = (kept != 0) & (((qexp - emin + 1) & 1) == 1)
                odd = torch.where(torch.as_tensor(t_mbits) == 0, by_code, odd)
            away = (two_d > full) | ((two_d == full) & (odd | sticky))
    elif rounding is Rounding.RTZ:
        away = torch.zeros_like(neg)
    elif rounding is Rounding.RUP:
        away = inexact & ~neg
    elif rounding is Rounding.RDOWN:
        away = inexact & neg
    else:
        draws = cast(Tensor, random)  # round_values checked that sr comes with its random bits
        head = torch.where(s >= sr_bits, dropped >> torch.clamp(s - sr_bits, max=W - 1),
                           dropped << torch.clamp(sr_bits - s, min=0, max=W - 1))
        away = (head + draws.to(it)) >= (1 << sr_bits)
    mag = kept + away.to(it)

    # overflow, decided on the rounded magnitude at the target's quantum
    limit_sig = torch.where(neg, tgt.min_sig, torch.full_like(mag, tgt.max_sig))
    qmax = tgt.qmax if scale_exp is None else scale_exp + tgt.qmax
    over = (qexp > qmax) | ((qexp == qmax) & (mag > limit_sig))
    out = _assemble(src, mag, qexp)

    if scale_exp is None:
        max_bits = _magnitude_bits(src, tgt.max_sig, tgt.qmax)
        limit_bits = torch.where(neg, _magnitude_bits(src, tgt.min_sig, tgt.qmax),
                                 torch.full_like(u, max_bits))
        smallest_bits: Tensor | int = _pow2_bits(src, tgt.smallest_exp)
    else:
        limit_bits = _assemble(src, limit_sig, scale_exp + tgt.qmax)
        smallest_bits = _assemble(src, torch.ones_like(u), scale_exp + tgt.smallest_exp)
    inf_bits = exp_all << src.mbits
    nan_bits = inf_bits | (1 << (src.mbits - 1))
    special_bits = inf_bits if tgt.has_inf else (nan_bits if tgt.has_nan else None)
    if overflow is Overflow.SATURATE or special_bits is None:
        over_bits = limit_bits
        inf_in = limit_bits
    else:
        if rounding is Rounding.RTZ:
            toward_zero = torch.ones_like(neg)
        elif rounding is Rounding.RUP:
            toward_zero = neg
        elif rounding is Rounding.RDOWN:
            toward_zero = ~neg
        else:
            toward_zero = torch.zeros_like(neg)
        over_bits = torch.where(toward_zero, limit_bits, special_bits)
        inf_in = torch.full_like(u, special_bits)
    out = torch.where(over, over_bits, out)
    out = torch.where(nonfinite, inf_in, out)
    if not tgt.has_zero:
        out = torch.maximum(out, torch.as_tensor(smallest_bits, dtype=it))
    # the sign: −0 only where the format has it, and nothing negative on an unsigned format
    keep_sign = neg & ((out != 0) | tgt.has_neg_zero) if tgt.signed else torch.zeros_like(neg)
    out = out | (keep_sign.to(it) * sign_mask)
    if not tgt.signed:
        below = neg & ((u != 0) | nonfinite)
        if overflow is Overflow.IEEE and tgt.has_nan:
            out = torch.where(below, nan_bits, out)
        else:
            # the format's least value: 0 where it has a zero (UE5M3), else its smallest (E8M0)
            least = 0 if tgt.has_zero else smallest_bits
            out = torch.where(below, least, out)
    out = torch.where(is_nan, nan_bits, out)
    return out.view(src.fdtype)


def _run(x: Tensor, residual: Tensor | None, random: Tensor | None,
         scale_exp: Tensor | None = None, **static: Any) -> Tensor:
    """The kernel on the back-end :func:`driftcli.kernels.numba_runs` chooses: numba's machine
    code (:mod:`driftcli.kernels.jit`), or torch's ops in cache-sized chunks. Both give the
    same bits."""
    if kernels.numba_runs(x, residual, random, scale_exp):
        return jit.round_bits(x, residual, random, scale_exp, jit_params(**static))
    return _eager(x, residual, random, scale_exp, **static)


@cache
def jit_params(*, src: _Source, tgt: Target, rounding: Rounding, overflow: Overflow,
               sr_bits: int) -> tuple[int, ...]:
    """The numba kernels' parameter vector (:data:`driftcli.kernels.jit.PARAMS`) of one rounding."""
    return jit.params(src.ebits, src.mbits, tgt, rounding.value, overflow.value, sr_bits)


EAGER_CHUNK = 1 << 18
"""Elements per eager step: the kernel's ~40 elementwise passes then stay in cache (several
times faster than one pass over the whole tensor; docs/performance-history.md)."""


def _eager(x: Tensor, residual: Tensor | None, random: Tensor | None,
           scale_exp: Tensor | None, **static: Any) -> Tensor:
    if x.numel() <= EAGER_CHUNK:
        return _kernel(x, residual, random, scale_exp, **static)
    # rows share a scale exponent, so keep them whole; unscaled, any split will do
    cols = x.shape[-1] if x.dim() > 1 and scale_exp is not None else 1
    rows = x.reshape(-1, cols)
    out = torch.empty_like(rows)
    step = max(1, EAGER_CHUNK // cols)

    def part(t: Tensor | None, i: int) -> Tensor | None:
        return None if t is None else t.reshape(rows.shape[0], -1)[i:i + step]

    for i in range(0, rows.shape[0], step):
        out[i:i + step] = _kernel(rows[i:i + step], part(residual, i), part(random, i),
                                  part(scale_exp, i), **static)
    return out.reshape(x.shape)


# --- public entry points -------------------------------------------------------------------

_DTYPE_FORMAT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def result_dtype(dtype: torch.dtype, fmt: Format) -> torch.dtype:
    """The dtype rounding returns: the input's if it holds every value of ``fmt``, else float32."""
    if dtype == torch.float64:
        return dtype
    name = _DTYPE_FORMAT.get(dtype)
    return dtype if name is not None and FORMATS[name].contains(fmt) else torch.float32


def _working(x: Tensor, what: str, wide: bool = False) -> tuple[Tensor, _Source]:
    if x.dtype == torch.float64 or (wide and x.dtype.is_floating_point):
        return x.to(torch.float64).contiguous(), _F64
    if x.dtype in _DTYPE_FORMAT:
        return x.to(torch.float32).contiguous(), _F32
    raise DriftError(f"{what} has dtype {x.dtype}; round float32, float64, bfloat16 or float16 "
                     "tensors (convert integers with .float() first)")


def check_random_bits(bits: Tensor, shape: torch.Size, sr_bits: int) -> None:
    """Raise a DriftError unless ``bits`` is an integer tensor of ``shape`` in 0..2**sr_bits-1."""
    if bits.shape != shape or bits.dtype.is_floating_point:
        raise DriftError(f"random_bits must be an integer tensor of shape {tuple(shape)}, "
                         f"not {bits.dtype} of shape {tuple(bits.shape)}")
    if bits.numel() and (int(bits.min()) < 0 or int(bits.max()) >= 1 << sr_bits):
        raise DriftError(f"random_bits must lie in 0..2**{sr_bits}-1 (sr_bits={sr_bits})")


def round_to_format(x: Tensor, fmt: str | Format, *, rounding: Rounding | str = Rounding.RNE,
                    overflow: Overflow | str = Overflow.SATURATE, random_bits: Tensor | None = None,
                    sr_bits: int = DEFAULT_SR_BITS) -> Tensor:
    """Round every element of ``x`` onto the grid of ``fmt``; return the values it lands on.

    ``rounding`` is one of ``rne rna rtz rup rdown sr``; ``sr`` reads
    ``random_bits``, an integer tensor shaped like ``x`` holding ``sr_bits``
    uniform random bits per element. ``overflow`` is ``saturate`` or ``ieee``.
    NaN stays NaN (also for formats without NaN, whose elements are then not
    representable); −0 is kept where the format has it. The result is float32,
    or ``x``'s dtype when that holds every value of ``fmt`` (float64 always).
    """
    fmt = get_format(fmt)
    mode = parse_choice(Rounding, rounding, "rounding mode")
    policy = parse_choice(Overflow, overflow, "overflow policy")
    return round_values(x, None, fmt, mode, policy, random_bits, sr_bits,
                        result_dtype(x.dtype, fmt))


def round_values(x: Tensor, residual: Tensor | None, fmt: Format, mode: Rounding,
                 policy: Overflow, random_bits: Tensor | None, sr_bits: int,
                 out_dtype: torch.dtype, scale_exp: Tensor | None = None,
                 wide: bool = False) -> Tensor:
    """Round ``x`` (+ ``residual``) onto ``fmt``'s grid (times ``2**scale_exp``).

    ``wide`` works in float64 (for scaled grids beyond float32's range).
    """
    work, src = _working(x, "input", wide)
    random = None
    if mode is Rounding.SR:
        if random_bits is None:
            raise DriftError("rounding 'sr' needs random_bits (or stochastic_round with a seed)")
        if not 1 <= sr_bits <= MAX_SR_BITS:
            raise DriftError(f"sr_bits={sr_bits} is out of range; use 1..{MAX_SR_BITS}")
        check_random_bits(random_bits, x.shape, sr_bits)
        random = random_bits.to(src.idtype).contiguous()
    if scale_exp is not None:
        scale_exp = scale_exp.to(src.idtype)
    out = _run(work, residual, random, scale_exp, src=src, tgt=Target.of(fmt), rounding=mode,
               overflow=policy, sr_bits=sr_bits)
    return out.to(out_dtype)


def source_of(dtype: torch.dtype) -> _Source:
    """The bit layout the kernel reads for a working dtype (float32 or float64)."""
    return _F64 if dtype == torch.float64 else _F32


def target_of(fmt: Format) -> Target:
    """The kernel's constants for ``fmt`` (hashable; pass it into compiled functions)."""
    return Target.of(fmt)


def round_sum(s: Tensor, r: Tensor, tgt: Target, rounding: Rounding, *, wide: bool) -> Tensor:
    """``s + r`` rounded once onto ``tgt``'s grid, with ``r`` the exact error of ``s`` (see
    :func:`driftcli.casts.twosum.two_sum`), overflowing to inf as IEEE addition does: one step of a
    simulated accumulator. ``wide`` for float64 sums."""
    static = {"src": _F64 if wide else _F32, "tgt": tgt, "rounding": rounding,
              "overflow": Overflow.IEEE, "sr_bits": DEFAULT_SR_BITS}
    return _run(s.contiguous(), r.contiguous(), None, None, **static)


def round_fused(x: Tensor, fmt: Format | Target, rounding: Rounding, overflow: Overflow,
                random: Tensor | None = None, scale_exp: Tensor | None = None,
                sr_bits: int = DEFAULT_SR_BITS) -> Tensor:
    """The rounding on a float32 or float64 tensor for the steps of a larger function (a
    scale rounded into its format, elements under their block's exponent): no argument checks,
    the result in ``x``'s dtype, on the back-end :func:`driftcli.kernels.numba_runs` chooses.
    ``scale_exp`` is one exponent per element or one per row of a 2-D ``x``."""
    src = _F64 if x.dtype == torch.float64 else _F32
    tgt = fmt if isinstance(fmt, Target) else Target.of(fmt)
    return _run(x.contiguous(), None, None if random is None else random.to(src.idtype),
                None if scale_exp is None else scale_exp.to(src.idtype).contiguous(), src=src,
                tgt=tgt, rounding=rounding, overflow=overflow, sr_bits=sr_bits)


def draw_random_bits(shape: torch.Size | tuple[int, ...], seed: int | torch.Generator,
                     sr_bits: int = DEFAULT_SR_BITS, device: torch.device | str = "cpu") -> Tensor:
    """``sr_bits`` uniform random bits per element from a seeded generator (int32)."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator(device).manual_seed(seed)
    return torch.randint(0, 1 << sr_bits, tuple(shape), generator=gen, dtype=torch.int32,
                         device=device)


def stochastic_round(x: Tensor, fmt: str | Format, *, seed: int | torch.Generator,
                     overflow: Overflow | str = Overflow.SATURATE,
                     sr_bits: int = DEFAULT_SR_BITS) -> Tensor:
    """Stochastic rounding with random bits drawn from ``seed``: reproducible for a seed."""
    bits = draw_random_bits(x.shape, seed, sr_bits, x.device)
    return round_to_format(x, fmt, rounding=Rounding.SR, overflow=overflow, random_bits=bits,
                           sr_bits=sr_bits)


def _two_operand(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    if a.dtype.is_floating_point is False or b.dtype.is_floating_point is False:
        raise DriftError("operands must be floating-point tensors")
    a64, b64 = torch.broadcast_tensors(a.to(torch.float64), b.to(torch.float64))
    return a64, b64


def multiply(a: Tensor, b: Tensor, fmt: str | Format, *, rounding: Rounding | str = Rounding.RNE,
             overflow: Overflow | str = Overflow.SATURATE, random_bits: Tensor | None = None,
             sr_bits: int = DEFAULT_SR_BITS) -> Tensor:
    """``a * b`` rounded once onto ``fmt``; exact for operands of up to 26 significant bits.

    The product is formed in float64, where two significands of at most 26
    bits (float32's 24 included) multiply without rounding.
    """
    a64, b64 = _two_operand(a, b)
    fmt = get_format(fmt)
    return round_values(a64 * b64, None, fmt, parse_choice(Rounding, rounding, "rounding mode"),
                  parse_choice(Overflow, overflow, "overflow policy"), random_bits, sr_bits,
                  result_dtype(torch.promote_types(a.dtype, b.dtype), fmt))


def add(a: Tensor, b: Tensor, fmt: str | Format, *, rounding: Rounding | str = Rounding.RNE,
        overflow: Overflow | str = Overflow.SATURATE, random_bits: Tensor | None = None,
        sr_bits: int = DEFAULT_SR_BITS) -> Tensor:
    """``a + b`` rounded once onto ``fmt``, exactly (float64 operands: unless the sum overflows
    float64 itself).

    The float64 sum ``s`` and its exact error ``r`` (Knuth's TwoSum) describe
    the exact sum; ``r`` lies below ``s``'s last bit and enters the rounding
    as a sticky bit. An exact zero takes IEEE 754's sign: +0 for operands of
    opposite signs, −0 when rounding toward −inf.
    """
    a64, b64 = _two_operand(a, b)
    fmt = get_format(fmt)
    mode = parse_choice(Rounding, rounding, "rounding mode")
    s, r = two_sum(a64, b64)
    r = torch.where(torch.isfinite(s), r, torch.zeros_like(r))
    sa, sb = torch.signbit(a64), torch.signbit(b64)
    zero_negative = (sa & sb) | ((sa != sb) & (mode is Rounding.RDOWN))
    s = torch.where(s == 0, torch.where(zero_negative, -0.0, 0.0).to(s.dtype), s)
    return round_values(s, r, fmt, mode, parse_choice(Overflow, overflow, "overflow policy"),
                  random_bits, sr_bits, result_dtype(torch.promote_types(a.dtype, b.dtype), fmt))
