"""Four over six (4/6): Transformer Engine's NVFP4 cast that quantizes each 1 x 16 block twice,
with the map-to-6 block scale and a map-to-4 one 1.5x larger, and keeps the candidate with the
smaller error (ties to map-to-6), the tensor scale's E4M3 bound 256 instead of 448.

The op sequence follows ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``
(``_quantize_blockwise_reference`` lines 694-746, ``_quantize_blockwise_4over6_reference``
lines 523-648, ``_ref_nvfp4_4over6_fp16_candidate`` lines 465-510) and the kernel it mirrors,
``common/cast/nvfp4/quantize_4over6_nvfp4.cuh`` lines 126-201, 246-258 (NVIDIA/
TransformerEngine at d0067d0); dequantized as ``dequantize_nvfp4.cuh`` lines 66-69 do with
``E4M3_MAX = 256``. Each step is one IEEE float32 operation. The scales are torch (one value per
block); the candidates' codes and errors, the hot loop, run on the kernel seam: numba's
``kernels.fourcode.errors_kernel`` (with the element kernel's rounding) or torch's element
rounding and :func:`block_errors`, the same bits. A values-only cast whose blocks are all
finite takes :func:`fused_values` on numba instead: scales, candidates, errors, the choice and
the values in one pass (``kernels.fourcode.values_kernel``), the same bits again. Its exact
twin is ``driftcli.oracle.fouroversix.four_over_six``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from driftcli import kernels
from driftcli.casts import rounding
from driftcli.casts.rounding import round_values
from driftcli.casts.scalearith import F32_MAX, ArithScales
from driftcli.casts.scaling import to_blocks
from driftcli.kernels import jit
from driftcli.records.cast import Cast
from driftcli.records.formats import FORMATS, Format
from driftcli.records.modes import (
    DEFAULT_SR_BITS,
    ElementOp,
    Granularity,
    Overflow,
    Rounding,
    TwoLevelOrder,
)

Tensor = torch.Tensor

E4M3_BOUND = 256.0
"""``nvfp4_e4m3_max`` under 4/6: the tensor scale maps amax to 6 · 256 = 1536, so that a
map-to-4 block scale (1.5x the map-to-6 one) stays within E4M3's 448 (reference lines 696,
382-384)."""
GLOBAL_MAX = 6.0 * E4M3_BOUND
EXPAND = 1.5
PREFER_MAP4: Callable[[Tensor, Tensor], Tensor] = torch.lt
"""Where map-to-4's error beats map-to-6's: strictly smaller (line 637: ties, and a NaN error,
keep map-to-6); a module constant so that a test can plant ``torch.le``."""
"""``expand_to_map4`` (quantize_4over6_nvfp4.cuh line 131)."""


def _e4m3(raw: Tensor) -> Tensor:
    """``.to(torch.float8_e4m3fn)`` after the reference's clamp to ±448: nearest even,
    saturating, NaN kept."""
    return round_values(raw.contiguous(), None, FORMATS["float8_e4m3fn"], Rounding.RNE,
                        Overflow.SATURATE, None, DEFAULT_SR_BITS, raw.dtype)


def tensor_scales(tensor_amax: Tensor) -> tuple[Tensor, Tensor]:
    """``S_enc = min(fl(1536 / amax_t), max)`` (1 where it is 0, or amax_t is 0: core_nvfp4.cuh
    ``compute_global_encode_scaling_factor_FP4``) and ``S_dec = fl(1 / S_enc)``, float32; one
    value, or one per block for row-scaled NVFP4 (``amax_t`` its row's)."""
    t = tensor_amax.float()
    enc = torch.clamp(torch.tensor(GLOBAL_MAX) / t, max=F32_MAX)
    enc = torch.where((t == 0) | (enc == 0), 1.0, enc)
    return enc, 1 / enc


def candidate_scales(amax: Tensor, enc: Tensor, dec: Tensor) -> tuple[Tensor, ...]:
    """Per row: the map-to-4 and map-to-6 E4M3 block scales, their float32 multipliers
    ``min(fl(1 / fl(sb · S_dec)), max)`` and the raw map-to-4 and map-to-6 scales."""
    base = (amax / torch.tensor(6.0)) * enc
    raw4 = base * torch.tensor(EXPAND)
    sb4, sb6 = _e4m3(raw4), _e4m3(base)
    inv4 = torch.clamp(1 / (sb4 * dec), max=F32_MAX)
    inv6 = torch.clamp(1 / (sb6 * dec), max=F32_MAX)
    return sb4, sb6, inv4, inv6, raw4, base


def fp16_product(q: Tensor, sb: Tensor) -> Tensor:
    """``q · sb`` as the kernel's FP16 product (reference lines 465-510): every product of an
    E2M1 and an E4M3 value is an FP16 value (at most 8 significant bits, magnitudes 2**-10 to
    2688), so it is the exact product in float32; an E4M3 NaN scale gives NaN."""
    return q * sb[:, None]


def block_errors(blocks: Tensor, q: Tensor, sb: Tensor, t: Tensor, enc: Tensor,
                 order: TwoLevelOrder) -> Tensor:
    """Each row's error of one candidate (codes ``q``, block scale ``sb``), accumulated from 0
    over its elements in order, one float32 addition each (reference lines 601-635); ``t`` and
    ``enc`` one value, or one per row (row-scaled: lines 614-617, ``error_global_amax``)."""
    if t.dim():
        t, enc = t[:, None], enc[:, None]
    if order.fp16_error:
        cand = fp16_product(q, sb)
        original = blocks * enc
        diff = cand - original
    else:
        val = ((q * sb[:, None]) * t) / torch.tensor(GLOBAL_MAX)
        diff = val - blocks
    terms = diff * diff if order.squared else diff.abs()
    err = torch.zeros(blocks.shape[0], dtype=torch.float32, device=blocks.device)
    for i in range(blocks.shape[1]):  # the reference's order: element 0 first
        err = err + terms[:, i]
    return err


def candidate_errors(blocks: Tensor, elem: Format, sb4: Tensor, sb6: Tensor, inv4: Tensor,
                     inv6: Tensor, t: Tensor, enc: Tensor,
                     order: TwoLevelOrder) -> tuple[Tensor, Tensor]:
    """Both candidates' errors per row, on whichever back-end runs (numba:
    ``kernels.fourcode.errors_kernel``; torch: the element rounding and
    :func:`block_errors`), the same bits."""
    tgt = rounding.target_of(elem)
    if kernels.numba_runs(blocks):
        p = rounding.jit_params(src=rounding.source_of(torch.float32), tgt=tgt,
                                rounding=Rounding.RNE, overflow=Overflow.SATURATE,
                                sr_bits=DEFAULT_SR_BITS)
        return jit.four_over_six_errors(blocks, inv4, inv6, sb4, sb6, t, enc,
                                        float(torch.tensor(GLOBAL_MAX, dtype=torch.float32)),
                                        p, order.squared, order.fp16_error)

    def codes(m: Tensor) -> Tensor:
        return rounding.round_fused((blocks * m[:, None]).contiguous(), tgt, Rounding.RNE,
                                    Overflow.SATURATE, None, None, DEFAULT_SR_BITS)

    return (block_errors(blocks, codes(inv4), sb4, t, enc, order),
            block_errors(blocks, codes(inv6), sb6, t, enc, order))


RUN = 16
"""The run of elements whose error is summed in order: a 1 x 16 block, or one row of a 16 x 16
tile."""


def tile_sum(rows: Tensor) -> Tensor:
    """Each row of ``rows`` (``(n, 16)``: a tile's 16 row errors) summed as the CUDA warp
    reduction does, halves added pairwise, one float32 addition each: ``(r0..7 + r8..15)``,
    then ``(0..3 + 4..7)``, ``(0,1 + 2,3)``, ``(0 + 1)`` (reference_nvfp4.py
    ``_sum_4over6_2d_error`` lines 512-521)."""
    while rows.shape[1] > 1:
        half = rows.shape[1] // 2
        rows = rows[:, :half] + rows[:, half:]
    return rows[:, 0]


def four_over_six_scales(blocks: Tensor, amax: Tensor, tensor_amax: Tensor, elem: Format,
                         order: TwoLevelOrder) -> ArithScales:
    """The scales of every 1 x 16 block or 16 x 16 tile (rows of float32 ``blocks``: 16 or 256
    elements, a tile's rows one after another; ``amax`` each row's ``fmaxf`` amax,
    ``tensor_amax`` the tensor's) under 4/6: both candidates cast (codes of ``fl(x ·
    multiplier)`` in ``elem``, nearest even, saturating), their errors, the choice. A tile's
    two candidates take the tile's amax; the error of each of its 16 rows is summed in order
    as a block's is, the 16 row errors by :func:`tile_sum`, and the choice is the tile's
    (reference_nvfp4.py lines 628-642). Row-scaled (``order.row_scaled``, 1 x 16 blocks only):
    ``tensor_amax`` holds each block's row amax, which takes the tensor amax's place in every
    step (reference lines 709-710, 614-617; quantize_4over6_nvfp4.cuh line 481)."""
    t = tensor_amax.float()
    enc, dec = tensor_scales(t)
    sb4, sb6, inv4, inv6, raw4, raw6 = candidate_scales(amax, enc, dec)
    runs = blocks.shape[1] // RUN  # 1 for a block, 16 for a tile

    def each_run(v: Tensor) -> Tensor:
        return v if runs == 1 else v.repeat_interleave(runs)

    err4, err6 = candidate_errors(blocks.reshape(-1, RUN), elem, each_run(sb4), each_run(sb6),
                                  each_run(inv4), each_run(inv6), t, enc, order)
    if runs > 1:
        err4, err6 = tile_sum(err4.view(-1, runs)), tile_sum(err6.view(-1, runs))
    pick4 = PREFER_MAP4(err4, err6)
    sb = torch.where(pick4, sb4, sb6)
    raw = torch.where(pick4, raw4, raw6)
    apply = torch.where(pick4, inv4, inv6)
    undo = (sb * t) * (1 / torch.tensor(GLOBAL_MAX))
    clamped = (raw > 448.0) | ((raw > 0) & (sb == 0))
    return ArithScales(apply, undo, undo.double(), clamped,
                       float(dec) if dec.numel() == 1 and not order.row_scaled else None,
                       ElementOp.MUL)


def fused_values(x: Tensor, c: Cast, axis: int) -> Tensor | None:
    """``quantize(x, c)``'s values under 4/6 in two numba passes (the rows' amax, then
    :func:`driftcli.kernels.jit.four_over_six_values`: scales, candidates, errors, choice and
    values in one), or None where the general steps run: a cast that is not 4/6 on 1 x 16
    blocks or 16 x 16 tiles of a float32 CPU tensor rounded to nearest even and saturating
    (the rounding both candidates are made with, so the chosen one's codes are the cast's),
    numba not at hand, or a block that holds NaN or inf. Row-scaled 4/6 tells the kernel how
    many blocks make a row (it takes each row's amax, S_enc and S_dec itself). The same bits
    as the general steps (tests/test_fouroversix_fused.py)."""
    s = c.scaling
    order = s.arithmetic.two
    if not (order.four_over_six and s.granularity in (Granularity.BLOCK, Granularity.TILE)
            and c.rounding is Rounding.RNE and c.overflow is Overflow.SATURATE
            and x.dtype == torch.float32 and x.numel() > 0 and kernels.numba_runs(x)):
        return None
    blocks, back = to_blocks(x, s, axis)
    blocks = blocks.contiguous()
    amax, bad = jit.block_amax(blocks)
    if bool(bad.any()):  # NaN and inf go through the general steps' amax policy
        return None
    # row-scaled: each row's amax, S_enc and S_dec are made in the kernel (three torch ops
    # over every block cost a tenth of the cast); the blocks of a row lie one after another
    per = -(-max(x.shape[axis] if x.dim() else 1, 1) // s.block) if order.row_scaled else 0
    t = amax[:1] if per else amax.max()
    enc, dec = tensor_scales(t.float())
    g = torch.tensor(GLOBAL_MAX)
    consts = (float(g), 6.0, EXPAND, float(1 / g), F32_MAX)
    p = rounding.jit_params(src=rounding.source_of(torch.float32),
                            tgt=rounding.target_of(c.format), rounding=Rounding.RNE,
                            overflow=Overflow.SATURATE, sr_bits=DEFAULT_SR_BITS)
    ps = rounding.jit_params(src=rounding.source_of(torch.float32),
                             tgt=rounding.target_of(FORMATS["float8_e4m3fn"]),
                             rounding=Rounding.RNE, overflow=Overflow.SATURATE,
                             sr_bits=DEFAULT_SR_BITS)
    q = jit.four_over_six_values(blocks, amax, (t, enc, dec), consts, p, ps, order.squared,
                                 order.fp16_error, blocks.shape[1] // RUN, per)
    return back(q).to(x.dtype)
