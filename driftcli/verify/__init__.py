"""``verify-formats``: the fast path against the exact oracle, value by value.

Checks are plain functions ``check(fmt, plan) -> Iterator[Outcome]``, one module per suite
(:mod:`~driftcli.verify.codes`, :mod:`~driftcli.verify.pairs`,
:mod:`~driftcli.verify.inputs`, :mod:`~driftcli.verify.blocks`,
:mod:`~driftcli.verify.matmuls`), listed in :data:`CHECKS` of
:mod:`~driftcli.verify.driver`; :mod:`~driftcli.verify.compare` holds what they share. Each
outcome is one (format, check, operation, rounding,
overflow) cell with its count and its disagreements. Full plan, with the
quick plan's numbers in brackets:

- ``codes``: every code of every format of at most 16 bits decodes to the
  reference value (``Format.decode``) and round-trips, through every rounding
  mode and overflow policy, back to its own code [16-bit formats: rne and
  saturate only].
- ``pairs``: products and sums, rounded back to the format, of every pair of
  codes of every format of at most 8 bits [8-bit: 1,024 seeded pairs plus all
  pairs of a boundary set], under every mode and both policies; ``sr`` for
  every value of :data:`PAIR_SR_BITS` random bits. 16-bit formats: 2**18
  seeded pairs under (rne, saturate) and 2**16 under every other cell, plus
  all boundary pairs, ``sr`` with one seeded 16-bit draw per pair [4,096
  pairs, (rne, saturate) only]. Wider formats (float32, ``e8m13``): 2**14
  seeded pairs plus boundary pairs per cell [1,024].
- ``float32-inputs``: float32 values at every midpoint between neighbouring
  values, one float32 ulp either side of each midpoint and each value, just
  above max, and 4,096 [256] through the subnormal range, under every mode
  and policy (``sr``: all-zero, all-one and seeded 16-bit draws) [formats of
  at most 8 bits only].
- ``blocks``: block-scaled casts of every signed element format of at most 8
  bits under every scale rule (:func:`block_casts`): every element of
  constructed blocks (amax at, just below and just above powers of two and
  element maxima, zeros, NaN and inf members, clamped scales, partial blocks
  and tiles) and of :data:`BLOCK_FULL_SAMPLE` random blocks, plus the scale of
  :data:`BLOCK_SCALE_SAMPLE` random blocks per power-of-two rule and
  :data:`REAL_SCALE_SAMPLE` per real-valued rule [the floor and two-level
  rules only, constructed blocks and a tenth of the scale samples].
- ``matmul``: simulated matmuls accumulating in the format, for the formats of
  :data:`MATMUL_ACCUMULATORS` (and any unregistered ``eXmY`` asked for), against
  :func:`driftcli.oracle.matmul.dot` on the oracle's own casts: every output element of
  seeded random matmuls (:data:`MATMUL_SHAPES`), a tiny and a huge case and a
  constructed case (swamping, cancellation, overflow) under the orders of
  :data:`MATMUL_ORDERS`, ``rne`` and ``rtz``, the operand casts of
  :data:`MATMUL_CASTS` and, with ``scale=block``, :data:`MATMUL_BLOCK_CASTS`; mixed
  operands and an output cast; ``native`` (float32 only) on integer cases where
  every float32 order is exact [two random shapes and the constructed case with
  K = 96; no cast and NVFP4, ``sequential``, ``pairwise``, ``chunked:16``; MXFP8
  with ``scale=block`` under ``sequential``].
- ``recipes``: every implementation preset on the format (``torchao/…``, ``te/…``,
  ``deepseek/…``), its values and codes against :func:`driftcli.oracle.quantization.cast_group`, the
  same op sequence with every float32 operation rounded exactly: drift's constructed blocks,
  and :data:`RECIPE_BLOCKS` random blocks as they are and moved onto the element grid's
  midpoints under each block's scale [12 constructed cases, one for 128 x 128 tiles].
"""

from __future__ import annotations

from driftcli.verify.blocks import (
    BLOCK_FULL_SAMPLE,
    BLOCK_SCALE_SAMPLE,
    REAL_SCALE_SAMPLE,
    RULE_SCALINGS,
    block_casts,
    cast_quantize,
    check_blocks,
    check_cast,
    oracle_cast_exact,
    quick_casts,
    random_blocks,
    rule_casts,
)
from driftcli.verify.codes import check_codes
from driftcli.verify.compare import (
    DETERMINISTIC,
    FAILURE_CAP,
    SEED,
    Outcome,
    Plan,
    VerifyRow,
    exact_of_float,
    to_float,
)
from driftcli.verify.driver import CHECKS, element_formats, rows, verify
from driftcli.verify.inputs import check_float32_inputs, float32_inputs
from driftcli.verify.matmuls import (
    MATMUL_ACCUMULATORS,
    MATMUL_BLOCK_CASTS,
    MATMUL_BLOCK_ORDERS,
    MATMUL_CASTS,
    MATMUL_CONSTRUCTED_K,
    MATMUL_NATIVE_CASTS,
    MATMUL_ORDERS,
    MATMUL_SHAPES,
    QUICK_MATMUL_SHAPES,
    MatmulCase,
    check_matmul,
    matmul_cases,
    matmul_fast,
    matmul_specs,
)
from driftcli.verify.pairs import (
    OTHER_SAMPLE_16,
    PAIR_SAMPLE_16,
    PAIR_SR_BITS,
    QUICK_PAIRS,
    QUICK_PAIRS_16,
    WIDE_PAIRS,
    check_pairs,
)
from driftcli.verify.recipes import RECIPE_BLOCKS, check_recipe, check_recipes, recipe_cases

__all__ = [
    "BLOCK_FULL_SAMPLE", "BLOCK_SCALE_SAMPLE", "CHECKS", "DETERMINISTIC", "FAILURE_CAP",
    "MATMUL_ACCUMULATORS", "MATMUL_BLOCK_CASTS", "MATMUL_BLOCK_ORDERS", "MATMUL_CASTS",
    "MATMUL_CONSTRUCTED_K", "MATMUL_NATIVE_CASTS", "MATMUL_ORDERS", "MATMUL_SHAPES",
    "OTHER_SAMPLE_16", "PAIR_SAMPLE_16", "PAIR_SR_BITS", "QUICK_MATMUL_SHAPES", "QUICK_PAIRS",
    "QUICK_PAIRS_16", "REAL_SCALE_SAMPLE", "RECIPE_BLOCKS", "RULE_SCALINGS", "SEED", "WIDE_PAIRS",
    "MatmulCase",
    "Outcome", "Plan", "VerifyRow", "block_casts", "cast_quantize", "check_blocks", "check_cast",
    "check_codes", "check_float32_inputs", "check_matmul", "check_pairs", "check_recipe",
    "check_recipes", "element_formats",
    "exact_of_float", "float32_inputs", "matmul_cases", "matmul_fast", "matmul_specs",
    "oracle_cast_exact", "quick_casts", "random_blocks", "recipe_cases", "rows",
    "rule_casts", "to_float",
    "verify",
]
