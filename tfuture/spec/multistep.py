"""Multi-step decode: up to ``K`` decode steps per schedule, chained on the device.

Small, fast models are host-bound even with overlap: scheduling and processing a step costs the
host more than the device's step. :class:`MultiStepTokenStep` runs a window of ``K`` decode
steps as one runtime step: one schedule, one launch, one copy and one process for ``K`` tokens
per request. On the forward stream the window's first forward is the token step's own
(prefill chunks, placeholders resolved by the fused prepare); each later one feeds every
sampling request the token the previous one sampled, at the next position, so step ``j + 1``'s
input is step ``j``'s output with no host round trip. The last token goes into the request's
future slot, which the next window names as its input, like a plain step's.

Sampling is the speculative step's verification with no drafts (:mod:`tfuture.spec.verify`):
the Sampler's filters and penalty formula, draws keyed by (seed, position), so a seeded request
gives the same tokens for every ``K``; penalties are exact (the device history counts each
token as it is sampled). The host learns the ``K`` tokens when it processes the window; a finish
(eos, stop token, ``max_tokens``, abort) inside it cuts the output there and the tokens past it
are dropped and counted (:class:`tfuture.scheduler.ContinuousBatcher`'s ``extra_tokens``). Their
KV positions belong to a finished request, whose rows are released. A window with a grammar
request (its mask is for one position) runs ``K = 1``; the scheduler decides per window
(``DraftBatch.n_steps``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch, HostMeta, Model
from tfuture.sampling import Sampler
from tfuture.sampling.filters import greedy_tokens
from tfuture.spec.batch import DraftBatch
from tfuture.spec.drafter import DraftContext
from tfuture.spec.penalties import penalise_rows, record_committed
from tfuture.spec.step import SpecState, SpecTokenStep
from tfuture.spec.verify import Verified, verify_rows
from tfuture.steps.base import InFlight, Op

__all__ = ["MultiStepTokenStep"]


class NoDrafts:
    """The drafter of a step that makes no drafts (``k = 0``)."""

    k = 0

    def bind(self, max_requests: int, max_len: int, device: torch.device) -> None:
        """Nothing to hold."""

    def observe(self, fwd: ForwardBatch) -> None:
        """Nothing to see."""

    def draft(self, ctx: DraftContext) -> torch.Tensor:
        return torch.empty(len(ctx.req_ids), 0, dtype=torch.int64, device=ctx.committed.device)

    def release(self, req_ids: np.ndarray) -> None:
        """Nothing held."""

    def close(self) -> None:
        """Nothing held."""


class MultiStepState(SpecState):
    """A window's record: the speculative step's, plus its later steps' host mirrors."""

    later: tuple[HostMeta, ...] = ()


class MultiStepTokenStep(SpecTokenStep):
    """The token step of ``model`` that runs ``DraftBatch.n_steps`` decode steps per launch (see
    the module docstring); a plain :class:`tfuture.core.batch.Batch` or ``n_steps = 1`` is one
    step. ``sampler``: the :class:`tfuture.sampling.Sampler` whose admitted parameters the
    requests use (a default one if None)."""

    stream_ops = (*SpecTokenStep.stream_ops, "decode")
    state_type = MultiStepState

    def __init__(self, model: Model, sampler: Sampler | None = None) -> None:
        super().__init__(model, NoDrafts(), sampler)

    # -- host, at launch ---------------------------------------------------------------------

    def plan_spec(self, batch: Any) -> tuple[SpecState, Any, int]:
        state, staged, n_out = super().plan_spec(batch)
        k = batch.n_steps if isinstance(batch, DraftBatch) else 1
        if k > 1 and state.n_sample:
            assert isinstance(state, MultiStepState)
            sreq = state.sample_reqs
            # Step j (1-based, after the first) feeds the token at position L + j - 1, where L is
            # the request's length after the first step's inputs: exact (no drafts in a window).
            length = (batch.prefix_lens + batch.seg_lens)[sreq]
            req_ids, n = batch.req_ids[sreq], sreq.size
            ones, rows = np.ones(n, dtype=np.int64), np.arange(n, dtype=np.int64)
            state.later = tuple(HostMeta(ones, length + j - 1, req_ids, rows, n, 1) for j in range(1, k))
            state.n_steps = k  # the verification's width stays 1: no drafts
        return state, staged, n_out

    # -- forward stream ----------------------------------------------------------------------

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        ops = super().sample_ops(rec, mask)
        if rec.state.n_steps > 1:
            ops.insert(1, ("decode", lambda: self._decode(rec)))  # after verify, before store
        return ops

    def _decode(self, rec: InFlight) -> None:
        """The window's later steps: each request's last token in, the next one out."""
        state: MultiStepState = rec.state
        v, fwd, inputs, n = state.verified, state.fwd, state.inputs, state.n_sample
        if v is None:
            return
        assert fwd is not None and state.rp is not None and state.new_len is not None
        dev = v.last.device
        rows = torch.arange(n, dtype=torch.int64, device=dev)
        starts = torch.arange(n + 1, dtype=torch.int64, device=dev)
        req_ids = fwd.req_ids.index_select(0, inputs.sample_idx)
        k = state.n_steps
        # Each request's last input position, then one more per later step: [k + 1, n].
        pos = fwd.positions.index_select(0, inputs.vrows) + torch.arange(k + 1, device=dev).unsqueeze(1)
        none, off = rows.new_zeros(n), rows.new_zeros(n, dtype=torch.bool)
        sampler, dev_params = self.sampler, self.row_params_on_device(state)
        greedy = state.pen is None and dev_params is None
        tokens, tok = [v.last], v.last
        for j, host in enumerate(state.later, start=1):
            # A greedy token is a valid id; a sampled row may have none (-1: the host raises).
            ids = (tok if greedy else tok.clamp_min(0)).to(fwd.input_ids.dtype)
            step = ForwardBatch(rec.step, ids, pos[j], rows, req_ids, pos[j + 1], rows, rows, starts, host)
            logits = self.model.forward(step)
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != n:
                got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                raise ValueError(
                    f"forward of step {rec.step} (decode {j + 1} of {state.n_steps}) must return "
                    f"[{n}, vocab] logits, got {got}"
                )
            if greedy:
                tok = greedy_tokens(logits)  # greedy without penalties: verification is the argmax
            else:
                if state.pen is not None:
                    assert sampler is not None
                    logits = penalise_rows(logits, sampler.history, state.pen, inputs.penalties, ids)
                w = verify_rows(logits, none, off, rows, n, 1, state.rp, dev_params, pos[j + 1])
                if state.pen is not None:
                    assert sampler is not None
                    record_committed(sampler.history, inputs.hist_req, w.committed, w.n_commit)
                tok = w.last
            tokens.append(tok)
        state.verified = Verified(
            torch.stack(tokens, 1), torch.full((n,), k, dtype=torch.int64, device=dev), tok
        )
        state.new_len = state.new_len + (k - 1)
