"""Adversarial checks of speculative decoding composed with multi-step windows through the front
door (``tfuture.generate``/``Engine`` with ``speculative=`` and ``multi_step=K``), as a demanding
user drives them: drafting and non-drafting (``GenerationParams(speculative=False)``) requests
mixed, more prompts than ``max_running``, prompts of one token, ``max_tokens`` of 1 and 2, stop
tokens and length limits at every offset of a window and of an accepted run, seeded sampling with
filters and penalties for every ``K`` and sync/overlap, streams aborted mid-window, the stats
against the outputs, nothing leaked (map slots, KV rows, sampler rows, draft-model rows), a
sliding-window Mistral past its window, a model in train mode, and a draft model of another size.

Greedy references are plain decoding (no drafter, ``multi_step=1``) and Hugging Face's own
``generate``. The target is a random Llama whose head is scaled up so its distributions are
peaked (a draft model that is an exact copy then gets its sampled drafts accepted too).
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any, NamedTuple

import pytest
import torch

pytest.importorskip("transformers")

import transformers

from tfuture import GenerationParams, ModelDrafter, NGramDrafter
from tfuture.engine import Engine, GenerateResult
from tfuture.examples.hf import build_llama
from tfuture.spec import DraftBatch

VOCAB, MAX_LEN, END = 64, 48, 2

QUOTED = [3, 5, 7, 9, 11, 13] * 2  # prompt lookup finds its own continuation
PROMPTS = [QUOTED, [4, 6, 8], [1], [9, 9, 9, 9, 9], [7]]


def greedy(n: int, **kw: Any) -> GenerationParams:
    return GenerationParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


# Drafting and non-drafting requests, length limits of 1 and 2, one-token prompts.
MIXED = [greedy(14), greedy(12, speculative=False), greedy(1), greedy(2, speculative=False), greedy(9)]


@pytest.fixture(scope="module")
def model() -> Any:
    m = build_llama(vocab=VOCAB, hidden=32, layers=1, seed=0, max_len=128)
    with torch.no_grad():
        m.lm_head.weight.mul_(30)  # peaked distributions: sampled drafts of a copy get accepted
    return m


@pytest.fixture(scope="module")
def small_draft() -> Any:
    """A draft model of another size (width, heads, KV heads) with the target's vocabulary."""
    return build_llama(vocab=VOCAB, hidden=16, layers=2, seed=3, heads=2, kv_heads=1, max_len=128)


def tokens(result: GenerateResult) -> list[list[int]]:
    return [r.token_ids for r in result]


class Ran(NamedTuple):
    windows: list[int]  # the n_steps of each multi-step window scheduled
    wasted: int  # tokens dropped past a finish (the scheduler's extra_tokens)


def count_windows(eng: Engine) -> list[int]:
    """Record the ``n_steps`` of every multi-step window the engine's scheduler builds."""
    windows: list[int] = []
    schedule = eng.scheduler.schedule

    def recording() -> Any:
        batch = schedule()
        if isinstance(batch, DraftBatch) and batch.n_steps > 1:
            windows.append(batch.n_steps)
        return batch

    eng.scheduler.schedule = recording  # type: ignore[method-assign]
    return windows


def run(
    model: Any, prompts: list[list[int]], params: Any, drafter: Any = None, **kw: Any
) -> tuple[GenerateResult, Ran]:
    """``prompts`` on an Engine, and what it ran (windows, dropped tokens); checks that nothing
    is held after the run (map slots, KV rows, sampler rows, the draft model's rows) and that
    the run's token count is what the outputs kept plus what the scheduler says it dropped."""
    opts: dict[str, Any] = {"max_running": len(prompts), "max_len": MAX_LEN, "eos_token_id": END, **kw}
    with Engine(model, speculative=drafter, **opts) as eng:
        windows = count_windows(eng)
        out = eng.generate(prompts, params)
        assert eng.fmap.in_use == 0, "future-map slots leaked"
        assert eng.model.pool.n_free == opts["max_running"], "KV rows leaked"
        assert eng.sampler.live_rows == 0, "sampler rows leaked"
        adapter = getattr(drafter, "adapter", None)
        if adapter is not None:
            assert adapter.pool.n_free == opts["max_running"], "draft-model KV rows leaked"
        assert out.stats is not None
        kept = sum(len(r.token_ids) for r in out)
        assert out.stats.tokens == kept + eng.scheduler.extra_tokens
        for r, p in zip(out, params if isinstance(params, list) else [params] * len(prompts), strict=True):
            assert r.timings.n_tokens == len(r.token_ids) <= p.max_tokens
            assert 0 <= r.timings.accepted <= r.timings.drafted
            if drafter is None or not p.speculative:
                assert r.timings.drafted == 0  # a request that opted out never drafts
        assert out.drafted == eng.scheduler.drafted_tokens and out.accepted == eng.scheduler.accepted_tokens
        wasted = eng.scheduler.extra_tokens
    assert all(k <= opts.get("multi_step", 1) for k in windows)
    return out, Ran(windows, wasted)


@pytest.fixture(scope="module")
def plain_mixed(model: Any) -> list[list[int]]:
    out, _ = run(model, PROMPTS, MIXED)
    with torch.inference_mode():
        hf = [
            model.generate(
                torch.tensor([p]),
                max_new_tokens=g.max_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(p) :].tolist()
            for p, g in zip(PROMPTS, MIXED, strict=True)
        ]
    assert tokens(out) == hf, "plain decoding is not Hugging Face's greedy decoding"
    return hf


@pytest.mark.parametrize(
    ("kind", "k", "steps", "overlap", "max_running"),
    [
        ("ngram", 3, 4, True, 2),  # requests arrive as others finish
        ("copy", 3, 8, True, 1),  # one at a time: every draft accepted, windows of 8
        ("small", 2, 3, False, 1),  # a draft model of another size, in sync
    ],
)
def test_greedy_equals_plain_and_hf(
    model: Any,
    small_draft: Any,
    plain_mixed: list[list[int]],
    kind: str,
    k: int,
    steps: int,
    overlap: bool,
    max_running: int,
) -> None:
    drafter = {
        "ngram": lambda: NGramDrafter(k=k),
        "copy": lambda: ModelDrafter(copy.deepcopy(model), k=k),
        "small": lambda: ModelDrafter(copy.deepcopy(small_draft), k=k),
    }[kind]()
    out, ran = run(model, PROMPTS, MIXED, drafter, multi_step=steps, overlap=overlap, max_running=max_running)
    assert ran.windows, "no step ran as a window"
    assert tokens(out) == plain_mixed
    assert [r.finish_reason for r in out] == ["length"] * len(PROMPTS)
    assert out.drafted > 0
    if kind == "copy":  # an exact copy: every draft accepted (no finish cut a run: counted before)
        assert out.accepted == out.drafted


def test_every_request_opted_out_runs_windows_only(model: Any, plain_mixed: list[list[int]]) -> None:
    """On a speculative engine where no request drafts, every decode runs in windows (the draft
    model still sees each window's first step): plain tokens, nothing drafted."""
    params = [replace(p, speculative=False) for p in MIXED]
    out, ran = run(
        model, PROMPTS, params, ModelDrafter(copy.deepcopy(model), k=2), multi_step=4, max_running=2
    )
    assert tokens(out) == plain_mixed
    assert ran.windows and out.drafted == 0


@pytest.fixture(scope="module")
def free_run(model: Any) -> list[int]:
    """The greedy continuation of [4, 6, 8]; its first 7 tokens are distinct (stop offsets)."""
    out, _ = run(model, [[4, 6, 8]], [greedy(10)])
    seq = out[0].token_ids
    assert len(set(seq[:7])) == 7, seq
    return seq


@pytest.mark.parametrize(("steps", "overlap"), [(4, True), (3, False)])
def test_stop_and_length_at_every_offset(model: Any, free_run: list[int], steps: int, overlap: bool) -> None:
    """One prompt many times: request ``i`` stops on the token at offset ``i`` (or has
    ``max_tokens = i + 1``), drafting (an exact-copy draft model: the finish lands inside an
    accepted run) or not (the finish lands inside a window). Cut exactly there, right reason."""
    prompts, params, want = [], [], []
    for spec in (False, True):  # the 11 that opt out first, together: they run in windows
        for i in range(7):
            prompts.append([4, 6, 8])
            params.append(
                GenerationParams(max_tokens=10, temperature=0, stop_token_ids=[free_run[i]], speculative=spec)
            )
            want.append((free_run[: i + 1], "stop"))
        for m in (1, 2, 3, 5):
            prompts.append([4, 6, 8])
            params.append(greedy(m, speculative=spec))
            want.append((free_run[:m], "length"))
    drafter = ModelDrafter(copy.deepcopy(model), k=3)
    out, ran = run(model, prompts, params, drafter, multi_step=steps, overlap=overlap, max_running=11)
    assert ran.windows and ran.wasted > 0  # finishes landed inside windows and accepted runs
    if not overlap:  # in sync, at most K - 1 per request in a window, k in a cut accepted run
        assert ran.wasted <= 11 * (steps - 1) + 11 * 3
    assert [(r.token_ids, r.finish_reason) for r in out] == want


SAMPLED = [  # the first two opt out (windows while only they run), then drafting joins
    GenerationParams(
        max_tokens=11, temperature=1.0, seed=2, top_p=0.9, frequency_penalty=0.5, speculative=False
    ),
    GenerationParams(
        max_tokens=10, temperature=1e6, seed=4, top_k=100, stop_token_ids=[5], speculative=False
    ),
    GenerationParams(max_tokens=12, temperature=0.8, seed=1, top_k=5, repetition_penalty=1.3),
    GenerationParams(
        max_tokens=7, temperature=1.0, seed=3, min_p=0.05, presence_penalty=-0.7, speculative=False
    ),
    GenerationParams(max_tokens=9, temperature=0.5, seed=5, presence_penalty=0.7, stop_token_ids=[40, 44]),
]


@pytest.mark.parametrize("kind", ["ngram", "small"])
def test_seeded_sampling_same_for_every_window_and_overlap(model: Any, small_draft: Any, kind: str) -> None:
    def drafter() -> Any:
        return NGramDrafter(k=2) if kind == "ngram" else ModelDrafter(copy.deepcopy(small_draft), k=2)

    want, _ = run(model, PROMPTS, SAMPLED, drafter(), overlap=False, max_running=2)
    for steps, overlap in ((4, True), (3, False)) if kind == "ngram" else ((4, True),):
        got, ran = run(model, PROMPTS, SAMPLED, drafter(), multi_step=steps, overlap=overlap, max_running=2)
        assert ran.windows
        assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in want]
    if kind != "ngram":
        return
    # A request that opted out decodes plainly: its seeded tokens are plain decoding's.
    plain, _ = run(model, PROMPTS, SAMPLED, max_running=2)
    for i in (0, 1, 3):
        assert want[i].token_ids == plain[i].token_ids


def test_stream_abort_mid_window_keeps_the_others_and_leaks_nothing(model: Any) -> None:
    """Abort a drafting and a non-drafting request at their first update (a window or an
    accepted run in flight, overlapped): they end 'abort' with a prefix of their tokens, the
    others finish as plain decoding, the streamed tokens equal each completion, and every row
    comes back."""
    params = [greedy(30), greedy(30, speculative=False), greedy(1), greedy(6, speculative=False), greedy(9)]
    want = tokens(run(model, PROMPTS, params)[0])
    drafter = ModelDrafter(copy.deepcopy(model), k=3)
    with Engine(
        model, max_running=3, max_len=MAX_LEN, eos_token_id=END, speculative=drafter, multi_step=4
    ) as eng:
        stream = eng.stream(PROMPTS, params)
        index = {rid: i for i, rid in enumerate(stream.rids)}
        got: dict[int, list[int]] = {}
        done: dict[int, tuple[str | None, list[int]]] = {}
        aborted: dict[int, bool] = {}
        for u in stream:
            i = index[u.rid]
            assert i not in done, "an update after the request's last one"
            got.setdefault(i, []).extend(u.tokens)
            if u.finished:
                assert u.completion is not None
                done[i] = (u.finish_reason, list(u.completion.token_ids))
            elif i in (0, 1) and i not in aborted:  # later updates may come before it applies
                aborted[i] = eng.abort(u.rid)
        deadline = time.monotonic() + 10
        while eng.busy and time.monotonic() < deadline:  # the background run winds down
            time.sleep(0.01)
        assert (eng.fmap.in_use, eng.model.pool.n_free, eng.sampler.live_rows) == (0, 3, 0)
        assert drafter.adapter is not None and drafter.adapter.pool.n_free == 3
    assert sorted(done) == list(range(len(PROMPTS)))
    assert any(aborted.values()), "the run outpaced the stream: no abort landed"
    for i, (reason, ids) in done.items():
        assert ids == got.get(i, [])
        if aborted.get(i):  # False: it had finished when the stream asked (a slow consumer)
            assert reason == "abort" and 0 < len(ids) < len(want[i]) and ids == want[i][: len(ids)]
        else:
            assert (reason, ids) == ("length", want[i])


def test_sliding_window_mistral_past_its_window_equals_hf() -> None:
    """Mistral with a window of 4: prompts plus output run far past it, drafted (a draft
    Mistral of one layer) and in windows; the tokens are Hugging Face's."""
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=4,
    )
    target = transformers.AutoModelForCausalLM.from_config(
        transformers.MistralConfig(**cfg), attn_implementation="sdpa"
    ).eval()
    torch.manual_seed(1)
    draft = transformers.AutoModelForCausalLM.from_config(
        transformers.MistralConfig(**{**cfg, "num_hidden_layers": 1, "sliding_window": 3}),
        attn_implementation="sdpa",
    )
    prompts = [[3, 5, 7, 9, 3, 5, 7, 9], [4, 6]]
    with torch.inference_mode():
        hf = [
            target.generate(
                torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    params = [greedy(16), greedy(16, speculative=False)]
    for drafter in (NGramDrafter(k=3), ModelDrafter(draft, k=2)):
        out, ran = run(target, prompts, params, drafter, multi_step=4, max_running=1)
        assert ran.windows
        assert tokens(out) == hf


def test_train_mode_target_drafting_itself_back_to_back(model: Any, plain_mixed: list[list[int]]) -> None:
    """A target in train mode with attention dropout, drafting with itself (the same object),
    twice in a row (the probe cache): plain greedy tokens, every draft accepted, its mode and
    attention given back."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=0.5,
    )
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    m.load_state_dict(model.state_dict())
    m.train()
    for steps in (4, 2):
        out, ran = run(m, PROMPTS, MIXED, ModelDrafter(m, k=3), multi_step=steps, max_running=3)
        assert ran.windows
        assert tokens(out) == plain_mixed
        assert out.accepted == out.drafted > 0
        assert m.training and m.config._attn_implementation == "sdpa"


def test_steps_of_a_request_that_finishes_inside_a_window(model: Any) -> None:
    """``RequestTimings.steps``: model steps that gave the request tokens. A request that opted
    out of drafting gets one token per decode step, so its steps equal its tokens, for every K
    (the window's steps past its finish gave it nothing; they were counted once)."""
    params = [greedy(2, speculative=False), greedy(9, speculative=False)]
    out, ran = run(model, [[4, 6, 8], [1, 2, 3]], params, NGramDrafter(k=2), multi_step=4)
    assert ran.windows and ran.wasted == 2
    assert [r.timings.steps for r in out] == [len(r.token_ids) for r in out] == [2, 9]
