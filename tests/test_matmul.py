"""Simulated matmuls: spec strings, every order against the exact oracle, and known values."""

from __future__ import annotations

import importlib
from fractions import Fraction

import numpy as np
import pytest
import torch

from driftcli import FORMATS, kernels, oracle, quantize
from driftcli.arith.matmul import (
    MatmulSpec,
    MatmulSpecError,
    Order,
    ScaleApplication,
    matmul,
    matmul_spec,
    parse_matmul_spec,
)
from driftcli.casts import rounding
from driftcli.errors import DriftError
from driftcli.records.formats import Exact
from driftcli.records.modes import Overflow, Rounding
from driftcli.verify import exact_of_float, to_float

mm = importlib.import_module("driftcli.arith.matmul")  # the module, not its function


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (−0 is not +0), any NaN equal to any NaN."""
    nan = torch.isnan(a) & torch.isnan(b)
    return a.shape == b.shape and bool(((_bits(a) == _bits(b)) | nan).all())


# --- spec strings ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "",
    "order=native",
    "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=bfloat16:rtz,order=chunked:128",
    "lhs=nvfp4,rhs=mxfp4_e2m1,acc=e8m13,order=pairwise,out=bf16",
    "lhs=mxfp8_e4m3,rhs=mxfp4_e2m1,acc=float16:rtz,order=chunked:64,scale=block",
    "acc=e5m2b15,order=sequential,lhs=float8_e4m3fn:tensor:amax:rtz",
])
def test_spec_strings_round_trip(text: str) -> None:
    spec = parse_matmul_spec(text)
    assert parse_matmul_spec(str(spec)) == spec
    assert str(parse_matmul_spec(str(spec))) == str(spec)


def test_canonical_string_and_the_keyword_constructor() -> None:
    spec = matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator="e8m13",
                       acc_rounding="rtz", order="chunked:128")
    assert spec == parse_matmul_spec("lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=e8m13:rtz,"
                                     "order=chunked:128")
    assert spec == matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator="e8m13",
                               acc_rounding=Rounding.RTZ, order="chunked", chunk=128)
    assert spec.order is Order.CHUNKED and spec.chunk == 128 and spec.order_name == "chunked:128"
    assert spec.accumulator == FORMATS["e8m13"]
    mx = "float8_e4m3fn:block32:float8_e8m0fnu:floor:rne:saturate"
    assert str(spec) == (f"lhs={mx},rhs={mx},acc=e8m13:rtz,order=chunked:128,"
                         "scale=dequantized,out=none")
    assert str(MatmulSpec()) == ("lhs=none,rhs=none,acc=float32:rne,order=sequential,"
                                 "scale=dequantized,out=none")


@pytest.mark.parametrize(("text", "says"), [
    ("acc=bfloat16:rna", "accumulator rounding 'rna' is not supported; use rne or rtz"),
    ("acc=bfloat16:sr", "use rne or rtz"),
    ("acc=int8", "not a signed float format"),
    ("acc=float8_e8m0fnu", "not a signed float format"),
    ("acc=bfloat17", "unknown format 'bfloat17'"),
    ("order=chunked", "matmul spec 'order=chunked': order chunked needs a chunk size of at "
                      "least 1, not 0; write e.g. chunked:128"),
    ("order=chunked:0", "chunked needs a positive size"),
    ("order=native:4", "only chunked and blockfma take a size"),
    ("order=diagonal", "unknown matmul order 'diagonal'"),
    ("order=native,acc=bfloat16", "order native is torch.matmul in float32"),
    ("order=native,acc=float32:rtz", "it needs acc=float32:rne"),
    ("ordr=native", "unknown key 'ordr'; did you mean order?"),
    ("order=native,order=sequential", "key 'order' given twice"),
    ("native", "'native' has no '='"),
    ("lhs=mxfp9", "unknown format or preset 'mxfp9'"),
    ("scale=blocks", "unknown scale application 'blocks'"),
    ("lhs=mxfp8_e4m3,scale=block", "scale=block needs block-scaled casts on both operands; "
                                   "rhs is none"),
    ("lhs=mxfp8_e4m3,rhs=nvfp4,scale=block", "needs power-of-two block scales"),
    ("lhs=mxfp8_e4m3,rhs=float8_e4m3fn:block16,scale=block", "equal block sizes along K; "
                                                              "lhs has 32, rhs 16"),
    ("lhs=mxfp8_e5m2,rhs=mxfp8_e4m3,scale=block", "needs 57 bits of fixed point, more than "
                                                  "float64's 53"),
    ("lhs=mxfp4_e2m1,rhs=mxfp4_e2m1,scale=block,order=chunked:16", "not a multiple of the "
                                                                   "block size 32"),
])
def test_bad_specs_name_the_input_and_the_fix(text: str, says: str) -> None:
    with pytest.raises(MatmulSpecError, match=None) as err:
        parse_matmul_spec(text)
    assert says in str(err.value)
    assert isinstance(err.value, DriftError)


def test_chunk_sizes_belong_to_chunked_only() -> None:
    with pytest.raises(MatmulSpecError, match="takes no chunk size"):
        MatmulSpec(order=Order.SEQUENTIAL, chunk=8)
    with pytest.raises(MatmulSpecError, match="disagree"):
        matmul_spec(order="chunked:8", chunk=16)


# --- against the oracle ---------------------------------------------------------------------

def _oracle_matmul(a: torch.Tensor, b: torch.Tensor, spec: MatmulSpec) -> torch.Tensor:
    """Each output element by oracle.matmul.dot over the exact products of the cast operands (the
    casts themselves are checked against the oracle by verify-formats)."""
    qa = a if spec.lhs is None else quantize(a, spec.lhs, axis=-1)
    qb = b if spec.rhs is None else quantize(b, spec.rhs, axis=-2)
    rows = [[exact_of_float(v) for v in r] for r in qa.tolist()]
    cols = [[exact_of_float(v) for v in c] for c in qb.T.tolist()]
    order = "sequential" if spec.order is Order.NATIVE else spec.order.value
    out = [[to_float(oracle.matmul.dot(oracle.matmul.products(r, c), order, spec.accumulator,
                                spec.acc_rounding, spec.chunk, FORMATS["float32"]))
            for c in cols] for r in rows]
    return torch.tensor(out, dtype=torch.float64).float()


SPECS = [
    "acc=bfloat16:rne,order=sequential",
    "acc=bfloat16:rtz,order=pairwise",
    "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=e8m13:rtz,order=chunked:8",
    "lhs=nvfp4,rhs=nvfp4,acc=float16:rne,order=chunked:5",
    "lhs=mxfp4_e2m1,rhs=mxfp4_e2m1,acc=float8_e5m2:rtz,order=pairwise",
    "lhs=mxfp4_e2m1,rhs=mxfp8_e4m3,acc=e5m7:rne,order=sequential",
    "lhs=fp8_e4m3,rhs=fp8_e4m3,acc=float32:rtz,order=sequential",
    "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=e7m23:rtz,order=chunked:3",
]


@pytest.mark.parametrize("text", SPECS)
@pytest.mark.parametrize("k", [1, 2, 5, 37])
def test_every_order_equals_the_oracle(text: str, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    a = torch.randn(3, k, generator=gen) * torch.exp2(torch.randint(-5, 6, (3, k), generator=gen))
    b = torch.randn(k, 4, generator=gen)
    spec = parse_matmul_spec(text)
    assert _same(matmul(a, b, spec), _oracle_matmul(a, b, spec))


def test_the_pairwise_tree_is_adjacent_pairs_with_the_odd_one_carried() -> None:
    """Terms 3, 4, 1/2, 3, 3 (exact sum 13.5) in E5M2 (3 significant bits; steps of 1 in
    [4, 8), of 2 in [8, 16)), every sum rounded to nearest even:

    - pairwise, adjacent pairs with the odd one carried: (3 + 4) = 7, (1/2 + 3) = 3.5, 3
      carried; 7 + 3.5 = 10.5 -> 10, 3 carried; 10 + 3 = 13 -> 12 (tie, 12 is even);
    - a tree split at the half, (3 + 4 + 1/2) + (3 + 3), would give 8 + 6 = 14;
    - sequentially: 7, 7.5 -> 8, 11 -> 12, 15 -> 16.
    """
    a = torch.tensor([[3.0, 4.0, 0.5, 3.0, 3.0]])
    ones = torch.ones(5, 1)
    got = {order: matmul(a, ones, matmul_spec(accumulator="float8_e5m2", order=order)).item()
           for order in ("pairwise", "sequential", "chunked:3")}
    # chunked:3: (3 + 4 + 1/2) -> 8 and (3 + 3) = 6, promoted into float32: 14
    assert got == {"pairwise": 12.0, "sequential": 16.0, "chunked:3": 14.0}
    terms = [Exact.of(Fraction(v)) for v in (3, 4, Fraction(1, 2), 3, 3)]
    assert to_float(oracle.matmul.pairwise(terms, FORMATS["float8_e5m2"], Rounding.RNE)) == 12.0


def test_swamping_in_a_bfloat16_accumulator_by_order() -> None:
    """1024 then 255 ones (exact sum 1279), bfloat16 (8 significant bits: steps of 8 at 1024).

    sequential: every 1 is lost (1025 rounds to 1024): 1024. chunked:16: chunk 0 stays 1024,
    the 15 others hold 16 each exactly, float32 master 1024 + 240 = 1264. pairwise: the ones
    pair up to 2, 4, ..., 128 while 1024 absorbs 1, 2 (1026 -> 1024), 4 (1028, a tie, -> 1024),
    then 8, 16, 32, 64, 128 exactly: 1272.
    """
    a = torch.cat([torch.tensor([1024.0]), torch.ones(255)])[None, :]
    b = torch.ones(256, 1)
    got = {order: matmul(a, b, matmul_spec(accumulator="bfloat16", order=order)).item()
           for order in ("sequential", "chunked:16", "pairwise", "chunked:256")}
    assert got == {"sequential": 1024.0, "chunked:16": 1264.0, "pairwise": 1272.0,
                   "chunked:256": 1024.0}
    assert matmul(a, b, "order=native").item() == 1279.0  # float32 holds every partial sum


def test_cancellation_exposes_the_order() -> None:
    """+2**20, 3, 3, -2**20 (exact sum 6). float32 holds every partial sum: 6. float16 (max
    65504) under rne: sequentially 2**20 overflows to inf and stays there; pairwise
    (2**20 + 3) -> inf and (3 - 2**20) -> -inf, whose sum is NaN. Under rtz nothing overflows
    to inf: 2**20 -> 65504, + 3 -> 65504 twice, 65504 - 2**20 -> -65504."""
    a = torch.tensor([[2.0**20, 3, 3, -(2.0**20)]])
    b = torch.ones(4, 1)
    assert matmul(a, b, "acc=float32,order=pairwise").item() == 6.0
    assert matmul(a, b, "acc=float32,order=sequential").item() == 6.0
    assert matmul(a, b, "acc=float16,order=sequential").item() == float("inf")
    assert torch.isnan(matmul(a, b, "acc=float16,order=pairwise")).item()
    assert matmul(a, b, "acc=float16:rtz,order=sequential").item() == -65504.0
    assert matmul(a, b, "acc=float16:rtz,order=pairwise").item() == 0.0  # 65504 - 65504


# --- known equalities -----------------------------------------------------------------------

@pytest.mark.parametrize("cast", [None, "mxfp8_e4m3", "nvfp4", "fp8_e4m3"])
def test_native_is_torch_matmul_of_the_cast_operands(cast: str | None) -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 5, 96, generator=gen), torch.randn(96, 7, generator=gen)
    spec = matmul_spec(lhs=cast, rhs=cast, order="native")
    qa = a if cast is None else quantize(a, cast, axis=-1)
    qb = b if cast is None else quantize(b, cast, axis=-2)
    assert _same(matmul(a, b, spec), torch.matmul(qa, qb))


def test_sequential_float32_is_a_plain_float32_loop_when_products_fit() -> None:
    """bfloat16-valued operands: every product has at most 16 significant bits, exact in float32,
    so a plain float32 loop (product, then sum, each rounded to nearest) is the same thing."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(4, 200, generator=gen).bfloat16().float()
    b = torch.randn(200, 3, generator=gen).bfloat16().float()
    got = matmul(a, b, "acc=float32,order=sequential")
    an, bn = a.numpy(), b.numpy()
    loop = np.zeros((4, 3), dtype=np.float32)
    for i in range(4):
        for j in range(3):
            acc = np.float32(0)
            for k in range(200):
                acc = np.float32(acc + an[i, k] * bn[k, j])
            loop[i, j] = acc
    assert _same(got, torch.from_numpy(loop))


def test_full_float32_products_are_exact_not_rounded() -> None:
    """With 24-bit operands a plain float32 loop rounds each product; drift does not (the
    products are exact, only the sums are rounded), and some results differ."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 256, generator=gen), torch.randn(256, 8, generator=gen)
    got = matmul(a, b, "acc=float32,order=sequential")
    assert _same(got, _oracle_matmul(a, b, parse_matmul_spec("acc=float32,order=sequential")))
    loop = torch.zeros(8, 8)
    for k in range(256):
        loop = loop + a[:, k, None] * b[None, k, :]  # product rounded to float32, then the sum
    assert int((got != loop).sum()) > 0


@pytest.mark.parametrize("acc", ["float32", "bfloat16", "e8m13"])
def test_chunked_with_one_chunk_is_sequential_then_into_float32(acc: str) -> None:
    """n >= K: one chunk, summed sequentially in the accumulator, then 0 + it in float32 (its
    values are float32 values; only a -0 becomes +0)."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(3, 40, generator=gen), torch.randn(40, 5, generator=gen)
    seq = matmul(a, b, matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator=acc))
    for n in (40, 41, 1000):
        one = matmul(a, b, matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator=acc,
                                       order=f"chunked:{n}"))
        assert _same(one, seq + 0.0)


def test_chunked_by_one_rounds_each_product_first() -> None:
    """chunked:1 rounds each product into the accumulator, then sums in float32: with MX
    operands the products are float32 values already and it is sequential float32; with full
    float32 operands each product is rounded first, and some results differ."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 33, generator=gen), torch.randn(33, 2, generator=gen)
    mx = "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,"
    assert _same(matmul(a, b, mx + "order=chunked:1"), matmul(a, b, mx + "order=sequential"))
    plain = matmul(a, b, "order=chunked:1")
    assert int((plain != matmul(a, b, "order=sequential")).sum()) > 0
    loop = torch.zeros(3, 2)
    for k in range(33):
        loop = loop + a[:, k, None] * b[None, k, :]  # each product rounded to float32
    assert _same(plain, loop)


@pytest.mark.parametrize("order", ["sequential", "pairwise", "chunked:7"])
def test_batched_shapes_broadcast_like_torch(order: str) -> None:
    """Leading dimensions broadcast; each batch element is the 2-D matmul of its slices (block
    casts along K do not mix batch elements)."""
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(2, 3, 4, 40, generator=gen)
    b = torch.randn(3, 40, 5, generator=gen)
    spec = matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp4_e2m1", accumulator="bfloat16", order=order)
    got = matmul(a, b, spec)
    assert got.shape == torch.matmul(a, b).shape == (2, 3, 4, 5)
    for i in range(2):
        for j in range(3):
            assert _same(got[i, j], matmul(a[i, j], b[j], spec))
    b2 = torch.randn(40, 5, generator=gen)
    assert _same(matmul(a, b2, spec)[1, 2], matmul(a[1, 2], b2, spec))


def test_empty_k_gives_plus_zero() -> None:
    for order in ("sequential", "pairwise", "chunked:4", "native"):
        got = matmul(torch.ones(2, 0), torch.ones(0, 3), f"order={order}")
        assert _same(got, torch.zeros(2, 3))


def test_block_scale_application_rounds_each_block_once() -> None:
    """K = 64 (two blocks): each block's dot product is exact and scaled by the two scales,
    then the two block terms enter the accumulator: round(round(0 + t0) + t1)."""
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(3, 64, generator=gen), torch.randn(64, 4, generator=gen)
    spec = matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator="bfloat16",
                       scale_application="block")
    assert spec.scale_application is ScaleApplication.BLOCK and spec.block == 32
    qa, qb = quantize(a, "mxfp8_e4m3", axis=-1).double(), quantize(b, "mxfp8_e4m3",
                                                                  axis=-2).double()
    t0 = qa[:, :32] @ qb[:32]  # exact: the scales are powers of two, the elements 4 bits
    t1 = qa[:, 32:] @ qb[32:]
    bf16 = FORMATS["bfloat16"]
    first = rounding.round_to_format(t0, bf16)
    expected = rounding.add(first, t1, bf16, overflow=Overflow.IEEE).float()
    assert _same(matmul(a, b, spec), expected)
    dequantized = matmul(a, b, matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3",
                                           accumulator="bfloat16"))
    assert int((dequantized != expected).sum()) > 0  # 64 roundings, not 2


def test_the_output_cast_applies_to_the_result() -> None:
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randn(4, 50, generator=gen), torch.randn(50, 64, generator=gen)
    base = matmul_spec(lhs="nvfp4", rhs="nvfp4", accumulator="e8m13", order="chunked:16")
    for out in ("bf16", "mxfp8_e4m3"):
        with_out = matmul_spec(lhs="nvfp4", rhs="nvfp4", accumulator="e8m13",
                               order="chunked:16", out=out)
        assert _same(matmul(a, b, with_out), quantize(matmul(a, b, base), out, axis=-1))


def test_stochastic_casts_need_a_seed_and_reproduce_with_one() -> None:
    a, b = torch.randn(2, 32), torch.randn(32, 3)
    spec = matmul_spec(lhs="mxfp4_e2m1:sr", rhs="mxfp4_e2m1", accumulator="bfloat16")
    with pytest.raises(DriftError, match=r"lhs cast .* rounds stochastically; pass "
                                         r"matmul\(\.\.\., seed=S\)"):
        matmul(a, b, spec)
    assert _same(matmul(a, b, spec, seed=3), matmul(a, b, spec, seed=3))


@pytest.mark.parametrize(("a", "b", "says"), [
    (torch.ones(3), torch.ones(3, 2), "operand A has shape (3,)"),
    (torch.ones(2, 3), torch.ones(4, 2), "do not agree along K (3 != 4)"),
    (torch.ones(2, 2, 3), torch.ones(3, 3, 2), "batch dimensions (2,) and (3,) do not broadcast"),
    (torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 2), "must be a floating-point tensor"),
])
def test_bad_operands(a: torch.Tensor, b: torch.Tensor, says: str) -> None:
    with pytest.raises(DriftError) as err:
        matmul(a, b, "order=sequential")
    assert says in str(err.value)


# --- the fast paths -------------------------------------------------------------------------

def test_working_precision_is_float32_only_where_exact() -> None:
    mx = matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator="bfloat16")
    ones = torch.ones(4, 4)
    assert mm.significant_bits(mx.lhs) == 4
    assert mm.significant_bits(parse_matmul_spec("lhs=nvfp4").lhs) == 24  # real scales
    assert mm.significant_bits(parse_matmul_spec("lhs=mxint8").lhs) == 7
    assert mm.significant_bits(None) == 24
    assert mm._float32_exact(ones, ones, mx)
    assert not mm._float32_exact(ones, ones, parse_matmul_spec("lhs=nvfp4,rhs=mxfp8_e4m3"))
    assert not mm._float32_exact(ones * 2.0**-64, ones * 2.0**-63, mx)  # products below 2**-126
    assert not mm._float32_exact(ones * 2.0**62, ones * 2.0**62, mx)  # sums could overflow
    assert not mm._float32_exact(ones * float("nan"), ones, mx)
    # 23 mantissa bits but not float32's layout: the kernel needs float64 to drop a bit
    assert not mm._float32_exact(ones, ones, matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3",
                                                         accumulator="e7m23"))


def _edge_float32() -> torch.Tensor:
    """Float32 values around every place a float32-layout rounding can go wrong."""
    ints = [0, 1, 2, 3, 0x7FFF, 0x8000, 0x8001, 0x007FFFFF, 0x00800000, 0x00800001,
            0x3F800000, 0x3F7FFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F810000,
            0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F000000, 0x7F800000, 0x7FC00000]
    gen = torch.Generator().manual_seed(9)
    rand = torch.randint(0, 0x7F800000, (4000,), generator=gen, dtype=torch.int64)
    low = torch.randint(0, 1 << 20, (2000,), generator=gen, dtype=torch.int64)
    ties = (torch.randint(0x00800000, 0x7F000000, (2000,), generator=gen) & ~0xFFFF) | 0x8000
    mags = torch.cat([torch.tensor(ints), rand, low, ties]).to(torch.int32)
    return torch.cat([mags, mags | -(1 << 31)]).view(torch.float32)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "e8m13", "e8m1", "e8m22"])
@pytest.mark.parametrize("mode", [Rounding.RNE, Rounding.RTZ])
def test_the_float32_layout_truncation_equals_the_rounding_kernel(name: str,
                                                                  mode: Rounding) -> None:
    """For every pair (s, r) that float32 TwoSum can leave (|r| at most half the gap to the
    neighbour on r's side, exactly half only when s is even; r = 0 for subnormal s),
    truncate_float32 gives the verified kernel's bits for the exact value s + r."""
    s = _edge_float32()
    mag = s.abs()
    finite = torch.isfinite(s)
    inf = torch.tensor(float("inf"))
    gap_up = (torch.nextafter(mag, inf) - mag).double()
    gap_down = (mag - torch.nextafter(mag, torch.tensor(0.0))).double()
    normal = finite & (mag >= 2.0**-126) & (mag < torch.finfo(torch.float32).max)
    even = (s.view(torch.int32) & 1) == 0
    sign = torch.where(torch.signbit(s), -1.0, 1.0).double()
    fmt = FORMATS[name]
    drop = 23 - fmt.mbits
    for frac in (0.0, 0.25, 0.5, -0.25, -0.5, 0.375, -0.375):
        gap = gap_up if frac > 0 else gap_down  # away from zero, or toward it
        ok = normal & (even | (abs(frac) < 0.5))
        r = torch.where(ok, sign * gap * frac, 0.0).float()
        got = mm.truncate_float32(s, r, drop, mode)
        # the reference rounds the same exact value from float64, as drift.add does
        want = rounding.round_sum(s.double(), r.double(), rounding.target_of(fmt), mode,
                                  wide=True).float()
        assert _same(got, want), (name, mode, frac)


def test_accumulation_agrees_on_both_back_ends() -> None:
    """The accumulator steps on numba and on torch: the float32-layout path, the generic kernel
    in float32 with a short last chunk, and the float64 path."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    gen = torch.Generator().manual_seed(10)
    a, b = torch.randn(6, 20, generator=gen), torch.randn(20, 7, generator=gen)
    k = mm.STEPS_PER_CALL
    cases = [(a[:, :2 * k], b[:2 * k], matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3",
                                                  accumulator="bfloat16", acc_rounding="rtz")),
             # chunks of k, k and 4 terms: the short last chunk keeps its sum
             (a, b, matmul_spec(lhs="mxfp4_e2m1", rhs="mxfp4_e2m1", accumulator="float16",
                                order=f"chunked:{k}")),
             (a, b, matmul_spec(lhs="nvfp4", rhs="nvfp4", accumulator="e8m13",
                                order=f"chunked:{k}"))]
    try:
        kernels.set_jit("never")
        reference = [matmul(x, y, s) for x, y, s in cases]
        kernels.set_jit("auto")
        fast_ = [matmul(x, y, s) for x, y, s in cases]
    finally:
        kernels.set_jit("auto")
    for (_, _, s), e, c in zip(cases, reference, fast_, strict=True):
        assert _same(e, c), str(s)


# --- the accumulation on the numba back-end (driftcli.kernels.accumcode) ---------------------

BACK_END_ACCUMULATORS = ("float32", "bfloat16", "float16", "float8_e5m2", "e8m13", "e5m7")
"""verify-formats' matmul accumulators, and a custom eXmY off float32's layout."""
SR_MX = "float8_e4m3fn:block32:float8_e8m0fnu:floor:sr:saturate"
BACK_END_CASTS = [
    # (operand cast, scale application, order of a chunk of 16 products)
    ("none", "dequantized", "chunked:16"),  # float64 work: 24 + 24 bits
    ("mxfp8_e4m3", "dequantized", "chunked:16"),  # float32 work where exact
    ("nvfp4", "dequantized", "chunked:16"),  # real scales: float64 work
    (SR_MX, "dequantized", "chunked:16"),  # stochastic operand casts
    ("mxfp8_e4m3", "block", "chunked:64"),  # one term per block of 32: chunks of 2 blocks
    ("mxfp4_e2m1", "block", "chunked:32"),
]


def _back_end_operands(k: int = 70) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Operands with batch axes that broadcast both ways ((2, 1) with (3,)) and K = 70 (a
    short last chunk of 16 products and of 2 blocks, a short last block, an odd pairwise
    level): random magnitudes over 2**-20..2**20, plus rows that sum to an exact zero, rows of
    -0, rows that overflow every accumulator, and (a second pair) inf and NaN."""
    gen = torch.Generator().manual_seed(33)
    a = torch.randn(2, 1, 5, k, generator=gen) * torch.exp2(
        torch.randint(-20, 21, (2, 1, 5, k), generator=gen).float())
    b = torch.randn(3, k, 6, generator=gen)
    a[0, 0, 1] = torch.cat([a[0, 0, 0, : k // 2], -a[0, 0, 0, : k // 2]])  # x then -x
    b[:, k // 2:] = b[:, : k // 2]  # ... against the same column values: an exact zero
    a[1, 0, 2] = -0.0
    a[1, 0, 3] = 3e38  # products far past every accumulator's top
    special = a.clone()
    special[0, 0, 4, 3] = float("inf")
    special[1, 0, 4, 5] = float("nan")
    return [(a, b), (special, b)]


def _both(a: torch.Tensor, b: torch.Tensor, spec: MatmulSpec,
          seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The matmul on the torch back-end and on the numba back-end."""
    try:
        kernels.set_jit("never")
        want = matmul(a, b, spec, seed=seed)
        kernels.set_jit("auto")
        got = matmul(a, b, spec, seed=seed)
    finally:
        kernels.set_jit("auto")
    return want, got


@pytest.mark.parametrize("acc", BACK_END_ACCUMULATORS)
def test_numba_accumulation_equals_the_torch_back_end_bit_for_bit(acc: str) -> None:
    """Every order x accumulator rounding x operand cast (plain, stochastic, block-scaled):
    the numba kernels give the torch steps' bits, -0 and NaN included."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    checked = 0
    for x, y in _back_end_operands():
        for cast, scale, chunked in BACK_END_CASTS:
            for order in ("sequential", chunked, "pairwise"):
                for mode in ("rne", "rtz"):
                    spec = matmul_spec(lhs=cast, rhs=cast, accumulator=acc, acc_rounding=mode,
                                       order=order, scale_application=scale)
                    want, got = _both(x, y, spec)
                    assert want.shape == (2, 3, 5, 6)
                    assert _same(want, got), str(spec)
                    checked += 1
    assert checked == 2 * len(BACK_END_CASTS) * 3 * 2


def test_the_back_end_comparison_sees_one_output_summed_in_another_order() -> None:
    """A planted fault: one output's products added in reverse order (by the numba kernel
    itself) makes the comparison fail, though every other output is left alone."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    a, b = _back_end_operands()[0]
    spec = matmul_spec(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3", accumulator="bfloat16",
                       order="sequential")
    want, got = _both(a, b, spec)
    assert _same(want, got)
    # the cast is along K, so flipping K in both operands flips each output's products
    flipped = matmul(a[0, 0, :1].flip(-1), b[0].flip(-2)[:, :1], spec)
    planted = got.clone()
    planted[0, 0, 0, 0] = flipped[0, 0]
    assert float(flipped[0, 0]) != float(want[0, 0, 0, 0])
    assert not _same(want, planted)
    assert int((planted != want).sum()) == 1


def test_the_numba_back_end_runs_the_accumulation_as_one_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the numba back-end each custom order is one call of jit.accumulate (no torch step
    loop); on the torch back-end none."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end here")
    calls: list[str] = []
    real = mm.jit.accumulate

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(str(args[5]))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mm.jit, "accumulate", counted)
    a, b = _back_end_operands()[0]
    for order in ("sequential", "chunked:16", "pairwise"):
        matmul(a, b, matmul_spec(accumulator="bfloat16", order=order))
    assert calls == ["sequential", "chunked", "pairwise"]
    try:
        kernels.set_jit("never")
        matmul(a, b, matmul_spec(accumulator="bfloat16", order="pairwise"))
    finally:
        kernels.set_jit("auto")
    assert len(calls) == 3
    # the native order and the block-FMA unit have kernels of their own
    matmul(a, b, matmul_spec(order="native"))
    assert len(calls) == 3


def test_numba_accumulation_of_empty_and_one_term_shapes() -> None:
    """K = 0 gives +0 in every order; K = 1 is the product rounded once (from +0); M or N of 0
    give empty results; the same bits as the torch back-end."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    gen = torch.Generator().manual_seed(2)
    for m, k, n in ((3, 0, 4), (3, 1, 4), (0, 5, 4), (3, 5, 0)):
        a, b = -torch.rand(m, k, generator=gen), torch.rand(k, n, generator=gen)
        for order in ("sequential", "chunked:2", "pairwise"):
            spec = matmul_spec(accumulator="e5m7", acc_rounding="rtz", order=order)
            want, got = _both(a, b, spec)
            assert got.shape == (m, n) and _same(want, got), (m, k, n, order)
            if k == 0:
                assert not bool(torch.signbit(got).any())


def _level_tree(k: int) -> set[tuple[int, int, int]]:
    """The torch back-end's pairwise additions as (lo, mid, hi) blocks of terms: adjacent
    pairs level by level, an odd last one carried up."""
    level = [(j, j + 1) for j in range(k)]
    steps = set()
    while len(level) > 1:
        pairs = [(level[i][0], level[i][1], level[i + 1][1]) for i in range(0, len(level) - 1, 2)]
        steps.update(pairs)
        level = [(lo, hi) for lo, _, hi in pairs] + (level[-1:] if len(level) % 2 else [])
    return steps


def test_the_numba_pairwise_tree_is_the_level_by_level_tree() -> None:
    """The kernel's streaming tree (a stack of finished subtrees) adds the same blocks as the
    torch back-end's levels, for every K up to 300; each addition's halves are made before it."""
    accumcode = pytest.importorskip("driftcli.kernels.accumcode")
    for k in range(301):
        steps = accumcode.pairwise_tree(k)
        assert len(steps) == max(k - 1, 0) and set(steps) == _level_tree(k), k
        made = {(j, j + 1) for j in range(k)}
        for lo, mid, hi in steps:
            assert (lo, mid) in made and (mid, hi) in made, (k, lo, mid, hi)
            made.add((lo, hi))
        assert k == 0 or (0, k) in made


@pytest.mark.parametrize("acc", ["bfloat16", "float16"])
def test_numba_pairwise_equals_the_torch_back_end_for_every_small_k(acc: str) -> None:
    """Pairwise on both back-ends for K = 1..40 and a few powers of two and their neighbours
    (the right edge of the tree changes with every bit of K)."""
    if (why := kernels.jit_unavailable()) is not None:
        pytest.xfail(f"{why}: only one back-end to compare")
    gen = torch.Generator().manual_seed(4)
    for k in [*range(1, 41), 63, 64, 65, 127, 128, 129]:
        a = torch.randn(3, k, generator=gen) * torch.exp2(
            torch.randint(-8, 9, (3, k), generator=gen).float())
        b = torch.randn(k, 5, generator=gen)
        for cast in ("none", "mxfp8_e4m3"):
            spec = matmul_spec(lhs=cast, rhs=cast, accumulator=acc, acc_rounding="rtz",
                               order="pairwise")
            want, got = _both(a, b, spec)
            assert _same(want, got), (k, str(spec))


def test_accumulate_is_the_matmul_of_operands_already_cast() -> None:
    """``accumulate`` is ``matmul`` after its casts: given the cast values and, under
    ``scale=block``, the casts' block scales, it gives matmul's bits without casting again."""
    from typing import cast as typed

    from driftcli.arith.matmul import MatmulSpecError, accumulate
    from driftcli.casts.quantization import QuantInfo

    gen = torch.Generator().manual_seed(30)
    a, b = torch.randn(2, 3, 96, generator=gen), torch.randn(96, 5, generator=gen)
    for text in ("lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=bfloat16,order=chunked:32,scale=block",
                 "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,order=blockfma:32,fma=32:13,scale=block",
                 "lhs=nvfp4,rhs=nvfp4,acc=e8m13,order=pairwise"):
        spec = parse_matmul_spec(text)
        ia = typed(QuantInfo, quantize(a, spec.lhs, axis=-1, return_info=True))
        ib = typed(QuantInfo, quantize(b, spec.rhs, axis=-2, return_info=True))
        got = accumulate(ia.values, ib.values, spec, lhs_scales=ia.scales,
                         rhs_scales=ib.scales)
        assert _same(got, matmul(a, b, spec)), text
    with pytest.raises(MatmulSpecError, match="block scales"):  # none given: refused, not guessed
        accumulate(ia.values, ib.values, parse_matmul_spec(
            "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=bfloat16,scale=block"))
