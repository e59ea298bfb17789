"""One running request's host state in a :class:`tfuture.scheduler.ContinuousBatcher`, and the
busy host work that stands in for a scheduler's bookkeeping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tfuture.core.batch import Batch
from tfuture.core.future_map import FutureIndices
from tfuture.grammars.base import Matcher
from tfuture.scheduler.request import RequestSpec

__all__ = ["_Req", "spin"]


def spin(seconds: float) -> None:
    """Busy host work that holds the GIL, like a Python scheduler's bookkeeping."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass(slots=True, eq=False)
class _Req:
    spec: RequestSpec
    fed: int = 0  # prompt tokens already sent to the model
    out: list[int] = field(default_factory=list)
    # (batch, first row in batch.out, rows) of its latest sampling step: an unseen token, or
    # (speculative) the slots of its last committed token and its drafts.
    pending: tuple[Batch, int, int] | None = None
    n_pending: int = 0  # launched but unprocessed sampling steps (each commits >= 1 token)
    pending_extra: int = 0  # drafts those steps verify: tokens they may commit beyond one each
    # Speculative: its pending slots, held by the batcher while it waits a step (the runtime
    # releases a step's slots once a later step was launched); named by its next step.
    kept: FutureIndices | None = None
    # Speculative with a grammar: the drafts its latest processed step stored (its next step
    # verifies them; its mask rows walk the matcher through them).
    drafts: tuple[int, ...] = ()
    # Multi-step: tokens its launched, unprocessed windows surely give beyond one each (pending_
    # extra holds them too, as a bound on its length; this one counts towards max_new).
    sure_extra: int = 0
    steps: int = 0  # sampling steps processed (model steps that gave it tokens)
    drafted: int = 0  # drafts it verified (speculative)
    accepted: int = 0  # of those, accepted
    finished: bool = False
    matcher: Matcher | None = None  # a grammar request's position in its grammar
    admitted: bool = False  # its parameters went out with its first step
    state: int = 0  # free for subclasses (a grammar state kept by hand)
    reason: str | None = None  # why it finished: one of FINISH_REASONS

    @property
    def known_len(self) -> int:
        return self.fed + len(self.out) + self.n_pending

    @property
    def done_by_length(self) -> bool:
        return len(self.out) + self.n_pending + self.sure_extra >= self.spec.max_new
