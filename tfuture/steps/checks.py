"""A token step's host checks: the placeholders a batch may hold (at launch) and the sampled
tokens the host reads back (after the step's copy)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tfuture.core.batch import Batch
from tfuture.core.checks import count_nonzero

__all__ = ["check_placeholders", "check_sampled"]

_NO_ROWS = np.empty(0, dtype=np.int64)


def check_placeholders(batch: Batch) -> None:
    """Raise ``ValueError`` if ``batch.tokens`` holds a negative id that no handle of
    ``batch.consumes`` names: it would resolve to an unrelated slot's token (a prompt id of -1
    reads slot 1). Negative ids are placeholders, and only consumed handles make them."""
    tokens, consumes = batch.tokens, batch.consumes
    if len(consumes) == 1:
        slots = consumes[0]._array()  # checked live by the runtime; never written here
        # The usual decode: exactly the consumed handle's placeholders, in order.
        if slots.size == tokens.size and not count_nonzero(tokens + slots):
            return
    if not tokens.size or tokens[tokens.argmin()] >= 0:  # argmin: a third of a min's cost
        return
    negs = tokens[tokens < 0]
    neg = -negs  # int64 min stays negative: no handle names it
    named = (
        consumes[0].slots if len(consumes) == 1 else np.concatenate([h.slots for h in consumes] or [_NO_ROWS])
    )
    if neg.size == named.size and np.array_equal(neg, named):
        return  # the usual decode: the consumed handle's placeholders, in order
    stray = negs[~np.isin(neg, named)]
    if stray.size:
        raise ValueError(
            f"Batch.tokens holds the negative id {int(stray[0])}, which no handle of batch.consumes "
            f"names ({stray.size} such id(s)): negative ids are placeholders of consumed handles; "
            "token ids are >= 0"
        )


def check_sampled(tokens: np.ndarray, state: Any, step: int) -> None:
    """HOST, after the step's copy: raise ``ValueError`` naming the request and step if a row got
    no valid token (-1): its logits had a NaN or +inf, or -inf on every allowed token, so no
    token had a nonzero probability (or a model's own ``sample`` returned a negative id).

    ``state``: the step's record, with ``host`` (:class:`tfuture.core.batch.HostMeta`) and
    ``sample_reqs`` (``[n_sample]`` int64 indices into the batch's requests)."""
    if not tokens.size or tokens[tokens.argmin()] >= 0:  # argmin: a third of a min's cost
        return
    bad = np.flatnonzero(tokens < 0)
    rid = int(state.host.req_ids[state.sample_reqs[bad[0]]])
    raise ValueError(
        f"step {step}: the sampler found no valid token for request id {rid} ({bad.size} row(s)): its "
        "logits were NaN or +inf, or -inf on every token the mask allows (or the model's own sample "
        f"returned the negative id {int(tokens[bad[0]])})"
    )
