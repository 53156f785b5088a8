"""Probes run: the backend's results and a model's on the same operands, compared bit for bit."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from driftcli.arith.blockfma import (
    Accumulation,
    FMAUnit,
    Prepared,
    prepare,
)
from driftcli.arith.matmul import Order, input_emin, matmul
from driftcli.casts.rounding import round_to_format
from driftcli.measures.calibrate.backends import FLOAT32, Backend
from driftcli.measures.calibrate.family import Model
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import Format
from driftcli.records.modes import Overflow, Rounding


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


def observe(be: Backend, a: Tensor, b: Tensor) -> Observed:
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


def probe_share(model: Model, be: Backend, obs: Observed) -> float:
    return float(same_bits(model_results(model, be, obs), obs.results).double().mean())
