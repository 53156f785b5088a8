"""The choices a cast makes, as str enums: rounding mode, overflow policy, scale
granularity, scale rule and the settings of a scale arithmetic. Nothing here imports
torch: the oracle and ``drift --help`` read them. The commands' other choices are in
:mod:`driftcli.choices`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class Rounding(StrEnum):
    """How a real value is rounded onto a format's grid."""

    RNE = "rne"
    """Nearest, ties to the even significand (IEEE roundTiesToEven); the default."""
    RNA = "rna"
    """Nearest, ties away from zero (IEEE roundTiesToAway)."""
    RTZ = "rtz"
    """Toward zero (truncation)."""
    RUP = "rup"
    """Toward +inf."""
    RDOWN = "rdown"
    """Toward −inf."""
    SR = "sr"
    """Stochastic: with k random bits r, round away from zero when floor(f·2^k) + r ≥ 2^k,
    f the fractional distance past the lower neighbour (hardware adds random bits, truncates)."""

    def toward_zero(self, negative: bool) -> bool:
        """Whether this mode rounds a value of this sign toward zero (never past it)."""
        return self is Rounding.RTZ or (self is Rounding.RUP and negative) or (
            self is Rounding.RDOWN and not negative)


class Overflow(StrEnum):
    """What a value beyond the largest finite becomes."""

    SATURATE = "saturate"
    """Clamp to ±max finite, ±inf included (OCP saturating, TE satfinite)."""
    IEEE = "ieee"
    """As IEEE 754: ±inf where the format has it (±max when the mode rounds toward zero),
    NaN where it has only NaN, ±max where it has neither."""


class Granularity(StrEnum):
    """Which elements share one scale."""

    NONE = "none"
    """No scaling: the bare cast, scale 1."""
    TENSOR = "tensor"
    """One scale for the whole tensor."""
    CHANNEL = "channel"
    """One scale per slice along the axis (per row of a weight, for the last axis)."""
    BLOCK = "block"
    """One scale per ``k`` consecutive elements along the axis (MX: 32, NVFP4: 16)."""
    TILE = "tile"
    """One scale per ``k x k`` tile spanning the axis and the last other axis (for a matrix
    and the last axis: rows and columns; NVFP4 weights: 16)."""


class ScaleRule(StrEnum):
    """How a scale is chosen from the amax of the elements that share it.

    A member is a value that carries its implementations: its name, the one fact both
    implementations share (:attr:`power_of_two`), its fast implementation
    ``driftcli.casts.scaling.FAST_RULES[rule]`` (torch) and its exact one
    ``driftcli.oracle.scaling.EXACT_RULES[rule]`` (``Fraction``). A power-of-two rule implements its
    exponent ``k`` (headroom and clamping are shared), any other rule its divisor. The tables
    live beside the code they name, keyed by member, and each module checks on import that
    every member has an entry (:func:`check_rule_table`): a member without both cannot be
    imported, and ``verify-formats`` loops over the members, so one with both is verified. The
    enum itself stays here, free of torch, for the oracle and ``drift --help``; looking the
    implementations up from here would import upward.
    """

    power_of_two: bool
    """Whether the rule picks a power of two ``2**k`` (an integer exponent): elements are then
    rounded onto the element grid times ``2**k``, nothing divided; otherwise each element is
    divided by a real scale in float32."""
    covers_amax: bool
    """Whether the rule's exact scale is the real ``amax / M`` of its group or above it, so that
    in exact arithmetic nothing clips: a clip under it comes only from rounding that real scale
    (or the quotient ``x / s``), and counts in ``clipped_by_rounding``. ``floor`` and ``even``
    define their scale as a power of two below ``amax / M``: their clips are the rule's."""
    rounding: Rounding | None
    """A real-valued rule's rounding of ``amax / M`` into the scale format, or None where the
    scale is kept as computed (``amax``, and the power-of-two rules, whose scale is exact).
    Both implementations read it here (``scalearith``, ``oracle_arith``, the oracle's
    ``real_rule``), so a new rule states it once."""

    def __new__(cls, value: str, power_of_two: bool, covers_amax: bool = False,
                rounding: Rounding | None = None) -> ScaleRule:
        rule = str.__new__(cls, value)
        rule._value_ = value
        rule.power_of_two = power_of_two
        rule.covers_amax = covers_amax
        rule.rounding = rounding
        return rule

    FLOOR = "floor", True
    """OCP MX v1.0: ``2**(floor(log2 amax) - emax_elem)``; the largest values can clip."""
    CEIL = "ceil", True, True
    """``2**ceil(log2(amax / max_elem))``: nothing clips (NVIDIA's MXFP8 recipe)."""
    EVEN = "even", True
    """amax rounded to the element's mantissa width (ties away) first, then ``floor``."""
    AMAX = "amax", False, True
    """Real-valued ``amax / max_elem`` in float32, kept as is (current scaling)."""
    AMAX_RNE = "amax-rne", False, True, Rounding.RNE
    """``amax / max_elem`` rounded to nearest into the scale format."""
    AMAX_UP = "amax-up", False, True, Rounding.RUP
    """``amax / max_elem`` rounded up into the scale format (nothing clips)."""
    TWO_LEVEL = "two-level", False, True
    """A float32 tensor scale over block scales in the scale format (NVFP4)."""
    CEIL_AMAX = "ceil-amax", True, True
    """``2**(ceil(log2 amax) - emax_elem)``: amax rounded up to a power of two, then ``floor``
    (torchao's CEIL); the scale can exceed ``ceil``'s by one binade, nothing clips."""
    EVEN_E2M1 = "even-e2m1", True
    """amax rounded (ties away) to E2M1's one mantissa bit, whatever the element, then
    ``floor``: up a binade where amax's significand is at least 1.75 (compressed-tensors'
    ``generate_mx_scales`` for MXFP4 and MXFP8). ``even`` on E2M1, where the rule clips
    significands in (1.5, 1.75); where M's significand is at least 1.75 (E4M3, E5M2, FP6)
    amax / 2**k stays below M and nothing clips."""


# --- scale arithmetic: where each float operation of a scale happens -----------------------


class ScaleOp(StrEnum):
    """The float operation that turns a group's amax into its real scale."""

    DIV = "div"
    """``s = fl(amax / M)``: the scale, divided out (drift's default)."""
    RCP = "rcp"
    """``r = fl(M / amax)``: the reciprocal scale, the number elements are multiplied by."""
    MULRCP = "mulrcp"
    """``s = fl(amax · fl(1 / M))``: the scale from a multiplication by M's rounded
    reciprocal (Transformer Engine's MXFP8 ``amax * max_norm_rcp``)."""


class Precision(StrEnum):
    """The precision the scale operation (and the amax floor) is computed in."""

    F32 = "f32"
    """One float32 operation (the working dtype's)."""
    F64 = "f64"
    """Computed in float64 and rounded once to float32 (torchao's ``amax_to_scale``)."""


class ElementOp(StrEnum):
    """How each element meets its scale: on the way in (``apply``) and out (``undo``)."""

    DIV = "div"
    """Divided: ``fl(x / s)`` in, ``fl(q / r)`` out."""
    MUL = "mul"
    """Multiplied: ``fl(x · r)`` in, ``fl(q · s)`` out."""


class AmaxPolicy(StrEnum):
    """Which elements a group's amax is taken over."""

    FINITE = "finite"
    """The finite ones; a block or tile holding NaN or inf becomes NaN (drift's default)."""
    IEEE = "ieee"
    """All of them, as ``torch.amax``: a NaN makes amax NaN, an inf makes it inf, and the
    scale's operations then run on that (torchao)."""
    FMAX = "fmax"
    """All but NaN, as CUDA's ``fmaxf`` reduction: an inf makes amax inf (Transformer
    Engine)."""


class Pow2(StrEnum):
    """How a power of two is taken."""

    BITS = "bits"
    """Exactly, from bits: a power-of-two rule from amax's exponent, a real scale rounded into
    a power-of-two scale format on its bits (drift's default)."""
    LOG2 = "log2"
    """Through float32 ``log2``: ``ceil(log2(fl(amax / M)))`` for ``ceil``, and for a real
    scale ``exp2(ceil(log2 s))`` or ``exp2(floor(log2 r))`` (torchao's eager RCEIL and
    power-of-two scales, DeepSeek-V3's ``ue8m0``): one binade low where ``log2`` rounds to an
    integer though its argument is not a power of two. A named departure from exactness."""
    RP = "rp"
    """``ceil`` only: the float32 quotient ``fl(amax / M)`` (per ``scale``) rounded up to a
    power of two on its bits, saturating at ``2**127`` (PTX ``cvt.rp.satfinite.ue8m0x2.f32``,
    Transformer Engine's ``float_to_e8m0``)."""


class Guard(StrEnum):
    """What a group whose amax is 0 (or not finite) gets as its scale."""

    DRIFT = "drift"
    """An all-zero group keeps its zeros and reports the scale format's smallest value."""
    NONE = "none"
    """Nothing: the IEEE result of the operations as they stand (``M / 0`` is inf)."""
    ONE = "one"
    """Transformer Engine's ``compute_scale_from_amax``: a scale of 1 where amax is 0, inf or
    NaN, and float32's max where ``M / amax`` overflows."""


class SmallestRcp(StrEnum):
    """The multiplier used for the smallest power-of-two scale (E8M0 code 0, ``2**-127``)."""

    EXACT = "exact"
    """``2**127``."""
    ONE = "one"
    """1: torchao's eager RCEIL, after an older Transformer Engine ``exp2f_rcp``."""


class TwoLevelOrder(StrEnum):
    """The order of operations of a two-level (NVFP4) cast."""

    DRIFT = "drift"
    """``S = fl(amax_t / fl(Ms·M))``, ``sb = rne(fl(fl(amax_b / M) / S))``, ``d = fl(sb·S)``,
    ``fl(x / d)``, ``fl(q·d)`` (see docs/scaling.md)."""
    TORCHAO = "torchao"
    """torchao's ``nvfp4_quantize``: ``S = fl(amax_t / 2688)``,
    ``sb = rne(clamp(fl(fl(amax_b / 6) / S), 2**-6, 448))``, ``fl(x · fl(fl(1 / S) / sb))``,
    ``fl(q · fl(S · sb))``."""
    TE = "te"
    """Transformer Engine's NVFP4 kernels: ``S_enc = fl(2688 / amax_t)``,
    ``sb = rn(fl(amax_b · fl(S_enc · fl(1/6))))`` (0 below 2**-10),
    ``fl(x · min(fl(1 / fl(sb · fl(1 / S_enc))), max))``, and its dequantize kernel's
    ``fl(q · fl(fl(sb · amax_t) · fl(1 / 2688)))``."""
    TE_ROW = "te-row"
    """Transformer Engine's row-scaled NVFP4 (``row_scaled_nvfp4``): ``te``'s operations with
    one float32 amax per row (along the block axis) in place of the tensor's."""
    TE_4OVER6_MAE = "te-4over6-mae"
    """Transformer Engine's four over six (``nvfp4_use_4over6``, ``nvfp4_e4m3_max=256``): each
    block cast twice, with ``sb6 = rn(fl(fl(amax_b / 6) · S_enc))`` and ``sb4 = rn(fl(that
    product · 1.5))``, ``S_enc = fl(1536 / amax_t)``; the candidate with the smaller sum of
    ``|fl(fl(fl(q·sb)·amax_t) / 1536) − x|`` kept, ties to ``sb6`` (docs/recipes.md)."""
    TE_4OVER6_MSE = "te-4over6-mse"
    """The same, the error a sum of squares."""
    TE_4OVER6_MAE_FP16 = "te-4over6-mae-fp16"
    """Four over six with ``nvfp4_4over6_err_use_fast_math``: the error between the exact
    FP16 product ``q·sb`` and ``fl(x · S_enc)``, absolute."""
    TE_4OVER6_MSE_FP16 = "te-4over6-mse-fp16"
    """The fast error path, squared."""
    TE_ROW_4OVER6_MAE = "te-row-4over6-mae"
    """Four over six on row-scaled NVFP4 (``row_scaled_nvfp4`` with ``nvfp4_use_4over6``):
    ``te-4over6-mae``'s operations with each row's float32 amax as ``amax_t``, in ``S_enc``,
    in the error and in the dequantization."""
    TE_ROW_4OVER6_MSE = "te-row-4over6-mse"
    """Row-scaled four over six, the error a sum of squares."""
    TE_ROW_4OVER6_MAE_FP16 = "te-row-4over6-mae-fp16"
    """Row-scaled four over six, the fast error path (``fl(x · S_enc)``, ``S_enc`` the row's)."""
    TE_ROW_4OVER6_MSE_FP16 = "te-row-4over6-mse-fp16"
    """Row-scaled four over six, the fast error path, squared."""

    @property
    def row_scaled(self) -> bool:
        """Whether the "tensor" amax is each row's own."""
        return self.value.startswith("te-row")

    @property
    def four_over_six(self) -> bool:
        """Whether the order picks between a map-to-6 and a map-to-4 block scale."""
        return "-4over6-" in self.value

    @property
    def squared(self) -> bool:
        """Four over six's error: a sum of squares (MSE) rather than of magnitudes (MAE)."""
        return "-mse" in self.value

    @property
    def fp16_error(self) -> bool:
        """Four over six's fast error path (the FP16 product against ``fl(x · S_enc)``)."""
        return self.value.endswith("-fp16")


def check_rule_table(table: Mapping[ScaleRule, object], name: str) -> None:
    """Raise unless every :class:`ScaleRule` member has an entry in the implementation table
    ``name`` (each implementation module calls this on its table when imported)."""
    missing = [rule.value for rule in ScaleRule if rule not in table]
    if missing:
        raise NotImplementedError(f"{name} has no entry for the scale rule(s) "
                                  f"{', '.join(missing)}: add one for each")

DEFAULT_SR_BITS = 16
"""Random bits per element that stochastic rounding uses unless told otherwise."""
