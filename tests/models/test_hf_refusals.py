"""What ``HFCausalLM`` refuses at construction, and what its KV pool refuses at a step.

* Sliding windows below ``max_len``, whatever config key declares them (Mistral, Phi-3,
  Starcoder2 and Mixtral set ``sliding_window`` without ``layer_types``), and windows the probe
  forward sees in the attention call; a window of at least ``max_len`` never binds and runs
  token for token like ``generate``.
* Architectures the pooled attention cannot serve, found by the one-token probe: StableLM and
  Nemotron (layers that do not pass the attention kwargs), DeepSeek-V3 (latent attention: keys
  and values of different head sizes). The model is left as it was.
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

from tfuture import FutureMap  # noqa: E402
from tfuture.core.batch import Batch  # noqa: E402
from tfuture.examples.hf import build_llama  # noqa: E402
from tfuture.models import HFCausalLM, KVPool  # noqa: E402
from tfuture.runtime import OverlapRuntime  # noqa: E402
from tfuture.testing import ContinuousBatcher, RequestSpec  # noqa: E402

VOCAB = 64
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny(config: str, **kw: Any) -> Any:
    """A random-weight 2-layer model of ``transformers.<config>`` (skipped if not installed)."""
    cls = getattr(transformers, config, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config}")
    torch.manual_seed(0)
    cfg = cls(**{**TINY, **kw})
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


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

# -- sliding windows --------------------------------------------------------------------------

WINDOWED = ["MistralConfig", "Phi3Config", "Starcoder2Config", "MixtralConfig"]


@pytest.mark.parametrize("config", WINDOWED)
def test_a_sliding_window_below_max_len_is_refused_naming_the_key(config):
    model = tiny(config, sliding_window=4)
    # Accepted before: the 5th+ tokens then differed from generate (the window was ignored).
    with pytest.raises(ValueError, match=r"config\.sliding_window=4 limits attention .* max_len=32"):
        HFCausalLM(model, max_requests=2, max_len=32)
    assert model.config._attn_implementation == "sdpa"  # left as it was


def test_a_window_that_never_binds_runs_like_generate():
    # Every position stays below max_len <= window: the window masks nothing.
    model = tiny("MistralConfig", sliding_window=16)
    assert run_one(HFCausalLM(model, max_requests=2, max_len=16), PROMPT, 8) == generate(model, PROMPT, 8)


def test_windows_in_other_keys_and_per_layer_lists_are_refused():
    model = tiny("Qwen2Config", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(ValueError, match=r"config\.layer_types with \['sliding_attention'\]"):
        HFCausalLM(model, max_requests=2, max_len=32)
    # use_sliding_window=False switches Qwen2's window off: accepted.
    off = tiny("Qwen2Config", use_sliding_window=False, sliding_window=4)
    HFCausalLM(off, max_requests=2, max_len=32)
    for key, value in (("sliding_window", [None, 8]), ("window_size", 4), ("attention_chunk_size", 16)):
        llama = build_llama(vocab=VOCAB, hidden=32, layers=2)
        setattr(llama.config, key, value)
        with pytest.raises(
            ValueError, match=rf"config\.{key}={value!r} limits attention".replace("[", r"\[")
        ):
            HFCausalLM(llama, max_requests=2, max_len=32)


def test_a_window_the_attention_call_carries_is_refused_by_the_probe():
    """Whatever key a model reads its window from, the probe sees it in the attention call."""
    model = tiny("MistralConfig", sliding_window=4)
    with (
        mock.patch("tfuture.models.hf._check_windows"),
        pytest.raises(
            ValueError, match=r"layer 0 attends with sliding_window=4, below the KV pool's max_len=32"
        ),
    ):
        HFCausalLM(model, max_requests=2, max_len=32)
    assert model.config._attn_implementation == "sdpa"


# -- architectures the pooled attention cannot serve --------------------------------------------

DEEPSEEK = dict(
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)


@pytest.mark.parametrize(
    ("config", "kw", "match"),
    [
        ("StableLmConfig", {}, r"StableLmForCausalLM \(model_type 'stablelm'\): its decoder layers call"),
        ("NemotronConfig", {}, r"NemotronForCausalLM \(model_type 'nemotron'\): its decoder layers call"),
        (
            "DeepseekV3Config",
            DEEPSEEK,
            r"DeepseekV3ForCausalLM .*keys and values differ in shape .* key heads x size 4 x 24, "
            r"value 4 x 8",
        ),
    ],
    ids=["stablelm", "nemotron", "deepseek-v3"],
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
