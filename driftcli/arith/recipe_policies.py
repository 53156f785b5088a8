"""Recipe policies: whole training recipes (Transformer Engine's, torchao's, DeepSeek-V3's and
the hybrid ones of Transformer Engine's quantizer zoo) as arithmetic policy presets.

A recipe is more than a cast: it names a cast for each operand of each of a linear map's three
matmuls, stochastic rounding where it has it, what the backward reads for the forward's
operands, the accumulation, and which matmuls stay in high precision. :data:`RECIPES` holds one
:class:`RecipeEntry` per recipe, data only, each with the source lines it was read from;
:mod:`driftcli.arith.policy` turns every entry into an
:class:`~driftcli.arith.policy.ArithmeticPolicy` under its name (``--policy te/nvfp4_recipe``).

The operands of each role (docs/arithmetic.md#roles): ``forward`` multiplies X (lhs) by Wᵀ
(rhs), ``dgrad`` dY (lhs) by W (rhs), ``wgrad`` Xᵀ (lhs) by dY (rhs). A slot's cast is an
implementation preset (``te/nvfp4``, with ``:sr`` for stochastic rounding) or ``none``: the
operand enters in the model's own precision.

The random Hadamard transform (RHT) some recipes apply to the wgrad's operands is part of
those slots' casts (``te/nvfp4:rht=te``, :class:`~driftcli.records.cast.Rht`): both operands of the
wgrad carry it along the contraction (token) axis, so the transform cancels in the product
and only its effect on the casts remains, as on the GPU. Where drift cannot spell a recipe's
choice, :attr:`RecipeEntry.departures` says what differs. docs/recipes.md#recipe-policies
has the table with its sources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from driftcli.errors import DriftError
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Rounding

TE_COMMIT = "d0067d0da6cb01811b8072a7d304f0e00344ce2b"
"""The Transformer Engine commit every ``te/…`` entry was read at (as the ``te/…`` presets)."""
TORCHAO_VERSION = "0.18.0"
"""The torchao release every ``torchao/…`` entry was read from (the installed package)."""
DEEPSEEK_REPORT = "DeepSeek-V3 technical report, arXiv 2412.19437v2"

SLOTS: tuple[str, ...] = ("forward.lhs", "forward.rhs", "dgrad.lhs", "dgrad.rhs", "wgrad.lhs",
                          "wgrad.rhs")
"""Every operand slot of a training step, in order."""
OPERANDS: dict[str, str] = {"forward.lhs": "X", "forward.rhs": "Wᵀ", "dgrad.lhs": "dY",
                            "dgrad.rhs": "W", "wgrad.lhs": "Xᵀ", "wgrad.rhs": "dY"}
"""What each slot multiplies, for a linear map ``Y = X·Wᵀ``."""
GRADIENT_SLOTS: tuple[str, ...] = ("dgrad.lhs", "wgrad.rhs")
"""The slots holding the output gradient dY (the only tensor the forward does not make)."""
NONE = "none"
"""A slot given as this string is not cast: the operand in the model's own precision."""
BACKWARD_COPIES: tuple[str, str] = ("wgrad.lhs", "dgrad.rhs")
"""The slots reading the backward's copy of X and of W (the forward's left and right operand)."""
SOURCE_STATES: dict[str, str] = {"original": "recast", "forward-cast": "saved-cast"}
"""A per-operand source (Transformer Engine's ``columnwise_source``: ``original``,
``rowwise_dequantized``) as a backward state."""


@dataclass(frozen=True)
class RecipeEntry:
    """One recipe as an arithmetic policy: a cast per operand slot, and the rest of the recipe.

    Casts are written as cast specs (implementation presets, with ``:sr`` where the recipe
    rounds stochastically) or :data:`NONE`; a role whose two slots are both ``none`` runs as
    the plain torch op."""

    name: str
    """The policy's name (``te/nvfp4_recipe``)."""
    meaning: str
    """One line: what the recipe is."""
    casts: dict[str, str]
    """The cast of every slot of :data:`SLOTS`."""
    backward_state: str
    """What the backward reads for X and W (a :class:`~driftcli.arith.policy.BackwardState`
    value): ``recast`` where the recipe quantizes the backward's copies from the original
    high-precision tensor, ``saved-cast`` where it quantizes them from the forward's dequantized
    values."""
    source: str
    """The files, lines and commit (or report section) each setting was read from."""
    acc: str = "float32"
    """The accumulator, as a matmul spec's ``acc``."""
    order: str = "native"
    """The accumulation order, as a matmul spec's ``order``."""
    tc: str = ""
    """A tensor-core preset for every role's accumulation (empty: none)."""
    keep_matmuls: tuple[str, ...] = ()
    """Matmul kinds the recipe leaves in high precision (``attention``)."""
    keep_high_precision: tuple[str, ...] = ()
    """Module-name regexes the recipe leaves in high precision."""
    departures: str = ""
    """Where the policy is not the recipe (empty: nowhere)."""
    sources_by_operand: dict[str, str] = field(default_factory=dict)
    """Where the backward's copy of X (``wgrad.lhs``) and W (``dgrad.rhs``) is quantized from,
    per operand, where the recipe says it per operand: ``original`` (the policy's ``recast``)
    or ``forward-cast`` (``saved-cast``); the policy follows it operand by operand."""

    @property
    def operand_states(self) -> tuple[str, str]:
        """The backward state of X (the forward's left operand) and of W (its right one):
        :attr:`sources_by_operand` where it names the operand, else :attr:`backward_state`."""
        def state(slot: str) -> str:
            given = self.sources_by_operand.get(slot)
            return self.backward_state if given is None else SOURCE_STATES.get(given, given)

        return state(BACKWARD_COPIES[0]), state(BACKWARD_COPIES[1])

    @property
    def rht(self) -> tuple[str, ...]:
        """The slots whose cast applies a random Hadamard transform first (``:rht=…``)."""
        return tuple(s for s in SLOTS if self.casts[s] != NONE
                     and parse_cast(self.casts[s]).rht is not None)

    def role_casts(self, role: str) -> tuple[str, str]:
        """The (lhs, rhs) casts of ``role`` (``forward``, ``dgrad``, ``wgrad``)."""
        return self.casts[f"{role}.lhs"], self.casts[f"{role}.rhs"]


# --- the table ----------------------------------------------------------------------------------

_AT = f" at {TE_COMMIT[:7]}"
_TE_RECIPE = "transformer_engine/common/recipe/__init__.py" + _AT
_TE_FACTORIES = "transformer_engine/pytorch/custom_recipes/quantizer_factories.py" + _AT
_TE_ZOO = "transformer_engine/pytorch/custom_recipes/quantizer_factory_zoo.py" + _AT
_TORCHAO = f"torchao {TORCHAO_VERSION} torchao/prototype/moe_training"
_RHT_WGRAD = ("wgrad.lhs", "wgrad.rhs")
_RHT = ":rht=te"
"""The transform with Transformer Engine's fixed wgrad sign vector (docs/recipes.md, "The
random Hadamard transform")."""
_ATTENTION = ("attention",)


def _uniform(cast: str) -> dict[str, str]:
    return dict.fromkeys(SLOTS, cast)


def _slots(x: str, w: str, dy: str, *, w_dgrad: str | None = None,
           x_wgrad: str | None = None, dy_wgrad: str | None = None) -> dict[str, str]:
    """The six slots from the cast of X, W and dY (with a backward copy's own cast where it
    differs)."""
    return {"forward.lhs": x, "forward.rhs": w, "dgrad.lhs": dy,
            "dgrad.rhs": w if w_dgrad is None else w_dgrad,
            "wgrad.lhs": x if x_wgrad is None else x_wgrad,
            "wgrad.rhs": dy if dy_wgrad is None else dy_wgrad}


RECIPES: tuple[RecipeEntry, ...] = (
    RecipeEntry(
        "te/nvfp4_recipe",
        "Transformer Engine's NVFP4BlockScaling: 16 x 16 NVFP4 weights, 1 x 16 activations and "
        "gradients, SR on gradients, RHT on the wgrad operands, attention unquantized",
        _slots("te/nvfp4", "te/nvfp4_2d", "te/nvfp4:sr", x_wgrad="te/nvfp4" + _RHT,
               dy_wgrad="te/nvfp4:sr" + _RHT),
        "recast",
        f"{_TE_RECIPE} NVFP4BlockScaling lines 499-518 (both directions from the high-precision "
        "input; 2-D weights, SR on gradients, RHT), 571-573 (attention not quantized), 592-609 "
        "(QParams: RHT on inputs and gradients, 'only applied to column-wise usage so that it "
        f"can be used for wgrad GEMM'); {_TE_FACTORIES} nvfp4_factory lines 140-192",
        keep_matmuls=_ATTENTION),
    RecipeEntry(
        "te/mxfp8_recipe",
        "Transformer Engine's MXFP8BlockScaling: E4M3 in 1 x 32 blocks on every operand, each "
        "direction cast from the high-precision tensor, attention unquantized",
        _uniform("te/mxfp8"),
        "recast",
        f"{_TE_RECIPE} MXFP8BlockScaling lines 336-373 (E4M3 by default, line 369; both "
        "directions from the high-precision input, lines 346-352; fp8_dpa False, line 370); "
        f"{_TE_FACTORIES} mxfp8_factory lines 125-137",
        keep_matmuls=_ATTENTION),
    RecipeEntry(
        "te/fp8_block_recipe",
        "Transformer Engine's Float8BlockScaling: E4M3, 1 x 128 blocks for inputs and "
        "gradients, 128 x 128 tiles for weights, power-of-two scales, attention unquantized",
        _slots("te/float8_block", "te/float8_block_weight", "te/float8_block"),
        "recast",
        f"{_TE_RECIPE} Float8BlockScaling lines 391-443 (both directions from the "
        "high-precision input, lines 401-406; E4M3, line 431; power-of-two scales, lines "
        "429-434; 1-D x and grad, 2-D w, lines 435-437; split accumulator, lines 411-415 and "
        f"438-440; no FP8 attention, lines 461-463); {_TE_FACTORIES} "
        "float8_block_scaling_factory lines 95-122",
        keep_matmuls=_ATTENTION,
        departures="split accumulation (partial sums promoted to float32 on the GPU) is "
                   "modelled as float32 accumulation in torch's order"),
    RecipeEntry(
        "te/mxfp8_fwd_nvfp4_bwd",
        "Transformer Engine's quantizer zoo: MXFP8 forward, NVFP4 backward (the dgrad's W a "
        "plain 1 x 16 NVFP4 cast of the dequantized MXFP8 weight, SR and RHT as the NVFP4 "
        "recipe's)",
        _slots("te/mxfp8", "te/mxfp8", "te/nvfp4:sr", w_dgrad="te/nvfp4",
               x_wgrad="te/nvfp4" + _RHT, dy_wgrad="te/nvfp4:sr" + _RHT),
        "recast",
        f"{_TE_ZOO} mxfp8_fwd_nvfp4_bwd_factory lines 120-158, _plain_nvfp4_quantizer lines "
        f"106-117; {_TE_FACTORIES} nvfp4_factory lines 140-192, mxfp8_factory lines 125-137",
        keep_matmuls=_ATTENTION,
        # the dgrad's W from the dequantized MXFP8 weight (columnwise_source=
        # 'rowwise_dequantized', lines 150-155), the wgrad's X from the original input
        # (columnwise_source='original', lines 144-149)
        sources_by_operand={"wgrad.lhs": "original", "dgrad.rhs": "forward-cast"}),
    RecipeEntry(
        "te/nvfp4_row_fwd_mxfp8_bwd",
        "Transformer Engine's quantizer zoo: row-scaled NVFP4 activations and plain NVFP4 "
        "weights forward, MXFP8 backward cast from the forward's dequantized values",
        _slots("te/nvfp4_row", "te/nvfp4", "te/mxfp8", w_dgrad="te/mxfp8",
               x_wgrad="te/mxfp8"),
        "saved-cast",
        f"{_TE_ZOO} nvfp4_row_scaled_fwd_mxfp8_bwd_factory lines 238-296 (GroupedLinear "
        "roles; plain Linear layers get MXFP8 throughout, lines 294-296), "
        f"_plain_nvfp4_quantizer lines 106-117; {_TE_FACTORIES} mxfp8_factory lines 125-137",
        keep_matmuls=_ATTENTION,
        sources_by_operand={"wgrad.lhs": "forward-cast", "dgrad.rhs": "forward-cast"},
        departures="the recipe applies this split to GroupedLinear (MoE expert) layers only "
                   "and MXFP8 to plain Linear layers; drift has no grouped linear, so every "
                   "linear map takes the GroupedLinear split"),
    RecipeEntry(
        "te/hp_fwd_mxfp8_bwd",
        "Transformer Engine's quantizer zoo: high-precision forward, MXFP8 backward (each "
        "operand cast from its high-precision tensor)",
        {**_uniform("te/mxfp8"), "forward.lhs": NONE, "forward.rhs": NONE},
        "recast",
        f"{_TE_ZOO} high_precision_fwd_mxfp8_bwd_factory lines 83-103 (HybridQuantizer's "
        f"columnwise_source defaults to 'original'); {_TE_FACTORIES} mxfp8_factory lines "
        "125-137",
        keep_matmuls=_ATTENTION),
    RecipeEntry(
        "torchao/mxfp8_recipe",
        "torchao's MXFP8 training (MXFP8TrainingRecipe.MXFP8_RCEIL): E4M3, 1 x 32 blocks, "
        "RCEIL scales on every operand, each direction cast from the high-precision tensor",
        _uniform("torchao/mxfp8_rceil"),
        "recast",
        f"{_TORCHAO}/config.py MXFP8TrainingOpConfig lines 139-186 (scale_calculation_mode "
        "RCEIL, line 168; wgrad_with_hp False, line 165); mxfp8_linear.py mx_mm lines 84-255 "
        "(E4M3 for input, weight and grad_output, lines 61-64; weight and grad_output cast "
        "along dim1 from the saved high-precision tensors, lines 146-255)",
        keep_matmuls=_ATTENTION,
        departures="torchao/mxfp8_rceil is torchao's eager RCEIL (float32 log2, the "
                   "EMULATED kernel preference); the CUDA and Triton kernels of the AUTO "
                   "preference round the scale up on the quotient's bits, as te/mxfp8 does"),
    RecipeEntry(
        "torchao/nvfp4_recipe",
        "torchao's NVFP4 training (nvfp4_linear): 16 x 16 weights, 1 x 16 activations and "
        "gradients, SR on gradients, RHT on the wgrad operands",
        _slots("torchao/nvfp4", "float4_e2m1fn:tile16:float8_e4m3fn:two-level:rne:saturate:"
               "amax=ieee,two=torchao", "torchao/nvfp4:sr", x_wgrad="torchao/nvfp4" + _RHT,
               dy_wgrad="torchao/nvfp4:sr" + _RHT),
        "recast",
        f"{_TORCHAO}/nvfp4_training/nvfp4_linear.py nvfp4_mm_triton lines 57-237 (forward: "
        "rowwise X without SR, 2-D weights, lines 103-123; backward: dY rowwise with SR for "
        "the dgrad, columnwise RHT and SR for the wgrad, lines 176-229; X's columnwise RHT copy "
        "quantized from the input in the forward, lines 107-113); "
        "hadamard_quantize_row_col_triton.py triton_rht_quantize_row_col lines 243-250 (RHT on "
        "the columnwise output only)",
        keep_matmuls=_ATTENTION,
        departures="the training kernels compute NVFP4 scales in their own order "
                   "(nvfp4_training/hadamard_utils.py _nvfp4_quantize lines 238-257: S_enc = "
                   "min(2688 / amax, max), sb = clamp(fl(fl(amax_b / 6) · S_enc), 2^-6, 448), "
                   "x · min(fl(1 / fl(sb · S_dec)), max)), which no drift preset spells; the "
                   "policy uses torchao's eager cast (torchao/nvfp4, its order on 16 x 16 tiles "
                   "for weights); torchao runs it on bfloat16 operands only. The RHT's signs "
                   "are Transformer Engine's fixed vector (torchao's tensor-parallel "
                   "_TP_RHT_SIGN_VECTOR); a layer's own _rht_sign_vector can be given as "
                   "rht=signs/… in a policy file"),
    RecipeEntry(
        "deepseek/v3_recipe",
        "DeepSeek-V3's FP8 training: E4M3 everywhere, 1 x 128 activation and gradient "
        "blocks, 128 x 128 weight tiles, promotion to float32 every 128 products",
        _slots("deepseek/v3", "deepseek/v3_weight", "deepseek/v3"),
        "saved-cast",
        f"{DEEPSEEK_REPORT} section 3.3.1 (the three GEMMs of a linear map in FP8; embedding, "
        "output head, MoE gating, normalization and attention kept in BF16/FP32), 3.3.2 (1 x 128 "
        "tiles for activations, 128 x 128 blocks for weights, E4M3 on all tensors, promotion "
        "to FP32 every N_C = 128 elements, about 14 bits kept by the tensor cores), 3.5.2 (the "
        "backward's activations read, dequantized, transposed and re-quantized into 128 x 1 "
        "tiles); casts as deepseek-ai/DeepSeek-V3 9b4e978 inference/kernel.py and "
        "deepseek-ai/DeepGEMM 54e2261 deep_gemm/utils/math.py",
        tc="h100_e4m3_f32", order="blockfma:128",
        keep_matmuls=_ATTENTION, keep_high_precision=(r"(^|\.)lm_head$", r"(^|\.)gate$"),
        departures="the tensor cores are modelled by tc=h100_e4m3_f32 (13 bits kept, as "
                   "drift's H100 recordings say; the report says about 14); the output head "
                   "and MoE gates are kept by name (lm_head, a module named gate)"),
)
"""Every recipe policy, in the order ``drift formats --policies`` lists them."""

RECIPE_BY_NAME: dict[str, RecipeEntry] = {r.name: r for r in RECIPES}
"""Every recipe entry by its policy name."""


# --- checks -------------------------------------------------------------------------------------

_CITATION = re.compile(r"lines? \d+")


def check_recipe(entry: RecipeEntry) -> list[str]:
    """The problems of one table entry (empty: none): what every recipe here shares, so that a
    wrong entry is caught before it is a policy.

    - every slot has a cast that parses (or ``none``);
    - stochastic rounding only on the gradient dY (no recipe here rounds X or W stochastically);
    - dY takes one element format in both backward matmuls;
    - RHT only on the wgrad's operands (the recipes apply it to column-wise copies only), and
      the same on both (nothing undoes it: on one side the product would be wrong);
    - the per-operand sources name the backward's copy of X or W, and a source drift has;
    - the source cites lines, or a report's section.
    """
    problems: list[str] = []
    if set(entry.casts) != set(SLOTS):
        missing = sorted(set(SLOTS) - set(entry.casts))
        extra = sorted(set(entry.casts) - set(SLOTS))
        return [f"{entry.name}: slots must be {', '.join(SLOTS)} (missing {missing}, "
                f"unknown {extra})"]
    formats = {}
    transforms: dict[str, tuple[int, ...] | None] = {}
    for slot in SLOTS:
        text = entry.casts[slot]
        if text == NONE:
            continue
        try:
            c = parse_cast(text)
        except DriftError as err:
            problems.append(f"{entry.name}: {slot} cast {text!r} does not parse ({err})")
            continue
        formats[slot] = c.format.name
        transforms[slot] = None if c.rht is None else c.rht.signs
        if c.rounding is Rounding.SR and slot not in GRADIENT_SLOTS:
            problems.append(f"{entry.name}: {slot} ({OPERANDS[slot]}) rounds stochastically; "
                            "the recipes round only the gradient dY so")
    for role in ("forward", "dgrad", "wgrad"):
        lhs, rhs = transforms.get(f"{role}.lhs"), transforms.get(f"{role}.rhs")
        if lhs != rhs:
            problems.append(f"{entry.name}: RHT on one of the {role}'s operands only (or two "
                            "different ones); both need the same, or the product is wrong")
        elif lhs is not None and f"{role}.lhs" not in _RHT_WGRAD:
            problems.append(f"{entry.name}: RHT on the {role}; the recipes apply it to the "
                            "wgrad's operands only")
    grads = {formats[s] for s in GRADIENT_SLOTS if s in formats}
    if len(grads) > 1:
        problems.append(f"{entry.name}: dY takes {sorted(grads)} in the dgrad and the wgrad; "
                        "a recipe casts dY into one element format")
    for slot, given in entry.sources_by_operand.items():
        if slot not in BACKWARD_COPIES or given not in SOURCE_STATES:
            problems.append(f"{entry.name}: sources_by_operand {slot} = {given!r}; give "
                            f"{' or '.join(BACKWARD_COPIES)} as {' or '.join(SOURCE_STATES)}")
    if not (_CITATION.search(entry.source) or "section" in entry.source):
        problems.append(f"{entry.name}: the source cites no lines")
    return problems


def check_recipes(entries: tuple[RecipeEntry, ...] = RECIPES) -> list[str]:
    """The problems of every entry, and of names given twice."""
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    return [f"recipe policy {n!r} is given twice" for n in twice] + \
        [p for e in entries for p in check_recipe(e)]
