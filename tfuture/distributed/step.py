"""The step kind of a tensor- and pipeline-parallel rank: :class:`ParallelStep`.

Every rank runs the same loop and scheduler; what differs is what its stream does. Step ``n``
forwards micro-batch ``m_n`` and delivers the tokens of ``m_{n-lag}``, ``lag = pp - 1``
(:mod:`tfuture.distributed.micro`). On the forward stream of stage ``s``, tensor rank ``t``:

* ``prepare``: the fused resolve against this rank's own map (every rank stores every token);
* ``recv_hidden`` (``s > 0``), ``forward`` (all-reduces inside the model), ``send_hidden``
  (``s < pp - 1``, ``isend``: the next micro-batch does not wait for it);
* last stage: ``sample`` on tensor rank 0, ``broadcast`` over the stage's tensor group (every
  rank then holds the same tokens), ``isend`` of the tokens to every earlier stage;
* ``recv_tokens`` of ``m_{n-lag}`` from the last stage (the last stage takes its own), ``store``
  into the step's fresh slots, then the runtime's ``copy`` and ``copy_done``.

So the first stage stores a token sampled on another rank on its forward stream, and the
next micro-batch of that group resolves its placeholders from the map with no host sync.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tfuture.core.batch import ForwardBatch, StepResult
from tfuture.core.future_map import FutureMap
from tfuture.distributed.checks import check_batch, check_stored_tokens
from tfuture.distributed.context import ParallelContext
from tfuture.distributed.micro import MicroBatch, MicroResult
from tfuture.distributed.stage import (
    MicroState,
    StageModel,
    bubble,
    check_mask,
    check_mask_width,
    is_delayed,
    plan_micro,
)
from tfuture.steps.base import InFlight, Op, StepKind, StepPlan

__all__ = ["ParallelStep", "StageModel"]


class ParallelStep(StepKind):
    """Runs ``model`` (this rank's :class:`StageModel`) as its part of a ``tp x pp`` run.

    ``check``: the debug checks of :mod:`tfuture.distributed.checks` each step (host syncs).
    """

    stream_ops = (
        *StepKind.stream_ops,
        "release",
        "recv_hidden",
        "forward",
        "send_hidden",
        "sample",
        "send_tokens",
        "take_tokens",
        "recv_tokens",
        "store",
        "check_tokens",
    )

    def __init__(self, model: StageModel, ctx: ParallelContext, *, check: bool = False) -> None:
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        if ctx.pp > 1:
            for name in ("hidden_size", "hidden_dtype"):
                if not hasattr(model, name):
                    raise TypeError(
                        f"a pipeline stage model needs a {name} attribute; {type(model).__name__} has none"
                    )
        self.model, self.ctx, self.check = model, ctx, bool(check)
        self.lag = ctx.pp - 1
        self.fmap: FutureMap | None = None
        self._fifo: deque[MicroState] = deque()
        self._sends: deque[tuple[int, Any, torch.Tensor]] = deque()
        self._leftover: list[Any] = []

    def bind(self, fmap: FutureMap) -> None:
        if fmap.device.type != self.ctx.device.type:
            raise ValueError(
                f"the FutureMap lives on {fmap.device}, but this rank's backend {self.ctx.backend} runs on "
                f"{self.ctx.device}"
            )
        self.fmap = fmap

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
        if micro is None:
            state, inputs = bubble()
        else:
            if micro.out is not None or micro.step >= 0:
                raise ValueError(
                    f"group {batch.group}'s schedule() returned a batch that was already launched"
                )
            state, inputs = plan_micro(micro, batch.group)
        queue = [*self._fifo, state]
        state.delivers = queue[0] if len(queue) > self.lag else None
        n_out = 0 if state.delivers is None else state.delivers.n_sample
        return StepPlan(n_out, inputs, state)

    def delayed(self, batch: MicroBatch) -> bool:
        return batch.micro is not None and is_delayed(batch.micro)

    def prepare(self, rec: InFlight, inputs: Sequence[torch.Tensor]) -> None:
        fmap, state = self.fmap, rec.state
        assert fmap is not None
        if state.micro is None or state.n_tok == 0:
            return
        tokens, seg, prefix, rids, lens, sreq = inputs
        prepared = fmap.launch_prepare(tokens, seg, prefix, state.n_tok, None)
        sample_rows = prepared.last_rows.index_select(0, sreq)
        state.fwd = ForwardBatch(rec.step, *prepared, rids, lens, sreq, sample_rows, seg, state.host)

    def forward_ops(self, rec: InFlight) -> list[Op]:
        ctx, state, model = self.ctx, rec.state, self.model
        fmap = self.fmap
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
            check_batch(ctx, rec.step, state.micro, rec.out.slots, fmap.in_use)
        ops: list[Op] = []
        release = getattr(model, "release", None)
        if state.ended.size and release is not None:
            ended = state.ended
            ops.append(("release", lambda: release(ended)))
        if state.n_tok == 0:
            return ops
        dev, step = ctx.device, rec.step
        if not ctx.is_first_stage:
            n, width, dtype = state.n_tok, int(model.hidden_size), model.hidden_dtype
            src = ctx.rank_of(ctx.pp_rank - 1, ctx.tp_rank)

            def recv_hidden() -> None:
                buf = torch.empty(n, width, dtype=dtype, device=dev)
                dist.recv(buf, src=src, group=ctx.hidden_group)
                state.hidden_in = buf

            ops.append(("recv_hidden", recv_hidden))

        def forward() -> None:
            out = model.forward(state.fwd, state.hidden_in)
            state.hidden_in = None
            if out is None:
                raise ValueError("forward must return logits (last stage) or a hidden state, got None")
            if not ctx.is_last_stage:
                want = (state.n_tok, int(model.hidden_size))
                if tuple(out.shape) != want or out.dtype != model.hidden_dtype:
                    raise ValueError(
                        f"stage {ctx.pp_rank}'s forward must return a {model.hidden_dtype} hidden state of "
                        f"shape {want}, got {out.dtype} of shape {tuple(out.shape)}"
                    )
            state.out = out

        ops.append(("forward", forward))
        if not ctx.is_last_stage:
            dst = ctx.rank_of(ctx.pp_rank + 1, ctx.tp_rank)

            def send_hidden() -> None:
                assert state.out is not None
                # A copy: a model may hand back a reused (CUDA-graph) buffer, and the send reads
                # it asynchronously, maybe after the next forward rewrote it.
                self._isend(
                    step, state.out.clone(memory_format=torch.contiguous_format), dst, ctx.hidden_group
                )
                state.out = None

            ops.append(("send_hidden", send_hidden))
        return ops

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        ctx, state, fmap = self.ctx, rec.state, self.fmap
        assert fmap is not None
        if mask is not None:
            state.mask = check_mask(mask, state, rec.step)
            if state.mask.is_cuda:  # built on the caller's stream: the forward stream waits for it
                state.mask_ready = torch.cuda.Event()
                state.mask_ready.record()
            elif ctx.device.type == "cuda":  # pinned: the H2D copy on the stream stays async
                state.mask = state.mask.pin_memory()
        ops: list[Op] = []
        if ctx.is_last_stage and state.n_sample:
            ops.append(("sample", lambda: self._sample(state)))
            if ctx.pp > 1:
                ops.append(("send_tokens", lambda: self._send_tokens(rec.step, state)))
        done = state.delivers
        if done is None or done.n_sample == 0:
            return ops
        if ctx.is_last_stage:

            def take() -> None:
                state.delivered, done.sampled = done.sampled, None

            ops.append(("take_tokens", take))
        else:
            n, src, dev = done.n_sample, ctx.rank_of(ctx.pp - 1, ctx.tp_rank), ctx.device

            def recv_tokens() -> None:
                buf = torch.empty(n, dtype=torch.int64, device=dev)
                dist.recv(buf, src=src, group=ctx.token_group)
                state.delivered = buf

            ops.append(("recv_tokens", recv_tokens))
        out = rec.out

        def store() -> None:
            fmap.store(out, state.delivered)

        ops.append(("store", store))
        if self.check:
            slots, step = out.slots, rec.step
            ops.append(("check_tokens", lambda: check_stored_tokens(ctx, step, fmap.token_map, slots)))
        return ops

    # -- forward stream ----------------------------------------------------------------------

    def _sample(self, state: MicroState) -> None:
        """Tensor rank 0 samples; the broadcast gives every rank of the stage the same tokens."""
        ctx, n = self.ctx, state.n_sample
        if ctx.tp_rank == 0:
            if state.mask_ready is not None:
                torch.cuda.current_stream(ctx.device).wait_event(state.mask_ready)
            assert state.out is not None and state.fwd is not None
            mask = None
            if state.mask is not None:
                vocab = state.out.shape[-1]
                check_mask_width(state, vocab, state.step)
                # The whole pinned tensor, sliced on the device: a strided view of it would be
                # copied through a pageable temporary, a copy that waits for the stream.
                mask = state.mask.to(ctx.device, non_blocking=True)[:, :vocab]
            tokens = self.model.sample(state.out, state.fwd, mask)
            if (
                not isinstance(tokens, torch.Tensor)
                or tuple(tokens.shape) != (n,)
                or tokens.is_floating_point()
            ):
                got = (
                    f"{tokens.dtype} {tuple(tokens.shape)}"
                    if isinstance(tokens, torch.Tensor)
                    else type(tokens)
                )
                raise ValueError(f"sample must return [{n}] integer token ids, got {got}")
            # A copy: the tokens are stored ``lag`` steps later and sent asynchronously, and a
            # model may return a reused buffer.
            tokens = tokens.to(torch.int64, copy=True)
        else:
            tokens = torch.empty(n, dtype=torch.int64, device=ctx.device)
        if ctx.tp > 1:
            dist.broadcast(tokens, src=ctx.rank_of(ctx.pp_rank, 0), group=ctx.tp_group)
        state.sampled, state.out = tokens, None

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

    def n_result(self, rec: InFlight) -> int:
        return len(rec.out)

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        if len(rec.out):
            dst.copy_(rec.state.delivered, non_blocking=True)

    def result(self, rec: InFlight, words: np.ndarray) -> MicroResult:
        done = rec.state.delivers
        if done is None or done.micro is None:
            return MicroResult(rec.step, -1, None)
        return MicroResult(rec.step, done.group, StepResult(done.step, done.micro, words))

    def n_tokens(self, result: MicroResult) -> int:
        return result.n_tokens

    def close(self) -> None:
        # Sends still in flight are waited for by finish_sends() after a clean run; after a
        # failure their peers may be gone, so they are only dropped.
        self._leftover = [work for _, work, _ in self._sends]
        self._sends.clear()
        self._fifo.clear()
        close: Callable[[], None] | None = getattr(self.model, "close", None)
        if close is not None:
            close()

    def drop_sends(self) -> None:
        """After a failure: forget the sends in flight (their peers may be gone)."""
        self._sends.clear()
        self._leftover = []

    def finish_sends(self) -> None:
        """Host, after a clean run: wait until every send of the run was received."""
        leftover, self._leftover = self._leftover, []
        for work in leftover:
            work.wait()
