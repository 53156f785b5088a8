"""The backends calibrate multiplies with: torch on a device and dtype, or a drift matmul spec
(``drift:<spec>``), and the error a backend or a recordings folder that cannot be calibrated
raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from driftcli.arith.matmul import MatmulSpec, matmul
from driftcli.errors import DriftError
from driftcli.records.formats import FORMATS, Format, get_format

FLOAT32 = FORMATS["float32"]


class CalibrateError(DriftError, ValueError):
    """A backend or a recordings folder that cannot be calibrated as asked."""


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
