"""Issue 30 item 7: a prompt id past the vocab of a request with penalties is refused when the
step that admits it is planned (host), naming the request, the id and the vocab; before, a
``Sampler`` without ``vocab_size`` died with an ``IndexError`` on the forward stream."""

from __future__ import annotations

import numpy as np
import pytest
from support import worker_threads

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams
from tfuture.scheduler.batcher import ContinuousBatcher, RequestSpec
from tfuture.testing import ToyModel

VOCAB = 64
PENALTY = SamplingParams(repetition_penalty=1.5)
PAST = r"request 1 has input token id 100, past the vocab of 64"


class Undeclared:
    """A :class:`ToyModel` that does not say its vocab (no ``vocab`` attribute): the sampler
    learns it from the first logits. Counts its forwards."""

    def __init__(self) -> None:
        self._toy = ToyModel(vocab=VOCAB)

    @property
    def calls(self) -> int:
        return self._toy.calls

    def forward(self, batch):
        return self._toy.forward(batch)


def _run(model, arrival: int, overlap: bool, prompt=(1, 2, 100), params=PENALTY) -> ContinuousBatcher:
    fmap = FutureMap(64, device="cpu")
    specs = [
        RequestSpec(0, 0, np.array([1, 2, 3]), 4, params=params),
        RequestSpec(1, arrival, np.array(prompt), 4, params=params),
    ]
    sched = ContinuousBatcher(specs, fmap, eos=-5, history_rows=4)
    try:
        OverlapRuntime(model, fmap, sampler=Sampler(history_rows=4), overlap=overlap).run(sched)
    finally:
        assert fmap.in_use == 0 and not worker_threads()  # nothing leaked, even when refused
    return sched


@pytest.mark.parametrize("overlap", [True, False])
def test_an_id_past_a_declared_vocab_is_refused_before_its_first_step_runs(overlap):
    # The model says its vocab: the Sampler (no vocab_size) checks the first step on the host.
    model = ToyModel(vocab=VOCAB)
    with pytest.raises(ValueError, match=rf"step 0: {PAST}"):
        _run(model, 0, overlap)
    assert model.calls == 0  # refused at admission: no forward ran


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("declared", [True, False])
def test_an_id_past_the_vocab_learnt_from_the_logits_is_refused_at_admission(overlap, declared):
    # Request 1 arrives once the sampler has seen logits: refused when its step is planned.
    model = ToyModel(vocab=VOCAB) if declared else Undeclared()
    with pytest.raises(ValueError, match=PAST):
        _run(model, 3, overlap)


@pytest.mark.parametrize("overlap", [True, False])
def test_an_id_past_a_vocab_nobody_knows_yet_is_refused_with_the_first_logits(overlap):
    # Neither the model nor the Sampler says the vocab before the first logits: the id is kept
    # and checked when they come (a ValueError naming the request, not an IndexError).
    with pytest.raises(ValueError, match=rf"step 0: {PAST}"):
        _run(Undeclared(), 0, overlap)


def test_ids_inside_the_vocab_and_requests_without_penalties_still_run():
    ok = _run(ToyModel(vocab=VOCAB), 0, True, prompt=(1, 2, VOCAB - 1))
    assert ok.finish_reasons == {0: "length", 1: "length"}
    # Without penalties the sampler marks nothing: an id the toy model hashes is its own business.
    free = _run(ToyModel(vocab=VOCAB), 0, True, params=None)
    assert len(free.outputs[1]) == 4


def test_check_inputs_names_the_request_of_the_offending_row():
    sampler = Sampler(history_rows=4, vocab_size=VOCAB)
    rids, seg = np.array([7, 9], dtype=np.int64), np.array([2, 3], dtype=np.int64)
    tokens = np.array([1, 2, 3, 70, -1], dtype=np.int64)  # request 9 holds 70 (and a placeholder)
    plan = sampler.plan_step(
        {7: PENALTY, 9: PENALTY}, rids, seg, np.zeros(2, np.int64), np.arange(2), np.empty(0, np.int64), 0
    )
    with pytest.raises(ValueError, match=r"step 0: request 9 has input token id 70, past the vocab of 64"):
        sampler.check_inputs(plan, tokens, rids, seg)
    tokens[3] = VOCAB - 1
    sampler.check_inputs(plan, tokens, rids, seg)  # inside the vocab: nothing raised
