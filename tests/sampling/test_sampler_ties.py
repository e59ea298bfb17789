"""Exact ties at the top-p cut, and a bitmask never written into the caller's logits.

Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``: a token whose
preceding mass already equals ``top_p`` exactly is cut. With equal logits the masses are exact
binary fractions, so the tie is exact in float32. Every row of a step has its own seed, so one
step checks many draws.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfuture.kernels.bitmask import pack_bool_mask
from tfuture.sampling import Sampler, SamplingParams, pack_params

EMPTY = np.empty(0, dtype=np.int64)
N_ROWS = 400


def sample_rows(params: SamplingParams, logits_row: list[float], bitmask: torch.Tensor | None = None):
    """One decode step of ``N_ROWS`` requests with ``params``, one seed each, the same logits."""
    n = N_ROWS
    table = np.tile(params.pack(), (n, 1))
    table[:, 7] = np.arange(n)  # the seed word: one seed per row
    s = Sampler()
    ones, rows = np.ones(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    plan = s.plan(table, rows, ones, 4 * ones, rows, EMPTY, 0)
    state = s.prepare(plan, torch.from_numpy(plan.words.copy()))
    logits = torch.tensor(logits_row, dtype=torch.float32).expand(n, -1).contiguous()
    return s.sample(state, logits, bitmask=bitmask)


def test_top_p_half_of_two_equal_tokens_keeps_only_the_first():
    # sorted p = [0.5, 0.5]: token 1's preceding mass 0.5 equals top_p, so it is cut.
    tokens = sample_rows(SamplingParams(temperature=1.0, top_p=0.5, seed=0), [0.0, 0.0])
    assert set(tokens.tolist()) == {0}


def test_top_p_three_quarters_of_four_equal_tokens_never_draws_the_last():
    tokens = sample_rows(SamplingParams(temperature=1.0, top_p=0.75, seed=0), [0.0, 0.0, 0.0, 0.0])
    counts = np.bincount(tokens.numpy(), minlength=4)
    assert counts[3] == 0, counts
    assert (counts[:3] > N_ROWS // 6).all(), counts  # the three kept tokens are all drawn


def test_top_p_just_above_a_tie_keeps_the_next_token():
    tokens = sample_rows(SamplingParams(temperature=1.0, top_p=0.5000001, seed=0), [0.0, 0.0])
    assert set(tokens.tolist()) == {0, 1}


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=1.0, seed=3)],
    ids=["greedy", "sampled"],
)
def test_a_bitmask_is_not_applied_to_the_callers_logits(params):
    n, vocab = 3, 40
    allow = torch.zeros(n, vocab, dtype=torch.bool)
    allow[:, 5] = allow[:, 17] = True
    bitmask = pack_bool_mask(allow)
    s = Sampler()
    rows = np.arange(n, dtype=np.int64)
    plan = s.plan(pack_params([params] * n), rows, np.ones(n, dtype=np.int64), rows + 2, rows, EMPTY, 0)
    state = s.prepare(plan, torch.from_numpy(plan.words.copy()))
    logits = torch.randn(n, vocab, dtype=torch.float32)
    before = logits.clone()
    tokens = s.sample(state, logits, bitmask=bitmask)
    assert set(tokens.tolist()) <= {5, 17}
    assert torch.equal(logits, before)
