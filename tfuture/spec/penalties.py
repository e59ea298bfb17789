"""Penalties in a speculative step: each verification row sees the history its token would have.

Row ``j`` of a request that verifies drafts ``d_1..d_v`` scores the token after ``d_1..d_j``:
its penalties count the request's committed tokens (the Sampler's device history, current in
stream order) plus ``d_1..d_j``, as plain decoding would have counted them had they been
sampled. After verification only the committed tokens go into the history (counts and seen);
drafts are never observed as inputs, so a rejected draft leaves no trace. The penalty formula is
the Sampler's own (:func:`tfuture.sampling.history.apply_penalties`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from tfuture.core.params import FREQUENCY, N_FLOATS, PRESENCE, REPETITION
from tfuture.sampling.history import TokenHistory, apply_penalties
from tfuture.sampling.plan import SamplerPlan

__all__ = ["PenaltyPlan", "drop_observations", "penalise_rows", "plan_penalties", "record_committed"]

_OBS_IDX, _OBS_ROWS = 3, 4  # parts of SamplerPlan.words


class PenaltyPlan(NamedTuple):
    """Host side: ``words`` (int64: the rows' history rows ``[R]``, their repetition, frequency
    and presence factors ``[3 * R]`` as float64 bits, then the draft pairs ``[2 * P]``: row ``r``
    counts the draft at token row ``src``), and which penalties any row has."""

    words: np.ndarray
    n_rows: int
    n_pairs: int
    repetition: bool
    counts: bool


def plan_penalties(
    packed: np.ndarray, hist: np.ndarray, first_row: np.ndarray, j: np.ndarray
) -> PenaltyPlan | None:
    """The penalties of ``R`` verification rows, or None when no row has any.

    Args:
        packed: ``[R, PARAM_WORDS]`` each row's request's packed parameters.
        hist: ``[R]`` each row's history row (0: none).
        first_row, j: ``[R]`` each row's request's first verification row (a token row) and
            the row's index among its request's rows.
    """
    fs = np.ascontiguousarray(packed[:, :N_FLOATS]).view(np.float64)
    rep, freq, pres = fs[:, REPETITION], fs[:, FREQUENCY], fs[:, PRESENCE]
    on = hist > 0
    repetition, counts = (
        bool(np.count_nonzero(on & (rep != 1))),
        bool(np.count_nonzero(on & ((freq != 0) | (pres != 0)))),
    )
    if not (repetition or counts):
        return None
    # Row j counts the drafts d_1..d_j: token rows first_row + 1 .. first_row + j.
    lens = np.where(on, j, 0)
    pair_row = np.repeat(np.arange(j.size, dtype=np.int64), lens)
    offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    pair_src = np.repeat(first_row, lens) + 1 + offsets
    factors = np.stack([rep, freq, pres]).reshape(-1).view(np.int64)
    words = np.concatenate([hist, factors, pair_row, pair_src])
    return PenaltyPlan(words, int(j.size), int(pair_row.size), repetition, counts)


def drop_observations(plan: SamplerPlan, drop: np.ndarray) -> SamplerPlan:
    """``plan`` without the observations (``seen`` marks of input tokens) of token rows ``drop``
    (the drafts a step verifies: only committed tokens enter the history)."""
    sizes = list(plan.sizes)
    if not sizes[_OBS_IDX] or not drop.size:
        return plan
    cuts = np.cumsum(sizes)
    parts = np.split(plan.words, cuts[:-1])
    keep = ~np.isin(parts[_OBS_IDX], drop)
    parts[_OBS_IDX], parts[_OBS_ROWS] = parts[_OBS_IDX][keep], parts[_OBS_ROWS][keep]
    kept = int(np.count_nonzero(keep))
    new_sizes = (sizes[0], sizes[1], sizes[2], kept, kept, sizes[5])
    return plan._replace(words=np.concatenate(parts), sizes=new_sizes)


def penalise_rows(
    logits: torch.Tensor,
    history: TokenHistory,
    plan: PenaltyPlan,
    words: torch.Tensor,
    input_ids: torch.Tensor,
) -> torch.Tensor:
    """ON THE STREAM: the penalised ``[R, V]`` logits (float64 for float64 logits, else float32)."""
    r, p = plan.n_rows, plan.n_pairs
    hist, factors = words[:r], words[r : 4 * r].view(torch.float64).view(3, r)
    pair_row, pair_src = words[4 * r : 4 * r + p], words[4 * r + p :]
    assert history.seen is not None and history.counts is not None
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    drafts = input_ids.index_select(0, pair_src).to(torch.int64)
    seen = counts = None
    if plan.repetition:
        seen = history.seen.index_select(0, hist)
        seen.index_put_((pair_row, drafts), torch.ones((), dtype=torch.bool, device=seen.device))
    if plan.counts:
        counts = history.counts.index_select(0, hist)
        counts.index_put_(
            (pair_row, drafts), torch.ones(p, dtype=counts.dtype, device=counts.device), accumulate=True
        )
    f = factors.to(work)
    return apply_penalties(logits.to(work), seen, counts, f[0], f[1], f[2])


def record_committed(
    history: TokenHistory, hist_req: torch.Tensor, committed: torch.Tensor, n_commit: torch.Tensor
) -> None:
    """ON THE STREAM: count each request's committed tokens (``committed [n, W]``, the first
    ``n_commit`` of each row) in its history row ``hist_req [n]`` (0: none). Entries that are
    not committed, and requests without a row, go to the history's trash row (never read)."""
    w = committed.shape[1]
    valid = (torch.arange(w, device=committed.device).unsqueeze(0) < n_commit.unsqueeze(1)) & (
        hist_req > 0
    ).unsqueeze(1)
    rows = torch.where(valid, hist_req.unsqueeze(1), history.rows + 1).reshape(-1)
    history.count(rows, committed.clamp_min(0).reshape(-1))
