"""The sampling filters and the inverse-CDF pick, shared by the Sampler and speculative verification.

Both take logits already divided by the temperature. :func:`sorted_probs` sorts each row
(descending, stable: equal logits keep their vocab order) and applies top-k, top-p and min-p to
the softmax; :func:`inverse_cdf` picks the token whose cumulative probability first passes the
row's uniform draw. The Sampler's token of a row is ``inverse_cdf(*sorted_probs(x, ...), u)``;
speculative verification reads the same filtered probabilities (acceptance) and picks from them
the same way (bonus and residual tokens), so plain and speculative sampling draw from one
distribution.
"""

from __future__ import annotations

import torch

__all__ = ["greedy_tokens", "inverse_cdf", "sorted_probs"]


def sorted_probs(
    x: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    columns: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, order)``: the filtered, unnormalised probabilities ``p [m, V]`` in sorted order and
    ``order [m, V]`` int64, the vocab id of each sorted column.

    Args:
        x: ``[m, V]`` float logits over temperature.
        top_k: ``[m]`` int64 (``INT64_MAX``: off) or None (no row filters by it).
        top_p: ``[m]`` float (``inf``: off) or None.
        min_p: ``[m]`` float (0: off) or None.
        columns: ``arange(V)`` on ``x``'s device (cached by the caller).
    """
    sorted_x, order = torch.sort(x, dim=1, descending=True, stable=True)
    p = torch.softmax(sorted_x, dim=1)
    if top_k is not None:
        p = p.masked_fill(columns >= top_k.unsqueeze(1), 0)
    if top_p is not None:
        c = p.cumsum(dim=1)
        p = p.masked_fill(c - p >= top_p.unsqueeze(1) * c[:, -1:], 0)
    if min_p is not None:
        p = p.masked_fill(p < min_p.unsqueeze(1) * p[:, :1], 0)
    return p, order


def inverse_cdf(p: torch.Tensor, order: torch.Tensor, u: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``[m]`` int64: per row the vocab id at the first sorted column whose cumulative ``p``
    passes ``u * total`` (``u [m]`` float in ``[0, 1)``), or -1 where ``p`` is not a
    distribution (a NaN or +inf logit, or no token left). ``zero``: a 0-dim zero of ``p``'s dtype."""
    c = p.cumsum(dim=1)
    total = c[:, -1:]
    # Below the total by construction (u * total may round up to it): the pick has p > 0.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, zero))
    pick = torch.searchsorted(c, target, right=True).clamp_max_(p.shape[1] - 1)
    ok = p.gather(1, pick) > 0
    return torch.where(ok, order.gather(1, pick), -1).squeeze(1)


def greedy_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[m]`` int64: the argmax of each row of ``x [m, V]``, or -1 where it is not a real logit
    (NaN, or -inf: every allowed token banned), so no banned token is ever returned."""
    best, tokens = x.max(dim=1)  # one op: the value says whether the pick is a real logit
    return torch.where(best > float("-inf"), tokens, -1)
