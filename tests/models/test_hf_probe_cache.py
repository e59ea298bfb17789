"""The construction probe runs once per model: wrapping the same model again (every
``tfuture.generate`` call wraps it) reuses its result while nothing the probe looked at changed,
and probes again when a layer is swapped or patched, the attention or ``max_len`` changes (a few
results are kept per model), or the last probe refused."""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tfuture import FutureMap
from tfuture.examples.hf import build_llama
from tfuture.models import HFCausalLM
from tfuture.models import hf_probe as hf_module
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, RequestSpec

PROMPT = np.arange(1, 7)


class _Forwards:
    """Counts the probes of ``model`` (a probe is one forward, and two more that compare the
    direct forward with the modules')."""

    def __init__(self, model: Any) -> None:
        self.n = 0
        self.model = model
        real = hf_module._probe

        def counted(m: Any, *args: Any) -> Any:
            self.n += m is self.model
            return real(m, *args)

        patcher = mock.patch.object(hf_module, "_probe", side_effect=counted)
        patcher.start()
        _PATCHES.append(patcher)


_PATCHES: list[Any] = []


@pytest.fixture(autouse=True)
def _stop_patches() -> Any:
    yield
    while _PATCHES:
        _PATCHES.pop().stop()


def _tokens(adapter: HFCausalLM, n: int = 4) -> list[int]:
    fmap = FutureMap(16, device="cpu")
    sched = ContinuousBatcher([RequestSpec(0, 0, PROMPT, n)], fmap, eos=-1, max_running=2)
    with torch.inference_mode():
        OverlapRuntime(adapter, fmap).run(sched)
    return sched.outputs[0]


def test_wrapping_the_same_model_again_skips_the_probe_and_decodes_the_same():
    model = build_llama()
    forwards = _Forwards(model)
    first = HFCausalLM(model, max_requests=2, max_len=16)
    assert forwards.n == 1
    want = _tokens(first)
    forwards.n = 0
    again = HFCausalLM(model, max_requests=2, max_len=16)
    assert forwards.n == 0
    assert again.pool.k.shape == first.pool.k.shape and again.pool.v.shape == first.pool.v.shape
    assert _tokens(again) == want


def test_a_swapped_or_patched_layer_another_max_len_or_attention_is_probed_again():
    model = build_llama()
    forwards = _Forwards(model)
    HFCausalLM(model, max_requests=2, max_len=16)
    HFCausalLM(model, max_requests=2, max_len=24)  # windows bind against max_len
    assert forwards.n == 2
    layers = model.model.layers
    layers[1] = copy.deepcopy(layers[1])
    HFCausalLM(model, max_requests=2, max_len=24)
    assert forwards.n == 3
    attn = layers[0].self_attn
    attn.forward = attn.forward  # an instance override, as a monkeypatch leaves it
    HFCausalLM(model, max_requests=2, max_len=24)
    assert forwards.n == 4
    HFCausalLM(model, max_requests=2, max_len=24)
    assert forwards.n == 4
    other = build_llama(attn="eager")
    counted = _Forwards(other)
    HFCausalLM(other, max_requests=2, max_len=24)
    HFCausalLM(other, max_requests=2, max_len=24)
    assert counted.n == 1


def test_alternating_max_len_finds_each_probe_kept():
    """Engines that alternate (with and without drafts: their max_len differs) each find their
    own probe; past a few per model the least recently used one is probed again."""
    model = build_llama()
    forwards = _Forwards(model)
    for _ in range(3):
        HFCausalLM(model, max_requests=2, max_len=16)
        HFCausalLM(model, max_requests=2, max_len=21)
    assert forwards.n == 2
    kept = hf_module._PROBED_PER_MODEL
    for max_len in range(30, 30 + kept - 2):  # the cache is full after these
        HFCausalLM(model, max_requests=2, max_len=max_len)
    assert forwards.n == kept
    HFCausalLM(model, max_requests=2, max_len=16)  # a hit: now the most recently used
    HFCausalLM(model, max_requests=2, max_len=99)  # a new one drops the least recently used: 21
    HFCausalLM(model, max_requests=2, max_len=16)
    assert forwards.n == kept + 1
    HFCausalLM(model, max_requests=2, max_len=21)
    assert forwards.n == kept + 2


def test_a_refusal_is_not_kept():
    model = build_llama()
    refused = TypeError("LlamaForCausalLM: planted refusal")
    with (
        mock.patch.object(hf_module, "_probe", side_effect=refused),
        pytest.raises(TypeError, match="planted refusal"),
    ):
        HFCausalLM(model, max_requests=2, max_len=16)
    forwards = _Forwards(model)
    HFCausalLM(model, max_requests=2, max_len=16)
    assert forwards.n == 1
