"""Multi-step decode: up to ``K`` decode steps per schedule, chained on the device.

Small, fast models are host-bound even with overlap: scheduling and processing a step costs the
host more than the device's step. :class:`MultiStepTokenStep` runs a window of ``K`` decode
steps as one runtime step: one schedule, one launch, one copy and one process for ``K`` tokens
per request. It is the token step, plan and first step included (prefill chunks, placeholders
resolved by the fused prepare, the Sampler's sample); each later step of the window feeds every
sampling request the token the previous one sampled, at the next position, so step ``j + 1``'s
input is step ``j``'s output with no host round trip. The last token goes into the request's
future slot, which the next window names as its input, like a plain step's.

The later steps sample as the Sampler does: greedy rows take the argmax; sampled rows and
penalties go through :func:`tfuture.spec.verify.verify_rows` with no drafts (the Sampler's
filters and penalty formula, draws keyed by (seed, position): the Sampler's own tokens), so a
request gives the same tokens for every ``K``, and the device history counts each token as it
is sampled. The host learns the ``K`` tokens when it processes the window; a finish (eos, stop
token, ``max_tokens``, abort) inside it cuts the output there and the tokens past it are
dropped and counted (:class:`tfuture.scheduler.ContinuousBatcher`'s ``extra_tokens``). Their
KV positions belong to a finished request, whose rows are released. A window with a grammar
request (its mask is for one position) runs ``K = 1``, as the plain token step; the scheduler
decides per window (``DraftBatch.n_steps``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch, HostMeta, Model, StepResult
from tfuture.sampling import Sampler
from tfuture.sampling.filters import greedy_tokens
from tfuture.spec.batch import DraftResult, check_committed
from tfuture.spec.penalties import PenaltyPlan, penalise_rows, plan_penalties, record_committed
from tfuture.spec.verify import GREEDY_ROWS, RowParams, row_params, verify_rows
from tfuture.steps.base import InFlight, Op, StepPlan
from tfuture.steps.token import TokenStep
from tfuture.steps.token_state import TokenInputs, TokenState

__all__ = ["LaterSteps", "MultiStepTokenStep", "WindowState"]

_NONE = np.empty(0, dtype=np.int64)


#: A window's staged arrays: the token step's (:class:`TokenInputs`), then what its later steps
#: sample with when a row samples or has penalties (else empty): ``params`` (``[3 * n]`` float64
#: bits, ``[n]`` top_k, ``[n]`` seeds), ``penalties`` (:class:`PenaltyPlan` words) and
#: ``hist_req [n]`` (history rows).
WindowInputs = NamedTuple(  # type: ignore[misc]  # the field list is TokenInputs' plus ours
    "WindowInputs", [(name, Any) for name in (*TokenInputs._fields, "params", "penalties", "hist_req")]
)


class LaterSteps(NamedTuple):
    """What a window's later steps share on the device: ``first`` (``[n]`` int64, the first
    step's tokens), ``rows`` (``arange(n)``), ``starts`` (``arange(n + 1)``), ``req_ids [n]``,
    ``pos [k + 1, n]`` (each request's last input position, then one more per later step) and
    ``params`` (the sampled rows' float parameters ``[3, n]``, top-k and seeds, or None);
    ``none``/``off`` (``[n]`` zeros, int64 and bool: no drafts, for ``verify_rows``)."""

    first: torch.Tensor
    rows: torch.Tensor
    starts: torch.Tensor
    req_ids: torch.Tensor
    pos: torch.Tensor
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    none: torch.Tensor
    off: torch.Tensor


class WindowState(TokenState):
    """A window's record: the token step's, plus its later steps' host mirrors and plans."""

    n_steps: int = 1
    later: tuple[HostMeta, ...] = ()
    rp: RowParams | None = None  # the rows' parameters, when a row samples
    pen: PenaltyPlan | None = None  # the rows' penalties, when a row has any
    extra: Any = None  # the device views of the WindowInputs beyond the token step's
    tokens: torch.Tensor | None = None  # [n_sample, n_steps] int64, the window's tokens


class MultiStepTokenStep(TokenStep):
    """The token step of ``model`` that runs ``DraftBatch.n_steps`` decode steps per launch (see
    the module docstring); a plain :class:`tfuture.core.batch.Batch` or ``n_steps = 1`` is one
    step. ``sampler``: the :class:`tfuture.sampling.Sampler` whose admitted parameters the
    requests use (a default one if None)."""

    stream_ops = (*TokenStep.stream_ops, "decode")
    state_type = WindowState
    windows = True

    def __init__(self, model: Model, sampler: Sampler | None = None) -> None:
        super().__init__(model, sampler=sampler if sampler is not None else Sampler())

    # -- host, at launch ---------------------------------------------------------------------

    def plan(self, batch: Any) -> StepPlan:
        k = int(getattr(batch, "n_steps", 1))
        state, inputs = self.plan_batch(batch)
        assert isinstance(state, WindowState)
        n = state.sample_reqs.size
        if k == 1 or not n:
            staged = WindowInputs(*inputs, _NONE, _NONE, _NONE)  # type: ignore[call-arg]
            return StepPlan(n, staged, state, bool(state.late.size))
        sreq, splan = state.sample_reqs, state.splan
        # Step j (1-based, after the first) feeds the token at position L + j - 1, where L is the
        # request's length after the first step's inputs: exact (no drafts in a window).
        length = (batch.prefix_lens + batch.seg_lens)[sreq]
        req_ids = batch.req_ids[sreq]
        ones, rows = np.ones(n, dtype=np.int64), np.arange(n, dtype=np.int64)
        state.later = tuple(HostMeta(ones, length + j - 1, req_ids, rows, n, 1) for j in range(1, k))
        state.n_steps = k
        params = penalties = hist = _NONE
        if splan.sampled or splan.penalized:
            assert self.sampler is not None
            packed = self.sampler.packed_params(req_ids)
            if splan.sampled:
                state.rp = rp = row_params(packed)
                params = np.concatenate([rp.floats.reshape(-1).view(np.int64), rp.top_k, rp.seeds])
            hist = self.sampler.history_rows_of(req_ids)
            state.pen = plan_penalties(packed, hist, rows, np.zeros(n, dtype=np.int64))
            if state.pen is not None:
                penalties = state.pen.words
        staged = WindowInputs(*inputs, params, penalties, hist)  # type: ignore[call-arg]
        return StepPlan(n, staged, state, bool(state.late.size))

    # -- forward stream ----------------------------------------------------------------------

    def prepare(self, rec: InFlight, inputs: Any) -> None:  # WindowInputs (device views)
        super().prepare(rec, TokenInputs(*inputs[: len(TokenInputs._fields)]))
        rec.state.extra = inputs

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        ops = super().sample_ops(rec, mask)
        if rec.state.n_steps > 1:
            ops[-1] = ("decode", lambda: self._decode(rec))  # its later steps, then its store
            ops.append(("store", lambda: self._store_last(rec)))
        return ops

    def _decode(self, rec: InFlight) -> None:
        """The window's later steps: each request's last token in, the next one out."""
        state: WindowState = rec.state
        assert state.sampled is not None
        win = self.later_setup(rec, state.sampled)
        tokens, tok = [win.first], win.first
        for j in range(1, state.n_steps):
            step = self.later_batch(rec, win, j, tok)
            logits = self.later_logits(rec, j, self.model.forward(step))
            tok = self.later_sample(rec, win, j, logits, step.input_ids)
            tokens.append(tok)
        state.tokens = torch.stack(tokens, 1)

    # The pieces of a window's later steps, which a parallel rank runs with its own forward (a
    # pipeline stage's) and only its sampling rank samples (tfuture.distributed.window_step).

    def later_setup(self, rec: InFlight, first: torch.Tensor) -> LaterSteps:
        """FORWARD STREAM: what the later steps of window ``rec`` share, from ``first``, the
        window's first tokens (``[n_sample]`` int, -1 where a row got none)."""
        state: WindowState = rec.state
        fwd, n, k = state.fwd, state.n_sample, state.n_steps
        assert fwd is not None
        first = first.to(torch.int64)
        dev = first.device
        rows = torch.arange(n, dtype=torch.int64, device=dev)
        # Each request's last input position, then one more per later step: [k + 1, n].
        pos = fwd.positions.index_select(0, fwd.sample_rows) + torch.arange(k + 1, device=dev).unsqueeze(1)
        params = None
        if state.rp is not None:
            words = state.extra.params
            params = (words[: 3 * n].view(torch.float64).view(3, n), words[3 * n : 4 * n], words[4 * n :])
        return LaterSteps(
            first,
            rows,
            torch.arange(n + 1, dtype=torch.int64, device=dev),
            fwd.req_ids.index_select(0, fwd.sample_reqs),
            pos,
            params,
            rows.new_zeros(n),
            rows.new_zeros(n, dtype=torch.bool),
        )

    def later_batch(self, rec: InFlight, win: LaterSteps, j: int, tok: torch.Tensor) -> ForwardBatch:
        """FORWARD STREAM: the batch of later step ``j`` (1-based after the first), fed ``tok``
        (``[n_sample]`` int64, the previous step's tokens) at the next position."""
        state: WindowState = rec.state
        assert state.fwd is not None
        # A row with no valid token (all NaN or -inf: -1) feeds 0; the host raises on its -1.
        ids = tok.clamp_min(0).to(state.fwd.input_ids.dtype)
        rows = win.rows
        return ForwardBatch(
            rec.step,
            ids,
            win.pos[j],
            rows,
            win.req_ids,
            win.pos[j + 1],
            rows,
            rows,
            win.starts,
            state.later[j - 1],
        )

    def later_logits(self, rec: InFlight, j: int, logits: Any) -> torch.Tensor:
        """``logits`` of later step ``j``, checked: ``[n_sample, vocab]``, else a ValueError."""
        n, k = rec.state.n_sample, rec.state.n_steps
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != n:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(
                f"forward of step {rec.step} (decode {j + 1} of {k}) must return "
                f"[{n}, vocab] logits, got {got}"
            )
        return logits

    def later_sample(
        self, rec: InFlight, win: LaterSteps, j: int, logits: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """FORWARD STREAM: later step ``j``'s tokens ``[n_sample]`` (int64, -1 where a row has
        none) from its ``logits`` and its input ``ids``, as the Sampler samples; the device
        penalty history records them."""
        state: WindowState = rec.state
        if state.pen is None and win.params is None:
            return greedy_tokens(logits)  # greedy without penalties: the argmax
        sampler, n, rows = self.sampler, state.n_sample, win.rows
        assert sampler is not None
        if state.pen is not None:
            logits = penalise_rows(logits, sampler.history, state.pen, state.extra.penalties, ids)
        rp = state.rp if state.rp is not None else GREEDY_ROWS
        w = verify_rows(logits, win.none, win.off, rows, n, 1, rp, win.params, win.pos[j + 1])
        if state.pen is not None:
            record_committed(sampler.history, state.extra.hist_req, w.committed, w.n_commit)
        return w.last

    def _store_last(self, rec: InFlight) -> None:
        """FORWARD STREAM: each request's last token of the window into its fresh slot."""
        state: WindowState = rec.state
        assert self.fmap is not None and state.tokens is not None
        self.fmap.launch_store(rec.out, state.tokens[:, -1].clamp_min(0))

    # -- host, after copy_done ---------------------------------------------------------------

    def n_result(self, rec: InFlight) -> int:
        return rec.out._n * rec.state.n_steps

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        state: WindowState = rec.state
        if state.n_steps == 1:
            super().copy_result(rec, dst)
        elif state.tokens is not None:
            dst.copy_(state.tokens.reshape(-1), non_blocking=True)

    def result_array(self, rec: InFlight) -> np.ndarray | None:
        return super().result_array(rec) if rec.state.n_steps == 1 else None

    def result(self, rec: InFlight, words: np.ndarray) -> StepResult:
        state: WindowState = rec.state
        k = state.n_steps
        if k == 1:
            return super().result(rec, words)
        n = state.n_sample
        check_committed(rec.step, rec.batch, state.sample_reqs, words, self._vocab, lambda t: t // k)
        counts = np.full(n, k, dtype=np.int64)
        return DraftResult(rec.step, rec.batch, words.astype(np.int64), counts, np.zeros(n, dtype=np.int64))
