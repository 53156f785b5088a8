"""The random Hadamard transform (RHT) applied before a cast (``rht=`` in a cast spec): each
group of 16 elements along the block axis is multiplied by ``diag(signs) @ H16 / 4``, as
Transformer Engine's NVFP4 recipe does to its wgrad operands before their 1 x 16 cast.

The arithmetic follows ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``
(``_apply_rht`` lines 421-444: ``x.view(-1, 16) @ (H * 0.25)`` in the input's dtype, bfloat16 in
the recipe) and the fused kernel it is tested against bit for bit,
``common/hadamard_transform/hadamard_transform_cast_fusion.cu`` (bfloat16 operands on tensor
cores, a float32 accumulator, then "Downcast to BF16 for bit-wise compatibility", lines
481-485), NVIDIA/TransformerEngine at d0067d0. Neither fixes the order of the float32
accumulation; drift fixes it as: each product ``fl32(x_i · m_ij)``, summed from ``+0`` for
``i = 0 .. 15`` with one float32 addition each, the sum rounded to bfloat16 (nearest even,
overflow to inf). Every order gives these bits wherever the 16 products' float32 sum is exact
(for bfloat16 inputs, products within 12 binades of each other: docs/recipes.md). No inverse is
applied: the recipe transforms both operands of the wgrad GEMM, whose product the transform
leaves unchanged (``(H/4)(H/4)ᵀ = I``).

The hot loop runs on the kernel seam: numba's ``kernels.rhtcode.rht_kernel`` (through
:func:`driftcli.kernels.jit.hadamard16`) or torch here, the same bits; its exact twin is
``driftcli.oracle.hadamard.hadamard16``.

With ``tc=<core>`` beside ``rht=`` the transform runs as that tensor core's MMA does instead:
the operands rounded to bfloat16 (nearest even; the kernel reads bfloat16 only, so bfloat16 data
is unchanged), each output the block-FMA dot product of its group with a column of the matrix
(:func:`driftcli.arith.blockfma.fma_dot` under the core's unit: terms aligned to the largest,
cut, summed exactly, rounded once per group into its float32 accumulator toward zero), then
rounded to bfloat16 as above. Both back-ends are the block-FMA unit's own (numba's
``kernels.fmacode`` or its torch ops); the exact twin is
``driftcli.oracle.hadamard.hadamard16_blockfma``.
"""

from __future__ import annotations

import torch

from driftcli import kernels
from driftcli.arith.blockfma import fma_dot
from driftcli.arith.tensorcores import CORES, tensor_core
from driftcli.casts.rounding import round_values
from driftcli.errors import CastSpecError, DriftError
from driftcli.kernels import jit
from driftcli.records.cast import RHT_SIZE, Cast, Rht
from driftcli.records.formats import FORMATS
from driftcli.records.modes import DEFAULT_SR_BITS, Overflow, Rounding

Tensor = torch.Tensor


def matrix(rht: Rht) -> Tensor:
    """The 16 x 16 transform ``m[i, j] = s_i · H16[i][j] / 4`` as float64 (every entry ±1/4)."""
    return torch.tensor(rht.entries(), dtype=torch.float64).view(RHT_SIZE, RHT_SIZE)


def torch_groups(groups: Tensor, rht: Rht) -> Tensor:
    """The transform of each row of ``groups`` (``(n, 16)``, any float dtype) on the torch
    back-end: float32 values on bfloat16's grid."""
    m = matrix(rht).to(groups.device)
    wide = groups.double()  # exact: fl32 of the exact product is one rounding below
    acc = torch.zeros(groups.shape, dtype=torch.float32, device=groups.device)
    for i in range(RHT_SIZE):  # the order drift fixes: i = 0 first, one float32 add each
        acc = acc + (wide[:, i:i + 1] * m[i]).float()
    return round_values(acc.contiguous(), None, FORMATS["bfloat16"], Rounding.RNE,
                        Overflow.IEEE, None, DEFAULT_SR_BITS, torch.float32)


CORE_INPUTS = FORMATS["bfloat16"]
"""The operand format of the tensor cores a transform may run on (``tc=``): the kernel's."""


def transform_cores() -> list[str]:
    """The tensor cores ``tc=`` may name beside ``rht=``: those of ``CORES`` whose operands are
    bfloat16 (their accumulators are float32)."""
    return [name for name, core in CORES.items() if core.input_format == CORE_INPUTS]


def check_core(rht: Rht | None) -> None:
    """Refuse (:class:`CastSpecError`, exit 2) a ``tc=`` that names no tensor core with
    bfloat16 inputs: the spec grammar cannot (it reads no ``CORES``), so a command checks its
    casts here before it reads anything."""
    if rht is None or not rht.core or rht.core in transform_cores():
        return
    raise CastSpecError(f"rht={rht}: {rht.core!r} is not a tensor core with {CORE_INPUTS.name} "
                        f"inputs; choose tc= from {', '.join(transform_cores())} "
                        "(docs/recipes.md)")


def core_groups(groups: Tensor, rht: Rht) -> Tensor:
    """The transform of each row of ``groups`` (``(n, 16)``, any float dtype) on the tensor
    core ``rht.core``'s block-FMA unit: float32 values on bfloat16's grid. The back-end is the
    unit's (:func:`driftcli.arith.blockfma.fma_dot`)."""
    check_core(rht)
    core = tensor_core(rht.core)
    # the MMA reads bfloat16 operands: a wider source is rounded once, as .to(bfloat16) does
    x = round_values(groups.contiguous(), None, core.input_format, Rounding.RNE, Overflow.IEEE,
                     None, DEFAULT_SR_BITS, torch.float32)
    columns = matrix(rht).to(groups.device).T.contiguous()  # row j: the matrix's column j
    n = x.shape[0]
    acc = fma_dot(x, columns, core.accumulation(), shape=(1, n, RHT_SIZE))
    return round_values(acc.float().view(n, RHT_SIZE).contiguous(), None, FORMATS["bfloat16"],
                        Rounding.RNE, Overflow.IEEE, None, DEFAULT_SR_BITS, torch.float32)


def rht_problem(rht: Rht | None, shape: tuple[int, ...], axis: int = -1) -> str | None:
    """Why the transform ``rht`` cannot run on a tensor of ``shape`` along ``axis`` (it needs
    whole groups of 16 there), or None (also for no transform)."""
    if rht is None or (shape and shape[axis] % RHT_SIZE == 0):
        return None
    return (f"rht={rht} transforms groups of {RHT_SIZE} along the block axis; a tensor of "
            f"shape {shape} has {shape[axis] if shape else 1} there: pad that axis to a "
            f"multiple of {RHT_SIZE} or cast along another")


def transform(x: Tensor, rht: Rht, axis: int = -1) -> Tensor:
    """``x`` with every run of 16 elements along ``axis`` transformed: a float32 tensor of
    ``x``'s shape (its values on bfloat16's grid). The length along ``axis`` must be a
    multiple of 16, as the reference requires."""
    if (why := rht_problem(rht, tuple(x.shape), axis)) is not None:
        raise DriftError(why)
    moved = x.detach().movedim(axis, -1).contiguous()
    groups = moved.reshape(-1, RHT_SIZE)
    if rht.core:
        out = core_groups(groups, rht)
    elif kernels.numba_runs(groups) and groups.dtype in (torch.float32, torch.float64):
        out = jit.hadamard16(groups, rht.entries())
    else:
        out = torch_groups(groups, rht)
    return out.reshape(moved.shape).movedim(-1, axis)


def transformed(x: Tensor, c: Cast, axis: int = -1) -> Tensor:
    """What the cast ``c`` reads: ``x`` itself, or its transform where ``c`` has ``rht=``."""
    return x if c.rht is None else transform(x, c.rht, axis)
