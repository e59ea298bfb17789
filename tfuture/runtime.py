"""The dual-stream overlap runtime: one loop, overlapped or in sync, for every kind of step.

Per step, on the forward stream: ``prepare`` (one H2D copy of the step's index data, then the
kind's input preparation, where placeholders resolve), the kind's forward ops, then its sample
ops (the last stores into the step's fresh slots) unless the step is delayed, then ``copy``
(results and the error flag to host staging) and the ``copy_done`` marker. The host launches
step N+1, then processes step N: it waits on N's ``copy_done`` only then. A delayed step
(grammar) launches its sample after the previous step was processed and its mask built, and
always before the next step's resolve. The forward stream hands back only ``FutureIndices``
(``batch.out``) and the event-gated host copy. What a step does is a :class:`StepKind`; how a
step is staged and submitted is :class:`tfuture.steps.launch.StepLauncher` (this class's base).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tfuture.core.batch import Model, Scheduler
from tfuture.core.checks import as_count
from tfuture.core.errors import raise_if_flagged
from tfuture.core.future_map import FutureIndices, FutureMap
from tfuture.sampling import Sampler
from tfuture.steps.base import InFlight, StepKind
from tfuture.steps.launch import StepLauncher
from tfuture.steps.token import Buckets, TokenStep
from tfuture.streams.backends import BACKENDS, Delay, ForwardStream, drain_and_close, make_stream
from tfuture.streams.base import RunWrapper, SpanLog
from tfuture.streams.staging import Layout, StagingRing
from tfuture.streams.stats import RunStats

__all__ = ["OverlapRuntime"]

T = TypeVar("T")

# The scheduler hooks the loop calls on the host (a RunWrapper may target them).
HOST_HOOKS = ("schedule", "process", "build_mask")


class OverlapRuntime(StepLauncher):
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
