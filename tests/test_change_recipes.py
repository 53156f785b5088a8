"""docs/architecture.md's change recipes, done in a test: a change touches only the files the
recipe names, and verify-formats (or the checker the recipe names) checks it with no other
edit, and catches a planted fault. (The scale rules' recipes are
tests/test_verify.py::test_a_new_scale_rule_is_verified_with_no_other_edit and
::test_a_new_real_valued_rule_is_verified_with_no_other_edit; a reader's is
tests/test_readers.py::test_a_new_kind_of_file_is_one_entry_in_the_kinds.)

A registry that other modules derive a table from on import (``FORMATS`` from ``_NAMED``,
``POLICIES`` and ``RECIPE_BY_NAME`` from ``RECIPES``) is patched together with what the import
derives, as the one edited entry would give on a fresh import."""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from typer.testing import CliRunner

from driftcli.arith import policy, recipe_policies, tensorcores
from driftcli.arith.blockfma import FMAUnit
from driftcli.arith.matmulspec import parse_matmul_spec
from driftcli.casts import given, rounding, scalearith
from driftcli.cli import app, measure_cmds
from driftcli.cli.measure_cmds import ScanArgs
from driftcli.io.tables import column
from driftcli.measures.common import Measure, TensorCastRow, ratio
from driftcli.measures.stats import CastStats
from driftcli.records import formats, recipes
from driftcli.records.cast import Cast, ScaleArithmetic, Scaling
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS, Format
from driftcli.records.modes import (
    AmaxPolicy,
    ElementOp,
    Granularity,
    Pow2,
    Rounding,
    ScaleOp,
    ScaleRule,
)
from driftcli.records.presets import preset_names
from driftcli.verify import Plan, check_recipes
from driftcli.verify.compare import Outcome, judge, to_float
from driftcli.verify.driver import element_formats, verify
from driftcli.verify.matmuls import _MatmulOracle, matmul_cases, matmul_fast

runner = CliRunner()

FP6 = FORMATS["float6_e3m2fn"]
ACME = recipes.Implementation("acme", "ACME's kernels", "1.0", "https://example.invalid/acme")


def _add_acme_preset(monkeypatch: pytest.MonkeyPatch) -> str:
    """The recipe's one file, records/recipes.py: an ImplementationPreset in
    IMPLEMENTATION_PRESETS. An MXFP6 (E3M2) cast no implementation preset has, spelled with the
    existing arithmetic settings: amax over finite values, ``fl(amax · fl(1 / 28))``, its scale
    the power of two at or above it read from its bits, elements multiplied by ``2**-k``."""
    arithmetic = ScaleArithmetic(amax=AmaxPolicy.FMAX, scale=ScaleOp.MULRCP, pow2=Pow2.RP,
                                 apply=ElementOp.MUL)
    cast = Cast(FP6, Scaling(Granularity.BLOCK, 32, FORMATS["float8_e8m0fnu"], ScaleRule.CEIL,
                             arithmetic=arithmetic))
    name = "acme/mxfp6_e3m2"
    monkeypatch.setitem(recipes.IMPLEMENTATION_PRESETS, name, recipes.ImplementationPreset(
        name, cast, "MXFP6 E3M2, E8M0 = cvt.rp(fl(amax · fl(1 / 28)))", ACME,
        "acme/quantize.cu quantize_mx", "mxfp6_e3m2_ceil"))
    return name


def _acme_outcomes() -> list[tuple[str, int, int]]:
    """verify-formats' recipes suite on the element format, as the full run calls it: (check,
    values checked, failures) of the new preset's rows."""
    return [(o.operation, o.n_checked, o.n_failed) for o in check_recipes(FP6, Plan(quick=True))
            if o.operation.startswith("acme/")]


def test_a_new_implementation_preset_is_verified_with_no_other_edit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the one entry, the grammar reads the name, the preset tables list it, and
    verify-formats' recipes suite checks its values and codes against the exact op sequence:
    clean as written; with the fast scales one binade low (a fault planted where
    casts/given.py reads casts/scalearith.py's scales), its cells fail."""
    name = _add_acme_preset(monkeypatch)
    assert parse_cast(name) == recipes.IMPLEMENTATION_PRESETS[name].cast
    assert name in preset_names()
    honest = _acme_outcomes()
    # docs/architecture.md shows these counts: the quick plan's cases are seeded, and casts are
    # drift's own roundings, the same bits on either back-end and any CPU
    assert honest == [(f"{name} value", 384, 0), (f"{name} code", 384, 0)]

    honest_scales = given.arith_scales

    def one_binade_high(*args: Any) -> scalearith.ArithScales:
        out = honest_scales(*args)
        return scalearith.ArithScales(out.apply * 2, out.undo / 2, out.scale / 2, out.clamped,
                                      out.tensor_scale, out.apply_op, out.undo_op)

    monkeypatch.setattr(given, "arith_scales", one_binade_high)
    planted = _acme_outcomes()
    assert planted == [(f"{name} value", 384, 320), (f"{name} code", 384, 320)]


# --- a new element format: 1 file ----------------------------------------------------------

E3M3 = Format("float7_e3m3fn", 3, 3, 3)
"""A throwaway element format no registry has: 7 bits, E3M3, no infinities or NaN (as FP6's)."""


def _add_e3m3(monkeypatch: pytest.MonkeyPatch) -> Format:
    """The recipe's one file, records/formats.py: an entry in ``_NAMED``. ``FORMATS`` is built
    from ``_NAMED`` on import; its table is filled again here, in place, as a fresh import
    would (every module holds the same ``FORMATS``)."""
    named = (*formats._NAMED, E3M3)
    monkeypatch.setattr(formats, "_NAMED", named)
    monkeypatch.setattr(FORMATS, "_named", {f.name: f for f in named})
    return E3M3


def _verified(fmt: Format) -> list[tuple[str, str, str, int, int]]:
    """verify-formats' quick plan on ``fmt``, in this process: (check, operation, rounding,
    values checked, failures) of every cell."""
    return [(o.check, o.operation, o.rounding, o.n_checked, o.n_failed)
            for o in verify([fmt], Plan(quick=True))]


def test_a_new_element_format_is_verified_with_no_other_edit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the one entry, the spec grammar and ``drift formats`` know it, verify-formats
    runs every suite on it (a full run loops over the registry) and agrees with the oracle on
    every cell; with the fast rounding taking ties away from zero where ties to even is asked
    (a fault planted in casts/rounding for this format only), the ties-to-even cells fail."""
    fmt = _add_e3m3(monkeypatch)
    assert fmt in element_formats()
    assert parse_cast("float7_e3m3fn:block32:float8_e8m0fnu:ceil").format is fmt
    listed = {r["name"]: r for r in json.loads(runner.invoke(app, ["formats", "--json"]).stdout)}
    assert (listed[fmt.name]["bits"], listed[fmt.name]["max"]) == (7, "30")
    honest = _verified(fmt)
    # docs/architecture.md shows these counts: the quick plan's inputs are seeded and every
    # comparison is of drift's own roundings, the same bits on either back-end and any CPU
    assert (len(honest), sum(c[3] for c in honest), sum(c[4] for c in honest)) == (53, 167_146, 0)
    assert {c[0] for c in honest} == {"codes", "pairs (sampled pairs)", "float32-inputs",
                                      "blocks", "block scales"}

    real, target = rounding._run, rounding.Target.of(fmt)

    def ties_away(*args: Any, tgt: rounding.Target, rounding: Rounding, **kw: Any) -> Any:
        wrong = Rounding.RNA if tgt == target and rounding is Rounding.RNE else rounding
        return real(*args, tgt=tgt, rounding=wrong, **kw)

    monkeypatch.setattr(rounding, "_run", ties_away)
    failing = [(c[0], c[1], c[2], c[4]) for c in _verified(fmt) if c[4]]
    assert failing == [
        ("pairs (sampled pairs)", "product", "rne", 45),
        ("pairs (sampled pairs)", "product", "rne", 45),  # saturate, then ieee
        ("pairs (sampled pairs)", "sum", "rne", 125),
        ("pairs (sampled pairs)", "sum", "rne", 125),
        ("float32-inputs", "cast", "rne", 64),
        ("float32-inputs", "cast", "rne", 64)]


# --- a new tensor-core unit: 1 file --------------------------------------------------------

ACME_CORE = "acme_e4m3_f32"


def _add_acme_core(monkeypatch: pytest.MonkeyPatch) -> tensorcores.TensorCore:
    """The recipe's one file, arith/tensorcores.py: a ``put`` in ``_cores``, that is, one
    entry of ``CORES``. A hypothetical FP8 unit as Hopper's but keeping 12 bits, not 13."""
    core = tensorcores.TensorCore("float8_e4m3fn", FMAUnit(32, 12, -133), "e8m12", Rounding.RTZ,
                                  "acme (a throwaway unit)")
    monkeypatch.setitem(tensorcores.CORES, ACME_CORE, core)
    return core


def _tc_outcome(name: str) -> tuple[int, int]:
    """``tc=name`` on the full plan's matmul cases against the oracle's block-FMA dot products,
    as verify-formats judges its block-FMA cells: (values checked, failures)."""
    spec = parse_matmul_spec(f"tc={name}")
    out = Outcome(spec.accumulator.name, "matmul", str(spec), spec.acc_rounding.value, "ieee")
    ref = _MatmulOracle()
    for case in matmul_cases(Plan()):
        expected = torch.tensor([to_float(v) for v in ref.result(case, spec)],
                                dtype=torch.float64)
        judge(out, expected, matmul_fast(case.a, case.b, spec).flatten(), str)
    return out.n_checked, out.n_failed


def test_a_new_tensor_core_unit_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the one entry, ``tc=NAME`` expands to the unit, ``drift formats --tensor-cores``
    lists it, and its matmuls agree with the exact block-FMA twin on every value; with the
    fast block-FMA keeping one bit more than the unit says (a planted fault where
    arith/matmul calls arith/blockfma), they do not."""
    core = _add_acme_core(monkeypatch)
    spec = parse_matmul_spec(f"tc={ACME_CORE}")
    assert (spec.unit, spec.accumulator.name, spec.acc_rounding) == (core.unit, "e8m12",
                                                                     Rounding.RTZ)
    res = runner.invoke(app, ["formats", "--tensor-cores", "--json"])
    assert res.exit_code == 0, res.output
    listed = {r["preset"]: r for r in json.loads(res.stdout)}
    assert (listed[ACME_CORE]["kept_bits"], listed[ACME_CORE]["result"]) == (12, "e8m12")
    # exact on either back-end and any CPU (integer block-FMA against the Fraction oracle)
    assert _tc_outcome(ACME_CORE) == (82, 0)
    # its own unit: a bit fewer than Hopper's changes 42 of the 82 results
    hopper = parse_matmul_spec("tc=h100_e4m3_f32")
    assert sum(int((matmul_fast(c.a, c.b, spec) != matmul_fast(c.a, c.b, hopper)).sum())
               for c in matmul_cases(Plan())) == 42

    matmul_mod = importlib.import_module("driftcli.arith.matmul")
    honest_dot = matmul_mod.fma_dot

    def one_bit_more(a: torch.Tensor, b: torch.Tensor, how: Any, **kw: Any) -> torch.Tensor:
        wider = dataclasses.replace(how.unit, kept_bits=how.unit.kept_bits + 1)
        return honest_dot(a, b, dataclasses.replace(how, unit=wider), **kw)

    monkeypatch.setattr(matmul_mod, "fma_dot", one_bit_more)
    assert _tc_outcome(ACME_CORE) == (82, 38)


# --- a new recipe policy: 1 file -----------------------------------------------------------

ACME_RECIPE = recipe_policies.RecipeEntry(
    "acme/mxfp6_recipe",
    "a throwaway recipe: MXFP6 E3M2 on every operand, each cast from the high-precision tensor",
    dict.fromkeys(recipe_policies.SLOTS, "mxfp6_e3m2"), "recast",
    "acme/recipe.py lines 1-10 (a throwaway source)", keep_matmuls=("attention",))
ACME_COSINE = 0.9952
"""grad-cosine's cosine over every parameter of tests/test_grad_cosine.tiny_case under it."""


def _add_recipe(monkeypatch: pytest.MonkeyPatch,
                entry: recipe_policies.RecipeEntry = ACME_RECIPE) -> None:
    """The recipe's one file, arith/recipe_policies.py: a ``RecipeEntry`` in ``RECIPES``;
    ``RECIPE_BY_NAME`` and ``arith/policy.POLICIES`` derive from it on import."""
    monkeypatch.setattr(recipe_policies, "RECIPES", (*recipe_policies.RECIPES, entry))
    monkeypatch.setitem(recipe_policies.RECIPE_BY_NAME, entry.name, entry)
    monkeypatch.setitem(policy.POLICIES, entry.name, (policy.recipe_policy(entry), entry.meaning))


def test_a_new_recipe_policy_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the one entry, the checker passes the table, ``drift formats --policies`` lists it
    and grad-cosine runs it by name; MXFP6 keeps less of the gradient than MXFP8. The checker
    catches the entry written wrong (X rounded stochastically)."""
    from test_grad_cosine import tiny_case, tiny_logits

    from driftcli.measures.grad_cosine import ALL_PARAMETERS, grad_cosine
    from driftcli.models.loaders import next_token_loss

    _add_recipe(monkeypatch)
    assert recipe_policies.check_recipes(recipe_policies.RECIPES) == []
    res = runner.invoke(app, ["formats", "--policies", "--json"])
    assert res.exit_code == 0, res.output
    listed = {r["preset"]: r for r in json.loads(res.stdout)}
    assert listed[ACME_RECIPE.name]["roles"]["wgrad"] == {"lhs": "mxfp6_e3m2", "rhs": "mxfp6_e3m2"}
    mine = policy.get_policy(ACME_RECIPE.name)
    assert mine.forward is not None and str(mine.forward.lhs) == str(parse_cast("mxfp6_e3m2"))

    model, ids = tiny_case()
    rows = grad_cosine(model, ids, next_token_loss(tiny_logits),
                       ["exact", ACME_RECIPE.name, "te/mxfp8_recipe"])
    cosine = {r.policy: r.cosine for r in rows if r.parameter == ALL_PARAMETERS}
    # torch's float32 matmuls may sum in another order on another CPU: the figures are
    # compared to 5e-4 (as tests/test_recipe_policies.py's COSINES), the order exactly
    assert cosine[ACME_RECIPE.name] == pytest.approx(ACME_COSINE, abs=5e-4)
    assert cosine[ACME_RECIPE.name] < cosine["te/mxfp8_recipe"] < 1

    wrong = dataclasses.replace(
        ACME_RECIPE, casts={**ACME_RECIPE.casts, "forward.lhs": "mxfp6_e3m2:sr"})
    assert recipe_policies.check_recipes((*recipe_policies.RECIPES, wrong)) == [
        f"recipe policy {ACME_RECIPE.name!r} is given twice",
        f"{ACME_RECIPE.name}: forward.lhs (X) rounds stochastically; the recipes round only "
        "the gradient dY so"]


# --- a new measurement subcommand: 5 files (1 new) -----------------------------------------

@dataclass(frozen=True)
class NonfiniteRateRow(TensorCastRow):
    """The new module's row type (``measures/nonfinite_rate.py``): NaN and inf elements."""

    TABLE: ClassVar[str] = "nonfinite-rate"
    KEYS: ClassVar[tuple[str, ...]] = ("source", "tensor", "cast")
    HEADLINE: ClassVar[str] = "nonfinite_rate"
    HIGHER_IS_WORSE: ClassVar[bool] = True

    nonfinite_rate: float | None = column("NaN or infinite input elements / elements")
    nonfinite: int | None = column("NaN or infinite input elements")


def _nonfinite_columns(draws: tuple[CastStats, ...], expected: CastStats | None
                       ) -> dict[str, Any]:
    st = draws[0]
    return {"nonfinite_rate": ratio(st.nonfinite, st.numel), "nonfinite": st.nonfinite}


def nonfinite_rate(args: ScanArgs) -> None:
    """Share of elements that are NaN or infinite, per cast."""
    measure_cmds._run(NonfiniteRateRow.TABLE, args)


def _add_measurement(monkeypatch: pytest.MonkeyPatch, in_section: bool = True) -> None:
    """The recipe's five files: the module (above), its ``Measure`` in
    ``measures/__init__.MEASURES``, its row type in ``report/load.ROW_TYPES``, its command in
    ``cli/measure_cmds.py`` (one ``_run`` call) and its place in ``cli/app.SECTIONS`` (which
    ``driftcli.cli`` re-exports; ``in_section=False`` leaves it out: the planted fault)."""
    from driftcli import cli
    from driftcli.measures import MEASURES
    from driftcli.report import load

    name = NonfiniteRateRow.TABLE
    monkeypatch.setitem(MEASURES, name, Measure(name, NonfiniteRateRow, _nonfinite_columns))
    monkeypatch.setitem(load.ROW_TYPES, name, f"{__name__}:NonfiniteRateRow")
    load.row_types.cache_clear()
    monkeypatch.setattr(app, "registered_commands", list(app.registered_commands))
    measure_cmds.scan_command(name)(nonfinite_rate)
    if in_section:
        sections = tuple((title, (*names, name) if title == "Measure" else names)
                         for title, names in cli.SECTIONS)
        for module in (cli, importlib.import_module("driftcli.cli.app")):
            monkeypatch.setattr(module, "SECTIONS", sections)


@pytest.fixture
def fresh_row_types() -> Any:
    from driftcli.report import load

    yield
    load.row_types.cache_clear()  # the registry as it was, after the monkeypatch undoes it


def test_a_new_measurement_is_five_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         fresh_row_types: None) -> None:
    """With the five, ``drift nonfinite-rate`` scans a checkpoint into its table, ``drift
    report --fail-on`` gates on its headline and ``drift --help`` lists it under Measure; left
    out of ``SECTIONS``, the command lands under "Other" and the help test fails."""
    from safetensors.torch import save_file
    from test_cli import test_help_groups_every_command_once_in_sections as grouped

    from driftcli.io.tables import read_table

    w = torch.linspace(-3, 3, 4096).reshape(64, 64)
    w[0, :5], w[1, 0] = float("nan"), float("inf")
    save_file({"w": w, "b": torch.ones(64)}, tmp_path / "m.safetensors")
    _add_measurement(monkeypatch)
    res = runner.invoke(app, ["nonfinite-rate", str(tmp_path / "m.safetensors"), "-c", "nvfp4",
                              "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    df, _ = read_table(tmp_path / "out" / "nonfinite-rate.parquet")
    got = {t: (n, r) for t, n, r in zip(df.tensor, df.nonfinite, df.nonfinite_rate, strict=True)}
    assert got == {"w": (6, 6 / 4096), "b": (0, 0.0), "*": (6, 6 / 4160)}
    gate = runner.invoke(app, ["report", str(tmp_path / "out"), "--fail-on",
                               "nonfinite_rate > 0.001"])
    assert gate.exit_code == 1 and "FAIL nonfinite_rate > 0.001: 2 row(s)" in gate.output
    grouped()

    monkeypatch.undo()
    _add_measurement(monkeypatch, in_section=False)
    with pytest.raises(AssertionError):
        grouped()


# --- a new pre-quantized layout, as a family module of its own: 3 files (1 new) ------------

def _add_layout_member(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> Any:
    """A member of io/layouts.Layout, as a line there would give (enums take no new members
    once built, so the member maps are patched, as tests/test_verify.py's ``_add_rule``
    does; undone after the test)."""
    from driftcli.io.layouts import Layout

    member = str.__new__(Layout, value)
    member._value_, member._name_ = value, name
    member.__objclass__ = Layout  # type: ignore[misc]
    monkeypatch.setitem(Layout._member_map_, name, member)
    monkeypatch.setitem(Layout._value2member_map_, value, member)
    monkeypatch.setattr(Layout, "_member_names_", [*Layout._member_names_, name])
    return member


def _acme_family(layout: Any) -> Any:
    """The new module's ``FAMILY``: FP8 codes ``*.weight`` beside ``*.weight_scale16``, E8M0
    bytes, one per 16 elements of a row (a layout no family reads)."""
    from driftcli.io.readers.quantized_weight import Family, QuantSpec

    suffix = "_scale16"

    def claims(by_name: dict[str, Any], unreadable: set[str]) -> dict[str, set[Any]]:
        return {n.removesuffix(suffix): {layout} for n in [*by_name, *unreadable]
                if n.endswith(".weight" + suffix)}

    def build(lay: Any, stem: str, by_name: dict[str, Any], config: Any) -> QuantSpec | str:
        codes, scale = by_name.get(stem), by_name.get(stem + suffix)
        if codes is None or scale is None:
            return f"weight {stem} needs {stem} and {stem + suffix}"
        return QuantSpec(stem, lay, codes.dtype, codes.shape, codes, False, scale, "e8m0",
                         (1, 16), pow2_declared=True)

    return Family((layout,), claims, build, lambda lay, stem: (stem, stem + suffix))


def test_a_new_layout_family_is_three_entries(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """A layout whose tensors no family claims is a ``Layout`` member, its family module and
    one entry in ``io/readers/quantized.FAMILIES``: the listing then shows one weight of that
    layout in place of its two stored tensors, read as each code times its block's scale,
    and ``drift inspect`` names its layout and block. No checker stands behind a family's
    word on its blocks: the values are compared with the product made by hand, which a family
    with the wrong blocks fails."""
    from safetensors.torch import save_file

    from driftcli.io.readers import quantized
    from driftcli.io.readers.collect import open_inputs
    from driftcli.io.readers.quantized_weight import spec_of

    layout = _add_layout_member(monkeypatch, "ACME_FP8_16", "acme-fp8-16")
    monkeypatch.setattr(quantized, "FAMILIES", (*quantized.FAMILIES, _acme_family(layout)))
    codes = torch.linspace(-6, 6, 4 * 64).reshape(4, 64).to(torch.float8_e4m3fn)
    exps = torch.tensor([127, 130, 120, 127], dtype=torch.uint8).repeat(4, 1)  # 1, 8, 2^-7, 1
    path = tmp_path / "acme.safetensors"
    save_file({"l.weight": codes, "l.weight_scale16": exps, "n.weight": torch.ones(3)}, path)

    listed = {t.name: t for t in open_inputs([path]).tensors}
    assert sorted(listed) == ["l.weight", "n.weight"]
    spec = spec_of(listed["l.weight"])
    assert spec is not None and (spec.layout, spec.block) == (layout, (1, 16))
    by_hand = codes.float() * torch.exp2(exps.float() - 127).repeat_interleave(16, dim=1)
    assert torch.equal(listed["l.weight"].read(), by_hand)
    res = runner.invoke(app, ["inspect", str(path), "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    row = next(r for r in json.loads(res.stdout)["rows"] if r["tensor"] == "l.weight")
    assert (row["layout"], row["block"]) == ("acme-fp8-16", "1x16")

    # the planted fault: the family's blocks one scale per 32, not 16; read without an error
    # (the generic reader does not check that the scales cover the weight), the values differ
    honest = _acme_family(layout)

    def wide_blocks(*args: Any) -> Any:
        return dataclasses.replace(honest.build(*args), block=(1, 32))

    monkeypatch.setattr(quantized, "FAMILIES", (*quantized.FAMILIES[:-1],
                                                dataclasses.replace(honest, build=wide_blocks)))
    wrong = {t.name: t for t in open_inputs([path]).tensors}["l.weight"].read()
    assert not torch.equal(wrong, by_hand)
