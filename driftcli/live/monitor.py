"""``drift.monitor``: the operands of every matmul of a user's own training run, measured under
what-if casts while it trains, without changing a number of the run.

::

    with drift.monitor(model, ["mxfp8_e4m3", "nvfp4"], out="runs/mon", every=10) as mon:
        for batch in data:
            loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()
            mon.step()

On a sampled step the monitor records the step's operands with :func:`driftcli.io.capture.
capture` kept in memory (the same interception table the arithmetic mode casts through, so the
operands are those a policy would cast: forward operands, weights, and the gradient reaching
each matmul's output), and at ``step()`` measures each one in every direction it feeds
(forward, dgrad, wgrad: cast along that matmul's contraction axis) under every cast at once,
with the scan the commands run (:func:`driftcli.measures.scan.scan_unit`), on the tensors' own
device. On any other step no hook is installed at all. Rows go to one Parquet table per
measurement, written in parts that each appear whole (:func:`driftcli.io.tables.write_table`),
so a run killed at any moment keeps every part flushed before. Alert rules in the report's
language are evaluated on each sampled step's rows.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from driftcli.arith.intercept import OUTSIDE, ROOT
from driftcli.choices import Device, parse_choice
from driftcli.errors import DriftError
from driftcli.io.capture import Capture, capture
from driftcli.io.dumps import ROLES, Role
from driftcli.io.readers import TensorRef
from driftcli.io.tables import provenance, read_table, write_table, write_text
from driftcli.live.operands import Layout, MemoryReader, layouts, operand_stats, oriented
from driftcli.live.tables import (
    MANIFEST,
    ROW_TYPES,
    Direction,
    Measurement,
    MonitorBlockStatsRow,
    MonitorStatsRow,
    row_columns,
    rows_frame,
    table_parts,
)
from driftcli.measures import MEASURES
from driftcli.measures.block_stats import Direction as Groups
from driftcli.measures.block_stats import direction_stats, directions, element_span
from driftcli.measures.scan import Scan, ScanOptions, TensorUnit, scan_unit
from driftcli.records.cast import Cast
from driftcli.records.castspec import parse_cast
from driftcli.records.modes import Granularity
from driftcli.report.expr import Rule, evaluate, parse_rule

Tensor = torch.Tensor

log = logging.getLogger("driftcli.monitor")
log.addHandler(logging.NullHandler())  # a library: the application decides what is shown


@dataclass(frozen=True)
class Alert:
    """One row of a sampled step that matched an alert rule."""

    step: int
    rule: str
    table: str
    tensor: str
    layer: str
    role: str
    direction: str
    cast: str | None
    column: str
    value: Any

    def line(self) -> str:
        """The one line the monitor logs."""
        under = f" under {self.cast}" if self.cast else ""
        return (f"step {self.step}: {self.layer} {self.role} ({self.tensor}, {self.direction})"
                f"{under}: {self.column} = {self.value} matches {self.rule!r}")


@dataclass(frozen=True)
class MonitorConfig:
    """What a monitor measures, where and when (``docs/monitor.md`` lists each)."""

    casts: tuple[Cast, ...]
    measurements: tuple[Measurement, ...] = (Measurement.CLIP_RATE,
                                             Measurement.UNDERFLOW_RATE,
                                             Measurement.ERROR_BIAS, Measurement.STATS)
    layers: tuple[str, ...] = ("*",)
    """Glob patterns on the layer's qualified name; a layer matching any is monitored."""
    types: tuple[type[nn.Module], ...] = ()
    """Module types; when given, only layers whose module is one of them."""
    operands: frozenset[Role] = frozenset(Role)
    directions: frozenset[Direction] = frozenset(Direction)
    every: int = 10
    start: int = 0
    end: int | None = None
    """The last step sampled (inclusive); None: no end."""
    flush_every: int = 1
    """Sampled steps per written part."""
    alerts: tuple[str, ...] = ()
    seed: int = 0
    name: str = "monitor"
    cast_names: tuple[tuple[str, str], ...] = ()
    """(canonical spec, the name given) where they differ: the report shows the names."""

    def sampled(self, step: int) -> bool:
        """Whether ``step`` is measured."""
        return (step >= self.start and (self.end is None or step <= self.end)
                and (step - self.start) % self.every == 0)


@dataclass
class _Operand:
    """One recorded tensor of a sampled step."""

    name: str
    tensor: Tensor
    role: Role
    layer: str
    operand: str
    transposed: bool


class Monitor:
    """Measures a model's matmul operands on sampled steps (made by :func:`monitor`).

    Use it as a context manager with ``step()`` at the end of every training step, or call
    ``start()``, ``step()`` and ``close()`` yourself. ``rows(measurement)`` holds every row so
    far as a DataFrame; with ``out`` each table is also written there in parts."""

    def __init__(self, model: nn.Module, config: MonitorConfig, out: Path | None,
                 on_alert: Callable[[Alert], None] | None) -> None:
        self.model = model
        self.config = config
        self.out = out
        self.on_alert = on_alert
        self.alerts: list[Alert] = []
        self.current = 0
        self.unrecorded: dict[str, int] = {}
        self._rules: list[Rule] = [parse_rule(r) for r in config.alerts]
        self._rows: dict[Measurement, list[Any]] = {m: [] for m in config.measurements}
        self._pending: dict[Measurement, list[Any]] = {m: [] for m in config.measurements}
        self._pending_steps = 0
        self._capture: Capture | None = None
        self._started = False
        self._closed = False
        self._prov: dict[str, Any] = {}
        self._modules = dict(model.named_modules())
        self._listeners: list[Callable[[int, Mapping[Measurement, list[Any]]], None]] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, step: int = 0) -> Monitor:
        """Begin at ``step`` (the monitor counts the steps it is told of, from ``step``: a
        resumed run's)."""
        if self._started:
            raise DriftError("a monitor can be started only once; call drift.monitor() again")
        self._started = True
        self.current = step
        if self.out is not None:
            if (self.out / MANIFEST).exists():
                raise DriftError(f"monitor: {self.out} holds a monitor run already; give another "
                                 "out folder, or remove it to start again")
            self._prov = provenance(seed=self.config.seed, device=self._device().value,
                                    extra={"monitor": self._manifest(),
                                           "names": {"cast": dict(self.config.cast_names)}})
            write_text(self.out / MANIFEST, json.dumps(self._manifest(), indent=1) + "\n")
        self._arm()
        return self

    def step(self) -> None:
        """End the current training step (measure it, if sampled) and begin the next."""
        self.end_step()
        self.begin_step()

    def end_step(self) -> None:
        """End the current training step: measure it if it was sampled, remove the hooks, and
        count it. Until :meth:`begin_step` nothing is recorded (a trainer's evaluation)."""
        self._check_open("end_step")
        if self._capture is not None:
            cap, self._capture = self._capture, None
            cap.__exit__(None, None, None)
            self._measure(cap)
        self.current += 1

    def begin_step(self) -> None:
        """Begin the current training step: install the hooks if it is sampled (once)."""
        self._check_open("begin_step")
        if self._capture is None:
            self._arm()

    def _check_open(self, what: str) -> None:
        if not self._started or self._closed:
            raise DriftError(f"monitor.{what}() outside the monitor; enter it with 'with' or "
                             "call start() first")

    def close(self) -> None:
        """Stop: remove the hooks (an unfinished step is not measured) and write what is
        left."""
        if self._closed:
            return
        self._closed = True
        if self._capture is not None:
            cap, self._capture = self._capture, None
            cap.__exit__(RuntimeError, RuntimeError("closed"), None)  # records discarded
        self.flush()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def add_listener(self, listener: Callable[[int, Mapping[Measurement, list[Any]]], None]
                     ) -> None:
        """Call ``listener(step, rows)`` after each sampled step is measured (the rows of that
        step, per measurement): TensorBoard scalars, a trainer's log."""
        self._listeners.append(listener)

    # -- rows --------------------------------------------------------------------------------

    def rows(self, measurement: Measurement | str) -> Any:
        """Every row of ``measurement`` so far, as a pandas DataFrame in the table's
        columns."""
        m = parse_choice(Measurement, measurement, "measurement")
        if m not in self._rows:
            raise DriftError(f"monitor: {m.value} is not measured; add it to measurements")
        if self.out is None:
            return rows_frame(ROW_TYPES[m], self._rows[m])
        import pandas as pd

        # with a folder the rows live there (a long run's would fill the memory): the parts
        # written, then the rows not yet written
        parts = [read_table(p)[0] for p in table_parts(self.out / ROW_TYPES[m].TABLE)]
        return pd.concat([*parts, rows_frame(ROW_TYPES[m], self._pending[m])], ignore_index=True)

    def flush(self) -> None:
        """Write the rows not yet written, one part per table (each file whole or absent)."""
        if self.out is None or not self._pending_steps:
            return
        for m, rows in self._pending.items():
            if rows:
                path = self.out / ROW_TYPES[m].TABLE / f"part-{rows[0].step:09d}.parquet"
                write_table(path, ROW_TYPES[m], rows, self._prov)
            self._pending[m] = []
        self._pending_steps = 0

    # -- internals ---------------------------------------------------------------------------

    def _device(self) -> Device:
        p = next(self.model.parameters(), None)
        return Device.CUDA if p is not None and p.is_cuda else Device.CPU

    def _manifest(self) -> dict[str, Any]:
        c = self.config
        return {"name": c.name, "casts": [str(x) for x in c.casts],
                "measurements": [m.value for m in c.measurements],
                "tables": {m.value: ROW_TYPES[m].TABLE for m in c.measurements},
                "layers": list(c.layers), "types": [t.__name__ for t in c.types],
                "operands": sorted(r.value for r in c.operands),
                "directions": sorted(d.value for d in c.directions), "every": c.every,
                "start": c.start, "end": c.end, "alerts": list(c.alerts)}

    def _arm(self) -> None:
        """Install the hooks for the current step if it is sampled; else none."""
        if self.config.sampled(self.current):
            roles = [r.value for r in self.config.operands]
            self._capture = capture(self.model, None, roles=roles, step=self.current)
            self._capture.__enter__()

    def _wanted(self, layer: str) -> bool:
        c = self.config
        if not any(fnmatch.fnmatchcase(layer, p) for p in c.layers):
            return False
        if not c.types:
            return True
        module = self.model if layer == ROOT else None if layer == OUTSIDE else \
            self._modules.get(layer)
        return module is not None and isinstance(module, c.types)

    def _measure(self, cap: Capture) -> None:
        for name, count in cap.unrecorded.items():
            self.unrecorded[name] = self.unrecorded.get(name, 0) + count
        ops = [_Operand(n, cap.tensors[n], e.role, e.layer, e.operand, n in cap.transposed)
               for n, e in cap.entries.items() if self._wanted(e.layer)]
        step_rows: dict[Measurement, list[Any]] = {m: [] for m in self.config.measurements}
        for op in ops:
            for lay in layouts(op.operand, op.transposed):
                if lay.direction not in self.config.directions:
                    continue
                got = oriented(op.tensor, lay)
                if got is not None:
                    self._measure_one(op, lay, *got, step_rows)
        for m, rows in step_rows.items():
            if self.out is None:
                self._rows[m].extend(rows)
            self._pending[m].extend(rows)
        self._pending_steps += 1
        self._alert(step_rows)
        for listener in self._listeners:
            listener(self.current, step_rows)
        if self._pending_steps >= self.config.flush_every:
            self.flush()

    def _measure_one(self, op: _Operand, lay: Layout, x: Tensor, axis: int,
                     out: dict[Measurement, list[Any]]) -> None:
        base: dict[str, Any] = {
            "tensor": op.name, "role": op.role.value, "layer": op.layer, "operand": lay.token,
            "step": self.current, "direction": lay.direction.value}
        if Measurement.STATS in out:
            out[Measurement.STATS].append(MonitorStatsRow(
                source=self.config.name, **base, dtype=str(x.dtype).removeprefix("torch."),
                shape=json.dumps(list(x.shape)), **operand_stats(x, axis)))
        if Measurement.BLOCK_STATS in out:
            out[Measurement.BLOCK_STATS].extend(self._block_rows(op, lay, x, axis))
        cast_measures = [m for m in self.config.measurements
                         if m not in (Measurement.STATS, Measurement.BLOCK_STATS)]
        if not cast_measures:
            return
        ref = TensorRef(self.config.name, op.name, str(x.dtype).removeprefix("torch."),
                        tuple(x.shape), op.role.value, op.layer, lay.token, self.current,
                        _reader=MemoryReader(x))
        device = Device.CUDA if x.is_cuda else Device.CPU
        options = ScanOptions(axis=axis, seed=self.config.seed, device=device,
                              draws=8 if Measurement.ERROR_BIAS in cast_measures else 1)
        rounded = any(MEASURES[m.value].rounded for m in cast_measures)
        results = tuple(scan_unit(TensorUnit(self.config.name, ref, self.config.casts, options,
                                             rounded)))
        found = Scan(results, {}, (), names=dict(self.config.cast_names))
        for m in cast_measures:
            for row in MEASURES[m.value].rows(found, totals=False):
                out[m].append(ROW_TYPES[m](**row_columns(row), direction=lay.direction.value))

    def _block_rows(self, op: _Operand, lay: Layout, x: Tensor, axis: int
                    ) -> list[MonitorBlockStatsRow]:
        """block-stats of ``x`` along ``axis`` under every cast: the rows of ``x`` turned so
        the axis is last (a tile or tensor scale has the same groups either way)."""
        rows = x.movedim(axis, -1)
        out = []
        for c in self.config.casts:
            s = c.scaling
            base: dict[str, Any] = {
                "source": self.config.name, "tensor": op.name, "layer": op.layer,
                "dtype": str(x.dtype).removeprefix("torch."), "shape": json.dumps(list(x.shape)),
                "cast": str(c), "format": c.format.name,
                "scale_format": s.scale_format.name if s.scale_format else "",
                "granularity": s.granularity.value, "block": s.block,
                "direction": lay.direction.value, "role": op.role.value, "operand": lay.token,
                "step": self.current}
            try:
                groups = directions(c, rows.dim())[0] if c.scaling.granularity in (
                    Granularity.TENSOR, Granularity.TILE) else Groups.ROWS
                cols, _ = direction_stats(rows, c, groups)
                out.append(MonitorBlockStatsRow(**base, **cols, error=None))
            except DriftError as err:  # a cast block-stats does not model: a row saying so
                nulls: dict[str, Any] = {
                    f.name: None for f in dataclasses.fields(MonitorBlockStatsRow)
                    if f.name not in base and f.name not in ("element_span", "error")}
                out.append(MonitorBlockStatsRow(**base, **nulls,
                                                element_span=element_span(c.format),
                                                error=str(err)))
        return out

    def _alert(self, step_rows: Mapping[Measurement, list[Any]]) -> None:
        if not self._rules:
            return
        import pandas as pd

        for rule in self._rules:
            for m, rows in step_rows.items():
                table = ROW_TYPES[m].TABLE
                if rule.scope is not None and rule.scope not in (table, m.value):
                    continue
                if not rows:
                    continue
                frame = pd.DataFrame([row_columns(r) for r in rows])
                if not set(rule.columns) <= set(frame.columns):
                    continue  # a rule about another table's columns
                hits = evaluate(rule, frame)
                col = rule.columns[0]
                for i in hits.nonzero()[0]:
                    r = rows[int(i)]
                    alert = Alert(self.current, rule.text, table, r.tensor, r.layer, r.role,
                                  r.direction, getattr(r, "cast", None), col,
                                  getattr(r, col))
                    self.alerts.append(alert)
                    log.warning("%s", alert.line())
                    if self.on_alert is not None:
                        self.on_alert(alert)


def _tuple(value: Any, what: str) -> tuple[Any, ...]:
    if isinstance(value, str | type):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise DriftError(f"monitor: {what} must be one value or a list, not "
                         f"{type(value).__name__}") from None


def monitor(model: nn.Module, casts: str | Cast | Sequence[str | Cast], *,
            out: str | Path | None = None, every: int = 10, start: int = 0,
            end: int | None = None,
            measurements: Iterable[str | Measurement] | str = (
                "clip-rate", "underflow-rate", "error-bias", "stats"),
            layers: Iterable[str] | str = ("*",),
            types: Iterable[type[nn.Module]] | type[nn.Module] = (),
            operands: Iterable[str | Role] | str = ROLES,
            directions: Iterable[str | Direction] | str = tuple(Direction),
            alerts: Iterable[str] | str = (), on_alert: Callable[[Alert], None] | None = None,
            flush_every: int = 1, seed: int = 0, name: str = "monitor") -> Monitor:
    """A :class:`Monitor` of ``model``'s matmul operands under ``casts`` on every ``every``-th
    step from ``start`` to ``end`` (docs/monitor.md).

    ``layers`` (glob patterns on qualified module names) and ``types`` (module classes) pick
    the layers; ``operands`` (``activation``, ``weight``, ``gradient``) and ``directions``
    (``forward``, ``dgrad``, ``wgrad``) what is measured of each; ``measurements`` which
    tables. ``out`` is a folder the tables are written to, in parts every ``flush_every``
    sampled steps; without it the rows stay in memory (``Monitor.rows``). ``alerts`` are
    rules in the report's language (``clip_rate > 0.01``), checked on each sampled step's
    rows: a match is logged (logger ``driftcli.monitor``) and passed to ``on_alert``.
    """
    if not isinstance(model, nn.Module):
        raise DriftError(f"monitor needs a torch.nn.Module, got {type(model).__name__}")
    for label, v, least in (("every", every, 1), ("start", start, 0),
                            ("flush_every", flush_every, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise DriftError(f"monitor: {label} must be an int of at least {least}, not {v!r}")
    if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < start):
        raise DriftError(f"monitor: end must be None or an int of at least start, not {end!r}")
    given = _tuple(casts if not isinstance(casts, Cast) else (casts,), "casts")
    parsed = tuple(parse_cast(c) for c in given)
    names = tuple((str(c), g) for g, c in zip(given, parsed, strict=True)
                  if isinstance(g, str) and str(c) != g)
    if not parsed:
        raise DriftError("monitor: no cast given; name one, e.g. mxfp8_e4m3")
    kinds = tuple(dict.fromkeys(parse_choice(Measurement, m, "measurement")
                                for m in _tuple(measurements, "measurements")))
    chosen_types = _tuple(types, "types")
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in chosen_types):
        raise DriftError("monitor: types must be nn.Module classes (nn.Linear)")
    config = MonitorConfig(
        casts=parsed, measurements=kinds, layers=tuple(str(p) for p in _tuple(layers, "layers")),
        types=chosen_types,
        operands=frozenset(parse_choice(Role, r, "operand") for r in _tuple(operands, "operands")),
        directions=frozenset(parse_choice(Direction, d, "direction")
                             for d in _tuple(directions, "directions")),
        every=every, start=start, end=end, flush_every=flush_every,
        alerts=tuple(_tuple(alerts, "alerts")), seed=seed, name=name, cast_names=names)
    return Monitor(model, config, None if out is None else Path(out), on_alert)
