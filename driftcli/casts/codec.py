"""Vectorized codes ↔ values for any format, from the bit fields.

``decode`` is the tensor twin of :meth:`Format.decode` (checked against it on
every code by ``drift verify-formats``); ``encode`` turns values already on a
format's grid (the output of :func:`driftcli.round_to_format`) into codes.
"""

from __future__ import annotations

from functools import cache

import torch

from driftcli.errors import DriftError
from driftcli.records.formats import Format, Kind, NanEncoding, get_format

Tensor = torch.Tensor


def nan_code(fmt: Format) -> int | None:
    """The canonical NaN code: quiet NaN (IEEE), all ones (TOP), the sign bit alone (fnuz)."""
    top_exp = ((1 << fmt.ebits) - 1) << fmt.mbits
    match fmt.nan:
        case NanEncoding.IEEE:
            return top_exp | (1 << (fmt.mbits - 1))
        case NanEncoding.TOP:
            return top_exp | ((1 << fmt.mbits) - 1)
        case NanEncoding.NEG_ZERO:
            return 1 << (fmt.bits - 1)
    return None


def decode(codes: Tensor, fmt: str | Format) -> Tensor:
    """Float32 values of integer ``codes`` (every format's values are float32s)."""
    fmt = get_format(fmt)
    c = codes.to(torch.int64) & ((1 << fmt.bits) - 1)
    if fmt.taper is not None:  # no field arithmetic reads a tapered code: its table does
        return _tapered_values(fmt)[c]
    if fmt.integer:
        signed = torch.where(c >= 1 << (fmt.bits - 1), c - (1 << fmt.bits), c)
        return torch.ldexp(signed.to(torch.float64), torch.tensor(float(fmt.qmin))).float()
    negative = (c >> (fmt.ebits + fmt.mbits)) & 1 if fmt.signed else torch.zeros_like(c)
    exp_field = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    man = c & ((1 << fmt.mbits) - 1)
    if fmt.has_subnormals:
        sig = torch.where(exp_field == 0, man, man + (1 << fmt.mbits))
        exp = torch.clamp(exp_field, min=1) - fmt.bias - fmt.mbits
    else:
        sig, exp = man + (1 << fmt.mbits), exp_field - fmt.bias - fmt.mbits
    mag = torch.ldexp(sig.to(torch.float64), exp.to(torch.float64))
    top_exp = exp_field == (1 << fmt.ebits) - 1
    if fmt.nan is NanEncoding.IEEE:
        special = torch.where(man == 0, torch.inf, torch.nan) if fmt.has_inf else torch.nan
        mag = torch.where(top_exp, special, mag)
    elif fmt.nan is NanEncoding.TOP:
        mag = torch.where(top_exp & (man == (1 << fmt.mbits) - 1), torch.nan, mag)
    elif fmt.nan is NanEncoding.NEG_ZERO:
        mag = torch.where(c == 1 << (fmt.bits - 1), torch.nan, mag)
    if fmt.inf_code is not None and fmt.nan is not NanEncoding.IEEE:
        # P3109's extended domain: inf at the top non-NaN code of each sign
        magnitude_code = c & ((1 << (fmt.ebits + fmt.mbits)) - 1)
        mag = torch.where(torch.eq(magnitude_code, fmt.inf_code), torch.inf, mag)
    return torch.where(negative == 1, -mag, mag).float()


@cache
def _tapered_values(fmt: Format) -> Tensor:
    """Float32 values of every code of a tapered format, in code order."""
    values = [float("nan") if v.kind is Kind.NAN else
              float("inf") * (-1 if v.negative else 1) if v.kind is Kind.INF else float(v.value)
              for _, v in fmt.values()]
    return torch.tensor(values, dtype=torch.float32)


def encode(values: Tensor, fmt: str | Format) -> Tensor:
    """Int64 codes of ``values``, which must already lie on ``fmt``'s grid.

    NaN gets the canonical NaN code; a value off the grid, or NaN on a format
    without NaN, raises :class:`DriftError`.
    """
    fmt = get_format(fmt)
    v = values.to(torch.float64)
    finite = torch.isfinite(v)
    mag = torch.where(finite, v.abs(), torch.zeros_like(v))
    negative = (torch.signbit(v) & ((mag != 0) | torch.isinf(v) | fmt.has_neg_zero)).to(torch.int64)
    if fmt.taper is not None:
        # NaN sorts last, after +inf (a stable sort keeps inf's code first)
        table = _tapered_values(fmt).to(torch.float64).nan_to_num(
            nan=torch.inf, posinf=torch.inf, neginf=-torch.inf)
        order = torch.argsort(table, stable=True)
        # the NaN code is set below; -0.0 finds 0's code (no tapered format has −0)
        index = torch.searchsorted(table[order], torch.where(torch.isnan(v), 0.0, v).contiguous())
        code = order[torch.clamp(index, max=len(order) - 1)]
        exact = torch.ones_like(finite)
    elif fmt.integer:
        n = torch.ldexp(torch.where(finite, v, torch.zeros_like(v)), torch.tensor(float(-fmt.qmin)))
        code = n.to(torch.int64) & ((1 << fmt.bits) - 1)
        exact = n == torch.trunc(n)
    else:
        _mant, exp = torch.frexp(mag)  # mag = mant * 2**exp, 0.5 <= mant < 1: exponents from bits
        e = exp.to(torch.int64) - 1
        normal = (e >= fmt.emin) | (not fmt.has_subnormals)
        quantum = torch.where(normal, e, torch.full_like(e, fmt.emin)) - fmt.mbits
        sig_f = torch.ldexp(mag, -quantum.to(torch.float64))
        sig = sig_f.to(torch.int64)
        exact = sig_f == torch.trunc(sig_f)
        exp_field = torch.where(normal & (mag != 0), e + fmt.bias, torch.zeros_like(e))
        man = torch.where(normal & (mag != 0), sig - (1 << fmt.mbits), sig)
        code = (exp_field << fmt.mbits) | man
        if fmt.signed:
            code = code | (negative << (fmt.ebits + fmt.mbits))
        if fmt.inf_code is not None:
            sign = negative << (fmt.bits - 1) if fmt.signed else 0
            code = torch.where(torch.isinf(v), fmt.inf_code | sign, code)
        exact = exact | torch.isinf(v)
    nan = nan_code(fmt)
    if nan is not None:
        code = torch.where(torch.isnan(v), nan, code)
        exact = exact | torch.isnan(v)
    roundtrip = decode(code, fmt).to(torch.float64)
    same = (roundtrip == v) | (torch.isnan(v) & torch.isnan(roundtrip))
    bad = ~(exact & same)
    if fmt.has_neg_zero:
        bad |= (v == 0) & (torch.signbit(roundtrip) != torch.signbit(v))
    if bool(bad.any()):
        where = int(bad.nonzero()[0, 0]) if bad.dim() else 0
        raise DriftError(f"value {v.flatten()[where].item()!r} is not a value of {fmt.name}; "
                         "round it first (round_to_format)")
    return code
