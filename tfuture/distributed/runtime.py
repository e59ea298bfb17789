"""``ParallelRuntime``: the one overlap loop on every rank of a tensor- and pipeline-parallel run."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from tfuture.core.checks import as_count
from tfuture.core.future_map import FutureMap
from tfuture.distributed.checks import agree
from tfuture.distributed.context import ParallelContext
from tfuture.distributed.failure import FailureWatcher, fail_run, finish_run
from tfuture.distributed.micro import MicroBatchScheduler
from tfuture.distributed.spec_step import ParallelSpecStep
from tfuture.distributed.step import ParallelStep, StageModel
from tfuture.distributed.window_step import ParallelWindowStep
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec.drafter import Drafter
from tfuture.steps.token import Buckets
from tfuture.streams.backends import Delay
from tfuture.streams.base import RunWrapper
from tfuture.streams.stats import RunStats

__all__ = ["ParallelRuntime"]


class ParallelRuntime:
    """Drive this rank's ``model`` (a :class:`tfuture.distributed.step.StageModel`) through the
    same schedulers as every other rank, overlapped or in sync.

    Every rank builds the same schedulers over the same requests with its own ``fmap`` (same
    capacity and dtype on every rank, checked) and calls :meth:`run` the same number of times.
    ``check`` (default: ``fmap.debug``) compares a digest of every step's batch and of every
    stored token across ranks (host syncs). ``buckets`` and ``sampler`` (every rank's own
    :class:`tfuture.sampling.Sampler`; the last stage's tensor rank 0 samples) and the other
    arguments as for :class:`tfuture.runtime.OverlapRuntime`.

    ``speculative``: a :class:`tfuture.spec.Drafter` (bound by the caller) makes the run
    speculative (:class:`tfuture.distributed.spec_step.ParallelSpecStep`): the schedulers give
    :class:`tfuture.spec.DraftBatch` objects (``ContinuousBatcher(speculative=k)``), every rank
    passes a drafter with the same ``k`` and the last stage's tensor rank 0 verifies and drafts.
    ``buckets`` pad its steps as they pad a plain run's.

    ``windows``: run multi-step decode windows
    (:class:`tfuture.distributed.window_step.ParallelWindowStep`): the schedulers may be
    ``ContinuousBatcher(multi_step=K)``, whose ``DraftBatch.n_steps = K`` batches run ``K``
    decode steps per launch (the last stage's tensor rank 0 samples each, and broadcasts them
    before the next step's forward). Explicit, as ``Engine(multi_step=K)`` is: without it
    :meth:`run` refuses a scheduler with ``multi_step > 1`` before any step. Every rank samples
    with a Sampler (``sampler``, or a default one), never the model's ``sample``. Under pipeline
    parallelism each later step of a window is a full traversal of the stages in lockstep (the
    window holds the pipeline). No ``buckets`` and no ``speculative`` with it.
    """

    def __init__(
        self,
        model: StageModel,
        fmap: FutureMap,
        ctx: ParallelContext,
        *,
        overlap: bool = True,
        stream: str = "auto",
        delay: Delay | None = None,
        faults: RunWrapper | None = None,
        trace: bool = False,
        check: bool | None = None,
        buckets: Buckets | None = None,
        sampler: Sampler | None = None,
        speculative: Drafter | None = None,
        windows: bool = False,
    ) -> None:
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        if not isinstance(fmap, FutureMap):
            raise TypeError(f"fmap must be a FutureMap, got {type(fmap).__name__}")
        self.ctx, self.fmap, self.overlap = ctx, fmap, bool(overlap)
        self.check = fmap.debug if check is None else bool(check)
        if not isinstance(windows, bool):
            raise TypeError(f"windows must be a bool, got {type(windows).__name__}")
        if windows and (speculative is not None or buckets is not None):
            what = "speculative=" if speculative is not None else "buckets="
            raise ValueError(f"multi-step windows (windows=True) take no {what} (not supported yet)")
        self.windows = windows
        self.kind: ParallelStep
        if windows:
            self.kind = ParallelWindowStep(model, ctx, check=self.check, sampler=sampler)
        elif speculative is None:
            self.kind = ParallelStep(model, ctx, check=self.check, buckets=buckets, sampler=sampler)
        else:
            self.kind = ParallelSpecStep(
                model, ctx, speculative, check=self.check, sampler=sampler, buckets=buckets
            )
        self.runtime = OverlapRuntime(
            self.kind, fmap, overlap=overlap, stream=stream, delay=delay, faults=faults, trace=trace
        )
        self.scheduler: MicroBatchScheduler | None = None

    @property
    def model(self) -> StageModel:
        return self.kind.model  # type: ignore[return-value]

    def run(self, schedulers: Any | Sequence[Any], max_steps: int | None = None) -> RunStats:
        """Run ``schedulers`` (one :class:`tfuture.core.batch.Scheduler`, or one per micro-batch group:
        ``ctx.pp`` groups keep the pipeline full) until all are done, or for ``max_steps``
        micro-batches (then up to ``pp - 1`` bubble steps deliver the last tokens).

        On a failure on any rank, every rank raises (the failing one its own exception, the
        others :class:`tfuture.distributed.failure.RankFailure` or their own error), every
        rank's slots are released and the process groups are torn down (``ctx`` is closed).
        A mismatched configuration (map capacity, dtype, debug, overlap, group count) raises
        :class:`tfuture.distributed.checks.RankDivergence` on every rank before any step.
        """
        ctx = self.ctx
        if ctx.closed:
            raise RuntimeError(f"{ctx!r} is closed (a failed run tears the process groups down)")
        if max_steps is not None:
            max_steps = as_count("max_steps", max_steps)
        groups = list(schedulers) if isinstance(schedulers, list | tuple) else [schedulers]
        if not groups:
            raise ValueError("run needs at least one scheduler, got an empty sequence")
        for i, g in enumerate(groups):
            missing = [m for m in ("schedule", "process", "build_mask") if not callable(getattr(g, m, None))]
            if missing:
                raise TypeError(f"scheduler {i} ({type(g).__name__}) lacks {', '.join(missing)}")
        window = max(_multi_step(i, g) for i, g in enumerate(groups))
        fmap = self.fmap
        config = {
            "map capacity": fmap.capacity,
            "map dtype": str(fmap.dtype),
            "debug checks": self.check,
            "overlap": self.overlap,
            "scheduler groups": len(groups),
            "max_steps": max_steps,
            "drafts per step (k)": getattr(self.kind, "k", 0),
            "multi-step window (K)": window,
            "windows": self.windows,
        }
        agree(ctx, config, "before the run: ")
        if window > 1 and isinstance(self.kind, ParallelSpecStep):
            raise ValueError(
                f"the schedulers run multi-step windows (multi_step={window}) and this run is speculative: "
                "speculative steps and windows together are not supported under tfuture.distributed yet "
                "(use multi_step=1, or windows=True without speculative=)"
            )
        if window > 1 and not self.windows:
            raise ValueError(
                f"the schedulers run multi-step windows (multi_step={window}) and this runtime runs one "
                "decode step per launch: build ParallelRuntime(..., windows=True)"
            )
        key = ctx.next_run()
        self.kind.reset()
        self.scheduler = MicroBatchScheduler(groups, self.kind, max_steps)
        watcher: AbstractContextManager[Any] = (
            FailureWatcher(ctx, key) if ctx.backend == "nccl" else nullcontext()
        )
        try:
            with watcher:
                stats = self.runtime.run(self.scheduler)
                self.kind.finish_sends()
        except BaseException as exc:
            self.kind.drop_sends()
            err = fail_run(ctx, key, exc)
            if err is exc:
                raise
            raise err from exc
        finish_run(ctx, key)
        return stats


def _multi_step(i: int, scheduler: Any) -> int:
    """Scheduler ``i``'s window length (``multi_step``, 1 when it has none), checked."""
    k = getattr(scheduler, "multi_step", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise TypeError(f"scheduler {i}'s multi_step must be an int >= 1, got {k!r}")
    return k
