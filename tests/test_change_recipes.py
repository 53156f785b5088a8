"""docs/architecture.md's change recipes, done in a test: a change touches only the files the
recipe names, and verify-formats checks it with no other edit. (The scale rules' recipes are
tests/test_verify.py::test_a_new_scale_rule_is_verified_with_no_other_edit and
::test_a_new_real_valued_rule_is_verified_with_no_other_edit; a reader's is
tests/test_readers.py::test_a_new_kind_of_file_is_one_entry_in_the_kinds.)"""

from __future__ import annotations

from typing import Any

import pytest

from driftcli.casts import quantization, scalearith
from driftcli.records import recipes
from driftcli.records.cast import Cast, ScaleArithmetic, Scaling
from driftcli.records.castspec import parse_cast
from driftcli.records.formats import FORMATS
from driftcli.records.modes import AmaxPolicy, ElementOp, Granularity, Pow2, ScaleOp, ScaleRule
from driftcli.records.presets import preset_names
from driftcli.verify import Plan, check_recipes

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
    casts/quantization.py reads casts/scalearith.py's scales), its cells fail."""
    name = _add_acme_preset(monkeypatch)
    assert parse_cast(name) == recipes.IMPLEMENTATION_PRESETS[name].cast
    assert name in preset_names()
    honest = _acme_outcomes()
    # docs/architecture.md shows these counts: the quick plan's cases are seeded, and casts are
    # drift's own roundings, the same bits on either back-end and any CPU
    assert honest == [(f"{name} value", 384, 0), (f"{name} code", 384, 0)]

    honest_scales = quantization.arith_scales

    def one_binade_high(*args: Any) -> scalearith.ArithScales:
        out = honest_scales(*args)
        return scalearith.ArithScales(out.apply * 2, out.undo / 2, out.scale / 2, out.clamped,
                                      out.tensor_scale, out.apply_op, out.undo_op)

    monkeypatch.setattr(quantization, "arith_scales", one_binade_high)
    planted = _acme_outcomes()
    assert planted == [(f"{name} value", 384, 320), (f"{name} code", 384, 320)]
