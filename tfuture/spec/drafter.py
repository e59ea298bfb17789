"""The drafter protocol: what proposes a speculative step's draft tokens, on the forward stream.

Under overlap the host schedules step N+1 before it has read step N's accepted tokens, so
drafting for step N+1 runs where step N's results are: on the device, in stream order, right
after step N's verification. A drafter sees every step's resolved inputs (:meth:`Drafter.observe`,
after the step's prepare) and each sampling request's committed tokens (:meth:`Drafter.draft`),
and returns ``k`` drafts per request. Its drafts are point masses (one proposed token each):
verification accepts draft ``x`` with probability ``p(x)`` (:mod:`tfuture.spec.verify`), so the
output follows the target's distribution whatever a drafter proposes, and greedy output equals
plain greedy decoding. A drafter that proposes badly only costs acceptance.

:class:`tfuture.NGramDrafter` (prompt lookup) and :class:`tfuture.ModelDrafter` (a small draft
model) implement it; an EAGLE-style head would too (its ``observe`` reads the target's hidden
states if the model exposes them).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch

__all__ = ["DraftContext", "Drafter"]


class DraftContext:
    """What a drafter gets after a step's verification (device tensors, host mirrors).

    ``req_ids [n]`` int64 host array: the sampling requests, in the step's order;
    ``committed [n, W]`` int64: each request's committed tokens this step (the first
    ``n_commit[i]``; -1 past them); ``n_commit [n]`` int64; ``seq_lens [n]`` int64: each
    request's sequence length after them (its committed tokens are at positions
    ``seq_lens - n_commit .. seq_lens - 1``); ``max_len``: a host bound on every ``seq_lens``.
    """

    __slots__ = ("committed", "max_len", "n_commit", "req_ids", "seq_lens")

    def __init__(
        self,
        req_ids: np.ndarray,
        committed: torch.Tensor,
        n_commit: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
    ) -> None:
        self.req_ids, self.committed, self.n_commit = req_ids, committed, n_commit
        self.seq_lens, self.max_len = seq_lens, max_len


@runtime_checkable
class Drafter(Protocol):
    """Proposes ``k`` draft tokens per request. Every method but :meth:`bind` runs on the
    forward stream, in step order (on CUDA: on the host thread, enqueueing device work; read
    no device value on the host there)."""

    #: Drafts per request and step (>= 1).
    k: int

    def bind(self, max_requests: int, max_len: int, device: torch.device) -> None:
        """HOST, once before the first step: live requests at once, positions per request."""
        ...

    def observe(self, fwd: ForwardBatch) -> None:
        """After a step's prepare: its resolved ``input_ids`` at their ``positions`` (the
        requests' prompts, last committed tokens and the drafts being verified)."""
        ...

    def draft(self, ctx: DraftContext) -> torch.Tensor:
        """After a step's verification: ``[n, k]`` int64 drafts, ids in ``[0, vocab)``, that
        continue each request's committed tokens."""
        ...

    def release(self, req_ids: np.ndarray) -> None:
        """Requests that ended (after their last step): free what they held."""
        ...

    def close(self) -> None:
        """HOST, after a run (the stream drained): free every request's state."""
        ...
