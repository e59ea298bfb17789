"""ContinuousBatcher: several stop tokens, and ended requests reported in the next batch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tfuture import FutureMap
from tfuture.core.batch import Batch
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams
from tfuture.testing import ContinuousBatcher, ToyModel, random_workload


class Watching(ContinuousBatcher):
    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.batches: list[Batch] = []

    def schedule(self) -> Batch | None:
        batch = super().schedule()
        if batch is not None and (not self.batches or self.batches[-1] is not batch):
            self.batches.append(batch)
        return batch


def test_any_of_several_stop_tokens_ends_a_request():
    specs = random_workload(3, 12, vocab=64, max_new=20)
    fmap = FutureMap(64, device="cpu")
    stop = {3, 5, 7, 11, 13}
    sched = Watching(specs, fmap, eos=stop)
    OverlapRuntime(ToyModel(vocab=64), fmap).run(sched)
    by_rid = {s.rid: s for s in specs}
    stopped = 0
    for rid, out in sched.outputs.items():
        assert not set(out[:-1]) & stop
        if len(out) < by_rid[rid].max_new:
            assert out[-1] in stop
            stopped += 1
    assert stopped, "no request ended on a stop token: pick other stop tokens"


def test_finished_requests_are_reported_once_and_never_scheduled_again():
    fmap = FutureMap(64, device="cpu")
    sched = Watching(random_workload(4, 12, vocab=64, max_new=6), fmap, max_running=4)
    OverlapRuntime(ToyModel(vocab=64), fmap).run(sched)
    reported: list[int] = []
    for i, batch in enumerate(sched.batches):
        ended = set(batch.ended.tolist())
        assert not ended & set(reported)
        reported += sorted(ended)
        later = {int(r) for b in sched.batches[i:] for r in b.req_ids}
        assert not ended & later, "a reported request appears in this or a later step"
    assert reported and set(reported) <= set(sched.outputs)
    assert np.unique(reported).size == len(reported)


def test_grammar_defaults_packed_masks_and_the_whole_step_waits():
    from tfuture.testing import RequestSpec, ToyGrammar

    fmap = FutureMap(16, device="cpu")
    specs = [RequestSpec(i, 0, np.array([1, 2]), 4, i == 1) for i in range(3)]
    sched = ContinuousBatcher(specs, fmap, grammar=ToyGrammar(64))
    assert (sched.mask, sched.delay) == ("bitmask", "batch")
    batch = sched.schedule()
    assert batch.delayed.all() and sched.build_mask(batch).shape == (3, 2)


def test_only_grammar_rows_wait_on_request():
    from tfuture.testing import RequestSpec, ToyGrammar

    fmap = FutureMap(16, device="cpu")
    specs = [RequestSpec(i, 0, np.array([1, 2]), 4, i == 1) for i in range(3)]
    sched = ContinuousBatcher(specs, fmap, grammar=ToyGrammar(64), delay="rows")
    batch = sched.schedule()
    assert batch.delayed.tolist() == [False, True, False]
    assert sched.build_mask(batch).dtype == np.int32 and sched.build_mask(batch).shape == (1, 2)


def test_a_bad_delay_is_named():
    from tfuture.testing import RequestSpec, ToyGrammar

    fmap = FutureMap(16, device="cpu")
    specs = [RequestSpec(0, 0, np.array([1, 2]), 4, True)]
    with pytest.raises(ValueError, match=r"delay must be one of \('rows', 'batch'\), got 'row'"):
        ContinuousBatcher(specs, fmap, grammar=ToyGrammar(64), delay="row")


class Holding(ContinuousBatcher):
    """Records, after each schedule, how many requests with penalties run at once."""

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.penalised_running: list[int] = []

    def schedule(self) -> Batch | None:
        batch = super().schedule()
        pen = [r for r in self.running if r.spec.params is not None and r.spec.params.has_penalties]
        self.penalised_running.append(len(pen))
        return batch


@pytest.mark.parametrize("overlap", [True, False])
def test_penalised_requests_wait_while_every_history_row_is_taken(overlap):
    # Issue 30 item 16: with history_rows=2 at most two requests with penalties run at once; the
    # others wait for admission (back-pressure) instead of failing the run for want of a row,
    # and every request gets the tokens it gets with rows to spare.
    pen = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5)
    base = random_workload(4, 6, vocab=64, max_new=6, arrival_span=0)
    specs = [replace(s, params=pen if s.rid % 3 else None) for s in base]  # 4 of 6 penalised
    outs = {}
    for rows in (2, 6):
        fmap = FutureMap(64, device="cpu")
        sched = Holding(specs, fmap, eos=-1, max_running=6, history_rows=rows)
        OverlapRuntime(ToyModel(vocab=64), fmap, sampler=Sampler(history_rows=rows), overlap=overlap).run(
            sched
        )
        assert fmap.in_use == 0 and sorted(sched.outputs) == [s.rid for s in specs]
        assert max(sched.penalised_running) == min(rows, 4)
        outs[rows] = sched.outputs
    assert outs[2] == outs[6]
