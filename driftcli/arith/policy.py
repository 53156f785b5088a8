"""Arithmetic policies: which matmul arithmetic each role of a training step uses.

A linear map ``Y = X·Wᵀ`` takes three matmuls per step (docs/arithmetic.md#roles):

- ``forward``: ``X·Wᵀ``, contracting over the input features;
- ``dgrad``: ``dX = dY·W``, contracting over the output features;
- ``wgrad``: ``dW = dYᵀ·X``, contracting over the tokens.

For a plain ``C = A·B`` (attention's ``q·kᵀ`` and ``p·v``) ``dgrad`` is the gradient of the left
operand, ``dC·Bᵀ``, and ``wgrad`` that of the right one, ``Aᵀ·dC``. An
:class:`ArithmeticPolicy` gives each role a :class:`~driftcli.arith.matmul.MatmulSpec` (or
``None``: the plain torch op in the operands' own dtype) and says what the backward reads for the
forward's operands (:class:`BackwardState`). ``with driftcli.arithmetic(policy):`` applies it
to any model (:mod:`driftcli.arith.mode`).

Policies come from presets (``exact``, ``float32``, one per cast preset of
:data:`driftcli.records.presets.PRESETS` and one per recipe of
:data:`driftcli.arith.recipe_policies.RECIPES`), from a cast spec (every operand cast with
it), or from a TOML file (:func:`policy_from_toml`; docs/arithmetic.md describes the format).
A policy may give the modules a regular expression matches a cast of their own
(:class:`ModuleOverride`: a layer kept in bfloat16 under an MXFP8 policy).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

from driftcli.arith.intercept import MatmulKind
from driftcli.arith.matmul import MatmulSpec, Order, matmul_spec
from driftcli.arith.recipe_policies import RECIPES, RecipeEntry
from driftcli.choices import parse_choice
from driftcli.errors import DriftError, close_matches
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Rounding
from driftcli.records.presets import PRESETS


class PolicyError(DriftError, ValueError):
    """A policy name, file or setting that cannot be used."""


class Role(StrEnum):
    """The three matmuls of a linear map in one training step."""

    FORWARD = "forward"
    """``X·Wᵀ`` (or ``A·B``): contraction over the input features."""
    DGRAD = "dgrad"
    """``dY·W`` (or ``dC·Bᵀ``): the gradient of the left operand, contraction over the
    output features."""
    WGRAD = "wgrad"
    """``dYᵀ·X`` (or ``Aᵀ·dC``): the gradient of the right operand (the weight), contraction
    over the tokens (every leading dimension of X folded into one)."""


class BackwardState(StrEnum):
    """What the backward matmuls read for the operands the forward multiplied."""

    SAVED_CAST = "saved-cast"
    """The cast values the forward used, which were blocked along the forward's contraction
    axis; the backward's own cast (if any) is then applied to them along its contraction axis,
    as hardware that needs blocks along K must do (a second rounding of a rounded tensor)."""
    RECAST = "recast"
    """The original high-precision tensor, cast afresh along the backward's contraction axis,
    as real recipes do (the default). A stochastic cast reuses the forward's random bits for
    the same element, so only the blocking differs from the forward."""
    FRESH_SR = "fresh-sr"
    """As ``recast``, with new random bits: an independent stochastic draw. For casts that
    round deterministically this is the same as ``recast``."""


class BackwardCast(StrEnum):
    """Where the backward matmuls (dgrad, wgrad) apply their casts."""

    OPERANDS = "operands"
    """Both operands cast before the multiply, along the matmul's contraction axis, as real
    low-precision training does (the default)."""
    RESULT = "result"
    """**A wrong method, kept for comparison.** The backward matmuls multiply the uncast
    operands (float32, torch's order) and cast only their result: the cast of dY (dgrad's
    ``lhs``, wgrad's ``rhs``; the role's ``out`` where it has one) applied to dX and dW along
    their last axis. This is what a standard layer's backward followed by a cast of the
    gradient computes, the mistake of the seed study's first GPU check; it carries one
    rounding of the exact product instead of every operand's error
    (docs/arithmetic.md#casting-results-is-not-casting-operands)."""


ROLES: tuple[Role, ...] = tuple(Role)
"""The roles in the order of a training step."""


def _check_pattern(policy: str, key: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as err:
        raise PolicyError(f"policy {policy!r}: {key} pattern {pattern!r} is not a regular "
                          f"expression ({err}); write a Python regex such as 'lm_head' or "
                          r"r'layers\.0\.'") from None


@dataclass(frozen=True)
class ModuleOverride:
    """Another cast for every matmul run inside the modules ``modules`` matches (``re.search``
    on qualified names), and below them: both operands of the forward, the dgrad and the
    wgrad cast with ``cast``, float32 accumulation in torch.matmul's order, no output cast
    (the matmuls of :func:`uniform_policy`). Everything else (backward state, seed, kept
    kinds, backward cast) is the policy's; a module ``keep_high_precision`` keeps stays plain.
    """

    modules: str
    """A regular expression on module qualified names."""
    cast: Cast
    """The cast of both operands of every role (``bf16``: a layer kept in bfloat16)."""

    def __post_init__(self) -> None:
        if not isinstance(self.modules, str) or not self.modules:
            raise PolicyError(f"override modules must be a non-empty regex string, e.g. "
                              f"'^head$', not {self.modules!r}")
        _check_pattern("override", "modules", self.modules)
        if not isinstance(self.cast, Cast):
            raise PolicyError(f"override {self.modules!r}: cast must be a Cast (a spec string "
                              f"goes through module_override), not {self.cast!r}")

    @property
    def spec(self) -> MatmulSpec:
        """The matmul every role of a matching module runs."""
        return matmul_spec(lhs=self.cast, rhs=self.cast, accumulator="float32",
                           order=Order.NATIVE)


def module_override(modules: str, cast_spec: Cast | str) -> ModuleOverride:
    """A :class:`ModuleOverride` from a regex and a cast preset or spec (``"bf16"``)."""
    if isinstance(cast_spec, str):
        try:
            cast_spec = parse_cast(cast_spec)
        except DriftError as err:
            raise PolicyError(f"override {modules!r}: {err}") from None
    return ModuleOverride(modules, cast_spec)


@dataclass(frozen=True)
class ArithmeticPolicy:
    """How every matmul of a model is computed, per role (see the module docs)."""

    name: str
    """What tables and summaries call this policy (a preset's name, a file's ``name``)."""
    forward: MatmulSpec | None = None
    """The forward matmul; None: the plain torch op in the operands' own dtype (no casts)."""
    dgrad: MatmulSpec | None = None
    """The matmul giving the left operand's gradient; None: plain torch."""
    wgrad: MatmulSpec | None = None
    """The matmul giving the right operand's (the weight's) gradient; None: plain torch."""
    backward_state: BackwardState = BackwardState.RECAST
    keep_high_precision: tuple[str, ...] = ()
    """Regular expressions on module qualified names (``re.search``): matmuls run inside a
    matching module (or below it) use plain torch ops in every role."""
    seed: int = 0
    """The seed every stochastic cast's random bits are derived from."""
    keep_matmuls: tuple[MatmulKind, ...] = ()
    """Kinds of matmul (:class:`~driftcli.arith.intercept.MatmulKind`: ``attention``,
    ``linear``) that run as plain torch ops in every role, wherever they are: ``attention``
    keeps ``q·kᵀ`` and ``P·v`` in the model's own precision."""
    backward_cast: BackwardCast = BackwardCast.OPERANDS
    """Where the backward matmuls cast: their operands (right) or their result (wrong, kept
    for comparison)."""
    backward_state_lhs: BackwardState | None = None
    """What the backward reads for the forward's left operand (X of a linear map, read by the
    wgrad), where it differs from :attr:`backward_state` (None: that one)."""
    backward_state_rhs: BackwardState | None = None
    """The same for the right operand (Wᵀ, read by the dgrad): Transformer Engine's hybrid
    recipes recast one operand from the original tensor and cast the other from the forward's
    dequantized values (``columnwise_source``)."""
    overrides: tuple[ModuleOverride, ...] = ()
    """Modules that run another cast (:class:`ModuleOverride`); the first that matches a
    module applies to it and below it, unless a module below matches one of its own."""

    def __post_init__(self) -> None:
        for pattern in self.keep_high_precision:
            _check_pattern(self.name, "keep_high_precision", pattern)
        if not all(isinstance(o, ModuleOverride) for o in self.overrides):
            raise PolicyError(f"policy {self.name!r}: overrides must be ModuleOverride "
                              f"(module_override(regex, cast)), not {self.overrides!r}")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise PolicyError(f"policy {self.name!r}: seed must be a non-negative int, not "
                              f"{self.seed!r}")
        kinds = tuple(parse_choice(MatmulKind, k, "keep_matmuls kind")
                      for k in self.keep_matmuls)
        object.__setattr__(self, "keep_matmuls", tuple(dict.fromkeys(kinds)))
        object.__setattr__(self, "backward_cast",
                           parse_choice(BackwardCast, self.backward_cast, "backward_cast"))
        for side in ("backward_state", "backward_state_lhs", "backward_state_rhs"):
            given = getattr(self, side)
            if given is not None:
                object.__setattr__(self, side, parse_choice(BackwardState, given, side))

    def operand_state(self, lhs: bool) -> BackwardState:
        """What the backward reads for the forward's left (``lhs``) or right operand."""
        own = self.backward_state_lhs if lhs else self.backward_state_rhs
        return self.backward_state if own is None else own

    def spec(self, role: Role) -> MatmulSpec | None:
        """The matmul spec of ``role`` as it runs (None: plain torch). Under
        ``backward_cast = result`` a backward role's spec multiplies uncast operands in
        float32 (``native``) and casts the result (:class:`BackwardCast`)."""
        given = {Role.FORWARD: self.forward, Role.DGRAD: self.dgrad,
                 Role.WGRAD: self.wgrad}[role]
        if given is None or role is Role.FORWARD or self.backward_cast is BackwardCast.OPERANDS:
            return given
        grad = given.lhs if role is Role.DGRAD else given.rhs
        return MatmulSpec(order=Order.NATIVE, out=given.out or grad)

    def keeps_kind(self, kind: MatmulKind) -> bool:
        """Whether matmuls of ``kind`` run as plain torch ops (``keep_matmuls``)."""
        return kind in self.keep_matmuls

    @property
    def exact(self) -> bool:
        """Whether no role is simulated: every matmul is the plain torch op."""
        return all(self.spec(r) is None for r in ROLES) and not self.overrides

    @property
    def stochastic(self) -> bool:
        """Whether some cast of some role rounds stochastically (then draws differ by seed)."""
        return any(c is not None and c.rounding is Rounding.SR
                   for s in (self.spec(r) for r in ROLES) if s is not None
                   for c in (s.lhs, s.rhs, s.out)) or any(
            o.cast.rounding is Rounding.SR for o in self.overrides)

    def keeps(self, module_name: str) -> bool:
        """Whether the module of this qualified name is kept in high precision."""
        return any(re.search(p, module_name) for p in self.keep_high_precision)

    def override(self, module_name: str) -> ModuleOverride | None:
        """The first override matching the module of this qualified name, or None."""
        return next((o for o in self.overrides if re.search(o.modules, module_name)), None)

    def module_policy(self, module_name: str) -> ArithmeticPolicy | None:
        """The policy a module's own matmuls run under, read from its dotted name as the
        arithmetic mode reads the running modules: None when it or a module above it is kept
        in high precision (plain torch), else the innermost override matching it or a
        module above it, else this policy."""
        parts = module_name.split(".")
        names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(self.keeps(n) for n in names):
            return None
        for name in reversed(names):
            found = self.override(name)
            if found is not None:
                return self.overridden(found)
        return self

    def overridden(self, override: ModuleOverride) -> ArithmeticPolicy:
        """This policy as it runs inside a module ``override`` matches: every role the
        override's matmul, everything else this policy's."""
        spec = override.spec
        return replace(self, forward=spec, dgrad=spec, wgrad=spec, keep_high_precision=(),
                       overrides=())

    def describe(self) -> str:
        """One line naming every setting (what tables store next to the name)."""
        def text(s: MatmulSpec | None) -> str:
            return "plain" if s is None else str(s)

        specs = [self.spec(r) for r in ROLES]
        if all(s == specs[0] for s in specs):
            parts = [f"every role: {text(specs[0])}"]
        else:
            parts = [f"{r.value}: {text(s)}" for r, s in zip(ROLES, specs, strict=True)]
        lhs, rhs = self.operand_state(True), self.operand_state(False)
        parts.append(f"backward: {lhs.value}" if lhs is rhs else
                     f"backward: lhs {lhs.value}, rhs {rhs.value}")
        if self.backward_cast is not BackwardCast.OPERANDS:
            parts.append(f"backward cast: {self.backward_cast.value} (a wrong method, for "
                         "comparison)")
        if self.keep_high_precision:
            parts.append(f"keep: {', '.join(self.keep_high_precision)}")
        if self.keep_matmuls:
            parts.append(f"keep matmuls: {', '.join(k.value for k in self.keep_matmuls)}")
        parts += [f"override {o.modules}: {o.cast}" for o in self.overrides]
        return "; ".join(parts)


# --- presets ------------------------------------------------------------------------------------

def uniform_policy(name: str, cast: Cast | str | None) -> ArithmeticPolicy:
    """Every operand of every matmul cast with ``cast`` (None: none), float32 accumulation in
    torch.matmul's own order (``native``), no output cast: the shape of every preset."""
    spec = matmul_spec(lhs=cast, rhs=cast, accumulator="float32", order=Order.NATIVE)
    return ArithmeticPolicy(name, spec, spec, spec)


EXACT = ArithmeticPolicy("exact")
"""No casts: every matmul is the plain torch op (float64 in ``grad-cosine``, the reference)."""

POLICIES: dict[str, tuple[ArithmeticPolicy, str]] = {
    "exact": (EXACT, "no casts: plain torch ops in the model's dtype (the float64 reference)"),
    "float32": (uniform_policy("float32", None),
                "no casts, every matmul in float32 (torch.matmul on float32 operands)"),
    **{name: (uniform_policy(name, c),
              f"every operand of every matmul cast as {name} ({doc}); float32 accumulation")
       for name, (c, doc) in PRESETS.items()},
}
"""Every preset policy and what it means (the recipe policies are added below)."""


def recipe_policy(entry: RecipeEntry) -> ArithmeticPolicy:
    """The policy of one recipe table entry (:mod:`driftcli.arith.recipe_policies`): each
    role's two casts, the entry's accumulation, backward state and kept matmuls; a role whose
    two slots are ``none`` is plain."""
    def spec(role: Role) -> MatmulSpec | None:
        lhs, rhs = entry.role_casts(role.value)
        if lhs == rhs == "none":
            return None
        if entry.tc:
            return matmul_spec(lhs=lhs, rhs=rhs, tc=entry.tc, order=entry.order)
        return matmul_spec(lhs=lhs, rhs=rhs, accumulator=entry.acc, order=entry.order)

    state = BackwardState(entry.backward_state)
    lhs, rhs = (BackwardState(s) for s in entry.operand_states)
    return ArithmeticPolicy(entry.name, spec(Role.FORWARD), spec(Role.DGRAD), spec(Role.WGRAD),
                            state, entry.keep_high_precision,
                            keep_matmuls=tuple(MatmulKind(k) for k in entry.keep_matmuls),
                            backward_state_lhs=None if lhs is state else lhs,
                            backward_state_rhs=None if rhs is state else rhs)


POLICIES.update({r.name: (recipe_policy(r), r.meaning) for r in RECIPES})


# --- TOML files ---------------------------------------------------------------------------------

_TOP_KEYS = ("name", "preset", "backward_state", "backward_cast", "keep_high_precision",
             "keep_matmuls", "seed", "matmul", "override", *(r.value for r in ROLES))
_OVERRIDE_KEYS = ("modules", "cast")
_SPEC_KEYS = ("lhs", "rhs", "acc", "order", "fma", "tc", "scale", "out")
_DEFAULTS = {"lhs": "none", "rhs": "none", "acc": "float32", "order": "native",
             "scale": "dequantized", "out": "none"}
PLAIN = "plain"
"""A role written as this string is the plain torch op (no simulation)."""


def _spec_keys(spec: MatmulSpec | None) -> dict[str, str] | None:
    """The TOML keys of a spec, as strings (None: plain)."""
    if spec is None:
        return None
    return {"lhs": "none" if spec.lhs is None else str(spec.lhs),
            "rhs": "none" if spec.rhs is None else str(spec.rhs),
            "acc": f"{spec.accumulator.name}:{spec.acc_rounding.value}",
            "order": spec.order_name, **({"fma": str(spec.unit)} if spec.unit else {}),
            "scale": spec.scale_application.value,
            "out": "none" if spec.out is None else str(spec.out)}


def _from_keys(keys: dict[str, str], where: str) -> MatmulSpec:
    acc, _, mode = keys["acc"].partition(":")
    try:
        return matmul_spec(lhs=keys["lhs"], rhs=keys["rhs"], accumulator=acc,
                           acc_rounding=mode or Rounding.RNE, order=keys["order"],
                           unit=keys.get("fma"), scale_application=keys["scale"],
                           out=keys["out"])
    except DriftError as err:
        raise PolicyError(f"{where}: {err}") from None


def _table(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise PolicyError(f"{where} must be a table of {', '.join(_SPEC_KEYS)}, or the string "
                          f"{PLAIN!r}; got {type(value).__name__}")
    out = {}
    for key, v in value.items():
        if key not in _SPEC_KEYS:
            raise PolicyError(f"{where}: unknown key {key!r}{close_matches(key, _SPEC_KEYS)} "
                              f"(keys: {', '.join(_SPEC_KEYS)})")
        if not isinstance(v, str):
            raise PolicyError(f"{where}.{key} must be a string such as \"mxfp8_e4m3\", not "
                              f"{v!r}")
        out[key] = v
    if "tc" in out:  # a tensor-core preset: written out as the keys it sets
        try:
            # acc and fma given beside it are refused, as in a spec string (not overwritten)
            spec = matmul_spec(tc=out.pop("tc"), lhs=out.get("lhs"), rhs=out.get("rhs"),
                               accumulator=out["acc"].partition(":")[0] if "acc" in out
                               else None, unit=out.get("fma"),
                               order=out.get("order"), scale_application=out.get("scale",
                                                                               "dequantized"),
                               out=out.get("out"))
        except DriftError as err:
            raise PolicyError(f"{where}: {err}") from None
        out = {**out, **cast(dict[str, str], _spec_keys(spec))}
    return out


_OPERANDS = ("lhs", "rhs")


def _backward_states(given: Any, base: ArithmeticPolicy, source: str
                     ) -> tuple[BackwardState, BackwardState | None, BackwardState | None]:
    """A file's ``backward_state``: a string for both operands, or a table ``{lhs = …,
    rhs = …}`` per operand of the forward (one given keeps the preset's other); absent, the
    preset's."""
    if given is None:
        return base.backward_state, base.backward_state_lhs, base.backward_state_rhs
    if isinstance(given, str):
        return parse_choice(BackwardState, given, "backward_state"), None, None
    if not isinstance(given, dict) or set(given) - set(_OPERANDS) or not given:
        raise PolicyError(f"{source}: backward_state must be one of "
                          f"{', '.join(s.value for s in BackwardState)} or a table of lhs "
                          f"and rhs (the forward's operands, X and Wᵀ), e.g. "
                          f"{{lhs = \"recast\", rhs = \"saved-cast\"}}, not {given!r}")
    sides = {k: parse_choice(BackwardState, str(v), f"backward_state.{k}")
             for k, v in given.items()}
    lhs = sides.get("lhs", base.operand_state(True))
    rhs = sides.get("rhs", base.operand_state(False))
    return base.backward_state, lhs, rhs


def _overrides(given: Any, base: ArithmeticPolicy, source: str) -> tuple[ModuleOverride, ...]:
    """A file's ``[[override]]`` tables (absent: the preset's)."""
    if given is None:
        return base.overrides
    example = '[[override]] modules = "^head$" cast = "bf16"'
    if not isinstance(given, list) or not all(isinstance(t, dict) for t in given):
        raise PolicyError(f"{source}: override must be tables written [[override]] with keys "
                          f"modules and cast, e.g. {example}, not {given!r}")
    out = []
    for n, table in enumerate(given, start=1):
        where = f"{source}: [[override]] {n}"
        for key in table:
            if key not in _OVERRIDE_KEYS:
                raise PolicyError(f"{where}: unknown key {key!r}"
                                  f"{close_matches(key, _OVERRIDE_KEYS)} (keys: modules, cast)")
        for key in _OVERRIDE_KEYS:
            if not isinstance(table.get(key), str) or not table[key]:
                raise PolicyError(f"{where}: {key} must be a non-empty string (modules a "
                                  f"regex on module names, cast a cast spec), e.g. {example}; "
                                  f"got {table.get(key)!r}")
        try:
            out.append(module_override(table["modules"], table["cast"]))
        except DriftError as err:
            raise PolicyError(f"{where}: {err}") from None
    return tuple(out)


def override_toml(overrides: Sequence[ModuleOverride]) -> list[str]:
    """The ``[[override]]`` tables of a policy file, as lines (what :func:`policy_from_toml`
    reads back to the same overrides)."""
    lines = []
    for o in overrides:
        # JSON strings are TOML basic strings: the same escapes
        lines += ["", "[[override]]", f"modules = {json.dumps(o.modules)}",
                  f"cast = {json.dumps(str(o.cast))}"]
    return lines


def policy_from_dict(data: dict[str, Any], *, source: str = "policy",
                     default_name: str = "policy") -> ArithmeticPolicy:
    """A policy from the parsed contents of a policy file (see :func:`policy_from_toml`)."""
    for key in data:
        if key not in _TOP_KEYS:
            raise PolicyError(f"{source}: unknown key {key!r}{close_matches(key, _TOP_KEYS)} "
                              f"(keys: {', '.join(_TOP_KEYS)})")
    base = EXACT
    if "preset" in data:
        base = get_policy(str(data["preset"]))
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise PolicyError(f"{source}: name must be a non-empty string, not {name!r}")
    shared = _table(data.get("matmul", {}), f"{source}: [matmul]")
    specs: dict[Role, MatmulSpec | None] = {}
    for role in ROLES:
        given = data.get(role.value)
        if isinstance(given, str):
            if given != PLAIN:
                raise PolicyError(f"{source}: {role.value} = {given!r}: a role is a table of "
                                  f"{', '.join(_SPEC_KEYS)} or the string {PLAIN!r}")
            specs[role] = None
            continue
        start = _spec_keys(base.spec(role))
        if start is None and not shared and given is None:
            specs[role] = None  # nothing says to simulate this role
            continue
        own = _table(given or {}, f"{source}: [{role.value}]")
        keys = {**(start or _DEFAULTS), **shared, **own}
        if "order" in own and "fma" not in own and not own["order"].startswith("blockfma"):
            # a role that leaves block-FMA for another order drops the unit it inherited
            keys.pop("fma", None)
        specs[role] = _from_keys(keys, f"{source}: [{role.value}]")
    keep = data.get("keep_high_precision", list(base.keep_high_precision))
    if isinstance(keep, str):
        keep = [keep]
    if not isinstance(keep, list) or not all(isinstance(p, str) for p in keep):
        raise PolicyError(f"{source}: keep_high_precision must be a list of regex strings, "
                          f"e.g. [\"lm_head\"], not {keep!r}")
    state, lhs, rhs = _backward_states(data.get("backward_state"), base, source)
    seed = data.get("seed", base.seed)
    kinds = data.get("keep_matmuls", list(base.keep_matmuls))
    if isinstance(kinds, str):
        kinds = [kinds]
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise PolicyError(f"{source}: keep_matmuls must be a list of matmul kinds "
                          f"({', '.join(k.value for k in MatmulKind)}), e.g. [\"attention\"], "
                          f"not {kinds!r}")
    overrides = _overrides(data.get("override"), base, source)
    try:
        return ArithmeticPolicy(name, specs[Role.FORWARD], specs[Role.DGRAD],
                                specs[Role.WGRAD], state, tuple(keep), seed, tuple(kinds),
                                data.get("backward_cast", base.backward_cast), lhs, rhs,
                                overrides)
    except DriftError as err:
        raise PolicyError(f"{source}: {err}") from None


def policy_from_toml(path: str | Path) -> ArithmeticPolicy:
    """Read a policy file (TOML; the format is in docs/arithmetic.md).

    Top-level keys: ``name`` (default: the file's stem), ``preset`` (a policy to start from),
    ``backward_state`` (a string, or a table ``{lhs = …, rhs = …}`` per forward operand),
    ``keep_high_precision`` (a list of regexes), ``seed``; ``[[override]]`` tables of
    ``modules`` (a regex) and ``cast`` (:class:`ModuleOverride`); a ``[matmul]``
    table of spec keys shared by every role, and ``[forward]``, ``[dgrad]``, ``[wgrad]``
    tables overriding them per role (or a role given as ``"plain"``). Spec keys are those of a
    matmul spec string: ``lhs``, ``rhs``, ``acc``, ``order``, ``fma``, ``tc``, ``scale``,
    ``out``; keys not given take the preset's values, else ``none``, ``float32``, ``native``,
    ``dequantized`` (a role whose own table gives an order other than ``blockfma`` drops an
    inherited ``fma``).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise PolicyError(f"cannot read policy file {p}: {err.strerror or err}; give the path "
                          "of a .toml policy file or a preset name") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PolicyError(f"policy file {p} is not valid TOML: {err}") from None
    return policy_from_dict(data, source=str(p), default_name=p.stem)


def get_policy(name_or_path: str | Path | ArithmeticPolicy) -> ArithmeticPolicy:
    """A policy from a preset name (``exact``, ``float32``, ``mxfp8_e4m3``, …), a ``.toml``
    file, or a cast spec (every operand of every matmul cast with it, e.g. ``mxfp4_e2m1:sr``);
    policies pass through."""
    if isinstance(name_or_path, ArithmeticPolicy):
        return name_or_path
    text = str(name_or_path).strip()
    if text in POLICIES:
        return POLICIES[text][0]
    if isinstance(name_or_path, Path) or text.endswith(".toml"):
        return policy_from_toml(text)
    try:
        c = parse_cast(text)
    except DriftError:
        raise PolicyError(
            f"unknown policy {text!r}{close_matches(text, POLICIES)} (give a preset: exact, "
            "float32 or a cast preset such as mxfp8_e4m3; a cast spec; or a .toml policy "
            "file)") from None
    return uniform_policy(text, c)


def with_seed(policy: ArithmeticPolicy, seed: int) -> ArithmeticPolicy:
    """The same policy drawing its random bits from ``seed``."""
    return replace(policy, seed=seed)
