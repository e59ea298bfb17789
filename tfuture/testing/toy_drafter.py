"""A seeded, fallible draft model for :class:`tfuture.testing.ToyModel`, for speculative tests.

:class:`ToyDrafter` implements :class:`tfuture.spec.Drafter`: after a step's verification it
chains the target's own greedy function ``k`` times from each request's last committed token, on
the stream and with no host read of a device value, and makes a draft wrong (the target's token
+ 1) where a seeded hash of (request, position, ``seed``) falls under ``error_rate``. The drafts
depend only on the committed tokens, never on the schedule or the backend, so sync and
overlapped runs draft alike. Greedy speculative decoding with it must equal plain greedy
decoding of the target, whatever ``error_rate``; ``0.0`` has every draft accepted and ``1.0``
none (the first draft is always wrong then).
"""

from __future__ import annotations

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch
from tfuture.spec.drafter import DraftContext
from tfuture.testing.toy import ToyModel

__all__ = ["ToyDrafter"]

_P = 2_147_483_647
_SCALE = 1 << 20


def _hash(*xs: torch.Tensor | int) -> torch.Tensor:
    """A deterministic int64 hash in ``[0, 2**31 - 1)`` of integer tensors (no int64 overflow)."""
    h = torch.zeros((), dtype=torch.int64)
    for x in xs:
        h = ((h * 1_103_515_245 + torch.as_tensor(x, dtype=torch.int64) % _P) * 69_069 + 12_345) % _P
    return h


class ToyDrafter:
    """Drafts ``target``'s greedy continuation, each draft wrong with probability ``error_rate``
    (see the module docstring). ``k >= 1`` drafts per request and step."""

    def __init__(self, target: ToyModel, k: int = 2, error_rate: float = 0.3, seed: int = 0) -> None:
        if type(k) is not int or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate!r}")
        self.target, self.k, self.error_rate, self.seed = target, k, error_rate, seed
        self.device = torch.device("cpu")
        self.calls = 0

    def bind(self, max_requests: int, max_len: int, device: torch.device) -> None:
        self.device = torch.device(device)

    def observe(self, fwd: ForwardBatch) -> None:
        """Nothing to keep: the target's next token depends on the last one only."""

    def draft(self, ctx: DraftContext) -> torch.Tensor:
        self.calls += 1
        n = len(ctx.req_ids)
        dev = ctx.committed.device
        rid = torch.from_numpy(np.ascontiguousarray(ctx.req_ids, dtype=np.int64)).to(dev)
        last = ctx.committed.gather(1, (ctx.n_commit.to(torch.int64) - 1).clamp(min=0)[:, None])[:, 0]
        pos = ctx.seq_lens.to(torch.int64) - 1  # the last committed token's position
        out = torch.empty(n, self.k, dtype=torch.int64, device=dev)
        threshold = int(self.error_rate * _SCALE)
        tok = last
        for j in range(self.k):
            tok = self.target.scores(tok, pos + j, rid).argmax(dim=-1)
            wrong = _hash(rid, pos + j + 1, self.seed) % _SCALE < threshold
            out[:, j] = torch.where(wrong, (tok + 1) % self.target.vocab, tok)
        return out

    def release(self, req_ids: np.ndarray) -> None:
        """Nothing held per request."""

    def close(self) -> None:
        """Nothing held per run."""
