"""A pipeline stage's model interface, :class:`StageModel`, and what a rank keeps per
micro-batch, :class:`MicroState` (a token step's record plus the pipe's fields)."""

from __future__ import annotations

from typing import Protocol

import torch

from tfuture.core.batch import Batch, ForwardBatch
from tfuture.steps.token import TokenState

__all__ = ["MicroState", "StageModel"]


class StageModel(Protocol):
    """One rank's part of the model.

    ``forward(batch, hidden)``: ``hidden`` is None on the first stage, else the previous stage's
    output ``[n_rows, hidden_size]`` of ``hidden_dtype`` (``n_rows``: the step's token rows,
    padded to the bucket with ``buckets=``). A stage before the last returns its own
    ``[n_rows, hidden_size]`` output; the last stage returns logits for ``batch.sample_rows``
    (``[n_sample, vocab]``). Sampling runs on the last stage's tensor rank 0 only: with
    tfuture's :class:`tfuture.sampling.Sampler` (the default without a ``sample`` method) or the
    model's own ``sample(logits, batch, mask)`` (``[n_sample]`` int token ids; ``mask`` bool
    ``[n_sample, vocab]`` or None). Optional, as for a :class:`tfuture.core.batch.Model`:
    ``release(req_ids)`` and ``close()``.
    """

    hidden_size: int
    hidden_dtype: torch.dtype

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None) -> torch.Tensor: ...


class MicroState(TokenState):
    """One launched micro-batch (or bubble, ``micro`` None) on this rank, from plan to delivery."""

    micro: Batch | None = None
    group: int = -1
    step: int = -1
    hidden_in: torch.Tensor | None = None
    hidden_out: torch.Tensor | None = None  # a stage before the last: its forward's output
    n_own: int = 0  # the slots its own tokens take when a later step delivers them
    delivers: MicroState | None = None  # the micro-batch whose tokens this step stores
    delivered: torch.Tensor | None = None  # those tokens, int64 [n_out]
