"""verify-formats: it passes on the real fast path, catches planted faults, and verifies every
scale rule, a new one included, with no edit of its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kernel_paths import kernel_path
from typer.testing import CliRunner

from driftcli import FORMATS, oracle
from driftcli.casts import rounding, route, scaling
from driftcli.choices import Engine
from driftcli.cli import app
from driftcli.engines import Execution
from driftcli.io.tables import read_table
from driftcli.records.cast import Scaling
from driftcli.records.formats import Exact, Kind
from driftcli.records.modes import Granularity, Rounding, ScaleRule, check_rule_table
from driftcli.verify import Plan, block_casts, blocks, check_cast, driver, element_formats, verify

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


@pytest.mark.parametrize("path", ["torch", "jit"])
def test_a_planted_wrong_tie_rule_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            path: str) -> None:
    """Ties away instead of ties to even, for one format, in the torch kernel or in the numba
    kernel's parameters: verify-formats fails, only there."""
    planted = rounding.Target.of(FORMATS["float8_e4m3fn"])
    name = "_kernel" if path == "torch" else "jit_params"
    real = getattr(rounding, name)

    def wrong(*args: object, **kw: object) -> object:
        if kw["tgt"] == planted and kw["rounding"] is Rounding.RNE:
            kw["rounding"] = Rounding.RNA
        return real(*args, **kw)

    monkeypatch.setattr(rounding, name, wrong)
    with kernel_path(path):
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

    real = oracle.rounding.product
    monkeypatch.setattr(oracle.rounding, "product", unsigned_zero_product)
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


def _log2_shortcut(real):  # type: ignore[no-untyped-def]
    """The bug verify-formats must catch, planted in verify's scale step alone
    (:func:`driftcli.casts.route.group_scales`, on either back-end): the exponent from a
    float32 log2, which rounds log2 of the largest float32 below 8.0 up to 3."""
    import dataclasses

    import torch

    def planted(c, amax, **kw):  # type: ignore[no-untyped-def]
        got = real(c, amax, **kw)
        if got.exponent is None:
            return got
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        exact = torch.frexp(safe).exponent.long() - 1  # read from the bits
        shift = torch.where(amax > 0, torch.floor(torch.log2(safe.float())).long() - exact, 0)
        k = got.exponent + shift
        return dataclasses.replace(got, exponent=k, value=torch.ldexp(
            torch.ones_like(k, dtype=torch.float64), k.double()))
    return planted


def _log2_shortcut_plan(amax, plan):  # type: ignore[no-untyped-def]
    """The same bug in the form the cast path calls (a :class:`ScalePlan`)."""
    import torch

    k = torch.floor(torch.log2(amax.float())).long() - plan.elem_emax + plan.headroom
    zero = amax == 0
    return torch.where(zero, plan.low, k.clamp(plan.low, plan.high)), torch.zeros_like(zero)


def _log2_shortcut_rows(real):  # type: ignore[no-untyped-def]
    """The same bug planted in the numba back-end's block scales: each row's exponent moved
    by what float32's log2 adds to the exact exponent of its amax (+1 just below a power of
    two, where log2 rounds up to the next integer)."""
    import torch

    def planted(blocks, rule):  # type: ignore[no-untyped-def]
        got = real(blocks, rule)
        amax = got.amax
        finite = amax > 0
        safe = torch.where(finite, amax, torch.ones_like(amax))
        exact = torch.frexp(safe).exponent.long() - 1  # read from the bits
        shift = torch.where(finite, torch.floor(torch.log2(safe)).long() - exact, 0)
        ks = got.scale + shift
        return got._replace(scale=ks, kmin=min(got.kmin, int(ks.min())),
                            kmax=max(got.kmax, int(ks.max())))
    return planted


@pytest.mark.parametrize("backend", ["torch", "jit"])
@pytest.mark.parametrize("where", ["cast", "verify"])
def test_a_planted_log2_scale_rule_is_caught(where: str, backend: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted in quantize's scale step (on each back-end, which computes block scales its
    own way) or in verify's scale path alone (the block scales)."""
    from driftcli.kernels import jit

    if where == "cast":
        monkeypatch.setattr(route, "plan_pow2_exponents", _log2_shortcut_plan)
        monkeypatch.setattr(jit, "pow2_block_scales", _log2_shortcut_rows(jit.pow2_block_scales))
    else:
        monkeypatch.setattr(blocks, "group_scales", _log2_shortcut(blocks.group_scales))
    with kernel_path(backend):
        outcomes = verify([FORMATS["float4_e2m1fn"]], Plan(quick=True))
    failing = {o.check for o in outcomes if o.n_failed}
    # the cast's scale step is verify's scale step's too, on either back-end (in
    # driftcli.casts.route: castcode's kernel, or plan_pow2_exponents): planted there, both
    # checks catch it
    assert failing == ({"blocks", "block scales"} if where == "cast" else {"block scales"})


def test_floor_where_ceil_is_asked_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    real = blocks.group_scales
    real_plan = route.plan_pow2_exponents

    def floor_instead(c, *args, **kw):  # type: ignore[no-untyped-def]
        floor = dataclasses.replace(c.scaling, rule=ScaleRule.FLOOR)
        return real(dataclasses.replace(c, scaling=floor), *args, **kw)

    def floor_instead_plan(amax, plan):  # type: ignore[no-untyped-def]
        return real_plan(amax, dataclasses.replace(plan, rule=ScaleRule.FLOOR))

    monkeypatch.setattr(route, "plan_pow2_exponents", floor_instead_plan)
    monkeypatch.setattr(blocks, "group_scales", floor_instead)
    ceil = next(c for c in block_casts(FORMATS["float8_e4m3fn"])
                if c.scaling.rule is ScaleRule.CEIL)
    outcomes = list(check_cast(FORMATS["float8_e4m3fn"], ceil, Plan(quick=True)))
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
                        lambda terms, rule: real_pairwise(terms, rule))
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


# --- every scale rule is verified, a new one with no edit of verify-formats -------------------

def _add_rule(monkeypatch: pytest.MonkeyPatch, name: str, value: str, power_of_two: bool,
              covers_amax: bool = False, rounding: Rounding | None = None) -> ScaleRule:
    """Extend ScaleRule by one member for this test only, as a line in modes.py would (enums
    take no new members once built, so the member maps are patched; undone after the test)."""
    rule = ScaleRule._new_member_(ScaleRule, value, power_of_two,  # type: ignore[attr-defined]
                                  covers_amax, rounding)
    rule._name_ = name
    rule.__objclass__ = ScaleRule  # type: ignore[misc]
    monkeypatch.setitem(ScaleRule._member_map_, name, rule)
    monkeypatch.setitem(ScaleRule._value2member_map_, value, rule)
    monkeypatch.setattr(ScaleRule, "_member_names_", [*ScaleRule._member_names_, name])
    return rule


def _register_floor2(monkeypatch: pytest.MonkeyPatch, fast_headroom: int = 2) -> ScaleRule:
    """A throwaway rule, ``floor2``: floor with 2 binades of headroom written as its own rule,
    added the way a new rule is: a member, its fast exponent, its exact exponent. The fast one
    adds ``fast_headroom`` binades (not 2: a planted fault)."""
    rule = _add_rule(monkeypatch, "FLOOR2", "floor2", power_of_two=True)
    monkeypatch.setitem(scaling.FAST_RULES, rule,
                        lambda e, significand, plan: e - plan.elem_emax + fast_headroom)
    monkeypatch.setitem(oracle.scaling.EXACT_RULES, rule,
                        lambda amax, elem: oracle.rounding.binade(amax) - elem.emax + 2)
    return rule


@pytest.fixture
def floor2(monkeypatch: pytest.MonkeyPatch) -> ScaleRule:
    return _register_floor2(monkeypatch)


def _rules_checked(fmt_name: str, monkeypatch: pytest.MonkeyPatch) -> set[ScaleRule]:
    """The rules whose casts the blocks suite runs in the full plan (recorded, not run)."""
    seen = []

    def record(fmt: object, c: object, plan: object, random: bool = True) -> list[object]:
        seen.append(c)
        return []

    with monkeypatch.context() as m:
        m.setattr(blocks, "check_cast", record)
        list(blocks.check_blocks(FORMATS[fmt_name], Plan()))
    return {c.scaling.rule for c in seen}  # type: ignore[attr-defined]


def test_every_scale_rule_is_verified(floor2: ScaleRule,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every member, the throwaway one too, has a cast in the blocks suite of every element
    format it runs on; a list of casts that predates a member would miss it, and this sees it."""
    signed = [f.name for f in element_formats() if f.bits <= 8 and f.signed and f.name in FORMATS]
    # FP8 (4), FP6 (2), FP4, int8, int4, P3109 (3 listed), the elements of HiFloat4, MX6, MX9,
    # HiFloat8
    assert len(signed) == 16
    for name in signed:
        assert _rules_checked(name, monkeypatch) == set(ScaleRule), name
    real = blocks.block_casts
    monkeypatch.setattr(blocks, "block_casts",  # the planted fault: a hand-written list
                        lambda fmt: [c for c in real(fmt) if c.scaling.rule is not floor2])
    assert set(ScaleRule) - _rules_checked("float4_e2m1fn", monkeypatch) == {floor2}


def test_every_scale_rule_has_a_fast_and_an_exact_implementation() -> None:
    """Both tables cover every member (each module checks its own on import), and the check
    names a member that is missing."""
    for rule in ScaleRule:
        assert rule in scaling.FAST_RULES and rule in oracle.scaling.EXACT_RULES, rule
    check_rule_table(dict.fromkeys(ScaleRule), "a full table")
    with pytest.raises(NotImplementedError, match=r"^a table has no entry for the scale rule\(s\) "
                                                  r"even: add one for each$"):
        check_rule_table({r: None for r in ScaleRule if r is not ScaleRule.EVEN}, "a table")


def _only_the_rule_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer random blocks, to keep the full plan of one format to seconds (a rule's cells still
    get the constructed blocks, random blocks and random scales), and only the checks a scale
    rule reaches: the FP4 recipes' cells (a million elements each) and the matmul cells are the
    other tests' business."""
    monkeypatch.setattr(blocks, "BLOCK_FULL_SAMPLE", 32)
    monkeypatch.setattr(blocks, "BLOCK_SCALE_SAMPLE", 800)
    monkeypatch.setattr(blocks, "REAL_SCALE_SAMPLE", 800)
    monkeypatch.setattr(driver, "CHECKS", [c for c in driver.CHECKS
                                           if c.__name__ not in ("check_recipes", "check_matmul")])


@pytest.mark.parametrize("fast_headroom", [2, 1])
def test_a_new_scale_rule_is_verified_with_no_other_edit(
        fast_headroom: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``floor2`` (a member, its fast and its exact exponent, nothing else) is checked by the
    full run exactly as ``floor+2``, the same rule spelled with headroom, is: the same two cells
    with the same counts, and 0 disagreements. With a fast exponent one binade short, only its
    two cells fail."""
    rule = _register_floor2(monkeypatch, fast_headroom)
    _only_the_rule_checks(monkeypatch)
    code, df = _run(tmp_path, "-f", "float4_e2m1fn")
    summary = df[df.kind == "summary"]
    spec = "float4_e2m1fn:block32:float8_e8m0fnu:{}:rne:saturate"
    new = summary[summary.operation == spec.format(rule)].set_index("check")
    old = summary[summary.operation == spec.format("floor+2")].set_index("check")
    assert list(new.index) == list(old.index) == ["blocks", "block scales"]
    assert (new.n_checked == old.n_checked).all() and new.n_checked.min() >= 800
    failing = summary[summary.n_failed > 0]
    if fast_headroom == 2:
        assert code == 0 and failing.empty
    else:
        assert code == 1
        assert set(failing.operation) == {spec.format(rule)} and len(failing) == 2


@pytest.mark.parametrize("fast_mode", [Rounding.RTZ, Rounding.RNE])
def test_a_new_real_valued_rule_is_verified_with_no_other_edit(
        fast_mode: Rounding, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``amax-rtz`` (``amax / M`` rounded toward zero into the scale format) added as a real-valued
    rule is: a member stating its rounding, its fast and exact divisors read from the member,
    and its stressing scaling in ``RULE_SCALINGS`` (float32 scales would hide any rounding).
    Verified clean; a fast version that rounds to nearest instead fails its cells only."""
    rule = _add_rule(monkeypatch, "AMAX_RTZ", "amax-rtz", power_of_two=False,
                     rounding=Rounding.RTZ)
    assert rule.rounding is Rounding.RTZ
    monkeypatch.setitem(scaling.FAST_RULES, rule, scaling.real_rule(fast_mode))
    monkeypatch.setitem(oracle.scaling.EXACT_RULES, rule, oracle.scaling.real_rule(rule.rounding))
    e4m3 = FORMATS["float8_e4m3fn"]
    monkeypatch.setitem(blocks.RULE_SCALINGS, rule,
                        (Scaling(Granularity.BLOCK, 32, e4m3, rule),))
    _only_the_rule_checks(monkeypatch)
    code, df = _run(tmp_path, "-f", "float4_e2m1fn")
    summary = df[df.kind == "summary"]
    spec = "float4_e2m1fn:block32:float8_e4m3fn:amax-rtz:rne:saturate"
    new = summary[summary.operation == spec]
    assert sorted(new.check) == ["block scales", "blocks"] and new.n_checked.min() >= 800
    failing = summary[summary.n_failed > 0]
    if fast_mode is Rounding.RTZ:
        assert code == 0 and failing.empty
    else:
        assert code == 1
        assert set(failing.operation) == {spec} and int(failing.n_failed.sum()) > 0


# --- engines ---------------------------------------------------------------------------------

ENGINE_FORMATS = ["float4_e2m1fn", "int4"]
"""Two formats of the quick plan, 77,754 and 49,962 values (docs/verify-formats.md; float4_e2m1fn
carries the FP4 recipes' 26,896): twelve (format, check) units of very different lengths, so
that workers finish them out of order."""


@pytest.mark.parametrize("engine", [Engine.PROCESSES, Engine.RAY])
def test_every_engine_gives_the_serial_outcomes_in_the_serial_order(
        engine: Engine, request: pytest.FixtureRequest) -> None:
    if engine is Engine.RAY:
        request.getfixturevalue("ray_cluster")  # the test run's shared local cluster
    formats = element_formats(ENGINE_FORMATS)
    serial = verify(formats, Plan(quick=True))
    told: list[tuple[int, int, str]] = []
    spread = verify(formats, Plan(quick=True), Execution(engine, 2),
                    progress=lambda done, total, name: told.append((done, total, name)))
    assert sum(o.n_checked for o in serial) == 77_754 + 49_962
    assert spread == serial  # every count and disagreement, cell by cell, in order
    # the progress, as units finish: each of the twelve once (int4's matmul and recipes units
    # are empty)
    assert [(d, t) for d, t, _ in told] == [(i, 12) for i in range(1, 13)]
    assert sorted(n for _, _, n in told) == sorted(
        f"{f}: {c}" for f in ENGINE_FORMATS
        for c in ("codes", "pairs", "float32_inputs", "blocks", "matmul", "recipes"))


def test_jobs_spreads_the_checks_over_processes_and_provenance_names_them(
        tmp_path: Path) -> None:
    """``-j 2`` is ``--workers 2`` of the default engine, processes: the same table as
    ``--engine serial``, and the provenance says which ran."""
    args = ["--quick", *(a for f in ENGINE_FORMATS for a in ("-f", f))]
    spread, spread_prov = read_table(_run_table(tmp_path / "j2", *args, "-j", "2"))
    serial, prov = read_table(_run_table(tmp_path / "serial", *args, "--engine", "serial"))
    assert spread.equals(serial)
    # 53 cells a format, float4_e2m1fn's 17 FP4 recipes x (value, code), and te/nvfp4_rht's
    # transform, on its own and on the two TRANSFORM_CORES
    assert len(serial) == 2 * 53 + 17 * 2 + 3 and set(serial.kind) == {"summary"}
    assert (prov["engine"], prov["workers"]) == ("serial", 1)
    assert (spread_prov["engine"], spread_prov["workers"]) == ("processes", 2)


def test_one_worker_process_is_this_process(tmp_path: Path) -> None:
    """``-j 1`` ran the checks in-process before the engines and still does: what the planted
    faults above (seen only by this process) are run with."""
    _, prov = read_table(_run_table(tmp_path, "--quick", "-f", "int4", "--workers", "1"))
    assert (prov["engine"], prov["workers"]) == ("serial", 1)


def _run_table(out: Path, *args: str) -> Path:
    result = runner.invoke(app, ["verify-formats", "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    return out / "verify-formats.parquet"


def test_ray_without_the_extra_exits_2_naming_it(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` finds without the extra
    result = runner.invoke(app, ["verify-formats", "--quick", "-f", "int4", "--engine", "ray",
                                 "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --engine ray needs Ray (drift's optional extra ray): pip install ray"]
    assert not (tmp_path / "verify-formats.parquet").exists()
