"""drift's kernel seam: every hot loop exists once per back-end, and :func:`numba_runs` is the
one place that decides which back-end runs.

The two back-ends:

- **torch** (the readable, vectorised reference; the path of CUDA tensors, of tensors that
  need autograd, and of ``DRIFT_JIT=never``): the tensor ops in :mod:`driftcli.casts.rounding`,
  :mod:`driftcli.casts.scaling`, :mod:`driftcli.casts.quantization`, :mod:`driftcli.measures.stats`,
  :mod:`driftcli.arith.matmul`, :mod:`driftcli.arith.blockfma`, :mod:`driftcli.casts.fouroversix`
  and
  :mod:`driftcli.casts.hadamard`;
- **numba** (the CPU default): :mod:`driftcli.kernels.jit` calls the machine code of
  :mod:`driftcli.kernels.jitcode` (element rounding, block amax), :mod:`driftcli.kernels.statcode`
  (the scan's fused passes), :mod:`driftcli.kernels.castcode` (block scales and block casts),
  :mod:`driftcli.kernels.accumcode` (the simulated matmul's accumulation orders),
  :mod:`driftcli.kernels.fmacode` (the block-FMA unit), :mod:`driftcli.kernels.fourcode`
  (four over six's candidates and errors) and :mod:`driftcli.kernels.rhtcode` (the random
  Hadamard transform).

Each operation's exact twin is in the oracle (:mod:`driftcli.oracle`, ``oracle_arith``,
``oracle_blockfma``); ``docs/architecture.md`` maps which module owns which operation. Both
back-ends give the same bits (the tests run every format, rounding, overflow policy, scale rule
and implementation preset through each); only the time differs.
"""

from __future__ import annotations

import torch

from driftcli.kernels.jit import jit_unavailable, set_jit

Tensor = torch.Tensor

__all__ = ["jit_unavailable", "numba_runs", "set_jit"]


def numba_runs(*tensors: Tensor | None) -> bool:
    """Whether these tensors go to the numba back-end: numba is at hand (and not turned off by
    ``DRIFT_JIT=never``), and every tensor is on the CPU and needs no gradient. Everything
    else runs on the torch back-end. The only place drift chooses between them."""
    return jit_unavailable() is None and not torch.compiler.is_compiling() and all(
        t is None or (t.device.type == "cpu" and not t.requires_grad) for t in tensors)
