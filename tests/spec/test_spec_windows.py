"""Speculative decoding and multi-step windows in one run (``ContinuousBatcher(speculative=k,
multi_step=K)`` + :class:`tfuture.spec.SpecWindowStep`): requests that draft keep their
speculative steps; a step where no request drafts runs as a window. Tokens equal plain decoding
(greedy) and a speculative-only run (seeded sampling, penalties), sync and overlap; windows never
carry a drafting request; the drafter's rows come back when requests end inside windows; and the
front door takes both options."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tfuture import FutureMap
from tfuture.core.params import SamplingParams
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec import DraftBatch, NGramDrafter, SpecTokenStep, SpecWindowStep
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyModel
from tfuture.testing.faults import random_delay
from tfuture.testing.toy_drafter import ToyDrafter

VOCAB, ROWS, K_DRAFT, K_STEPS = 64, 4, 3, 4


class Recording(ContinuousBatcher):
    """Records every batch it schedules."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.batches: list[Any] = []

    def schedule(self) -> Any:
        batch = super().schedule()
        if batch is not None:
            self.batches.append(batch)
        return batch


def workload(
    seed: int = 0, n: int = 10, params: list[SamplingParams | None] | None = None
) -> list[RequestSpec]:
    """Every third request drafts; the others opted out (``drafts=False``). Staggered arrivals
    and lengths, so that steps without a drafting request come up mid-run."""
    rng = np.random.default_rng(seed)
    return [
        RequestSpec(
            i,
            int(rng.integers(0, 8)),
            rng.integers(1, VOCAB, int(rng.integers(3, 9))),
            int(rng.integers(4, 30)),
            params=None if params is None else params[i % len(params)],
            drafts=i % 3 == 0,
        )
        for i in range(n)
    ]


def run(
    specs: list[RequestSpec],
    *,
    multi_step: int = K_STEPS,
    overlap: bool = True,
    drafter: Any = None,
    **kw: Any,
) -> Recording:
    fmap = FutureMap(256, device="cpu")
    drafter = drafter if drafter is not None else ToyDrafter(ToyModel(vocab=VOCAB), k=K_DRAFT, error_rate=0.3)
    drafter.bind(ROWS, 128, fmap.device)
    sampler = Sampler(history_rows=ROWS)
    kind = SpecWindowStep if multi_step > 1 else SpecTokenStep
    sched = Recording(
        specs, fmap, eos=-1, max_running=ROWS, history_rows=ROWS, speculative=K_DRAFT, multi_step=multi_step
    )
    OverlapRuntime(kind(ToyModel(vocab=VOCAB), drafter, sampler), fmap, overlap=overlap, **kw).run(sched)
    assert fmap.in_use == 0 and sampler.live_rows == 0, "nothing is held after the run"
    return sched


def plain(specs: list[RequestSpec]) -> dict[int, list[int]]:
    return ToyModel(vocab=VOCAB).references(specs, -1)


def windows(sched: Recording) -> list[DraftBatch]:
    return [b for b in sched.batches if getattr(b, "n_steps", 1) > 1]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_drafts_and_windows_equal_plain_decoding(seed: int, overlap: bool) -> None:
    specs = workload(seed)
    sched = run(specs, overlap=overlap, delay=random_delay(seed))
    assert sched.outputs == plain(specs)
    wins = windows(sched)
    assert wins, "no step ran as a window"
    assert sched.drafted_tokens > 0 and sched.accepted_tokens > 0, "no request speculated"
    drafting = {s.rid for s in specs if s.drafts}
    for b in wins:  # a window never carries a drafting request, nor drafts to verify
        assert not drafting & set(b.req_ids.tolist())
        assert not b.n_draft.size or not b.n_draft.any()
    assert len(sched.batches) < len(run(specs, multi_step=1).batches)


def test_seeded_sampling_and_penalties_equal_a_speculative_run_without_windows() -> None:
    kinds: list[SamplingParams | None] = [
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.1, top_p=0.9, top_k=20, seed=5, frequency_penalty=0.5),
        None,
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=0.7, min_p=0.05, seed=9, presence_penalty=0.4),
    ]
    specs = workload(4, params=kinds)
    want = run(specs, multi_step=1)
    for overlap in (True, False):
        got = run(specs, overlap=overlap)
        assert got.outputs == want.outputs
        assert windows(got)
    # The requests that never draft give plain decoding's tokens (no speculation at all).
    fmap = FutureMap(256, device="cpu")
    undrafted = [replace(s, drafts=True) for s in specs if not s.drafts]
    base = ContinuousBatcher(undrafted, fmap, eos=-1, max_running=ROWS, history_rows=ROWS)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap, sampler=Sampler(history_rows=ROWS)).run(base)
    assert {r: want.outputs[r] for r in base.outputs} == base.outputs


def test_drafter_rows_come_back_when_requests_end_inside_windows() -> None:
    # The n-gram drafter has exactly ROWS rows: a drafting request that ended in a step the
    # host reports within a window must still give its row back (in stream order), or a later
    # drafting request finds every row held.
    long = [RequestSpec(100 + i, 0, np.arange(1, 5) + i, 110, drafts=False) for i in range(ROWS - 1)]
    short = [RequestSpec(i, 1 + 8 * i, np.arange(2, 6) + i, 3) for i in range(2 * ROWS)]
    specs = long + short
    drafter = NGramDrafter(k=K_DRAFT, max_ngram=2)
    sched = run(specs, drafter=drafter)
    assert sched.outputs == plain(specs)
    ended_in_windows = {int(r) for b in windows(sched) for r in b.ended}
    assert ended_in_windows & {s.rid for s in specs if s.drafts}, "no drafting request ended in a window"


def test_the_n_gram_drafter_under_stream_delays_in_both_modes() -> None:
    specs = workload(5)
    outs = [
        run(specs, overlap=o, drafter=NGramDrafter(k=K_DRAFT, max_ngram=2), delay=random_delay(5))
        for o in (True, False)
    ]
    assert outs[0].outputs == outs[1].outputs == plain(specs)
    assert windows(outs[0]) and outs[0].drafted_tokens > 0


def test_a_speculative_step_without_windows_is_refused_before_the_first_step() -> None:
    fmap = FutureMap(256, device="cpu")
    drafter = ToyDrafter(ToyModel(vocab=VOCAB), k=K_DRAFT)
    drafter.bind(ROWS, 128, fmap.device)
    sched = Recording(workload(), fmap, eos=-1, max_running=ROWS, speculative=K_DRAFT, multi_step=K_STEPS)
    runtime = OverlapRuntime(SpecTokenStep(ToyModel(vocab=VOCAB), drafter, Sampler()), fmap)
    with pytest.raises(ValueError, match=r"multi_step=4\) and this runtime's SpecTokenStep .*SpecWindowStep"):
        runtime.run(sched)
    assert not sched.batches and fmap.in_use == 0


def test_a_failure_inside_a_window_gives_everything_back() -> None:
    from tfuture.testing.faults import FaultPlan, InjectedFault

    fmap = FutureMap(256, device="cpu")
    drafter = NGramDrafter(k=K_DRAFT, max_ngram=2)
    drafter.bind(ROWS, 128, fmap.device)
    sampler = Sampler(history_rows=ROWS)
    specs = [replace(s, drafts=False) for s in workload(6)]  # every step a window
    for point in ("decode", "store"):
        sched = Recording(specs, fmap, eos=-1, max_running=ROWS, speculative=K_DRAFT, multi_step=K_STEPS)
        kind = SpecWindowStep(ToyModel(vocab=VOCAB), drafter, sampler)
        with pytest.raises(InjectedFault, match=f"at {point} of step 3"):
            OverlapRuntime(kind, fmap, faults=FaultPlan(raise_at={point: 3})).run(sched)
        assert windows(sched) and fmap.in_use == 0 and sampler.live_rows == 0
    # The Sampler and the map serve a fresh run afterwards.
    assert run(workload(6)).outputs == plain(workload(6))


def test_the_front_door_takes_speculation_and_windows_together() -> None:
    pytest.importorskip("transformers")
    import tfuture
    from tfuture.examples.hf import build_llama
    from tfuture.scheduler import GenerationParams

    model = build_llama(vocab=96, hidden=48, layers=2, seed=0)
    base = [3, 5, 7, 9, 11, 13]
    prompts = [base * 2, [4, 6, 8], base + base[:3], [20, 21, 22, 23]]
    greedy = GenerationParams(max_tokens=12, temperature=0, ignore_eos=True)
    params = [greedy, replace(greedy, speculative=False), greedy, replace(greedy, speculative=False)]
    want = tfuture.generate(model, prompts, params)
    for overlap in (True, False):
        got = tfuture.generate(
            model, prompts, params, speculative=tfuture.NGramDrafter(k=2), multi_step=4, overlap=overlap
        )
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
    with tfuture.Engine(model, max_len=64, speculative=tfuture.NGramDrafter(k=2), multi_step=4) as eng:
        assert isinstance(eng.runtime.kind, SpecWindowStep)
        out = eng.generate(prompts[1:2], params[1], progress=False)
        assert out[0].token_ids == want[1].token_ids and eng.fmap.in_use == 0


def test_a_draft_model_sees_requests_whose_prefill_ran_in_a_window() -> None:
    # Two rows: D1 and R1 speculate; D1 ends and R2 (no drafts) is admitted beside R1, so R2's
    # prefill runs in a window; R1 ends and D2 joins R2 in a speculative step, where the draft
    # model must already hold R2's KV row (it failed with "holds no KV row" before).
    pytest.importorskip("transformers")
    import copy

    import tfuture
    from tfuture.examples.hf import build_llama
    from tfuture.scheduler import GenerationParams

    model = build_llama(vocab=96, hidden=48, layers=2, seed=0)
    drafting = GenerationParams(max_tokens=4, temperature=0, ignore_eos=True)
    plain_p = GenerationParams(max_tokens=10, temperature=0, ignore_eos=True, speculative=False)
    prompts = [[3, 5, 7, 3, 5], [4, 6, 8], [9, 10, 11, 12], [3, 5, 7, 3, 5, 7]]
    params = [drafting, plain_p, plain_p, drafting]
    want = tfuture.generate(model, prompts, params, max_running=2)
    for overlap in (True, False):
        drafter = tfuture.ModelDrafter(copy.deepcopy(model), k=2)
        got = tfuture.generate(
            model, prompts, params, max_running=2, speculative=drafter, multi_step=4, overlap=overlap
        )
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.finish_reason for r in got] == ["length"] * 4
