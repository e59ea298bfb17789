"""What an :class:`tfuture.engine.Engine` changes on a Hugging Face model it wraps, and gives back.

Wrapping a model in :class:`tfuture.models.HFCausalLM` puts it in eval mode (no dropout while
generating) and switches its attention implementation to ``tfuture_<inner>``. The engine that
wrapped it gives both back when it closes (``generate`` closes its engine before returning):
the mode the model had, and its own attention implementation (Hugging Face's ``generate_batch``
refuses a foreign one). Several engines may wrap one model at once: the state is recorded by
the first and given back by the last to close (a lease counted per model), never under a
running one. An ``HFCausalLM`` the user built is the user's: an engine over it changes nothing
and gives nothing back (:meth:`tfuture.models.HFCausalLM.restore` is there for that).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["wrap"]


@dataclass(slots=True, eq=False)
class _Lease:
    """One model wrapped by engines: its state before the first of them, and how many hold it."""

    model: Any
    attn: str
    training: bool
    holders: int = 0


_LOCK = threading.Lock()
_LEASES: dict[int, _Lease] = {}  # by id(model); the lease holds the model, so the id stays its own


def wrap(model: Any, max_requests: int, max_len: int) -> tuple[Any, Callable[[], None]]:
    """``model`` in a new :class:`tfuture.models.HFCausalLM`, and the callable that gives the
    model's state back once this engine (and every other one over the model) is done with it
    (idempotent). A refused model is left as it was, and nothing is leased."""
    from tfuture.models.hf import HFCausalLM  # the hf extra: only when a HF model is given

    with _LOCK:
        lease = _LEASES.get(id(model))
        if lease is None:
            lease = _Lease(model, str(model.config._attn_implementation), bool(model.training))
        adapter = HFCausalLM(model, max_requests=max_requests, max_len=max_len)
        lease.holders += 1
        _LEASES[id(model)] = lease
    released = False

    def give_back() -> None:
        nonlocal released
        with _LOCK:
            if released:
                return
            released = True
            lease.holders -= 1
            if lease.holders:
                return  # another engine still runs on the model: it keeps the pooled attention
            del _LEASES[id(model)]
            if lease.attn == adapter.inner:  # else it was someone's tfuture_* before: leave it
                adapter.restore()
            model.train(lease.training)

    return adapter, give_back
