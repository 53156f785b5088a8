"""The package's shape: the public API resolves to what it names, whatever was imported first."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import types

import pytest

import driftcli


def _every_module() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(driftcli.__path__, "driftcli.")
            if not m.name.endswith("__main__")]


def test_the_public_api_is_not_shadowed_by_a_submodule() -> None:
    """A lazily exported name that is also a submodule's name would turn into that module once
    the submodule is imported (``driftcli.quantize`` the function, or ``driftcli/quantize.py``):
    import every module, then every public name must still be what its module defines."""
    for name in _every_module():
        importlib.import_module(name)
    for name in driftcli.__all__:
        value = getattr(driftcli, name)
        assert not isinstance(value, types.ModuleType), f"driftcli.{name} is a module"
        if name != "__version__":
            home = importlib.import_module(driftcli._API[name])
            assert value is getattr(home, name), name


LAYERS = (
    ("errors", "_version", "lazy", "records", "casts", "arith"),
    ("records.formats", "records.tapered", "records.modes", "choices", "text", "escaping",
     "kernels", "casts.twosum", "memory", "progress"),
    ("records.cast", "records.recipes", "records.presets", "records.castspec", "oracle"),
    ("casts.rounding", "casts.codec"),
    ("casts.scaling", "casts.scalearith", "casts.fouroversix", "casts.hadamard",
     "casts.microscale", "arith.blockfma", "arith.tensorcores"),
    ("casts.quantization", "casts.route", "casts.given"),
    ("arith.autograd", "arith.exact", "arith.intercept", "arith.matmul", "arith.matmulspec",
     "arith.mode", "arith.policy", "arith.recipe_policies"),
    ("io", "engines"),
    ("models",),
    ("measures", "verify"),
    ("runs", "api"),
    ("report", "live"),
    ("cli", "__main__"),
)
"""drift's layers, bottom first: a module imports only from its own layer or those below
(docs/architecture.md). Names are modules and packages under driftcli, a module taking the
layer of the longest name that holds it (``records.cast``, else ``records``: the packages of the
numeric core are empty but for ``oracle``, which imports its modules)."""


def _module_imports() -> dict[str, set[str]]:
    """Each module's imports of other drift modules (:func:`_imports_in`)."""
    from pathlib import Path

    names = set(_every_module()) | {"driftcli"}
    edges: dict[str, set[str]] = {}
    for name in [*_every_module(), "driftcli"]:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        path = Path(spec.origin)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = _imports_in(path.read_text(encoding="utf-8"), package, names)
        edges[name] = (found | _packages_run(found, name, names)) - {name}
    return edges


def _packages_run(found: set[str], importer: str, names: set[str]) -> set[str]:
    """The packages whose ``__init__`` importing ``found`` runs: ``arith.blockfma`` runs
    ``arith/__init__``, an edge to whatever that imports. Not the importer's own packages,
    which run before it does."""
    run = set()
    for target in found:
        parts = target.split(".")
        for k in range(2, len(parts)):
            package = ".".join(parts[:k])
            if package in names and not importer.startswith(package + "."):
                run.add(package)
    return run


def test_importing_a_module_runs_its_packages() -> None:
    """The checker's planted case: importing ``arith.blockfma`` from ``casts.hadamard`` runs
    ``arith/__init__`` (an edge), while ``arith.matmul`` importing ``arith.blockfma`` does not
    run its own package again."""
    names = {"driftcli.arith", "driftcli.arith.blockfma", "driftcli.casts"}
    assert _packages_run({"driftcli.arith.blockfma"}, "driftcli.casts.hadamard", names) == {
        "driftcli.arith"}
    assert _packages_run({"driftcli.arith.blockfma"}, "driftcli.arith.matmul", names) == set()


def _imports_in(source: str, package: str, names: set[str]) -> set[str]:
    """The modules of ``names`` that ``source`` (a module of ``package``) imports, inside
    functions too: the CLI makes them to start without torch, but a deferred import is still
    a dependency, and one that goes up or round is a circle the module level hides.
    ``TYPE_CHECKING`` blocks are not edges: they never run."""
    import ast

    found: set[str] = set()
    tree = ast.parse(source)
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            target = package.rsplit(".", node.level - 1)[0] + (f".{node.module}"
                                                              if node.module else "")
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in names}
            continue
        else:
            continue
        subs = {f"{target}.{a.name}" for a in node.names} & names
        if subs:  # from a package, its modules
            found |= subs
        elif target in names:
            found.add(target)
    return found


def test_imports_inside_functions_count_and_type_checking_ones_do_not() -> None:
    """The checker's planted case: a deferred import is an edge, a typing-only one is not."""
    source = """
from typing import TYPE_CHECKING
from driftcli.records.formats import Format
if TYPE_CHECKING:
    from driftcli.report import load
def late() -> None:
    from driftcli.cli import app
    from . import scaling
"""
    names = {"driftcli.records.formats", "driftcli.report.load", "driftcli.cli.app",
             "driftcli.casts.scaling"}
    assert _imports_in(source, "driftcli.casts", names) == {
        "driftcli.records.formats", "driftcli.cli.app", "driftcli.casts.scaling"}


def _layer(module: str) -> int:
    rel = module.removeprefix("driftcli.") if module != "driftcli" else ""
    best: tuple[int, int] | None = None  # (length of the name that holds it, its layer)
    for i, names in enumerate(LAYERS):
        for name in names:
            if (rel == name or rel.startswith(name + ".")) and (best is None
                                                                or len(name) > best[0]):
                best = (len(name), i)
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: add it (and to "
                             "docs/architecture.md)")
    return best[1]


def test_a_module_takes_the_layer_of_the_longest_name_that_holds_it() -> None:
    """The checker's planted case: ``records.cast`` is above ``records.formats``, and a module
    named nowhere is refused rather than put anywhere."""
    assert _layer("driftcli.records.cast") == 2 and _layer("driftcli.records.formats") == 1
    assert _layer("driftcli.records") == 0 and _layer("driftcli.arith.exact") == 6
    assert _layer("driftcli.casts.rounding") < _layer("driftcli.casts.quantization")
    with pytest.raises(AssertionError, match=r"driftcli\.nowhere is in no layer"):
        _layer("driftcli.nowhere")


def test_imports_go_only_downward() -> None:
    upward = [f"{a} -> {b}" for a, targets in _module_imports().items() if a != "driftcli"
              for b in targets if b != "driftcli" and _layer(b) > _layer(a)]
    assert not upward


def _circles() -> list[list[str]]:
    edges = _module_imports()
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return circles


def test_there_is_no_import_circle() -> None:
    """Function-level imports counted: the cast grammar (``castspec``) reads the preset table
    (``presets``), which reads the implementations' presets (``recipes``), which are built from
    the cast record (``cast``); nothing below looks up."""
    assert _circles() == []


def test_no_module_imports_a_private_name_of_another() -> None:
    import ast
    from pathlib import Path

    bad = []
    for name in _every_module():
        path = Path(importlib.util.find_spec(name).origin)  # type: ignore[union-attr, arg-type]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("driftcli"):
                bad += [f"{name}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("fast", "rounding", "compiling", "scaling")
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{name}: {node.value.id}.{node.attr}")
    assert not bad


def test_a_lazy_export_that_is_also_a_submodule_is_refused() -> None:
    """``driftcli.report.load`` is a module; exporting a function ``load`` from the package
    would give the module or the function depending on what was imported first."""
    import driftcli.report
    from driftcli.lazy import exports

    namespace = {"__name__": "driftcli.report", "__path__": driftcli.report.__path__}
    with pytest.raises(ImportError, match="exports load, which are also its submodules"):
        exports(namespace, {"load": "driftcli.report.load", "Table": "driftcli.report.load"})


def test_no_module_reaches_for_a_compiler_of_torch() -> None:
    """drift's kernels are torch ops or numba code (driftcli.kernels): no module imports
    dynamo or inductor, whose code differs by instruction set and compiles in every new
    process."""
    from pathlib import Path

    root = Path(driftcli.__file__).parent
    found = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if "torch._dynamo" in p.read_text(encoding="utf-8")
             or "torch._inductor" in p.read_text(encoding="utf-8")]
    assert found == []


ENGINE_USERS = ("measures", "verify", "runs")
"""The layers that measure, verify and train through the casts (issue 41): they ask the casts
for a cast's steps and never compose a route of their own, so they import nothing from
``kernels/`` (the back-end is the casts' choice) and only :data:`CASTS_INTERFACE` of
``casts/``."""

CASTS_INTERFACE = {
    "casts.quantization": {"quantize", "QuantInfo", "working_dtype"},
    "casts.rounding": {"round_to_format", "draw_random_bits", "add", "multiply"},
    "casts.codec": {"encode", "decode", "nan_code"},
    "casts.hadamard": {"transform", "transformed", "check_core", "rht_problem"},
    # the cast pipeline's route, decided once per cast (issue 41): what the fused pass takes
    "casts.route": {"flat_route", "one_scale",
                    # and its steps: the groups' amax, scales, values and counts
                    "block_amax", "block_ranges", "merge_ranges", "group_ranges", "group_scales",
                    "GroupScales",
                    "cast_elements", "ElementCast", "block_summary", "key_counts",
                    "fused_summary", "Summary",
                    # the counts a cast makes of a tensor (the scan's), and a slice's shared reads
                    "count_cast", "fused_counts", "fused_takes", "Counts", "error_terms",
                    "error_sums", "SliceFacts", "slice_facts", "run_amax", "run_length",
                    "finite_amax", "SUM_PIECE", "TENSOR_ROW", "policy_amax", "combined_amax"},
}
"""The names of ``casts/`` the layers above may use: a whole cast (``quantize``), the element
rounding and arithmetic verify checks, code <-> value, the random Hadamard transform, and the
dtype a cast works in. Everything else of ``casts/`` (scale plans, block masks, the pieces of a
route) is private to it; the cast pipeline of issue 41 adds its steps here."""

def _is_module(name: str) -> bool:
    """Whether ``name`` is an importable module or package (not a name inside one)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a name inside a module, not a submodule
        return False


def _reaches_inside(source: str, package: str) -> set[str]:
    """What ``source`` (a module of ``package``) takes from ``kernels/`` (every import) and from
    ``casts/`` outside :data:`CASTS_INTERFACE`, as dotted names: imports anywhere in it (inside
    functions and ``TYPE_CHECKING`` blocks too), and ``module.name`` wherever it reaches a name
    through a module it bound (``from driftcli.casts import rounding``, then
    ``rounding.jit_params``; ``import driftcli.casts.scaling``, then
    ``driftcli.casts.scaling.to_blocks``; ``from driftcli import casts``, then
    ``casts.scaling.to_blocks``)."""
    import ast

    tree = ast.parse(source)
    taken: list[str] = []
    bound: dict[str, str] = {}  # a local name -> the dotted name of drift's it is
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (package.rsplit(".", node.level - 1)[0] + (f".{node.module}" if node.module
                                                              else "")
                    if node.level else node.module or "")
            for a in node.names:
                full = f"{base}.{a.name}"
                taken.append(full)
                bound[a.asname or a.name] = full
        elif isinstance(node, ast.Import):
            for a in node.names:
                taken.append(a.name)
                # ``import a.b.c as m`` binds ``m`` to a.b.c; ``import a.b.c`` binds ``a``
                root = a.name.split(".")[0]
                bound[a.asname or root] = a.name if a.asname else root
    bound = {k: v for k, v in bound.items() if v.startswith("driftcli")}
    for node in ast.walk(tree):
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not parts or not isinstance(node, ast.Name) or node.id not in bound:
            continue
        path = bound[node.id]
        for attr in reversed(parts):  # down the modules, then the one name taken from the last
            if not _is_module(path):
                break
            path = f"{path}.{attr}"
            taken.append(path)
    found = set()
    for full in taken:
        rel = full.removeprefix("driftcli.")
        if rel == "kernels" or rel.startswith("kernels."):
            found.add(full.rsplit(".", 1)[0] if rel.count(".") > 1 else full)
        elif rel.startswith("casts.") and rel not in CASTS_INTERFACE:
            module, _, name = rel.rpartition(".")
            if module != "casts" and name not in CASTS_INTERFACE.get(module, set()):
                found.add(full)
    return found


def _engine_reaches() -> dict[str, set[str]]:
    from pathlib import Path

    out = {}
    for name in _every_module():
        if name.removeprefix("driftcli.").split(".")[0] not in ENGINE_USERS:
            continue
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        path = Path(spec.origin)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        if found := _reaches_inside(path.read_text(encoding="utf-8"), package):
            out[name] = found
    return out


def test_the_checker_catches_a_reach_into_kernels_or_the_casts_insides() -> None:
    """The checker's planted case: kernels taken three ways, a private name of a casts module
    taken directly and through the module, and the interface left alone."""
    source = """
from driftcli import kernels
from ..kernels.jit import block_amax
from driftcli.casts.quantization import quantize, plan_scales
from driftcli.casts import rounding
import driftcli.casts.scaling as sc
def f(x):
    from driftcli.casts.hadamard import transform
    return rounding.round_to_format(x) + rounding.jit_params(x) + sc.to_blocks(x)
"""
    assert _reaches_inside(source, "driftcli.measures") == {
        "driftcli.kernels", "driftcli.kernels.jit", "driftcli.casts.quantization.plan_scales",
        "driftcli.casts.rounding.jit_params", "driftcli.casts.scaling.to_blocks"}
    assert _reaches_inside("from driftcli.casts.codec import decode\n",
                           "driftcli.verify") == set()
    # through a package bound whole: every dotted reach resolved down to the name it takes
    assert _reaches_inside("import driftcli.casts.scaling\n"
                           "y = driftcli.casts.scaling.to_blocks(x)\n",
                           "driftcli.measures") == {"driftcli.casts.scaling.to_blocks"}
    assert _reaches_inside("from driftcli import casts\ny = casts.quantization.plan_scales(x)\n"
                           "z = casts.quantization.quantize.__doc__\n",
                           "driftcli.measures") == {"driftcli.casts.quantization.plan_scales"}
    assert _reaches_inside("import driftcli\ny = driftcli.kernels.jit.block_amax(x)\n",
                           "driftcli.runs") == {"driftcli.kernels", "driftcli.kernels.jit"}


def test_measures_verify_and_runs_use_no_kernel_and_no_private_cast_name() -> None:
    """No module of ``measures/``, ``verify/`` or ``runs/`` reaches into ``kernels/`` or the
    casts' insides: they take the cast pipeline's steps (:data:`CASTS_INTERFACE`)."""
    assert _engine_reaches() == {}


ROUTE_DECIDER = "driftcli.casts.route"
"""Where a cast's route is decided (issue 41): the only module of the cast pipeline and of its
users that asks which back-end runs (:func:`driftcli.kernels.numba_runs`); ``quantize``
(``casts/quantization``) follows the route its ``cast_route`` decides, and the layers of
:data:`ENGINE_USERS` take the steps it gives. The casts' single kernels (element rounding,
micro scales, four over six, the transform) choose their own back-end inside their modules,
as arith's do."""


def _asks_the_back_end(source: str) -> bool:
    """Whether ``source`` uses ``numba_runs`` (by any name it imported it as, through a star
    import of ``kernels``, or as ``kernels.numba_runs``): called, or bound to call later."""
    import ast

    tree = ast.parse(source)
    names = {a.asname or "numba_runs" for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) for a in node.names
             if a.name == "numba_runs" or (
                 a.name == "*" and (node.module or "").rsplit(".", 1)[-1] == "kernels")}
    return any((isinstance(node, ast.Name) and node.id in names) or (
        isinstance(node, ast.Attribute) and node.attr == "numba_runs")
        for node in ast.walk(tree))


def _route_deciders() -> set[str]:
    from pathlib import Path

    found = set()
    for name in _every_module():
        rel = name.removeprefix("driftcli.")
        if rel.split(".")[0] not in ENGINE_USERS and name != ROUTE_DECIDER and \
                rel != "casts.quantization":
            continue
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        if _asks_the_back_end(Path(spec.origin).read_text(encoding="utf-8")):
            found.add(name)
    return found


def test_the_checker_finds_a_back_end_asked_any_way() -> None:
    """The checker's planted case: asked through the package, through an imported name (and
    an alias), through a star import, bound to a name first, and not asked where the name is
    only mentioned."""
    assert _asks_the_back_end("from driftcli import kernels\nkernels.numba_runs(x)\n")
    assert _asks_the_back_end("from driftcli.kernels import numba_runs as nr\nnr(x, y)\n")
    assert _asks_the_back_end("from driftcli.kernels import *\nnumba_runs(x)\n")
    assert _asks_the_back_end("from driftcli import kernels\nask = kernels.numba_runs\nask(x)\n")
    assert not _asks_the_back_end("from driftcli.casts.route import group_scales\n"
                                  "doc = 'numba_runs'\ngroup_scales(c, a)\n")


def test_the_route_is_decided_in_one_module() -> None:
    """Beside :data:`ROUTE_DECIDER`, neither ``quantize`` nor a module that measures, verifies
    or trains asks which back-end runs; ``quantize`` follows
    :func:`driftcli.casts.route.cast_route`'s route."""
    import ast
    from pathlib import Path

    assert _route_deciders() == {ROUTE_DECIDER}
    source = Path(importlib.import_module("driftcli.casts.quantization").__file__ or "")
    called = {n.func.id for n in ast.walk(ast.parse(source.read_text(encoding="utf-8")))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "cast_route" in called
