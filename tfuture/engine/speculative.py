"""The front door's speculative decoding: a drafter checked, bound and put in the token step.

``Engine(model, speculative=tfuture.NGramDrafter(k=4))`` (and :func:`tfuture.generate`) runs
every request through :class:`tfuture.spec.SpecTokenStep` with ``k`` drafts a step. The KV rows
hold a margin of positions past ``max_len`` for the drafts verified beyond a request's last
token; the future map holds ``1 + k`` slots per request and step. A structured-output request's
rows wait for grammar masks, one per draft it verifies; the others' do not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tfuture.engine.inputs import _is_hf_model
from tfuture.engine.model_state import wrap
from tfuture.sampling import Sampler
from tfuture.spec import Drafter, ModelDrafter, SpecTokenStep, SpecWindowStep

__all__ = ["check_drafter", "margin", "spec_step"]


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
