"""What a rank keeps per micro-batch, and its host-side checks (:mod:`tfuture.distributed.step`).

:class:`StageModel` is the model interface of a pipeline stage; :class:`MicroState` one launched
micro-batch (or bubble) from plan to delivery; :func:`plan_micro` stages a micro-batch's host
arrays as :class:`tfuture.steps.token.TokenStep` does; :func:`check_mask` takes a grammar mask
(bool or packed int32 bitmask, for the waiting rows) and widens it to every sampling row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tfuture.core.batch import Batch, ForwardBatch, HostMeta

__all__ = ["MicroState", "StageModel", "check_mask", "plan_micro"]

_EMPTY = np.zeros(0, dtype=np.int64)
_BITS = torch.arange(32, dtype=torch.int32)


class StageModel(Protocol):
    """One rank's part of the model.

    ``forward(batch, hidden)``: ``hidden`` is None on the first stage, else the previous stage's
    output ``[n_tokens, hidden_size]`` of ``hidden_dtype``. A stage before the last returns its
    own ``[n_tokens, hidden_size]`` output; the last stage returns logits for
    ``batch.sample_rows`` (``[n_sample, vocab]``). ``sample`` runs on the last stage's tensor
    rank 0 only and returns ``[n_sample]`` int token ids (``mask``: bool ``[n_sample, vocab]``
    or None). Optional, as for a :class:`tfuture.core.batch.Model`: ``release(req_ids)`` and
    ``close()``.
    """

    hidden_size: int
    hidden_dtype: torch.dtype

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None) -> torch.Tensor: ...

    def sample(
        self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None
    ) -> torch.Tensor: ...


@dataclass(slots=True, eq=False)
class MicroState:
    """One launched micro-batch (or bubble, ``micro`` None) on this rank, from plan to delivery."""

    micro: Batch | None
    group: int
    sample_reqs: np.ndarray
    host: HostMeta | None
    ended: np.ndarray
    n_tok: int
    mask_rows: np.ndarray  # indices into sample_reqs of the rows a delayed sample waits for
    step: int = -1
    fwd: ForwardBatch | None = None
    hidden_in: torch.Tensor | None = None
    out: torch.Tensor | None = None  # hidden state (not last stage) or logits (last stage)
    sampled: torch.Tensor | None = None  # last stage: this micro-batch's tokens, int64
    mask: torch.Tensor | None = None
    mask_packed: bool = False  # the scheduler sent a packed bitmask (unpacked to 32 bits a word)
    mask_ready: Any = None
    delivers: MicroState | None = None  # the micro-batch whose tokens this step stores
    delivered: torch.Tensor | None = None  # those tokens, int64 [n_out]

    @property
    def n_sample(self) -> int:
        return int(self.sample_reqs.size)


def bubble() -> tuple[MicroState, tuple[np.ndarray, ...]]:
    """An empty micro-batch: it forwards nothing, but its step still delivers tokens."""
    state = MicroState(None, -1, _EMPTY, None, _EMPTY, 0, _EMPTY)
    return state, (_EMPTY, np.zeros(1, dtype=np.int64), _EMPTY, _EMPTY, _EMPTY, _EMPTY)


def is_delayed(micro: Batch) -> bool:
    """Whether any sampling request of ``micro`` waits for a mask (``Batch.delayed`` bool or array)."""
    d = micro.delayed
    if isinstance(d, np.ndarray):
        return bool(d[micro.sample].any())
    return bool(d)


def plan_micro(micro: Batch, group: int) -> tuple[MicroState, tuple[np.ndarray, ...]]:
    """The state and host arrays of a micro-batch (staged as :class:`TokenStep` stages them)."""
    if getattr(micro, "sampling", None) is not None:
        raise ValueError(
            "Batch.sampling needs tfuture's sampler; a ParallelRuntime samples with the last stage's "
            "own sample (on tensor rank 0): leave Batch.sampling None"
        )
    sample_reqs = np.flatnonzero(micro.sample)
    n_reqs, n_tok = micro.n_reqs, int(micro.tokens.size)
    seg_starts = np.zeros(n_reqs + 1, dtype=np.int64)
    np.cumsum(micro.seg_lens, out=seg_starts[1:])
    lens = micro.prefix_lens + micro.seg_lens
    max_seg = int(micro.seg_lens.max()) if n_reqs else 0
    host = HostMeta(micro.seg_lens, micro.prefix_lens, micro.req_ids, sample_reqs, n_tok, max_seg)
    d = micro.delayed
    rows = np.arange(sample_reqs.size, dtype=np.int64)
    mask_rows = np.flatnonzero(d[sample_reqs]) if isinstance(d, np.ndarray) else rows
    state = MicroState(micro, group, sample_reqs, host, micro.ended, n_tok, mask_rows)
    return state, (micro.tokens, seg_starts, micro.prefix_lens, micro.req_ids, lens, sample_reqs)


def _check_rows(t: torch.Tensor, state: MicroState, step: int, vocab: int) -> None:
    """On the host (a CPU mask): every waiting row allows one of the first ``vocab`` tokens."""
    if t.is_cuda or not state.mask_rows.size:
        return
    rows = t if t.shape[0] == state.mask_rows.size else t[torch.from_numpy(state.mask_rows)]
    empty = np.flatnonzero(~rows[:, :vocab].any(dim=1).numpy())
    if empty.size:
        rid = int(state.host.req_ids[state.sample_reqs[state.mask_rows[empty[0]]]]) if state.host else -1
        raise ValueError(
            f"build_mask of step {step}: the mask row of request {rid} allows no token of the "
            f"vocab of {vocab}"
        )


def check_mask_width(state: MicroState, vocab: int, step: int) -> None:
    """On the stream, once the logits give ``vocab``: the mask has its exact width (``vocab``
    columns, or ``ceil(vocab / 32)`` words when packed) and no waiting row allows only tokens
    past ``vocab`` (padding bits)."""
    mask = state.mask
    assert mask is not None
    want = 32 * -(-vocab // 32) if state.mask_packed else vocab
    if mask.shape[1] != want:
        what = f"ceil({vocab} / 32) words" if state.mask_packed else f"{vocab} columns"
        got = mask.shape[1] // 32 if state.mask_packed else mask.shape[1]
        raise ValueError(
            f"build_mask of step {step}: the mask must have {what} (the logits' vocab), got {got}"
        )
    _check_rows(mask, state, step, vocab)


def check_mask(mask: object, state: MicroState, step: int) -> torch.Tensor:
    """``mask`` for ``state``'s waiting rows (bool ``[m, vocab]`` or packed int32
    ``[m, ceil(vocab / 32)]``: bit ``j`` of word ``w`` allows token ``32 w + j``) as a bool
    ``[n_sample, width]`` tensor whose other rows allow every token; every waiting row must
    allow a token (checked on the host for a CPU mask)."""
    t = torch.as_tensor(mask)
    m = state.mask_rows.size
    if t.dim() != 2 or t.shape[0] != m or t.dtype not in (torch.bool, torch.int32):
        raise ValueError(
            f"build_mask must return a bool [{m}, vocab] mask or an int32 [{m}, ceil(vocab / 32)] bitmask "
            f"for the {m} waiting sampling rows, got {t.dtype} of shape {tuple(t.shape)}"
        )
    state.mask_packed = t.dtype == torch.int32
    if state.mask_packed:
        bits = _BITS if t.device.type == "cpu" else _BITS.to(t.device)
        t = ((t[:, :, None] >> bits) & 1).bool().reshape(m, -1)
    _check_rows(t, state, step, t.shape[1])  # early; again with the vocab once it is known
    if m == state.n_sample:
        return t
    full = torch.ones(state.n_sample, t.shape[1], dtype=torch.bool, device=t.device)
    full[torch.from_numpy(state.mask_rows).to(t.device)] = t
    return full
