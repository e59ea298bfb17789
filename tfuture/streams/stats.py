"""What a run measured: :class:`RunStats`, with bubble accounting and a Chrome-trace timeline."""

from __future__ import annotations

import json
import os

import numpy as np

from tfuture.streams.base import Span, SpanLog

Spans = list[Span] | SpanLog


class RunStats:
    """What one :meth:`OverlapRuntime.run` measured. Times are seconds.

    ``tokens`` counts the sampled tokens (one per sampling request per step, a speculative
    step's committed tokens, the extra step's discarded token included). ``device_idle`` is
    the forward stream's idle time between its first and last op, and ``idle_per_step[i]`` the
    idle gap before step ``i``'s first op.

    ``host_spans`` and ``device_spans`` are lists of :class:`Span`; a run hands over the
    :class:`SpanLog` its hot path recorded, and the Spans are made when first read. The device
    totals (``device_busy``, ``device_idle``, ``idle_per_step``) are accounted from
    ``device_spans`` when first read after the spans were set (:meth:`account`), so a run whose
    stats nobody reads pays nothing for them.
    """

    __slots__ = (
        "_accounted",
        "_busy",
        "_device",
        "_host",
        "_idle",
        "_per_step",
        "mode",
        "steps",
        "tokens",
        "wall",
    )

    def __init__(
        self,
        mode: str,
        steps: int = 0,
        tokens: int = 0,
        wall: float = 0.0,
        device_busy: float = 0.0,
        device_idle: float = 0.0,
        idle_per_step: dict[int, float] | None = None,
        host_spans: Spans | None = None,
        device_spans: Spans | None = None,
    ) -> None:
        self.mode, self.steps, self.tokens, self.wall = mode, steps, tokens, wall
        self._busy, self._idle = device_busy, device_idle
        self._per_step: dict[int, float] = {} if idle_per_step is None else idle_per_step
        # Totals given here stand while no spans are: given spans are accounted when read.
        self._accounted = device_spans is None
        self._host: Spans = [] if host_spans is None else host_spans
        self._device: Spans = [] if device_spans is None else device_spans

    def __repr__(self) -> str:
        return (
            f"RunStats(mode={self.mode!r}, steps={self.steps}, tokens={self.tokens}, wall={self.wall:.6f}, "
            f"device_busy={self.device_busy:.6f}, device_idle={self.device_idle:.6f}, "
            f"host_spans=[{len(self._host)} spans], device_spans=[{len(self._device)} spans])"
        )

    @property
    def host_spans(self) -> list[Span]:
        """Host phases (schedule, launch, wait, process, ...), in start order."""
        if isinstance(self._host, SpanLog):
            self._host = self._host.spans()
        return self._host

    @host_spans.setter
    def host_spans(self, spans: Spans) -> None:
        self._host = spans

    @property
    def device_spans(self) -> list[Span]:
        """Forward-stream ops (prepare, forward, sample, copy, ...), in start order."""
        if isinstance(self._device, SpanLog):
            self._device = self._device.spans()
        return self._device

    @device_spans.setter
    def device_spans(self, spans: Spans) -> None:
        self._device = spans
        self._accounted = False  # the totals follow the spans, accounted when read

    @property
    def device_busy(self) -> float:
        """Sum of the forward-stream ops' times."""
        return self._totals()[0]

    @property
    def device_idle(self) -> float:
        """Idle time of the forward stream between its first and last op."""
        return self._totals()[1]

    @property
    def idle_per_step(self) -> dict[int, float]:
        """Step -> the idle gap(s) before that step's ops."""
        return self._totals()[2]

    def _totals(self) -> tuple[float, float, dict[int, float]]:
        """The device totals, accounted from the spans first when they changed since."""
        if not self._accounted:
            self.account()
        return self._busy, self._idle, self._per_step

    @property
    def step_time(self) -> float:
        return self.wall / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    @property
    def idle_fraction(self) -> float:
        span = self.device_busy + self.device_idle
        return self.device_idle / span if span else 0.0

    def account(self) -> None:
        """Fill the device totals from ``device_spans``: busy is the sum of the ops' times; in
        start order, a gap between an op's start and the latest end before it is idle, billed
        to that op's step."""
        dev = self._device
        if isinstance(dev, SpanLog):
            steps, starts, ends = dev.columns()
        else:
            t = np.array([(s[1], s[2], s[3]) for s in dev], dtype=np.float64).reshape(-1, 3)
            steps, starts, ends = t[:, 0], t[:, 1], t[:, 2]
        order = np.argsort(starts, kind="stable")
        steps, starts, ends = steps[order], starts[order], ends[order]
        per_step: dict[int, float] = {}
        idle = 0.0
        if starts.size > 1:
            gaps = starts[1:] - np.maximum.accumulate(ends)[:-1]
            late = gaps > 0
            gaps = gaps[late]
            if gaps.size:
                # Each step's gaps summed at once (a step may have several): no loop per span.
                owners, which = np.unique(steps[1:][late].astype(np.int64), return_inverse=True)
                per_step = dict(zip(owners.tolist(), np.bincount(which, weights=gaps).tolist(), strict=True))
                idle = float(gaps.sum())
        self._busy, self._idle, self._per_step = float((ends - starts).sum()), idle, per_step
        self._accounted = True

    def summary(self) -> str:
        """One line: steps, wall time, tokens/s, and the device's idle share (a run with steps
        but no device spans was not traced: ``trace=True`` records them)."""
        traced = self.device_busy > 0 or not self.steps
        idle = f"device idle {100 * self.idle_fraction:.1f}%" if traced else "device idle not traced"
        return (
            f"{self.mode}: {self.steps} steps in {self.wall:.3f} s ({self.step_time * 1e3:.3f} ms/step), "
            f"{self.tokens} tokens ({self.tokens_per_s:.0f} tokens/s), {idle}"
        )

    def write_chrome_trace(self, path: str) -> None:
        """Write a Chrome trace JSON (open in Perfetto or chrome://tracing): host and forward rows."""
        spans = [(0, s) for s in self.host_spans] + [(1, s) for s in self.device_spans]
        if not spans:
            t0 = 0.0
        else:
            t0 = min(s.start for _, s in spans)
        events: list[dict[str, object]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "host (schedule)"}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "forward stream"}},
        ]
        for tid, s in spans:
            events.append(
                {
                    "name": s.name,
                    "ph": "X",
                    "pid": 0,
                    "tid": tid,
                    "ts": (s.start - t0) * 1e6,
                    "dur": max(s.end - s.start, 0.0) * 1e6,
                    "args": {"step": s.step},
                }
            )
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
