"""The forward stream's interface: :class:`ForwardStream`, its :class:`Marker` and :class:`Span`.

The backends (CPU worker, inline, CUDA) are in :mod:`tfuture.streams.backends`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch


class StreamAbandoned(RuntimeError):
    """The stream was abandoned (:meth:`ForwardStream.abandon`): later ops were skipped."""


class Span(NamedTuple):
    """One op on the forward stream (or a host phase): name, step, start and end in seconds
    (perf_counter). The hot path records them into a :class:`SpanLog`; Spans are made from it
    when they are read."""

    name: str
    step: int
    start: float
    end: float


class SpanLog:
    """Spans as the hot path records them, in flat lists that keep no object per span.

    ``items``: ``name, step, start, end`` per span, one C call to record,
    ``items.extend((name, step, start, end))`` (the tuple is dropped at once): about a third
    of the cost of appending a :class:`Span`. Chains of ops run back to back (a stream's step,
    each op starting where the one before ended) are cheaper still: ``chains`` gets
    ``step, start, len(links)`` once, then ``links`` gets ``name, end`` per op. :meth:`spans`
    and :meth:`columns` read both back, in start order.
    """

    __slots__ = ("chains", "items", "links")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.chains: list[Any] = []
        self.links: list[Any] = []

    def __len__(self) -> int:
        return len(self.items) // 4 + len(self.links) // 2

    def add(self, name: str, step: int, start: float, end: float) -> None:
        self.items.extend((name, step, start, end))

    def _names(self) -> list[str]:
        """Every span's name: the items', then the chains'."""
        return self.items[0::4] + self.links[0::2]

    def _columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(steps, starts, ends)`` of every span: the items', then the chains'."""
        items, links = self.items, self.links
        steps = np.array(items[1::4], dtype=np.int64)
        starts = np.array(items[2::4], dtype=np.float64)
        ends = np.array(items[3::4], dtype=np.float64)
        if not links:
            return steps, starts, ends
        c_ends = np.array(links[1::2], dtype=np.float64)
        chains = np.array(self.chains, dtype=np.float64).reshape(-1, 3)  # step, start, len(links)
        first = chains[:, 2].astype(np.int64) // 2  # the chain's first op
        counts = np.diff(np.append(first, c_ends.size))
        c_starts = np.empty_like(c_ends)
        c_starts[1:] = c_ends[:-1]  # an op starts where the op before it ended ...
        ran = counts > 0
        c_starts[first[ran]] = chains[ran, 1]  # ... but a chain's first op at the chain's start
        c_steps = np.repeat(chains[:, 0].astype(np.int64), counts)
        return (
            np.concatenate([steps, c_steps]),
            np.concatenate([starts, c_starts]),
            np.concatenate([ends, c_ends]),
        )

    def _order(self, starts: np.ndarray) -> np.ndarray | None:
        """The permutation into start order when both lists hold spans, else None (one list
        is recorded in start order already)."""
        return np.argsort(starts, kind="stable") if self.items and self.links else None

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(steps, starts, ends)``: int64, float64, float64 ``[len(self)]``, in start order."""
        steps, starts, ends = self._columns()
        order = self._order(starts)
        return (steps, starts, ends) if order is None else (steps[order], starts[order], ends[order])

    def spans(self) -> list[Span]:
        """The recorded spans, in start order (recording order on one stream)."""
        names = self._names()
        steps, starts, ends = self._columns()
        order = self._order(starts)
        if order is not None:
            names = [names[i] for i in order.tolist()]
            steps, starts, ends = steps[order], starts[order], ends[order]
        return list(map(Span, names, steps.tolist(), starts.tolist(), ends.tolist()))


@dataclass(slots=True, eq=False)
class Marker:
    """A point on the forward stream after all work submitted before it: the ``seq``-th op of a
    CPU stream (no object per marker to build or signal), or a recorded CUDA event."""

    seq: int = 0
    cuda_event: torch.cuda.Event | None = None
    done: bool = False  # born complete (the inline stream's): waiting on it is a no-op


Delay = Callable[[str], float]


@runtime_checkable
class RunWrapper(Protocol):
    """Something that wraps a run from outside the loop, such as fault injection
    (:class:`tfuture.testing.faults.FaultPlan`): the runtime calls :meth:`bind` once with the
    names of its step kind's stream ops and host hooks (raise ``ValueError`` for a name it
    cannot target), then wraps each run's stream and scheduler. ``delay``, when not None, is
    the streams' per-op delay hook."""

    delay: Delay | None

    def bind(self, stream_ops: Sequence[str], host_hooks: Sequence[str]) -> None: ...

    def wrap_stream(self, inner: ForwardStream) -> ForwardStream: ...

    def wrap_scheduler(self, inner: Any) -> Any: ...


class ForwardStream(ABC):
    """Common part: the error slot, the span log, the optional delay hook."""

    def __init__(self, delay: Delay | None = None, trace: bool = True) -> None:
        self.delay = delay
        self.trace = trace
        # What the traced ops recorded; take_log() hands it over, take_spans() as Spans.
        self.log = SpanLog()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _fail(self, exc: BaseException, name: str, step: int) -> None:
        with self._lock:
            if self._error is None:
                note = f"tfuture: raised on the forward stream in '{name}' of step {step}"
                if hasattr(exc, "add_note"):  # Python >= 3.11; a GPU image may run an older one
                    exc.add_note(note)
                self._error = exc

    def abandon(self) -> None:
        """Skip every op not yet started, from now on (an interrupted drain: the caller gives up
        on the queued work). The op running now, if any, still finishes; a stream that already
        failed keeps its first exception."""
        with self._lock:
            if self._error is None:
                self._error = StreamAbandoned(
                    "the forward stream was abandoned (interrupted while draining): its queued ops were "
                    "skipped"
                )

    def raise_if_failed(self) -> None:
        """Re-raise the first exception of submitted work, with its original traceback."""
        err = self._error
        if err is not None:
            raise err

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def alive(self) -> bool:
        """True while an op of this stream may still run on a worker of its own (a CPU worker
        whose close was interrupted); False for a stream without one."""
        return False

    def wait_worker(self) -> None:  # noqa: B027 - nothing to wait for without a worker
        """Block until no op of this stream runs any more (see :attr:`alive`)."""

    @abstractmethod
    def submit(self, name: str, step: int, fn: Callable[[], object]) -> None:
        """Enqueue ``fn`` (op ``name`` of step ``step``) after everything submitted before."""

    def submit_ops(self, step: int, ops: Sequence[tuple[str, Callable[[], object]]]) -> None:
        """Enqueue ``ops`` in order, as :meth:`submit` would one by one. A backend may hand them
        over as one unit of work (the CPU worker takes one queue item): fewer hand-offs per step,
        with the same per-op delays, spans and failure notes."""
        for name, fn in ops:
            self.submit(name, step, fn)

    def _run_ops(self, step: int, ops: Sequence[tuple[str, Callable[[], object]]]) -> None:
        """Run ``ops`` in order on the calling thread, as :meth:`_run_op` one by one. With no
        delay hook and no trace that is one loop in one ``try`` (the host path of every step)."""
        if self.delay is not None:
            for name, fn in ops:
                self._run_op(name, step, fn)
            return
        if self._error is not None:
            return
        name = ""
        try:
            if self.trace:  # a span per op; ops run back to back: an op ends where the next starts
                log, clock = self.log, time.perf_counter
                links = log.links
                log.chains.extend((step, clock(), len(links)))
                for name, fn in ops:
                    fn()
                    links += (name, clock())  # list +=: an extend without a method call
            else:
                for name, fn in ops:  # noqa: B007 - the failing op's name is read below
                    fn()
        except BaseException as exc:
            self._fail(exc, name, step)

    def _run_op(self, name: str, step: int, fn: Callable[[], object]) -> None:
        """Run one op on the calling thread: skip it after a failure, else delay, run, trace."""
        if self._error is not None:
            return
        try:
            if self.delay is not None:
                pause = self.delay(name)
                if pause > 0:
                    time.sleep(pause)
            if not self.trace:
                fn()
                return
            start = time.perf_counter()
            fn()
            self.log.add(name, step, start, time.perf_counter())
        except BaseException as exc:
            self._fail(exc, name, step)

    @abstractmethod
    def record(self) -> Marker:
        """Backend-specific."""

    @abstractmethod
    def wait(self, marker: Marker) -> None:
        """Backend-specific."""

    def close(self) -> None:  # noqa: B027 - a no-op is right for backends with nothing to stop
        """Drain the stream and stop; idempotent."""

    def take_log(self) -> SpanLog:
        """The spans recorded so far; the stream starts a fresh log."""
        log, self.log = self.log, SpanLog()
        return log

    def take_spans(self) -> list[Span]:
        """:meth:`take_log`, as Spans."""
        return self.take_log().spans()
