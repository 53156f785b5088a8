"""The simulated matmul's spec (:class:`MatmulSpec`): what each operand is cast with, the
accumulator and its order, how block scales are applied, the output cast; the checks that
keep it exact in float64; and the grammar that writes and reads it.

The spec string is ``key=value`` pairs joined by commas, in any order, every key optional::

    lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=bfloat16:rtz,order=chunked:128,scale=block,out=bf16

``lhs``/``rhs``/``out``: a cast spec or preset (``none``: no cast). ``acc``: the accumulator
format, optionally ``:rne`` or ``:rtz``. ``order``: ``sequential``, ``pairwise``,
``chunked:N``, ``native``, ``blockfma`` or ``blockfma:N``. ``fma``: the block-FMA unit,
``SIZE:KEPT[:iK][:eMIN]`` (order ``blockfma`` only). ``tc``: a tensor-core preset
(``h100_e4m3_f32``), which sets ``acc``, ``order``, ``fma`` and, where they are not given,
``lhs`` and ``rhs`` to its input format. ``scale``: ``dequantized`` or ``block``.
``str(spec)`` writes every key in that order (``fma`` only under ``blockfma``; ``tc`` never:
it is written out) with canonical casts, and ``parse_matmul_spec(str(s)) == s``.

:mod:`driftcli.arith.matmul` executes a spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import cast

from driftcli.arith.blockfma import FMAUnit, parse_unit
from driftcli.arith.tensorcores import tensor_core
from driftcli.choices import parse_choice
from driftcli.errors import DriftError, close_matches
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS, Format, get_format
from driftcli.records.modes import Granularity, Rounding

FLOAT32 = FORMATS["float32"]


MASTER = FLOAT32
"""The format of the master sum that ``chunked`` orders promote into (rounded to nearest)."""


ACC_ROUNDINGS = (Rounding.RNE, Rounding.RTZ)
"""The rounding modes an accumulator may use."""


class MatmulSpecError(DriftError, ValueError):
    """A matmul spec that cannot be built as asked."""


class Order(StrEnum):
    """In which order the accumulator adds the terms."""

    SEQUENTIAL = "sequential"
    """``acc = +0; for k in 0..K-1: acc = round(acc + t[k])``."""
    PAIRWISE = "pairwise"
    """A tree: adjacent pairs level by level, an odd last element carried up unchanged; the
    root added to +0."""
    CHUNKED = "chunked"
    """``chunk`` terms summed sequentially in the accumulator from +0, each chunk's result then
    added into a float32 master sum rounded to nearest (promotion every ``chunk`` terms)."""
    NATIVE = "native"
    """``torch.matmul`` of the cast operands in float32: the fast path, order unspecified."""
    BLOCKFMA = "blockfma"
    """A tensor core's block-FMA unit (the spec's ``unit``) over the products in index order;
    with ``chunk`` > 0, promotion into a float32 master sum (rounded to nearest) every
    ``chunk`` products."""


class ScaleApplication(StrEnum):
    """Where block scales enter the sum."""

    DEQUANTIZED = "dequantized"
    """Products of the dequantized operands (element times scale) are the terms."""
    BLOCK = "block"
    """One term per block along K: the exact partial dot product of the two blocks' elements,
    in element units, times the two block scales."""


DOUBLE_BITS = 53


def element_bits(fmt: Format) -> int:
    """Bits of fixed point that hold every dequantized value of ``fmt`` divided by its
    power-of-two scale: from the finest quantum ``2**qmin`` up to ``2**(emax + 2)`` (one binade
    above the top, which a float32 store of a tiny scaled value can round up into)."""
    return fmt.emax + 2 - fmt.qmin


@dataclass(frozen=True)
class MatmulSpec:
    """How a simulated matmul is computed (see the module docs and docs/arithmetic.md)."""

    lhs: Cast | None = None
    """The cast of A along K (its last axis); None: A as float32."""
    rhs: Cast | None = None
    """The cast of B along K (its second-to-last axis); None: B as float32."""
    accumulator: Format = field(default_factory=lambda: FLOAT32)
    """The format every partial sum is rounded to."""
    acc_rounding: Rounding = Rounding.RNE
    """``rne`` or ``rtz``; overflow as IEEE (±inf, ±max under rtz)."""
    order: Order = Order.SEQUENTIAL
    chunk: int = 0
    """Terms per chunk for ``chunked`` (products; with block scale application a multiple of
    the block size); for ``blockfma`` the promotion interval in products (0: none); 0 for
    every other order."""
    unit: FMAUnit | None = None
    """The block-FMA unit of order ``blockfma`` (None for every other order)."""
    scale_application: ScaleApplication = ScaleApplication.DEQUANTIZED
    out: Cast | None = None
    """The cast of the result along its last axis (N); None: the accumulator's values."""

    def __post_init__(self) -> None:
        acc = self.accumulator
        if acc.integer or not acc.signed or not acc.has_zero:
            raise MatmulSpecError(
                f"accumulator {acc.name!r} is not a signed float format with a zero; use "
                "float32, bfloat16, float16 or a custom eXmY such as e8m13")
        if self.acc_rounding not in ACC_ROUNDINGS:
            raise MatmulSpecError(
                f"accumulator rounding {self.acc_rounding.value!r} is not supported; use "
                f"{' or '.join(m.value for m in ACC_ROUNDINGS)}")
        if self.order is Order.CHUNKED:
            if self.chunk < 1:
                raise MatmulSpecError(f"order chunked needs a chunk size of at least 1, not "
                                      f"{self.chunk}; write e.g. chunked:128")
        elif self.order is Order.BLOCKFMA:
            self._check_blockfma()
        elif self.chunk:
            raise MatmulSpecError(f"order {self.order.value} takes no chunk size "
                                  f"(got {self.chunk}); only chunked:N does")
        if self.order is Order.NATIVE and (acc != FLOAT32 or self.acc_rounding is not Rounding.RNE
                                           or self.scale_application is not
                                           ScaleApplication.DEQUANTIZED):
            raise MatmulSpecError(
                f"order native is torch.matmul in float32: it needs acc=float32:rne and "
                f"scale=dequantized (got acc={acc.name}:{self.acc_rounding.value}, "
                f"scale={self.scale_application.value}); use sequential, pairwise or chunked:N "
                "for other accumulators")
        if self.order is not Order.BLOCKFMA and self.unit is not None:
            raise MatmulSpecError(f"fma={self.unit} describes a block-FMA unit; it needs "
                                  f"order=blockfma, not {self.order.value}")
        if self.scale_application is ScaleApplication.BLOCK:
            self._check_block()
        self._check_transforms()

    def _check_transforms(self) -> None:
        """A random Hadamard transform keeps the product only when both operands carry the same
        one along K (``Xᵀ·M·Mᵀ·dY = Xᵀ·dY``; drift applies no inverse): on one side, with other
        signs, or on the result, the matmul would be silently wrong."""
        signs = [None if c is None or c.rht is None else c.rht.signs
                 for c in (self.lhs, self.rhs)]
        if signs[0] != signs[1]:
            sides = ", ".join(f"{side} {'none' if c is None or c.rht is None else c.rht}"
                              for side, c in (("lhs", self.lhs), ("rhs", self.rhs)))
            raise MatmulSpecError(
                f"rht= transforms along K and is not undone: both operands need the same one "
                f"(here {sides}); give both casts the same rht= or neither")
        if self.out is not None and self.out.rht is not None:
            raise MatmulSpecError(f"out={self.out} has rht={self.out.rht}: a result cast cannot "
                                  "take a transform that nothing undoes; leave rht= out of it")

    def _check_blockfma(self) -> None:
        """A unit and a promotion interval of whole groups (under block scale application,
        promotion at every scale block: :meth:`_check_block`, once the casts are checked)."""
        if self.unit is None:
            raise MatmulSpecError("order blockfma needs a unit: give fma=SIZE:KEPT (e.g. "
                                  "fma=32:13) or a tensor-core preset (tc=h100_e4m3_f32)")
        if self.chunk < 0 or self.chunk % self.unit.size:
            raise MatmulSpecError(f"blockfma:{self.chunk} promotes every {self.chunk} products, "
                                  f"not a whole number of groups of {self.unit.size}")

    def _check_block(self) -> None:
        """Block scale application needs two power-of-two block scalings of one size whose
        partial dot products are exact in float64."""
        sizes = []
        for side, c in (("lhs", self.lhs), ("rhs", self.rhs)):
            s = None if c is None else c.scaling
            if c is None or s is None or s.granularity is not Granularity.BLOCK:
                raise MatmulSpecError(
                    f"scale=block needs block-scaled casts on both operands; {side} is "
                    f"{'none' if c is None else c}; use scale=dequantized")
            if s.rule is None or not s.rule.power_of_two:
                raise MatmulSpecError(
                    f"scale=block needs power-of-two block scales (floor, ceil, even); {side}'s "
                    f"rule is {s.rule}, whose element values are not recoverable exactly from "
                    "the dequantized ones; use scale=dequantized")
            sizes.append(s.block)
        lhs, rhs = cast(Cast, self.lhs), cast(Cast, self.rhs)
        if sizes[0] != sizes[1]:
            raise MatmulSpecError(
                f"scale=block needs equal block sizes along K; lhs has {sizes[0]}, rhs "
                f"{sizes[1]}: cast both with the same block size or use scale=dequantized")
        if self.order is Order.BLOCKFMA:  # the unit's products are exact whatever the formats
            if self.chunk != sizes[0]:  # each block's partial sum is scaled as it is promoted
                raise MatmulSpecError(
                    f"order blockfma with scale=block promotes each scale block with its "
                    f"scales: write order=blockfma:{sizes[0]} (the block size), not "
                    f"{self.order_name}")
            return
        # a sum of n terms below 2**x stays below 2**(x + ceil(log2 n))
        bits = element_bits(lhs.format) + element_bits(rhs.format) + (sizes[0] - 1).bit_length()
        if bits > DOUBLE_BITS:
            raise MatmulSpecError(
                f"scale=block forms each block's dot product exactly in float64; "
                f"{lhs.format.name} x {rhs.format.name} in blocks of {sizes[0]} needs {bits} "
                f"bits of fixed point, more than float64's {DOUBLE_BITS}; use "
                "scale=dequantized for these formats")
        if self.order is Order.CHUNKED and self.chunk % sizes[0]:
            raise MatmulSpecError(
                f"with scale=block a chunk is whole blocks: chunked:{self.chunk} is not a "
                f"multiple of the block size {sizes[0]}")

    @property
    def block(self) -> int:
        """The block size along K under block scale application (else 0)."""
        if self.scale_application is not ScaleApplication.BLOCK or self.lhs is None:
            return 0
        return self.lhs.scaling.block

    @property
    def order_name(self) -> str:
        """The order as written in a spec: ``sequential``, ``chunked:128``, ``blockfma:128``…"""
        return f"{self.order.value}:{self.chunk}" if self.chunk else self.order.value

    def __str__(self) -> str:
        def cast_text(c: Cast | None) -> str:
            return "none" if c is None else str(c)

        return ",".join([
            f"lhs={cast_text(self.lhs)}", f"rhs={cast_text(self.rhs)}",
            f"acc={self.accumulator.name}:{self.acc_rounding.value}",
            f"order={self.order_name}", *([f"fma={self.unit}"] if self.unit else []),
            f"scale={self.scale_application.value}", f"out={cast_text(self.out)}"])


_KEYS = ("lhs", "rhs", "acc", "order", "fma", "tc", "scale", "out")


_EXAMPLE = "lhs=mxfp8_e4m3,rhs=mxfp8_e4m3,acc=bfloat16:rtz,order=chunked:128"


def _bad(text: str, why: str) -> MatmulSpecError:
    return MatmulSpecError(f"matmul spec {text!r}: {why}; write KEY=VALUE pairs joined by "
                           f"commas, keys {', '.join(_KEYS)}, e.g. {_EXAMPLE}")


def parse_order(text: str) -> tuple[Order, int]:
    """``sequential``, ``pairwise``, ``native``, ``chunked:N``, ``blockfma`` or
    ``blockfma:N`` as ``(Order, chunk)``."""
    name, sep, size = text.strip().partition(":")
    order = parse_choice(Order, name, "matmul order")
    if order in (Order.CHUNKED, Order.BLOCKFMA) and sep:
        if not size.isdigit() or int(size) < 1:
            raise MatmulSpecError(f"order {text!r}: {order.value} needs a positive size, "
                                  f"e.g. {order.value}:128")
        return order, int(size)
    if order is Order.CHUNKED:
        raise MatmulSpecError(f"order {text!r}: chunked needs a positive size, e.g. chunked:128")
    if sep:
        raise MatmulSpecError(f"order {text!r}: only chunked and blockfma take a size")
    return order, 0


def _optional_cast(value: Cast | str | None) -> Cast | None:
    if value is None or (isinstance(value, str) and value.strip() == "none"):
        return None
    return parse_cast(value)


def matmul_spec(*, lhs: Cast | str | None = None, rhs: Cast | str | None = None,
                accumulator: Format | str | None = None, acc_rounding: Rounding | str | None = None,
                order: Order | str | None = None, chunk: int | None = None,
                unit: FMAUnit | str | None = None, tc: str | None = None,
                scale_application: ScaleApplication | str = ScaleApplication.DEQUANTIZED,
                out: Cast | str | None = None) -> MatmulSpec:
    """A :class:`MatmulSpec` from objects or strings: casts as spec strings or presets
    (``"mxfp8_e4m3"``, ``"none"``), the accumulator as a format name (``"bfloat16"``,
    ``"e8m13"``), the order as ``"sequential"``, ``"pairwise"``, ``"native"``,
    ``"chunked:128"`` (or ``order="chunked", chunk=128``) or ``"blockfma:128"``, the
    block-FMA unit as ``"32:13"``. ``tc`` names a tensor-core preset: it sets the accumulator,
    its rounding, the order (``blockfma``, keeping a promotion interval given) and the unit,
    and the operand casts where they are not given (a plain cast to its input format)."""
    parsed: Order | None
    if order is None or isinstance(order, Order):
        parsed, size = order, 0
    else:
        parsed, size = parse_order(order) if ":" in order else (
            parse_choice(Order, order.strip(), "matmul order"), 0)
    if chunk is not None:
        if size and size != chunk:
            raise MatmulSpecError(f"order {order!r} and chunk={chunk} disagree; give one")
        size = chunk
    if tc is not None:
        given = [name for name, v in (("acc", accumulator), ("acc rounding", acc_rounding),
                                      ("fma", unit)) if v is not None]
        if given:
            raise MatmulSpecError(f"tc={tc} sets {', '.join(given)}; give the preset or them")
        if parsed is not None and parsed is not Order.BLOCKFMA:
            raise MatmulSpecError(f"tc={tc} is a block-FMA unit: its order is blockfma "
                                  f"(blockfma:N to promote), not {parsed.value}")
        core = tensor_core(tc)
        lhs = core.inputs if lhs is None else lhs
        rhs = core.inputs if rhs is None else rhs
        accumulator, acc_rounding, parsed, unit = core.acc, core.rounding, Order.BLOCKFMA, \
            core.unit
    return MatmulSpec(lhs=_optional_cast(lhs), rhs=_optional_cast(rhs),
                      accumulator=get_format(FLOAT32 if accumulator is None else accumulator),
                      acc_rounding=parse_choice(Rounding, acc_rounding or Rounding.RNE,
                                                "accumulator rounding"),
                      order=parsed or Order.SEQUENTIAL, chunk=size,
                      unit=None if unit is None else parse_unit(unit),
                      scale_application=parse_choice(ScaleApplication, scale_application,
                                                     "scale application"),
                      out=_optional_cast(out))


def parse_matmul_spec(text: str | MatmulSpec) -> MatmulSpec:
    """A :class:`MatmulSpec` from its spec string (see the module docs); specs pass through."""
    if isinstance(text, MatmulSpec):
        return text
    found: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise _bad(text, f"{part.strip()!r} has no '='")
        if key not in _KEYS:
            raise _bad(text, f"unknown key {key!r}{close_matches(key, _KEYS)}")
        if key in found:
            raise _bad(text, f"key {key!r} given twice")
        found[key] = value.strip()
    acc, _, mode = found["acc"].partition(":") if "acc" in found else (None, "", "")
    try:
        return matmul_spec(lhs=found.get("lhs"), rhs=found.get("rhs"), accumulator=acc,
                           acc_rounding=mode or (None if acc is None else Rounding.RNE),
                           order=found.get("order"), unit=found.get("fma"), tc=found.get("tc"),
                           scale_application=found.get("scale", ScaleApplication.DEQUANTIZED),
                           out=found.get("out"))
    except DriftError as err:
        raise MatmulSpecError(f"matmul spec {text!r}: {err}") from None
