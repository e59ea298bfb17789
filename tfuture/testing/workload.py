"""Seeded test workloads (:func:`random_workload`) and host work that holds the GIL
(:func:`spin`). The request type itself is product code: :class:`tfuture.scheduler.RequestSpec`."""

from __future__ import annotations

import numpy as np

from tfuture.scheduler.batcher import spin
from tfuture.scheduler.request import RequestSpec

__all__ = ["RequestSpec", "random_workload", "spin"]


def random_workload(
    seed: int,
    n_requests: int,
    *,
    vocab: int = 64,
    max_prompt: int = 24,
    max_new: int = 24,
    arrival_span: int = 20,
    grammar_share: float = 0.0,
) -> list[RequestSpec]:
    """Seeded requests with random prompt lengths, limits and arrival ticks."""
    rng = np.random.default_rng(seed)
    specs = []
    for rid in range(n_requests):
        prompt = rng.integers(1, vocab, int(rng.integers(1, max_prompt + 1)), dtype=np.int64)
        specs.append(
            RequestSpec(
                rid,
                int(rng.integers(0, arrival_span + 1)),
                prompt,
                int(rng.integers(1, max_new + 1)),
                bool(rng.random() < grammar_share),
            )
        )
    return specs
