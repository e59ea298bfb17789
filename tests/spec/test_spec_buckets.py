"""Speculative steps padded to ``Buckets``: ``SpecTokenStep(..., buckets=)``.

A padded step feeds the model bucket-sized token rows and request counts (empty requests at the
end); verification, drafting and the slots see the real requests only. Greedy output equals
plain decoding, with the toy target under stream delays and with a Hugging Face model and the
real drafters; seeded sampling with penalties gives the same tokens padded and unpadded."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from tfuture import FutureMap
from tfuture.core.batch import ForwardBatch
from tfuture.core.params import SamplingParams
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec import SpecTokenStep
from tfuture.steps.token import Buckets
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyGrammar, ToyModel, random_workload
from tfuture.testing.faults import random_delay
from tfuture.testing.toy_drafter import ToyDrafter

VOCAB = 64
BUCKETS = Buckets(rows=(8, 16, 32, 64), reqs=(2, 4, 8))


class Shapes(ToyModel):
    """The toy target, recording each forward's (token rows, requests)."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB)
        self.shapes: list[tuple[int, int]] = []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        assert batch.seg_starts is not None
        self.shapes.append((batch.input_ids.numel(), batch.seg_starts.numel() - 1))
        return super().forward(batch)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("seed", [0, 1])
def test_padded_speculative_steps_equal_plain_greedy(seed: int, overlap: bool) -> None:
    specs = random_workload(seed, 8, vocab=VOCAB, max_prompt=10, max_new=20, arrival_span=6)
    fmap = FutureMap(128, device="cpu")
    drafter = ToyDrafter(ToyModel(vocab=VOCAB), k=3, error_rate=0.3, seed=seed)
    drafter.bind(4, 128, fmap.device)
    sched = ContinuousBatcher(specs, fmap, eos=-1, max_running=4, speculative=3)
    target = Shapes()
    step = SpecTokenStep(target, drafter, Sampler(), buckets=BUCKETS)
    OverlapRuntime(step, fmap, overlap=overlap, delay=random_delay(seed)).run(sched)
    assert sched.outputs == ToyModel(vocab=VOCAB).references(specs, -1)
    assert fmap.in_use == 0 and 0 < sched.accepted_tokens < sched.drafted_tokens
    # Every forward ran at bucket sizes, and some were padded (rows or requests).
    assert {rows for rows, _ in target.shapes} <= set(BUCKETS.rows)
    assert {reqs for _, reqs in target.shapes} <= set(BUCKETS.reqs)
    assert any(reqs > 1 for _, reqs in target.shapes)


@pytest.mark.parametrize("delay", ["batch", "rows"])
def test_padded_speculative_steps_with_grammar_rows_equal_plain_grammar_decoding(delay: str) -> None:
    # Grammar requests take a mask row per verification row (packed bitmask), beside requests
    # that verify without one; plain decoding of the same grammar is the reference.
    specs = random_workload(4, 8, vocab=VOCAB, max_prompt=10, max_new=16, arrival_span=6, grammar_share=0.5)
    grammar = ToyGrammar(VOCAB, seed=2, density=0.3)

    def outputs(drafts: bool) -> dict[int, list[int]]:
        fmap = FutureMap(128, device="cpu")
        sched = ContinuousBatcher(
            specs, fmap, eos=-1, max_running=4, grammar=grammar, delay=delay, speculative=3 if drafts else 0
        )
        if drafts:
            drafter = ToyDrafter(ToyModel(vocab=VOCAB), k=3, error_rate=0.3, seed=4)
            drafter.bind(4, 128, fmap.device)
            OverlapRuntime(
                SpecTokenStep(ToyModel(vocab=VOCAB), drafter, Sampler(), buckets=BUCKETS), fmap
            ).run(sched)
            assert sched.accepted_tokens > 0
        else:
            OverlapRuntime(ToyModel(vocab=VOCAB), fmap, sampler=Sampler()).run(sched)
        assert fmap.in_use == 0
        return sched.outputs

    assert outputs(True) == outputs(False)


def test_buckets_must_be_buckets() -> None:
    drafter = ToyDrafter(ToyModel(vocab=VOCAB), k=2)
    with pytest.raises(TypeError, match="buckets must be a Buckets or None, got tuple"):
        SpecTokenStep(ToyModel(vocab=VOCAB), drafter, buckets=(8, 16))  # type: ignore[arg-type]


# -- a Hugging Face model with the real drafters ------------------------------------------------

HF_ROWS, MAX_LEN = 4, 160


@pytest.fixture(scope="module")
def hf_model() -> Any:
    pytest.importorskip("transformers")
    from tfuture.examples.hf import build_llama

    return build_llama(vocab=96, hidden=48, layers=2, seed=0)


def hf_workload(params: SamplingParams | None = None) -> list[RequestSpec]:
    rng = np.random.default_rng(0)
    specs = []
    for i in range(4):
        base = rng.integers(3, 96, size=5 + i)
        specs.append(RequestSpec(i, 2 * i, np.concatenate([base, base, base[:3]]), 14, params=params))
    return specs


def hf_run(model: Any, specs: list[RequestSpec], drafter: Any, buckets: Buckets | None, overlap: bool) -> Any:
    from tfuture.models import HFCausalLM

    fmap = FutureMap(256, device="cpu")
    hf = HFCausalLM(model, max_requests=HF_ROWS, max_len=MAX_LEN)
    sampler = Sampler(history_rows=HF_ROWS)
    kind: Any = hf
    k = 0
    if drafter is not None:
        drafter.bind(HF_ROWS, MAX_LEN, torch.device("cpu"))
        kind, k = SpecTokenStep(hf, drafter, sampler, buckets=buckets), drafter.k
    sched = ContinuousBatcher(specs, fmap, eos=10**9, max_running=HF_ROWS, chunk=8, speculative=k)
    kw = {} if drafter is not None else {"sampler": sampler, "buckets": buckets}
    OverlapRuntime(kind, fmap, overlap=overlap, **kw).run(sched)
    assert fmap.in_use == 0
    return sched


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_padded_hf_speculative_steps_equal_plain_decoding(hf_model: Any, overlap: bool) -> None:
    from tfuture.spec import ModelDrafter, NGramDrafter

    specs = hf_workload()
    plain = hf_run(hf_model, specs, None, None, overlap).outputs
    for drafter in (NGramDrafter(k=4), ModelDrafter(copy.deepcopy(hf_model), k=3)):
        sched = hf_run(hf_model, specs, drafter, Buckets(rows=(16, 32, 64), reqs=(2, 4)), overlap)
        assert sched.outputs == plain, drafter
        assert sched.accepted_tokens > 0


def test_padded_seeded_speculative_sampling_with_penalties_is_unpadded_sampling(hf_model: Any) -> None:
    from tfuture.spec import NGramDrafter

    params = SamplingParams(
        temperature=0.9, top_p=0.95, seed=5, frequency_penalty=0.4, repetition_penalty=1.1
    )
    specs = hf_workload(params)
    runs = [
        hf_run(hf_model, specs, NGramDrafter(k=3), buckets, overlap=True).outputs
        for buckets in (None, Buckets(rows=(16, 32, 64), reqs=(2, 4)))
    ]
    assert runs[0] == runs[1]
