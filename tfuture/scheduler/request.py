"""What a scheduler is asked to do: requests (:class:`RequestSpec`) and the checks
:class:`tfuture.scheduler.ContinuousBatcher` runs on them once, before its first step."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

import numpy as np

from tfuture.core.params import SamplingParams
from tfuture.grammars.base import Grammar, shared_vocab

__all__ = ["RequestSpec", "check_params", "grammar_vocab"]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: id, arrival (in scheduler ticks), prompt ``[n]`` int64, length limit,
    grammar (False; True: the batcher's grammar; or a :class:`tfuture.grammars.Grammar` of its
    own), sampling parameters (None: the sampler's defaults, greedy) and stop token ids (None:
    the batcher's ``eos``; an empty collection: stop only at the length limit or the grammar's
    end), kept as a frozenset; ``drafts``: False makes it decode plainly under a speculative
    scheduler (``ContinuousBatcher(speculative=k)``)."""

    rid: int
    arrival: int
    prompt: np.ndarray
    max_new: int
    grammar: bool | Grammar = False
    params: SamplingParams | None = None
    stop: Collection[int] | None = None
    drafts: bool = True  # a speculative scheduler's drafts for it (False: plain decoding)

    def __post_init__(self) -> None:
        for name in ("rid", "arrival", "max_new"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise TypeError(f"RequestSpec.{name} must be an int, got {type(v).__name__} {v!r}")
        if self.max_new < 1:
            raise ValueError(
                f"request {self.rid}: max_new must be >= 1 (tokens to generate), got {self.max_new}"
            )
        p = self.prompt
        if isinstance(p, list | tuple):
            p = np.asarray(p, dtype=np.int64) if len(p) else np.empty(0, dtype=np.int64)
        if not isinstance(p, np.ndarray) or p.ndim != 1 or (p.size and p.dtype.kind not in "iu"):
            got = f"{p.dtype} array of shape {p.shape}" if isinstance(p, np.ndarray) else type(p).__name__
            raise TypeError(f"request {self.rid}: prompt must be a 1-D integer array or list, got {got}")
        if not p.size:
            raise ValueError(f"request {self.rid}: the prompt is empty (a request needs at least one token)")
        if int(p.min()) < 0:
            raise ValueError(f"request {self.rid}: prompt token ids must be >= 0, got {int(p.min())}")
        object.__setattr__(self, "prompt", p.astype(np.int64, copy=False))
        if self.stop is not None:
            object.__setattr__(self, "stop", _stop_set(self.rid, self.stop))


def _stop_set(rid: int, stop: object) -> frozenset[int]:
    if isinstance(stop, str | bytes) or not isinstance(stop, Iterable):
        raise TypeError(f"request {rid}: stop must be a collection of token ids or None, got {stop!r}")
    ids = list(stop)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 0:
            raise ValueError(f"request {rid}: stop token ids must be ints >= 0, got {t!r}")
    return frozenset(int(t) for t in ids)


def grammar_vocab(specs: list[RequestSpec], grammar: Grammar | None) -> int | None:
    """The vocab every grammar of the run shares (None without grammars); raise on a mismatch."""
    named: dict[str, object] = {} if grammar is None else {"grammar": grammar}
    for s in specs:
        if s.grammar is True and grammar is None:
            raise ValueError(f"request {s.rid} asks for a grammar but no grammar was given")
        if not isinstance(s.grammar, bool):
            named[f"request {s.rid}'s grammar"] = s.grammar
    return shared_vocab(named)


def check_params(specs: list[RequestSpec]) -> None:
    """Raise ``TypeError`` unless every request's ``params`` is a SamplingParams or None."""
    for s in specs:
        if s.params is not None and not isinstance(s.params, SamplingParams):
            got = type(s.params).__name__
            raise TypeError(f"request {s.rid}: params must be a SamplingParams or None, got {got}")
