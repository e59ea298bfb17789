"""Speculative decoding on a tensor- and pipeline-parallel rank: :class:`ParallelSpecStep`.

It is :class:`tfuture.distributed.step.ParallelStep` whose token step is the speculative one
(:class:`tfuture.spec.step.SpecTokenStep`), so its batches carry drafts and what travels from
the sampling rank is no longer one token per request but a *payload* of int64 words:

* each request's committed tokens ``[n_sample, width]`` and their count ``[n_sample]``, what
  the host reads back;
* the tokens of the micro-batch's fresh slots (each request's last committed token and its
  next ``k`` drafts), ``[n_own]`` (read back too when a grammar request drafted);
* the ``seq_len`` field of each of those slots (the request's true length), ``[n_own]``.

The last stage's tensor rank 0 verifies (greedy or rejection sampling) and drafts; every
other rank only forwards. The payload reaches the other tensor ranks by ``broadcast`` and the
earlier stages by ``send_tokens``, exactly where the plain step's tokens go; every rank then
stores it into its own map and ``seq_len`` field. A rank's next micro-batch of the group takes
its positions from that field on its own device, so the ranks agree on the accepted lengths
with no host sync, and the host learns them when it processes the delivering step.

The drafter is the sampling rank's: it alone observes, drafts and releases. Every rank
passes one with the same ``k`` (checked before the run), bound by the caller.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tfuture.core.batch import Batch
from tfuture.distributed.context import ParallelContext
from tfuture.distributed.micro import MicroResult
from tfuture.distributed.stage import MicroState, StageModel
from tfuture.distributed.step import ParallelStep
from tfuture.sampling import Sampler
from tfuture.spec.drafter import Drafter
from tfuture.spec.step import SpecTokenStep
from tfuture.spec.step_result import SpecState
from tfuture.steps.base import InFlight, Op
from tfuture.steps.token import Buckets

__all__ = ["ParallelSpecStep"]


class MicroSpecState(MicroState, SpecState):
    """A speculative micro-batch on this rank: the pipe's fields and the verification's."""


class ParallelSpecStep(ParallelStep, SpecTokenStep):
    """Runs ``model`` (this rank's :class:`StageModel`) as its part of a speculative ``tp x pp``
    run with ``drafter`` (see the module docstring). ``check``, ``sampler`` and ``buckets`` as
    for :class:`ParallelStep` (padding as :class:`tfuture.spec.SpecTokenStep` pads)."""

    state_type = MicroSpecState
    keeps_out = True
    stream_ops = (
        *SpecTokenStep.stream_ops,
        "pack",
        *ParallelStep.comm_ops,
    )

    def __init__(
        self,
        model: StageModel,
        ctx: ParallelContext,
        drafter: Drafter,
        *,
        check: bool = False,
        sampler: Sampler | None = None,
        buckets: Buckets | None = None,
    ) -> None:
        self.take_drafter(drafter)
        ParallelStep.__init__(
            self,
            model,
            ctx,
            check=check,
            buckets=buckets,
            sampler=sampler if sampler is not None else Sampler(),
        )
        self.drafts = self.samples

    # -- host, at launch ---------------------------------------------------------------------

    def plan_micro(self, micro: Batch) -> tuple[MicroState, Any, int]:
        state, staged, n_out = self.plan_spec(micro)
        assert isinstance(state, MicroSpecState)
        return state, staged, n_out

    # -- forward stream ----------------------------------------------------------------------

    def sample_here_ops(self, rec: InFlight) -> list[Op]:
        return [
            ("verify", lambda: self._verify(rec)),
            ("draft", lambda: self._draft(rec)),
            ("pack", lambda: self._pack(rec.state)),
        ]

    def payload_size(self, state: MicroState) -> int:
        assert isinstance(state, MicroSpecState)
        return 2 * state.n_out + state.n_sample * (state.width + 1)

    def _pack(self, state: MicroSpecState) -> None:
        """The payload (module docstring), one fresh int64 tensor: it is sent asynchronously
        and stored ``pp - 1`` steps later."""
        v, inputs = state.verified, state.inputs
        assert v is not None and state.store_tokens is not None and state.new_len is not None
        parts = (
            v.committed.reshape(-1),
            v.n_commit,
            state.store_tokens,
            state.new_len.index_select(0, inputs.out_req),
        )
        state.sampled = torch.cat([p.to(torch.int64) for p in parts])

    def store_delivered(self, rec: InFlight, done: MicroState) -> None:
        assert self.fmap is not None and self.fields is not None
        assert isinstance(done, MicroSpecState)
        payload, n, at = rec.state.delivered, done.n_own, done.n_sample * (done.width + 1)
        self.fmap.launch_store(rec.out, payload[at : at + n])
        self.fields.store(rec.out, {"seq_len": payload[at + n : at + 2 * n]})

    # -- host, after copy_done ---------------------------------------------------------------

    def n_tokens(self, result: MicroResult) -> int:  # type: ignore[override]
        return result.n_tokens

    def n_result(self, rec: InFlight) -> int:
        done = rec.state.delivers
        if done is None or done.micro is None:
            return 0
        return int(done.n_sample * (done.width + 1) + done.n_stored)

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        if len(dst):
            dst.copy_(rec.state.delivered[: len(dst)], non_blocking=True)

    def result(self, rec: InFlight, words: np.ndarray) -> MicroResult:  # type: ignore[override]
        done = rec.state.delivers
        if done is None or done.micro is None:
            return MicroResult(rec.step, -1, None)
        return MicroResult(rec.step, done.group, self.draft_result(done.step, done.micro, done, words))
