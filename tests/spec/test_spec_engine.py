"""Speculative decoding through the front door (``Engine(model, speculative=drafter)``,
``tfuture.generate(..., speculative=)``) on a tiny Hugging Face Llama: streamed runs of accepted
tokens, aborts (from a callback and from another thread), requests added mid-run, stops and
length limits inside an accepted run, penalties and structured output served, refusals of bad
drafters and budgets, sync against overlap, seeded sampling, failure recovery, and regressions
for drafter rows and waiting decodes. Every greedy output is checked against plain decoding on an
engine without drafter."""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

import tfuture
from tfuture import GenerationParams, ModelDrafter, NGramDrafter, TokenUpdate
from tfuture.engine import Engine, GenerateResult
from tfuture.examples.hf import build_llama
from tfuture.testing import ToyGrammar

VOCAB, ROWS, MAX_LEN = 96, 4, 128
K = 3


@pytest.fixture(scope="module")
def model() -> Any:
    return build_llama(vocab=VOCAB, hidden=48, layers=2, seed=0)


def greedy(n: int, **kw: Any) -> GenerationParams:
    return GenerationParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def make_engine(model: Any, drafter: Any = None, **kw: Any) -> Engine:
    opts: dict[str, Any] = {"max_running": ROWS, "max_len": MAX_LEN, "chunk": 16, "token_budget": 64, **kw}
    return Engine(model, speculative=drafter, **opts)


def plain(model: Any, prompts: list[list[int]], params: Any) -> GenerateResult:
    """The reference: the same requests on an engine without a drafter."""
    with make_engine(model) as eng:
        return eng.generate(prompts, params)


def tokens(result: GenerateResult) -> list[list[int]]:
    return [r.token_ids for r in result]


@pytest.fixture(scope="module")
def looped(model: Any) -> list[list[int]]:
    """Prompts that end in their own greedy continuation, twice over: prompt lookup finds long
    matches, so steps commit runs of several tokens."""
    rng = np.random.default_rng(0)
    base = [rng.integers(3, VOCAB, size=n).tolist() for n in (6, 8, 5)]
    out = tokens(plain(model, base, greedy(16)))
    return [(b + o) * 2 for b, o in zip(base, out, strict=True)]


# ----------------------------------------------------------------------------- streaming
def test_stream_delivers_each_steps_accepted_run_in_order(model: Any, looped: list[list[int]]) -> None:
    want = tokens(plain(model, looped, greedy(20)))
    with make_engine(model, NGramDrafter(k=K)) as eng:
        stream = eng.stream(looped, greedy(20))
        got: dict[int, list[int]] = defaultdict(list)
        sizes: list[int] = []
        finals = {}
        for u in stream:
            assert u.rid not in finals, "an update after the request's last one"
            got[u.rid] += u.tokens
            sizes.append(len(u.tokens))
            if u.finished:
                finals[u.rid] = u.completion
            else:
                assert 1 <= len(u.tokens) <= K + 1, "a live update holds one step's committed tokens"
        assert eng.scheduler.accepted_tokens > 0
    # After close(), which waits for the background run (the stream ends at the last update,
    # possibly before that run gave its last slots back).
    assert eng.fmap.in_use == 0 and not eng.busy
    assert max(sizes) > 1, "no step committed more than one token: nothing exercised the runs"
    for rid, w in zip(stream.rids, want, strict=True):
        assert got[rid] == finals[rid].token_ids == w
        assert finals[rid].finish_reason == "length"


def test_on_tokens_updates_join_to_the_request_outputs(model: Any, looped: list[list[int]]) -> None:
    want = plain(model, looped, greedy(20))
    got: dict[int, list[int]] = defaultdict(list)

    def on_tokens(engine: Engine, u: TokenUpdate) -> None:
        got[u.rid] += u.tokens

    with make_engine(model, NGramDrafter(k=K)) as eng:
        res = eng.generate(looped, greedy(20), on_tokens=on_tokens)
        assert eng.fmap.in_use == 0
    assert tokens(res) == tokens(want) == [got[r.rid] for r in res]
    assert res.stats is not None and want.stats is not None and res.stats.steps < want.stats.steps


# ----------------------------------------------------------------------------- aborts
def test_abort_from_on_tokens_after_the_first_update(model: Any, looped: list[list[int]]) -> None:
    want = tokens(plain(model, looped, greedy(24)))
    with make_engine(model, NGramDrafter(k=K)) as eng:
        victim: list[int] = []

        def on_tokens(engine: Engine, u: TokenUpdate) -> None:
            if not victim and not u.finished:
                victim.append(u.rid)
                assert engine.abort(u.rid)

        res = eng.generate(looped, greedy(24), on_tokens=on_tokens)
        assert eng.fmap.in_use == 0 and not eng.busy and eng.scheduler.live == []
        for r, w in zip(res, want, strict=True):
            if r.rid == victim[0]:
                assert r.finish_reason == "abort"
                assert 1 <= len(r.token_ids) < len(w) and r.token_ids == w[: len(r.token_ids)]
            else:
                assert r.finish_reason == "length" and r.token_ids == w
        # The engine serves the same requests again, whole.
        assert tokens(eng.generate(looped, greedy(24))) == want
        assert eng.fmap.in_use == 0


def test_abort_from_another_thread_while_the_run_goes(model: Any, looped: list[list[int]]) -> None:
    want = tokens(plain(model, looped[:2], greedy(24)))
    first, aborted, done = threading.Event(), threading.Event(), threading.Event()
    updates: list[TokenUpdate] = []

    def callback(u: TokenUpdate) -> None:
        updates.append(u)
        if len(updates) == 1:
            first.set()
            # Hold the run here until the other thread aborted: the abort lands mid-run.
            assert aborted.wait(30)
        if u.finished:
            done.set()

    with make_engine(model, NGramDrafter(k=K)) as eng:
        other = eng.stream(looped[1:2], greedy(24))  # starts the background thread
        rid = eng.submit(looped[0], greedy(24), callback=callback)
        assert first.wait(30)
        aborter = threading.Thread(target=lambda: eng.abort(rid))
        aborter.start()
        aborter.join()
        aborted.set()
        rest = list(other)
        assert done.wait(30)
        last = updates[-1]
        assert last.finished and last.finish_reason == "abort" and last.completion is not None
        out = last.completion.token_ids
        assert out == [t for u in updates for t in u.tokens] == want[0][: len(out)]
        assert len(out) < len(want[0])
        assert [t for u in rest for t in u.tokens] == want[1]
        # The same engine serves the same requests again, whole.
        assert tokens(eng.generate(looped[:2], greedy(24))) == want
        eng.close(timeout=30)
        assert eng.fmap.in_use == 0 and not eng.busy


def test_requests_submitted_mid_run_equal_plain(model: Any, looped: list[list[int]]) -> None:
    late = [looped[2], looped[0][:9]]
    want = tokens(plain(model, [looped[0], looped[1], *late], greedy(16)))
    added: list[int] = []

    def on_tokens(engine: Engine, u: TokenUpdate) -> None:
        if not added:
            added.extend(engine.submit(p, greedy(16)) for p in late)

    with make_engine(model, NGramDrafter(k=K)) as eng:
        res = eng.generate(looped[:2], greedy(16), on_tokens=on_tokens)
        assert eng.fmap.in_use == 0
    assert [r.rid for r in res][2:] == added
    assert tokens(res) == want
    assert all(r.finish_reason == "length" for r in res)


# ------------------------------------------------------------- finishes inside a run
@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_inside_an_accepted_run(model: Any, looped: list[list[int]], max_tokens: int) -> None:
    want = plain(model, looped, greedy(max_tokens))
    with make_engine(model, ModelDrafter(copy.deepcopy(model), k=4)) as eng:
        got = eng.generate(looped, greedy(max_tokens))
        assert eng.fmap.in_use == 0
    assert tokens(got) == tokens(want)
    assert all(len(t) == max_tokens for t in tokens(got))
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want] == ["length"] * len(looped)


def test_a_stop_token_inside_an_accepted_run(model: Any, looped: list[list[int]]) -> None:
    free = tokens(plain(model, looped, greedy(20)))
    stop = free[0][6]  # request 0's 7th token: inside a run of 5 committed tokens (k=4, all accepted)
    params = greedy(20, stop_token_ids=[stop])
    want = plain(model, looped, params)
    with make_engine(model, ModelDrafter(copy.deepcopy(model), k=4)) as eng:
        got = eng.generate(looped, params)
        extra = eng.scheduler.extra_tokens
        assert eng.fmap.in_use == 0
    assert tokens(got) == tokens(want)
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert got[0].timings.drafted > 0  # the JSON request drafted (xgrammar rolls its matcher back)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop and len(got[0].token_ids) <= 7
    assert extra > 0, "the tokens committed past the stop are dropped (and counted)"


def test_the_models_end_token_stops_like_plain(model: Any, looped: list[list[int]]) -> None:
    free = tokens(plain(model, looped, greedy(20)))
    eos = free[1][4]
    params = GenerationParams(max_tokens=20, temperature=0)  # ignore_eos off: eos stops
    want = plain_eos(model, looped, params, eos)
    with make_engine(model, NGramDrafter(k=K), eos_token_id=eos) as eng:
        got = eng.generate(looped, params)
    assert tokens(got) == tokens(want)
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert got[0].timings.drafted > 0  # the JSON request drafted (xgrammar rolls its matcher back)
    assert got[1].finish_reason == "stop"


def plain_eos(model: Any, prompts: list[list[int]], params: Any, eos: int) -> GenerateResult:
    with make_engine(model, eos_token_id=eos) as eng:
        return eng.generate(prompts, params)


# -------------------------------------------------- penalties, structured output, refusals
def test_penalties_on_a_speculative_engine_equal_plain(model: Any, looped: list[list[int]]) -> None:
    params = [
        greedy(12, presence_penalty=0.8),
        greedy(12, frequency_penalty=0.5, repetition_penalty=1.3),
        greedy(12, repetition_penalty=1.5),
    ]
    want = plain(model, looped, params)
    assert tokens(want) != tokens(plain(model, looped, greedy(12))), "the penalties change nothing here"
    with make_engine(model, NGramDrafter(k=K)) as eng:
        got = eng.generate(looped, params)
        assert eng.fmap.in_use == 0
    assert tokens(got) == tokens(want)


def test_a_grammar_request_on_a_speculative_engine_equals_plain(model: Any, looped: list[list[int]]) -> None:
    grammar = ToyGrammar(VOCAB, seed=1)
    params = [greedy(10), greedy(10, grammar=grammar), greedy(10)]
    want = plain(model, looped, params)
    with make_engine(model, NGramDrafter(k=K)) as eng:
        got = eng.generate(looped, params)
        assert eng.fmap.in_use == 0
    assert tokens(got) == tokens(want)
    assert grammar.accepts(got[1].token_ids)


def test_a_json_schema_request_on_a_speculative_engine_equals_plain() -> None:
    pytest.importorskip("xgrammar")
    pytest.importorskip("tokenizers")
    from tiny_bpe import tiny_tokenizer

    tok = tiny_tokenizer()
    small = build_llama(vocab=tok.get_vocab_size(), hidden=32, layers=1, seed=2)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [greedy(12, json_schema=schema), greedy(6)]
    with make_engine(small, tokenizer=tok) as eng:
        want = eng.generate(["hello", "world"], params)
    with make_engine(small, NGramDrafter(k=2), tokenizer=tok) as eng:
        got = eng.generate(["hello", "world"], params)
        assert eng.fmap.in_use == 0
    assert tokens(got) == tokens(want)
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert got[0].timings.drafted > 0  # the JSON request drafted (xgrammar rolls its matcher back)


def test_a_request_may_opt_out_of_drafts(model: Any, looped: list[list[int]]) -> None:
    params = [greedy(12, speculative=False), greedy(12), greedy(12, speculative=False)]
    with make_engine(model, NGramDrafter(k=K)) as eng:
        got = eng.generate(looped, params)
    assert tokens(got) == tokens(plain(model, looped, greedy(12)))
    assert got[0].timings.drafted == got[2].timings.drafted == 0 < got[1].timings.drafted


def test_a_drafter_that_is_not_one_is_refused(model: Any) -> None:
    with pytest.raises(TypeError, match=r"speculative= takes a drafter .* got str"):
        make_engine(model, "ngram")
    with pytest.raises(TypeError, match="speculative= takes a drafter"):
        tfuture.generate(model, [[1, 2, 3]], greedy(2), speculative=4)


def test_a_draft_model_with_another_vocabulary_is_refused(model: Any) -> None:
    other = build_llama(vocab=VOCAB + 8, hidden=32, layers=1, seed=4)
    with pytest.raises(ValueError, match=f"vocabulary has {VOCAB + 8} tokens, the target's {VOCAB}"):
        make_engine(model, ModelDrafter(other, k=2))


def test_a_draft_adapter_with_too_few_rows_is_refused(model: Any) -> None:
    from tfuture.models import HFCausalLM

    small = HFCausalLM(copy.deepcopy(model), max_requests=1, max_len=32)
    with pytest.raises(ValueError, match="the draft HFCausalLM has max_requests=1, max_len=32"):
        make_engine(model, ModelDrafter(small, k=2))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: NGramDrafter(k=0), r"NGramDrafter\(k=\) must be an int >= 1, got 0"),
        (lambda: NGramDrafter(k=2, max_ngram=1, min_ngram=2), r"min_ngram=\) must be <= max_ngram=1"),
        (lambda: ModelDrafter(object(), k=2), "needs a causal LM"),
        (lambda: ModelDrafter(build_llama(vocab=VOCAB, hidden=32, layers=1), k=True), "must be an int >= 1"),
    ],
    ids=["k0", "ngram_range", "not_a_model", "bool_k"],
)
def test_bad_drafter_arguments_are_refused(make: Any, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        make()


# ------------------------------------------------------------------ modes and sampling
def test_sync_gives_the_overlapped_tokens(model: Any, looped: list[list[int]]) -> None:
    want = tokens(plain(model, looped, greedy(16)))
    over = tfuture.generate(model, looped, greedy(16), speculative=NGramDrafter(k=K))
    sync = tfuture.generate(model, looped, greedy(16), speculative=NGramDrafter(k=K), overlap=False)
    assert tokens(over) == tokens(sync) == want
    # Every request ends by its length: no step runs for ended requests only (the batcher waits
    # for the step in flight when each request may end in it), so overlap takes sync's steps.
    assert over.stats is not None and sync.stats is not None
    assert over.stats.steps == sync.stats.steps


def test_seeded_sampling_is_the_same_overlapped_and_in_sync(model: Any, looped: list[list[int]]) -> None:
    params = [
        GenerationParams(max_tokens=14, temperature=0.8, seed=11 + i, ignore_eos=True) for i in range(3)
    ]
    over = tfuture.generate(model, looped, params, speculative=NGramDrafter(k=K))
    sync = tfuture.generate(model, looped, params, speculative=NGramDrafter(k=K), overlap=False)
    alone = tfuture.generate(model, looped[1:2], params[1:2], speculative=NGramDrafter(k=K))
    assert tokens(over) == tokens(sync)
    assert tokens(alone)[0] == tokens(over)[1]
    assert all(len(t) == 14 for t in tokens(over))
    # Not greedy: some sampled token differs from the greedy output.
    assert tokens(over) != tokens(plain(model, looped, greedy(14)))


# ------------------------------------------------------------------ failures and reuse
def test_a_failed_run_leaves_the_speculative_engine_usable(model: Any, looped: list[list[int]]) -> None:
    want = tokens(plain(model, looped, greedy(12)))
    seen = [0]

    def on_tokens(engine: Engine, u: TokenUpdate) -> None:
        seen[0] += 1
        if seen[0] == 3:
            raise KeyError("a callback bug")

    with make_engine(model, NGramDrafter(k=K)) as eng:
        with pytest.raises(KeyError, match="a callback bug"):
            eng.generate(looped, greedy(12), on_tokens=on_tokens)
        assert eng.fmap.in_use == 0 and not eng.busy and eng.scheduler.live == []
        assert tokens(eng.generate(looped, greedy(12))) == want
        # Leaving a stream early aborts its requests; the engine goes idle and serves again.
        stream = eng.stream(looped, greedy(12))
        next(stream)
        stream.close()
        wait_idle(eng)  # new requests at once: test_new_requests_in_the_step_that_ends_aborted_ones
        assert tokens(eng.generate(looped, greedy(12))) == want
        eng.close(timeout=30)
        assert eng.fmap.in_use == 0 and not eng.busy


def wait_idle(eng: Engine) -> None:
    with eng._cond:
        assert eng._cond.wait_for(lambda: eng._driver is None, timeout=30)


# ------------------------------------------------------- rows, budget (regressions)
# Each of these failed before main's ab265e4 (found by this file's first, xfail version).
@pytest.mark.parametrize("drafter", ["ngram", "twin"])
def test_more_requests_than_running_rows(model: Any, drafter: str) -> None:
    # 3 requests, 2 rows: the third is admitted in the step that reports the first ended, so the
    # drafter must free that one's row before it takes one for the newcomer.
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    want = tokens(plain(model, prompts, greedy(4)))
    d = NGramDrafter(k=2) if drafter == "ngram" else ModelDrafter(copy.deepcopy(model), k=2)
    got = tfuture.generate(model, prompts, greedy(4), max_running=2, speculative=d)
    assert tokens(got) == want


def test_new_requests_in_the_step_that_ends_aborted_ones(model: Any, looped: list[list[int]]) -> None:
    # Every row is live; on_tokens aborts them all and submits as many new requests: the step
    # that reports the aborted ones ended admits the new ones.
    want = tokens(plain(model, looped, greedy(12)))
    first: list[int] = []

    def on_tokens(engine: Engine, u: TokenUpdate) -> None:
        if not first:
            first.extend(engine.scheduler.live)
            for rid in first:
                engine.abort(rid)
            for p in looped:
                engine.submit(p, greedy(12))

    with make_engine(model, NGramDrafter(k=K), max_running=len(looped)) as eng:
        res = eng.generate(looped, greedy(12), on_tokens=on_tokens)
        assert eng.fmap.in_use == 0
    assert [r.finish_reason for r in res][: len(looped)] == ["abort"] * len(looped)
    assert tokens(res)[len(looped) :] == want


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_decode_skipped_for_token_budget_keeps_its_drafts(model: Any, overlap: bool) -> None:
    # Two decodes of 1 + 4 tokens and a budget of 9: one of them waits a step, every step.
    prompts = [[5, 6, 7], [8, 9, 10]]
    want = tokens(plain(model, prompts, greedy(6)))
    got = tfuture.generate(
        model, prompts, greedy(6), speculative=NGramDrafter(k=4), token_budget=9, overlap=overlap
    )
    assert tokens(got) == want


def test_a_decode_behind_a_prefill_chunk_keeps_its_drafts(model: Any) -> None:
    # The long prompt's chunks (8 of a budget of 10) come first: the short request's decode waits.
    prompts = [list(range(3, 43)), [5, 6, 7]]
    want = tokens(plain(model, prompts, greedy(6)))
    with make_engine(model, NGramDrafter(k=4), chunk=8, token_budget=10) as eng:
        got = eng.generate(prompts, greedy(6))
        assert eng.fmap.in_use == 0
    assert tokens(got) == want


def test_a_token_budget_below_one_plus_k_is_refused(model: Any) -> None:
    with pytest.raises(ValueError, match=r"token_budget=4 cannot hold a speculative decode of 1 \+ 4 tokens"):
        make_engine(model, NGramDrafter(k=4), token_budget=4, chunk=2)


def test_a_drafter_serves_one_open_engine_at_a_time(model: Any, looped: list[list[int]]) -> None:
    """Binding sizes the drafter's rows and history to an engine's requests: a second engine
    built with it while the first is open is refused (before, the first then failed at run time
    with a misleading "KV pool full"); once the first closed, the drafter moves on."""
    drafter = NGramDrafter(k=2)
    params = greedy(6)
    want = tokens(plain(model, looped, params))
    first = make_engine(model, drafter)
    with pytest.raises(ValueError, match="drafter of another Engine that is still open"):
        make_engine(model, drafter, max_running=1)
    assert tokens(first.generate(looped, params, progress=False)) == want
    first.close()
    with make_engine(model, drafter, max_running=1) as second:
        assert tokens(second.generate(looped, params, progress=False)) == want
    for _ in range(2):  # tfuture.generate closes its engine: the drafter is free again each call
        out = tfuture.generate(model, looped, params, speculative=drafter, progress=False)
        assert tokens(out) == want
