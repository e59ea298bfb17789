"""The speculative token step: a :class:`tfuture.steps.token.TokenStep` whose requests carry drafts.

It is the token step with three parts changed, the way
:class:`tfuture.distributed.step.ParallelStep` adds communication: the plan stages each
request's verification rows and sampling parameters; ``prepare`` takes the positions of the
requests that verify from their previous step's ``seq_len`` field (the accepted count never
visits the host) and shows the drafter the step's inputs; the sample becomes ``verify``
(greedy acceptance or rejection sampling, :mod:`tfuture.spec.verify`), ``draft`` (the
drafter's next drafts) and ``store`` (each request's last committed token and its drafts into
its slots, and the ``seq_len`` field); their per-row arithmetic, on a device and in numpy on the
CPU, is :mod:`tfuture.spec.step_rows`. The host reads back each request's committed tokens and
their count (:mod:`tfuture.spec.step_result`, with the step's record). Prefill chunks, plain
decodes (``k = 0``), ended requests, the KV cache and the runtime's staging, tracing, faults and
error path are the token step's own.

A request whose sample waits for a grammar mask (a delayed step) gets a mask row per
verification row (see :class:`tfuture.spec.DraftBatch`), applied to those rows before
verification, while the other requests of the step verify theirs; when such a request drafts,
the stored drafts come back to the host with the committed tokens (its next masks follow them).
Penalties: each verification row is scored with the history its token would have
(:mod:`tfuture.spec.penalties`). Tensor and pipeline parallel runs use it through
:class:`tfuture.distributed.spec_step.ParallelSpecStep`. ``buckets=`` pads its steps as the
token step pads its own (bucket-sized token rows and request counts for the model; verification,
drafting and the slots see the real requests only; ``ParallelRuntime(speculative=...,
buckets=...)`` pads every rank's steps the same way). Not yet: step graphs with drafts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tfuture.core.batch import Batch, Model
from tfuture.core.future_fields import FutureFields
from tfuture.core.future_map import FutureMap
from tfuture.kernels.bitmask import unpack_bitmask
from tfuture.sampling import Sampler
from tfuture.sampling.filters import greedy_tokens
from tfuture.sampling.plan import SamplerPlan
from tfuture.spec.batch import DraftBatch
from tfuture.spec.drafter import DraftContext, Drafter
from tfuture.spec.penalties import (
    penalise_rows,
    record_committed,
)
from tfuture.spec.staging import stage_drafts
from tfuture.spec.step_result import SpecResults, SpecState
from tfuture.spec.step_rows import new_lengths, out_lengths, store_tokens, true_positions
from tfuture.spec.verify import Verified, verify_greedy_host, verify_rows
from tfuture.steps.base import InFlight, Op, StepPlan
from tfuture.steps.masks import check_rows, check_width, mask_on_stream
from tfuture.steps.token import TokenStep
from tfuture.steps.token_state import Buckets, TokenInputs

__all__ = ["SpecTokenStep"]

_NONE = np.empty(0, dtype=np.int64)


class SpecTokenStep(SpecResults, TokenStep):
    """The token step of ``model`` with speculative requests (see the module docstring).

    Args:
        model: a :class:`tfuture.core.batch.Model` that returns logits for any rows its
            ``ForwardBatch.sample_rows`` names (as :class:`tfuture.models.HFCausalLM` does);
            here those are every verification row.
        drafter: a :class:`tfuture.spec.drafter.Drafter`, bound by the caller.
        sampler: the :class:`tfuture.sampling.Sampler` whose admitted parameters the rows use
            (a default one if None).
    """

    keeps_out = True  # drafts live only in the slots: sync mode names its last step's slots too
    # The ops it runs (a fault plan may name only these): the token step's sample, sample_now
    # and replay become verify and draft; the drafter's ended rows go back in prepare.
    stream_ops: tuple[str, ...] = (
        "prepare",
        "copy",
        "debug",
        "release",
        "forward",
        "verify",
        "draft",
        "store",
    )
    state_type = SpecState

    #: Whether this step's process drafts (observe, draft, release): a rank of a parallel run
    #: that does not verify leaves it to the one that does.
    drafts = True

    def __init__(
        self, model: Model, drafter: Drafter, sampler: Sampler | None = None, buckets: Buckets | None = None
    ) -> None:
        self.take_drafter(drafter)
        super().__init__(model, buckets, sampler=sampler if sampler is not None else Sampler())

    def take_drafter(self, drafter: Drafter) -> None:
        """Check and keep ``drafter`` (bound by the caller)."""
        if not isinstance(drafter, Drafter):
            raise TypeError(
                f"drafter must implement tfuture.spec.Drafter (k, bind, observe, draft, release, close), "
                f"got {type(drafter).__name__}"
            )
        self.drafter = drafter
        self.k = int(drafter.k)
        self.fields: FutureFields | None = None

    def bind(self, fmap: FutureMap) -> None:
        super().bind(fmap)
        self.fields = FutureFields(fmap, {"seq_len": ((), torch.int64)})

    # -- host, at launch ---------------------------------------------------------------------

    def plan(self, batch: Any) -> StepPlan:
        state, staged, n_out = self.plan_spec(batch)
        return StepPlan(n_out, staged, state, bool(state.late.size))

    def plan_spec(self, batch: Any) -> tuple[SpecState, Any, int]:
        """HOST: the step's record, its staged :data:`tfuture.spec.staging.DraftInputs` and its
        number of fresh slots."""
        if not isinstance(batch, Batch):
            raise TypeError(
                f"schedule() must return a tfuture.spec.DraftBatch (or a plain Batch: no drafts) or None, "
                f"got {type(batch).__name__}"
            )
        zeros = np.zeros(batch.seg_lens.size, dtype=np.int64)
        n_verify, n_draft = (
            (batch.n_verify, batch.n_draft) if isinstance(batch, DraftBatch) else (zeros, zeros)
        )
        state, inputs = self.plan_batch(batch)
        assert isinstance(state, SpecState) and self.sampler is not None
        state.split = False  # a step with waiting rows waits whole: verification takes every row
        sreq = state.sample_reqs
        req_ids = batch.req_ids[sreq]
        if int(n_draft[sreq].max(initial=0)) > self.k:
            raise ValueError(
                f"DraftBatch.n_draft asks for {int(n_draft[sreq].max())} drafts, the drafter makes k={self.k}"
            )
        dp = stage_drafts(
            batch,
            sreq,
            n_verify,
            n_draft,
            self.sampler.packed_params(req_ids),
            self.sampler.history_rows_of(req_ids),
            inputs,
            state.splan,
            self.k,
        )
        state.splan, state.rp, state.width, state.n_verify, state.pen = (
            dp.splan,
            dp.rp,
            dp.width,
            dp.n_verify,
            dp.pen,
        )
        state.max_len = int((batch.prefix_lens + batch.seg_lens).max(initial=0)) + 1  # >= every new length
        state.n_out = dp.n_out
        if state.mask_rows.size:
            self._plan_mask_rows(state, n_draft[sreq])
        return state, dp.staged, dp.n_out

    def _plan_mask_rows(self, state: SpecState, n_draft: np.ndarray) -> None:
        """HOST: a waiting request gets a mask row per verification row (``DraftBatch``), so
        ``mask_rows`` repeats it ``1 + n_verify`` times and ``mask_vrows`` names those rows; the
        stored drafts come back to the host when such a request drafts (its next masks)."""
        waiting, nv = state.mask_rows, state.n_verify
        state.late = waiting  # only the mask's rows wait (verification takes every row at once)
        per = 1 + nv[waiting]
        state.mask_rows = np.repeat(waiting, per)
        ends = np.cumsum(1 + nv)[waiting]
        state.mask_vrows = np.repeat(ends - per, per) + (
            np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
        )
        if int(n_draft[waiting].max(initial=0)):
            state.n_stored = state.n_out

    # -- forward stream ----------------------------------------------------------------------

    def prepare(self, rec: InFlight, inputs: Any) -> None:  # DraftInputs (device views)
        super().prepare(rec, TokenInputs(*inputs[: len(TokenInputs._fields)]))
        state: SpecState = rec.state
        state.inputs, fwd = inputs, state.fwd
        assert fwd is not None and self.fields is not None
        if inputs.spec_reqs.numel():
            # The accepted counts stay on the device: each verifying request's true prefix is its
            # previous step's seq_len field minus its last token; the host staged only a bound.
            positions, seq_lens = true_positions(fwd, inputs, self.fields.buffer("seq_len"))
            fwd = fwd._replace(positions=positions, seq_lens=seq_lens)
        state.fwd = fwd._replace(sample_rows=inputs.vrows)
        if not self.drafts:
            return
        if state.ended.size:
            # Before observe: a request admitted in this step may take an ended request's row.
            self.drafter.release(state.ended)
        self.drafter.observe(state.fwd)

    def sampler_state(self, splan: Any, words: torch.Tensor, ids: torch.Tensor) -> Any:
        # Verification reads its rows' own parameters, never the path's state: of the path's
        # prepare only the history's work counts (new rows zeroed, inputs marked seen), which
        # only requests with penalties have.
        if isinstance(splan, SamplerPlan) and not (splan.sizes[3] or splan.sizes[5]):
            return None
        return super().sampler_state(splan, words, ids)

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        if mask is not None:
            self.take_mask(rec, mask)
        return [
            ("verify", lambda: self._verify(rec)),
            ("draft", lambda: self._draft(rec)),
            ("store", lambda: self._store(rec)),
        ]

    def _verify(self, rec: InFlight) -> None:
        state: SpecState = rec.state
        inputs: Any = rec.state.inputs
        fwd, n = state.fwd, state.n_sample
        assert fwd is not None
        logits = state.logits
        rows = inputs.vrows.numel()
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != rows:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(
                f"forward of step {rec.step} must return logits for every row of sample_rows "
                f"([{rows}, vocab]: the verification rows), got {got}"
            )
        self._vocab = int(logits.shape[1])
        rp = state.rp
        if not n or rp is None:
            state.verified = None
            return
        dev_params = self.row_params_on_device(state)
        if state.mask is not None:
            logits = self._masked(rec, logits)
        sampler = self.sampler
        if state.pen is not None:
            assert sampler is not None
            sampler.vocab = sampler.vocab or int(logits.shape[1])
            sampler.history.ensure(sampler.vocab, logits.device)
            logits = penalise_rows(logits, sampler.history, state.pen, inputs.penalties, fwd.input_ids)
        if state.width == 1 and dev_params is None:
            # No request verifies a draft and none samples: verification is the argmax.
            last = greedy_tokens(logits)
            v = Verified(last.unsqueeze(1), torch.ones_like(last), last)
        elif dev_params is None and logits.device.type == "cpu":
            # Greedy rows on the CPU: the acceptance in a host loop (see verify_greedy_host).
            drafts = fwd.input_ids.numpy()[inputs.draft_src.numpy()]
            v = verify_greedy_host(logits, drafts, inputs.n_verify.numpy(), n, state.width)
        else:
            drafts = fwd.input_ids.index_select(0, inputs.draft_src).to(torch.int64)
            positions = fwd.positions.index_select(0, inputs.vrows) + 1
            v = verify_rows(
                logits,
                drafts,
                inputs.is_draft.bool(),
                inputs.pad_pos,
                n,
                state.width,
                rp,
                dev_params,
                positions,
            )
        state.verified = v
        if state.pen is not None:
            assert sampler is not None
            record_committed(sampler.history, inputs.hist_req, v.committed, v.n_commit)
        state.new_len = new_lengths(fwd.seq_lens, inputs, v.n_commit)

    @staticmethod
    def row_params_on_device(state: SpecState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The verification rows' staged parameters ``(floats [3, R] float64, top_k [R], seeds
        [R])`` as device views, or None when no row samples (greedy)."""
        rp = state.rp
        if rp is None or not rp.sampled:
            return None
        words, rows = state.inputs.params, state.inputs.vrows.numel()
        floats = words[: 3 * rows].view(torch.float64).view(3, rows)
        return floats, words[3 * rows : 4 * rows], words[4 * rows :]

    def _masked(self, rec: InFlight, logits: torch.Tensor) -> torch.Tensor:
        """The logits with the grammar masks applied to the waiting requests' verification rows
        (a row each: ``DraftBatch``), on a copy."""
        state: SpecState = rec.state
        assert self.fmap is not None
        vocab = int(logits.shape[1])
        if state.unchecked is not None and state.mask is not None:
            # The host could not check the rows before the vocab was known (the logits here
            # have a row per verification row, not per request: the check is ours).
            check_width(state.mask, vocab, rec.step)
            check_rows(state.mask, state.unchecked, rec.step, vocab)
            state.unchecked = None
        mask = mask_on_stream(state, rec.step, self.fmap.device)
        allowed = mask if mask.dtype == torch.bool else unpack_bitmask(mask, vocab)
        rows = torch.from_numpy(state.mask_vrows).to(logits.device)
        return logits.index_put((rows,), logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))

    def _draft(self, rec: InFlight) -> None:
        state: SpecState = rec.state
        inputs: Any = rec.state.inputs
        v = state.verified
        if v is None:
            return
        if not self.k:  # no drafts: each request's one slot takes its last committed token
            state.store_tokens = v.last.clamp_min(0)
            return
        assert state.new_len is not None and state.fwd is not None and state.fwd.host is not None
        ctx = DraftContext(
            state.fwd.host.req_ids[state.sample_reqs], v.committed, v.n_commit, state.new_len, state.max_len
        )
        drafts = self.drafter.draft(ctx)
        n = state.n_sample
        if not isinstance(drafts, torch.Tensor) or drafts.shape != (n, self.k):
            got = tuple(drafts.shape) if isinstance(drafts, torch.Tensor) else type(drafts).__name__
            raise ValueError(f"the drafter's draft must return [{n}, {self.k}] token ids, got {got}")
        state.store_tokens = store_tokens(
            v.last, drafts, inputs, state.n_out, max(self._vocab_bound() - 1, 0)
        )

    def _vocab_bound(self) -> int:
        return self._vocab if self._vocab is not None else int(np.iinfo(np.int64).max)

    def _store(self, rec: InFlight) -> None:
        state: SpecState = rec.state
        if state.verified is None:
            return
        assert self.fmap is not None and self.fields is not None and state.new_len is not None
        inputs: Any = rec.state.inputs
        assert state.store_tokens is not None
        self.fmap.launch_store(rec.out, state.store_tokens)
        if self.k:  # read by a next step that verifies drafts: none without a drafter
            # Our own slots and a payload built here (int64 on the map's device): no checks.
            self.fields.launch_store(rec.out, "seq_len", out_lengths(state.new_len, inputs))

    def close(self) -> None:
        super().close()
        self.drafter.close()
