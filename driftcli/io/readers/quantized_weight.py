"""Pre-quantized weights, one record each: the layouts, a weight's stored tensors as one
:class:`QuantSpec`, and its exact decoding.

The value of a quantized element is defined as the exact product of its decoded code and
its scale(s) (divided by a global scale where the layout's global scale is a divisor),
rounded once, to nearest even, to the output dtype. A layout family module
(:mod:`~driftcli.io.readers.fp8_scaled`, :mod:`~driftcli.io.readers.fp4_packed`) builds the
spec of one weight from its tensors; :mod:`~driftcli.io.readers.quantized` finds the weights
of a listing. ``docs/inputs.md`` lists each layout and where its convention comes from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cache

import torch

from driftcli.casts.codec import decode
from driftcli.io.layouts import Layout, Library
from driftcli.io.readers.core import ReadError, TensorRef
from driftcli.records.formats import FORMATS, Format, get_format


class Order(StrEnum):
    """How a weight's codes and scales are combined (``--order``)."""

    EXACT = "exact"
    """The exact product of code, block scale and global scale, rounded once."""
    LIBRARY = "library"
    """As the library that wrote the checkpoint decodes it (:data:`LIBRARY_ORDERS`): its
    intermediate roundings and its sign of zero; exact where it has none."""


@dataclass(frozen=True)
class LibraryOrder:
    """The roundings one library's decoder makes before the output's own (each cited in
    ``docs/dequantize.md``)."""

    scale_dtype: str | None = None
    """The (combined) scale is rounded to this dtype before the product: a dtype name, or
    ``out`` for the output dtype; None: used exactly."""
    product_dtype: str | None = None
    """The product is rounded to this dtype before the output's rounding: a dtype name, or
    ``scale`` for the dtype the library holds the scale in (float32 beside a global scale,
    bfloat16 for E8M0 bytes, else the stored float dtype); None: rounded once."""
    signed_zero: bool = True
    """Whether the code for -0 decodes as -0.0 (ModelOpt's NVFP4 table holds +0 there)."""


LIBRARY_ORDERS: dict[tuple[Library, Layout], LibraryOrder] = {
    (Library.COMPRESSED_TENSORS, Layout.CT_NVFP4): LibraryOrder("float32", "scale"),
    (Library.COMPRESSED_TENSORS, Layout.CT_FP8): LibraryOrder(None, "scale"),
    (Library.COMPRESSED_TENSORS, Layout.MXFP8): LibraryOrder(None, "scale"),
    (Library.COMPRESSED_TENSORS, Layout.CT_MXFP4): LibraryOrder(None, "scale"),
    (Library.MODELOPT, Layout.MODELOPT_NVFP4): LibraryOrder("float32", "float32", False),
    (Library.MODELOPT, Layout.CT_FP8): LibraryOrder("out", None),
    (Library.MODELOPT, Layout.MXFP4): LibraryOrder(None, "float32"),
    (Library.DEEPSEEK, Layout.DEEPSEEK_FP8): LibraryOrder(None, "float32"),
}
"""Each library's decoding order of each layout it writes; a pair not listed decodes as
the exact order does (its decoder makes no rounding before the output's)."""

DEFAULT_LIBRARY: dict[Layout, Library] = {
    Layout.CT_NVFP4: Library.COMPRESSED_TENSORS, Layout.CT_FP8: Library.COMPRESSED_TENSORS,
    Layout.CT_MXFP4: Library.COMPRESSED_TENSORS, Layout.MODELOPT_NVFP4: Library.MODELOPT,
    Layout.DEEPSEEK_FP8: Library.DEEPSEEK, Layout.GPT_OSS_MXFP4: Library.TRANSFORMERS,
    Layout.MXFP6_E2M3: Library.QUARK, Layout.MXFP6_E3M2: Library.QUARK}
"""The library a layout's checkpoint comes from where its config names none."""


class QuantizedError(ReadError):
    """A quantized weight whose tensors cannot be read as one: missing, mismatched or NaN."""


CHUNK_ELEMENTS = 1 << 22
"""Elements dequantized at a time (the float64 work holds about 40 bytes each)."""

OUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a quantized weight can be dequantized to."""


@dataclass(frozen=True)
class QuantSpec:
    """One quantized weight: where its codes and scales are, and how they combine."""

    name: str
    """The weight's own name (``model.layers.0.mlp.down_proj.weight``)."""
    layout: Layout
    element: str
    """The element format's drift name (``float8_e4m3fn``, ``float4_e2m1fn``)."""
    shape: tuple[int, ...]
    """The dequantized weight's shape."""
    codes: TensorRef
    """The stored codes: one per byte, or two nibbles per byte (low nibble first)."""
    packed: bool
    scale: TensorRef
    scale_format: str
    """How the scale's bytes are read: a torch float dtype name, or ``e8m0`` for bytes
    holding a biased power-of-two exponent."""
    block: tuple[int, int]
    """Rows x columns of the weight's last two dims that one scale covers."""
    global_scale: TensorRef | None = None
    global_divides: bool = False
    """Whether the element is divided by the global scale (compressed-tensors) rather than
    multiplied by it (ModelOpt)."""
    pow2_declared: bool = False
    """Whether the layout declares every scale a power of two (ue8m0, E8M0)."""
    order: Order = Order.EXACT
    out_dtype: str = "float32"
    extras: tuple[str, ...] = field(default=())
    """Other stored tensors of this weight (input scales), never measured."""
    library: Library | None = None
    """The library that wrote it (its config's, else the layout's own): whose decoding
    ``Order.LIBRARY`` reproduces."""

    @property
    def library_order(self) -> LibraryOrder:
        """The roundings ``Order.LIBRARY`` makes for this weight (none: exact)."""
        lib = self.library or DEFAULT_LIBRARY.get(self.layout)
        return LIBRARY_ORDERS.get((lib, self.layout), LibraryOrder()) if lib else \
            LibraryOrder()

    @property
    def tensors(self) -> tuple[str, ...]:
        """Every stored tensor this weight is read from."""
        names = [self.codes.name, self.scale.name]
        if self.global_scale is not None:
            names.append(self.global_scale.name)
        return (*names, *self.extras)


# --- exact decoding -----------------------------------------------------------------------


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim, the low nibble first (every FP4 layout
    drift reads stores element ``2i`` in the low nibble of byte ``i``)."""
    b = packed.to(torch.int64)
    # the last dim named, not -1: a weight of no rows has no size for -1 to infer
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*packed.shape[:-1],
                                                          2 * packed.shape[-1])


def unpack_sixes(packed: torch.Tensor) -> torch.Tensor:
    """Four 6-bit codes per three bytes along the last dim: the three bytes are one
    little-endian 24-bit word, element ``4i + k`` in its bits ``6k .. 6k + 5`` (amd-quark's
    FP6 packing)."""
    groups = packed.shape[-1] // 3  # named, not -1: a weight of no rows has no size to infer
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], groups, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([(word >> (6 * k)) & 0x3F for k in range(4)], dim=-1).reshape(
        *packed.shape[:-1], 4 * groups)


def unpack_codes(raw: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The stored codes of ``spec`` (rows of them) as int64, one per element."""
    if not spec.packed:
        return raw.view(torch.uint8).to(torch.int64)
    if len(spec.shape) < len(spec.codes.shape):  # gpt-oss: (..., G, 16) -> (..., G*16)
        raw = raw.reshape(*raw.shape[:-2], -1)
    raw = raw.view(torch.uint8)
    # by the element's width (its record), not its name: four 6-bit codes per three bytes
    return unpack_sixes(raw) if get_format(spec.element).bits == 6 else unpack_nibbles(raw)


def scale_values(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored scales as exact float64 values: E8M0 bytes as 2**(byte - 127), 255 as NaN."""
    if fmt == "e8m0":
        b = raw.view(torch.uint8).to(torch.int64) if raw.dtype != torch.uint8 else raw.to(
            torch.int64)
        vals = torch.ldexp(torch.ones(b.shape, dtype=torch.float64),
                           (b - 127).to(torch.float64))
        return torch.where(b == 255, torch.nan, vals)
    if raw.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return decode(raw.view(torch.uint8), str(raw.dtype).removeprefix("torch.")).double()
    return raw.to(torch.float64)


def stored_scale_format(spec: QuantSpec) -> Format | None:
    """The format record of the scales as stored: ``e8m0`` bytes are OCP's E8M0, any other
    name is a torch float dtype's (a layout's storage names, read once here); ``None`` for a
    dtype drift has no format of (float64)."""
    return FORMATS.get("float8_e8m0fnu" if spec.scale_format == "e8m0" else spec.scale_format)


@cache
def _values_of(element: str) -> torch.Tensor:
    """Every code's exact float64 value in ``element``, in code order (drift's codec)."""
    return decode(torch.arange(1 << get_format(element).bits), element).double()


def element_values(codes: torch.Tensor, element: str) -> torch.Tensor:
    """Integer codes as their exact float64 values in ``element``: a lookup in the table of
    every code's value (decoded once), a few times faster than decoding each element."""
    table = _values_of(element)
    return table[codes.to(torch.int64) & (len(table) - 1)]


def round_once(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Exact float64 values (or values already rounded once, see the docs) rounded to
    nearest even in ``dtype``, overflowing to infinity."""
    if dtype == "float32":
        return x.to(torch.float32)  # IEEE conversion: one RNE rounding
    # float64 -> bfloat16/float16 in torch goes through float32 (two roundings); drift's
    # rounding reads the float64 bits and rounds once
    from driftcli.casts.rounding import round_to_format
    return round_to_format(x, dtype, overflow="ieee").to(OUT_DTYPES[dtype])


def _expand(scales: torch.Tensor, block: tuple[int, int], rows: tuple[int, int],
            shape: tuple[int, ...]) -> torch.Tensor:
    """Block scales spread over the elements they cover, cut to ``shape``; ``rows`` is the
    (offset, count) of the last-but-one dim wanted within the first scale row's block."""
    br, bc = block
    off, n = rows
    # indices, not repeat_interleave: a block size from a config (2^24 rows) costs the
    # elements wanted, never block x scales
    x = scales.index_select(-1, torch.arange(shape[-1]) // bc)
    return x.index_select(-2, torch.arange(off, off + n) // br)


def read_weight(spec: QuantSpec, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` (of dim 0) of the dequantized weight, in ``spec.out_dtype``.

    Raises :class:`QuantizedError` naming the weight where a scale it needs is NaN or
    infinite."""
    codes = unpack_codes(spec.codes.read(start, stop), spec)
    vals = element_values(codes, spec.element)
    lib = spec.library_order if spec.order is Order.LIBRARY else LibraryOrder()
    if not lib.signed_zero:
        vals = torch.where(vals == 0, 0.0, vals)
    out_shape = (stop - start, *spec.shape[1:])
    if spec.scale.numel == 1:
        raw = spec.scale.read()
        scale = scale_values(raw, spec.scale_format).reshape(())
    elif len(spec.shape) == 2:  # dim 0 is the blocked row dim
        br = spec.block[0]
        first, last = start // br, -(-stop // br)
        raw = spec.scale.read(first, last)
        # ModelOpt's [rows] and [R, 1, C, 1] grids are [rows, 1] and [R, C]
        raw = raw.reshape(raw.shape[0], math.prod(raw.shape[1:]))
        scale = _expand(scale_values(raw, spec.scale_format), spec.block,
                        (start - first * br, stop - start), out_shape)
    else:  # dim 0 leads (experts); the blocks tile the last two dims
        raw = spec.scale.read(start, stop)
        scale = _expand(scale_values(raw, spec.scale_format), spec.block,
                        (0, spec.shape[-2]), out_shape)
    bad = ~torch.isfinite(scale)
    if bool(bad.any()):
        raise QuantizedError(f"{spec.scale.source}: tensor {spec.scale.name} holds a "
                             f"{'NaN' if bool(scale.isnan().any()) else 'infinite'} scale, so "
                             f"weight {spec.name} cannot be dequantized; re-export the "
                             "checkpoint")
    if spec.global_scale is not None:
        g = spec.global_scale.read().to(torch.float64).reshape(())
        if not math.isfinite(float(g)) or float(g) == 0:
            raise QuantizedError(f"{spec.global_scale.source}: tensor "
                                 f"{spec.global_scale.name} is {float(g)}, so weight "
                                 f"{spec.name} cannot be dequantized; re-export the checkpoint")
        if lib.scale_dtype is None:
            # code (2 bits) x E4M3 scale (4 bits) x float32 global (24 bits) is exact in
            # float64; a quotient is rounded once to 53 bits, which cannot move it across a
            # float32 or bfloat16 rounding boundary (see docs/inputs.md), so the final
            # rounding is the only one that counts
            full = vals * scale / g if spec.global_divides else vals * scale * g
            return _library_product(full, spec, lib)
        scale = scale / g if spec.global_divides else scale * g
    if lib.scale_dtype is not None:
        scale = round_once(scale, _dtype(lib.scale_dtype, spec)).double()
    return _library_product(vals * scale, spec, lib)  # exact: <= 4 + 24 bits


def _dtype(name: str, spec: QuantSpec) -> str:
    """A :class:`LibraryOrder` dtype: ``out`` the output's, ``scale`` the one the library
    holds the scale in."""
    if name == "out":
        return spec.out_dtype
    if name == "scale":
        if spec.global_scale is not None:
            return "float32"
        fmt = "bfloat16" if spec.scale_format == "e8m0" else spec.scale_format
        return fmt if fmt in OUT_DTYPES else "float32"
    return name


def _library_product(exact: torch.Tensor, spec: QuantSpec, lib: LibraryOrder) -> torch.Tensor:
    """The product rounded to the output dtype, through the library's own dtype first where
    its decoder rounds there."""
    if lib.product_dtype is not None:
        exact = round_once(exact, _dtype(lib.product_dtype, spec)).double()
    return round_once(exact, spec.out_dtype)


@dataclass(frozen=True)
class QuantReader:
    """The :class:`~driftcli.io.readers.core.Reader` of a quantized weight."""

    spec: QuantSpec

    def read(self, ref: TensorRef, start: int, stop: int,
             into: torch.Tensor | None) -> torch.Tensor:
        """Rows ``[start, stop)`` dequantized (``into`` is not used), a few million elements
        at a time: the float64 work takes about 40 bytes an element, the result 2 or 4."""
        del ref, into
        spec = self.spec
        row = math.prod(spec.shape[1:])
        step = max(1, CHUNK_ELEMENTS // max(row, 1))
        if len(spec.shape) == 2 and step > spec.block[0]:
            step -= step % spec.block[0]  # whole blocks: each scale row read once
        if stop - start <= step:
            return read_weight(spec, start, stop)
        out = torch.empty((stop - start, *spec.shape[1:]), dtype=OUT_DTYPES[spec.out_dtype])
        for at in range(start, stop, step):
            out[at - start:min(at + step, stop) - start] = read_weight(
                spec, at, min(at + step, stop))
        return out


def weight_ref(spec: QuantSpec) -> TensorRef:
    """The one tensor a quantized weight is listed as."""
    return TensorRef(spec.codes.source, spec.name, spec.out_dtype, spec.shape,
                     _reader=QuantReader(spec))


def spec_of(ref: TensorRef) -> QuantSpec | None:
    """The quantized weight behind ``ref``, or None for a stored tensor."""
    reader = ref._reader  # the reader is how a listed ref carries where it comes from
    return reader.spec if isinstance(reader, QuantReader) else None


def with_options(ref: TensorRef, out_dtype: str = "float32",
                 order: Order = Order.EXACT) -> TensorRef:
    """``ref`` read to ``out_dtype`` and in ``order`` where it is a quantized weight."""
    spec = spec_of(ref)
    if spec is None:
        return ref
    return weight_ref(replace(spec, out_dtype=out_dtype, order=order))


@dataclass(frozen=True)
class Config:
    """What a checkpoint folder's config says about its quantization."""

    layout: Layout | None
    block: tuple[int, int] | None = None
    pow2_declared: bool = False
    library: Library | None = None
    """The library the config says wrote the checkpoint."""
    notice: str | None = None
    """A one-line notice: the config names a quantization drift does not know, and the
    weights are read by their names."""
    block_error: str | None = None
    """The config gives a block size that is no block size (``[true, true]``, ``[0, 128]``):
    the weights it would apply to are refused with this line, never read under a guess."""


@dataclass(frozen=True)
class Family:
    """The layouts one module reads: which weights a folder's tensors claim, and how the
    tensors of one weight become its spec."""

    layouts: tuple[Layout, ...]
    claims: Callable[[dict[str, TensorRef], set[str]], dict[str, set[Layout]]]
    """Weight name -> the layouts its stored tensors' names, dtypes and shapes suggest, from
    the folder's readable tensors and the names of its unreadable ones."""
    build: Callable[[Layout, str, dict[str, TensorRef], Config], QuantSpec | str]
    """The spec of one weight, or a one-line problem naming the tensor at fault."""
    parts: Callable[[Layout, str], tuple[str, ...]]
    """The stored names a weight of this layout may have."""
