"""The construction probe runs once per model: wrapping the same model again (every
``tfuture.generate`` call wraps it) reuses its result while nothing the probe looked at changed,
whatever ``max_len`` (prompts of another length), and probes again when a layer is swapped or
patched, the attention changes (a few results are kept per model), or the last probe refused.
The attention calls' windows are checked against every ``max_len``, probed or not."""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tiny_hf import tiny

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


def test_a_swapped_or_patched_layer_or_another_attention_is_probed_again_another_max_len_is_not():
    model = build_llama()
    forwards = _Forwards(model)
    HFCausalLM(model, max_requests=2, max_len=16)
    for max_len in (24, 17, 300):  # the probe's calls do not depend on max_len
        HFCausalLM(model, max_requests=2, max_len=max_len)
    assert forwards.n == 1
    layers = model.model.layers
    layers[1] = copy.deepcopy(layers[1])
    HFCausalLM(model, max_requests=2, max_len=24)
    assert forwards.n == 2
    attn = layers[0].self_attn
    attn.forward = attn.forward  # an instance override, as a monkeypatch leaves it
    HFCausalLM(model, max_requests=2, max_len=24)
    assert forwards.n == 3
    HFCausalLM(model, max_requests=2, max_len=24)
    assert forwards.n == 3
    other = build_llama(attn="eager")
    counted = _Forwards(other)
    HFCausalLM(other, max_requests=2, max_len=24)
    HFCausalLM(other, max_requests=2, max_len=24)
    assert counted.n == 1


def test_prompts_of_another_length_through_generate_reuse_the_probe_and_decode_as_fresh():
    """Every ``tfuture.generate`` call wraps the model at its own ``max_len`` (prompt + max_tokens):
    the later calls reuse the first call's probe and give the tokens of a model never wrapped."""
    import tfuture
    from tfuture.scheduler import GenerationParams

    params = GenerationParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1, 1 + n)) for n in (4, 9, 6)]
    model = build_llama()
    forwards = _Forwards(model)
    got = [list(tfuture.generate(model, [p], params, progress=False)[0].token_ids) for p in prompts]
    assert forwards.n == 1
    for p, tokens in zip(prompts, got, strict=True):
        fresh = copy.deepcopy(model)  # another model object: its own probe
        assert list(tfuture.generate(fresh, [p], params, progress=False)[0].token_ids) == tokens


def test_the_windows_are_checked_at_every_max_len_on_a_kept_probe():
    """A kept probe's attention calls are checked against the config's windows at the new
    ``max_len``: a layer whose attention call carries a window its config does not give (here
    the config's reading patched to say full attention) passes where that window never binds
    (``max_len`` 4) and is refused where it would (32), though no forward runs again."""
    model = tiny("MistralConfig", sliding_window=4)
    forwards = _Forwards(model)
    with mock.patch("tfuture.models.hf.layer_windows", return_value=(None, None)):
        assert HFCausalLM(model, max_requests=2, max_len=4).pool.windows == (None, None)
        assert forwards.n == 1
        before = model.config._attn_implementation
        with pytest.raises(
            ValueError, match=r"layer 0 attends with sliding_window=4, its config gives it full attention"
        ):
            HFCausalLM(model, max_requests=2, max_len=32)
    assert forwards.n == 1
    assert model.config._attn_implementation == before  # refused: left as it was


def test_a_config_window_changed_since_the_probe_is_probed_again():
    """The attention calls carry the window the module read from its config during the probe:
    a window switched off (or changed) in the config since is probed again, not refused on the
    old calls; a max_len that keeps the config's windows reuses the probe."""
    model = tiny("MistralConfig", sliding_window=4)
    forwards = _Forwards(model)
    assert HFCausalLM(model, max_requests=2, max_len=32).pool.windows == (4, 4)
    assert HFCausalLM(model, max_requests=2, max_len=24).pool.windows == (4, 4)
    assert forwards.n == 1
    model.config.sliding_window = None  # the user turns the window off
    assert HFCausalLM(model, max_requests=2, max_len=32).pool.windows == (None, None)
    assert forwards.n == 2


def test_past_a_few_kept_probes_the_least_recently_used_is_probed_again():
    """Each instance ``forward`` override (a new bound method: another key, as a monkeypatch
    makes one); past ``_PROBED_PER_MODEL`` of them the least recently used one is dropped."""
    model = build_llama()
    forwards = _Forwards(model)
    attn = model.model.layers[1].self_attn
    versions = [attn.forward for _ in range(hf_module._PROBED_PER_MODEL + 1)]  # distinct objects

    def wrap(i: int) -> None:
        attn.forward = versions[i]  # kept alive in versions: ids are not reused
        HFCausalLM(model, max_requests=2, max_len=16)

    for _ in range(3):
        wrap(0)
        wrap(1)
    assert forwards.n == 2
    kept = hf_module._PROBED_PER_MODEL
    for i in range(2, kept):  # the cache is full after these
        wrap(i)
    assert forwards.n == kept
    wrap(0)  # a hit: now the most recently used
    wrap(kept)  # a new one drops the least recently used: version 1
    wrap(0)
    assert forwards.n == kept + 1
    wrap(1)
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
