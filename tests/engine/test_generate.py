"""``tfuture.generate`` end to end: a random-weight Hugging Face Llama (built from a config, no
download) with the tiny tokenizer (``tests/tiny_bpe.py``), mixed sampling parameters, a JSON
schema request, an abort midway, a request added while the run goes, and streaming order."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("xgrammar")
pytest.importorskip("tokenizers")

from tiny_bpe import END_TOKEN, tiny_tokenizer  # noqa: E402

import tfuture  # noqa: E402
from tfuture import GenerationParams, TokenUpdate  # noqa: E402

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["color"],
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
}


@functools.cache
def llama() -> Any:
    """A 2-layer random-weight Llama over the tiny tokenizer's vocabulary; its end token is the
    tokenizer's (so the model's default stop token and xgrammar's agree)."""
    tok = tiny_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=tok.token_to_id(END_TOKEN),
        pad_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def hf_greedy(prompt: str, max_new: int) -> list[int]:
    """Hugging Face's own greedy ``generate`` for one prompt (same end token)."""
    tok, model = tiny_tokenizer(), llama()
    ids = torch.tensor([tok.encode(prompt).ids])
    end = tok.token_to_id(END_TOKEN)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=end, pad_token_id=end)
    return out[0, ids.shape[1] :].tolist()


PROMPTS = [
    "The lamp is lit and",  # 0 greedy
    "Hello world, said the",  # 1 greedy
    "Is the door open?",  # 2 seeded temperature
    "Once upon a time",  # 3 seeded temperature, top-p, top-k
    "Give me a color as JSON:",  # 4 JSON schema (greedy under the mask)
    "A long answer that we abort",  # 5 aborted midway
]
ADDED = "Hello again"  # 6: added while the run goes
PARAMS = [
    GenerationParams(max_tokens=10, temperature=0),
    GenerationParams(max_tokens=7, temperature=0.0),
    GenerationParams(max_tokens=9, temperature=0.9, seed=11),
    GenerationParams(max_tokens=8, temperature=1.3, top_p=0.9, top_k=-1, min_p=0.05, seed=12),
    GenerationParams(max_tokens=30, temperature=0, json_schema=SCHEMA),
    GenerationParams(max_tokens=20, temperature=0),
]
ADDED_PARAMS = GenerationParams(max_tokens=6, temperature=0)
ABORT_AT = 3  # tokens of request 5 seen when on_tokens aborts it


def run(overlap: bool = True) -> tuple[tfuture.GenerateResult, list[TokenUpdate], dict[str, int]]:
    updates: list[TokenUpdate] = []
    seen: dict[int, int] = {}
    added: dict[str, int] = {}

    def on_tokens(engine: tfuture.Engine, u: TokenUpdate) -> None:
        updates.append(u)
        seen[u.rid] = seen.get(u.rid, 0) + len(u.tokens)
        if u.rid == 0 and seen[0] >= 2 and "rid" not in added:
            added["rid"] = engine.submit(ADDED, ADDED_PARAMS)  # joins the running run
        if u.rid == 5 and seen[5] >= ABORT_AT and not u.finished:
            assert engine.abort(5)

    res = tfuture.generate(
        llama(), PROMPTS, PARAMS, tokenizer=tiny_tokenizer(), overlap=overlap, on_tokens=on_tokens
    )
    return res, updates, added


def test_generate_hf_llama_mixed_params_json_abort_added_request_and_streaming():
    res, updates, added = run()
    assert [o.rid for o in res] == [0, 1, 2, 3, 4, 5, added["rid"]]
    out = {o.rid: o for o in res}

    # Greedy requests (the added one too) are Hugging Face's own greedy generate.
    for rid, prompt, p in [(0, PROMPTS[0], PARAMS[0]), (1, PROMPTS[1], PARAMS[1]), (6, ADDED, ADDED_PARAMS)]:
        ref = hf_greedy(prompt, p.max_tokens)
        assert out[rid].token_ids == ref, rid
        end = tiny_tokenizer().token_to_id(END_TOKEN)
        assert out[rid].finish_reason == ("stop" if ref[-1] == end else "length")
    assert out[6].prompt == ADDED

    # Seeded sampling runs to its length limit (or the end token).
    for rid in (2, 3):
        assert out[rid].finish_reason in ("length", "stop")
        assert len(out[rid].token_ids) == PARAMS[rid].max_tokens or out[rid].finish_reason == "stop"

    # The JSON schema request: a document of the schema, ended by the end token.
    js = out[4]
    assert js.finish_reason == "stop" and js.token_ids[-1] == tiny_tokenizer().token_to_id(END_TOKEN)
    doc = json.loads(js.text)
    assert list(doc) == ["color"] and doc["color"] in ("red", "green", "blue")

    # The aborted request stopped early with the tokens seen before the abort: a prefix of greedy.
    ab = out[5]
    assert ab.finish_reason == "abort" and len(ab.token_ids) == ABORT_AT < PARAMS[5].max_tokens
    assert ab.token_ids == hf_greedy(PROMPTS[5], PARAMS[5].max_tokens)[:ABORT_AT]

    # Streaming: each request's chunks concatenate to its tokens (and text), in order, and the
    # one update with finished=True comes last.
    for rid, o in out.items():
        mine = [u for u in updates if u.rid == rid]
        assert [t for u in mine for t in u.tokens] == o.token_ids
        assert "".join(u.text or "" for u in mine) == o.text
        assert [u.finished for u in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == o.finish_reason
        rid_, _tokens, fin = mine[-1]  # unpacks as (rid, tokens, finished)
        assert (rid_, fin) == (rid, True)

    # Timings are host stamps: first token after submission, steady tokens after.
    for o in res:
        t = o.timings
        assert t.ttft is not None and t.ttft > 0 and t.latency is not None and t.latency >= t.ttft
        assert t.n_tokens == len(o.token_ids)
        if t.n_tokens > 1:
            assert t.tpot is not None and t.tpot > 0
    assert (
        res.stats is not None
        and res.stats.steps > 0
        and res.stats.tokens >= sum(len(o.token_ids) for o in res)
    )


def test_sync_and_overlap_give_the_same_outputs():
    a, _, _ = run(overlap=True)
    b, _, _ = run(overlap=False)
    assert [(o.token_ids, o.finish_reason) for o in a] == [(o.token_ids, o.finish_reason) for o in b]
    assert a.stats is not None and b.stats is not None
    assert (a.stats.mode, b.stats.mode) == ("overlap", "sync")


def test_three_line_start_defaults_and_token_id_prompts():
    tok = tiny_tokenizer()
    # Defaults as vLLM: 16 tokens, temperature 1 (a random seed each request).
    res = tfuture.generate(llama(), "The lamp", tokenizer=tok, progress=False)
    assert len(res) == 1 and len(res[0].token_ids) <= 16 and res[0].finish_reason in ("length", "stop")
    assert res[0].text == tok.decode(res[0].token_ids)
    # Token ids without a tokenizer: no text.
    ids = tok.encode("The lamp").ids
    res = tfuture.generate(llama(), [ids, ids], GenerationParams(max_tokens=4, temperature=0))
    assert res[0].token_ids == res[1].token_ids == hf_greedy("The lamp", 4)
    assert res[0].text is None and res[0].prompt_token_ids == ids
