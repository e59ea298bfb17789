"""Issue 30 item 16: a ServingScheduler frees a request id once a batch reported it in
``Batch.ended`` (adding it again works), and its set of taken ids does not grow over a long run
of requests that come and go."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tfuture import FutureMap, OverlapRuntime, ServingScheduler
from tfuture.scheduler import RequestSpec
from tfuture.testing import ToyModel

VOCAB = 64
IDS, ROUNDS, NEW = (0, 1, 2), 12, 3
ANCHOR = 99  # a long request that keeps batches coming until every round was added
PROMPT = np.array([3, 4, 5], dtype=np.int64)


class Recycler:
    """Drives ``sched`` and adds each id again as soon as a batch reports it ended, ``ROUNDS``
    times (then aborts the anchor); records the most ids the scheduler held taken at once."""

    def __init__(self, sched: ServingScheduler) -> None:
        self.sched = sched
        self.rounds = dict.fromkeys(IDS, 1)
        self.most_taken = 0

    def schedule(self):
        batch = self.sched.schedule()
        if batch is not None:
            for rid in batch.ended.tolist():
                if rid != ANCHOR and self.rounds[rid] < ROUNDS:
                    self.sched.add(RequestSpec(rid, 0, PROMPT, NEW))  # free again: accepted
                    self.rounds[rid] += 1
            if all(n == ROUNDS for n in self.rounds.values()):
                self.sched.abort(ANCHOR)
        self.most_taken = max(self.most_taken, len(self.sched._ids))  # the taken-id set
        return batch

    def process(self, result) -> None:
        self.sched.process(result)

    def build_mask(self, batch):
        return self.sched.build_mask(batch)


@pytest.mark.parametrize("overlap", [True, False])
def test_an_ended_id_is_free_again_and_the_taken_ids_do_not_grow(overlap):
    model, fmap = ToyModel(vocab=VOCAB), FutureMap(32, device="cpu")
    outs: dict[int, list[list[int]]] = defaultdict(list)

    def heard(update) -> None:
        if update.finished:
            outs[update.rid].append(update.completion.token_ids)

    specs = [RequestSpec(rid, 0, PROMPT, NEW) for rid in IDS] + [RequestSpec(ANCHOR, 0, PROMPT, 500)]
    sched = ServingScheduler(fmap, specs, max_running=len(IDS) + 1, on_update=heard, retain=False)
    driver = Recycler(sched)
    OverlapRuntime(model, fmap, overlap=overlap).run(driver)
    sched.end_run()
    assert driver.rounds == dict.fromkeys(IDS, ROUNDS)
    anchor = outs.pop(ANCHOR)[0]
    assert 0 < len(anchor) < 500  # aborted once every round was in
    want = {rid: [model.reference(PROMPT, rid, NEW)] * ROUNDS for rid in IDS}
    assert dict(outs) == want  # every round of an id is a fresh request
    assert driver.most_taken <= len(IDS) + 1  # bounded by the live requests, not the run's length
    assert not sched._ids and not sched.live and fmap.in_use == 0
    # After the run every id is free as well.
    sched.add(RequestSpec(0, 0, PROMPT, NEW))
    with pytest.raises(ValueError, match="request id 0 is live"):
        sched.add(RequestSpec(0, 0, PROMPT, NEW))
