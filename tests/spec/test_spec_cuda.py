"""Speculative and multi-step decoding with a Hugging Face model and its FutureMap on CUDA.

The CPU suite runs every speculative path on CPU maps; these run the front door on a CUDA
model (float64, so that a verification forward of several tokens and a decode of one cannot
round an argmax apart) and compare with plain decoding on the same device."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import tfuture
from tfuture.examples.hf import build_llama
from tfuture.scheduler import GenerationParams
from tfuture.spec import ModelDrafter, NGramDrafter

pytestmark = pytest.mark.gpu

VOCAB = 96
# Prompts that quote themselves (prompt lookup hits) and one that does not.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 11, 12, 13, 11], [40, 3, 77, 21, 9]]


def model_on_cuda() -> torch.nn.Module:
    return build_llama(vocab=VOCAB, hidden=64, layers=2, seed=0).to(device="cuda", dtype=torch.float64)


def ids(out: tfuture.GenerateResult) -> list[list[int]]:
    return [list(r.token_ids) for r in out]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_speculative_greedy_on_cuda_equals_plain(overlap: bool) -> None:
    model = model_on_cuda()
    params = GenerationParams(max_tokens=24, temperature=0)
    plain = tfuture.generate(model, PROMPTS, params, overlap=overlap)
    for drafter in (NGramDrafter(k=4), ModelDrafter(copy.deepcopy(model), k=4)):
        got = tfuture.generate(model, PROMPTS, params, overlap=overlap, speculative=drafter)
        assert ids(got) == ids(plain), drafter
        assert got.drafted > 0 and 0 < got.accepted <= got.drafted
    twin = tfuture.generate(
        model, PROMPTS, params, overlap=overlap, speculative=ModelDrafter(copy.deepcopy(model), k=4)
    )
    assert twin.accepted == twin.drafted  # an exact copy of the target: every draft accepted


@pytest.mark.parametrize("k", [2, 4])
def test_multi_step_on_cuda_equals_plain(k: int) -> None:
    model = model_on_cuda()
    params = GenerationParams(max_tokens=21, temperature=0, stop_token_ids=[17])
    plain = tfuture.generate(model, PROMPTS, params)
    assert ids(tfuture.generate(model, PROMPTS, params, multi_step=k)) == ids(plain)


def test_seeded_speculative_sampling_on_cuda_reproduces_in_sync() -> None:
    model = model_on_cuda()
    params = GenerationParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    runs = [
        ids(tfuture.generate(model, PROMPTS, params, overlap=overlap, speculative=NGramDrafter(k=3)))
        for overlap in (True, False)
    ]
    assert runs[0] == runs[1]
