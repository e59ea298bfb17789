"""What ``HFCausalLM`` refuses at construction, and what its KV pool refuses at a step.

* Limited attention the pooled attention does not reproduce, whatever config key declares it
  (``attention_chunk_size``, other window keys, chunked layer types, bidirectional attention,
  sliding windows where transformers < 4.53 masks per model), and an attention call whose window
  disagrees with the config. Sliding windows themselves run (per layer, as ``layer_types`` and
  ``sliding_window`` say; ``test_hf_windows.py`` runs them against transformers).
* Rope types whose frequencies follow the longest position of the forward (``dynamic``,
  ``longrope``) when ``max_len`` passes the original context.
* Architectures the pooled attention cannot serve, found by the one-token probe: StableLM and
  Nemotron (layers that do not pass the attention kwargs). The model is left as it was.
* A request that arrives with cached tokens but owns no KV row, and a step with more requests
  than the pool has rows: clear errors at that step, no row taken.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_hf import VOCAB, tiny  # noqa: E402

from tfuture import FutureMap  # noqa: E402
from tfuture.core.batch import Batch  # noqa: E402
from tfuture.examples.hf import build_llama  # noqa: E402
from tfuture.models import HFCausalLM, KVPool  # noqa: E402
from tfuture.runtime import OverlapRuntime  # noqa: E402
from tfuture.testing import ContinuousBatcher, RequestSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def generate(model: Any, prompt: np.ndarray, n: int) -> list[int]:
    with torch.inference_mode():
        ids = model.generate(torch.as_tensor(prompt)[None], max_new_tokens=n, do_sample=False, pad_token_id=0)
    return ids[0, prompt.size :].tolist()


def run_one(adapter: HFCausalLM, prompt: np.ndarray, n: int) -> list[int]:
    fmap = FutureMap(16, device="cpu")
    sched = ContinuousBatcher([RequestSpec(0, 0, prompt, n)], fmap, eos=-1, max_running=2)
    with torch.inference_mode():
        OverlapRuntime(adapter, fmap).run(sched)
    return sched.outputs[0]


PROMPT = np.arange(1, 7)

# -- sliding windows and other limited attention ------------------------------------------------

WINDOWED = ["MistralConfig", "Phi3Config", "Starcoder2Config", "MixtralConfig"]


@pytest.mark.parametrize("config", WINDOWED)
def test_a_sliding_window_without_layer_types_windows_every_layer(config):
    # Refused before (the pooled attention had no window); tests/models/test_hf_windows.py
    # runs them against transformers.
    adapter = HFCausalLM(tiny(config, sliding_window=4), max_requests=2, max_len=32)
    assert adapter.pool.windows == (4, 4)
    # A window of at least max_len never binds: not masked.
    assert HFCausalLM(tiny(config, sliding_window=32), max_requests=2, max_len=32).pool.windows == (
        None,
        None,
    )


def test_a_window_that_never_binds_runs_like_generate():
    # Every position stays below max_len <= window: the window masks nothing.
    model = tiny("MistralConfig", sliding_window=16)
    assert run_one(HFCausalLM(model, max_requests=2, max_len=16), PROMPT, 8) == generate(model, PROMPT, 8)


def test_qwen2_windows_follow_use_sliding_window_and_max_window_layers():
    on = tiny("Qwen2Config", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert HFCausalLM(on, max_requests=2, max_len=32).pool.windows == (None, 4)
    # use_sliding_window=False switches Qwen2's window off.
    off = tiny("Qwen2Config", use_sliding_window=False, sliding_window=4)
    assert HFCausalLM(off, max_requests=2, max_len=32).pool.windows == (None, None)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("sliding_window", [None, 8], r"config\.sliding_window must be an int >= 1 or None, got \[None, 8\]"),
        ("window_size", 4, r"config\.window_size=4 limits attention below the KV pool's max_len=32"),
        ("attention_chunk_size", 16, r"config\.attention_chunk_size=16 limits attention below .*max_len=32"),
        (
            "layer_types",
            ["chunked_attention", "full_attention"],
            r"config\.layer_types .* \['chunked_attention'\]",
        ),
        (
            "layer_types",
            ["sliding_attention", "full_attention"],
            r"'sliding_attention' layers, config\.sliding_window is None",
        ),
        ("layer_types", ["full_attention"], r"each of its 2 layers, got 1 entries"),
    ],
    ids=["window-list", "window_size", "attention_chunk_size", "chunked-layer", "no-window", "short-types"],
)
def test_limited_attention_the_pool_does_not_reproduce_is_refused_naming_the_key(key, value, match):
    llama = build_llama(vocab=VOCAB, hidden=32, layers=2)
    setattr(llama.config, key, value)
    with pytest.raises(ValueError, match=match):
        HFCausalLM(llama, max_requests=2, max_len=32)
    assert llama.config._attn_implementation == "sdpa"  # left as it was


def test_bidirectional_attention_is_refused():
    model = tiny("Gemma3TextConfig", head_dim=8, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True is not causal"):
        HFCausalLM(model, max_requests=2, max_len=32)


def test_windows_are_refused_where_transformers_masks_per_model():
    """Before 4.53 (no masking_utils) each model built its own sliding mask: not reproduced."""
    model = tiny("MistralConfig", sliding_window=4)
    with (
        mock.patch("tfuture.models.hf_config._masks_from_layer_types", return_value=False),
        pytest.raises(ValueError, match=r"sliding_window=4 is below the KV pool's max_len=32.*< 4\.53"),
    ):
        HFCausalLM(model, max_requests=2, max_len=32)
    assert HFCausalLM(model, max_requests=2, max_len=4).pool.windows == (None, None)


def test_an_attention_call_whose_window_disagrees_with_the_config_is_refused_by_the_probe():
    """Whatever key a model reads its window from, the probe sees it in the attention call."""
    model = tiny("MistralConfig", sliding_window=4)
    with (
        mock.patch("tfuture.models.hf.layer_windows", return_value=(None, None)),
        pytest.raises(
            ValueError, match=r"layer 0 attends with sliding_window=4, its config gives it full attention"
        ),
    ):
        HFCausalLM(model, max_requests=2, max_len=32)
    assert model.config._attn_implementation == "sdpa"


def test_a_window_changed_after_construction_fails_the_step_naming_the_layer():
    model = tiny("MistralConfig", sliding_window=4)
    adapter = HFCausalLM(model, max_requests=2, max_len=32)
    model.config.sliding_window = 6  # Mistral's attention reads it at each call
    try:
        with pytest.raises(
            ValueError, match=r"layer 0 attends with sliding_window=6, the KV pool gives it a window of 4"
        ):
            run_one(adapter, PROMPT, 2)
    finally:
        model.config.sliding_window = 4


# -- rope that depends on the step ----------------------------------------------------------


def rope_model(rope_type: str) -> Any:
    """A 16-position model whose rope frequencies follow the longest position of the forward."""
    if rope_type == "dynamic":
        return tiny(
            "LlamaConfig", max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
        )
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}
    return tiny(
        "Phi3Config", max_position_embeddings=64, original_max_position_embeddings=16, rope_scaling=scaling
    )


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_that_follows_the_longest_position_is_refused_past_the_original_context(rope_type):
    model = rope_model(rope_type)
    # Accepted before: a short request's tokens changed when a long one shared its step.
    with pytest.raises(
        ValueError,
        match=rf"rope type '{rope_type}' .* max_len=17 passes the original context of 16 positions",
    ):
        HFCausalLM(model, max_requests=2, max_len=17)
    assert model.config._attn_implementation == "sdpa"
    # Within it the frequencies are fixed: a short request gives the same tokens alone and
    # beside a long one, and those of generate.
    adapter = HFCausalLM(model, max_requests=2, max_len=16)
    short, long = np.arange(1, 4), np.arange(1, 13)
    alone = run_one(adapter, short, 4)
    fmap = FutureMap(16, device="cpu")
    specs = [RequestSpec(0, 0, short, 4), RequestSpec(1, 0, long, 4)]
    sched = ContinuousBatcher(specs, fmap, eos=-1, max_running=2)
    with torch.inference_mode():
        OverlapRuntime(adapter, fmap).run(sched)
    assert sched.outputs[0] == alone == generate(model, short, 4)
    assert sched.outputs[1] == generate(model, long, 4)


# -- architectures the pooled attention cannot serve --------------------------------------------


@pytest.mark.parametrize(
    ("config", "kw", "match"),
    [
        ("StableLmConfig", {}, r"StableLmForCausalLM \(model_type 'stablelm'\): its decoder layers call"),
        ("NemotronConfig", {}, r"NemotronForCausalLM \(model_type 'nemotron'\): its decoder layers call"),
    ],
    ids=["stablelm", "nemotron"],
)
def test_architectures_that_would_crash_mid_run_are_refused_at_construction(config, kw, match):
    model = tiny(config, **kw)
    with pytest.raises(TypeError, match=match):
        HFCausalLM(model, max_requests=2, max_len=32)
    assert model.config._attn_implementation == "sdpa"
    generate(model, PROMPT, 2)  # the model itself still works


# -- the KV pool at a step ------------------------------------------------------------------


def _pool(rows: int = 2) -> KVPool:
    return KVPool(1, rows, 8, 1, 4, dtype=torch.float32, device=torch.device("cpu"))


def test_a_request_with_cached_tokens_but_no_row_is_refused():
    pool = _pool()
    with pytest.raises(ValueError, match=r"request 7 comes with prefix_len=3 .* holds no KV row"):
        pool.rows_of(np.array([5, 7]), np.array([0, 3]))
    assert pool.n_free == 2 and pool.rows == {}  # request 5's fresh row went back
    assert pool.rows_of(np.array([5]), np.array([0])).tolist() == [0]
    assert pool.rows_of(np.array([5]), np.array([4])).tolist() == [0]  # owns its row: fine


def test_a_step_with_more_requests_than_rows_is_refused_naming_both():
    pool = _pool(2)
    with pytest.raises(RuntimeError, match=r"a step runs 3 requests, the KV pool has max_requests=2 rows"):
        pool.rows_of(np.array([1, 2, 3]), np.zeros(3, dtype=np.int64))
    assert pool.n_free == 2


class Script:
    """A scheduler that plays fixed batches (concrete token ids, no placeholders)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def schedule(self) -> Batch | None:
        return self.batches.pop(0) if self.batches else None

    def process(self, result: Any) -> None:
        pass

    def build_mask(self, batch: Any) -> None:
        return None


def _batch(rid: int, tokens: list[int], prefix: int, ended: list[int] | None = None) -> Batch:
    i64 = np.int64
    return Batch(
        np.array(tokens, dtype=i64),
        np.array([len(tokens)], dtype=i64),
        np.array([prefix], dtype=i64),
        np.array([rid], dtype=i64),
        np.array([True]),
        ended=np.array(ended or [], dtype=i64),
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_a_row_is_never_handed_out_to_a_request_that_has_cached_tokens(overlap):
    adapter = HFCausalLM(build_llama(vocab=VOCAB, hidden=32, layers=1), max_requests=2, max_len=16)
    # Request 0 prefills, is reported ended (its row is freed and taken by request 1), then
    # decodes on: it would get a fresh row and attend over an empty cache.
    script = Script([_batch(0, [1, 2, 3], 0), _batch(1, [4, 5], 0, ended=[0]), _batch(0, [6], 3)])
    fmap = FutureMap(16, device="cpu")
    with torch.inference_mode(), pytest.raises(ValueError, match=r"request 0 comes with prefix_len=3"):
        OverlapRuntime(adapter, fmap, overlap=overlap).run(script)
    assert fmap.in_use == 0 and adapter.pool.n_free == 2
    # Never run at all:
    fmap = FutureMap(16, device="cpu")
    with torch.inference_mode(), pytest.raises(ValueError, match=r"request 9 comes with prefix_len=5"):
        OverlapRuntime(adapter, fmap, overlap=overlap).run(Script([_batch(9, [1], 5)]))


def test_a_pool_smaller_than_max_running_fails_at_the_first_step_that_needs_more_rows():
    adapter = HFCausalLM(build_llama(vocab=VOCAB, hidden=32, layers=1), max_requests=2, max_len=24)
    specs = [RequestSpec(r, 0, np.arange(1, 4), 4) for r in range(4)]
    fmap = FutureMap(16, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=-1, max_running=4)
    steps: list[int] = []
    forward = adapter.forward

    def spy(batch):
        steps.append(batch.step)
        return forward(batch)

    adapter.forward = spy  # type: ignore[method-assign]
    with (
        torch.inference_mode(),
        pytest.raises(
            RuntimeError, match=r"KV pool full: a step runs 4 requests, the KV pool has max_requests=2 rows"
        ),
    ):
        OverlapRuntime(adapter, fmap).run(sched)
    assert steps == [0] and fmap.in_use == 0 and adapter.pool.n_free == 2
