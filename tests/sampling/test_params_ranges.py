"""Parameters that would lose their meaning in the sampler's float32 math are refused when a
SamplingParams is built, with the range in the message (they used to sample wrong tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfuture.sampling import Sampler, SamplingParams


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"top_p": 7e-46}, r"top_p must be a float in \[1e-30, 1\]"),
        ({"frequency_penalty": 3.5e38}, r"frequency_penalty must be a float in \[-1e\+06, 1e\+06\]"),
        ({"presence_penalty": 1e39}, r"presence_penalty must be a float in \[-1e\+06, 1e\+06\]"),
        ({"presence_penalty": -1e39}, r"presence_penalty must be"),
        ({"repetition_penalty": 1e39}, r"repetition_penalty must be a float in \[1e-06, 1e\+06\]"),
        ({"repetition_penalty": 1e-40}, r"repetition_penalty must be"),
        ({"temperature": 1e39}, r"temperature must be a float in \[0, 1e\+06\]"),
        ({"temperature": float("inf")}, r"temperature must be"),
        ({"top_p": float("nan")}, r"top_p must be"),
    ],
)
def test_values_past_float32_are_refused_with_the_range(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_the_extremes_that_are_accepted_sample_sensibly() -> None:
    """At the edges of the ranges, float32 logits still give tokens the filters allow."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    extremes = {
        0: SamplingParams(temperature=1.0, top_p=1e-30, seed=1),  # keeps the top token only
        1: SamplingParams(temperature=1e6, top_k=2, seed=2),  # near-uniform over the top 2
        2: SamplingParams(temperature=1.0, seed=3, presence_penalty=1e6, repetition_penalty=1e6),
    }
    sampler = Sampler(history_rows=3)
    sampler.claim(extremes)
    try:
        for step in range(4):
            ids = np.arange(3, dtype=np.int64)
            plan = sampler.plan_step(
                extremes if step == 0 else None,
                ids,
                np.ones(3, np.int64),
                np.full(3, step, np.int64),
                ids,
                np.empty(0, np.int64),
                step,
            )
            state = sampler.prepare(plan, torch.from_numpy(plan.words.copy()))
            tokens = sampler.sample(state, logits)
            sampler.record(state, tokens)
            got = tokens.tolist()
            assert got[0] == 0, got
            assert got[1] in (0, 1), got
            assert 0 <= got[2] < 4, got
    finally:
        sampler.unclaim(extremes)


def test_a_prompt_id_past_the_vocab_of_a_penalised_request_is_named() -> None:
    """It used to end in a bare IndexError from the penalty history."""
    sampler = Sampler(history_rows=1, vocab_size=8)
    owner = object()
    sampler.claim(owner)
    try:
        one = np.zeros(1, np.int64)
        plan = sampler.plan_step(
            {0: SamplingParams(repetition_penalty=1.2)},
            one,
            np.array([2]),
            one,
            one,
            np.empty(0, np.int64),
            0,
        )
        state = sampler.prepare(plan, torch.from_numpy(plan.words.copy()))
        with pytest.raises(ValueError, match=r"step 0: an input token id 9 .* past the vocab of 8"):
            sampler.observe(state, torch.tensor([3, 9]))
    finally:
        sampler.unclaim(owner)
