"""The threshold language of ``drift report --fail-on``: a hand-written tokenizer, a
recursive-descent parser and a vectorized evaluator over a table's columns. No ``eval``.

Grammar (``docs/report.md`` shows it with examples)::

    rule       := [TABLE ":"] expr
    expr       := conj ("or" conj)*
    conj       := neg ("and" neg)*
    neg        := "not" neg | "(" expr ")" | comparison
    comparison := operand OP operand
    operand    := COLUMN | NUMBER | "-" NUMBER | STRING | "true" | "false" | "inf" | "-" "inf"
    OP         := "<" | "<=" | ">" | ">=" | "==" | "!="

A comparison involving a null (or NaN) is unknown, and ``and``/``or``/``not`` follow
three-valued (SQL) logic, so a row matches a rule only when the rule is known to be true:
nulls never match, not even under ``not``.
"""

from __future__ import annotations

import enum
import math
import operator
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from driftcli.errors import DriftError, close_matches

MAX_DEPTH = 64
"""Nesting of parentheses and ``not`` allowed; deeper input is refused, never a crash."""
MAX_LENGTH = 10_000
"""Characters allowed in one rule."""

GRAMMAR_HINT = ("write COLUMN OP VALUE joined by and/or/not, e.g. 'clip_rate > 0.01' "
                "(docs/report.md)")

_SCOPE = re.compile(r"\s*([A-Za-z][A-Za-z0-9_.\-]*)\s*:(?!=)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_ESCAPES = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t"}


class ExpressionError(DriftError, ValueError):
    """A ``--fail-on`` rule that does not parse, names an unknown column or compares
    values of different kinds."""


class CompareOp(enum.StrEnum):
    """The comparison operators, by their spelling."""

    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="
    EQ = "=="
    NE = "!="

    @property
    def function(self) -> Callable[[Any, Any], Any]:
        """The elementwise operator."""
        return _FUNCTIONS[self]


_FUNCTIONS: dict[CompareOp, Callable[[Any, Any], Any]] = {
    CompareOp.LT: operator.lt, CompareOp.LE: operator.le, CompareOp.GT: operator.gt,
    CompareOp.GE: operator.ge, CompareOp.EQ: operator.eq, CompareOp.NE: operator.ne,
}


class TokenKind(enum.StrEnum):
    """What a token is."""

    NAME = "name"
    NUMBER = "number"
    STRING = "string"
    OP = "operator"
    MINUS = "-"
    LPAREN = "("
    RPAREN = ")"
    END = "end of rule"


@dataclass(frozen=True)
class Token:
    """One token and where it starts (0-based character offset in the rule)."""

    kind: TokenKind
    text: str
    value: Any
    pos: int


# --- the syntax tree ------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    """A column's value in each row."""

    name: str


@dataclass(frozen=True)
class Literal:
    """A constant: a float, a string or a bool."""

    value: float | str | bool


Operand = Column | Literal


@dataclass(frozen=True)
class Compare:
    """``left OP right``."""

    op: CompareOp
    left: Operand
    right: Operand


@dataclass(frozen=True)
class Not:
    """``not operand``."""

    operand: Node


@dataclass(frozen=True)
class And:
    """``left and right``."""

    left: Node
    right: Node


@dataclass(frozen=True)
class Or:
    """``left or right``."""

    left: Node
    right: Node


Node = Compare | Not | And | Or


def columns_of(node: Node) -> tuple[str, ...]:
    """The columns a tree names, in order of first mention."""
    out: dict[str, None] = {}
    stack: list[Node | Operand] = [node]
    while stack:  # iterative: a tree may be as deep as MAX_DEPTH allows on each side
        n = stack.pop()
        if isinstance(n, Column):
            out.setdefault(n.name)
        elif isinstance(n, Compare):
            stack += [n.right, n.left]
        elif isinstance(n, Not):
            stack.append(n.operand)
        elif isinstance(n, And | Or):
            stack += [n.right, n.left]
    return tuple(out)


def text_comparisons(node: Node) -> tuple[tuple[str, str], ...]:
    """(column, text) of each ``==`` or ``!=`` between a column and a quoted string, in
    order of first mention: the comparisons that match nothing when the text is misspelt."""
    out: dict[tuple[str, str], None] = {}
    stack: list[Node] = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Compare):
            if n.op in (CompareOp.EQ, CompareOp.NE) and (pair := _column_text(n)) is not None:
                out.setdefault(pair)
        elif isinstance(n, Not):
            stack.append(n.operand)
        else:
            stack += [n.right, n.left]
    return tuple(out)


def _column_text(node: Compare) -> tuple[str, str] | None:
    """(column, text) where ``node`` compares a column with a string literal."""
    for a, b in ((node.left, node.right), (node.right, node.left)):
        if isinstance(a, Column) and isinstance(b, Literal) and isinstance(b.value, str):
            return a.name, b.value
    return None


@dataclass(frozen=True)
class Rule:
    """One parsed ``--fail-on`` rule: the text as given, an optional table scope, the tree."""

    text: str
    scope: str | None
    expr: Node

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns the rule names, in order of first mention."""
        return columns_of(self.expr)

    @property
    def text_comparisons(self) -> tuple[tuple[str, str], ...]:
        """(column, text) of each equality or inequality with a quoted string."""
        return text_comparisons(self.expr)


# --- tokenizer ------------------------------------------------------------------------------

def _fail(rule: str, pos: int, what: str) -> ExpressionError:
    return ExpressionError(f"cannot parse rule {rule!r} at character {pos + 1}: {what}; "
                           f"{GRAMMAR_HINT}")


def _string(text: str, start: int) -> tuple[str, int]:
    """The string literal opening at ``start``; returns its value and the index after it."""
    quote, i, out = text[start], start + 1, list[str]()
    while i < len(text):
        ch = text[i]
        if ch == quote:
            return "".join(out), i + 1
        if ch == "\\":
            if i + 1 >= len(text) or text[i + 1] not in _ESCAPES:
                raise _fail(text, i, "unknown escape in a string (use \\\\, \\\", \\', \\n, \\t)")
            out.append(_ESCAPES[text[i + 1]])
            i += 2
            continue
        out.append(ch)
        i += 1
    raise _fail(text, start, "string never closed")


def tokenize(text: str, offset: int = 0) -> Iterator[Token]:
    """The tokens of ``text`` from ``offset``, ending with an END token."""
    i = offset
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in "<>=!":
            two = text[i:i + 2]
            if two in ("<=", ">=", "==", "!="):
                yield Token(TokenKind.OP, two, CompareOp(two), i)
                i += 2
            elif ch in "<>":
                yield Token(TokenKind.OP, ch, CompareOp(ch), i)
                i += 1
            else:
                hint = "use == for equality" if ch == "=" else "use != or not"
                raise _fail(text, i, f"unexpected {ch!r} ({hint})")
        elif ch == "(":
            yield Token(TokenKind.LPAREN, ch, None, i)
            i += 1
        elif ch == ")":
            yield Token(TokenKind.RPAREN, ch, None, i)
            i += 1
        elif ch == "-":
            yield Token(TokenKind.MINUS, ch, None, i)
            i += 1
        elif ch in "\"'":
            value, end = _string(text, i)
            yield Token(TokenKind.STRING, text[i:end], value, i)
            i = end
        elif m := _NUMBER.match(text, i):
            end = m.end()
            if end < len(text) and (text[end].isalnum() or text[end] in "_."):
                raise _fail(text, i, f"malformed number {text[i:end + 1]!r}")
            yield Token(TokenKind.NUMBER, m.group(), float(m.group()), i)
            i = end
        elif m := _NAME.match(text, i):
            yield Token(TokenKind.NAME, m.group(), m.group(), i)
            i = m.end()
        else:
            hint = {"&": " (use and)", "|": " (use or)"}.get(ch, "")
            raise _fail(text, i, f"unexpected {ch!r}{hint}")
    yield Token(TokenKind.END, "", None, len(text))


# --- parser ---------------------------------------------------------------------------------

class _Parser:
    def __init__(self, text: str, offset: int) -> None:
        self.text = text
        self.tokens = list(tokenize(text, offset))
        self.i = 0

    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def take(self) -> Token:
        tok = self.tokens[self.i]
        self.i = min(self.i + 1, len(self.tokens) - 1)
        return tok

    def is_word(self, word: str) -> bool:
        return self.tok.kind is TokenKind.NAME and self.tok.text == word

    def expected(self, what: str) -> ExpressionError:
        got = self.tok.kind.value if self.tok.kind is TokenKind.END else repr(self.tok.text)
        return _fail(self.text, self.tok.pos, f"expected {what}, found {got}")

    def parse(self) -> Node:
        node = self.expr(0)
        if self.tok.kind is not TokenKind.END:
            raise self.expected("and, or or the end of the rule")
        return node

    def expr(self, depth: int) -> Node:
        node = self.conj(depth)
        while self.is_word("or"):
            self.take()
            node = Or(node, self.conj(depth))
        return node

    def conj(self, depth: int) -> Node:
        node = self.neg(depth)
        while self.is_word("and"):
            self.take()
            node = And(node, self.neg(depth))
        return node

    def neg(self, depth: int) -> Node:
        if depth >= MAX_DEPTH:
            raise _fail(self.text, self.tok.pos, f"nested deeper than {MAX_DEPTH} levels")
        if self.is_word("not"):
            self.take()
            return Not(self.neg(depth + 1))
        if self.tok.kind is TokenKind.LPAREN:
            self.take()
            node = self.expr(depth + 1)
            if self.tok.kind is not TokenKind.RPAREN:
                raise self.expected("')'")
            self.take()
            return node
        return self.comparison()

    def comparison(self) -> Compare:
        left = self.operand()
        if self.tok.kind is not TokenKind.OP:
            raise self.expected("a comparison (< <= > >= == !=)")
        op = self.take().value
        return Compare(op, left, self.operand())

    def operand(self) -> Operand:
        tok = self.tok
        if tok.kind is TokenKind.MINUS:
            self.take()
            if self.tok.kind is TokenKind.NUMBER:
                return Literal(-self.take().value)
            if self.is_word("inf"):
                self.take()
                return Literal(-math.inf)
            raise self.expected("a number after '-'")
        if tok.kind is TokenKind.NUMBER:
            return Literal(self.take().value)
        if tok.kind is TokenKind.STRING:
            return Literal(self.take().value)
        if tok.kind is TokenKind.NAME:
            if tok.text in ("and", "or", "not"):
                raise self.expected("a column, number or quoted string")
            self.take()
            if tok.text in ("true", "false"):
                return Literal(tok.text == "true")
            if tok.text == "inf":
                return Literal(math.inf)
            return Column(tok.text)
        raise self.expected("a column, number or quoted string")


def parse_rule(text: str) -> Rule:
    """Parse one ``--fail-on`` rule; raise :class:`ExpressionError` with the position if it
    is malformed."""
    if not isinstance(text, str):
        raise ExpressionError(f"a rule must be text, not {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"rule of {len(text)} characters is longer than {MAX_LENGTH}; "
                              "split it into several --fail-on rules")
    scope = None
    offset = 0
    if m := _SCOPE.match(text):
        scope, offset = m.group(1), m.end()
    if not text[offset:].strip():
        raise _fail(text, offset, "empty rule")
    expr = _Parser(text, offset).parse()
    if not columns_of(expr):
        raise ExpressionError(f"rule {text!r} names no column, so no row can break it; "
                              f"{GRAMMAR_HINT}")
    return Rule(text, scope, expr)


# --- evaluation -----------------------------------------------------------------------------

class Kind(enum.StrEnum):
    """What kind of values a column or literal holds, for type checks."""

    NUMBER = "number"
    TEXT = "text"
    BOOL = "true/false"
    NULL = "null"


@dataclass(frozen=True)
class Truth:
    """Three-valued logic over rows: ``known`` rows have the value ``value``."""

    value: np.ndarray
    known: np.ndarray

    @property
    def matches(self) -> np.ndarray:
        """Rows where the rule is known to be true."""
        return self.value & self.known


def _kind_of_series(s: pd.Series) -> Kind:
    if s.isna().all():
        return Kind.NULL
    if pd.api.types.is_bool_dtype(s.dtype):
        return Kind.BOOL
    if pd.api.types.is_numeric_dtype(s.dtype):
        return Kind.NUMBER
    if pd.api.types.is_string_dtype(s.dtype) and not pd.api.types.is_object_dtype(s.dtype):
        return Kind.TEXT
    kinds = {Kind.BOOL if isinstance(v, bool | np.bool_) else
             Kind.NUMBER if isinstance(v, int | float | np.number) else Kind.TEXT
             for v in s.dropna()}
    return kinds.pop() if len(kinds) == 1 else Kind.TEXT


def _kind_of_literal(value: float | str | bool) -> Kind:
    if isinstance(value, bool):
        return Kind.BOOL
    return Kind.TEXT if isinstance(value, str) else Kind.NUMBER


def _values(operand: Operand, frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, Kind]:
    """Values as an array, the rows where they are not null, and their kind."""
    n = len(frame)
    if isinstance(operand, Literal):
        v = operand.value
        kind = _kind_of_literal(v)
        arr = np.full(n, v, dtype=object if kind is Kind.TEXT else float if kind is Kind.NUMBER
                      else bool)
        return arr, np.ones(n, dtype=bool), kind
    s = frame[operand.name]
    kind = _kind_of_series(s)
    known = np.array(s.notna(), dtype=bool)  # a copy: pandas may hand out read-only views
    if kind is Kind.NUMBER:
        arr = pd.to_numeric(s, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
        known &= ~np.isnan(arr)  # NaN is a missing value here, as in pandas
    elif kind is Kind.BOOL:
        arr = s.fillna(False).to_numpy(dtype=bool)
    else:  # text; str() so that a stray non-string value orders without a TypeError
        arr = np.array([str(v) if k else "" for v, k in zip(s.tolist(), known, strict=True)],
                       dtype=object)
    return arr, known, kind


def _describe(operand: Operand) -> str:
    if isinstance(operand, Column):
        return f"column {operand.name!r}"
    return f"the value {operand.value!r}"


Synonyms = Mapping[tuple[str, str], frozenset[str]]
"""(column, text) → the values of the column that the text stands for, where they are more
than the text itself: ``cast == 'nvfp4'`` means the rows whose cast the report shows as
``nvfp4``, whatever canonical spec the table stores."""


def _compare(node: Compare, frame: pd.DataFrame, rule: str, synonyms: Synonyms) -> Truth:
    lv, lk, lkind = _values(node.left, frame)
    rv, rk, rkind = _values(node.right, frame)
    known = lk & rk
    if Kind.NULL in (lkind, rkind):  # an all-null column compares with anything: never true
        return Truth(np.zeros(len(frame), dtype=bool), np.zeros(len(frame), dtype=bool))
    if lkind is not rkind:
        raise ExpressionError(
            f"rule {rule!r} compares {_describe(node.left)} ({lkind.value}) with "
            f"{_describe(node.right)} ({rkind.value}); quote text values, write numbers bare "
            "and true/false for flags")
    if lkind is Kind.BOOL and node.op not in (CompareOp.EQ, CompareOp.NE):
        raise ExpressionError(f"rule {rule!r} orders true/false values with {node.op.value}; "
                              "use == or !=")
    value = np.zeros(len(frame), dtype=bool)
    pair = _column_text(node) if node.op in (CompareOp.EQ, CompareOp.NE) else None
    if pair is not None and pair in synonyms and lkind is Kind.TEXT:
        column = lv if isinstance(node.left, Column) else rv
        equal = np.isin(column[known].astype(str), sorted(synonyms[pair] | {pair[1]}))
        value[known] = equal if node.op is CompareOp.EQ else ~equal
    elif known.any():
        value[known] = np.asarray(node.op.function(lv[known], rv[known]), dtype=bool)
    return Truth(value, known)


def _evaluate(node: Node, frame: pd.DataFrame, rule: str, synonyms: Synonyms) -> Truth:
    if isinstance(node, Compare):
        return _compare(node, frame, rule, synonyms)
    if isinstance(node, Not):
        t = _evaluate(node.operand, frame, rule, synonyms)
        return Truth(~t.value, t.known)
    a, b = (_evaluate(node.left, frame, rule, synonyms),
            _evaluate(node.right, frame, rule, synonyms))
    if isinstance(node, And):
        false_a, false_b = a.known & ~a.value, b.known & ~b.value
        known = (a.known & b.known) | false_a | false_b
        return Truth(a.matches & b.matches, known)
    true_a, true_b = a.matches, b.matches
    return Truth(true_a | true_b, (a.known & b.known) | true_a | true_b)


def check_columns(rule: Rule, columns: list[str], where: str) -> None:
    """Raise :class:`ExpressionError` naming the choices if ``rule`` names a column that
    ``columns`` lacks."""
    for name in rule.columns:
        if name not in columns:
            raise ExpressionError(
                f"rule {rule.text!r} names column {name!r}, which {where} lacks"
                f"{close_matches(name, columns)} (columns: {', '.join(columns)})")


def evaluate(rule: Rule, frame: pd.DataFrame, synonyms: Synonyms | None = None) -> np.ndarray:
    """A boolean mask of the rows of ``frame`` that break ``rule`` (known true; nulls never
    match); ``synonyms`` widens what a quoted string equals (:data:`Synonyms`). Raises
    :class:`ExpressionError` for unknown columns or mismatched kinds."""
    check_columns(rule, list(frame.columns), "the table")
    return _evaluate(rule.expr, frame, rule.text, synonyms or {}).matches
