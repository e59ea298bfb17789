"""What a run is asked to do: requests (:class:`RequestSpec`), seeded workloads, and the
checks a scheduler runs on them once, before its first step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tfuture.grammars.base import Grammar, shared_vocab
from tfuture.sampling import SamplingParams

__all__ = ["RequestSpec", "default_params_row", "grammar_vocab", "random_workload", "spin"]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: id, arrival (in scheduler ticks), prompt ``[n]`` int64, length limit,
    grammar (False; True: the batcher's grammar; or a :class:`tfuture.grammars.Grammar` of its
    own) and sampling parameters (None: the sampler's defaults, greedy)."""

    rid: int
    arrival: int
    prompt: np.ndarray
    max_new: int
    grammar: bool | Grammar = False
    params: SamplingParams | None = None


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


def spin(seconds: float) -> None:
    """Busy host work that holds the GIL, like a Python scheduler's bookkeeping."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def grammar_vocab(specs: list[RequestSpec], grammar: Grammar | None) -> int | None:
    """The vocab every grammar of the run shares (None without grammars); raise on a mismatch."""
    named: dict[str, object] = {} if grammar is None else {"grammar": grammar}
    for s in specs:
        if s.grammar is True and grammar is None:
            raise ValueError(f"request {s.rid} asks for a grammar but no grammar was given")
        if not isinstance(s.grammar, bool):
            named[f"request {s.rid}'s grammar"] = s.grammar
    return shared_vocab(named)


def default_params_row(specs: list[RequestSpec]) -> np.ndarray | None:
    """The packed default SamplingParams row when any request has params, else None."""
    for s in specs:
        if s.params is not None and not isinstance(s.params, SamplingParams):
            got = type(s.params).__name__
            raise TypeError(f"request {s.rid}: params must be a SamplingParams or None, got {got}")
    return None if all(s.params is None for s in specs) else SamplingParams().pack()
