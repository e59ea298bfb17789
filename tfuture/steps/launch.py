"""How the runtime puts a step on the forward stream: :class:`StepLauncher`, the launch half
of :class:`tfuture.runtime.OverlapRuntime`.

A launch takes the batch's handles, asks the step kind for its plan, stages the plan's index
data (on CUDA one host buffer of the input ring and one H2D copy; on a CPU map fresh arrays the
step owns), allocates the step's fresh slots and submits the step as one unit of work:
``prepare`` (the staged data as the kind's named device views), the kind's forward ops, then its
sample ops and the ``copy`` of results and error flag (a delayed step's sample and copy follow
later, :meth:`StepLauncher._launch_sample`). Nothing here waits for the device. The loop, the
finish of a step and the error path are the runtime's (:mod:`tfuture.runtime`).
"""

from __future__ import annotations

import time
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from tfuture.core.future_map import FutureIndices, FutureMap
from tfuture.steps.base import InFlight, Op, StepKind
from tfuture.streams.backends import ForwardStream
from tfuture.streams.base import SpanLog
from tfuture.streams.staging import Layout, StagingRing, fresh_parts, fresh_words, staging_layout

__all__ = ["StepLauncher"]

_SIZE = attrgetter("size")
_NO_WORDS = np.empty(0, dtype=np.int64)
_NO_WORDS.flags.writeable = False


class StepLauncher:
    """The launch path of :class:`tfuture.runtime.OverlapRuntime` (see the module docstring),
    over the runtime's state below, which the runtime sets up and owns."""

    fmap: FutureMap
    kind: StepKind
    trace: bool
    _stream: ForwardStream | None
    _step: int
    _inflight: list[InFlight]
    _deferred: list[FutureIndices]
    _host_log: SpanLog
    _on_cpu: bool
    _in_ring: StagingRing
    _out_ring: StagingRing
    _err_host: np.ndarray | None
    _empty: torch.Tensor
    _mark: float
    _layouts: dict[tuple[int, ...], Layout]

    def _launch(self, batch: Any, scheduled: float = 0.0, start: float = 0.0) -> InFlight:
        """Enqueue prepare and the forward ops (and the sample unless delayed); no host sync.
        Traced: the spans of the schedule (from ``scheduled``) and of the launch (from ``start``,
        the schedule's end); ``_mark`` gets the launch's end."""
        stream, fmap, kind = self._stream, self.fmap, self.kind
        assert stream is not None
        consumes: Any = getattr(batch, "consumes", None)
        taken = type(consumes) is list
        if taken:
            for h in consumes:
                # A live handle of this map, outside debug mode: one test each (the usual case).
                if type(h) is not FutureIndices or h._pool is not fmap or h._released or h._gens is not None:
                    taken = False
                    break
        if not taken:
            consumes = fmap.take_handles(consumes, "batch.consumes")  # every check, its message
        out = None
        try:
            if getattr(batch, "out", None) is not None:
                raise ValueError("schedule() returned a batch that was already launched")
            if hasattr(batch, "step"):
                batch.step = self._step  # for the kind's messages; -1 again if the launch fails
            plan = kind.plan(batch)
            # On CUDA one host buffer and one H2D copy for all of the step's index data: the
            # non-empty parts back to back; ``cuts`` ends each one but the last (tensor_split's).
            parts = plan.inputs
            sizes = tuple(map(_SIZE, parts))
            layout = self._layouts.get(sizes)
            if layout is None:
                layout = staging_layout(sizes, self._layouts)
            total, cuts, n_live, trailing = layout
            # A CPU map needs no host staging buffer: its step gets fresh memory at once (below).
            staging = None if self._on_cpu else self._in_ring.acquire(total, stream)
            out = fmap.alloc(plan.n_out)
            if plan.with_out is not None:
                plan.with_out(out)
        except BaseException:
            if hasattr(batch, "step"):
                batch.step = -1
            if out is not None:
                fmap.release(out)
            fmap.release_live(consumes)
            raise
        batch.out, batch.step = out, self._step
        # The non-empty parts: in the staging buffer back to back, in one C call (as slice
        # assignments), copied on the stream and split there at ``cuts`` (tensor_split's
        # indices); on a CPU map each in a fresh int64 array the step owns, made at once: no
        # packing, no torch dispatch, and those arrays are the device inputs themselves.
        live = parts[:n_live] if trailing >= 0 else [part for part in parts if part.size]
        target = plan.target  # a graphed step's static inputs, or None: fresh memory
        data: Any = None
        arrays: tuple[np.ndarray, ...] = ()
        if staging is not None:
            if n_live:
                np.concatenate(live, out=staging.array[:total], casting="unsafe")
            data = staging.data[:total]
        elif target is None:
            arrays = fresh_parts(live)
        else:  # a graphed step on a CPU map: its static inputs take the packed words
            data = np.concatenate(live, dtype=np.int64, casting="unsafe") if n_live else np.empty(0, np.int64)
        rec = InFlight(self._step, batch, out, staging, plan.state)
        self._step += 1
        self._inflight.append(rec)
        dev, named, n_parts = fmap.device, type(parts), len(sizes)
        empty, empties = self._empty, (self._empty,) * max(trailing, 0)
        host_empties = (_NO_WORDS,) * max(trailing, 0)

        def prepare() -> None:
            # Fresh memory on every backend: the step must not alias a reusable host buffer.
            views: tuple[torch.Tensor, ...]
            if data is None:
                # A CPU map: the step's own arrays as tensors (the kind may read the arrays too).
                views = tuple(map(torch.from_numpy, arrays))
                if trailing >= 0:
                    rec.host_inputs = tuple.__new__(named, arrays + host_empties)
            else:
                if target is not None:
                    dev_in = target
                    if type(data) is np.ndarray:
                        target.numpy()[:] = data
                    else:
                        target.copy_(data, non_blocking=True)
                else:
                    dev_in = data.to(dev, non_blocking=True, copy=True)
                views = torch.tensor_split(dev_in, cuts) if cuts else (dev_in,) if n_live else ()
            if trailing > 0:
                views += empties
            elif trailing < 0:
                it = iter(views)
                views = tuple(next(it) if size else empty for size in sizes)
            if len(views) != n_parts:  # one view per part (namedtuple._make's check, inline)
                raise AssertionError(f"staged {len(views)} views for {n_parts} parts")
            kind.prepare(rec, tuple.__new__(named, views))  # the kind's named inputs, as device views

        delayed = rec.delayed = plan.delayed
        ops = [("prepare", prepare), *kind.forward_ops(rec)]
        if not delayed:
            ops += self._sample_ops(rec, None)
        # The whole step (or its head, when delayed) goes to the stream as one unit of work.
        stream.submit_ops(rec.step, ops)
        marker = stream.record()
        if staging is not None:
            staging.marker = marker
        if not delayed:
            rec.copy_done = marker
            if rec.staging is not None:
                rec.staging.marker = marker
        # The prepare that reads these placeholders is enqueued: stream order protects them.
        if consumes:
            fmap.release_live(consumes)
        if self._deferred:
            fmap.release_live(self._deferred)
        if self.trace:
            self._mark = end = time.perf_counter()
            step = rec.step
            self._host_log.items.extend(("schedule", step, scheduled, start, "launch", step, start, end))
        return rec

    def _launch_sample(self, rec: InFlight, mask: object) -> None:
        """Enqueue a delayed step's sample ops, its copy, and ``copy_done``."""
        stream = self._stream
        assert stream is not None
        ops = self._sample_ops(rec, mask)
        stream.submit_ops(rec.step, ops)
        rec.copy_done = marker = stream.record()
        if rec.staging is not None:
            rec.staging.marker = marker

    def _sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        """The kind's sample ops, then the D2H copy of results and error flag into a staging
        buffer of the output ring (acquired here: it waits until its last copy ran); on a CPU
        map, into fresh memory the step owns (:func:`tfuture.streams.staging.fresh_words`)."""
        stream, fmap, kind = self._stream, self.fmap, self.kind
        assert stream is not None
        ops = kind.sample_ops(rec, mask)
        n = rec.n_result = kind.n_result(rec)
        # The error flag is not zeroed per step: a set flag raises at this step's sync, and the
        # run's abort clears it once the stream is drained (one launch less per step).
        if self._on_cpu:
            err = self._err_host
            assert err is not None

            def copy_cpu() -> None:
                # A CPU map: the results as a fresh array the step owns, the flag as two ints.
                words = kind.result_array(rec)
                if words is None or words.size != n:
                    buf = torch.empty(n, dtype=torch.int64)
                    kind.copy_result(rec, buf)
                    words = buf.numpy()
                rec.words = fresh_words(words, err)

            return [*ops, ("copy", copy_cpu)]
        staging = rec.staging = self._out_ring.acquire(n + 2, stream)

        def copy() -> None:
            kind.copy_result(rec, staging.head(n))
            staging.data[n : n + 2].copy_(fmap.err, non_blocking=True)

        return [*ops, ("copy", copy)]
