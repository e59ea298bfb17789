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
