"""Simulated arithmetic: matmuls whose casts, products, accumulator and order are settings.

The package is empty on purpose: importing one of its modules (``arith.blockfma``, which the
Hadamard transform's ``tc=`` reads from a lower layer) must not import the others.
"""
