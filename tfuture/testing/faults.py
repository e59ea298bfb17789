"""Fault injection for the runtime, for tfuture's tests and for users' own test suites.

``OverlapRuntime(..., faults=FaultPlan(...))`` wraps its forward stream and its scheduler in
the plan's :class:`FaultyStream` and :class:`FaultyScheduler` (the loop itself has no fault
branches), and then:

* sleeps a random ``0..max_delay_s`` before each forward-stream op named in ``delay_ops``
  (``torch.cuda._sleep`` on the CUDA stream, a sleep in the CPU worker), and a random
  ``0..host_delay_s`` on the host before each wait on the forward stream (a step's results,
  a staging buffer), so both sides of every race get shifted;
* runs ``gc.collect()`` after every processed step (``gc_every_step``), so that a tensor
  the host dropped is really freed and its memory reused while a stream may still read it;
* raises :class:`InjectedFault` at ``raise_at[point] == step`` for the points ``prepare``,
  ``forward``, ``sample``, ``store``, ``copy``, ``verify``, ``draft`` (stream ops of token
  and speculative steps) and ``schedule``, ``process``, ``build_mask`` (host hooks).

On CUDA, run the process with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` as well
(it must be set before CUDA initializes, so the plan cannot set it for you).
"""

from __future__ import annotations

import gc
import math
import numbers
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tfuture.streams.backends import ForwardStream, Marker, Span
from tfuture.streams.base import SpanLog

# The main stream ops of a token step and of a speculative step; every kind lists all of its
# own in ``StepKind.stream_ops``, and a plan is checked against them when a runtime binds it.
TOKEN_POINTS = ("prepare", "forward", "sample", "store", "copy")
SPEC_POINTS = ("prepare", "verify", "draft", "store", "copy")
HOST_POINTS = ("schedule", "process", "build_mask")


class InjectedFault(RuntimeError):
    """Raised by a :class:`FaultPlan` at a planned point."""


class StepTypeError(TypeError, ValueError):
    """A ``raise_at`` step that is not an integer (a ``TypeError``, and a ``ValueError`` as
    before numpy integers were accepted)."""


@dataclass
class FaultPlan:
    """What to inject; ``injected`` counts what was injected, by kind."""

    seed: int = 0
    max_delay_s: float = 0.0
    delay_ops: tuple[str, ...] | None = None  # None: every stream op of the step kind
    host_delay_s: float = 0.0
    gc_every_step: bool = False
    raise_at: dict[str, int] = field(default_factory=dict)
    injected: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if not isinstance(self.raise_at, dict) or not all(isinstance(k, str) for k in self.raise_at):
            raise TypeError(f"raise_at must be a dict of op name -> step, got {self.raise_at!r}")
        if self.delay_ops is not None:
            if isinstance(self.delay_ops, str) or not all(isinstance(k, str) for k in self.delay_ops):
                raise TypeError(f"delay_ops must be a tuple of op names or None, got {self.delay_ops!r}")
            self.delay_ops = tuple(self.delay_ops)
        for name, value in (("max_delay_s", self.max_delay_s), ("host_delay_s", self.host_delay_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        steps: dict[str, int] = {}
        for point, step in self.raise_at.items():
            if isinstance(step, bool) or not isinstance(step, numbers.Integral):
                got = f"{type(step).__name__} {step!r}"
                raise StepTypeError(f"raise_at[{point!r}] must be a step number >= 0 (an int), got {got}")
            if step < 0:
                raise ValueError(f"raise_at[{point!r}] must be a step number >= 0, got {step}")
            steps[point] = int(step)
        self.raise_at = steps
        # One generator per side: the worker thread and the host draw independently.
        self._stream_rng = random.Random(self.seed)
        self._host_rng = random.Random(self.seed + 1)

    def bind(self, stream_ops: Sequence[str], host_hooks: Sequence[str]) -> None:
        """Called by a runtime with its step kind's stream op names and its host hooks: raise
        ``ValueError`` if the plan names an op or hook that the runtime never runs."""
        unknown = set(self.raise_at) - set(stream_ops) - set(host_hooks)
        if unknown:
            raise ValueError(
                f"raise_at points must be among this runtime's {(*stream_ops, *host_hooks)}, got "
                f"{sorted(unknown)}"
            )
        ops = set(self.delay_ops or ()) - set(stream_ops)
        if ops:
            raise ValueError(
                f"delay_ops must be among this runtime's stream ops {stream_ops}, got {sorted(ops)}"
            )

    def delay(self, op: str) -> float:
        """Seconds to sleep before stream op ``op`` (the streams' ``delay`` hook)."""
        if self.max_delay_s <= 0 or (self.delay_ops is not None and op not in self.delay_ops):
            return 0.0
        self.injected["stream_delay"] += 1
        return self._stream_rng.random() * self.max_delay_s

    def host_delay(self) -> float:
        if self.host_delay_s <= 0:
            return 0.0
        self.injected["host_delay"] += 1
        return self._host_rng.random() * self.host_delay_s

    def check(self, point: str, step: int) -> None:
        """Raise :class:`InjectedFault` if the plan says so for ``point`` at ``step``."""
        if self.raise_at.get(point) == step:
            self.injected[f"raise_{point}"] += 1
            raise InjectedFault(f"injected fault at {point} of step {step}")

    def wrap_stream(self, inner: ForwardStream) -> FaultyStream:
        return FaultyStream(inner, self)

    def wrap_scheduler(self, inner: Any) -> FaultyScheduler:
        return FaultyScheduler(inner, self)


class FaultyStream(ForwardStream):
    """``inner`` with the plan's exceptions raised inside its ops and host delays before its
    waits (stream-side delays are ``inner``'s own ``delay`` hook)."""

    def __init__(self, inner: ForwardStream, plan: FaultPlan) -> None:
        super().__init__(None, inner.trace)
        self.inner, self.plan = inner, plan

    def submit(self, name: str, step: int, fn: Callable[[], object]) -> None:
        self.submit_ops(step, ((name, fn),))

    def submit_ops(self, step: int, ops: Sequence[tuple[str, Callable[[], object]]]) -> None:
        self.inner.submit_ops(step, [(name, self._checked(name, step, fn)) for name, fn in ops])

    def _checked(self, name: str, step: int, fn: Callable[[], object]) -> Callable[[], None]:
        plan = self.plan

        def checked() -> None:
            plan.check(name, step)
            fn()

        return checked

    def record(self) -> Marker:
        return self.inner.record()

    def wait(self, marker: Marker) -> None:
        pause = self.plan.host_delay()
        if pause > 0:
            time.sleep(pause)
        self.inner.wait(marker)

    def raise_if_failed(self) -> None:
        self.inner.raise_if_failed()

    def abandon(self) -> None:
        super().abandon()
        self.inner.abandon()

    @property
    def failed(self) -> bool:
        return self.inner.failed

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def wait_worker(self) -> None:
        self.inner.wait_worker()

    def close(self) -> None:
        self.inner.close()

    def take_log(self) -> SpanLog:
        return self.inner.take_log()

    def take_spans(self) -> list[Span]:
        return self.inner.take_spans()


class FaultyScheduler:
    """``inner`` with the plan's host faults: exceptions in its hooks and ``gc.collect()`` after
    each ``process``. Steps are counted as the runtime counts them."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self.inner, self.plan = inner, plan
        self._launched = 0

    def schedule(self) -> Any:
        self.plan.check("schedule", self._launched)
        batch = self.inner.schedule()
        if batch is not None:
            self._launched += 1
        return batch

    def build_mask(self, batch: Any) -> Any:
        self.plan.check("build_mask", batch.step)
        return self.inner.build_mask(batch)

    def process(self, result: Any) -> None:
        plan = self.plan
        plan.check("process", result.step)
        self.inner.process(result)
        if plan.gc_every_step:
            plan.injected["gc"] += 1
            gc.collect()


def random_delay(seed: int, p: float = 0.3, max_s: float = 2e-3) -> Callable[[str], float]:
    """A seeded ``delay`` hook for the forward stream (``OverlapRuntime(..., delay=...)``): sleep a
    uniform ``0..max_s`` seconds before an op with probability ``p``."""
    rng = np.random.default_rng(seed)
    return lambda name: float(rng.uniform(0, max_s)) if rng.random() < p else 0.0
