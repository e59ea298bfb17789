"""Sliding-window and latent attention through ``HFCausalLM``, against transformers itself.

Each architecture runs a mixed workload (chunked prefills beside decodes, requests that grow
past the window) in sync and overlap mode, in float64: every sampled row's logits equal those
of one full forward of the request's whole sequence (transformers' own masks), and the greedy
tokens equal ``generate`` (transformers' own sliding-window cache). Windows shorter than the
sequences, longer than them, all layers windowed, and full and sliding layers mixed; keys and
values of different head sizes (DeepSeek-V2/V3).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_hf import TINY, VOCAB  # noqa: E402

from tfuture import FutureMap  # noqa: E402
from tfuture.core.batch import ForwardBatch  # noqa: E402
from tfuture.models import HFCausalLM  # noqa: E402
from tfuture.runtime import OverlapRuntime  # noqa: E402
from tfuture.testing import ContinuousBatcher, RequestSpec, random_workload  # noqa: E402

MAX_LEN, WINDOW = 32, 5
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
GEMMA = dict(sliding_window=WINDOW, head_dim=8, query_pre_attn_scalar=8)
# name: (config class, config kwargs, attention implementation, the pool's per-layer windows)
CASES: dict[str, tuple[str, dict[str, Any], str, tuple[int | None, ...]]] = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), "sdpa", (WINDOW, WINDOW)),
    "mistral-eager": ("MistralConfig", dict(sliding_window=WINDOW), "eager", (WINDOW, WINDOW)),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW), "sdpa", (WINDOW, WINDOW)),
    # Qwen2's max_window_layers: layer 0 full, layer 1 sliding.
    "qwen2-mixed": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "sdpa",
        (None, WINDOW),
    ),
    "qwen3-layer-types": (
        "Qwen3Config",
        dict(
            use_sliding_window=True,
            sliding_window=WINDOW,
            head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "sdpa",
        (WINDOW, None),
    ),
    "gemma2": ("Gemma2Config", GEMMA, "eager", (WINDOW, None)),  # softcapping: eager only
    "gemma3": ("Gemma3TextConfig", dict(GEMMA, sliding_window_pattern=2), "sdpa", (WINDOW, None)),
    "gpt-oss": (
        "GptOssConfig",
        dict(sliding_window=WINDOW, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
        "eager",
        (WINDOW, None),
    ),
    # Windows that never bind: one past max_len (not masked), one past every sequence (masked).
    "mistral-wide": ("MistralConfig", dict(sliding_window=MAX_LEN), "sdpa", (None, None)),
    "mistral-longer-than-seqs": ("MistralConfig", dict(sliding_window=MAX_LEN - 1), "sdpa", (31, 31)),
    "deepseek-v2": ("DeepseekV2Config", DEEPSEEK, "sdpa", (None, None)),
    "deepseek-v3": ("DeepseekV3Config", DEEPSEEK, "sdpa", (None, None)),
}
pytestmark = pytest.mark.usefixtures("one_torch_thread")
SPECS = random_workload(0, 4, vocab=VOCAB, max_prompt=10, max_new=8, arrival_span=3)


def build(name: str) -> Any:
    """A random-weight 2-layer float64 model (skipped when this transformers lacks the config)."""
    config, kw, attn, _ = CASES[name]
    cls = getattr(transformers, config, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config}")
    torch.manual_seed(0)
    cfg = cls(**{**TINY, **kw})
    # Eager experts: the grouped matmul of MoE layers takes no float64.
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn, experts_implementation="eager"
    )
    return model.double().eval()


class Recording(HFCausalLM):
    """Keeps every sampled row's logits, per request, in step order."""

    def __init__(self, model: Any, **kw: Any) -> None:
        super().__init__(model, **kw)
        self.logits: dict[int, list[torch.Tensor]] = {}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        assert batch.host is not None
        logits = super().forward(batch)
        rids = batch.host.req_ids[batch.host.sample_reqs].tolist()
        for rid, row in zip(rids, logits, strict=True):
            self.logits.setdefault(rid, []).append(row.clone())
        return logits


def generate(model: Any, specs: list[RequestSpec]) -> dict[int, list[int]]:
    out = {}
    with torch.inference_mode():
        for s in specs:
            ids = model.generate(
                torch.as_tensor(s.prompt)[None], max_new_tokens=s.max_new, do_sample=False, pad_token_id=0
            )
            out[s.rid] = ids[0, s.prompt.size :].tolist()
    return out


def run(adapter: Recording, overlap: bool) -> dict[int, list[int]]:
    adapter.logits.clear()
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(SPECS, fmap, eos=-1, max_running=4, chunk=4, token_budget=8)
    with torch.inference_mode():
        OverlapRuntime(adapter, fmap, overlap=overlap).run(sched)
    assert fmap.in_use == 0 and adapter.pool.n_free == 4
    return sched.outputs


def full_forward_logits(model: Any, spec: RequestSpec, out: list[int]) -> torch.Tensor:
    """``[len(out), vocab]``: the logits that predict each output token, from one forward."""
    seq = torch.as_tensor(np.concatenate([spec.prompt, np.asarray(out[:-1], dtype=np.int64)]))[None]
    with torch.inference_mode():
        logits = model(input_ids=seq).logits[0]
    return logits[spec.prompt.size - 1 :]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_a_full_forward_and_generate_past_the_window(name):
    model = build(name)
    ref = generate(model, SPECS)
    adapter = Recording(model, max_requests=4, max_len=MAX_LEN)
    assert adapter.pool.windows == CASES[name][3]
    assert max(s.prompt.size + len(ref[s.rid]) for s in SPECS) > 3 * WINDOW  # runs past the window
    # Eager attention takes its softmax in float32.
    atol = 1e-6 if CASES[name][2] == "eager" else 1e-9
    for overlap in (False, True):
        got = run(adapter, overlap)
        assert got == ref, f"overlap={overlap}"
        for s in SPECS:
            rows = adapter.logits[s.rid][: len(got[s.rid])]
            assert len(rows) == len(got[s.rid])
            torch.testing.assert_close(
                torch.stack(rows), full_forward_logits(model, s, got[s.rid]), rtol=0, atol=atol
            )


def test_latent_attention_pools_keys_and_values_in_their_own_shapes():
    adapter = HFCausalLM(build("deepseek-v3"), max_requests=2, max_len=MAX_LEN)
    # qk_nope_head_dim + qk_rope_head_dim = 24 for keys, v_head_dim = 8 for values.
    assert adapter.pool.k.shape == (2, 2, MAX_LEN, 4, 24)
    assert adapter.pool.v.shape == (2, 2, MAX_LEN, 4, 8)


@pytest.mark.parametrize("config", ["Gemma2Config", "Gemma3TextConfig"])
def test_gemma_with_a_window_past_max_len_runs_like_generate(config):
    """Refused before whatever the window (their layer_types name sliding layers)."""
    cls = getattr(transformers, config, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config}")
    torch.manual_seed(0)
    cfg = cls(**{**TINY, **GEMMA, "sliding_window": 64})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ref = generate(model, SPECS)
    adapter = Recording(model, max_requests=4, max_len=MAX_LEN)
    assert adapter.pool.windows == (None, None)
    assert run(adapter, overlap=True) == ref
