"""Decode-only workloads for the runtime benchmarks (``bench_overlap``, ``bench_runtime_overhead``).

``n`` requests that decode forever: every step decodes every request.

* :class:`DecodeScheduler` drives an :class:`tfuture.runtime.OverlapRuntime`. Under overlap,
  step N+1 is scheduled before step N's tokens reached the host, so its tokens are the
  placeholders of a handle filtered from step N's ``out``; in sync mode they are the concrete
  tokens that :meth:`DecodeScheduler.process` received.
* :class:`HandLoop` does the same steps by hand on a :class:`tfuture.FutureMap`, with no runtime:
  the baseline that the runtime's own cost is measured against.
* :class:`MinimalLoop` decodes with no ``FutureMap`` at all: a minimal plain-torch loop.
* :class:`ZeroModel` has no device work, to measure host costs alone.

``host_work_s`` of host spin per processed step (Python holding the GIL, as a scheduler's
bookkeeping does) stands in for T_cpu. Given a :class:`StepClock`, both stamp the wall and the
host thread's CPU time as each step is processed, so a benchmark reads the steady-state step
time (pipeline fill and drain left out) and the host CPU per step without the host work.
"""

from __future__ import annotations

import inspect
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tfuture import FutureMap
from tfuture.core.batch import Batch, ForwardBatch, StepResult
from tfuture.streams.backends import CpuStream

# The GIL switch interval the runtime's worker stream sets while it runs: the hand loop's
# worker runs under the same one, or the comparison would measure the interval, not the loop.
WORKER_SWITCH_S = inspect.signature(CpuStream).parameters["switch_s"].default


def spin(seconds: float) -> None:
    """Busy host work that holds the GIL."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StepClock:
    """Stamps taken as each step is processed: wall (``perf_counter``), the host thread's CPU
    (``thread_time``), and the CPU seconds of that step's host work (the spin)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.work: list[float] = []

    def tick(self, host_work_s: float) -> None:
        """Stamp a processed step, then do its host work."""
        self.wall.append(time.perf_counter())
        cpu = time.thread_time()
        self.cpu.append(cpu)
        if host_work_s > 0:
            spin(host_work_s)
            self.work.append(time.thread_time() - cpu)
        else:
            self.work.append(0.0)

    def per_step(self, skip: int = 2) -> tuple[float, float]:
        """Steady state, from the ``skip + 1``-th processed step to the last: (wall seconds per
        step, host-thread CPU seconds per step without the host work)."""
        m = len(self.wall) - 1 - skip
        if m < 1:
            raise ValueError(f"StepClock: {len(self.wall)} steps, need more than {skip + 1}")
        cpu = self.cpu[-1] - self.cpu[skip] - sum(self.work[skip:-1])
        return (self.wall[-1] - self.wall[skip]) / m, cpu / m


def process_step(host_work_s: float, clock: StepClock | None) -> None:
    """What a processed step costs the host: the clock's stamps, then the host work."""
    if clock is not None:
        clock.tick(host_work_s)
    elif host_work_s > 0:
        spin(host_work_s)


class DecodeScheduler:
    """``n`` requests decoding one token per step, for as many steps as the runtime runs."""

    def __init__(self, n: int, host_work_s: float = 0.0, clock: StepClock | None = None) -> None:
        self.n, self.host_work_s, self.clock = n, host_work_s, clock
        self.ones = np.ones(n, dtype=np.int64)
        self.req_ids = np.arange(n, dtype=np.int64)
        self.sample = np.ones(n, dtype=bool)
        self.positions = np.full(n, 3, dtype=np.int64)
        self.tokens = np.arange(1, n + 1, dtype=np.int64)
        self.last: Batch | None = None  # launched, its tokens not processed yet

    def schedule(self) -> Batch:
        consumes = []
        tokens = self.tokens
        if self.last is not None and self.last.out is not None:
            kept = self.last.out.filter(self.sample)
            consumes, tokens = [kept], kept.host_placeholders()
        batch = Batch(tokens, self.ones, self.positions.copy(), self.req_ids, self.sample, consumes=consumes)
        self.positions += 1
        self.last = batch
        return batch

    def process(self, result: StepResult) -> None:
        process_step(self.host_work_s, self.clock)
        self.tokens = result.tokens
        if result.batch is self.last:
            self.last = None

    def build_mask(self, batch: Batch) -> None:
        return None


class _Worker:
    """A bare worker thread as the stand-in device: closures in FIFO order, a done counter."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._submitted = self._done = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="hand-loop-worker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (fn := self._queue.get()) is not None:
            if self._error is None:
                try:
                    fn()
                except BaseException as exc:  # re-raised on the host at the next wait
                    self._error = exc
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    def submit(self, fn: Callable[[], None]) -> int:
        self._submitted += 1
        self._queue.put(fn)
        return self._submitted

    def wait(self, seq: int) -> None:
        with self._cond:
            while self._done < seq:
                if not self._cond.wait(1.0) and not self._thread.is_alive():
                    raise RuntimeError("hand loop: the worker thread died")
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class HandLoop:
    """The runtime's work per decode step, written by hand on a FutureMap: no runtime, no Batch,
    no step kind, no staging-ring class.

    Per step, on the host: the tokens (the placeholders of the last unread step's ``out``,
    filtered as :class:`DecodeScheduler` does, or the concrete tokens last read), ``alloc``, the
    step's index data written into a reusable staging buffer (on a CPU map into one
    fresh array the step owns: no copy). On the stream, as one unit of work: one
    H2D copy (none on a CPU map), the decode step's prepare as the runtime does it (``launch_resolve`` of
    the tokens in place; positions and last rows are views of the staged data), the model's
    ``forward`` and ``sample``, ``store``, the D2H copy of tokens and error flag. The consumed
    handle is released once that is enqueued. The step is read (wait, check the flag, release
    its ``out``, then ``host_work_s`` of spin: the scheduler's ``process``) at once in sync
    mode, and after the next step was launched under overlap.

    ``stream``: ``"inline"`` (every op at once on this thread: the host path a GPU sees),
    ``"worker"`` (a bare worker thread, the CPU's stand-in device, under the runtime worker's
    GIL switch interval) or ``"cuda"`` (a side stream). ``time_model``: time every forward plus
    sample into ``model_s`` (``perf_counter`` on CPU, CUDA events on a GPU). ``clock``: a
    :class:`StepClock` stamped as each step is processed. ``batches``: also build, per step, the
    checked :class:`tfuture.core.batch.Batch` that a scheduler hands a runtime (with the consumed
    handle) and the :class:`StepResult` that its ``process`` gets: the floor of any runtime
    whose steps come as checked batches.
    """

    N_STAGING = 4

    def __init__(
        self,
        model: Any,
        n: int,
        overlap: bool,
        stream: str = "inline",
        device: str = "cpu",
        host_work_s: float = 0.0,
        time_model: bool = False,
        clock: StepClock | None = None,
        batches: bool = False,
    ) -> None:
        if stream not in ("inline", "worker", "cuda"):
            raise ValueError(f"stream must be 'inline', 'worker' or 'cuda', got {stream!r}")
        self.model, self.n, self.overlap, self.stream, self.device = model, n, overlap, stream, device
        self.host_work_s, self.clock = host_work_s, clock
        self.time_model, self.batches = time_model, batches
        self.model_s: list[float] = []
        self.ones = np.ones(n, dtype=np.int64)
        self.fmap = FutureMap(4 * n + 64, device=device)
        self.keep = np.ones(n, dtype=bool)
        self.seg_starts, self.req_ids = np.arange(n + 1, dtype=np.int64), np.arange(n, dtype=np.int64)
        # tokens, seg_starts, prefix_lens, req_ids, seq_lens, sample_reqs
        self.split = np.cumsum([n, n + 1, n, n, n]).tolist()
        pin = stream == "cuda"
        ring = range(self.N_STAGING)
        self.staging_in = [torch.zeros(6 * n + 1, dtype=torch.int64, pin_memory=pin) for _ in ring]
        self.staging_out = [torch.zeros(n + 2, dtype=torch.int64, pin_memory=pin) for _ in ring]
        self.in_arrays = [t.numpy() for t in self.staging_in]
        self.out_arrays = [t.numpy() for t in self.staging_out]

    def run(self, steps: int) -> None:
        fmap, n, keep, ins = self.fmap, self.n, self.keep, self.in_arrays
        on_cpu = fmap.device.type == "cpu"
        positions, tokens = np.full(n, 3, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64)
        worker = _Worker() if self.stream == "worker" else None
        cuda = torch.cuda.Stream(device=self.device) if self.stream == "cuda" else None
        if cuda is not None:
            cuda.wait_stream(torch.cuda.current_stream(self.device))
        timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        saved = sys.getswitchinterval()
        if worker is not None:
            sys.setswitchinterval(min(saved, WORKER_SWITCH_S))
        # (out, staging index, marker, batch) of the unread step
        prev: tuple[Any, int, Any, Batch | None] | None = None
        try:
            for step in range(steps):
                kept = prev[0].filter(keep) if prev is not None else None
                ids = tokens if kept is None else kept.host_placeholders()
                batch = None
                if self.batches:
                    consumes = [] if kept is None else [kept]
                    batch = Batch(ids, self.ones, positions.copy(), self.req_ids, keep, consumes=consumes)
                out = fmap.alloc(n)
                k = step % self.N_STAGING
                # A CPU map's step gets a fresh array (no staging copy), split on the stream.
                a = np.empty(6 * n + 1, dtype=np.int64) if on_cpu else ins[k]
                a[:n] = ids
                a[n : 2 * n + 1] = self.seg_starts
                a[2 * n + 1 : 3 * n + 1] = positions
                a[3 * n + 1 : 4 * n + 1] = self.req_ids
                np.add(positions, 1, out=a[4 * n + 1 : 5 * n + 1])
                a[5 * n + 1 :] = self.req_ids
                ops = self._ops(step, k, out, timings, a)
                if worker is not None:
                    marker: Any = worker.submit(ops)
                elif cuda is not None:
                    with torch.cuda.stream(cuda):
                        ops()
                        marker = torch.cuda.Event()
                        marker.record(cuda)
                else:
                    ops()
                    marker = None
                if kept is not None:
                    fmap.release(kept)  # its resolve is enqueued: stream order protects the slots
                cur: tuple[Any, int, Any, Batch | None] | None = (out, k, marker, batch)
                if self.overlap:
                    cur, prev = prev, cur
                if cur is not None:
                    tokens = self._read(*cur, worker)
                positions += 1
            if prev is not None:
                self._read(*prev, worker)
        finally:
            if worker is not None:
                worker.close()
                sys.setswitchinterval(saved)
            if cuda is not None:
                cuda.synchronize()
        self.model_s += [start.elapsed_time(end) / 1e3 for start, end in timings]

    def _ops(
        self,
        step: int,
        k: int,
        out: Any,
        timings: list[tuple[torch.cuda.Event, torch.cuda.Event]],
        staged: np.ndarray,
    ) -> Callable[[], None]:
        """The step's work on the stream, one closure, staged in buffer ``k`` of each ring (a
        CPU map: in ``staged``, the step's own array)."""
        fmap, model, n, dev, split = self.fmap, self.model, self.n, self.device, self.split
        host_in, host_out = self.staging_in[k], self.staging_out[k]
        on_cpu = fmap.device.type == "cpu"

        def ops() -> None:
            # The step's own array for a CPU map, else one H2D copy.
            if on_cpu:
                dev_in = torch.from_numpy(staged)
            else:
                dev_in = host_in.to(dev, non_blocking=True, copy=True)
            ids, seg, prefix, rids, lens, sreq = torch.tensor_split(dev_in, split)
            # A decode step, as the runtime prepares one: resolve in place, the rest are views.
            last = seg[:-1]
            fb = ForwardBatch(step, fmap.launch_resolve(ids), prefix, last, rids, lens, sreq, last)
            if not self.time_model:
                sampled = model.sample(model.forward(fb), fb, None)
            elif self.stream == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                sampled = model.sample(model.forward(fb), fb, None)
                end.record()
                timings.append((start, end))
            else:
                t0 = time.perf_counter()
                sampled = model.sample(model.forward(fb), fb, None)
                self.model_s.append(time.perf_counter() - t0)
            fmap.store(out, sampled)
            host_out[:n].copy_(sampled, non_blocking=True)
            host_out[n:].copy_(fmap.err, non_blocking=True)
            fmap.err.zero_()

        return ops

    def _read(self, out: Any, k: int, marker: Any, batch: Batch | None, worker: _Worker | None) -> np.ndarray:
        """Wait for a step's copy, check its error flag, release its handle, do the host work."""
        if worker is not None:
            worker.wait(marker)
        elif marker is not None:
            marker.synchronize()
        got = self.out_arrays[k][: self.n + 2].copy()
        if got[self.n]:
            raise AssertionError(f"hand loop: {got[self.n]} bad placeholder(s)")
        self.fmap.release(out)
        if batch is not None:
            StepResult(batch.step, batch, got[: self.n])  # what a scheduler's process would get
        process_step(self.host_work_s, self.clock)
        return got[: self.n]


class ZeroModel:
    """No device work: ``forward`` returns a zero logits view, ``sample`` its argmax (token 0)."""

    def __init__(self, n: int, device: str = "cpu") -> None:
        self.logits = torch.zeros(n, 2, device=device)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits[: batch.sample_rows.numel()]

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        return logits.argmax(dim=1)


class MinimalLoop:
    """A minimal decode loop in plain torch, no FutureMap: ``buf[row]`` holds request ``row``'s last
    token on the device. Per step: the host writes the step's index data (request rows,
    positions, sequence lengths) into a reusable staging buffer; one H2D copy; gather the last
    tokens ``buf[rows]``; forward; sample; scatter ``buf[rows] = tokens``; one D2H copy of the
    tokens, read at once (sync) or after the next step was launched (overlap)."""

    N_STAGING = 4

    def __init__(self, n: int, overlap: bool, device: str = "cpu") -> None:
        self.n, self.overlap, self.device, self.model = n, overlap, device, ZeroModel(n, device)
        cuda = torch.device(device).type == "cuda"
        pool = 2 * n + 8  # request rows: a pool larger than the batch, rows scattered in it
        self.rows = np.sort(np.random.default_rng(n).permutation(pool)[:n]).astype(np.int64)
        self.buf = torch.arange(pool, dtype=torch.int64, device=device)
        self.all_rows = torch.arange(n, dtype=torch.int64, device=device)  # decode: row q is request q's
        ring = range(self.N_STAGING)
        self.staging_in = [torch.zeros(3 * n, dtype=torch.int64, pin_memory=cuda) for _ in ring]
        self.staging_out = [torch.zeros(n, dtype=torch.int64, pin_memory=cuda) for _ in ring]
        self.in_arrays = [t.numpy() for t in self.staging_in]
        self.out_arrays = [t.numpy() for t in self.staging_out]

    def run(self, steps: int) -> None:
        n, model, buf, ar, dev = self.n, self.model, self.buf, self.all_rows, self.device
        cuda = torch.device(dev).type == "cuda"
        positions = np.full(n, 3, dtype=np.int64)
        prev: tuple[int, torch.cuda.Event | None] | None = None
        for step in range(steps):
            k = step % self.N_STAGING
            a = self.in_arrays[k]
            a[:n] = self.rows
            a[n : 2 * n] = positions
            np.add(positions, 1, out=a[2 * n :])
            dev_in = self.staging_in[k].to(dev, non_blocking=True, copy=True)
            rows, pos, lens = dev_in.split(n)
            ids = buf.index_select(0, rows)
            fb = ForwardBatch(step, ids, pos, ar, rows, lens, ar, ar)
            tokens = model.sample(model.forward(fb), fb, None)
            buf.index_copy_(0, rows, tokens)
            self.staging_out[k].copy_(tokens, non_blocking=True)
            event = torch.cuda.Event() if cuda else None
            if event is not None:
                event.record()
            cur: tuple[int, torch.cuda.Event | None] | None = (k, event)
            if self.overlap:
                cur, prev = prev, cur
            if cur is not None:
                self.read(*cur)
            positions += 1
        if prev is not None:
            self.read(*prev)

    def read(self, k: int, event: torch.cuda.Event | None) -> np.ndarray:
        if event is not None:
            event.synchronize()
        return self.out_arrays[k].copy()
