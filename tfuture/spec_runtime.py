"""Overlapped speculative decoding: launch step N+1 from step N's fields, then process step N.

Per step, on the forward stream: ``prepare`` (one launch: each request's ``[last accepted
token, k drafts]`` row and positions, read from its previous step's slot fields, so the
accepted length never visits the host), ``verify`` (target greedy tokens and greedy
acceptance), ``draft`` (the next step's drafts), ``store`` (every field of the step into its
fresh slots, one launch), then ``copy`` (gather ``tokens`` and ``accept_len`` from those slots
and copy them to host staging) and the ``copy_done`` marker. The host learns step N's accepted
lengths only when it processes step N, after step N+1 was launched.

A step's ``out`` handle stays live until the step was processed *and* a later step was
launched, so a scheduler can always refer to its latest step's slots, in both modes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tfuture import FutureIndices, FutureMap
from tfuture.fields import FutureFields
from tfuture.futures import raise_if_flagged
from tfuture.kernels.spec import SpecInputs, prepare_spec_inputs
from tfuture.runtime import abandon
from tfuture.spec_batch import (
    HOST_FIELDS,
    SpecBatch,
    SpecModel,
    SpecResult,
    SpecScheduler,
    SpecStats,
    greedy_accept,
    spec_fields,
)
from tfuture.streams import Delay, ForwardStream, Marker, make_stream


@dataclass(slots=True, eq=False)
class _Staging:
    tokens: torch.Tensor
    accept: torch.Tensor
    err: torch.Tensor
    marker: Marker | None = None


@dataclass(slots=True, eq=False)
class _InFlight:
    step: int
    batch: SpecBatch
    out: FutureIndices
    host_inputs: torch.Tensor
    staging: _Staging
    inputs: SpecInputs | None = None
    req_ids: torch.Tensor | None = None
    payload: dict[str, torch.Tensor] = field(default_factory=dict)
    copy_done: Marker | None = None


class SpecRuntime:
    """Drive ``model`` through ``scheduler``'s speculative steps, overlapped or in sync.

    ``overlap=False`` runs the same steps one at a time (same interface, for A/B checks).
    ``delay(op_name) -> seconds`` is injected before each forward-stream op.
    """

    def __init__(
        self, model: SpecModel, fmap: FutureMap, *, overlap: bool = True, delay: Delay | None = None
    ) -> None:
        if not isinstance(fmap, FutureMap):
            raise TypeError(f"fmap must be a FutureMap, got {type(fmap).__name__}")
        self.model, self.fmap, self.overlap, self.delay = model, fmap, overlap, delay
        self.k = int(model.k)
        self.fields = FutureFields(fmap, {**spec_fields(self.k), **model.extra_fields})
        self._bufs = [self.fields.buffer(n) for n in ("tokens", "accept_len", "new_seq_len", "draft_tokens")]
        # Two steps in flight plus one being filled; a buffer is reused after its marker.
        self._staging = [self._new_staging(16) for _ in range(3)]
        self._next = 0
        self._stream: ForwardStream | None = None
        self._step = 0
        self._inflight: list[_InFlight] = []
        self._deferred: list[FutureIndices] = []

    def run(self, scheduler: SpecScheduler, max_steps: int | None = None) -> SpecStats:
        """Run until ``schedule()`` returns ``None`` with nothing in flight.

        An exception (forward-stream op or scheduler hook) drains and stops the stream,
        releases every handle the runtime holds, and re-raises here with its traceback.
        """
        stats = SpecStats("overlap" if self.overlap else "sync")
        self._stream = stream = make_stream(self.fmap.device, self.delay, trace=False)
        # Debug-mode device effects of alloc/release stay ordered with this stream's work.
        self.fmap.device_exec = lambda fn: stream.submit("debug", -1, fn)
        t0 = time.perf_counter()
        try:
            prev: _InFlight | None = None
            while max_steps is None or stats.steps < max_steps:
                batch = scheduler.schedule()
                if batch is None:
                    if prev is None:
                        break
                    self._finish(prev, scheduler, stats)
                    prev = None
                    continue
                cur = self._launch(batch)
                stats.steps += 1
                if prev is not None:
                    self._finish(prev, scheduler, stats)
                prev = cur
                if not self.overlap:
                    self._finish(cur, scheduler, stats)
                    prev = None
            if prev is not None:
                self._finish(prev, scheduler, stats)
            self.fmap.release_live(self._deferred)
            self._stream.close()
        except BaseException:
            self._abort()
            raise
        finally:
            stats.wall = time.perf_counter() - t0
            self.fmap.device_exec = None
            self._stream = None
        return stats

    def _new_staging(self, rows: int) -> _Staging:
        pin = self.fmap.device.type == "cuda"
        return _Staging(
            torch.zeros((rows, self.k + 1), dtype=torch.int64, pin_memory=pin),
            torch.zeros(rows, dtype=torch.int32, pin_memory=pin),
            torch.zeros(2, dtype=torch.int64, pin_memory=pin),
        )

    def _acquire_staging(self, n: int) -> _Staging:
        i = self._next
        self._next = (i + 1) % len(self._staging)
        staging = self._staging[i]
        # Reuse only after the copy that last wrote this buffer has completed.
        if staging.marker is not None and self._stream is not None:
            self._stream.wait(staging.marker)
        if staging.accept.numel() < n:
            staging = self._staging[i] = self._new_staging(max(n, 2 * staging.accept.numel()))
        return staging

    def _launch(self, batch: SpecBatch) -> _InFlight:
        """Enqueue prepare, verify, draft, store and the host copy; no host sync."""
        if not isinstance(batch, SpecBatch) or batch.out is not None:
            self.fmap.release_live(getattr(batch, "consumes", []))
            raise TypeError(f"schedule() must return a fresh SpecBatch or None, got {batch!r}")
        n = batch.last.size
        try:
            staging = self._acquire_staging(n)
            batch.out = self.fmap.alloc(n)
        except BaseException:
            self.fmap.release_live(batch.consumes)
            raise
        # One host array and one H2D copy for all of the step's index data.
        packed = torch.from_numpy(np.concatenate([batch.last, batch.seq_lens, batch.req_ids]))
        rec = _InFlight(self._step, batch, batch.out, packed, staging)
        self._step += 1
        self._inflight.append(rec)
        fmap, fields, model, dev = self.fmap, self.fields, self.model, self.fmap.device

        def prepare() -> None:
            last, lens, rec.req_ids = rec.host_inputs.to(dev, non_blocking=True).split(n)
            rec.inputs = prepare_spec_inputs(last, lens, *self._bufs, err=fmap.err)

        def verify() -> None:
            assert rec.inputs is not None and rec.req_ids is not None
            target = model.verify(rec.step, rec.inputs, rec.req_ids)
            if not isinstance(target, torch.Tensor) or target.shape != (n, self.k + 1):
                got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
                raise ValueError(f"verify must return [{n}, {self.k + 1}] token ids, got {got}")
            acc = greedy_accept(rec.inputs, target)
            new_len = rec.inputs.positions[:, 0] + 1 + acc
            rec.payload = {"tokens": target.to(torch.int64), "accept_len": acc, "new_seq_len": new_len}

        def draft() -> None:
            assert rec.req_ids is not None
            acc, new_len = rec.payload["accept_len"], rec.payload["new_seq_len"]
            last = rec.payload["tokens"].gather(1, (acc.to(torch.int64) - 1)[:, None]).squeeze(1)
            rec.payload |= model.draft(last, new_len - 1, rec.req_ids)
            missing = sorted(set(fields.names) - rec.payload.keys())
            if missing:
                raise ValueError(f"draft must return every declared field, missing {missing}")

        def copy() -> None:
            got = fields.gather(rec.out, HOST_FIELDS)
            staging.tokens[:n].copy_(got["tokens"], non_blocking=True)
            staging.accept[:n].copy_(got["accept_len"], non_blocking=True)
            staging.err.copy_(fmap.err, non_blocking=True)
            fmap.err.zero_()

        stream = self._stream
        assert stream is not None
        stream.submit("prepare", rec.step, prepare)
        # The prepare that reads these placeholders is enqueued: stream order protects them.
        self.fmap.release_live(batch.consumes)
        self.fmap.release_live(self._deferred)
        stream.submit("verify", rec.step, verify)
        stream.submit("draft", rec.step, draft)
        stream.submit("store", rec.step, lambda: fields.store(rec.out, rec.payload))
        stream.submit("copy", rec.step, copy)
        rec.copy_done = staging.marker = stream.record()
        return rec

    def _finish(self, rec: _InFlight, scheduler: SpecScheduler, stats: SpecStats) -> None:
        """Wait for ``rec``'s copy, check the error flag, hand the result to the scheduler."""
        stream = self._stream
        assert stream is not None and rec.copy_done is not None
        stream.wait(rec.copy_done)
        raise_if_flagged(rec.staging.err.tolist())
        n = len(rec.out)
        accept = rec.staging.accept[:n].numpy().astype(np.int64)
        result = SpecResult(rec.step, rec.batch, rec.staging.tokens[:n].numpy().copy(), accept)
        self._inflight.remove(rec)
        # Keep the slots until a later step is launched: it may still name them.
        if self._step > rec.step + 1:
            self.fmap.release(rec.out)
        else:
            self._deferred.append(rec.out)
        stats.rows += n
        stats.accepted += int(accept.sum())
        scheduler.process(result)

    def _abort(self) -> None:
        """Drain and stop the stream, then release every handle the runtime still holds."""
        held = [h for r in self._inflight for h in (r.out, *r.batch.consumes)]
        abandon(self._stream, self.fmap, held + self._deferred)
        self._inflight = []
        self._deferred = []
