"""What a run measured: :class:`RunStats`, with bubble accounting and a Chrome-trace timeline."""

from __future__ import annotations

import json
import operator
import os
from dataclasses import dataclass, field

from tfuture.streams.backends import Span

_START = operator.itemgetter(2)  # a Span's start


@dataclass(slots=True)
class RunStats:
    """What one :meth:`OverlapRuntime.run` measured. Times are seconds.

    ``tokens`` counts the sampled tokens (one per sampling request per step, a speculative
    step's committed tokens, the extra step's discarded token included). ``device_idle`` is
    the forward stream's idle time between its first and last op, and ``idle_per_step[i]`` the
    idle gap before step ``i``'s first op.
    """

    mode: str
    steps: int = 0
    tokens: int = 0
    wall: float = 0.0
    device_busy: float = 0.0
    device_idle: float = 0.0
    idle_per_step: dict[int, float] = field(default_factory=dict)
    host_spans: list[Span] = field(default_factory=list)
    device_spans: list[Span] = field(default_factory=list)

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
        """Fill the device totals from ``device_spans``."""
        spans = sorted(self.device_spans, key=_START)
        busy = idle = 0.0
        last_end: float | None = None
        per_step: dict[int, float] = {}
        for _, step, start, end in spans:  # Spans are tuples: unpacking is the cheap read
            busy += end - start
            if last_end is not None and start > last_end:
                gap = start - last_end
                idle += gap
                per_step[step] = per_step.get(step, 0.0) + gap
            last_end = end if last_end is None or end > last_end else last_end
        self.device_busy, self.device_idle, self.idle_per_step = busy, idle, per_step

    def summary(self) -> str:
        return (
            f"{self.mode}: {self.steps} steps in {self.wall:.3f} s ({self.step_time * 1e3:.3f} ms/step), "
            f"{self.tokens} tokens ({self.tokens_per_s:.0f} tokens/s), "
            f"device idle {100 * self.idle_fraction:.1f}%"
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
