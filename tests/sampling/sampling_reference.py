"""A plain host reference of the sampling rule (numpy, float64), and a step driver for Sampler.

``reference_token`` is the rule of ``tfuture.sampling.Sampler`` written per request with a python
token list and prompt: penalties from the request's own history, then greedy argmax or the
filtered inverse-CDF draw with ``uniform_draws(seed, position)``. ``run_step`` drives one step
through the Sampler the way the runtime does (prepare, observe, sample, record).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch

from tfuture.sampling import GREEDY_BELOW, Sampler, SamplerPlan, SamplingParams, uniform_draws


def penalise(
    x: np.ndarray, p: SamplingParams, seen: Iterable[int], outputs: list[int], dtype: type = np.float64
) -> np.ndarray:
    """vLLM's penalties in ``dtype``: repetition over ``seen``, then frequency and presence over
    the ``outputs`` counts (the sampler's operations, in its order)."""
    x = x.astype(dtype)
    if p.repetition_penalty != 1:
        r = dtype(p.repetition_penalty)
        for t in set(seen):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    f, pres = dtype(p.frequency_penalty), dtype(p.presence_penalty)
    for t, c in Counter(outputs).items():
        x[t] = x[t] - f * dtype(c) - pres * dtype(c > 0)
    return x


def filtered_probs(x: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(order, kept probabilities in that order) of a non-greedy row: the sampler's filters."""
    x = x / p.temperature
    order = np.argsort(-x, kind="stable")
    s = x[order]
    e = np.exp(s - s[0])
    probs = e / e.sum()
    if p.top_k > 0:
        probs[p.top_k :] = 0
    if p.top_p < 1:
        c = np.cumsum(probs)
        probs[c - probs >= p.top_p * c[-1]] = 0
    if p.min_p > 0:
        probs[probs < p.min_p * probs[0]] = 0
    return order, probs


def reference_token(x: np.ndarray, p: SamplingParams, position: int) -> int:
    """The token for penalised float64 logits ``x`` at sequence ``position``."""
    if p.temperature < GREEDY_BELOW or p.top_k == 1:
        return int(np.argmax(x))
    order, probs = filtered_probs(x, p)
    c = np.cumsum(probs)
    total = c[-1]
    u = float(uniform_draws(np.array([p.seed]), np.array([position]))[0])
    target = min(u * total, np.nextafter(total, 0.0))
    j = min(int(np.searchsorted(c, target, side="right")), x.size - 1)
    return int(order[j])


def run_step(
    sampler: Sampler,
    plan: SamplerPlan,
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    split: int | None = None,
) -> torch.Tensor:
    """prepare, observe, sample (in two parts with ``rows`` when ``split`` is given), record."""
    state = sampler.prepare(plan, torch.from_numpy(plan.words.copy()).to(logits.device))
    sampler.observe(state, input_ids)
    if plan.n_sample == 0:  # a step of prefill chunks only: the runtime may not call sample
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if split is None:
        tokens = sampler.sample(state, logits)
    else:
        n = logits.shape[0]
        first = torch.arange(0, split, device=logits.device)
        rest = torch.arange(split, n, device=logits.device)
        tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
        # The later rows first: order among parts must not matter.
        tokens[rest] = sampler.sample(state, logits[rest], rows=rest)
        tokens[first] = sampler.sample(state, logits[first], rows=first)
    sampler.record(state, tokens)
    return tokens
