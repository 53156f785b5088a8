"""A tapered accumulator (HiFloat8) in the block-FMA unit and the other accumulation orders:
each rounding uses the mantissa width of its own binade on both back-ends, as the exact
reference does."""

from __future__ import annotations

import pytest
import torch
from kernel_paths import kernel_path

from driftcli.arith.matmul import matmul, parse_matmul_spec
from driftcli.verify import matmuls

# before the numba kernel read the taper, it rounded every binade with HiFloat8's widest
# mantissa (3 bits): 22, 28, 12 and 31 of these 48 outputs were wrong (measured)
SPECS = ["lhs=none,rhs=none,acc=hifloat8:rne,order=blockfma,fma=4:20",
         "lhs=none,rhs=none,acc=hifloat8:rtz,order=blockfma,fma=4:20",
         "lhs=none,rhs=none,acc=hifloat8:rne,order=blockfma,fma=8:9:i2",
         "lhs=none,rhs=none,acc=hifloat8:rne,order=blockfma:8,fma=4:20",
         # the one-step orders (kernels/accumcode.py) read the taper through round_one already
         "lhs=none,rhs=none,acc=hifloat8:rne,order=sequential",
         "lhs=none,rhs=none,acc=hifloat8:rtz,order=pairwise"]


@pytest.mark.parametrize("path", ["torch", "jit"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_tapered_accumulator_rounds_as_the_exact_reference(path: str, spec: str) -> None:
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(8, 16, generator=gen) * 4
    b = torch.randn(16, 6, generator=gen) * 4
    with kernel_path(path):
        got = matmul(a, b, spec)
    ref = matmuls._MatmulOracle().result(matmuls.MatmulCase("tapered", a, b),
                                         parse_matmul_spec(spec))
    exact = torch.tensor([float(v.value) for v in ref]).reshape(got.shape)
    # most outputs sit at 16 or above, in HiFloat8's binades of 2 and 1 mantissa bits
    assert int((exact.abs() >= 16).sum()) >= 36
    assert torch.equal(got.double(), exact.double()), spec
