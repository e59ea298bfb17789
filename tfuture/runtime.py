"""The dual-stream overlap runtime: one loop, overlapped or in sync, for every kind of step.

Per step, on the forward stream: ``prepare`` (one H2D copy of the step's index data, then the
kind's input preparation, where placeholders resolve), the kind's forward ops, then its sample
ops (the last stores into the step's fresh slots) unless the step is delayed, then ``copy``
(results and the error flag to host staging) and the ``copy_done`` marker. The host launches
step N+1, then processes step N: it waits on N's ``copy_done`` only then. A delayed step
(grammar) launches its sample after the previous step was processed and its mask built, and
always before the next step's resolve. The forward stream hands back only ``FutureIndices``
(``batch.out``) and the event-gated host copy. What a step does is a :class:`StepKind`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

import numpy as np
import torch

from tfuture.core.batch import Model, Scheduler
from tfuture.core.checks import as_count
from tfuture.core.errors import raise_if_flagged
from tfuture.core.future_map import FutureIndices, FutureMap
from tfuture.sampling import Sampler
from tfuture.steps.base import InFlight, Op, StepKind
from tfuture.steps.token import Buckets, TokenStep
from tfuture.streams.backends import BACKENDS, Delay, ForwardStream, drain_and_close, make_stream
from tfuture.streams.base import RunWrapper, SpanLog
from tfuture.streams.staging import Layout, StagingRing, fresh_parts, fresh_words, staging_layout
from tfuture.streams.stats import RunStats

__all__ = ["OverlapRuntime"]

T = TypeVar("T")
_SIZE = attrgetter("size")
_NO_WORDS = np.empty(0, dtype=np.int64)
_NO_WORDS.flags.writeable = False

# The scheduler hooks the loop calls on the host (a RunWrapper may target them).
HOST_HOOKS = ("schedule", "process", "build_mask")


class OverlapRuntime:
    """Drive a model through a scheduler's steps, overlapped or in sync.

    Args:
        model: a :class:`tfuture.core.batch.Model` (run as :class:`tfuture.steps.token.TokenStep`), or a
            :class:`tfuture.steps.base.StepKind` such as :class:`tfuture.spec.SpecTokenStep`.
        fmap: the future map; its device picks the backend (CUDA streams or a CPU worker).
        overlap: False runs the same steps one at a time (sync mode) for A/B comparison.
        stream: ``"auto"``, ``"worker"`` or ``"inline"`` (see :func:`tfuture.streams.backends.make_stream`).
        delay: ``delay(op_name) -> seconds`` injected before each forward-stream op.
        faults: a :class:`tfuture.streams.base.RunWrapper` that wraps each run's stream and
            scheduler from outside the loop, such as :class:`tfuture.testing.faults.FaultPlan`
            (delays, gc, exceptions); its ``delay`` is used when ``delay`` is not given.
        trace: record per-op spans for bubble accounting (``RunStats.device_idle``) and the
            Chrome trace; off by default (it costs host time on every step).
        n_staging: host staging buffers per direction (at least 3: two steps in flight); a CPU
            map stages none: a step's inputs and its results each get a fresh array.
        buckets: pad every token step to these shapes (:class:`tfuture.steps.token.Buckets`),
            so a model can capture one CUDA graph per bucket; for a plain model only.
        sampler: a :class:`tfuture.sampling.Sampler` that samples every token step (per-request
            parameters admitted with ``Batch.params``, packed bitmasks, only grammar rows wait) instead
            of the model's ``sample``; a model without ``sample`` gets ``Sampler()``.
        graphs: run each greedy step that fits a bucket as that bucket's captured step graph (one
            H2D copy, one replay, one D2H copy); needs ``buckets`` and a graph-safe model, see
            :mod:`tfuture.steps.graphs` (which steps fall back to eager launches, and why).
    """

    def __init__(
        self,
        model: Model | StepKind,
        fmap: FutureMap,
        *,
        overlap: bool = True,
        stream: str = "auto",
        delay: Delay | None = None,
        faults: RunWrapper | None = None,
        trace: bool = False,
        n_staging: int = 4,
        buckets: Buckets | None = None,
        sampler: Sampler | None = None,
        graphs: bool = False,
    ) -> None:
        if not isinstance(fmap, FutureMap):
            raise TypeError(f"fmap must be a FutureMap, got {type(fmap).__name__}")
        n_staging = as_count("n_staging", n_staging)
        if n_staging < 3:
            raise ValueError(f"n_staging must be >= 3 (two steps in flight plus one), got {n_staging}")
        if stream not in BACKENDS:
            raise ValueError(f"stream must be one of {BACKENDS}, got {stream!r}")
        if faults is not None and not isinstance(faults, RunWrapper):
            raise TypeError(
                "faults must be a RunWrapper (bind, wrap_stream, wrap_scheduler, delay) such as "
                f"tfuture.testing.faults.FaultPlan, or None, got {type(faults).__name__}"
            )
        if isinstance(model, StepKind) and (buckets is not None or sampler is not None or graphs):
            raise ValueError(
                "buckets, graphs and sampler are for token steps: pass them to a plain model, not to a "
                "step kind (a step kind takes its own: SpecTokenStep(model, drafter, sampler, buckets=))"
            )
        if not isinstance(graphs, bool):
            raise TypeError(f"graphs must be a bool, got {type(graphs).__name__}")
        self.kind: StepKind = (
            model if isinstance(model, StepKind) else TokenStep(model, buckets, sampler, graphs)
        )
        self.kind.bind(fmap)
        if faults is not None:
            faults.bind(self.kind.stream_ops, HOST_HOOKS)
        self.fmap, self.overlap, self.faults, self.trace, self.backend = fmap, overlap, faults, trace, stream
        self.delay = delay if delay is not None or faults is None else faults.delay
        pin = fmap.device.type == "cuda"
        self._on_cpu = fmap.device.type == "cpu"  # a CPU map stages and copies with numpy
        self._in_ring = StagingRing(n_staging, pin, "inputs")
        self._out_ring = StagingRing(n_staging, pin, "outputs")  # not used by a CPU map
        self._err_host = fmap.err.numpy() if self._on_cpu else None  # the error flag's host view
        self._stream: ForwardStream | None = None
        self._step = 0
        self._inflight: list[InFlight] = []
        self._deferred: list[FutureIndices] = []
        self._host_log = SpanLog()  # the host phases' spans (trace=True)
        self._open = False  # a cut run's per-request state is kept for the next run
        # The stream of a run whose drain was interrupted, while its worker still runs (see _abort).
        self._unsettled: ForwardStream | None = None
        self._empty = torch.empty(0, dtype=torch.int64, device=fmap.device)
        self._mark = 0.0  # traced: the last launch's end (the next wait's start)
        self._layouts: dict[tuple[int, ...], Layout] = {}  # staging layouts by part sizes

    @property
    def model(self) -> Any:
        return getattr(self.kind, "model", None)

    def run(self, scheduler: Scheduler | Any, max_steps: int | None = None) -> RunStats:
        """Run until ``scheduler.schedule()`` returns ``None`` with nothing in flight.

        ``scheduler``: a :class:`tfuture.core.batch.Scheduler` for token steps, or the scheduler
        protocol of the step kind (the speculative and multi-step kinds take the
        :class:`tfuture.spec.DraftBatch` batches of a ``ContinuousBatcher(speculative=k)`` or
        ``ContinuousBatcher(multi_step=K)``).

        ``max_steps``: launch at most that many steps (the ones in flight are finished). The
        requests of a run cut this way (or whose scheduler says ``cut``) may still be live: their
        per-request state (sampling parameters, penalty history, the model's KV rows) is kept,
        and a later ``run`` on this runtime continues them; :meth:`close` gives it up.

        An exception anywhere (forward, sample, a scheduler hook) stops the loop: the stream is
        drained and stopped, every slot the runtime holds is released, every request's state is
        freed, and the exception re-raises here with its original traceback. When the drain
        itself is interrupted (Ctrl-C again), the step the CPU worker runs still finishes after
        this returns: its requests' state is freed once it ended, at the start of the next
        ``run`` (which waits for it) or at :meth:`close`.
        """
        if max_steps is not None:
            max_steps = as_count("max_steps", max_steps)
        window = getattr(scheduler, "multi_step", 1)
        if isinstance(window, int) and window > 1 and not getattr(self.kind, "windows", False):
            # Before any step: the batch check would refuse only the first window, mid-run.
            raise ValueError(
                f"the scheduler runs multi-step windows (multi_step={window}) and this runtime's "
                f"{type(self.kind).__name__} runs one decode step per launch: give the runtime "
                "tfuture.spec.MultiStepTokenStep (tfuture.spec.SpecWindowStep for a speculative scheduler)"
            )
        self._settle()
        self.fmap.claim_driver()
        user_scheduler = scheduler
        stats = RunStats(mode="overlap" if self.overlap else "sync")
        t0 = time.perf_counter()
        stream: ForwardStream | None = None
        try:
            stream = make_stream(self.fmap.device, self.delay, self.trace, self.backend)
            if self.faults is not None:
                stream, scheduler = self.faults.wrap_stream(stream), self.faults.wrap_scheduler(scheduler)
            self._stream, self._step, self._host_log = stream, 0, SpanLog()
            # Markers belong to the stream that recorded them; the last run's stream is drained.
            self._in_ring.reset()
            self._out_ring.reset()
            self.fmap.device_exec = lambda fn: stream.submit("debug", -1, fn)
            cut = self._loop(scheduler, max_steps, stats) or bool(getattr(user_scheduler, "cut", False))
            self.fmap.release_live(self._deferred)
            stream.close()
            self.kind.drained()  # a cut run too: nothing in flight needs it now
            if cut:
                # Requests may still be live: their state (parameters, penalty history, KV rows)
                # stays for the next run of this runtime (close() gives it up).
                self._open = True
            else:
                self.close()
        except BaseException:
            self._abort()
            raise
        finally:
            stats.wall = time.perf_counter() - t0
            if stream is not None:
                stats.device_spans = stream.take_log()
            stats.host_spans = self._host_log  # Spans are made when read, the device totals too
            self.fmap.device_exec = None
            self._stream = None
            self.fmap.release_driver()
        return stats

    def close(self) -> None:
        """Free the per-request state a run cut by ``max_steps`` kept for its continuation (the
        sampler's rows, the model's ``close()``); a run that ends otherwise does this itself."""
        self._settle()
        self._open = False
        self.kind.close()

    def _settle(self) -> None:
        """Before the next run (or :meth:`close`): wait until the worker of a run whose drain
        was interrupted has finished the step it was running, then free what that step's late
        ops wrote (sampler rows and history, the model's KV rows, the error flag). Without the
        wait, those ops (its sample, record, store) would run into the next run's rows: the same
        request ids would get other tokens. Interruptible: Ctrl-C here leaves it for next time."""
        stream = self._unsettled
        if stream is None:
            return
        stream.wait_worker()
        self._unsettled = None
        self.fmap.err.zero_()
        self.kind.close()

    def _loop(self, scheduler: Scheduler, max_steps: int | None, stats: RunStats) -> bool:
        """The one loop: launch step N+1, then finish step N (sync: finish each step at once).
        True when ``max_steps`` stopped it (the scheduler may still have work)."""
        prev: InFlight | None = None
        cut = False
        # Host phases are traced inline, a clock read where one phase ends and the next starts
        # (schedule -> launch -> wait): a failed phase's span is never read, since the run
        # raises and its stats are dropped.
        trace, clock, log = self.trace, time.perf_counter, self._host_log
        start = mark = 0.0
        while True:
            if max_steps is not None and stats.steps >= max_steps:
                cut = True
                break
            if trace:
                start = clock()
                batch = scheduler.schedule()
                mark = clock()  # the schedule's end; the launch's start
            else:
                batch = scheduler.schedule()
            if batch is None:
                if trace:
                    log.items.extend(("schedule", self._step, start, mark))
                if prev is None:
                    break
                self._finish(prev, scheduler, stats)
                prev = None
                continue
            cur = self._launch(batch, start, mark)  # traced: both spans, and _mark its end
            stats.steps += 1
            if prev is not None:
                self._finish(prev, scheduler, stats, self._mark)
            if cur.delayed:
                self._delayed_sample(scheduler, cur)
            prev = cur
            if not self.overlap:
                self._finish(cur, scheduler, stats, None if cur.delayed else self._mark)
                prev = None
        if prev is not None:
            self._finish(prev, scheduler, stats)
        return cut

    def _delayed_sample(self, scheduler: Scheduler, rec: InFlight) -> None:
        """Build the mask on the host (the previous step is processed), then launch the sample."""
        mask = self._host("build_mask", rec.step, scheduler.build_mask, rec.batch)
        self._launch_sample(rec, mask)

    def _host(self, name: str, step: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: a host-side phase, timed for the trace (no closure to build)."""
        if not self.trace:
            return fn(*args)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._host_log.add(name, step, start, time.perf_counter())  # rare phases only

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

    def _finish(
        self, rec: InFlight, scheduler: Scheduler, stats: RunStats, start: float | None = None
    ) -> None:
        """Wait for ``rec``'s copy, check the error flag, hand the result to the scheduler.
        Traced: the wait's span starts at ``start`` (the launch's end, when this follows it)."""
        stream, kind, fmap = self._stream, self.kind, self.fmap
        assert stream is not None and rec.copy_done is not None
        marker, n, trace = rec.copy_done, rec.n_result, self.trace
        if trace:
            log, clock = self._host_log, time.perf_counter
            if start is None:
                start = clock()
            stream.wait(marker)
            waited = clock()
        else:
            stream.wait(marker)
        staging = rec.staging
        flag: Any
        if staging is None:  # a CPU map: the copy op made the step's own results and flag
            assert rec.words is not None  # the copy ran: the wait above raised otherwise
            words, flag = rec.words
        else:
            both = staging.array[: n + 2].copy()
            words, flag = both[:n], both[n:]
        result = kind.result(rec, words)  # first: a kind's own check names the request
        if flag[0]:
            raise_if_flagged(flag)
        self._inflight.remove(rec)
        stats.tokens += kind.n_tokens(result)
        out = rec.out
        try:
            # The handle lives through process(), so the scheduler can still filter it.
            if trace:
                began = clock()
                scheduler.process(result)
                log.items.extend(("wait", rec.step, start, waited, "process", rec.step, began, clock()))
            else:
                scheduler.process(result)
        except BaseException:
            if not out.released:
                fmap.release(out)
            raise
        if out._released:
            raise ValueError(
                f"scheduler.process released batch.out of step {rec.step}: the runtime owns batch.out "
                "and releases it after process (filter it to keep slots)"
            )
        if kind.keeps_out and self._step <= rec.step + 1:
            self._deferred.append(out)  # a later step may still name these slots
        else:
            fmap.release(out)

    def _abort(self) -> None:
        """Drain and stop the stream, then release every handle the runtime still holds."""
        if self._stream is not None:
            drain_and_close(self._stream)
        self.fmap.err.zero_()  # a reported flag does not stick to the next run
        self.fmap.device_exec = None
        held = [h for r in self._inflight for h in (r.out, *r.batch.consumes)]
        self.fmap.release_live(held + self._deferred)
        self._inflight = []
        self._deferred = []
        self._open = False
        if self._stream is not None and self._stream.alive:
            # An interrupted drain: the worker still runs a step, whose later ops (sample, record,
            # store) still write per-request state. It is freed once they ended (_settle), and the
            # sampler stays claimed meanwhile (another runtime on it is refused).
            self._unsettled = self._stream
        else:
            try:
                self.kind.close()
            except Exception:
                pass  # the first failure is the one that re-raises
