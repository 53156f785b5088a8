"""verify-formats: it passes on the real fast path and catches planted faults."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from driftcli import FORMATS, oracle
from driftcli import rounding as fast
from driftcli.cli import app
from driftcli.formats import Exact, Kind
from driftcli.io.tables import read_table
from driftcli.modes import Rounding
from driftcli.verify import Plan, verify

runner = CliRunner()


def _run(tmp_path: Path, *args: str) -> tuple[int, object]:
    result = runner.invoke(app, ["verify-formats", "--out", str(tmp_path), "-j", "1", *args])
    table = tmp_path / "verify-formats.parquet"
    return result.exit_code, (read_table(table)[0] if table.exists() else None)


def test_quick_run_passes_and_writes_its_table(tmp_path: Path) -> None:
    code, df = _run(tmp_path, "--quick", "-f", "float8_e4m3fn", "-f", "float4_e2m1fn")
    assert code == 0
    summary = df[df.kind == "summary"]
    assert int(summary.n_failed.sum()) == 0
    assert set(summary.format) == {"float8_e4m3fn", "float4_e2m1fn"}
    # FP4: all 256 pairs under every cell; sr: every one of the 16 draws of 4 bits
    fp4 = summary[(summary.format == "float4_e2m1fn") & (summary.operation == "product")]
    assert set(fp4.n_checked) == {256, 256 * 16}


def test_a_planted_wrong_tie_rule_is_caught(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ties away instead of ties to even, for one format: verify-formats fails, only there."""
    real = fast._kernel
    planted = fast._Target.of(FORMATS["float8_e4m3fn"])

    def wrong(*args: object, **kw: object) -> object:
        if kw["tgt"] == planted and kw["rounding"] is Rounding.RNE:
            kw["rounding"] = Rounding.RNA
        return real(*args, **kw)

    monkeypatch.setattr(fast, "_kernel", wrong)
    code, df = _run(tmp_path, "--quick", "-f", "float8_e4m3fn", "-f", "float8_e5m2")
    assert code == 1
    failing = df[(df.kind == "summary") & (df.n_failed > 0)]
    assert set(failing.format) == {"float8_e4m3fn"} and set(failing.rounding) == {"rne"}
    assert set(failing.check) >= {"float32-inputs"}
    rows = df[df.kind == "disagreement"]
    assert len(rows) > 0 and rows.expected.notna().all() and rows.got.notna().all()


def test_a_reference_that_loses_the_sign_of_zero_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed study's first bug, planted in the oracle: (+0)·(−x) computed as +0."""

    def unsigned_zero_product(a: Exact, b: Exact) -> Exact:
        if a.kind is Kind.FINITE and b.kind is Kind.FINITE:
            return Exact.of(a.value * b.value)  # a plain rational has no −0
        return real(a, b)

    real = oracle.product
    monkeypatch.setattr(oracle, "product", unsigned_zero_product)
    outcomes = verify([FORMATS["float4_e2m1fn"]], Plan(quick=True))
    failing = [o for o in outcomes if o.n_failed]
    assert failing and all(o.operation == "product" for o in failing)
    # products of a zero and an opposite-signed operand: 2 zeros x 7 nonzero magnitudes x 2 signs
    # and (+0)(−0), (−0)(+0): 28 + 2 = 30 pairs, each −0 in truth
    deterministic = [o for o in failing if o.rounding != "sr"]
    assert {o.n_failed for o in deterministic} == {30}
    assert all(got == "-0" and exp == "0" for o in failing for _, exp, got in o.failures)


def test_unknown_and_impossible_formats_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["verify-formats", "-f", "e3m4", "-f", "float8_e4m3", "--out",
                                 str(tmp_path)])
    assert result.exit_code == 2
    assert "error: unknown format 'float8_e4m3'" in result.output
    assert "did you mean float8_e4m3fn" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "verify-formats.parquet").exists()


def _log2_shortcut(amax, elem, scaling):  # type: ignore[no-untyped-def]
    """The bug verify-formats must catch: the exponent from a float32 log2, which rounds
    log2 of the largest float32 below 8.0 up to 3."""
    import torch

    from driftcli.scaling import pow2_range

    k = torch.floor(torch.log2(amax.float())).long() - elem.emax + scaling.headroom
    low, high = pow2_range(scaling.scale_format)
    zero = amax == 0
    return torch.where(zero, low, k.clamp(low, high)), torch.zeros_like(zero)


def _log2_shortcut_plan(amax, plan):  # type: ignore[no-untyped-def]
    """The same bug in the form the cast path calls (a :class:`ScalePlan`)."""
    import torch

    k = torch.floor(torch.log2(amax.float())).long() - plan.elem_emax + plan.headroom
    zero = amax == 0
    return torch.where(zero, plan.low, k.clamp(plan.low, plan.high)), torch.zeros_like(zero)


@pytest.mark.parametrize("where", ["cast", "verify"])
def test_a_planted_log2_scale_rule_is_caught(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted in quantize (the elements) or in the scale path alone (the block scales)."""
    import driftcli.cast
    import driftcli.verify

    if where == "cast":
        monkeypatch.setattr(driftcli.cast, "plan_pow2_exponents", _log2_shortcut_plan)
    else:
        monkeypatch.setattr(driftcli.verify, "pow2_exponents", _log2_shortcut)
    outcomes = verify([FORMATS["float4_e2m1fn"]], Plan(quick=True))
    failing = {o.check for o in outcomes if o.n_failed}
    assert failing == ({"blocks"} if where == "cast" else {"block scales"})


def test_floor_where_ceil_is_asked_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import driftcli.cast
    from driftcli.modes import ScaleRule

    real = driftcli.cast.pow2_exponents
    real_plan = driftcli.cast.plan_pow2_exponents

    def floor_instead(amax, elem, scaling):  # type: ignore[no-untyped-def]
        return real(amax, elem, dataclasses.replace(scaling, rule=ScaleRule.FLOOR))

    def floor_instead_plan(amax, plan):  # type: ignore[no-untyped-def]
        return real_plan(amax, dataclasses.replace(plan, rule=ScaleRule.FLOOR))

    monkeypatch.setattr(driftcli.cast, "plan_pow2_exponents", floor_instead_plan)
    monkeypatch.setattr(driftcli.verify, "pow2_exponents", floor_instead)
    ceil = next(c for c in driftcli.verify.block_casts(FORMATS["float8_e4m3fn"])
                if c.scaling.rule is ScaleRule.CEIL)
    outcomes = list(driftcli.verify.check_cast(FORMATS["float8_e4m3fn"], ceil, Plan(quick=True)))
    assert [o.check for o in outcomes] == ["blocks", "block scales"]
    assert all(o.n_failed > 0 for o in outcomes)


def test_pairwise_where_sequential_is_asked_is_caught(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted order bug: the pairwise tree computed where sequential is asked. With the
    narrow E5M2 accumulator verify-formats exits 1, and only sequential matmul cells fail."""
    import importlib

    simulated = importlib.import_module("driftcli.arith.matmul")
    real_pairwise = simulated._pairwise
    monkeypatch.setattr(simulated, "_sequential",
                        lambda terms, rule, work: real_pairwise(terms, rule))
    code, df = _run(tmp_path, "--quick", "-f", "float8_e5m2")
    assert code == 1
    summary = df[df.kind == "summary"]
    failing = summary[summary.n_failed > 0]
    assert set(failing.check) == {"matmul"} and len(failing) >= 4
    assert all("order=sequential" in op for op in failing.operation)
    others = summary[(summary.check == "matmul") & ~summary.operation.str.contains("sequential")]
    assert len(others) > 0 and int(others.n_failed.sum()) == 0
    rows = df[(df.kind == "disagreement") & (df.check == "matmul")]
    assert rows.operands.str.contains("element").all()
