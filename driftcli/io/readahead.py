"""Reading a scan's tensors: into one reused staging buffer (:class:`Staging`), or one read
ahead of the pass on a reader thread (:class:`ReadAhead`, double buffering).

A scan knows every read it will make before it makes the first (which rows of which tensor,
in which order: :class:`Read`), so a reader thread can fill one buffer with the next read
while the pass counts the other: the scan then takes about the longer of the read and the
pass, not their sum. At most two reads are held at once (the one the pass counts and the next),
so memory stays within two of the largest read. The reads, their order and their bytes are the
same either way; a read that fails raises, on the scan's thread, where that read is taken, as
it would have raised there, and the reads of its tensor that were to follow are not made.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from driftcli.io.readers.core import TensorRef


@dataclass(frozen=True)
class Read:
    """One read of a scan: rows ``[start, stop)`` of a tensor (all of a 0-d one) into a
    buffer of at least ``nbytes`` bytes."""

    start: int
    stop: int
    nbytes: int
    amax: bool = False
    """Also the rows' largest finite magnitude, taken as they land (the first read of the
    casts that need a tensor's amax: on the reader thread where the read is ahead)."""

    def of(self, ref: TensorRef, into: torch.Tensor) -> torch.Tensor:
        """The rows, read from ``ref`` into the front of ``into`` where its reader reads
        bytes (see :meth:`TensorRef.read`)."""
        return ref.read(self.start, self.stop, into=into) if ref.shape else ref.read(into=into)


Taken = tuple[torch.Tensor, float | None]
"""The rows of a read, valid until the next take, and their amax where the read asks for it
(:attr:`Read.amax`) and the reads were given the function for it."""

AmaxOf = Callable[[torch.Tensor], float]
"""The largest finite magnitude of rows, as the scan's casts read it (given by the scan: this
layer holds no cast's arithmetic)."""


class Reads(Protocol):
    """Where a scan takes its reads from, in the order it planned them."""

    def take(self, ref: TensorRef, read: Read) -> Taken:
        """The rows of ``read``, and their amax where it asks for it (:data:`Taken`)."""
        ...

    def done(self, key: Hashable) -> None:
        """The scan is done with the tensor ``key`` (its reads not taken are dropped)."""
        ...


class Staging:
    """One byte buffer every read of a scan goes into, grown to the largest read: memory
    already touched reads several times faster than fresh pages (docs/performance-history.md).
    Reads here are made when taken, on the caller's thread; ``amax_of`` takes the amax of the
    reads that ask for it."""

    def __init__(self, amax_of: AmaxOf | None = None) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.amax_of = amax_of

    def at_least(self, n: int) -> torch.Tensor:
        """The buffer, grown to ``n`` bytes where it is smaller."""
        if self.buf.numel() < n:
            self.buf = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.buf = torch.empty(n, dtype=torch.uint8)
        return self.buf

    def take(self, ref: TensorRef, read: Read) -> Taken:
        return landed(read.of(ref, self.at_least(read.nbytes)), read, self.amax_of)

    def done(self, key: Hashable) -> None:
        pass


def landed(rows: torch.Tensor, read: Read, amax_of: AmaxOf | None) -> Taken:
    """The rows of ``read`` as taken: with their amax where it asks and ``amax_of`` is given."""
    return rows, amax_of(rows) if read.amax and amax_of is not None else None


@dataclass(frozen=True)
class Job:
    """One read a :class:`ReadAhead` makes: of tensor ``ref``, the scan's tensor ``key``."""

    key: Hashable
    ref: TensorRef
    read: Read


class PlanMismatch(RuntimeError):
    """A scan took another read than the next it planned: a bug in drift, not in the input."""


class ReadAhead:
    """The reads ``jobs``, made in order on a reader thread one ahead of :meth:`take`, into
    two staging buffers taken in turn, with the amax of those that ask for it (``amax_of``).
    Use as a context manager: leaving it stops the thread (a read in progress finishes
    first)."""

    def __init__(self, jobs: Sequence[Job], amax_of: AmaxOf | None = None) -> None:
        self._jobs = list(jobs)
        self._amax_of = amax_of
        self._buffers = [Staging(), Staging()]
        self._size = max((j.read.nbytes for j in self._jobs), default=0)
        """Each buffer's size, made at its first read: the largest read, so that no buffer
        is made anew as reads grow (its pages are touched once, where reads reach)."""
        self._cond = threading.Condition()
        self._free = [0, 1]
        """Buffers the reader may fill."""
        self._ready: list[tuple[int, int, Taken | None, Exception | None]] = []
        """(job, buffer, rows, error) read and not yet taken, in job order."""
        self._held: int | None = None
        """The buffer of the read last taken (the caller's until its next take)."""
        self._dropped: set[Hashable] = set()
        self._closed = False
        self._finished = False
        """The reader has made (or skipped) every job, or stopped."""
        self._thread = threading.Thread(target=self._run, name="drift-read", daemon=True)

    def __enter__(self) -> ReadAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        failed: set[Hashable] = set()
        try:
            for i, job in enumerate(self._jobs):
                with self._cond:
                    if job.key in failed or job.key in self._dropped:
                        # the scan will not take it: its tensor failed or is done
                        self._ready.append((i, -1, None, None))
                        self._cond.notify_all()
                        continue
                    while not self._free and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        return
                    b = self._free.pop(0)
                rows: Taken | None = None
                error: Exception | None = None
                try:
                    rows = landed(job.read.of(job.ref, self._buffers[b].at_least(self._size)),
                                  job.read, self._amax_of)
                except Exception as exc:  # handed to the scan's thread, raised where taken
                    error = exc
                    failed.add(job.key)
                with self._cond:
                    self._ready.append((i, b, rows, error))
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _release(self, b: int) -> None:
        if b >= 0:
            self._free.append(b)

    def take(self, ref: TensorRef, read: Read) -> Taken:
        """The next planned read, which must be ``read`` of ``ref``; raises what the read
        raised."""
        with self._cond:
            if self._held is not None:  # the caller is done with the previous read's rows
                self._release(self._held)
                self._held = None
                self._cond.notify_all()
            while True:
                while not self._ready:
                    if self._finished:
                        raise PlanMismatch(f"the scan read {ref.name} {read} past the "
                                           "reads it planned")
                    self._cond.wait()
                i, b, rows, error = self._ready.pop(0)
                job = self._jobs[i]
                if b < 0 or job.key in self._dropped:  # skipped, or of a tensor done with
                    self._release(b)
                    self._cond.notify_all()
                    continue
                break
            if job.ref is not ref or job.read != read:
                self._release(b)
                self._cond.notify_all()
                raise PlanMismatch(f"the scan read {ref.name} {read}, planned "
                                   f"{job.ref.name} {job.read}")
            if error is not None:
                self._release(b)
                self._cond.notify_all()
                raise error
            self._held = b
            return cast(Taken, rows)

    def done(self, key: Hashable) -> None:
        with self._cond:
            self._dropped.add(key)
            if self._held is not None:  # its rows are the tensor's: the reader may refill it
                self._release(self._held)
                self._held = None
            self._cond.notify_all()
