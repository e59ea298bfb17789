"""The runtime releases a step's consumed handles only once the prepare that reads them is enqueued.

The batcher's consumed handles share their slots with the previous step's ``out`` (still live at
launch), so releasing them frees nothing. Here the scheduler instead keeps a handle of its own
from ``process`` (the README's ``keep = out.filter(...)``) and hands it over a step later: the
runtime has released that ``out`` by then, so the consumed handle holds the last reference and
its release frees the slots. In debug mode a release ahead of the prepare would free (and poison)
the slots on the stream before the prepare reads them: a FutureError.
"""

from __future__ import annotations

import numpy as np
import pytest

from tfuture import FutureIndices, FutureMap
from tfuture.core.batch import Batch, StepResult
from tfuture.runtime import OverlapRuntime
from tfuture.testing.toy import ToyModel

STEPS = 6


class KeepingScheduler:
    """One request; each step feeds back a sampled token through a handle kept in ``process``."""

    def __init__(self) -> None:
        self.kept: list[FutureIndices] = []
        self.consumed = 0
        self.launched = 0
        self.tokens: list[int] = []

    def schedule(self) -> Batch | None:
        if self.launched == STEPS:
            return None
        consumes: list[FutureIndices] = []
        tokens = np.array([5 + self.launched])
        if self.kept:
            h = self.kept.pop(0)
            tokens, consumes = h.host_placeholders(), [h]
            self.consumed += 1
        self.launched += 1
        pos = np.array([self.launched])
        return Batch(tokens, np.ones(1, np.int64), pos, np.zeros(1, np.int64), np.ones(1, bool), consumes)

    def process(self, result: StepResult) -> None:
        self.tokens.append(int(result.tokens[0]))
        assert result.batch.out is not None
        self.kept.append(result.batch.out.filter([0]))  # ours: the runtime releases out after this

    def build_mask(self, batch: Batch) -> None:
        raise AssertionError("no step is delayed")


def run(overlap: bool, debug: bool) -> list[int]:
    fmap = FutureMap(8, device="cpu", debug=debug)
    sched = KeepingScheduler()
    OverlapRuntime(ToyModel(vocab=64), fmap, overlap=overlap).run(sched)
    assert sched.consumed >= STEPS - 2  # most steps consumed a handle holding the last reference
    fmap.release_live(sched.kept)
    assert fmap.in_use == 0
    return sched.tokens


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_consumed_handle_holding_the_last_reference_is_released_after_the_prepare(overlap):
    assert run(overlap, debug=True) == run(overlap, debug=False)
