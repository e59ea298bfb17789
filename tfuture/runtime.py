"""The dual-stream overlap runtime: launch step N+1, then process step N on the host.

Per step, on the forward stream: prepare inputs (the fused resolve), forward, then sample,
store into the step's fresh slots, copy the tokens to host staging and record ``copy_done``.
A delayed step (grammar) launches its sample only after the previous step's results were
processed and its mask was built, and always before the next step's resolve. The forward
stream hands back only ``FutureIndices`` (``batch.out``) and the event-gated host copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tfuture.batch import Batch, ForwardBatch, Model, Scheduler, StepResult
from tfuture.futures import FutureError, FutureIndices, FutureMap, FutureMapFull, raise_if_flagged
from tfuture.streams import Delay, ForwardStream, Marker, Span, make_stream
from tfuture.trace import RunStats

__all__ = [
    "FutureError",
    "FutureIndices",
    "FutureMap",
    "FutureMapFull",
    "OverlapRuntime",
]


@dataclass(slots=True, eq=False)
class _Staging:
    """A host buffer for one step's D2H copy; reusable only once ``marker`` has completed."""

    tokens: torch.Tensor
    err: torch.Tensor
    marker: Marker | None = None


@dataclass(slots=True, eq=False)
class _InFlight:
    """Everything a launched step keeps alive until its results were processed."""

    step: int
    batch: Batch
    out: FutureIndices
    host_inputs: torch.Tensor
    fwd: ForwardBatch | None = None
    logits: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    staging: _Staging | None = None
    copy_done: Marker | None = None
    keep: list[torch.Tensor] = field(default_factory=list)


class OverlapRuntime:
    """Drive ``model`` through ``scheduler``'s steps, overlapped or in sync.

    Args:
        model: forward and sample functions (:class:`tfuture.batch.Model`).
        fmap: the future map; its device picks the backend (CUDA streams or a CPU worker).
        overlap: False runs the same steps one at a time (sync mode) for A/B comparison.
        delay: ``delay(op_name) -> seconds`` injected before each forward-stream op.
        trace: record per-op spans for bubble accounting and the Chrome trace.
    """

    def __init__(
        self,
        model: Model,
        fmap: FutureMap,
        *,
        overlap: bool = True,
        delay: Delay | None = None,
        trace: bool = True,
        n_staging: int = 4,
    ) -> None:
        if not isinstance(fmap, FutureMap):
            raise TypeError(f"fmap must be a FutureMap, got {type(fmap).__name__}")
        if n_staging < 3:
            raise ValueError(f"n_staging must be >= 3 (two steps in flight plus one), got {n_staging}")
        self.model, self.fmap, self.overlap = model, fmap, overlap
        self.delay, self.trace = delay, trace
        pin = fmap.device.type == "cuda"
        self._staging = [
            _Staging(torch.zeros(0, dtype=torch.int64, pin_memory=pin), torch.zeros(2, dtype=torch.int64, pin_memory=pin))
            for _ in range(n_staging)
        ]
        self._next_staging = 0
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
            self._stream.close()
        except BaseException:
            self._abort()
            raise
        finally:
            stats.wall = time.perf_counter() - t0
            stats.device_spans = self._stream.take_spans()
            stats.host_spans = self._host_spans
            stats.account()
            self.fmap.device_exec = None
            self._stream = None
        return stats

    def _loop_overlap(self, scheduler: Scheduler, max_steps: int | None) -> int:
        prev: _InFlight | None = None
        steps = 0
        while max_steps is None or steps < max_steps:
            batch = self._timed("schedule", scheduler.schedule)
            if batch is None:
                if prev is None:
                    break
                self._finish(prev, scheduler)
                prev = None
                continue
            cur = self._launch(batch)
            steps += 1
            if prev is not None:
                self._finish(prev, scheduler)
            if batch.delayed:
                self._launch_sample(cur, self._timed("mask", lambda: scheduler.build_mask(batch)))
            prev = cur
        if prev is not None:
            self._finish(prev, scheduler)
        return steps

    def _loop_sync(self, scheduler: Scheduler, max_steps: int | None) -> int:
        steps = 0
        while max_steps is None or steps < max_steps:
            batch = self._timed("schedule", scheduler.schedule)
            if batch is None:
                break
            cur = self._launch(batch)
            steps += 1
            if batch.delayed:
                self._launch_sample(cur, self._timed("mask", lambda: scheduler.build_mask(batch)))
            self._finish(cur, scheduler)
        return steps

    def _timed(self, name: str, fn):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return fn()
        finally:
            if self.trace:
                self._host_spans.append(Span(name, self._step, start, time.perf_counter()))

    def _launch(self, batch: Batch) -> _InFlight:
        """Enqueue prepare and forward (and sample unless delayed) for ``batch``; no host sync."""
        start = time.perf_counter()
        if not isinstance(batch, Batch):
            raise TypeError(f"schedule() must return a Batch or None, got {type(batch).__name__}")
        if batch.out is not None:
            raise ValueError("schedule() returned a Batch that was already launched")
        sample_reqs = np.flatnonzero(batch.sample)
        try:
            out = self.fmap.alloc(sample_reqs.size)
        except BaseException:
            self._release_all(batch.consumes)
            raise
        batch.out = out
        n_tok, n_req = batch.tokens.size, batch.n_reqs
        seg_starts = np.zeros(n_req + 1, dtype=np.int64)
        np.cumsum(batch.seg_lens, out=seg_starts[1:])
        seq_lens = batch.prefix_lens + batch.seg_lens
        # One host array and one H2D copy for all of the step's index data.
        packed = np.concatenate([batch.tokens, seg_starts, batch.prefix_lens, batch.req_ids, seq_lens, sample_reqs])
        rec = _InFlight(self._step, batch, out, torch.from_numpy(packed))
        self._step += 1
        self._inflight.append(rec)
        fmap, model, dev = self.fmap, self.model, self.fmap.device
        cuts = np.cumsum([n_tok, n_req + 1, n_req, n_req, n_req])

        def prepare() -> None:
            dev_in = rec.host_inputs.to(dev, non_blocking=True)
            tokens, seg, prefix, rids, lens, sreq = torch.tensor_split(dev_in, cuts.tolist())
            inputs = fmap.prepare_inputs(tokens, seg, prefix)
            rec.fwd = ForwardBatch(rec.step, *inputs, rids, lens, sreq)

        def forward() -> None:
            assert rec.fwd is not None
            rec.logits = model.forward(rec.fwd)

        stream = self._stream
        assert stream is not None
        stream.submit("prepare", rec.step, prepare)
        stream.submit("forward", rec.step, forward)
        # The resolve that reads these placeholders is enqueued: stream order protects them.
        self._release_all(batch.consumes)
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
        staging = self._acquire_staging(n)
        rec.staging = staging
        fmap, model, dev = self.fmap, self.model, self.fmap.device

        def sample() -> None:
            assert rec.fwd is not None and rec.logits is not None
            mask_dev = None if rec.mask is None else rec.mask.to(dev, non_blocking=True)
            tokens = model.sample(rec.logits, rec.fwd, mask_dev)
            if not isinstance(tokens, torch.Tensor) or tokens.shape != (n,):
                got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
                raise ValueError(f"sample must return [{n}] token ids, got {got}")
            fmap.store(rec.out, tokens)
            rec.sampled = tokens

        def copy() -> None:
            assert rec.sampled is not None
            staging.tokens[:n].copy_(rec.sampled, non_blocking=True)
            staging.err.copy_(fmap.err, non_blocking=True)
            fmap.err.zero_()

        stream = self._stream
        assert stream is not None
        stream.submit("sample", rec.step, sample)
        stream.submit("copy", rec.step, copy)
        rec.copy_done = staging.marker = stream.record()

    def _acquire_staging(self, n: int) -> _Staging:
        staging = self._staging[self._next_staging]
        self._next_staging = (self._next_staging + 1) % len(self._staging)
        # Reuse only after the copy that last wrote this buffer has completed.
        if staging.marker is not None and self._stream is not None:
            self._stream.wait(staging.marker)
        if staging.tokens.numel() < n:
            pin = self.fmap.device.type == "cuda"
            staging.tokens = torch.zeros(max(n, 2 * staging.tokens.numel()), dtype=torch.int64, pin_memory=pin)
        return staging

    def _finish(self, rec: _InFlight, scheduler: Scheduler) -> None:
        """Wait for ``rec``'s copy, check the error flag, hand the tokens to the scheduler."""
        stream = self._stream
        assert stream is not None and rec.copy_done is not None and rec.staging is not None
        self._timed("wait", lambda: stream.wait(rec.copy_done))
        raise_if_flagged(rec.staging.err.tolist())
        tokens = rec.staging.tokens[: len(rec.out)].numpy().copy()
        result = StepResult(rec.step, rec.batch, tokens)
        self._inflight.remove(rec)
        try:
            # The handle lives through process(), so the scheduler can still filter it.
            self._timed("process", lambda: scheduler.process(result))
        finally:
            self.fmap.release(rec.out)

    def _abort(self) -> None:
        """Drain and stop the stream, then release every handle the runtime still holds."""
        stream = self._stream
        if stream is not None:
            try:
                stream.wait(stream.record())
            except BaseException:  # noqa: S110 - the first failure is the one that re-raises
                pass
            stream.close()
        self.fmap.device_exec = None
        for rec in self._inflight:
            self._release_all([rec.out, *rec.batch.consumes])
        self._inflight = []

    def _release_all(self, handles: list[FutureIndices]) -> None:
        for h in handles:
            if not h.released:
                self.fmap.release(h)
        handles.clear()
