"""A decode-only scheduler for the runtime benchmarks (``bench_overlap``, ``bench_runtime_overhead``).

``n`` requests that decode forever: every step decodes every request. Under overlap, step N+1
is scheduled before step N's tokens reached the host, so its tokens are the placeholders of
a handle filtered from step N's ``out``; in sync mode the tokens are the concrete ones that
:meth:`DecodeScheduler.process` received. ``host_work_s`` of host spin per processed step
(Python holding the GIL, as a scheduler's bookkeeping does) stands in for T_cpu.
"""

from __future__ import annotations

import time

import numpy as np

from tfuture.core.batch import Batch, StepResult


def spin(seconds: float) -> None:
    """Busy host work that holds the GIL."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class DecodeScheduler:
    """``n`` requests decoding one token per step, for as many steps as the runtime runs."""

    def __init__(self, n: int, host_work_s: float = 0.0) -> None:
        self.n, self.host_work_s = n, host_work_s
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
        if self.host_work_s > 0:
            spin(self.host_work_s)
        self.tokens = result.tokens
        if result.batch is self.last:
            self.last = None

    def build_mask(self, batch: Batch) -> None:
        return None
