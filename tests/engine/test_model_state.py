"""What the front door leaves of a Hugging Face model (issue 30 item 2): ``generate`` and an
``Engine`` give a model its train/eval mode and its own attention implementation back when they
are done, generate without dropout meanwhile, and never switch a model under another engine."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tfuture  # noqa: E402
from tfuture import GenerationParams  # noqa: E402
from tfuture.engine import Engine  # noqa: E402
from tfuture.models import HFCausalLM  # noqa: E402

PROMPTS = [[1, 5, 7, 9], [3, 2]]


def llama(dropout: float = 0.5) -> Any:
    """A random-weight Llama with attention dropout, left in train mode, as a user's model is
    after training steps."""
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attention_dropout=dropout,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Hugging Face's greedy generate in eval mode (no dropout), the mode put back after."""
    training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        return out[0, len(prompt) :].tolist()
    finally:
        model.train(training)


def greedy(n: int) -> GenerationParams:
    return GenerationParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_generate_runs_without_dropout_and_gives_the_mode_and_attention_back():
    model = llama()
    res = tfuture.generate(model, PROMPTS, greedy(6))
    assert model.training, "generate() left a training model in eval mode"
    assert model.config._attn_implementation == "sdpa", "generate() left its attention switched"
    for o, p in zip(res, PROMPTS, strict=True):
        assert o.token_ids == hf_greedy(model, p, 6)  # generated in eval mode: no dropout
    model.eval()
    tfuture.generate(model, PROMPTS, greedy(2))
    assert not model.training and model.config._attn_implementation == "sdpa"


def test_the_last_engine_over_a_model_gives_it_back_and_never_under_a_running_one():
    model = llama()
    a = Engine(model, max_running=2)
    b = Engine(model, max_running=2)
    assert not model.training and model.config._attn_implementation == "tfuture_sdpa"
    a.close()
    # b still serves the model: its pooled attention and eval mode stay.
    assert not model.training and model.config._attn_implementation == "tfuture_sdpa"
    res = b.generate(PROMPTS, greedy(5))
    b.close()
    assert model.training and model.config._attn_implementation == "sdpa"
    for o, p in zip(res, PROMPTS, strict=True):
        assert o.token_ids == hf_greedy(model, p, 5)


def test_a_closed_engine_gives_back_only_after_its_background_run_ended():
    model = llama()
    eng = Engine(model, max_running=2)
    stream = eng.stream([PROMPTS[0]], greedy(40))
    first = next(stream)
    eng.close(timeout=30)  # aborts the request; the run ends, then the model is given back
    assert not eng.busy
    assert model.training and model.config._attn_implementation == "sdpa"
    assert first.tokens


def test_an_engine_refused_after_wrapping_leaves_the_model_as_it_was():
    model = llama()
    with pytest.raises(ValueError, match="eos_token_id"):
        Engine(model, eos_token_id=[-1])
    assert model.training and model.config._attn_implementation == "sdpa"


def test_an_hfcausallm_the_user_built_is_left_as_it_is():
    model = llama()
    adapter = HFCausalLM(model, max_requests=2, max_len=32)
    assert not model.training
    with Engine(adapter, max_running=2) as eng:
        eng.generate(PROMPTS, greedy(3))
    assert not model.training and model.config._attn_implementation == "tfuture_sdpa"
    adapter.restore()
    assert model.config._attn_implementation == "sdpa"
