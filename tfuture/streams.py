"""The forward stream, on two backends behind one small interface.

* :class:`CpuStream`: a worker thread runs submitted work in FIFO order, acting as the
  device. Torch CPU ops release the GIL, so host and "device" really overlap.
* :class:`CudaStream`: a ``torch.cuda.Stream``; submitted work is launched on it at once.

Both record :class:`Marker` events that the host waits on, keep a busy-interval log for
bubble accounting, and capture the first exception raised by submitted work: the stream is
then poisoned (later work is skipped) and that exception, with its original traceback and a
note naming the op and step, re-raises at the next host wait.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Span:
    """One op on the forward stream: name, step, start and end in seconds (perf_counter)."""

    name: str
    step: int
    start: float
    end: float


@dataclass(slots=True, eq=False)
class Marker:
    """An event recorded on the forward stream after all work submitted before it."""

    done: threading.Event = field(default_factory=threading.Event)
    cuda_event: torch.cuda.Event | None = None


Delay = Callable[[str], float]


class ForwardStream(ABC):
    """Common part: the error slot, the span log, the optional delay hook."""

    def __init__(self, delay: Delay | None = None, trace: bool = True) -> None:
        self.delay = delay
        self.trace = trace
        self.spans: list[Span] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _fail(self, exc: BaseException, name: str, step: int) -> None:
        with self._lock:
            if self._error is None:
                note = f"tfuture: raised on the forward stream in '{name}' of step {step}"
                if hasattr(exc, "add_note"):  # Python >= 3.11; a GPU image may run an older one
                    exc.add_note(note)
                self._error = exc

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
        """Backend-specific."""

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
        return spans


class CpuStream(ForwardStream):
    """A worker thread as the forward stream. ``delay(name)`` seconds are slept before each op.

    While it runs, the interpreter's GIL switch interval is lowered to ``switch_s``: with the
    default 5 ms, GIL-holding host work could stall the "device" for a whole interval between
    two ops, which a real GPU never suffers. ``close`` restores the previous interval.
    """

    def __init__(self, delay: Delay | None = None, trace: bool = True, switch_s: float = 1e-4) -> None:
        super().__init__(delay, trace)
        self._old_switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._old_switch, switch_s))
        self._queue: queue.SimpleQueue[tuple[str, int, Callable[[], object]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tfuture-forward", daemon=True)
        self._closed = False
        self._thread.start()

    def _run(self) -> None:
        get, clock = self._queue.get, time.perf_counter
        while True:
            item = get()
            if item is None:
                return
            name, step, fn = item
            if self._error is not None and name != "marker":
                continue
            try:
                if self.delay is not None and name != "marker":
                    pause = self.delay(name)
                    if pause > 0:
                        time.sleep(pause)
                start = clock()
                fn()
                if self.trace and name != "marker":
                    self.spans.append(Span(name, step, start, clock()))
            except BaseException as exc:
                self._fail(exc, name, step)

    def submit(self, name: str, step: int, fn: Callable[[], object]) -> None:
        if self._closed:
            raise RuntimeError("submit on a closed CpuStream")
        self._queue.put((name, step, fn))

    def record(self) -> Marker:
        marker = Marker()
        self.submit("marker", -1, marker.done.set)
        return marker

    def wait(self, marker: Marker) -> None:
        # Poll so that a dead worker can never hang the host.
        while not marker.done.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError("the forward-stream worker thread died")
        self.raise_if_failed()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        sys.setswitchinterval(self._old_switch)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class CudaStream(ForwardStream):
    """A ``torch.cuda.Stream`` as the forward stream; spans come from CUDA event pairs.

    ``delay(name)`` seconds are injected with ``torch.cuda._sleep`` on the stream.
    """

    # Cycles per second for torch.cuda._sleep; about 1.9 GHz on H100/H200 class parts.
    SLEEP_HZ = 1.9e9

    def __init__(self, device: torch.device, delay: Delay | None = None, trace: bool = True) -> None:
        super().__init__(delay, trace)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # Work enqueued before the run (the map's zeroed buffers, model weights) happens first.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self._pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._origin: tuple[torch.cuda.Event, float] | None = None

    def submit(self, name: str, step: int, fn: Callable[[], object]) -> None:
        if self._error is not None:
            return
        with torch.cuda.stream(self.stream):
            try:
                if self.delay is not None:
                    pause = self.delay(name)
                    if pause > 0:
                        torch.cuda._sleep(int(pause * self.SLEEP_HZ))
                if not self.trace:
                    fn()
                    return
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                if self._origin is None:
                    self._origin = (start, time.perf_counter())
                self._pending.append((name, step, start, end))
            except BaseException as exc:
                self._fail(exc, name, step)

    def record(self) -> Marker:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return Marker(cuda_event=ev)

    def wait(self, marker: Marker) -> None:
        assert marker.cuda_event is not None
        marker.cuda_event.synchronize()
        self.raise_if_failed()
        self._collect_spans()

    def _collect_spans(self) -> None:
        if self._origin is None:
            return
        origin, t0 = self._origin
        keep = []
        for name, step, start, end in self._pending:
            if not end.query():
                keep.append((name, step, start, end))
                continue
            a = t0 + origin.elapsed_time(start) / 1e3
            self.spans.append(Span(name, step, a, t0 + origin.elapsed_time(end) / 1e3))
        self._pending = keep

    def close(self) -> None:
        self.stream.synchronize()
        self._collect_spans()


def drain_and_close(stream: ForwardStream) -> None:
    """Let everything submitted finish (or be skipped after a failure), then stop the stream.

    For error paths: a failure of the stream itself is swallowed here, since the first
    failure is the one that re-raises to the caller.
    """
    try:
        stream.wait(stream.record())
    except BaseException:
        pass
    try:
        stream.close()
    except BaseException:
        pass  # a sticky CUDA error: the slots must still be released after this


def make_stream(device: torch.device, delay: Delay | None = None, trace: bool = True) -> ForwardStream:
    """The forward stream for ``device``: CUDA streams on CUDA, the worker thread on CPU."""
    if device.type == "cuda":
        return CudaStream(device, delay, trace)
    return CpuStream(delay, trace)
