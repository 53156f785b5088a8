"""The exact twins: every fast operation of drift computed in ``fractions.Fraction``, one
value or block at a time, each module named after the one it judges:

- :mod:`.rounding` judges :mod:`driftcli.casts.rounding` (``round_exact``, ``total``);
- :mod:`.scaling` judges :mod:`driftcli.casts.scaling` (``EXACT_RULES``);
- :mod:`.quantization` judges :mod:`driftcli.casts.quantization` (``cast_block``, and
  ``cast_group`` under a scale arithmetic);
- :mod:`.scalearith` judges :mod:`driftcli.casts.scalearith` (each float32 step);
- :mod:`.fouroversix` judges :mod:`driftcli.casts.fouroversix`;
- :mod:`.hadamard` judges :mod:`driftcli.casts.hadamard`;
- :mod:`.matmul` judges :mod:`driftcli.arith.matmul` (the sums);
- :mod:`.blockfma` judges :mod:`driftcli.arith.blockfma`.

Nothing here imports torch or the fast path. The package imports every module, so
``oracle.rounding.round_exact`` reads beside ``rounding.round_values``.
"""

from driftcli.oracle import (
           blockfma,
           fouroversix,
           hadamard,
           matmul,
           quantization,
           rounding,
           scalearith,
           scaling,
)

__all__ = ["blockfma", "fouroversix", "hadamard", "matmul", "quantization",
           "rounding", "scalearith", "scaling"]
