"""The direct forward (``tfuture.models.hf_direct``): Llama-structured models skip their module
calls and give the module path's logits bit for bit, step by step, over mixed prefill and decode
steps; anything it does not stand for (another architecture, a foreign or patched module, a
forward hook or a module swapped after construction, a probe that disagrees) runs the modules."""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from direct_support import MAX_LEN, ROWS, Recorded, run, same_logits  # noqa: E402
from tiny_hf import TINY, tiny  # noqa: E402

from tfuture.models import HFCausalLM, hf_direct  # noqa: E402

# name: (config class, its kwargs, attention implementation)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", {}, "sdpa"),
    "llama-eager": ("LlamaConfig", {}, "eager"),
    # Biases everywhere, a head size of its own, llama3 rope scaling, tied embeddings, gelu.
    "llama-variant": (
        "LlamaConfig",
        dict(
            attention_bias=True,
            mlp_bias=True,
            head_dim=16,
            tie_word_embeddings=True,
            hidden_act="gelu",
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        "sdpa",
    ),
    "mistral-window": ("MistralConfig", dict(sliding_window=5), "sdpa"),
    "qwen2": ("Qwen2Config", {}, "sdpa"),
    "qwen3-mixed": (
        "Qwen3Config",
        dict(
            head_dim=8,
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "eager",
    ),
}


DIRECT_CALLS = 1 + 2 * TINY["num_hidden_layers"]  # module calls of a direct step, at most


@pytest.mark.parametrize("case", list(CASES))
def test_the_direct_forward_gives_the_module_paths_logits_bit_for_bit(case, one_torch_thread):
    config, kw, attn = CASES[case]
    model = tiny(config, attn, **kw)
    direct, modules = Recorded(model), Recorded(model, direct=False)
    assert direct._direct is not None, f"{case}: the direct forward should apply"
    want = run(modules)
    assert run(direct) == want
    assert same_logits(direct, modules), case
    # The direct steps called the rotary embedding, and per layer its activation and (where
    # transformers wraps it in a module) the rotary function, nothing else.
    n_layers = model.config.num_hidden_layers
    assert max(direct.module_calls) <= DIRECT_CALLS
    assert min(modules.module_calls) > 5 * n_layers
    assert run(direct, overlap=True) == want


def test_a_hook_or_a_swap_after_construction_runs_the_modules(one_torch_thread):
    model = tiny("LlamaConfig")
    want = run(Recorded(model, direct=False))
    adapter = Recorded(model)
    seen: list[int] = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *_: seen.append(1))
    assert run(adapter) == want and seen, "a forward hook must run"
    handle.remove()
    adapter.module_calls.clear()
    assert run(adapter) == want and max(adapter.module_calls) <= DIRECT_CALLS
    with torch.nn.modules.module.register_module_forward_hook(lambda *_: seen.append(2)):
        assert run(adapter) == want and 2 in seen, "a global forward hook must run"
    # A module swapped (a copy: same results, but the direct forward no longer holds it).
    model.model.layers[0].mlp = copy.deepcopy(model.model.layers[0].mlp)
    adapter.module_calls.clear()
    assert run(adapter) == want and min(adapter.module_calls) > DIRECT_CALLS
    # An instance forward (a monkeypatch) on a module that was not swapped.
    adapter = Recorded(model)
    assert adapter._direct is not None
    norm = model.model.norm
    norm.forward = norm.forward
    adapter.module_calls.clear()
    assert run(adapter) == want and min(adapter.module_calls) > DIRECT_CALLS
    del norm.forward


class _LoRALike(torch.nn.Linear):
    """A Linear subclass (as adapters and quantizers install): the direct forward does not apply."""


def test_models_the_direct_forward_does_not_stand_for_run_the_modules(one_torch_thread):
    model = tiny("LlamaConfig")
    want = run(Recorded(model, direct=False))
    attn = model.model.layers[0].self_attn
    old = attn.q_proj
    attn.q_proj = _LoRALike(old.in_features, old.out_features, bias=False)
    attn.q_proj.load_state_dict(old.state_dict())
    assert HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN)._direct is None
    attn.q_proj = old
    # Another architecture (Phi-3: fused projections).
    assert HFCausalLM(tiny("Phi3Config"), max_requests=ROWS, max_len=MAX_LEN)._direct is None
    # The probe compares logits bit for bit: a direct forward that rounds differently is not used.
    fresh = tiny("LlamaConfig")
    real = hf_direct._rms

    def rounds_differently(norm: Any, x: torch.Tensor) -> torch.Tensor:
        return real(norm, x) * (1 + 1e-6)

    with mock.patch.object(hf_direct, "_rms", rounds_differently):
        adapter = Recorded(fresh)
        assert adapter._direct is None
        assert run(adapter) == want


def test_a_window_changed_after_construction_fails_the_direct_step(one_torch_thread):
    model = tiny("MistralConfig", sliding_window=4)
    adapter = Recorded(model)
    assert adapter._direct is not None and adapter._direct.intact()
    model.config.sliding_window = 6  # Mistral's attention reads it at each call
    try:
        with pytest.raises(
            ValueError, match=r"layer 0 attends with sliding_window=6, the KV pool gives it a window"
        ):
            run(adapter)
    finally:
        model.config.sliding_window = 4
    assert adapter._direct.intact()  # the step that raised ran the direct forward


def test_direct_false_always_runs_the_modules(one_torch_thread):
    model = tiny("LlamaConfig")
    adapter = HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN, direct=False)
    assert adapter._direct is None
    with pytest.raises(TypeError, match="direct must be a bool, got int"):
        HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN, direct=1)


def test_multi_token_steps_attend_grouped_keys_as_they_are_and_bit_for_bit(one_torch_thread):
    """Prefill chunks of a grouped-query sdpa model on the CPU: SDPA with ``enable_gqa`` instead of
    ``repeat_kv``'s copies, the module path's logits all the same; decode steps keep transformers'
    own function."""
    model = tiny("LlamaConfig")  # 4 query heads, 2 KV heads
    direct, modules = Recorded(model), Recorded(model, direct=False)
    real = torch.nn.functional.scaled_dot_product_attention
    widths: list[tuple[int, bool]] = []

    def seen(q: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        widths.append((q.shape[2], bool(kw.get("enable_gqa"))))
        return real(q, *args, **kw)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", seen):
        got = run(direct)
    assert got == run(modules) and same_logits(direct, modules)
    assert any(gqa for _, gqa in widths), "no multi-token step took enable_gqa"
    assert not all(gqa for _, gqa in widths), "decode steps go through transformers' function"


def test_sdpa_with_enable_gqa_equals_sdpa_on_repeated_keys_bit_for_bit():
    """What the direct forward's grouped attention rests on, on this torch: SDPA over grouped keys
    and values as they are gives what it gives over ``repeat_kv``'s copies, bit for bit, for masked
    multi-token queries over strided (pool-like) keys, several shapes and dtypes."""
    from transformers.integrations.sdpa_attention import repeat_kv

    gen = torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    shapes = [(1, 2, 2, 16, 2, 5), (3, 2, 4, 64, 5, 40), (2, 1, 8, 8, 17, 17), (8, 4, 2, 80, 3, 300)]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for reqs, kv, groups, dim, width, kv_len in shapes:
            q = torch.randn(reqs, kv * groups, width, dim, generator=gen).to(dtype)
            pool = torch.randn(2, reqs, kv_len + 3, kv, dim, generator=gen).to(dtype)
            k, v = (pool[i, :, :kv_len].transpose(1, 2) for i in (0, 1))  # [reqs, kv, kv_len, dim], strided
            mask = torch.zeros(reqs, 1, width, kv_len, dtype=dtype)
            mask.masked_fill_(torch.rand(reqs, 1, width, kv_len, generator=gen) < 0.3, float("-inf"))
            mask[..., 0] = 0
            want = sdpa(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=dim**-0.5)
            got = sdpa(q, k, v, attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
            assert torch.equal(got, want), (dtype, reqs, kv, groups, dim, width, kv_len)
