"""The device token history behind the penalties, updated on the forward stream.

Two tables of ``rows + 2`` rows by the vocab: ``counts`` (int32, how often each token was
sampled for the request) and ``seen`` (bool, the token occurred in the request's inputs or
outputs). Row 0 is all zero and never written (the row of requests without penalties, so every
sampling row can take the same ops); row ``rows + 1`` takes marks that went stale before the
tables existed and is never read. The tables are made once the vocab is known (the first
logits, or ``Sampler(vocab_size=)``); ``seen`` marks made before are kept until then. Which
request owns which row is the host's business (a :class:`tfuture.core.rows.RowAllocator`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from tfuture.sampling.plan import R_FREQ, R_PRES, R_REP, SamplerPlan

__all__ = ["TokenHistory", "apply_penalties"]


def apply_penalties(
    x: torch.Tensor,
    seen: torch.Tensor | None,
    counts: torch.Tensor | None,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Out of place: the repetition penalty (``seen [m, V]`` bool, None: off), then frequency and
    presence (``counts [m, V]``, None: off), with per-row ``[m]`` float factors. A seen token's
    logit is divided by ``repetition`` when positive, multiplied when not; then
    ``x - frequency * count - presence * (count > 0)``."""
    if seen is not None:
        r = repetition.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if counts is not None:
        c = counts.to(x.dtype)
        x = x - frequency.unsqueeze(1) * c - presence.unsqueeze(1) * (c > 0)
    return x


class _Pending(NamedTuple):
    """``seen`` marks observed before the tables existed (vocab unknown until the first logits)."""

    host_rows: np.ndarray
    rows: torch.Tensor
    tokens: torch.Tensor


class TokenHistory:
    """``counts`` and ``seen`` of ``rows`` requests on one device (forward stream only)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self._ones: torch.Tensor | None = None
        self._true: torch.Tensor | None = None
        self._pending: list[_Pending] = []

    def ensure(self, vocab: int | None, device: torch.device) -> None:
        """Make the tables once ``vocab`` is known (replaying earlier marks); a later call on
        another device raises ``ValueError``."""
        if self.counts is not None:
            if self.counts.device != device:
                raise ValueError(
                    f"this Sampler's history lives on {self.counts.device}, got a tensor on {device}"
                )
            return
        if vocab is None or not self.rows:
            return
        shape = (self.rows + 2, vocab)
        self.counts = torch.zeros(shape, dtype=torch.int32, device=device)
        self.seen = torch.zeros(shape, dtype=torch.bool, device=device)
        self._ones = torch.ones(self.rows + 1, dtype=torch.int32, device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)
        for p in self._pending:
            self.seen.index_put_((p.rows, p.tokens), self._true)
        self._pending = []

    def zero(self, host_new: np.ndarray, new: torch.Tensor) -> None:
        """Clear rows ``new`` (the device copy of ``host_new``), newly assigned to requests."""
        if self.counts is not None and self.seen is not None:
            self.counts.index_fill_(0, new, 0)
            self.seen.index_fill_(0, new, False)
            return
        # Rows reassigned before the tables exist: their earlier marks go to the trash row.
        trash = self.rows + 1
        for i, p in enumerate(self._pending):
            stale = np.isin(p.host_rows, host_new)
            if stale.any():
                rows = torch.where(torch.isin(p.rows, new), trash, p.rows)
                self._pending[i] = _Pending(np.where(stale, trash, p.host_rows), rows, p.tokens)

    def mark_seen(self, host_rows: np.ndarray, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """``seen[rows[i], tokens[i]] = True`` (int64 ``tokens``), now or once the tables exist."""
        if self.seen is None:
            self._pending.append(_Pending(host_rows, rows, tokens))
            return
        assert self._true is not None
        self.seen.index_put_((rows, tokens), self._true)

    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add sampled ``tokens`` (int64) to the outputs of ``rows``: counts and seen."""
        if self.counts is None or self.seen is None or self._ones is None or self._true is None:
            raise RuntimeError("Sampler.record before any sample: the history tables do not exist yet")
        n = rows.numel()
        ones = self._ones[:n] if n <= self._ones.numel() else self._ones.new_ones(n)
        self.counts.index_put_((rows, tokens), ones, accumulate=True)
        self.seen.index_put_((rows, tokens), self._true)

    def penalise(
        self, x: torch.Tensor, floats: torch.Tensor, hist: torch.Tensor, plan: SamplerPlan
    ) -> torch.Tensor:
        """Repetition, then frequency and presence, for rows with history rows ``hist``; out of
        place (``x`` may be the caller's)."""
        assert self.counts is not None and self.seen is not None
        seen = self.seen.index_select(0, hist) if plan.repetition else None
        counts = self.counts.index_select(0, hist) if plan.counts else None
        return apply_penalties(x, seen, counts, floats[R_REP], floats[R_FREQ], floats[R_PRES])

    def forget_pending(self) -> None:
        """Drop marks kept for tables not made yet (their requests' run ended)."""
        self._pending = []
