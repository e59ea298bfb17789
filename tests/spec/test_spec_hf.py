"""Speculative decoding through the token step on a Hugging Face Llama: greedy output equal to
plain decoding and to HF ``generate`` for every drafter (prompt lookup, a draft model, a drafter
that is always wrong), sync and overlap, chunked prefill, arrivals mid-run, delays on every
stream op; stops and length limits inside an accepted run; seeded sampling that reproduces."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tfuture import FutureMap
from tfuture.core.params import SamplingParams
from tfuture.examples.hf import build_llama
from tfuture.models import HFCausalLM
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec import DraftContext, ModelDrafter, NGramDrafter, SpecTokenStep
from tfuture.testing import ContinuousBatcher, RequestSpec
from tfuture.testing.faults import FaultPlan

VOCAB, ROWS, MAX_LEN = 96, 4, 160
NO_STOP = 10**9


@pytest.fixture(scope="module")
def model() -> Any:
    return build_llama(vocab=VOCAB, hidden=48, layers=2, seed=0)


class WrongDrafter(NGramDrafter):
    """Proposes a token the target never takes next (its last token + 1, mod vocab) most of the
    time: nearly every draft is rejected, so the KV rows roll back nearly every step."""

    def draft(self, ctx: DraftContext) -> torch.Tensor:
        good = super().draft(ctx)
        return (good + 1 + torch.arange(self.k)) % VOCAB


def workload(n: int = 4, max_new: int = 16, repeat: bool = True, seed: int = 0) -> list[RequestSpec]:
    """Prompts that quote themselves (prompt lookup finds matches) arriving over several ticks."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(n):
        base = rng.integers(3, VOCAB, size=5 + i)
        prompt = np.concatenate([base, base, base[:3]]) if repeat else base
        specs.append(RequestSpec(i, 2 * i, prompt, max_new))
    return specs


def run(
    model: Any,
    specs: list[RequestSpec],
    drafter: Any = None,
    *,
    overlap: bool = True,
    chunk: int = 8,
    eos: int = NO_STOP,
    faults: FaultPlan | None = None,
    debug: bool = False,
) -> tuple[ContinuousBatcher, Any]:
    fmap = FutureMap(256, debug=debug, device="cpu")
    hf = HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN)
    kind: Any = hf
    k = 0
    if drafter is not None:
        drafter.bind(ROWS, MAX_LEN, torch.device("cpu"))
        kind, k = SpecTokenStep(hf, drafter, Sampler(history_rows=ROWS)), drafter.k
    sched = ContinuousBatcher(specs, fmap, eos=eos, max_running=ROWS, chunk=chunk, speculative=k)
    kw = {} if drafter is not None else {"sampler": Sampler(history_rows=ROWS)}
    stats = OverlapRuntime(kind, fmap, overlap=overlap, trace=False, faults=faults, **kw).run(sched)
    assert fmap.in_use == 0, "every slot is released after the run"
    return sched, stats


def hf_greedy(model: Any, specs: list[RequestSpec]) -> dict[int, list[int]]:
    out = {}
    with torch.inference_mode():
        for s in specs:
            ids = model.generate(
                torch.as_tensor(s.prompt)[None],
                max_new_tokens=s.max_new,
                min_new_tokens=s.max_new,
                do_sample=False,
                pad_token_id=0,
            )
            out[s.rid] = ids[0, s.prompt.size :].tolist()
    return out


DRAFTERS = {
    "ngram4": lambda m: NGramDrafter(k=4),
    "ngram2": lambda m: NGramDrafter(k=2, max_ngram=2),
    "wrong": lambda m: WrongDrafter(k=3),
    "twin": lambda m: ModelDrafter(copy.deepcopy(m), k=4),
    "small": lambda m: ModelDrafter(build_llama(vocab=VOCAB, hidden=32, layers=1, seed=3), k=2),
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_equals_plain_and_generate(model: Any, name: str, overlap: bool) -> None:
    specs = workload()
    plain, plain_stats = run(model, specs, chunk=4)
    assert plain.outputs == hf_greedy(model, specs)
    spec, stats = run(model, specs, DRAFTERS[name](model), overlap=overlap, chunk=4)
    assert spec.outputs == plain.outputs
    assert all(spec.finish_reasons[s.rid] == "length" for s in specs)
    if name == "twin":  # an exact copy of the target: every draft accepted
        assert stats.steps < 0.7 * plain_stats.steps


def test_ngram_drafts_cut_model_steps_on_a_repetitive_workload(model: Any) -> None:
    # A prompt that is its own continuation under this model: the greedy output, fed back, repeats.
    specs = workload(n=2, max_new=24)
    plain, _ = run(model, specs)
    looped = [RequestSpec(s.rid, 0, np.concatenate([s.prompt, plain.outputs[s.rid]] * 2), 24) for s in specs]
    base, base_stats = run(model, looped)
    spec, stats = run(model, looped, NGramDrafter(k=4))
    assert spec.outputs == base.outputs
    assert stats.steps < base_stats.steps


def test_delays_on_every_stream_op_in_debug_mode(model: Any) -> None:
    specs = workload(n=3, max_new=10)
    plain, _ = run(model, specs)
    faults = FaultPlan(seed=1, max_delay_s=0.003)
    spec, _ = run(model, specs, NGramDrafter(k=3), faults=faults, debug=True)
    assert spec.outputs == plain.outputs
    assert sum(faults.injected.values()) > 0


def test_a_stop_token_inside_an_accepted_run_truncates_there(model: Any) -> None:
    specs = workload(n=2, max_new=20)
    plain, _ = run(model, specs)
    stop = plain.outputs[0][6]  # a token request 0 generates at its 7th position
    want, _ = run(model, specs, eos=stop)
    twin = ModelDrafter(copy.deepcopy(model), k=4)  # accepts every draft: runs of 5 tokens
    got, _ = run(model, specs, twin, eos=stop)
    assert got.outputs == want.outputs
    assert got.outputs[0][-1] == stop and len(got.outputs[0]) <= 7
    assert got.finish_reasons == want.finish_reasons
    assert got.extra_tokens > 0  # tokens committed past the stop: dropped, counted


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_tokens_inside_an_accepted_run(model: Any, max_new: int) -> None:
    specs = workload(n=2, max_new=max_new)
    plain, _ = run(model, specs)
    got, _ = run(model, specs, ModelDrafter(copy.deepcopy(model), k=4))
    assert got.outputs == plain.outputs
    assert all(len(v) == max_new for v in got.outputs.values())


def test_seeded_sampling_reproduces_alone_batched_and_in_sync(model: Any) -> None:
    def specs(ids: list[int]) -> list[RequestSpec]:
        rng = np.random.default_rng(5)
        base = [rng.integers(3, VOCAB, size=6) for _ in range(4)]
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
        return [RequestSpec(i, 0, np.concatenate([base[i]] * 3), 12, params=params) for i in ids]

    batched, _ = run(model, specs([0, 1, 2, 3]), NGramDrafter(k=3))
    sync, _ = run(model, specs([0, 1, 2, 3]), NGramDrafter(k=3), overlap=False)
    alone, _ = run(model, specs([2]), NGramDrafter(k=3))
    assert batched.outputs == sync.outputs
    assert alone.outputs[2] == batched.outputs[2]


def test_without_drafts_the_step_samples_the_samplers_tokens(model: Any) -> None:
    # k = 0 through the speculative step: the Sampler's own draw, bit for bit.
    params = SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=3)
    specs = [RequestSpec(i, 0, np.arange(3 + i, 9 + i), 10, params=params) for i in range(3)]
    plain, _ = run(model, specs)
    fmap = FutureMap(128, device="cpu")
    step = SpecTokenStep(HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN), NGramDrafter(k=2), Sampler())
    step.drafter.bind(ROWS, MAX_LEN, torch.device("cpu"))
    sched = ContinuousBatcher(specs, fmap, eos=NO_STOP, max_running=ROWS)  # plain Batches
    OverlapRuntime(step, fmap, trace=False).run(sched)
    assert sched.outputs == plain.outputs


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_with_penalties_equals_plain_decoding(model: Any, overlap: bool) -> None:
    pens = [
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.2),
    ]
    specs = [
        RequestSpec(s.rid, s.arrival, s.prompt, 14, params=p) for s, p in zip(workload(), pens, strict=True)
    ]
    plain, _ = run(model, specs)
    for drafter in (NGramDrafter(k=3), ModelDrafter(copy.deepcopy(model), k=3)):
        got, _ = run(model, specs, drafter, overlap=overlap)
        assert got.outputs == plain.outputs
        assert got.drafted_tokens > 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_grammar_requests_take_masks_beside_drafting_requests(model: Any, overlap: bool) -> None:
    from tfuture.testing import ToyGrammar

    grammar = ToyGrammar(VOCAB, seed=2)
    specs = [
        RequestSpec(s.rid, s.arrival, s.prompt, s.max_new, grammar=s.rid % 2 == 1)
        for s in workload(n=4, max_new=12)
    ]

    def go(k: int) -> ContinuousBatcher:
        fmap = FutureMap(256, device="cpu")
        hf = HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN)
        kind: Any = hf
        if k:
            drafter = NGramDrafter(k=k)
            drafter.bind(ROWS, MAX_LEN, torch.device("cpu"))
            kind = SpecTokenStep(hf, drafter, Sampler())
        sched = ContinuousBatcher(specs, fmap, eos=NO_STOP, max_running=ROWS, grammar=grammar, speculative=k)
        kw = {} if k else {"sampler": Sampler()}
        OverlapRuntime(kind, fmap, overlap=overlap, trace=False, **kw).run(sched)
        assert fmap.in_use == 0
        return sched

    plain, spec = go(0), go(3)
    assert spec.outputs == plain.outputs
    for s in specs:
        if s.grammar:
            assert grammar.accepts(spec.outputs[s.rid])
    assert spec.drafted_tokens > 0  # the free requests drafted beside the grammar ones


def test_a_request_may_opt_out_of_drafting(model: Any) -> None:
    import tfuture
    from tfuture.scheduler import GenerationParams

    prompts = [s.prompt.tolist() for s in workload(n=3, max_new=10)]
    params = [
        GenerationParams(max_tokens=10, temperature=0, ignore_eos=True, speculative=i != 1) for i in range(3)
    ]
    plain = tfuture.generate(model, prompts, params)
    spec = tfuture.generate(model, prompts, params, speculative=NGramDrafter(k=3))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[1].timings.drafted == 0 and spec[0].timings.drafted > 0
    assert spec.drafted == sum(o.timings.drafted for o in spec) and plain.drafted == 0
    with pytest.raises(TypeError, match="speculative must be a bool"):
        GenerationParams(speculative="yes")  # type: ignore[arg-type]


def test_generate_gives_the_draft_model_its_state_back(model: Any) -> None:
    import tfuture
    from tfuture.scheduler import GenerationParams

    draft = build_llama(vocab=VOCAB, hidden=32, layers=1, seed=4)
    draft.train()
    attn = draft.config._attn_implementation
    out = tfuture.generate(
        model,
        [[1, 2, 3, 1, 2]],
        GenerationParams(max_tokens=6, temperature=0),
        speculative=ModelDrafter(draft, k=2),
    )
    assert len(out[0].token_ids) == 6 and out.drafted > 0
    assert draft.training and draft.config._attn_implementation == attn
