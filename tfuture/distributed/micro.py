"""Micro-batches: how pipeline parallelism maps onto the runtime's one loop.

With ``P`` stages a micro-batch's tokens reach the first stage ``P - 1`` steps after its
forward started there: step ``n`` forwards micro-batch ``m_n`` and *delivers* (stores into its
fresh slots, copies to the host) the tokens of ``m_{n-P+1}``. So every rank runs the same
loop, and the scheduler sees results ``P - 1`` steps late. :class:`MicroBatchScheduler` hides
that from ordinary schedulers: it drives several *groups* (one scheduler each, disjoint
requests; ``P`` groups keep the pipe full) round robin. A group is asked for its next batch
only once its previous one was delivered, so each group sees exactly the one-step overlap of a
single rank: its batch ``j + 1`` is scheduled before batch ``j``'s tokens reached the host and
names them by placeholder. When no group has work while tokens are still in the pipe, a
*bubble* (an empty micro-batch) pushes them out. With ``P = 1`` it is a pass-through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from tfuture.core.batch import Batch, StepResult
from tfuture.core.slots import FutureIndices

__all__ = ["MicroBatch", "MicroBatchScheduler", "MicroResult"]


@dataclass(slots=True, eq=False)
class MicroBatch:
    """What the runtime launches: a group's :class:`tfuture.core.batch.Batch`, or a bubble (``micro``
    None). ``out`` (set by the runtime) holds the slots of the tokens this step delivers."""

    micro: Batch | None
    group: int = -1
    out: FutureIndices | None = None
    step: int = -1
    consumes: list[FutureIndices] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.micro is not None:
            self.consumes = self.micro.consumes


@dataclass(slots=True, eq=False)
class MicroResult:
    """A processed step: ``result`` for the group whose micro-batch was delivered (None for a
    step that delivered a bubble or nothing yet)."""

    step: int
    group: int
    result: StepResult | None

    @property
    def n_tokens(self) -> int:
        return 0 if self.result is None else int(self.result.tokens.size)


class _Pipe(Protocol):
    """What the scheduler asks the step kind: the groups with an undelivered micro-batch."""

    def undelivered_groups(self) -> set[int]: ...

    def real_undelivered(self) -> bool: ...


class MicroBatchScheduler:
    """Round-robin over ``groups`` (each a :class:`tfuture.core.batch.Scheduler`) for ``pipe``'s lag.

    ``schedule`` returns a :class:`MicroBatch` of the first group in turn that may schedule
    (its previous batch was delivered) and has work, a bubble while tokens are still in the
    pipe, or None when everything is done. After ``max_micro`` micro-batches no group is asked
    again; bubbles still deliver the tokens in flight (every token sent is received).
    """

    def __init__(self, groups: Sequence[Any], pipe: _Pipe, max_micro: int | None = None) -> None:
        self.groups = list(groups)
        self.pipe = pipe
        self.max_micro = max_micro
        self._next = 0
        self.bubbles = 0
        self.micro_batches = 0

    def schedule(self) -> MicroBatch | None:
        busy = self.pipe.undelivered_groups()
        n = 0 if self.max_micro is not None and self.micro_batches >= self.max_micro else len(self.groups)
        for i in range(n):
            g = (self._next + i) % n
            if g in busy:
                continue
            batch = self.groups[g].schedule()
            if batch is None:
                continue
            if not isinstance(batch, Batch):
                raise TypeError(
                    f"group {g}'s schedule() must return a Batch or None, got {type(batch).__name__}"
                )
            self._next = (g + 1) % n
            self.micro_batches += 1
            return MicroBatch(batch, g)
        if self.pipe.real_undelivered():
            self.bubbles += 1
            return MicroBatch(None)
        return None

    @property
    def cut(self) -> bool:
        """Whether ``max_micro`` stopped the groups (they may still have work)."""
        return self.max_micro is not None and self.micro_batches >= self.max_micro

    def process(self, result: MicroResult) -> None:
        if result.result is not None:
            group = self.groups[result.group]
            group.process(result.result)
            # A speculative group's next batch names the slots of this one, which the runtime
            # releases before the group's next turn may come: the group holds them itself.
            hold = getattr(group, "hold_slots", None)
            if hold is not None:
                hold(result.result.batch)

    def build_mask(self, batch: MicroBatch) -> np.ndarray | torch.Tensor | None:
        if batch.micro is None:
            return None
        mask: np.ndarray | torch.Tensor | None = self.groups[batch.group].build_mask(batch.micro)
        return mask
