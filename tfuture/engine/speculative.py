"""The front door's speculative decoding: a drafter checked, bound and put in the token step.

``Engine(model, speculative=tfuture.NGramDrafter(k=4))`` (and :func:`tfuture.generate`) runs
every request through :class:`tfuture.spec.SpecTokenStep` with ``k`` drafts a step. The KV rows
hold a margin of positions past ``max_len`` for the drafts verified beyond a request's last
token; the future map holds ``1 + k`` slots per request and step. A structured-output request's
rows wait for grammar masks, one per draft it verifies; the others' do not.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tfuture.engine.inputs import _is_hf_model
from tfuture.engine.model_state import wrap
from tfuture.sampling import Sampler
from tfuture.spec import Drafter, ModelDrafter, SpecTokenStep, SpecWindowStep

__all__ = ["chain", "check_drafter", "claim_drafter", "margin", "spec_step"]


def check_drafter(drafter: object) -> Drafter | None:
    """``drafter`` if it is a :class:`tfuture.spec.Drafter` (or None), else ``TypeError``."""
    if drafter is None or isinstance(drafter, Drafter):
        k = getattr(drafter, "k", 1)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative= needs a drafter with k >= 1 drafts per step, got k={k!r}")
        return drafter
    raise TypeError(
        "speculative= takes a drafter (tfuture.NGramDrafter(k=4), tfuture.ModelDrafter(draft_model, k=4) "
        f"or your own tfuture.spec.Drafter) or None, got {type(drafter).__name__}"
    )


def margin(drafter: Drafter | None) -> int:
    """KV positions a request may use past its ``max_len``: the host schedules a step while up
    to two earlier ones are in flight, each of which may commit ``k + 1`` tokens."""
    return 0 if drafter is None else 3 * (drafter.k + 1)


def spec_step(
    model: Any, drafter: Drafter, sampler: Sampler, max_running: int, pool_len: int, windows: bool = False
) -> tuple[SpecTokenStep, Callable[[], None] | None]:
    """The token step of ``model`` with ``drafter`` bound to ``max_running`` rows of
    ``pool_len`` positions on the model's device (a draft model must share the vocabulary), and
    what gives a Hugging Face draft model wrapped here its mode and attention back (or None).
    ``windows``: a :class:`tfuture.spec.SpecWindowStep` (multi-step windows for the steps
    where no request drafts)."""
    vocab = getattr(model, "vocab", None)
    if isinstance(drafter, ModelDrafter) and vocab is not None and drafter.vocab not in (None, vocab):
        raise ValueError(
            f"ModelDrafter: the draft model's vocabulary has {drafter.vocab} tokens, the target's {vocab}: "
            "a draft model must share the target's tokenizer"
        )
    param = next(iter(getattr(getattr(model, "model", None), "parameters", lambda: iter(()))()), None)
    device = param.device if isinstance(param, torch.Tensor) else torch.device("cpu")
    give_back = None
    if isinstance(drafter, ModelDrafter) and _is_hf_model(drafter.draft_model):
        # Leased like the target: the engine that wraps it gives its state back when it closes.
        drafter.adapter, give_back = wrap(drafter.draft_model, max_running, pool_len + drafter.k + 1)
    try:
        drafter.bind(max_running, pool_len, device)
        return (SpecWindowStep if windows else SpecTokenStep)(model, drafter, sampler), give_back
    except BaseException:
        if give_back is not None:
            give_back()
        raise


# The engine each drafter is bound to (by the drafter's id; the entry is checked by identity).
_DRAFTER_OWNERS: dict[int, weakref.ref[Any]] = {}
_DRAFTER_LOCK = threading.Lock()


def claim_drafter(drafter: Any, engine: Any) -> None:
    """Bind ``drafter`` to ``engine``, or raise ``ValueError`` while another engine that holds
    it is open or still running: binding re-sizes the drafter's rows and history, under that
    engine's requests."""
    with _DRAFTER_LOCK:
        for key in [k for k, ref in _DRAFTER_OWNERS.items() if ref() is None]:
            del _DRAFTER_OWNERS[key]
        ref = _DRAFTER_OWNERS.get(id(drafter))
        other = None if ref is None else ref()
        if other is not None and other is not engine and other.drafter is drafter:
            if not getattr(other, "_closed", True) or getattr(other, "_driver", None) is not None:
                raise ValueError(
                    f"this {type(drafter).__name__} is the drafter of another Engine that is still open: "
                    "a drafter serves one engine at a time (its rows and history are bound to that "
                    "engine's requests); close that engine first, or give each engine its own drafter"
                )
        _DRAFTER_OWNERS[id(drafter)] = weakref.ref(engine)


def chain(first: Callable[[], None] | None, then: Callable[[], None]) -> Callable[[], None]:
    """Call ``first`` (if any), then ``then``."""

    def both() -> None:
        try:
            if first is not None:
                first()
        finally:
            then()

    return both
