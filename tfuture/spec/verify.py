"""Verification of draft tokens: greedy acceptance and rejection sampling, on the device.

A request that verifies ``v`` drafts ``d_1..d_v`` gets ``v + 1`` logits rows: row ``j`` is the
target's distribution after the step's input ``j`` (the last committed token, then the drafts).
Draft ``d_{j+1}`` is checked at row ``j``; on the first rejection the request commits the
drafts before it and one token drawn at that row from the residual, and if every draft is
accepted one bonus token drawn at row ``v``. So a request commits between 1 and ``v + 1``
tokens. A plain request (``v = 0``) is the same rule with one row: it samples one token.

The rule (Leviathan et al. 2023; Chen et al. 2023) for a point-mass draft (the drafter proposes
one token, as prompt lookup and a greedy draft model do): accept ``x`` with probability
``p(x)``, where ``p`` is the target's distribution after the request's own processing
(temperature, top-k, top-p, min-p: :func:`tfuture.sampling.filters.sorted_probs`, the Sampler's
own filters); on rejection sample from ``p`` with ``x`` removed, renormalised, which is
``max(p - q, 0)`` normalised for ``q`` the point mass at ``x``. The committed tokens then follow
the target's distribution exactly, whatever the drafts. A greedy row (temperature 0 or top-k 1)
has ``p`` the point mass at its argmax: it accepts while the draft equals the argmax and commits
the argmax, which is plain greedy decoding.

Draws are keyed: the token sampled at sequence position ``pos`` uses
``uniform_draws(seed, pos)`` (the Sampler's draw there, so a plain row samples the Sampler's
token bit for bit) and its acceptance test ``uniform_draws(seed ^ ACCEPT_KEY, pos)``, computed on
the device from the device positions, so a seeded request reproduces for any batch, any overlap
and any number of drafts accepted before.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from tfuture.core.params import GREEDY_BELOW, N_FLOATS, SEED, TEMPERATURE, TOP_K
from tfuture.sampling.draws import device_draws
from tfuture.sampling.filters import greedy_tokens, inverse_cdf, sorted_probs
from tfuture.sampling.plan import K_OFF

__all__ = [
    "ACCEPT_KEY",
    "GREEDY_ROWS",
    "RowParams",
    "Verified",
    "row_params",
    "verify_greedy_host",
    "verify_rows",
]

#: XOR-ed into a request's seed for its acceptance draws (an odd 62-bit constant: seeds stay
#: below 2**63, and no acceptance draw is any request's sampling draw at the same position).
ACCEPT_KEY = 0x2545F4914F6CDD1D
_TOP_P, _MIN_P = 1, 2  # float columns of the packed parameters (temperature is 0)


class RowParams(NamedTuple):
    """Per logits row, on the host: ``floats [3, R]`` float64 (temperature, top_p, min_p, each
    at its no-op value where off; a greedy row has temperature 1 and top_k 1), ``top_k [R]`` and
    ``seeds [R]`` int64; and which filters any row uses (False: that filter launches nothing)."""

    floats: np.ndarray
    top_k: np.ndarray
    seeds: np.ndarray
    sampled: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool


def row_params(packed: np.ndarray) -> RowParams:
    """The :class:`RowParams` of packed parameter rows (``[R, PARAM_WORDS]`` int64, checked
    ones: :func:`tfuture.core.params.pack_params`), one per logits row."""
    fs = np.ascontiguousarray(packed[:, :N_FLOATS]).view(np.float64)
    top_k = packed[:, TOP_K].copy()
    greedy = (fs[:, TEMPERATURE] < GREEDY_BELOW) | (top_k == 1)
    floats = np.stack([fs[:, TEMPERATURE], fs[:, _TOP_P], fs[:, _MIN_P]])
    floats[0, greedy], floats[2, greedy], top_k[greedy] = 1.0, 0.0, 1
    p_off = (floats[1] >= 1) | greedy
    floats[1, p_off] = np.inf
    top_k[top_k == 0] = K_OFF
    return RowParams(
        floats,
        top_k,
        packed[:, SEED].copy(),
        bool(np.count_nonzero(~greedy)),
        bool(np.count_nonzero(top_k != K_OFF)),
        bool(np.count_nonzero(~p_off)),
        bool(np.count_nonzero(floats[2])),
    )


#: The :class:`RowParams` of rows that are all greedy (nothing staged: no row samples; a greedy row
#: with penalties too): :func:`verify_rows` reads only ``sampled``.
GREEDY_ROWS = RowParams(np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64), False, False, False, False)


class Verified(NamedTuple):
    """A step's verification, on the device: ``committed [n, W]`` int64 (row ``i`` commits its
    first ``n_commit[i]`` entries; -1 past them, and -1 at a row with no valid token, which the
    host refuses), ``n_commit [n]`` int64 in ``[1, v_i + 1]``, ``last [n]`` int64 (the last
    committed token)."""

    committed: torch.Tensor
    n_commit: torch.Tensor
    last: torch.Tensor


def verify_rows(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    is_draft: torch.Tensor,
    pad_pos: torch.Tensor,
    n: int,
    width: int,
    params: RowParams,
    dev_params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    positions: torch.Tensor,
) -> Verified:
    """ON THE STREAM: verify a step's drafts (see the module docstring).

    Args:
        logits: ``[R, V]`` float, the verification rows of ``n`` requests back to back
            (request ``i``'s ``v_i + 1`` rows in order).
        drafts: ``[R]`` int64, at a row that checks a draft the draft it checks (``d_{j+1}`` at
            row ``j``); any id elsewhere.
        is_draft: ``[R]`` bool, True at rows that check a draft (all but each request's last).
        pad_pos: ``[R]`` int64, each row's index ``i * width + j`` in the padded ``[n, width]``
            layout (``width`` = the most rows of a request).
        params: the rows' host parameters (:func:`row_params`); ``dev_params`` their device
            copies ``(floats [3, R] float64, top_k [R], seeds [R])``, or None when no row samples.
        positions: ``[R]`` int64, the sequence position of the token each row samples.
    """
    dev = logits.device
    if not params.sampled:
        target = greedy_tokens(logits)
        accept = is_draft & (drafts == target)
        final = target
    else:
        assert dev_params is not None
        floats, top_k, seeds = dev_params
        work = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(work) / floats[0].to(work).unsqueeze(1)
        columns = torch.arange(x.shape[1], device=dev)
        p, order = sorted_probs(
            x,
            top_k if params.use_top_k else None,
            floats[1].to(work) if params.use_top_p else None,
            floats[2].to(work) if params.use_min_p else None,
            columns,
        )
        is_x = order == drafts.unsqueeze(1)
        p_x = (p * is_x).sum(dim=1)
        total = p.sum(dim=1)
        u_accept = device_draws(seeds ^ ACCEPT_KEY, positions).to(work)
        accept = is_draft & (u_accept * total < p_x)
        # The residual at a draft row (the draft's mass removed); the full p at the bonus row.
        residual = p.masked_fill(is_x & is_draft.unsqueeze(1), 0)
        final = inverse_cdf(residual, order, device_draws(seeds, positions).to(work), p.new_zeros(()))
    flat = n * width
    acc_pad = torch.zeros(flat, dtype=torch.int64, device=dev).index_copy_(0, pad_pos, accept.to(torch.int64))
    n_commit = acc_pad.view(n, width).cumprod(dim=1).sum(dim=1) + 1
    draft_pad = torch.full((flat,), -1, dtype=torch.int64, device=dev).index_copy_(0, pad_pos, drafts)
    final_pad = torch.full((flat,), -1, dtype=torch.int64, device=dev).index_copy_(0, pad_pos, final)
    j = torch.arange(width, device=dev).unsqueeze(0)
    end = (n_commit - 1).unsqueeze(1)
    committed = torch.where(j < end, draft_pad.view(n, width), final_pad.view(n, width))
    committed = committed.masked_fill(j > end, -1)
    last = committed.gather(1, end).squeeze(1)
    return Verified(committed, n_commit, last)


_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def verify_greedy_host(
    logits: torch.Tensor, drafts: np.ndarray, n_verify: np.ndarray, n: int, width: int
) -> Verified:
    """:func:`verify_rows` of greedy rows whose logits are on the CPU: the argmax in numpy
    (torch's for a dtype numpy lacks, bfloat16), the acceptance in a loop over the requests (a
    handful of rows each: cheaper on the CPU than the dozen small tensor ops of the vectorised
    rule). ``drafts [R]`` int64 and ``n_verify [n]`` are host arrays (request ``i`` has
    ``n_verify[i] + 1`` rows, in order). The same :class:`Verified`, as CPU tensors (a test
    compares the two)."""
    if logits.dtype in _NUMPY_FLOATS:
        # numpy's argmax: several times cheaper than torch's max for a few rows on the CPU.
        # Both take the first maximum, and the first NaN of a row that has one.
        x = logits.detach().numpy()
        idx = x.argmax(axis=1)
        best = x[np.arange(idx.size), idx]
    else:
        best_t, idx_t = logits.max(dim=1)
        best, idx = best_t.float().numpy(), idx_t.numpy()  # float: NaN and -inf stay
    # A row with no real logit (NaN, or -inf everywhere) has no token: -1, as greedy_tokens.
    target = np.where(best > -math.inf, idx, -1).tolist()
    proposed = drafts.tolist()
    flat: list[int] = []
    counts: list[int] = []
    lasts: list[int] = []
    row = 0
    for v in n_verify.tolist():
        j = 0
        while j < v and proposed[row + j] == target[row + j] >= 0:
            j += 1
        t = target[row + j]
        flat += proposed[row : row + j]
        flat.append(t)
        flat += [-1] * (width - 1 - j)
        counts.append(j + 1)
        lasts.append(t)
        row += v + 1
    committed = np.array(flat, dtype=np.int64).reshape(n, width)
    n_commit, last = np.array(counts, dtype=np.int64), np.array(lasts, dtype=np.int64)
    return Verified(torch.from_numpy(committed), torch.from_numpy(n_commit), torch.from_numpy(last))
