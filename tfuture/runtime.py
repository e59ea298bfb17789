"""The dual-stream overlap runtime: launch step N+1, then process step N on the host.

Per step, on the forward stream: prepare inputs (the fused resolve), forward, then sample,
store into the step's fresh slots, copy the tokens to host staging and record ``copy_done``.
A delayed step (grammar) launches its sample only after the previous step's results were
processed and its mask was built, and always before the next step's resolve. The forward
stream hands back only ``FutureIndices`` (``batch.out``) and the event-gated host copy.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from tfuture import _planted
from tfuture.batch import Batch, ForwardBatch, Model, Scheduler, StepResult
from tfuture.faults import FaultPlan
from tfuture.futures import FutureError, FutureIndices, FutureMap, FutureMapFull, raise_if_flagged
from tfuture.staging import Staging, StagingRing
from tfuture.streams import Delay, ForwardStream, Marker, Span, drain_and_close, make_stream
from tfuture.trace import RunStats

__all__ = ["FutureError", "FutureIndices", "FutureMap", "FutureMapFull", "OverlapRuntime"]

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class _InFlight:
    """Everything a launched step keeps alive until its results were processed."""

    step: int
    batch: Batch
    out: FutureIndices
    inputs: Staging
    fwd: ForwardBatch | None = None
    logits: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    staging: Staging | None = None
    copy_done: Marker | None = None


class OverlapRuntime:
    """Drive ``model`` through ``scheduler``'s steps, overlapped or in sync.

    Args:
        model: forward and sample functions (:class:`tfuture.batch.Model`).
        fmap: the future map; its device picks the backend (CUDA streams or a CPU worker).
        overlap: False runs the same steps one at a time (sync mode) for A/B comparison.
        delay: ``delay(op_name) -> seconds`` injected before each forward-stream op.
        faults: a :class:`tfuture.faults.FaultPlan` (delays, gc, exceptions); its delays are
            used when ``delay`` is not given.
        trace: record per-op spans for bubble accounting and the Chrome trace.
        n_staging: host staging buffers per direction (at least 3: two steps in flight).
    """

    def __init__(
        self,
        model: Model,
        fmap: FutureMap,
        *,
        overlap: bool = True,
        delay: Delay | None = None,
        faults: FaultPlan | None = None,
        trace: bool = True,
        n_staging: int = 4,
    ) -> None:
        if not isinstance(fmap, FutureMap):
            raise TypeError(f"fmap must be a FutureMap, got {type(fmap).__name__}")
        if n_staging < 3:
            raise ValueError(f"n_staging must be >= 3 (two steps in flight plus one), got {n_staging}")
        self.model, self.fmap, self.overlap, self.faults, self.trace = model, fmap, overlap, faults, trace
        self.delay = delay if delay is not None or faults is None else faults.delay
        pin = fmap.device.type == "cuda"
        self._in_ring = StagingRing(n_staging, pin, "no_input_keepalive")
        self._out_ring = StagingRing(n_staging, pin, "staging_no_wait")
        self._stream: ForwardStream | None = None
        self._step = 0
        self._inflight: list[_InFlight] = []
        self._host_spans: list[Span] = []

    def run(self, scheduler: Scheduler, max_steps: int | None = None) -> RunStats:
        """Run until ``scheduler.schedule()`` returns ``None`` with nothing in flight.

        An exception anywhere (forward, sample, a scheduler hook) stops the loop: the stream is
        drained and stopped, every slot the runtime holds is released, and the exception
        re-raises here with its original traceback.
        """
        stats = RunStats(mode="overlap" if self.overlap else "sync")
        self._stream = stream = make_stream(self.fmap.device, self.delay, self.trace)
        self.fmap.device_exec = lambda fn: stream.submit("debug", -1, fn)
        self._host_spans = []
        t0 = time.perf_counter()
        try:
            loop = self._loop_overlap if self.overlap else self._loop_sync
            stats.steps = loop(scheduler, max_steps)
            stream.close()
        except BaseException:
            self._abort()
            raise
        finally:
            stats.wall = time.perf_counter() - t0
            stats.device_spans = stream.take_spans()
            stats.host_spans = self._host_spans
            stats.account()
            self.fmap.device_exec = None
            self._stream = None
        return stats

    def _loop_overlap(self, scheduler: Scheduler, max_steps: int | None) -> int:
        prev: _InFlight | None = None
        late: _InFlight | None = None  # planted defect: a delayed sample launched one step late
        steps = 0
        while max_steps is None or steps < max_steps:
            batch = self._host("schedule", self._step, scheduler.schedule)
            if batch is None:
                if late is not None:
                    self._delayed_sample(scheduler, late)
                    late = None
                if prev is None:
                    break
                self._finish(prev, scheduler)
                prev = None
                continue
            cur = self._launch(batch)
            steps += 1
            if late is not None:
                self._delayed_sample(scheduler, late)
                late = None
            if prev is not None:
                self._finish(prev, scheduler)
            if batch.delayed:
                if "late_delayed_sample" in _planted.ACTIVE:
                    late = cur
                else:
                    self._delayed_sample(scheduler, cur)
            prev = cur
        if late is not None:
            self._delayed_sample(scheduler, late)
        if prev is not None:
            self._finish(prev, scheduler)
        return steps

    def _loop_sync(self, scheduler: Scheduler, max_steps: int | None) -> int:
        steps = 0
        while max_steps is None or steps < max_steps:
            batch = self._host("schedule", self._step, scheduler.schedule)
            if batch is None:
                break
            cur = self._launch(batch)
            steps += 1
            if batch.delayed:
                self._delayed_sample(scheduler, cur)
            self._finish(cur, scheduler)
        return steps

    def _delayed_sample(self, scheduler: Scheduler, rec: _InFlight) -> None:
        """Build the mask on the host (the previous step is processed), then launch the sample."""
        self._launch_sample(rec, self._host("build_mask", rec.step, lambda: scheduler.build_mask(rec.batch)))

    def _host(self, name: str, step: int, fn: Callable[[], T]) -> T:
        """Run a host-side phase: fault check, then ``fn``, timed for the trace."""
        start = time.perf_counter()
        try:
            if self.faults is not None:
                self.faults.check(name, step)
            return fn()
        finally:
            if self.trace:
                self._host_spans.append(Span(name, step, start, time.perf_counter()))

    def _submit(self, name: str, step: int, fn: Callable[[], None]) -> None:
        """Enqueue ``fn`` on the forward stream, behind the fault plan's check."""
        assert self._stream is not None
        faults = self.faults
        if faults is None:
            self._stream.submit(name, step, fn)
            return

        def checked() -> None:
            faults.check(name, step)
            fn()

        self._stream.submit(name, step, checked)

    def _launch(self, batch: Batch) -> _InFlight:
        """Enqueue prepare and forward (and sample unless delayed) for ``batch``; no host sync."""
        start = time.perf_counter()
        if not isinstance(batch, Batch):
            raise TypeError(f"schedule() must return a Batch or None, got {type(batch).__name__}")
        if batch.out is not None:
            raise ValueError("schedule() returned a Batch that was already launched")
        stream = self._stream
        assert stream is not None
        sample_reqs = np.flatnonzero(batch.sample)
        n_tok, n_req = batch.tokens.size, batch.n_reqs
        total = n_tok + 4 * n_req + 1 + sample_reqs.size
        try:
            staging = self._in_ring.acquire(total, stream)
            out = self.fmap.alloc(sample_reqs.size)
        except BaseException:
            self.fmap.release_live(batch.consumes)
            raise
        batch.out = out
        # One host buffer and one H2D copy for all of the step's index data.
        parts = [
            batch.tokens,
            None,
            batch.prefix_lens,
            batch.req_ids,
            batch.prefix_lens + batch.seg_lens,
            sample_reqs,
        ]
        host = staging.data.numpy()
        cuts = np.cumsum([0, n_tok, n_req + 1, n_req, n_req, n_req, sample_reqs.size])
        host[cuts[1]] = 0
        np.cumsum(batch.seg_lens, out=host[cuts[1] + 1 : cuts[2]])
        for i, part in enumerate(parts):
            if part is not None:
                host[cuts[i] : cuts[i + 1]] = part
        rec = _InFlight(self._step, batch, out, staging)
        self._step += 1
        self._inflight.append(rec)
        fmap, model, dev = self.fmap, self.model, self.fmap.device
        split = cuts[1:-1].tolist()
        data = staging.data[:total]

        def prepare() -> None:
            # A real copy on every backend: the step must not alias the reusable host buffer.
            dev_in = data.to(dev, non_blocking=True, copy=True)
            tokens, seg, prefix, rids, lens, sreq = torch.tensor_split(dev_in, split)
            inputs = fmap.prepare_inputs(tokens, seg, prefix)
            rec.fwd = ForwardBatch(rec.step, *inputs, rids, lens, sreq)

        def forward() -> None:
            assert rec.fwd is not None
            rec.logits = model.forward(rec.fwd)

        self._submit("prepare", rec.step, prepare)
        staging.marker = stream.record()
        self._submit("forward", rec.step, forward)
        # The resolve that reads these placeholders is enqueued: stream order protects them.
        self.fmap.release_live(batch.consumes)
        if not batch.delayed:
            self._launch_sample(rec, None)
        if self.trace:
            self._host_spans.append(Span("launch", rec.step, start, time.perf_counter()))
        return rec

    def _launch_sample(self, rec: _InFlight, mask: np.ndarray | torch.Tensor | None) -> None:
        """Enqueue sample, store into ``rec.out``, the D2H copy and ``copy_done``."""
        n = len(rec.out)
        if mask is not None:
            rec.mask = torch.as_tensor(mask)
            if rec.mask.dim() != 2 or rec.mask.shape[0] != n or rec.mask.dtype != torch.bool:
                raise ValueError(
                    f"build_mask must return a bool [n_sample={n}, vocab] mask, got "
                    f"{rec.mask.dtype} of shape {tuple(rec.mask.shape)}"
                )
        mask_ready = None
        if rec.mask is not None and self.fmap.device.type == "cuda":
            if rec.mask.is_cuda:
                # Built on the caller's stream: the forward stream must wait for it.
                mask_ready = torch.cuda.Event()
                mask_ready.record()
            else:
                # Pinned (torch's caching host allocator keeps it until the copy ran): a truly
                # async H2D copy, where pageable memory may make the host wait.
                rec.mask = rec.mask.pin_memory()
        assert self._stream is not None
        staging = rec.staging = self._out_ring.acquire(n + 2, self._stream)
        fmap, model, dev = self.fmap, self.model, self.fmap.device

        def sample() -> None:
            assert rec.fwd is not None and rec.logits is not None
            if mask_ready is not None:
                torch.cuda.current_stream(dev).wait_event(mask_ready)
            mask_dev = None if rec.mask is None else rec.mask.to(dev, non_blocking=True)
            tokens = model.sample(rec.logits, rec.fwd, mask_dev)
            if not isinstance(tokens, torch.Tensor) or tokens.shape != (n,):
                got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
                raise ValueError(f"sample must return [{n}] token ids, got {got}")
            rec.sampled = tokens

        def store() -> None:
            assert rec.sampled is not None
            fmap.store(rec.out, rec.sampled)

        def copy() -> None:
            assert rec.sampled is not None
            staging.data[:n].copy_(rec.sampled, non_blocking=True)
            staging.data[n : n + 2].copy_(fmap.err, non_blocking=True)
            fmap.err.zero_()

        self._submit("sample", rec.step, sample)
        self._submit("store", rec.step, store)
        self._submit("copy", rec.step, copy)
        rec.copy_done = staging.marker = self._stream.record()

    def _finish(self, rec: _InFlight, scheduler: Scheduler) -> None:
        """Wait for ``rec``'s copy, check the error flag, hand the tokens to the scheduler."""
        stream = self._stream
        assert stream is not None and rec.copy_done is not None and rec.staging is not None
        if self.faults is not None and (pause := self.faults.host_delay()) > 0:
            time.sleep(pause)
        marker = rec.copy_done
        self._host("wait", rec.step, lambda: stream.wait(marker))
        n = len(rec.out)
        host = rec.staging.data[: n + 2].numpy().copy()
        raise_if_flagged(host[n:])
        result = StepResult(rec.step, rec.batch, host[:n])
        self._inflight.remove(rec)
        try:
            # The handle lives through process(), so the scheduler can still filter it.
            self._host("process", rec.step, lambda: scheduler.process(result))
        finally:
            self.fmap.release(rec.out)
        if self.faults is not None and self.faults.gc_every_step:
            self.faults.injected["gc"] += 1
            gc.collect()

    def _abort(self) -> None:
        """Drain and stop the stream, then release every handle the runtime still holds."""
        abandon(self._stream, self.fmap, [h for r in self._inflight for h in (r.out, *r.batch.consumes)])
        self._inflight = []


def abandon(stream: ForwardStream | None, fmap: FutureMap, handles: list[FutureIndices]) -> None:
    """A runtime's error path: drain and stop ``stream``, then release every live handle.

    The stream's own failure, if any, is swallowed: the first failure is the one that re-raises.
    """
    if stream is not None:
        drain_and_close(stream)
    fmap.device_exec = None
    fmap.release_live(handles)
