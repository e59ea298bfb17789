"""The forward stream, on three backends behind one small interface.

* :class:`CpuStream`: a worker thread runs submitted work in FIFO order, acting as the
  device. Torch CPU ops release the GIL, so host and "device" really overlap.
* :class:`InlineStream`: submitted work runs at once on the calling thread, markers are born
  complete. No overlap: the host path a GPU would see (on CUDA the host only launches), made
  measurable on CPU, and the simplest backend to debug a model integration with.
* :class:`CudaStream`: a ``torch.cuda.Stream``; submitted work is launched on it at once.

Both record :class:`Marker` events that the host waits on, keep a busy-interval log for
bubble accounting, and capture the first exception raised by submitted work: the stream is
then poisoned (later work is skipped) and that exception, with its original traceback and a
note naming the op and step, re-raises at the next host wait.

Interrupts: :func:`drain_and_close` (the runtime's error path) drains the stream; when the drain
itself is interrupted (a second Ctrl-C) the stream is abandoned (:meth:`ForwardStream.abandon`:
no op that has not started yet runs), and a :class:`CpuStream` whose ``close`` is interrupted
(a third one) is abandoned as well and gives the GIL switch interval back all the same.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

from tfuture.streams.base import Delay, ForwardStream, Marker, Span, StreamAbandoned
from tfuture.streams.omp import HOST_TEAM

__all__ = [
    "BACKENDS",
    "CpuStream",
    "CudaStream",
    "Delay",
    "ForwardStream",
    "InlineStream",
    "Marker",
    "Span",
    "StreamAbandoned",
    "drain_and_close",
    "make_stream",
    "stream_host_thread",
]

_WORKER = threading.local()  # on a CpuStream worker: ``host``, the thread that created the stream


def stream_host_thread() -> threading.Thread:
    """The host thread of the run whose stream op calls this: on a :class:`CpuStream` worker the
    thread that created the stream (the runtime's ``run``), anywhere else the calling thread (the
    inline and CUDA streams run their ops on the host thread). A model that serves one run at a
    time tells runs apart with it."""
    host: threading.Thread | None = getattr(_WORKER, "host", None)
    return host if host is not None else threading.current_thread()


class _SwitchInterval:
    """The process-wide GIL switch interval, lowered while any worker stream runs.

    Reference-counted: the first worker saves the interval, the last one restores it exactly,
    however the lifetimes of several runtimes overlap.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = 0.0

    def acquire(self, seconds: float) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
            self._users += 1
            sys.setswitchinterval(min(sys.getswitchinterval(), seconds))

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


SWITCH_INTERVAL = _SwitchInterval()


class CpuStream(ForwardStream):
    """A worker thread as the forward stream. ``delay(name)`` seconds are slept before each op.

    While it runs, the interpreter's GIL switch interval is lowered to ``switch_s``: with the
    default 5 ms, GIL-holding host work could stall the "device" for a whole interval between
    two ops, which a real GPU never suffers. Every torch op releases and retakes the GIL, so a
    step of ~25 ops waits up to 25 intervals while the host spins in Python: 30 us instead of
    100 us took overlap / nominal from 2.2x to 1.87x at T_cpu = T_dev = 1 ms (batch 16) for 7%
    more CPU time. The last stream to close restores the interval exactly.

    The worker runs with the creating thread's grad mode and inference mode, so a run inside
    ``torch.inference_mode()`` or ``torch.no_grad()`` builds no autograd graph on the worker.
    The creating (host) thread's OpenMP team is parked while the stream is open
    (:mod:`tfuture.streams.omp`): its torch ops are serial, and the worker's parallel ops are not
    throttled by the host's idle helper threads.
    """

    def __init__(self, delay: Delay | None = None, trace: bool = True, switch_s: float = 3e-5) -> None:
        super().__init__(delay, trace)
        self._grad = torch.is_grad_enabled()
        self._inference = torch.is_inference_mode_enabled()
        self._host = threading.current_thread()
        SWITCH_INTERVAL.acquire(switch_s)
        try:
            self._team_owner = HOST_TEAM.acquire()
        except BaseException:
            SWITCH_INTERVAL.release()  # nothing else taken yet
            raise
        # Ops submitted, and ops the worker got past (run, skipped or failed); under _cond.
        self._submitted = 0
        self._done = 0
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[int, Sequence[tuple[str, Callable[[], object]]]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="tfuture-forward", daemon=True)
        self._closed = False
        try:
            self._thread.start()
        except BaseException:
            self._closed = True
            SWITCH_INTERVAL.release()
            HOST_TEAM.release(self._team_owner)
            raise

    def _run(self) -> None:
        _WORKER.host = self._host
        with torch.inference_mode(self._inference), torch.set_grad_enabled(self._grad):
            self._serve()

    def _serve(self) -> None:
        get, run, cond = self._queue.get, self._run_ops, self._cond
        while True:
            item = get()
            if item is None:
                return
            run(*item)
            with cond:
                self._done += 1
                cond.notify_all()

    def submit(self, name: str, step: int, fn: Callable[[], object]) -> None:
        self.submit_ops(step, ((name, fn),))

    def submit_ops(self, step: int, ops: Sequence[tuple[str, Callable[[], object]]]) -> None:
        if self._closed:
            raise RuntimeError("submit on a closed CpuStream")
        self._submitted += 1
        self._queue.put((step, ops))

    def record(self) -> Marker:
        return Marker(self._submitted)

    def wait(self, marker: Marker) -> None:
        with self._cond:
            # Poll so that a dead worker can never hang the host.
            while self._done < marker.seq:
                if not self._cond.wait(0.05) and not self._thread.is_alive():
                    raise RuntimeError("the forward-stream worker thread died")
        self.raise_if_failed()

    def close(self) -> None:
        """Run every op submitted so far, then stop the worker; idempotent.

        Interrupted (``KeyboardInterrupt`` while the worker still runs), the stream is abandoned:
        no op that has not started yet will run, the one running now finishes on its own and the
        worker then exits. The GIL switch interval is given back on every path.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None)
            self._thread.join()
        except BaseException:
            self.abandon()
            raise
        finally:
            SWITCH_INTERVAL.release()
            HOST_TEAM.release(self._team_owner)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_worker(self) -> None:
        """Block until the worker thread has exited (after :meth:`close`, or an abandoned one:
        once the op it was running has finished)."""
        self._thread.join()


_DONE = Marker(done=True)


class InlineStream(ForwardStream):
    """Forward-stream ops run at once on the calling thread; every marker is born complete.

    A failing op poisons the stream as on the other backends: later ops are skipped and the
    exception re-raises at the next :meth:`wait`.
    """

    def submit(self, name: str, step: int, fn: Callable[[], object]) -> None:
        self._run_op(name, step, fn)

    submit_ops = ForwardStream._run_ops  # at once, on this thread (no call in between)

    def record(self) -> Marker:
        return _DONE

    def wait(self, marker: Marker) -> None:
        err = self._error  # raise_if_failed, inline: every step waits
        if err is not None:
            raise err


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
        self.submit_ops(step, ((name, fn),))

    def submit_ops(self, step: int, ops: Sequence[tuple[str, Callable[[], object]]]) -> None:
        """Launch ``ops`` on the stream under one stream context (one switch per step)."""
        if self._error is not None:
            return
        with torch.cuda.stream(self.stream):
            if self.delay is not None or self.trace:
                for name, fn in ops:
                    if self._error is None:
                        self._launch_op(name, step, fn)
                return
            name = ""
            try:
                for name, fn in ops:  # noqa: B007 - the failing op's name is read below
                    fn()
            except BaseException as exc:
                self._fail(exc, name, step)

    def _launch_op(self, name: str, step: int, fn: Callable[[], object]) -> None:
        """One op on the current (forward) stream, with its delay and its span's events."""
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
            self.log.add(name, step, a, t0 + origin.elapsed_time(end) / 1e3)
        self._pending = keep

    def close(self) -> None:
        self.stream.synchronize()
        self._collect_spans()


def drain_and_close(stream: ForwardStream) -> None:
    """Let everything submitted finish (or be skipped after a failure), then stop the stream.

    For error paths: a failure of the stream itself is swallowed here, since the first
    failure is the one that re-raises to the caller. A drain that is itself interrupted (a
    ``KeyboardInterrupt`` in the wait) abandons the stream: the ops that have not started are
    skipped, and the close only waits for the one running. An interrupt of the close is
    swallowed too; the stream then stays abandoned (see :meth:`CpuStream.close`).
    """
    try:
        stream.wait(stream.record())
    except BaseException:
        if not stream.failed:  # not the stream's own failure: interrupted, or the worker died
            stream.abandon()
    try:
        stream.close()
    except BaseException:
        pass  # a sticky CUDA error: the slots must still be released after this


BACKENDS = ("auto", "worker", "inline")


def make_stream(
    device: torch.device, delay: Delay | None = None, trace: bool = True, backend: str = "auto"
) -> ForwardStream:
    """The forward stream for ``device``.

    ``backend``: ``"auto"`` (a CUDA stream on CUDA, the worker thread on CPU), ``"worker"``
    (:class:`CpuStream`, CPU only) or ``"inline"`` (:class:`InlineStream`, CPU only).
    """
    if backend not in BACKENDS:
        raise ValueError(f"stream backend must be one of {BACKENDS}, got {backend!r}")
    if device.type == "cuda":
        if backend != "auto":
            raise ValueError(f"stream backend {backend!r} is for CPU maps; a map on {device} uses 'auto'")
        return CudaStream(device, delay, trace)
    if backend == "inline":
        return InlineStream(delay, trace)
    return CpuStream(delay, trace)
