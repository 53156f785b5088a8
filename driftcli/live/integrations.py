"""``drift.monitor`` in the loops people train with: a Hugging Face ``TrainerCallback`` and
TensorBoard scalars (docs/monitor.md#integrations). Neither library is needed to import this
module: each is imported when its function is called."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from driftcli.errors import DriftError
from driftcli.live.monitor import Monitor, monitor
from driftcli.live.tables import ROW_TYPES, Measurement


class ScalarWriter(Protocol):
    """What TensorBoard scalars are written to (``torch.utils.tensorboard.SummaryWriter``)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...


def scalars(writer: ScalarWriter) -> Callable[[int, Mapping[Measurement, list[Any]]], None]:
    """A :meth:`Monitor.add_listener` listener writing each sampled step's headline values to
    ``writer``, one scalar per operand, direction and cast:
    ``drift/TABLE/HEADLINE/CAST/TENSOR/DIRECTION`` (``drift/monitor-clip-rate/clip_rate/
    mxfp8_e4m3/blocks.0.up/weight/forward``); null values are left out."""

    def write(step: int, rows: Mapping[Measurement, list[Any]]) -> None:
        for m, found in rows.items():
            row_type = ROW_TYPES[m]
            head = row_type.HEADLINE
            for r in found:
                value = getattr(r, head)
                if value is None:
                    continue
                cast = getattr(r, "cast", None)
                where = f"{cast}/" if cast is not None else ""
                writer.add_scalar(f"drift/{row_type.TABLE}/{head}/{where}{r.tensor}/"
                                  f"{r.direction}", float(value), step)

    return write


def tensorboard(mon: Monitor, log_dir: str | Path) -> Any:
    """Write ``mon``'s headline values as TensorBoard scalars under ``log_dir`` (needs the
    ``tensorboard`` package); returns the ``SummaryWriter`` (close it after training)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise DriftError("TensorBoard scalars need the tensorboard package: pip install "
                         "tensorboard (drift.monitor's tables need nothing more)") from None
    writer = SummaryWriter(str(log_dir))
    mon.add_listener(scalars(writer))
    return writer


def hf_callback(casts: Any, **options: Any) -> Any:
    """A Hugging Face ``TrainerCallback`` monitoring the trained model: ``drift.monitor(model,
    casts, **options)`` started at the beginning of training, each optimizer step a monitor
    step (the hooks installed at ``on_step_begin``, so the trainer's evaluations in between
    are not recorded), closed at the end. ``callback.monitor`` is the :class:`Monitor`."""
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise DriftError("hf_callback needs transformers: pip install transformers") from None

    class DriftMonitorCallback(TrainerCallback):
        """drift.monitor on a Trainer's model (see :func:`hf_callback`)."""

        def __init__(self) -> None:
            self.monitor: Monitor | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           **kwargs: Any) -> None:
            if model is None:
                raise DriftError("hf_callback: the trainer passed no model to the callback")
            self.monitor = monitor(model, casts, **options)
            self.monitor.start(state.global_step)  # a resumed run goes on counting

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.monitor is not None:
                self.monitor.begin_step()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.monitor is not None:
                self.monitor.end_step()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.monitor is not None:
                self.monitor.close()

    return DriftMonitorCallback()
