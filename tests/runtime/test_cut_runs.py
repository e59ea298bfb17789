"""A run cut by ``max_steps`` and then continued gives the tokens of an uncut run: per-request
state (sampling parameters, penalty history) lives until the scheduler says a request ended."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams
from tfuture.testing import ContinuousBatcher, TinyTransformer, random_workload

VOCAB = 64
PARAMS = [
    SamplingParams(temperature=0.9, seed=5, frequency_penalty=0.8),
    SamplingParams(temperature=1.2, top_p=0.9, seed=9, presence_penalty=0.5),
    SamplingParams(repetition_penalty=1.4),
    None,
]


def specs() -> list:
    base = random_workload(4, 6, vocab=VOCAB, max_prompt=6, max_new=10, arrival_span=2)
    return [replace(s, params=PARAMS[i % len(PARAMS)]) for i, s in enumerate(base)]


def run(cuts: list[int | None], overlap: bool) -> tuple[dict[int, list[int]], Sampler, FutureMap]:
    fmap = FutureMap(32, device="cpu")
    sampler = Sampler(history_rows=6)
    runtime = OverlapRuntime(
        TinyTransformer(VOCAB, d_model=16, seed=2), fmap, overlap=overlap, sampler=sampler
    )
    sched = ContinuousBatcher(specs(), fmap, eos=-1, max_running=3)
    for cut in cuts:
        runtime.run(sched, max_steps=cut)
    return sched.outputs, sampler, fmap


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cut_run_continues_as_if_uncut(overlap: bool) -> None:
    want, _, _ = run([None], overlap)
    got, sampler, fmap = run([3, 4, None], overlap)
    assert got == want
    assert sampler.live_rows == 0 and fmap.in_use == 0  # the last run ended every request


def test_a_cut_runtime_keeps_its_sampler_until_closed() -> None:
    fmap = FutureMap(32, device="cpu")
    sampler = Sampler(history_rows=6)
    model = TinyTransformer(VOCAB, d_model=16, seed=2)
    runtime = OverlapRuntime(model, fmap, sampler=sampler)
    runtime.run(ContinuousBatcher(specs(), fmap, eos=-1, max_running=3), max_steps=3)
    assert sampler.live_rows > 0  # penalised requests still live
    with pytest.raises(RuntimeError, match="in use by another running runtime"):
        OverlapRuntime(model, fmap, sampler=sampler).run(ContinuousBatcher(specs(), fmap, eos=-1))
    runtime.close()
    assert sampler.live_rows == 0
    fresh = ContinuousBatcher(specs(), fmap, eos=-1, max_running=3)
    OverlapRuntime(model, fmap, sampler=sampler).run(fresh)
    assert fmap.in_use == 0


class Closing:
    """:class:`TinyTransformer` (through the Sampler) with a counted ``close()``: the model's
    per-request state is dropped only when the runtime closes it."""

    def __init__(self) -> None:
        self.inner = TinyTransformer(VOCAB, d_model=16, seed=2)
        self.closed = 0

    def forward(self, batch):
        return self.inner.forward(batch)

    def close(self) -> None:
        self.closed += 1


class Pausing:
    """A scheduler that stops handing out steps after ``pause_after`` of them and says ``cut``
    (a server pausing with requests live), then goes on in the next run."""

    def __init__(self, inner: ContinuousBatcher, pause_after: int) -> None:
        self.inner, self.left, self.cut = inner, pause_after, False

    def schedule(self):
        if self.left is not None and self.left <= 0:
            self.cut = True
            return None
        if self.left is not None:
            self.left -= 1
        return self.inner.schedule()

    def process(self, result) -> None:
        self.inner.process(result)

    def build_mask(self, batch):
        return self.inner.build_mask(batch)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_scheduler_that_says_cut_keeps_its_requests_for_the_next_run(overlap: bool) -> None:
    # Issue 30 item 16: with `cut` set the runtime keeps the requests' state (no model close(),
    # the sampler's history rows still held) and the next run continues them as if uncut.
    want, _, _ = run([None], overlap)
    fmap = FutureMap(32, device="cpu")
    sampler, model = Sampler(history_rows=6), Closing()
    runtime = OverlapRuntime(model, fmap, overlap=overlap, sampler=sampler)
    inner = ContinuousBatcher(specs(), fmap, eos=-1, max_running=3)
    sched = Pausing(inner, pause_after=3)
    runtime.run(sched)
    assert not inner.idle and model.closed == 0  # requests live: nothing given up
    assert sampler.live_rows > 0  # their penalty history kept
    sched.left, sched.cut = None, False
    runtime.run(sched)
    assert inner.outputs == want
    assert model.closed == 1 and sampler.live_rows == 0 and fmap.in_use == 0
