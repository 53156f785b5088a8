"""drift's IEEE P3109 formats against the outside: the P3109 public repository's value tables
(a CSV of every code of every binaryKpP) and, optionally, gfloat's ``round_float`` on boundary
inputs. Neither is part of drift: pass the folders of copies fetched outside the repository.

    git -C P3109/Public archive HEAD "Value Tables/Hexadecimal" | tar -x -C /tmp/p3109
    git -C graphcore-research/gfloat archive HEAD src | tar -x -C /tmp/gfloat
    pip install --target /tmp/gfdeps --no-deps array-api-compat   # gfloat imports it
    PYTHONPATH=.:/tmp/gfdeps python benchmarks/conformance_p3109.py \\
        "/tmp/p3109/Value Tables/Hexadecimal" \\
        --gfloat /tmp/gfloat/src

Prints, per K, the tables read, the codes compared and the differences (each difference
listed), then the gfloat rounding comparison; exits 1 on any difference. docs/formats.md
records the numbers with the references' commits.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import re
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from driftcli import oracle
from driftcli.casts import codec, rounding
from driftcli.errors import FormatSpecError
from driftcli.records.formats import Exact, Format, Kind, p3109
from driftcli.records.modes import Overflow, Rounding

_NAME = re.compile(r"Binary(\d+)p(\d+)([su])([ef])\.csv")
_HEX = re.compile(r"(-?)0x([0-9a-f]+)(?:\.([0-9a-f]*))?p([+-]?\d+)")


def parse_value(text: str) -> Exact:
    """A table cell (``0x1.cp+7``, ``-0x0.4p-8``, ``Inf``, ``-Inf``, ``NaN``) exactly."""
    t = text.strip().lower()
    if t == "nan":
        return Exact(Kind.NAN)
    if t in ("inf", "+inf", "-inf"):
        return Exact(Kind.INF, t.startswith("-"))
    m = _HEX.fullmatch(t)
    if m is None:
        raise ValueError(f"cannot read the table value {text!r}")
    frac = m[3] or ""
    mag = Fraction(int(m[2] + frac, 16), 16 ** len(frac)) * Fraction(2) ** int(m[4])
    return Exact(Kind.FINITE, m[1] == "-", mag)


def _same(a: Exact, b: Exact) -> bool:
    return a == b or (a.kind is Kind.NAN and b.kind is Kind.NAN)


def compare_tables(root: Path, max_k: int) -> tuple[dict[int, list[int]], list[str]]:
    """Per K: ``[tables, codes compared, differences, tables drift refuses]``; the differences.

    Each code is compared twice: drift's exact decoding and its vectorized codec (finite values
    as float32; every value of a format drift builds is one)."""
    per_k: dict[int, list[int]] = {}
    diffs: list[str] = []
    for path in sorted(root.rglob("Binary*.csv")):
        m = _NAME.fullmatch(path.name)
        if m is None or int(m[1]) > max_k:
            continue
        k, p = int(m[1]), int(m[2])
        row = per_k.setdefault(k, [0, 0, 0, 0])
        try:
            fmt = p3109(k, p, m[3] == "s", m[4] == "e")
        except FormatSpecError:
            row[3] += 1
            continue
        row[0] += 1
        with path.open(newline="") as f:
            table = [(int(r["codepoint"], 16), parse_value(r["value"]))
                     for r in csv.DictReader(f)]
        codes = [c for c, _ in table]
        if sorted(codes) != list(range(1 << k)):
            diffs.append(f"{path.name}: the table does not list every code once")
        fast_values = codec.decode(torch.tensor(codes), fmt).tolist()
        for (code, want), got_fast in zip(table, fast_values, strict=True):
            row[1] += 1
            got = fmt.decode(code)
            fast_ok = (got_fast != got_fast) if want.kind is Kind.NAN else \
                got_fast == (float(want.value) if want.kind is Kind.FINITE
                             else float("-inf") if want.negative else float("inf"))
            if not _same(got, want) or not fast_ok:
                row[2] += 1
                diffs.append(f"{fmt.name} {code:#x}: table {want}, drift {got} / {got_fast}")
    return per_k, diffs


def _gfloat_modes(gf: Any) -> dict[Rounding, Any]:
    rm = gf.RoundMode
    return {Rounding.RNE: rm.TiesToEven, Rounding.RNA: rm.TiesToAway,
            Rounding.RTZ: rm.TowardZero, Rounding.RUP: rm.TowardPositive,
            Rounding.RDOWN: rm.TowardNegative}


def _boundary_inputs(fmt: Format) -> list[float]:
    """Every finite value, the midpoints of neighbours and the float32s either side of each,
    both signs, beyond max, ±inf, ±0: where a rounding goes wrong first."""
    values = sorted({v.mag for _, v in fmt.values() if v.kind is Kind.FINITE})
    points = set(values)
    for lo, hi in itertools.pairwise(values):
        points.add((lo + hi) / 2)
    points.add(values[-1] * 2)
    out: list[float] = []
    for v in points:
        f = torch.tensor(float(v), dtype=torch.float32)
        for x in (f, torch.nextafter(f, torch.tensor(float("inf"))),
                  torch.nextafter(f, torch.tensor(0.0))):
            out += [float(x), -float(x)]
    return [*sorted(set(out)), float("inf"), float("-inf")]


def compare_gfloat(gfloat_src: Path, max_k: int) -> tuple[int, dict[str, int], list[str]]:
    """drift's fast path and oracle against gfloat's ``round_float`` on boundary inputs, for
    every P3109 format of K <= max_k, five roundings, SatFinite (``saturate``) and OvfInf
    (``ieee``). Returns the cases compared, differences by (format, mode), a few of them.
    Negative inputs to unsigned formats are left out: gfloat does not define them."""
    sys.path.insert(0, str(gfloat_src))
    import gfloat  # an outside copy, never a dependency of drift
    from gfloat.formats import format_info_p3109

    modes = _gfloat_modes(gfloat)
    compared, by_cell, samples = 0, {}, []
    for k in range(3, max_k + 1):
        for signed in (True, False):
            for p in range(1, k + (not signed)):
                for extended in (True, False):
                    fmt = p3109(k, p, signed, extended)
                    fi = format_info_p3109(
                        k, p, gfloat.Signedness.Signed if signed else gfloat.Signedness.Unsigned,
                        gfloat.Domain.Extended if extended else gfloat.Domain.Finite)
                    xs = [x for x in _boundary_inputs(fmt) if signed or x >= 0]
                    t = torch.tensor(xs, dtype=torch.float32)
                    for mode, gmode in modes.items():
                        for policy in Overflow:
                            ours = rounding.round_to_format(t, fmt, rounding=mode,
                                                            overflow=policy).tolist()
                            for x, got in zip(xs, ours, strict=True):
                                want = float(gfloat.round_float(
                                    fi, x, gmode, sat=policy is Overflow.SATURATE))
                                exact = oracle.rounding.round_exact(
                                    fmt, Exact(Kind.INF, x < 0) if abs(x) == float("inf")
                                    else Exact.of(Fraction(x)), mode, policy)
                                compared += 1
                                same = (want != want and got != got) or want == got
                                if not same or (exact.kind is Kind.FINITE
                                                and float(exact.value) != got):
                                    key = f"{fmt.name} {mode.value}"
                                    by_cell[key] = by_cell.get(key, 0) + 1
                                    if len(samples) < 12:
                                        samples.append(f"{fmt.name} {mode.value} {policy.value} "
                                                       f"{x!r}: gfloat {want!r}, drift {got!r}")
    return compared, by_cell, samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", type=Path, help="the value tables' Hexadecimal folder")
    parser.add_argument("--max-k", type=int, default=8, help="widest K compared (default 8)")
    parser.add_argument("--gfloat", type=Path, help="gfloat's src folder (optional)")
    args = parser.parse_args()
    per_k, diffs = compare_tables(args.tables, args.max_k)
    for k, (tables, codes, bad, refused) in sorted(per_k.items()):
        print(f"K={k}: {tables} tables, {codes} codes compared, {bad} differences"
              + (f" ({refused} tables outside float32's range, refused)" if refused else ""))
    total = [sum(r[i] for r in per_k.values()) for i in range(3)]
    print(f"all: {total[0]} tables, {total[1]} codes, {total[2]} differences")
    for d in diffs[:40]:
        print("  ", d)
    failed = bool(diffs)
    if args.gfloat is not None:
        compared, by_cell, samples = compare_gfloat(args.gfloat, args.max_k)
        print(f"gfloat round_float: {compared} roundings compared, "
              f"{sum(by_cell.values())} differences")
        for cell, n in sorted(by_cell.items()):
            print(f"   {cell}: {n}")
        for s in samples:
            print("  ", s)
        failed = failed or bool(by_cell)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
