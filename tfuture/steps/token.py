"""The plain step kind: prepare (the fused resolve), forward, sample, store, copy.

Optionally padded: with :class:`Buckets`, every step's token rows and request count are padded
up to the smallest bucket that holds them (zero rows, empty segments), into preallocated
``out=`` buffers of ``prepare_inputs``, so a model sees a few fixed shapes and can capture one
CUDA graph per bucket. A step larger than every bucket runs unpadded. The ops after the forward
(sample, store, a graphed step's replay) are :class:`tfuture.steps.token_sample.TokenSampling`,
the step's base.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tfuture.core.batch import NOTHING_WAITS, Batch, ForwardBatch, HostMeta, Model, StepResult, check_delayed
from tfuture.core.checks import count_nonzero
from tfuture.core.future_map import FutureMap
from tfuture.kernels.resolve import PreparedInputs
from tfuture.sampling import Sampler
from tfuture.steps.base import InFlight, Op, StepKind, StepPlan
from tfuture.steps.checks import check_placeholders, check_sampled
from tfuture.steps.graphs import StepGraphs, plan_graphed
from tfuture.steps.samplers import SamplePath, sample_path
from tfuture.steps.token_sample import TokenSampling
from tfuture.steps.token_state import _ARANGE, _NO_ROWS, Buckets, TokenInputs, TokenState, _arange

__all__ = ["Buckets", "TokenInputs", "TokenState", "TokenStep"]

_MAX = np.maximum.reduce  # without ndarray.max()'s Python wrapper
_BOOL = np.dtype(np.bool_)
_ARANGE_N = _ARANGE.size  # a shorter arange is a view of the cached one (no call)


class TokenStep(TokenSampling, StepKind):
    """The step of a :class:`tfuture.core.batch.Model`, padded to ``buckets`` if given.

    Sampling goes through one :class:`tfuture.steps.samplers.SamplePath`: ``sampler`` if given,
    else the model's own ``sample``, else a default :class:`tfuture.sampling.Sampler`. A path
    that samples row subsets (the Sampler) samples a delayed step's free rows right after the
    forward and only its waiting rows after the mask; otherwise a step with any waiting row
    waits whole.

    Ops: ``prepare``, ``release`` (ended requests), the model ops (``forward``), ``sample_now``,
    then ``sample`` (with the sampler's ``record``) and ``store``. A subclass adds ops around
    them (:class:`tfuture.distributed.step.ParallelStep`: communication) by overriding
    :meth:`model_ops` and :meth:`sample_ops`.
    """

    stream_ops = (*StepKind.stream_ops, "release", "forward", "sample_now", "sample", "store", "replay")
    #: Whether it runs multi-step windows (``DraftBatch.n_steps > 1``): only
    #: :class:`tfuture.spec.MultiStepTokenStep` does; the others refuse them.
    windows = False
    state_type: type[TokenState] = TokenState  # a subclass may keep more per step

    def __init__(
        self,
        model: Model,
        buckets: Buckets | None = None,
        sampler: Sampler | None = None,
        graphs: bool = False,
    ) -> None:
        if buckets is not None and not isinstance(buckets, Buckets):
            raise TypeError(f"buckets must be a Buckets or None, got {type(buckets).__name__}")
        if graphs and buckets is None:
            raise ValueError("graphs=True captures one graph per bucket: give buckets= too")
        if graphs and getattr(model, "graph_safe", False) is not True:
            raise ValueError(
                f"graphs=True needs a graph-safe model, and {type(model).__name__} does not say it is one: "
                "set graph_safe = True on its class once its forward and sample follow the rules of "
                "tfuture.steps.graphs (no host sync, nothing read from batch.step or batch.host)"
            )
        self.model, self.buckets = model, buckets
        #: Step graphs (:mod:`tfuture.steps.graphs`), or None.
        self.graphs: StepGraphs | None = StepGraphs() if graphs else None
        self.path: SamplePath = sample_path(model, sampler)
        self.sampler = sampler if sampler is not None else getattr(self.path, "sampler", None)
        #: Whether this step kind samples on this process (a parallel rank may not).
        self.samples = True
        self.fmap: FutureMap | None = None
        self._outs: dict[tuple[int, int], PreparedInputs] = {}
        self._vocab: int | None = None  # logits width, once a step sampled (for mask checks)
        #: Who claims the Sampler for a run: this step, or the step kind that runs this one's
        #: steps among its own (:class:`tfuture.spec.SpecWindowStep`), so that both share it.
        self.owner: object = self

    def bind(self, fmap: FutureMap) -> None:
        if self.graphs is not None and fmap.debug:
            raise ValueError(
                "graphs=True cannot check slots on the device: debug mode syncs in every call; use a "
                "FutureMap without debug=True"
            )
        dev = getattr(self.model, "device", None)
        if isinstance(dev, torch.device) and dev != fmap.device:
            raise ValueError(
                f"the model is on {dev} and the FutureMap on {fmap.device}: build the map on the "
                f"model's device (FutureMap(..., device={str(dev)!r})) or move the model"
            )
        self.fmap = fmap

    # -- host, at launch ---------------------------------------------------------------------

    def plan(self, batch: Any) -> StepPlan:
        if not isinstance(batch, Batch):
            raise TypeError(f"schedule() must return a Batch or None, got {type(batch).__name__}")
        state, inputs = self.plan_batch(batch)
        n_out, delayed = state.sample_reqs.size, bool(state.late.size)
        if self.graphs is not None:
            assert self.fmap is not None and self.buckets is not None
            graphed = plan_graphed(self.graphs, self.fmap, self.buckets, state, inputs, delayed)
            if graphed is not None:
                state.graph, inputs, with_out = graphed
                return StepPlan(n_out, inputs, state, False, state.graph.static_in, with_out)
        return StepPlan(n_out, inputs, state, delayed)

    def plan_batch(self, batch: Batch) -> tuple[TokenState, TokenInputs]:
        """The host side of ``batch``: its record and its staged arrays."""
        check_placeholders(batch)
        if type(batch) is not Batch and not self.windows and getattr(batch, "n_steps", 1) > 1:
            raise ValueError(
                f"{type(self).__name__} runs one decode step per launch, but the batch asks for "
                f"n_steps={batch.n_steps} (a multi-step window of ContinuousBatcher(multi_step=K)): "  # type: ignore[attr-defined]
                "run it with tfuture.spec.MultiStepTokenStep (tfuture.spec.SpecWindowStep when it drafts)"
            )
        seg_lens, prefix, rids, sample = batch.seg_lens, batch.prefix_lens, batch.req_ids, batch.sample
        n_reqs, n_tok = seg_lens.size, batch.tokens.size
        every = count_nonzero(sample) == n_reqs
        short = n_reqs < _ARANGE_N  # arange(n_reqs + 1) is a view of the cached one
        sample_reqs = (_ARANGE[:n_reqs] if short else _arange(n_reqs)) if every else np.flatnonzero(sample)
        n_rows, n_pad = n_tok, n_reqs
        if self.buckets is not None:
            n_rows, n_pad = Buckets.fit(self.buckets.rows, n_tok), Buckets.fit(self.buckets.reqs, n_reqs)
        decode = n_tok == n_reqs  # one token a request (seg_lens >= 1): no sum, no max
        if decode and n_reqs == n_pad:
            seg_starts = _ARANGE[: n_reqs + 1] if short else _arange(n_reqs + 1)
        else:
            # Padding requests are empty segments at the end: seg_starts repeats the token count.
            seg_starts = np.full(n_pad + 1, n_tok, dtype=np.int64)
            seg_starts[0] = 0
            np.cumsum(seg_lens, out=seg_starts[1 : n_reqs + 1])
        lens = prefix + seg_lens
        if n_pad > n_reqs:
            pad = np.zeros(n_pad - n_reqs, dtype=np.int64)
            prefix, rids, lens = (np.concatenate([a, pad]) for a in (prefix, rids, lens))
        host = HostMeta(
            seg_lens,
            batch.prefix_lens,
            batch.req_ids,
            sample_reqs,
            n_tok,
            1 if decode and n_reqs else 0 if not n_reqs else int(_MAX(seg_lens)),
        )
        delayed = batch.delayed
        if type(delayed) is not np.ndarray or (
            delayed.base is not NOTHING_WAITS and (delayed.dtype != _BOOL or delayed.shape != sample.shape)
        ):
            # Assigned after construction (``batch.delayed = True``): taken as the constructor
            # takes it, or refused naming Batch.delayed. One type test on the usual path.
            delayed = batch.delayed = check_delayed(delayed, n_reqs)
        if delayed.base is NOTHING_WAITS or not count_nonzero(delayed):  # nothing waits: the usual case
            late, now, mask_rows = _NO_ROWS, sample_reqs if every else _arange(sample_reqs.size), _NO_ROWS
        else:
            late, now, mask_rows = self._split_rows(batch, sample_reqs)
        splan = self.path.plan(self.owner, batch, sample_reqs)
        split = bool(late.size and now.size)
        # A decode step where every request samples, unpadded: its sampling requests are its
        # last rows (both arange(n_reqs)); prepare takes that view instead of staging a copy.
        as_last = every and decode and self.buckets is None
        inputs = TokenInputs(
            batch.tokens,
            seg_starts,
            prefix,
            rids,
            lens,
            _NO_ROWS if as_last else sample_reqs,
            late if split else _NO_ROWS,
            now if split else _NO_ROWS,
            splan.words,
        )
        state = self.state_type(sample_reqs, host, batch.ended, n_rows, late, now, mask_rows, splan)
        state.split = split
        return state, inputs

    def _split_rows(self, batch: Batch, sample_reqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(late, now, mask_rows)`` of :class:`TokenState`, indices into ``sample_reqs``, for a
        batch where some request waits (:meth:`plan_batch` takes the usual case itself)."""
        rows = _arange(sample_reqs.size)
        waits = batch.delayed[sample_reqs]
        n_waits = int(count_nonzero(waits))
        if n_waits == 0:
            return _NO_ROWS, rows, _NO_ROWS
        if n_waits == rows.size:
            return rows, _NO_ROWS, rows
        if not self.path.splits_rows:
            return rows, _NO_ROWS, rows[waits]  # the path takes every row at once
        return rows[waits], rows[~waits], rows[waits]

    # -- forward stream ----------------------------------------------------------------------

    def prepare(self, rec: InFlight, inputs: TokenInputs) -> None:
        fmap, state = self.fmap, rec.state
        assert fmap is not None
        if state.graph is not None:
            return  # the runtime copied the inputs into the bucket's static buffer: the graph reads it
        host = state.host
        if self.buckets is None and host.max_seg_len <= 1:
            # A decode step (one token a request, unpadded): the inputs are the staged arrays
            # themselves, fresh device memory each step. The tokens resolve in place, a position
            # is the prefix length, and request q's last row is q (seg_starts[q]).
            staged = rec.host_inputs  # a CPU map: the same memory as numpy (cheaper views)
            if staged is None:
                ids, positions, last = (
                    fmap.launch_resolve(inputs.tokens),
                    inputs.prefix_lens,
                    inputs.seg_starts[:-1],
                )
            else:
                ids, positions, last = (
                    fmap.launch_resolve(inputs.tokens, staged.tokens),
                    inputs.prefix_lens,
                    torch.from_numpy(staged.seg_starts[:-1]),
                )
            n_reqs = host.seg_lens.size
        else:
            ids, positions, last = self._prepare_rows(state, inputs)
            n_reqs = last.numel()
        # Every request samples and none is padding: the sampling rows are the last rows
        # themselves, no gather (and a decode step's sampling requests too: see plan_batch).
        n_sample = state.sample_reqs.size
        if n_sample == host.seg_lens.size == n_reqs:
            sample_rows = last
            sreq = last if host.max_seg_len <= 1 and self.buckets is None else inputs.sample_reqs
        else:
            sreq = inputs.sample_reqs
            sample_rows = last.index_select(0, sreq)
        state.fwd = ForwardBatch(
            rec.step,
            ids,
            positions,
            last,
            inputs.req_ids,
            inputs.seq_lens,
            sreq,
            sample_rows,
            inputs.seg_starts,
            host,
        )
        if self.samples:
            state.late_dev, state.now_dev = inputs.late, inputs.now
            state.sstate = self.sampler_state(state.splan, inputs.sampler_words, ids)

    def sampler_state(self, splan: Any, words: torch.Tensor, ids: torch.Tensor) -> Any:
        """FORWARD STREAM: the step's sampling state, its path's ``prepare`` (``words``: the
        device copy of ``splan.words``; ``ids``: the step's resolved input ids)."""
        return self.path.prepare(splan, words, ids)

    def _prepare_rows(self, state: TokenState, inputs: TokenInputs) -> PreparedInputs:
        """The fused prepare of a step with prefill chunks or padding (into a bucket's buffers)."""
        fmap = self.fmap
        assert fmap is not None
        out = None
        if self.buckets is not None:
            key = (state.n_rows, inputs.prefix_lens.numel())
            out = self._outs.get(key)
            if out is None and key[0] in self.buckets.rows and key[1] in self.buckets.reqs:
                dev = fmap.device
                out = self._outs[key] = PreparedInputs(
                    torch.zeros(key[0], dtype=inputs.tokens.dtype, device=dev),
                    torch.zeros(key[0], dtype=torch.int64, device=dev),
                    torch.zeros(key[1], dtype=torch.int64, device=dev),
                )
        # The tensors come from a checked Batch (seg_lens >= 1, prefix_lens >= 0): no second check.
        return fmap.launch_prepare(inputs.tokens, inputs.seg_starts, inputs.prefix_lens, state.n_rows, out)

    def forward_ops(self, rec: InFlight) -> list[Op]:
        state = rec.state
        if not state.ended.size and state.graph is None and not state.split:
            return self.model_ops(rec)  # the usual step: the model alone
        ops: list[Op] = []
        if state.ended.size:
            release = getattr(self.model, "release", None)
            if release is not None:
                ended = state.ended
                ops.append(("release", lambda: release(ended)))
        if state.graph is not None:
            ops.append(("replay", lambda: self._replay(rec)))
            return ops
        ops += self.model_ops(rec)
        if self.samples and state.split:
            # Only the waiting rows wait: the others sample now, while the host builds the mask.
            ops.append(("sample_now", lambda: self._sample_rows(rec, state.now_dev, None)))
        return ops

    def model_ops(self, rec: InFlight) -> list[Op]:
        """The ops that run the model: one ``forward`` that leaves the logits in ``rec.state``."""
        state, model = rec.state, self.model

        def forward() -> None:
            logits = model.forward(state.fwd)
            if logits is None:
                raise ValueError("forward must return logits (or what sample takes), got None")
            state.logits = logits

        return [("forward", forward)]

    # -- host, after copy_done ---------------------------------------------------------------

    def n_result(self, rec: InFlight) -> int:
        return rec.out._n  # len(rec.out), without the call

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        dst.copy_(rec.state.sampled, non_blocking=True)

    def result_array(self, rec: InFlight) -> np.ndarray | None:
        state = rec.state
        host = state.sampled_host  # the store's view of the same tensor, when it made one
        return host if host is not None else state.sampled.numpy()

    def result(self, rec: InFlight, words: np.ndarray) -> StepResult:
        if rec.state.sampled_host is None:
            check_sampled(words, rec.state, rec.step)
        # Else checked once already: a CPU map's store took the sampled tokens themselves
        # through that view only when every one of them is >= 0 (store_run), and the results
        # were copied from the same memory after it.
        return StepResult(rec.step, rec.batch, words)

    def n_tokens(self, result: StepResult) -> int:
        return int(result.tokens.size)

    def drained(self) -> None:
        if self.graphs is not None and self.fmap is not None:
            # The scratch slot: steps stage it (never a graph), so the next run takes a fresh one.
            self.graphs.close(self.fmap)

    def close(self) -> None:
        if self.graphs is not None and self.fmap is not None:
            self.graphs.close(self.fmap)  # the scratch slot (the stream was drained)
        self.path.close(self.owner)
        close = getattr(self.model, "close", None)
        if close is not None:
            close()
