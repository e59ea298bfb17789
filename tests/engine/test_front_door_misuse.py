"""The front door under misuse (issue 30): refused submissions inside ``on_tokens``, callbacks
that raise, streams left with ``break``, requests past the model's context, and inputs that are
not what the engine takes. Each ends correct or refused with a clear error, nothing leaked."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tfuture
import tfuture.engine.engine as engine_mod
from tfuture import GenerationParams, TokenUpdate
from tfuture.engine import Engine, EngineError
from tfuture.testing import ToyGrammar, ToyModel

VOCAB = 64


def greedy(n: int, **kw: Any) -> GenerationParams:
    return GenerationParams(max_tokens=n, temperature=0, **kw)


def toy_engine(model: ToyModel | None = None, **kw: Any) -> Engine:
    opts: dict[str, Any] = {"max_running": 4, "chunk": 4, "token_budget": 16, **kw}
    return Engine(model or ToyModel(vocab=VOCAB), **opts)


def reference(model: ToyModel, prompt: list[int], rid: int, n: int) -> list[int]:
    return model.reference(np.asarray(prompt, dtype=np.int64), rid, n, None)


def in_thread(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``fn()`` on a daemon thread; fails (instead of hanging the suite) if it does not return
    within ``timeout`` seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"did not return within {timeout} s (hung)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def idle(eng: Engine) -> None:
    """The engine ends with nothing live, no slot held, no thread driving it."""
    thread = eng._thread
    if thread is not None:
        thread.join(30)
    assert eng.scheduler.live == [] and not eng.busy and eng.fmap.in_use == 0


# ---------------------------------------------------------------- item 5: refused submit
def test_a_submit_refused_inside_on_tokens_is_not_waited_for(monkeypatch):
    # A model whose vocab the engine does not know: the grammar's vocab is checked by the
    # scheduler (against the run's first grammar), after the request was prepared.
    monkeypatch.setattr(engine_mod, "_vocab", lambda model: None)
    refused: list[Exception] = []

    def on_tokens(engine: Engine, u: TokenUpdate) -> None:
        if u.rid == 0 and not refused:
            try:
                engine.submit([5, 6], greedy(3, grammar=ToyGrammar(32)))
            except ValueError as e:
                refused.append(e)

    model = ToyModel(vocab=VOCAB)
    with toy_engine(model) as eng:
        params = greedy(6, grammar=ToyGrammar(VOCAB))
        res = in_thread(lambda: eng.generate([[1, 2, 3]], params, on_tokens=on_tokens))
        assert len(refused) == 1 and "grammar has vocab 32" in str(refused[0])
        assert [o.rid for o in res] == [0] and res[0].finish_reason == "length"
        idle(eng)


# --------------------------------------------------------------- item 6: raising callbacks
def test_a_raising_callback_ends_its_request_only_and_the_engine_serves_the_rest():
    model = ToyModel(vocab=VOCAB, work_s=0.001)
    boom = KeyError("callback bug")
    heard: list[TokenUpdate] = []

    def bad(u: TokenUpdate) -> None:
        heard.append(u)
        if len(heard) == 2:
            raise boom

    with toy_engine(model) as eng:
        stream = eng.stream([[1, 2, 3], [4, 5]], greedy(12))  # another caller's requests
        bad_rid = eng.submit([7, 8, 9], greedy(12), callback=bad)
        updates = in_thread(lambda: list(stream))  # no EngineError: the run went on
        got: dict[int, list[int]] = {}
        for u in updates:
            got.setdefault(u.rid, []).extend(u.tokens)
            if u.finished:
                assert u.finish_reason == "length" and u.error is None
        for rid, p in zip(stream.rids, ([1, 2, 3], [4, 5]), strict=True):
            assert got[rid] == reference(model, p, rid, 12)
        idle(eng)
        last = heard[-1]
        assert last.finished and last.finish_reason == "error" and last.error is boom
        assert last.completion is not None and last.completion.error is boom
        assert len(heard) == 3, "the failed callback heard more than its error"
        toks = [t for u in heard for t in u.tokens]
        assert toks == reference(model, [7, 8, 9], bad_rid, 12)[: len(toks)] and len(toks) < 12
        # The engine is still usable.
        res = eng.generate([[1, 2]], greedy(4))
        assert res[0].token_ids == reference(model, [1, 2], res[0].rid, 4)


def test_on_tokens_that_raises_re_raises_in_its_generate_and_spares_other_callers():
    model = ToyModel(vocab=VOCAB, work_s=0.001)

    def on_tokens(engine: Engine, u: TokenUpdate) -> None:
        if u.rid == 1 and len(u.tokens):
            raise KeyError("on_tokens bug")

    with toy_engine(model) as eng:
        stream = eng.stream([[4, 5, 6]], greedy(30))
        with pytest.raises(KeyError, match="on_tokens bug"):
            in_thread(lambda: eng.generate([[1, 2], [3]], greedy(30), on_tokens=on_tokens))
        updates = in_thread(lambda: list(stream))
        assert updates[-1].finish_reason == "length"
        assert [t for u in updates for t in u.tokens] == reference(model, [4, 5, 6], stream.rids[0], 30)
        idle(eng)


def test_a_run_failure_still_fails_every_request():
    model = ToyModel(vocab=VOCAB, fail_at=2)
    with toy_engine(model) as eng:
        stream = eng.stream([[1, 2]], greedy(10))
        with pytest.raises(EngineError):
            in_thread(lambda: list(stream))
        idle(eng)


def test_a_callback_raising_on_its_last_update_is_warned_and_recorded():
    from tfuture import FutureMap, OverlapRuntime, ServingScheduler
    from tfuture.scheduler import RequestSpec

    fmap = FutureMap(32, device="cpu")
    sched = ServingScheduler(fmap, max_running=2)

    def bad(u: TokenUpdate) -> None:
        if u.finished:
            raise ValueError("late bug")

    sched.add(RequestSpec(0, 0, np.array([1, 2]), 4), bad)
    sched.add(RequestSpec(1, 0, np.array([3]), 4))
    with pytest.warns(RuntimeWarning, match="request 0's callback raised on its last update"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    sched.end_run()
    assert sched.completions[0].finish_reason == "error"
    assert isinstance(sched.completions[0].error, ValueError)
    assert sched.completions[1].finish_reason == "length" and fmap.in_use == 0


# -------------------------------------------------------------- item 9: break out of a stream
def final_updates(stream: Any, timeout: float = 30.0) -> dict[int, TokenUpdate]:
    """The last update of each of the stream's requests, read from its queue (waits for them)."""
    final: dict[int, TokenUpdate] = {}
    while len(final) < len(stream.rids):
        u = stream._q.get(timeout=timeout)
        if u.finished:
            final[u.rid] = u
    return final


def test_break_aborts_a_stream_still_held_in_a_variable():
    with toy_engine() as eng:
        stream = eng.stream([[1, 2, 3], [4]], greedy(3000))
        seen = []
        for u in stream:
            seen.append(u)
            break
        assert seen and stream is not None  # still held
        final = final_updates(stream)
        assert {rid: u.finish_reason for rid, u in final.items()} == dict.fromkeys(stream.rids, "abort")
        idle(eng)


def test_next_then_a_for_loop_to_the_end_and_close_after_the_end_abort_nothing():
    model = ToyModel(vocab=VOCAB)
    with toy_engine(model) as eng:
        stream = eng.stream([[1, 2, 3]], greedy(8))
        first = next(stream)
        rest = list(stream)
        stream.close()
        assert rest[-1].finished and rest[-1].finish_reason == "length"
        toks = [t for u in [first, *rest] for t in u.tokens]
        assert toks == reference(model, [1, 2, 3], stream.rids[0], 8)
        # next() without a loop: close() stops it.
        stream = eng.stream([[5]], greedy(100_000))
        next(stream)
        stream.close()
        assert final_updates(stream)[stream.rids[0]].finish_reason == "abort"
        idle(eng)


# ------------------------------------------------- item 11: inputs that are not what it takes
@pytest.mark.parametrize(
    ("field", "match"),
    [
        ("n", "does not take n= .*submit the prompt that many times"),
        ("best_of", "does not take best_of="),
        ("stop", "does not take stop= .*stop_token_ids"),
        ("logprobs", "does not take logprobs= .*not supported"),
        ("min_tokens", "does not take min_tokens= .*not supported"),
        ("colour", "has no field 'colour'; its fields: max_tokens, temperature"),
    ],
)
def test_generation_params_name_a_vllm_only_or_unknown_field(field, match):
    with pytest.raises(TypeError, match=match):
        GenerationParams(**{field: 2})
    assert GenerationParams(7).max_tokens == 7  # positional and keyword fields still work


def test_a_tokenizer_name_is_refused_without_a_download():
    with pytest.raises(
        TypeError, match=r"tokenizer must be a tokenizer object, got the str 'gpt2'.*from_pretrained"
    ):
        Engine(ToyModel(vocab=VOCAB), tokenizer="gpt2")
    with pytest.raises(TypeError, match=r"got the str 'gpt2'"):
        tfuture.generate(ToyModel(vocab=VOCAB), ["Hello"], tokenizer="gpt2")
    with pytest.raises(TypeError, match="encode\\(text\\) and decode\\(ids\\)"):
        Engine(ToyModel(vocab=VOCAB), tokenizer=object())


def test_a_model_that_gives_no_logits_is_refused_by_name():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="plain torch Linear, not a causal LM"):
        tfuture.generate(torch.nn.Linear(4, 4), [[1, 2]], greedy(2))
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    with pytest.raises(TypeError, match="LlamaModel, which has no language-model head"):
        tfuture.generate(transformers.LlamaModel(cfg), [[1, 2]], greedy(2))


# ---------------------------------------------------------------- item 3: the model's context
def tiny_hf(kind: str, positions: int = 16) -> Any:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=64,
            n_positions=positions,
            n_embd=32,
            n_layer=1,
            n_head=2,
            bos_token_id=63,
            eos_token_id=63,
        )
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=positions,
        )
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize(("kind", "key"), [("gpt2", "n_positions"), ("llama", "max_position_embeddings")])
def test_generate_refuses_a_request_past_the_models_context(kind, key):
    model = tiny_hf(kind, positions=16)
    with pytest.raises(
        ValueError,
        match=rf"request 1: prompt of 4 tokens \+ max_tokens=13 = 17 positions "
        rf"exceeds the model's context of 16 positions \(config.{key}\); ask for at most 12",
    ):
        tfuture.generate(model, [[1, 2], [1, 2, 3, 4]], [greedy(3), greedy(13)])
    # At the context exactly: it runs, and ends by length.
    res = tfuture.generate(model, [[1, 2, 3, 4]], greedy(12, ignore_eos=True))
    assert len(res[0].token_ids) == 12 and res[0].finish_reason == "length"


def test_an_engine_refuses_max_len_past_the_context_and_defaults_to_it():
    model = tiny_hf("llama", positions=16)
    with pytest.raises(
        ValueError, match=r"max_len=10000 positions per request exceeds the model's context of 16"
    ):
        Engine(model, max_len=10000)
    with Engine(model) as eng:
        assert eng.max_len == 16
        with pytest.raises(ValueError, match="exceeds max_len=16"):
            eng.submit([1, 2, 3], greedy(14))


# ------------------------------------------------------------------- item 13: tracing opt-in
def test_tracing_is_opt_in_for_generate_the_engine_and_the_runtime():
    from tfuture import FutureMap, OverlapRuntime

    res = tfuture.generate(ToyModel(vocab=VOCAB), [[1, 2]], greedy(4))
    assert res.stats is not None and res.stats.steps > 0
    assert res.stats.device_spans == [] and res.stats.host_spans == []
    assert "device idle not traced" in res.stats.summary()
    with toy_engine() as eng:
        assert not eng.runtime.trace
    assert not OverlapRuntime(ToyModel(vocab=VOCAB), FutureMap(8, device="cpu")).trace
    traced = tfuture.generate(ToyModel(vocab=VOCAB, work_s=1e-3), [[1, 2]], greedy(4), trace=True)
    assert traced.stats is not None and traced.stats.device_spans and traced.stats.device_busy > 0
    assert "device idle not traced" not in traced.stats.summary()
