"""The step kind of a tensor- and pipeline-parallel rank: :class:`ParallelStep`, the token step
plus communication ops.

Every rank runs the same loop and scheduler; what differs is what its stream does. Step ``n``
forwards micro-batch ``m_n`` and delivers the tokens of ``m_{n-lag}``, ``lag = pp - 1``
(:mod:`tfuture.distributed.micro`). On the forward stream of stage ``s``, tensor rank ``t``,
the token step's ops (:class:`tfuture.steps.token.TokenStep`: prepare, release, forward,
sample, store) with these around them:

* ``prepare``: the fused resolve against this rank's own map (every rank stores every token);
* ``recv_hidden`` (``s > 0``) before the ``forward`` (all-reduces inside the model), and
  ``send_hidden`` (``s < pp - 1``, ``isend``: the next micro-batch does not wait for it) after;
* last stage: ``sample`` (and ``sample_now``) on tensor rank 0 only, with the step's sample
  path (tfuture's Sampler with per-request parameters and penalties, or the model's own
  ``sample``; masks and ``delay="rows"`` as on one rank), ``broadcast`` over the stage's tensor
  group (every rank then holds the same tokens), ``send_tokens`` (``isend``) to every earlier
  stage;
* ``recv_tokens`` of ``m_{n-lag}`` from the last stage (the last stage ``take_tokens`` its own),
  ``store`` into the step's fresh slots, then the runtime's ``copy`` and ``copy_done``.

So the first stage stores a token sampled on another rank on its forward stream, and the
next micro-batch of that group resolves its placeholders from the map with no host sync.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tfuture.core.batch import Batch, StepResult
from tfuture.core.future_map import FutureMap
from tfuture.distributed.checks import check_batch, check_stored_tokens
from tfuture.distributed.context import ParallelContext
from tfuture.distributed.micro import MicroBatch, MicroResult
from tfuture.distributed.stage import MicroState, StageModel
from tfuture.sampling import Sampler
from tfuture.steps.base import InFlight, Op, StepPlan
from tfuture.steps.checks import check_sampled
from tfuture.steps.token import Buckets, TokenInputs, TokenStep

__all__ = ["ParallelStep", "StageModel"]

_EMPTY = np.zeros(0, dtype=np.int64)


def _bubble() -> Batch:
    """An empty micro-batch: it forwards nothing, but its step still delivers tokens."""
    return Batch(_EMPTY, _EMPTY, _EMPTY, _EMPTY, np.zeros(0, dtype=np.bool_))


class ParallelStep(TokenStep):
    """Runs ``model`` (this rank's :class:`StageModel`) as its part of a ``tp x pp`` run.

    ``check``: the debug checks of :mod:`tfuture.distributed.checks` each step (host syncs).
    ``buckets`` and ``sampler`` as for :class:`tfuture.steps.token.TokenStep` (every rank plans
    the same sampling; only the last stage's tensor rank 0 runs the sampler on its stream).
    """

    state_type = MicroState
    #: The ops it adds to the token step's.
    comm_ops = (
        "recv_hidden",
        "send_hidden",
        "broadcast",
        "send_tokens",
        "take_tokens",
        "recv_tokens",
        "check_tokens",
    )
    stream_ops = (*TokenStep.stream_ops, *comm_ops)

    def __init__(
        self,
        model: StageModel,
        ctx: ParallelContext,
        *,
        check: bool = False,
        buckets: Buckets | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        if ctx.pp > 1:
            for name in ("hidden_size", "hidden_dtype"):
                if not hasattr(model, name):
                    raise TypeError(
                        f"a pipeline stage model needs a {name} attribute; {type(model).__name__} has none"
                    )
        # The token step's constructor by name: a subclass may put another token step (the
        # speculative one) between this class and TokenStep in its method order.
        TokenStep.__init__(self, model, buckets, sampler)  # type: ignore[arg-type]
        self.ctx, self.check = ctx, bool(check)
        self.samples = ctx.is_last_stage and ctx.tp_rank == 0
        self.lag = ctx.pp - 1
        self._fifo: deque[MicroState] = deque()
        self._sends: deque[tuple[int, Any, torch.Tensor]] = deque()
        self._leftover: list[Any] = []

    def bind(self, fmap: FutureMap) -> None:
        if fmap.device.type != self.ctx.device.type:
            raise ValueError(
                f"the FutureMap lives on {fmap.device}, but this rank's backend {self.ctx.backend} runs on "
                f"{self.ctx.device}"
            )
        super().bind(fmap)

    def reset(self) -> None:
        """Forget the last run's pipe (a new run starts with an empty pipe)."""
        self._fifo.clear()
        self._sends.clear()
        self._leftover = []

    def undelivered_groups(self) -> set[int]:
        return {m.group for m in self._fifo if m.micro is not None}

    def real_undelivered(self) -> bool:
        return any(m.micro is not None for m in self._fifo)

    # -- host, at launch ---------------------------------------------------------------------

    def plan(self, batch: Any) -> StepPlan:
        if not isinstance(batch, MicroBatch):
            raise TypeError(f"a ParallelStep launches MicroBatch objects, got {type(batch).__name__}")
        micro = batch.micro
        if micro is not None and (micro.out is not None or micro.step >= 0):
            raise ValueError(f"group {batch.group}'s schedule() returned a batch that was already launched")
        state, inputs, n_own = self.plan_micro(micro if micro is not None else _bubble())
        state.n_own, state.micro, state.group = n_own, micro, batch.group
        queue = [*self._fifo, state]
        state.delivers = queue[0] if len(queue) > self.lag else None
        n_out = 0 if state.delivers is None else state.delivers.n_own
        return StepPlan(n_out, inputs, state, bool(state.late.size))

    def plan_micro(self, micro: Batch) -> tuple[MicroState, Any, int]:
        """HOST: a micro-batch's record, its staged inputs and how many slots its tokens take
        when they are delivered (here one per sampling request)."""
        state, inputs = self.plan_batch(micro)
        assert isinstance(state, MicroState)
        return state, inputs, state.n_sample

    # -- forward stream ----------------------------------------------------------------------

    def prepare(self, rec: InFlight, inputs: TokenInputs) -> None:
        if rec.state.host.n_tokens:  # a bubble or an empty micro-batch forwards nothing
            super().prepare(rec, inputs)

    def forward_ops(self, rec: InFlight) -> list[Op]:
        state, fmap = rec.state, self.fmap
        assert fmap is not None
        # Host bookkeeping, in launch order: the pipe advances by one micro-batch.
        self._fifo.append(state)
        if len(self._fifo) > self.lag:
            done = self._fifo.popleft()
            assert done is state.delivers
            if done.micro is not None:
                done.micro.out = rec.out  # the runtime releases it after this step was processed
        state.step = rec.step
        if state.micro is not None:
            state.micro.step = rec.step
        if self.check:
            check_batch(self.ctx, rec.step, state.micro, rec.out.slots, fmap.in_use)
        return super().forward_ops(rec)

    def model_ops(self, rec: InFlight) -> list[Op]:
        """``recv_hidden``, ``forward``, ``send_hidden``, as far as this stage has them."""
        ctx, state, model = self.ctx, rec.state, self.model
        if not state.host.n_tokens:
            return []
        ops: list[Op] = []
        dev, step, n_rows = ctx.device, rec.step, state.n_rows
        if not ctx.is_first_stage:
            width, dtype = int(model.hidden_size), model.hidden_dtype  # type: ignore[attr-defined]
            src = ctx.rank_of(ctx.pp_rank - 1, ctx.tp_rank)

            def recv_hidden() -> None:
                buf = torch.empty(n_rows, width, dtype=dtype, device=dev)
                dist.recv(buf, src=src, group=ctx.hidden_group)
                state.hidden_in = buf

            ops.append(("recv_hidden", recv_hidden))

        def forward() -> None:
            out = model.forward(state.fwd, state.hidden_in)  # type: ignore[call-arg]
            state.hidden_in = None
            if out is None:
                raise ValueError("forward must return logits (last stage) or a hidden state, got None")
            if ctx.is_last_stage:
                state.logits = out
                return
            want = (n_rows, int(model.hidden_size))  # type: ignore[attr-defined]
            if tuple(out.shape) != want or out.dtype != model.hidden_dtype:  # type: ignore[attr-defined]
                raise ValueError(
                    f"stage {ctx.pp_rank}'s forward must return a {model.hidden_dtype} hidden state of "  # type: ignore[attr-defined]
                    f"shape {want}, got {out.dtype} of shape {tuple(out.shape)}"
                )
            state.hidden_out = out

        ops.append(("forward", forward))
        if not ctx.is_last_stage:
            dst = ctx.rank_of(ctx.pp_rank + 1, ctx.tp_rank)

            def send_hidden() -> None:
                assert state.hidden_out is not None
                # A copy: a model may hand back a reused (CUDA-graph) buffer, and the send reads
                # it asynchronously, maybe after the next forward rewrote it.
                out = state.hidden_out.clone(memory_format=torch.contiguous_format)
                self._isend(step, out, dst, ctx.hidden_group)
                state.hidden_out = None

            ops.append(("send_hidden", send_hidden))
        return ops

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        ctx, state, fmap = self.ctx, rec.state, self.fmap
        assert fmap is not None
        self.take_mask(rec, mask)  # every rank checks it: a bad mask fails on every rank
        ops = self.produce_ops(rec) if state.n_sample else []
        done = state.delivers
        if done is None or done.n_sample == 0:
            return ops
        if self.holds_payload(done):

            def take() -> None:
                state.delivered, done.sampled = done.sampled, None

            ops.append(("take_tokens", take))
        else:
            n, src, dev = self.payload_size(done), ctx.rank_of(ctx.pp - 1, ctx.tp_rank), ctx.device

            def recv_tokens() -> None:
                buf = torch.empty(n, dtype=torch.int64, device=dev)
                dist.recv(buf, src=src, group=ctx.token_group)
                state.delivered = buf

            ops.append(("recv_tokens", recv_tokens))
        ops.append(("store", lambda: self.store_delivered(rec, done)))
        if self.check:
            slots, step = rec.out.slots, rec.step
            ops.append(("check_tokens", lambda: check_stored_tokens(ctx, step, fmap.token_map, slots)))
        return ops

    # What a variant of the step (the speculative one) changes: what the sampling rank computes,
    # the int64 payload every rank gets from it, and what a rank stores from a delivered payload.

    def produce_ops(self, rec: InFlight) -> list[Op]:
        """This stage's ops that make a micro-batch's payload (``n_sample > 0``): the last
        stage's leave it in ``state.sampled`` on each of its tensor ranks and send it to the
        earlier stages; an earlier stage has none (it receives the payload on delivery)."""
        ctx, state = self.ctx, rec.state
        if not ctx.is_last_stage:
            return []
        ops = self.sample_here_ops(rec) if self.samples else []
        if ctx.tp > 1:
            ops.append(("broadcast", lambda: self._broadcast(state)))
        if ctx.pp > 1:
            ops.append(("send_tokens", lambda: self._send_tokens(rec.step, state)))
        return ops

    def sample_here_ops(self, rec: InFlight) -> list[Op]:
        """The ops of the last stage's tensor rank 0, leaving the payload in ``state.sampled``."""
        return [("sample", lambda: self._sample_here(rec))]

    def holds_payload(self, done: MicroState) -> bool:
        """Whether this rank holds ``done``'s payload in ``done.sampled`` when a step delivers
        it (the last stage), rather than receiving it from the last stage then."""
        return self.ctx.is_last_stage

    def payload_size(self, state: MicroState) -> int:
        """The int64 words a micro-batch's payload takes (its tokens)."""
        return state.n_sample

    def store_delivered(self, rec: InFlight, done: MicroState) -> None:
        """FORWARD STREAM: ``done``'s delivered payload into this step's fresh slots."""
        assert self.fmap is not None
        # -1 marks a row without a valid token: the map gets 0, the host copy raises.
        self.fmap.store(rec.out, rec.state.delivered.clamp(min=0))

    def _sample_here(self, rec: InFlight) -> None:
        """Tensor rank 0 of the last stage: the token step's sample (mask, rows, record)."""
        state = rec.state
        self.sample(rec)
        assert state.sampled is not None
        # A copy: the tokens are stored ``lag`` steps later and sent asynchronously, and a
        # model may return a reused buffer.
        state.sampled, state.logits = state.sampled.to(torch.int64, copy=True), None

    def _broadcast(self, state: MicroState) -> None:
        """Every tensor rank of the last stage gets tensor rank 0's tokens."""
        ctx = self.ctx
        if state.sampled is None:
            state.sampled = torch.empty(self.payload_size(state), dtype=torch.int64, device=ctx.device)
        dist.broadcast(state.sampled, src=ctx.rank_of(ctx.pp_rank, 0), group=ctx.tp_group)

    def _send_tokens(self, step: int, state: MicroState) -> None:
        ctx = self.ctx
        assert state.sampled is not None
        for s in range(ctx.pp - 1):
            self._isend(step, state.sampled, ctx.rank_of(s, ctx.tp_rank), ctx.token_group)

    def _isend(self, step: int, tensor: torch.Tensor, dst: int, group: Any) -> None:
        """``isend``, keeping the tensor alive; sends older than ``lag + 1`` steps are waited for
        (their receivers passed that step long ago, so this never blocks on a live pipe)."""
        sends = self._sends
        while sends and sends[0][0] <= step - self.lag - 1:
            sends.popleft()[1].wait()
        sends.append((step, dist.isend(tensor, dst=dst, group=group), tensor))

    # -- host, after copy_done ---------------------------------------------------------------

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        if len(rec.out):
            dst.copy_(rec.state.delivered, non_blocking=True)

    def result_array(self, rec: InFlight) -> np.ndarray | None:
        return None  # a rank may deliver nothing (copy_result copies only what it got)

    def result(self, rec: InFlight, words: np.ndarray) -> MicroResult:  # type: ignore[override]
        done = rec.state.delivers
        if done is None or done.micro is None:
            return MicroResult(rec.step, -1, None)
        check_sampled(words, done, done.step)
        return MicroResult(rec.step, done.group, StepResult(done.step, done.micro, words))

    def n_tokens(self, result: MicroResult) -> int:  # type: ignore[override]
        return result.n_tokens

    def close(self) -> None:
        # Sends still in flight are waited for by finish_sends() after a clean run; after a
        # failure their peers may be gone, so they are only dropped.
        self._leftover = [work for _, work, _ in self._sends]
        self._sends.clear()
        self._fifo.clear()
        super().close()

    def drop_sends(self) -> None:
        """After a failure: forget the sends in flight (their peers may be gone)."""
        self._sends.clear()
        self._leftover = []

    def finish_sends(self) -> None:
        """Host, after a clean run: wait until every send of the run was received."""
        leftover, self._leftover = self._leftover, []
        for work in leftover:
            work.wait()
