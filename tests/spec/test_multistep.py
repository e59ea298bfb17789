"""Multi-step decode (``ContinuousBatcher(multi_step=K)`` + ``MultiStepTokenStep``) on a tiny
Hugging Face Llama: K in {1, 2, 4, 8} give the same tokens as plain decoding (greedy, seeded
sampling, penalties; sync and overlap), with stop tokens and length limits landing at every
offset inside a window; the tokens past a finish are dropped and counted; grammar requests run
their windows with K = 1; nothing is held after a run; bad configurations are refused."""

from __future__ import annotations

from dataclasses import replace
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
from tfuture.spec import DraftBatch, MultiStepTokenStep
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyGrammar

VOCAB, ROWS, MAX_LEN = 96, 6, 64
NO_STOP = 10**9
LAUNCHES: dict[int, int] = {}  # runtime steps (launches) of each run, by id of its batcher
KINDS = [
    None,
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=1.1, top_p=0.9, top_k=20, seed=5, frequency_penalty=0.5),
    SamplingParams(repetition_penalty=1.3),  # greedy with a penalty
    SamplingParams(temperature=0.7, min_p=0.05, seed=9, presence_penalty=0.4),
    None,
]


@pytest.fixture(scope="module")
def model() -> Any:
    return build_llama(vocab=VOCAB, hidden=48, layers=2, seed=0)


def workload(max_new: int = 12) -> list[RequestSpec]:
    rng = np.random.default_rng(0)
    return [
        RequestSpec(i, i % 3, rng.integers(3, VOCAB, size=4 + i), max_new, params=KINDS[i])
        for i in range(ROWS)
    ]


def run(
    model: Any, specs: list[RequestSpec], k: int, *, overlap: bool = True, **kw: Any
) -> ContinuousBatcher:
    """``specs`` through the multi-step step (``k`` = 1: the plain token step with the Sampler);
    the batcher, with the run's model launches as ``launches``."""
    fmap = FutureMap(256, device="cpu")
    hf = HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN)
    sampler = Sampler(history_rows=ROWS)
    sched = ContinuousBatcher(
        specs, fmap, eos=NO_STOP, max_running=ROWS, history_rows=ROWS, multi_step=k, **kw
    )
    if k == 1:
        stats = OverlapRuntime(hf, fmap, overlap=overlap, trace=False, sampler=sampler).run(sched)
    else:
        stats = OverlapRuntime(MultiStepTokenStep(hf, sampler), fmap, overlap=overlap, trace=False).run(sched)
    LAUNCHES[id(sched)] = stats.steps
    assert fmap.in_use == 0 and sampler.live_rows == 0, "nothing is held after the run"
    return sched


@pytest.fixture(scope="module")
def plain(model: Any) -> dict[int, list[int]]:
    return run(model, workload(), 1).outputs


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_every_k_gives_plain_decodings_tokens(
    model: Any, plain: dict[int, list[int]], k: int, overlap: bool
) -> None:
    sched = run(model, workload(), k, overlap=overlap)
    assert sched.outputs == plain
    # Fewer launches: each window gave up to k tokens per request (prefill chunks launch alone).
    one = LAUNCHES[id(run(model, workload(), 1, overlap=overlap))]
    assert LAUNCHES[id(sched)] < one and (k < 4 or 2 * LAUNCHES[id(sched)] <= one)


def test_a_multi_step_window_of_one_is_the_token_step(model: Any, plain: dict[int, list[int]]) -> None:
    fmap = FutureMap(256, device="cpu")
    step = MultiStepTokenStep(
        HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN), Sampler(history_rows=ROWS)
    )
    sched = ContinuousBatcher(workload(), fmap, eos=NO_STOP, max_running=ROWS, history_rows=ROWS)
    OverlapRuntime(step, fmap, trace=False).run(sched)
    assert sched.outputs == plain


@pytest.mark.parametrize("k", [2, 4, 8])
def test_stops_and_length_limits_land_at_every_offset_of_a_window(
    model: Any, plain: dict[int, list[int]], k: int
) -> None:
    """Request i stops at a token of its plain output at offset i (its stop token ids), or at a
    length limit of 1 + i: every offset 0..5 inside a window, for both kinds of finish."""
    specs = workload()
    by_stop = [replace(s, stop={plain[s.rid][s.rid]}) for s in specs]
    by_length = [replace(s, max_new=1 + s.rid) for s in specs]
    for variant in (by_stop, by_length):
        want = run(model, variant, 1).outputs
        for overlap in (True, False):
            sched = run(model, variant, k, overlap=overlap)
            assert sched.outputs == want
            assert all(len(sched.outputs[s.rid]) <= s.max_new for s in variant)
    # Tokens past a finish were computed and dropped, and counted. A length limit is known ahead:
    # no window starts past it, overlapped or not, so at most k - 1 tokens of one are wasted.
    for overlap in (True, False):
        sched = run(model, by_length, k, overlap=overlap)
        assert sched.extra_tokens <= (k - 1) * len(by_length)
    sched = run(model, by_stop, k, overlap=False)
    assert 0 < sched.extra_tokens <= (k - 1) * len(by_stop)


def test_grammar_requests_run_windows_of_one(model: Any) -> None:
    grammar = ToyGrammar(VOCAB, seed=2)
    specs = [replace(s, grammar=s.rid in (1, 4), arrival=0) for s in workload(max_new=8)]
    want = run(model, specs, 1, grammar=grammar, delay="rows").outputs
    for overlap in (True, False):
        sched = run(model, specs, 4, overlap=overlap, grammar=grammar, delay="rows")
        assert sched.outputs == want
        assert grammar.accepts(sched.outputs[1]) and grammar.accepts(sched.outputs[4])


def test_windows_shrink_to_the_tokens_left(model: Any) -> None:
    """Every request wants 3 tokens: a window of 8 runs 3 steps, and nothing is wasted."""
    specs = [replace(s, max_new=3, arrival=0) for s in workload()]
    sched = run(model, specs, 8, overlap=False)
    assert sched.outputs == run(model, specs, 1).outputs
    assert sched.extra_tokens == 0


def test_bad_configurations_are_refused() -> None:
    fmap = FutureMap(64, device="cpu")
    with pytest.raises(ValueError, match="multi_step must be an int >= 1"):
        ContinuousBatcher(workload(), fmap, multi_step=0)
    one = np.ones(1, dtype=np.int64)
    with pytest.raises(ValueError, match="n_steps must be an int >= 1"):
        DraftBatch(one, one, one * 0, one * 0, np.ones(1, dtype=bool), n_steps=0)
    with pytest.raises(ValueError, match="several decode steps at once"):
        DraftBatch(one, one, one * 0, one * 0, np.ones(1, dtype=bool), n_draft=one, n_steps=2)
    with pytest.raises(ValueError, match="several decode steps at once"):
        DraftBatch(one, one, one * 0, one * 0, np.ones(1, dtype=bool), delayed=True, n_steps=2)


def test_a_model_that_returns_the_wrong_rows_in_a_later_step_is_refused_by_name(model: Any) -> None:
    class Truncating(HFCausalLM):
        def forward(self, batch: Any) -> torch.Tensor:
            logits = super().forward(batch)
            return logits[:1] if batch.host.max_seg_len == 1 and batch.sample_rows.numel() > 1 else logits

    fmap = FutureMap(256, device="cpu")
    step = MultiStepTokenStep(
        Truncating(model, max_requests=ROWS, max_len=MAX_LEN), Sampler(history_rows=ROWS)
    )
    sched = ContinuousBatcher(
        workload(), fmap, eos=NO_STOP, max_running=ROWS, history_rows=ROWS, multi_step=4
    )
    with pytest.raises(ValueError, match=r"decode \d of 4\) must return \[\d, vocab\] logits"):
        OverlapRuntime(step, fmap, trace=False).run(sched)
    assert fmap.in_use == 0


# --- the front door ------------------------------------------------------------------------


def test_generate_with_multi_step_equals_plain_decoding(model: Any) -> None:
    import tfuture
    from tfuture.scheduler import GenerationParams

    prompts = [[5, 7, 9, 11], [3, 4, 5], [9, 9], [20, 21, 22, 23, 24]]
    free = tfuture.generate(
        model, prompts[:1], GenerationParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    params = [
        GenerationParams(max_tokens=10, temperature=0, ignore_eos=True),
        GenerationParams(max_tokens=7, temperature=0.9, seed=4, ignore_eos=True),
        GenerationParams(max_tokens=9, temperature=0, stop_token_ids=[free[0].token_ids[2]]),  # mid-window
        GenerationParams(max_tokens=5, temperature=0.8, seed=2, frequency_penalty=0.5, ignore_eos=True),
    ]
    prompts[2] = prompts[0]  # the stop token is its third token
    want = tfuture.generate(model, prompts, params)
    for overlap in (True, False):
        got = tfuture.generate(model, prompts, params, multi_step=4, overlap=overlap)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
        assert got[2].finish_reason == "stop" and len(got[2].token_ids) == 3
        assert got.stats.steps < want.stats.steps  # launches: windows of up to 4 decode steps


def test_an_engine_with_multi_step_streams_and_aborts(model: Any) -> None:
    import tfuture
    from tfuture.scheduler import GenerationParams

    with tfuture.Engine(model, max_len=64, multi_step=4) as eng:
        stream = eng.stream(
            [[1, 2, 3], [4, 5]], GenerationParams(max_tokens=40, temperature=0, ignore_eos=True)
        )
        first = next(stream)
        assert 1 <= len(first.tokens) <= 4  # a window's tokens arrive together
        stream.close()  # aborts both requests mid-run
        eng.close(timeout=30)
        assert not eng.busy and eng.fmap.in_use == 0


def test_the_front_door_refuses_bad_window_lengths(model: Any) -> None:
    import tfuture

    with pytest.raises(ValueError, match="multi_step"):
        tfuture.Engine(model, max_len=64, multi_step=0)


def test_a_step_kind_without_windows_refuses_a_window_by_name(model: Any) -> None:
    """ContinuousBatcher(multi_step=K) driven by the plain token step: refused before the first
    step; a scheduler that does not say it makes windows is refused at its first window. Never
    one step run with the host counting K tokens."""
    fmap = FutureMap(256, device="cpu")
    hf = HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN)
    sched = ContinuousBatcher(workload(), fmap, eos=NO_STOP, max_running=ROWS, multi_step=4)
    runtime = OverlapRuntime(hf, fmap, trace=False, sampler=Sampler())
    with pytest.raises(ValueError, match=r"multi_step=4\) and this runtime's TokenStep runs one decode step"):
        runtime.run(sched)
    assert sched.tick == 0 and fmap.in_use == 0

    class Quiet(ContinuousBatcher):
        # Says multi_step=1 until its first schedule, then makes windows.
        multi_step = property(lambda self: 4 if self.tick else 1, lambda self, v: None)  # type: ignore[assignment]

    quiet = Quiet(workload(), fmap, eos=NO_STOP, max_running=ROWS, multi_step=4)
    with pytest.raises(ValueError, match=r"TokenStep runs one decode step per launch.*n_steps=4"):
        runtime.run(quiet)
    assert fmap.in_use == 0


def test_one_step_windows_under_a_tight_token_budget_equal_plain(model: Any) -> None:
    """A grammar request makes its windows one step, and a token budget of 2 makes decodes wait
    behind prefill chunks: after a processed window a request takes its last token from the
    host, whatever the window's length (its slots go back once a later step launched)."""
    grammar = ToyGrammar(VOCAB, seed=2)
    specs = [replace(s, grammar=s.rid == 1, arrival=0, max_new=6) for s in workload()]
    kw: dict[str, Any] = dict(grammar=grammar, delay="rows", token_budget=2, chunk=2)
    want = run(model, specs, 1, **kw).outputs
    for overlap in (True, False):
        assert run(model, specs, 4, overlap=overlap, **kw).outputs == want


def test_an_engine_refuses_max_len_whose_window_runs_past_the_context() -> None:
    import tfuture

    small = build_llama(vocab=VOCAB, hidden=32, layers=1, seed=1, max_len=32)
    with pytest.raises(ValueError, match=r"plus the 3 that .* exceed the model's context of 32"):
        tfuture.Engine(small, max_len=32, multi_step=4)
    tfuture.Engine(small, max_len=29, multi_step=4).close()


def test_a_row_without_a_valid_token_in_a_window_names_its_request(model: Any) -> None:
    """All-NaN logits for request 2: its tokens are -1 (fed on as 0), and the window's result
    names request 2, not a neighbour; nothing is held after the failed run."""

    class NaNFor2(HFCausalLM):
        def forward(self, batch: Any) -> torch.Tensor:
            logits = super().forward(batch)
            rows = batch.req_ids.index_select(0, batch.sample_reqs) == 2
            return logits.masked_fill(rows.unsqueeze(1), float("nan"))

    fmap = FutureMap(256, device="cpu")
    step = MultiStepTokenStep(NaNFor2(model, max_requests=ROWS, max_len=MAX_LEN), Sampler(history_rows=ROWS))
    specs = [replace(s, arrival=0) for s in workload()]
    sched = ContinuousBatcher(specs, fmap, eos=NO_STOP, max_running=ROWS, history_rows=ROWS, multi_step=4)
    with pytest.raises(ValueError, match="request 2 has no valid token to sample"):
        OverlapRuntime(step, fmap, trace=False).run(sched)
    assert fmap.in_use == 0
