"""Multi-step decode windows on a tensor- and pipeline-parallel rank: :class:`ParallelWindowStep`.

It is :class:`tfuture.distributed.step.ParallelStep` whose token step is the multi-step one
(:class:`tfuture.spec.MultiStepTokenStep`): a :class:`tfuture.spec.DraftBatch` with
``n_steps = K > 1`` (``ContinuousBatcher(multi_step=K)``) runs ``K`` decode steps in one
runtime step, and its *payload* is ``K`` tokens per request, ``[n_sample * K]`` int64 (request
by request, step by step): what the host reads back as one :class:`tfuture.spec.DraftResult`
(``n_commit = K``), as on one rank.

A window's first step is the token step's, as in :class:`ParallelStep` (prepare, the stages'
``forward`` with ``recv_hidden``/``send_hidden``, ``sample`` on the last stage's tensor rank 0,
``broadcast`` over the last stage's tensor group). Then ``decode``, on every rank: each later
step ``j`` is a full traversal of the stages, in lockstep:

* the first stage feeds every request the tokens of step ``j - 1`` at the next position; each
  stage forwards (the model all-reduces inside) and sends its hidden state to the next stage;
* on the last stage, tensor rank 0 samples step ``j`` as :class:`tfuture.spec.MultiStepTokenStep`
  does (greedy argmax, or ``verify_rows`` with no drafts: draws keyed by (seed, position), and
  penalties with the device history only that rank keeps) and broadcasts the tokens over the
  tensor group, so every tensor rank feeds the same tokens;
* the last stage sends each step's tokens to every earlier stage before the next step's
  forward (a blocking receive there: the next step needs them). They go over the stages'
  ``hidden_group``, from the last stage back: a direction hidden states never take, so they
  never queue behind the ``token_group``'s payloads of micro-batches still in the pipe.

So every rank holds the window's payload at the end of its own step, and the step that
delivers it (``pp - 1`` steps later, :mod:`tfuture.distributed.micro`) takes it with no
transfer: ``store`` puts each request's *last* token into its fresh slot on every rank (``-1``,
a row with no valid token, is stored as 0 and raises on the host); in debug mode the store
also checks that every rank holds the same payload (a digest, a host sync). A window holds the
pipeline for its ``K - 1`` later steps: the other micro-batches wait.

A batch with ``n_steps = 1`` (a prefill chunk alone, a grammar request) runs as the plain
:class:`ParallelStep`, with the same Sampler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tfuture.core.batch import Batch
from tfuture.distributed.checks import RankDivergence, diverging_ranks
from tfuture.distributed.context import ParallelContext
from tfuture.distributed.micro import MicroResult
from tfuture.distributed.stage import MicroState, StageModel
from tfuture.distributed.step import ParallelStep
from tfuture.sampling import Sampler
from tfuture.spec.batch import DraftResult, check_committed
from tfuture.spec.multistep import MultiStepTokenStep, WindowState
from tfuture.steps.base import InFlight, Op

__all__ = ["ParallelWindowStep"]


class MicroWindowState(MicroState, WindowState):
    """A micro-batch on this rank that may be a window: the pipe's fields and the window's."""


class ParallelWindowStep(ParallelStep, MultiStepTokenStep):
    """Runs ``model`` (this rank's :class:`StageModel`) as its part of a ``tp x pp`` run whose
    schedulers give multi-step windows (see the module docstring).

    ``check``: the debug checks of :class:`ParallelStep`, and every window's tokens compared
    across ranks. ``sampler``: every rank's own :class:`tfuture.sampling.Sampler` (a default one
    if None; a window samples with it, never with the model's ``sample``); no ``buckets`` (a
    window's later steps are never padded).
    """

    state_type = MicroWindowState
    windows = True
    stream_ops = tuple(dict.fromkeys((*MultiStepTokenStep.stream_ops, *ParallelStep.comm_ops)))

    def __init__(
        self,
        model: StageModel,
        ctx: ParallelContext,
        *,
        check: bool = False,
        sampler: Sampler | None = None,
    ) -> None:
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        if sampler is not None and not isinstance(sampler, Sampler):
            raise TypeError(
                f"sampler must be a tfuture.sampling.Sampler or None, got {type(sampler).__name__}"
            )
        ParallelStep.__init__(
            self, model, ctx, check=check, sampler=sampler if sampler is not None else Sampler()
        )

    # -- host, at launch ---------------------------------------------------------------------

    def plan_micro(self, micro: Batch) -> tuple[MicroState, Any, int]:
        plan = MultiStepTokenStep.plan(self, micro)  # the window's host mirrors and plans too
        state = plan.state
        assert isinstance(state, MicroWindowState)
        return state, plan.inputs, state.n_sample

    def payload_size(self, state: MicroState) -> int:
        assert isinstance(state, MicroWindowState)
        return state.n_sample * state.n_steps

    # -- forward stream ----------------------------------------------------------------------

    def produce_ops(self, rec: InFlight) -> list[Op]:
        state = rec.state
        if state.n_steps == 1:
            return super().produce_ops(rec)
        ops: list[Op] = []
        if self.ctx.is_last_stage:
            if self.samples:
                ops += self.sample_here_ops(rec)
            if self.ctx.tp > 1:

                def broadcast() -> None:
                    state.sampled = self._share(state.sampled, state.n_sample)

                ops.append(("broadcast", broadcast))
        ops.append(("decode", lambda: self._decode_window(rec)))
        return ops

    def holds_payload(self, done: MicroState) -> bool:
        assert isinstance(done, MicroWindowState)
        return done.n_steps > 1 or self.ctx.is_last_stage  # a window's: every stage made it

    def _share(self, tokens: torch.Tensor | None, n: int) -> torch.Tensor:
        """FORWARD STREAM, last stage: tensor rank 0's ``tokens`` (``[n]`` int64) on every
        tensor rank of the stage (the others pass None and get a fresh tensor)."""
        ctx = self.ctx
        if tokens is None:
            tokens = torch.empty(n, dtype=torch.int64, device=ctx.device)
        elif tokens.dtype != torch.int64 or not tokens.is_contiguous():
            tokens = tokens.to(torch.int64).contiguous()
        if ctx.tp > 1:
            dist.broadcast(tokens, src=ctx.rank_of(ctx.pp_rank, 0), group=ctx.tp_group)
        return tokens

    def _send_back(self, step: int, tokens: torch.Tensor) -> None:
        """FORWARD STREAM, last stage of a pipeline: a window step's ``tokens`` to every earlier
        stage (this rank's tensor rank there), over the ``hidden_group`` (module docstring)."""
        ctx = self.ctx
        for s in range(ctx.pp - 1):
            self._isend(step, tokens, ctx.rank_of(s, ctx.tp_rank), ctx.hidden_group)

    def _recv_back(self, n: int) -> torch.Tensor:
        """FORWARD STREAM, a stage before the last: a window step's ``[n]`` int64 tokens."""
        ctx = self.ctx
        tokens = torch.empty(n, dtype=torch.int64, device=ctx.device)
        dist.recv(tokens, src=ctx.rank_of(ctx.pp - 1, ctx.tp_rank), group=ctx.hidden_group)
        return tokens

    def _decode_window(self, rec: InFlight) -> None:
        """FORWARD STREAM: the window's later steps on this rank (module docstring), leaving the
        payload ``[n_sample * K]`` int64 in ``state.sampled``."""
        state: MicroWindowState = rec.state
        ctx, model, n, step = self.ctx, self.model, state.n_sample, rec.step
        last, pipe = ctx.is_last_stage, ctx.pp > 1
        state.logits = None  # the first step's (a rank that does not sample still holds them)
        if last:
            assert state.sampled is not None
            first = state.sampled
        else:
            first = self._recv_back(n)
        win = self.later_setup(rec, first)
        tokens, tok = [win.first], win.first
        for j in range(1, state.n_steps):
            if last and pipe:
                self._send_back(step, tok)
            batch = self.later_batch(rec, win, j, tok)
            hidden = None if ctx.is_first_stage else self._recv_hidden(n)
            out = model.forward(batch, hidden)  # type: ignore[call-arg]
            if last:
                logits = self.later_logits(rec, j, out)
                mine = self.later_sample(rec, win, j, logits, batch.input_ids) if self.samples else None
                tok = self._share(mine, n)
            else:
                self._send_hidden(step, out, n)
                tok = self._recv_back(n)
            tokens.append(tok)
        if last and pipe:
            self._send_back(step, tok)
        state.tokens = torch.stack(tokens, 1)
        state.sampled = state.tokens.reshape(-1)  # request by request, step by step

    def _recv_hidden(self, n: int) -> torch.Tensor:
        """FORWARD STREAM, a stage after the first: the previous stage's ``[n, hidden_size]``."""
        ctx, model = self.ctx, self.model
        width, dtype = int(model.hidden_size), model.hidden_dtype  # type: ignore[attr-defined]
        buf = torch.empty(n, width, dtype=dtype, device=ctx.device)
        dist.recv(buf, src=ctx.rank_of(ctx.pp_rank - 1, ctx.tp_rank), group=ctx.hidden_group)
        return buf

    def _send_hidden(self, step: int, out: Any, n: int) -> None:
        """FORWARD STREAM, a stage before the last: its ``[n, hidden_size]`` output, checked, to
        the next stage (a copy: the send reads it asynchronously)."""
        ctx, model = self.ctx, self.model
        want = (n, int(model.hidden_size))  # type: ignore[attr-defined]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != model.hidden_dtype:  # type: ignore[attr-defined]
            got = (
                f"{out.dtype} of shape {tuple(out.shape)}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            raise ValueError(
                f"stage {ctx.pp_rank}'s forward of step {step} (a window's later step) must return a "
                f"{model.hidden_dtype} hidden state of shape {want}, got {got}"  # type: ignore[attr-defined]
            )
        out = out.clone(memory_format=torch.contiguous_format)
        self._isend(step, out, ctx.rank_of(ctx.pp_rank + 1, ctx.tp_rank), ctx.hidden_group)

    def store_delivered(self, rec: InFlight, done: MicroState) -> None:
        assert isinstance(done, MicroWindowState)
        k = done.n_steps
        if k == 1:
            super().store_delivered(rec, done)
            return
        assert self.fmap is not None
        payload = rec.state.delivered
        # Each request's last token; -1 marks a row without a valid token: the map gets 0.
        self.fmap.store(rec.out, payload.view(-1, k)[:, -1].clamp(min=0).contiguous())
        if self.check:
            self._check_window(done.step, payload)

    def _check_window(self, step: int, payload: torch.Tensor) -> None:
        """FORWARD STREAM, debug: every rank delivered the same window tokens (a host sync)."""
        ctx = self.ctx
        bad = diverging_ranks(ctx, payload)
        if bad:
            raise RankDivergence(
                f"the window of step {step} diverged: the digest of its {payload.numel()} tokens differs "
                f"between rank 0 and rank(s) {bad} (this is rank {ctx.rank})"
            )

    # -- host, after copy_done ---------------------------------------------------------------

    def n_result(self, rec: InFlight) -> int:
        done = rec.state.delivers
        return 0 if done is None else int(done.n_own * done.n_steps)

    def result(self, rec: InFlight, words: np.ndarray) -> MicroResult:  # type: ignore[override]
        done = rec.state.delivers
        if done is None or done.micro is None or done.n_steps == 1:
            return super().result(rec, words)
        k, n = done.n_steps, done.n_sample
        check_committed(done.step, done.micro, done.sample_reqs, words, self._vocab, lambda t: t // k)
        counts = np.full(n, k, dtype=np.int64)
        window = DraftResult(
            done.step, done.micro, words.astype(np.int64), counts, np.zeros(n, dtype=np.int64)
        )
        return MicroResult(rec.step, done.group, window)
