"""The Engine and the ServingScheduler on the deterministic toy model: streaming, requests
added and aborted from other threads and mid-flight, failures, stop tokens, incremental
detokenization, and GenerationParams' defaults and checks."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import tfuture
from tfuture import FutureMap, GenerationParams, OverlapRuntime, ServingScheduler, TokenUpdate
from tfuture.core.batch import Batch
from tfuture.engine import Engine, EngineError, IncrementalDecoder
from tfuture.scheduler import RequestSpec
from tfuture.testing import ToyGrammar, ToyModel

VOCAB = 64


def greedy(n: int, **kw: Any) -> GenerationParams:
    return GenerationParams(max_tokens=n, temperature=0, **kw)


def toy_engine(model: ToyModel | None = None, **kw: Any) -> Engine:
    opts: dict[str, Any] = {"max_running": 4, "chunk": 4, "token_budget": 16, **kw}
    return Engine(model or ToyModel(vocab=VOCAB), **opts)


def reference(model: ToyModel, prompt: list[int], rid: int, n: int, eos: int | None = None) -> list[int]:
    return model.reference(np.asarray(prompt, dtype=np.int64), rid, n, eos)


# ---------------------------------------------------------------------------- streaming
def test_stream_yields_each_requests_tokens_in_order_and_ends():
    model = ToyModel(vocab=VOCAB)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14]]
    with toy_engine(model, max_running=2) as eng:
        stream = eng.stream(prompts, [greedy(8), greedy(5), greedy(6)])
        got: dict[int, list[int]] = defaultdict(list)
        finished: list[int] = []
        for rid, tokens, done in stream:
            assert rid in stream.rids and rid not in finished, "an update after the last one"
            got[rid] += tokens
            if done:
                finished.append(rid)
        assert sorted(finished) == stream.rids
        for rid, p, n in zip(stream.rids, prompts, (8, 5, 6), strict=True):
            assert got[rid] == reference(model, p, rid, n)
    assert eng.fmap.in_use == 0 and not eng.busy


def test_stream_text_deltas_are_complete_characters_and_add_up():
    tokenizers = pytest.importorskip("tokenizers")  # noqa: F841
    from tiny_bpe import tiny_tokenizer

    tok = tiny_tokenizer()
    # Random tokens of the whole vocabulary: byte tokens split multi-byte characters.
    model = ToyModel(vocab=tok.get_vocab_size())
    with toy_engine(model, tokenizer=tok) as eng:
        updates = list(eng.stream(["Is the lamp lit?", [200, 201, 202]], greedy(40)))
    for rid in {u.rid for u in updates}:
        mine = [u for u in updates if u.rid == rid]
        ids = [t for u in mine for t in u.tokens]
        assert "".join(u.text or "" for u in mine) == tok.decode(ids)
        assert not any((u.text or "").endswith("\ufffd") for u in mine[:-1])


def test_incremental_decoder_holds_back_partial_characters():
    pytest.importorskip("tokenizers")
    from tiny_bpe import tiny_tokenizer

    tok = tiny_tokenizer()
    text = "héllo 日本語 🙂 done"
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([t]) for t in ids), "no token splits a character: pick another text"
    dec = IncrementalDecoder(tok)
    deltas = [dec.push([t]) for t in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + dec.flush() == text == dec.text
    # An incomplete character at the end comes out as a full decode writes it.
    dec = IncrementalDecoder(tok)
    cut = tok.encode("日").ids[:-1]
    assert dec.push(cut) == "" and dec.flush() == tok.decode(cut)


# ------------------------------------------------------------------- threads and aborts
def test_a_request_submitted_from_another_thread_joins_the_running_run():
    model = ToyModel(vocab=VOCAB, work_s=0.002)
    with toy_engine(model) as eng:
        stream = eng.stream([[1, 2, 3]], greedy(40))
        first = next(stream)
        got: list[TokenUpdate] = []
        done = threading.Event()

        def client() -> None:
            def on_update(u: TokenUpdate) -> None:
                got.append(u)
                if u.finished:
                    done.set()

            ids.append(eng.submit([9, 8, 7], greedy(5), callback=on_update))

        ids: list[int] = []
        t = threading.Thread(target=client)
        t.start()
        t.join()
        rest = list(stream)
        assert done.wait(10)
    main = [t for u in [first, *rest] for t in u.tokens]
    assert main == reference(model, [1, 2, 3], stream.rids[0], 40)
    added = got[-1].completion
    assert added is not None and added.finish_reason == "length"
    assert added.token_ids == reference(model, [9, 8, 7], ids[0], 5)
    # Served while the first request ran: its last token came before the first one's.
    last = rest[-1].completion
    assert last is not None and last.timings.finished is not None
    assert added.timings.finished is not None and added.timings.finished < last.timings.finished


def test_closing_a_stream_early_aborts_its_requests():
    model = ToyModel(vocab=VOCAB)
    eng = toy_engine(model)
    stream = eng.stream([[1, 2], [3, 4, 5]], greedy(100_000))
    next(stream)
    stream.close()
    eng.close(timeout=30)
    assert not eng.busy and eng.fmap.in_use == 0
    final: dict[int, TokenUpdate] = {}
    while True:
        try:
            u = stream._q.get_nowait()
        except Exception:
            break
        if u.finished:
            final[u.rid] = u
    assert {rid: u.finish_reason for rid, u in final.items()} == dict.fromkeys(stream.rids, "abort")
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([1], greedy(2))


def test_breaking_out_of_a_stream_aborts_and_the_engine_goes_idle():
    with toy_engine() as eng:
        for _ in eng.stream([[1, 2, 3]], greedy(100_000)):
            break
        thread = eng._thread
        if thread is not None:
            thread.join(30)
        assert not eng.busy, "the dropped stream's request kept the engine running"


class Recording(ServingScheduler):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.batches: list[Batch] = []

    def schedule(self) -> Batch | None:
        batch = super().schedule()
        if batch is not None and (not self.batches or batch is not self.batches[-1]):
            self.batches.append(batch)
        return batch


@pytest.mark.parametrize("overlap", [False, True])
def test_aborts_mid_prefill_waiting_and_mid_decode_leak_nothing_and_keep_other_tokens(overlap):
    model = ToyModel(vocab=VOCAB)
    fmap = FutureMap(32, device="cpu")
    sched = Recording(fmap, max_running=3, chunk=2, token_budget=6)
    prompts = {0: list(range(1, 21)), 1: [5, 6], 2: [7, 8, 9], 3: [3, 1], 4: [2, 2, 2]}
    updates: list[TokenUpdate] = []
    seen: dict[int, int] = defaultdict(int)

    def on_update(u: TokenUpdate) -> None:
        updates.append(u)
        seen[u.rid] += len(u.tokens)
        if u.rid == 1 and seen[1] == 1:
            assert sched.abort(0)  # 20 prompt tokens in chunks of 2: still in prefill
            assert sched.abort(4)  # waiting: max_running=3 holds it back
        if u.rid == 2 and seen[2] == 3 and not u.finished:
            assert sched.abort(2)  # decoding, with a token in flight under overlap

    sched.on_update = on_update
    for rid, p in prompts.items():
        sched.add(RequestSpec(rid, 0, np.asarray(p), 12))
    OverlapRuntime(model, fmap, overlap=overlap).run(sched)
    sched.end_run()
    assert fmap.in_use == 0 and not sched.has_work() and sched.live == []
    reasons = {rid: c.finish_reason for rid, c in sched.completions.items()}
    assert reasons == {0: "abort", 1: "length", 2: "abort", 3: "length", 4: "abort"}
    out = {rid: c.token_ids for rid, c in sched.completions.items()}
    assert out[0] == [] and out[4] == []
    assert out[2] == reference(model, prompts[2], 2, 12)[:3]
    for rid in (1, 3):  # no token of another request was lost or moved
        assert out[rid] == reference(model, prompts[rid], rid, 12)
    ended = [int(r) for b in sched.batches for r in b.ended]
    assert sorted(ended) == sorted(set(ended)), "a request was reported ended twice"
    assert {0, 2} <= set(ended) and 4 not in ended  # 4 never ran
    assert 4 not in {int(r) for b in sched.batches for r in b.req_ids}
    assert not sched.abort(1) and not sched.abort(99)


def test_serving_scheduler_refuses_a_live_id_and_unpacks_updates():
    sched = ServingScheduler(FutureMap(8, device="cpu"))
    sched.add(RequestSpec(3, 0, np.array([1]), 2))
    with pytest.raises(ValueError, match="request id 3 is live"):
        sched.add(RequestSpec(3, 0, np.array([2]), 2))
    rid, tokens, finished = TokenUpdate(3, [7], True, "stop")
    assert (rid, tokens, finished) == (3, [7], True)


# --------------------------------------------------------------------------- failures
def test_a_failed_run_raises_in_generate_finishes_requests_with_error_and_the_engine_recovers():
    model = ToyModel(vocab=VOCAB, fail_at=2)
    with toy_engine(model) as eng:
        with pytest.raises(RuntimeError, match="planted failure"):
            eng.generate([[1, 2], [3, 4]], greedy(10))
        assert eng.fmap.in_use == 0 and not eng.busy and eng.scheduler.live == []
        # In the background: the stream raises EngineError from the run's exception.
        stream = eng.stream([[1, 2]], greedy(10))
        with pytest.raises(EngineError) as info:
            list(stream)
        assert isinstance(info.value.__cause__, RuntimeError)
        eng.close(timeout=10)
        assert eng.fmap.in_use == 0
    model.fail_at = None
    with toy_engine(model) as eng:
        res = eng.generate([[1, 2]], greedy(4))
        assert res[0].token_ids == reference(model, [1, 2], res[0].rid, 4)


def test_a_callback_error_re_raises_in_its_generate_and_leaks_nothing():
    def on_tokens(engine: Engine, u: TokenUpdate) -> None:
        raise KeyError("callback")

    with toy_engine() as eng:
        with pytest.raises(KeyError, match="callback"):
            eng.generate([[1, 2]], greedy(4), on_tokens=on_tokens)
        assert eng.fmap.in_use == 0 and not eng.busy


# --------------------------------------------------------------------- stop tokens
@dataclass
class EosToy(ToyModel):
    generation_config: Any = None
    config: Any = None


def test_default_stop_tokens_come_from_the_model_and_ignore_eos_turns_them_off():
    ns = SimpleNamespace
    assert Engine(EosToy(generation_config=ns(eos_token_id=[3, 5]), config=ns(eos_token_id=9))).eos == (3, 5)
    assert Engine(EosToy(generation_config=ns(eos_token_id=None), config=ns(eos_token_id=9))).eos == (9,)
    assert Engine(EosToy(config=ns(eos_token_id=9)), eos_token_id=[1, 2]).eos == (1, 2)
    assert Engine(ToyModel()).eos == ()

    plain = ToyModel(vocab=VOCAB)
    # The toy model's tokens depend on the request id: requests 0, 1, 2 of one prompt differ.
    ref = [reference(plain, [1, 2, 3], rid, 12) for rid in range(3)]
    end = next(t for t in ref[0][:-1] if t in ref[1][:-1])  # cuts requests 0 and 1
    stop = next(t for t in ref[2][:-1] if t != end)
    model = EosToy(vocab=VOCAB, generation_config=ns(eos_token_id=[end]))
    res = tfuture.generate(
        model,
        [[1, 2, 3]] * 3,
        [greedy(12), greedy(12, ignore_eos=True), greedy(12, ignore_eos=True, stop_token_ids=[stop])],
        progress=False,
    )
    assert res[0].token_ids == ref[0][: ref[0].index(end) + 1] and res[0].finish_reason == "stop"
    assert res[1].token_ids == ref[1] and res[1].finish_reason == "length"  # went past `end`
    assert res[2].token_ids == ref[2][: ref[2].index(stop) + 1] and res[2].finish_reason == "stop"


def test_a_grammar_object_constrains_the_request():
    g = ToyGrammar(VOCAB, seed=1)
    res = tfuture.generate(ToyModel(vocab=VOCAB), [[1, 2], [3]], [greedy(10, grammar=g), greedy(10)])
    assert g.accepts(res[0].token_ids) and res[0].finish_reason == "length"
    assert res[1].token_ids == reference(ToyModel(vocab=VOCAB), [3], 1, 10)


# ---------------------------------------------------------------------- parameters
def test_generation_params_follow_vllm_defaults_and_convert():
    p = GenerationParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (16, 1.0, 1.0, 0, 0.0, None)
    assert not p.greedy and not p.structured
    a, b = p.sampling_params(), p.sampling_params()
    assert a.seed != b.seed, "seed=None draws a fresh seed per request"
    s = GenerationParams(top_k=-1, seed=5, temperature=0.7).sampling_params()
    assert (s.top_k, s.seed, s.temperature) == (0, 5, 0.7)
    assert GenerationParams(temperature=0).sampling_params().greedy
    assert GenerationParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be an int >= 1, got 0"),
        ({"max_tokens": None}, ValueError, "not supported: give a limit"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens must be an int"),
        ({"top_k": -2}, ValueError, "top_k must be -1 or 0"),
        ({"top_p": 0.0}, ValueError, r"GenerationParams.top_p must be a float in \[1e-30, 1\]"),
        ({"temperature": -1}, ValueError, "GenerationParams.temperature"),
        ({"seed": -1}, ValueError, "seed must be None or an int"),
        ({"stop_token_ids": [-1]}, ValueError, "stop_token_ids must be token ids >= 0"),
        ({"stop_token_ids": "ab"}, TypeError, "stop_token_ids must be a list"),
        ({"json_schema": {}, "grammar": "root ::= 'a'"}, ValueError, "not both"),
        ({"json_schema": "{nope"}, ValueError, "not valid JSON"),
        ({"grammar": 3}, TypeError, "Grammar"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos must be a bool"),
    ],
)
def test_generation_params_refuse_bad_values(kw, error, match):
    with pytest.raises(error, match=match):
        GenerationParams(**kw)


def test_the_engine_refuses_bad_requests_before_queueing_them():
    with toy_engine(max_len=10) as eng:
        with pytest.raises(ValueError, match="needs a tokenizer"):
            eng.submit("text", greedy(2))
        with pytest.raises(ValueError, match="json_schema or an EBNF grammar\\) needs a tokenizer"):
            eng.submit([1], greedy(2, json_schema={"type": "object"}))
        with pytest.raises(ValueError, match="exceeds max_len=10"):
            eng.submit([1, 2, 3], greedy(8))
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            eng.submit([VOCAB], greedy(2))
        with pytest.raises(ValueError, match="empty"):
            eng.submit([], greedy(2))
        with pytest.raises(TypeError, match="GenerationParams"):
            eng.submit([1], tfuture.SamplingParams())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="2 entries for 3 prompts"):
            eng.generate([[1], [2], [3]], [greedy(1), greedy(1)])
        assert eng.scheduler.live == [] and not eng.busy


def test_progress_bar_only_when_asked_or_on_a_terminal(capsys):
    pytest.importorskip("tqdm")
    res = tfuture.generate(ToyModel(vocab=VOCAB), [[1], [2]], greedy(3), progress=True)
    assert len(res) == 2 and "2/2" in capsys.readouterr().err
    tfuture.generate(ToyModel(vocab=VOCAB), [[1], [2]], greedy(3))  # stderr is no terminal here
    assert "2/2" not in capsys.readouterr().err


def test_timings_are_monotonic_host_stamps():
    with toy_engine(ToyModel(vocab=VOCAB, work_s=0.001)) as eng:
        t0 = time.perf_counter()
        res = eng.generate([[1, 2, 3]], greedy(6))
    t = res[0].timings
    assert t0 <= t.submitted <= t.first_token <= t.last_token <= t.finished  # type: ignore[operator]
    assert t.tpot is not None and t.tpot > 0 and t.n_tokens == 6


def test_waiting_on_the_engine_inside_a_callback_is_refused():
    def on_tokens(engine: Engine, u: TokenUpdate) -> None:
        engine.generate([[5]], greedy(2))  # would wait for the run this thread drives

    with toy_engine() as eng:
        with pytest.raises(RuntimeError, match="this thread drives that run"):
            eng.generate([[1, 2]], greedy(3), on_tokens=on_tokens)
        assert eng.scheduler.live == [] and not eng.busy
        with pytest.raises(ValueError, match="grammar has vocab 32, the model's logits have 64"):
            eng.submit([1], greedy(2, grammar=ToyGrammar(32)))
