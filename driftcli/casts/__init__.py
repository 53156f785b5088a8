"""The casts, fast: each operation on tensors, on the kernel seam's back-ends
(:mod:`driftcli.kernels`), with its exact twin of the same name in
:mod:`driftcli.oracle` (``casts/rounding.py`` and ``oracle/rounding.py``, ...).
"""
