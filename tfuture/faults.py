"""Fault injection for the runtime, for tfuture's tests and for users' own test suites.

``OverlapRuntime(..., faults=FaultPlan(...))`` then:

* sleeps a random ``0..max_delay_s`` before each forward-stream op named in ``delay_ops``
  (``torch.cuda._sleep`` on the CUDA stream, a sleep in the CPU worker), and a random
  ``0..host_delay_s`` on the host before it waits for a step, so both sides of every race
  get shifted;
* runs ``gc.collect()`` after every processed step (``gc_every_step``), so that a tensor
  the host dropped is really freed and its memory reused while a stream may still read it;
* raises :class:`InjectedFault` at ``raise_at[point] == step`` for the points ``prepare``,
  ``forward``, ``sample``, ``store``, ``copy`` (stream ops) and ``schedule``, ``process``,
  ``build_mask`` (host hooks).

On CUDA, run the process with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` as well
(it must be set before CUDA initializes, so the plan cannot set it for you).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

STREAM_POINTS = ("prepare", "forward", "sample", "store", "copy")
HOST_POINTS = ("schedule", "process", "build_mask")


class InjectedFault(RuntimeError):
    """Raised by a :class:`FaultPlan` at a planned point."""


@dataclass
class FaultPlan:
    """What to inject; ``injected`` counts what was injected, by kind."""

    seed: int = 0
    max_delay_s: float = 0.0
    delay_ops: tuple[str, ...] = STREAM_POINTS
    host_delay_s: float = 0.0
    gc_every_step: bool = False
    raise_at: dict[str, int] = field(default_factory=dict)
    injected: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        unknown = set(self.raise_at) - set(STREAM_POINTS) - set(HOST_POINTS)
        if unknown:
            raise ValueError(
                f"raise_at points must be among {STREAM_POINTS + HOST_POINTS}, got {sorted(unknown)}"
            )
        for name, value in (("max_delay_s", self.max_delay_s), ("host_delay_s", self.host_delay_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        ops = set(self.delay_ops) - set(STREAM_POINTS) - {"debug"}
        if ops:
            raise ValueError(f"delay_ops must be among {(*STREAM_POINTS, 'debug')}, got {sorted(ops)}")
        for point, step in self.raise_at.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"raise_at[{point!r}] must be a step number >= 0, got {step!r}")
        # One generator per side: the worker thread and the host draw independently.
        self._stream_rng = random.Random(self.seed)
        self._host_rng = random.Random(self.seed + 1)

    def delay(self, op: str) -> float:
        """Seconds to sleep before stream op ``op`` (the streams' ``delay`` hook)."""
        if self.max_delay_s <= 0 or op not in self.delay_ops:
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
