"""Drafting with a small draft model: :class:`ModelDrafter`.

The draft model is a Hugging Face causal LM with the target's vocabulary, driven through its own
:class:`tfuture.models.HFCausalLM` (its own KV rows). On the forward stream, per step: it runs
the step's inputs (prompt chunks, and each verifying request's last committed token and drafts)
at the step's positions, which writes its KV cache; after verification it decodes ``k`` tokens
greedily from each request's last committed token. Rollback is by position, as for the target:
the KV entries of rejected drafts lie past the request's sequence length, so no later step
attends to them, and the next step overwrites them. Its drafts are point masses (the draft
model's argmax), which verification handles exactly for any target parameters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch, HostMeta
from tfuture.spec.drafter import DraftContext

__all__ = ["ModelDrafter"]


class ModelDrafter:
    """``k`` greedy drafts per request and step from ``draft_model`` (see the module docstring).

    Args:
        draft_model: a ``transformers`` causal LM with the target's vocabulary (a smaller one of
            the same family, or any model the pooled attention serves), or an
            :class:`tfuture.models.HFCausalLM` over one.
        k: drafts per step (>= 1).
    """

    def __init__(self, draft_model: Any, k: int = 4) -> None:
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"ModelDrafter(k=) must be an int >= 1, got {k!r}")
        if not hasattr(draft_model, "forward"):
            raise TypeError(
                f"ModelDrafter needs a causal LM as its draft model, got {type(draft_model).__name__}"
            )
        self.k = int(k)
        self.draft_model = draft_model
        self.adapter: Any = None
        self.vocab: int | None = getattr(getattr(draft_model, "config", None), "vocab_size", None)
        if self.vocab is None:
            self.vocab = getattr(draft_model, "vocab", None)

    def __repr__(self) -> str:
        return f"ModelDrafter({type(self.draft_model).__name__}, k={self.k})"

    def bind(self, max_requests: int, max_len: int, device: torch.device) -> None:
        from tfuture.models import HFCausalLM

        # k decodes past the longest verification window: the draft cache holds them too.
        need = max_len + self.k + 1
        if isinstance(self.draft_model, HFCausalLM):
            pool = self.draft_model.pool
            if pool.n_rows < max_requests or pool.max_len < need:
                raise ValueError(
                    f"ModelDrafter: the draft HFCausalLM has max_requests={pool.n_rows}, max_len="
                    f"{pool.max_len}; it needs at least {max_requests} and {need}"
                )
            self.adapter = self.draft_model
        else:
            a = self.adapter
            if a is None or a.pool.n_rows < max_requests or a.pool.max_len < need:
                self.adapter = HFCausalLM(self.draft_model, max_requests=max_requests, max_len=need)
        if self.adapter.device != device:
            raise ValueError(
                f"ModelDrafter: the draft model is on {self.adapter.device} and the FutureMap on "
                f"{device}: put the draft model on the map's device"
            )

    def _adapter(self) -> Any:
        if self.adapter is None:
            raise RuntimeError("ModelDrafter.bind was not called: the draft model has no KV rows yet")
        return self.adapter

    def observe(self, fwd: ForwardBatch) -> None:
        # The draft cache takes the step's tokens; the logits are not needed (the fewest rows).
        if fwd.host is not None and fwd.host.n_tokens:
            self._adapter().forward(fwd._replace(sample_rows=fwd.last_rows[:1]))

    def draft(self, ctx: DraftContext) -> torch.Tensor:
        adapter = self._adapter()
        n = ctx.req_ids.size
        dev = ctx.committed.device
        drafts = torch.empty(n, self.k, dtype=torch.int64, device=dev)
        if not n:
            return drafts
        rows = torch.arange(n, device=dev)
        tok = ctx.committed.gather(1, (ctx.n_commit - 1).unsqueeze(1)).squeeze(1).clamp_min(0)
        pos = ctx.seq_lens - 1
        ones = np.ones(n, dtype=np.int64)
        starts = torch.arange(n + 1, device=dev)
        req_dev = torch.from_numpy(ctx.req_ids).to(dev, non_blocking=True)
        for i in range(self.k):
            # The host knows only a bound on the positions: it sizes the attention, the device
            # positions place the keys.
            host = HostMeta(
                ones, np.full(n, ctx.max_len - 1 + i, dtype=np.int64), ctx.req_ids, np.arange(n), n, 1
            )
            fb = ForwardBatch(-1, tok, pos, rows, req_dev, pos + 1, rows, rows, starts, host)
            logits = adapter.forward(fb)
            tok = logits.argmax(dim=-1)
            drafts[:, i] = tok
            pos = pos + 1
        return drafts

    def release(self, req_ids: np.ndarray) -> None:
        self._adapter().release(req_ids)

    def close(self) -> None:
        if self.adapter is not None:
            self.adapter.close()
