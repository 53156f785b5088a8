"""Simulated arithmetic: matmuls whose casts, products, accumulator and order are settings."""

from driftcli.arith.matmul import (
    MatmulSpec,
    MatmulSpecError,
    Order,
    ScaleApplication,
    matmul,
    matmul_spec,
    parse_matmul_spec,
)

__all__ = [
    "MatmulSpec",
    "MatmulSpecError",
    "Order",
    "ScaleApplication",
    "matmul",
    "matmul_spec",
    "parse_matmul_spec",
]
