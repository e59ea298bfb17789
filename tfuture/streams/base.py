"""The forward stream's interface: :class:`ForwardStream`, its :class:`Marker` and :class:`Span`.

The backends (CPU worker, inline, CUDA) are in :mod:`tfuture.streams.backends`.
"""

from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch


class StreamAbandoned(RuntimeError):
    """The stream was abandoned (:meth:`ForwardStream.abandon`): later ops were skipped."""


class Span(NamedTuple):
    """One op on the forward stream (or a host phase): name, step, start and end in seconds
    (perf_counter). A tuple: the hot path records plain ``(name, step, start, end)`` tuples and
    ``Span._make`` names them once the run is over."""

    name: str
    step: int
    start: float
    end: float


@dataclass(slots=True, eq=False)
class Marker:
    """A point on the forward stream after all work submitted before it: the ``seq``-th op of a
    CPU stream (no object per marker to build or signal), or a recorded CUDA event."""

    seq: int = 0
    cuda_event: torch.cuda.Event | None = None
    done: bool = False  # born complete (the inline stream's): waiting on it is a no-op


#: ``(name, step, start, end)`` as a :class:`Span`, with no Python-level call (``Span._make`` has one).
span_of: Callable[[tuple[str, int, float, float]], Span] = functools.partial(tuple.__new__, Span)

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
        # Raw (name, step, start, end) tuples: a tuple costs a fraction of a Span on the hot path;
        # take_spans() makes the Spans.
        self.spans: list[tuple[str, int, float, float]] = []
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
            if self.trace:  # a span per op, as raw tuples
                spans, clock = self.spans, time.perf_counter
                for name, fn in ops:
                    start = clock()
                    fn()
                    spans.append((name, step, start, clock()))
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
            self.spans.append((name, step, start, time.perf_counter()))
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

    def take_spans(self) -> list[Span]:
        spans, self.spans = self.spans, []
        return list(map(span_of, spans))
