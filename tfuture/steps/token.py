"""The plain step kind: prepare (the fused resolve), forward, sample, store, copy.

Optionally padded: with :class:`Buckets`, every step's token rows and request count are padded
up to the smallest bucket that holds them (zero rows, empty segments), into preallocated
``out=`` buffers of ``prepare_inputs``, so a model sees a few fixed shapes and can capture one
CUDA graph per bucket. A step larger than every bucket runs unpadded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tfuture.core.batch import Batch, ForwardBatch, HostMeta, Model, StepResult
from tfuture.core.future_map import FutureMap
from tfuture.kernels.bitmask import unpack_bitmask
from tfuture.kernels.resolve import PreparedInputs
from tfuture.sampling import Sampler, SamplerPlan
from tfuture.steps.base import InFlight, Op, StepKind, StepPlan
from tfuture.steps.masks import check_logits, check_mask, check_rows, check_width, widen

_NO_ROWS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Buckets:
    """Padded step shapes: ``rows`` (token rows) and ``reqs`` (requests), each ascending."""

    rows: tuple[int, ...]
    reqs: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("rows", "reqs"):
            vals = getattr(self, name)
            ok = isinstance(vals, tuple) and vals and all(type(v) is int and v >= 1 for v in vals)
            if not ok or list(vals) != sorted(set(vals)):
                raise ValueError(
                    f"Buckets.{name} must be a non-empty ascending tuple of ints >= 1, got {vals!r}"
                )

    @staticmethod
    def fit(sizes: tuple[int, ...], n: int) -> int:
        """The smallest bucket >= ``n``, or ``n`` past the largest."""
        for b in sizes:
            if b >= n:
                return b
        return n


@dataclass(slots=True, eq=False)
class TokenState:
    """One token step's record. ``late``: the sampling rows (indices into ``sample_reqs``) that
    sample after the mask, ``now`` the others; ``mask_rows`` the rows the scheduler's mask
    covers (``late``, unless the model's own sample takes every row of a step with a few
    waiting rows)."""

    sample_reqs: np.ndarray
    host: HostMeta
    ended: np.ndarray
    n_rows: int
    late: np.ndarray
    now: np.ndarray
    mask_rows: np.ndarray
    splan: SamplerPlan | None = None
    fwd: ForwardBatch | None = None
    logits: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    sstate: Any = None
    late_dev: torch.Tensor | None = None
    now_dev: torch.Tensor | None = None


class TokenStep(StepKind):
    """The step of a :class:`tfuture.core.batch.Model`, padded to ``buckets`` if given.

    Sampling: with a :class:`tfuture.sampling.Sampler` (given, or the default one for a model
    without ``sample``), per-request parameters come from :attr:`Batch.sampling`, a delayed step
    samples its non-waiting rows right after the forward and only its waiting rows after the
    mask, and packed bitmasks are applied on the device. With the model's own ``sample``, a step
    with any waiting row waits whole, and the model gets a bool mask.
    """

    stream_ops = (*StepKind.stream_ops, "release", "forward", "sample_now", "sample", "store")

    def __init__(self, model: Model, buckets: Buckets | None = None, sampler: Sampler | None = None) -> None:
        if buckets is not None and not isinstance(buckets, Buckets):
            raise TypeError(f"buckets must be a Buckets or None, got {type(buckets).__name__}")
        if sampler is not None and not isinstance(sampler, Sampler):
            raise TypeError(
                f"sampler must be a tfuture.sampling.Sampler or None, got {type(sampler).__name__}"
            )
        if sampler is None and not callable(getattr(model, "sample", None)):
            sampler = Sampler()
        self.model, self.buckets, self.sampler = model, buckets, sampler
        self.fmap: FutureMap | None = None
        self._outs: dict[tuple[int, int], PreparedInputs] = {}
        self._vocab: int | None = None  # logits width, once a step sampled (for mask checks)

    def bind(self, fmap: FutureMap) -> None:
        self.fmap = fmap

    def plan(self, batch: Any) -> StepPlan:
        if not isinstance(batch, Batch):
            raise TypeError(f"schedule() must return a Batch or None, got {type(batch).__name__}")
        sample_reqs = np.flatnonzero(batch.sample)
        n_reqs, n_tok = batch.n_reqs, batch.tokens.size
        n_rows, n_pad = n_tok, n_reqs
        if self.buckets is not None:
            n_rows, n_pad = Buckets.fit(self.buckets.rows, n_tok), Buckets.fit(self.buckets.reqs, n_reqs)
        # Padding requests are empty segments at the end: seg_starts repeats the token count.
        seg_starts = np.full(n_pad + 1, n_tok, dtype=np.int64)
        seg_starts[0] = 0
        np.cumsum(batch.seg_lens, out=seg_starts[1 : n_reqs + 1])
        prefix, rids, lens = batch.prefix_lens, batch.req_ids, batch.prefix_lens + batch.seg_lens
        if n_pad > n_reqs:
            pad = np.zeros(n_pad - n_reqs, dtype=np.int64)
            prefix, rids, lens = (np.concatenate([a, pad]) for a in (prefix, rids, lens))
        host = HostMeta(
            batch.seg_lens,
            batch.prefix_lens,
            batch.req_ids,
            sample_reqs,
            n_tok,
            int(batch.seg_lens.max()) if n_reqs else 0,
        )
        late, now, mask_rows = self._split_rows(batch, sample_reqs)
        inputs = [batch.tokens, seg_starts, prefix, rids, lens, sample_reqs]
        splan = None
        if self.sampler is not None:
            self.sampler.claim(self)
            splan = self.sampler.plan(
                batch.sampling,
                batch.req_ids,
                batch.seg_lens,
                batch.prefix_lens,
                sample_reqs,
                batch.ended,
                batch.step,
            )
            if late.size and now.size:
                inputs += [late, now]
            inputs.append(splan.words)
        elif batch.sampling is not None:
            raise ValueError(
                "Batch.sampling needs tfuture's sampler, but the model samples itself: pass "
                "OverlapRuntime(..., sampler=Sampler()) (or give the model no sample method)"
            )
        state = TokenState(sample_reqs, host, batch.ended, n_rows, late, now, mask_rows, splan)
        return StepPlan(int(sample_reqs.size), inputs, state)

    def _split_rows(self, batch: Batch, sample_reqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(late, now, mask_rows)`` of :class:`TokenState`, indices into ``sample_reqs``."""
        rows = np.arange(sample_reqs.size, dtype=np.int64)
        d = batch.delayed
        if not isinstance(d, np.ndarray):
            return (rows, _NO_ROWS, rows) if d else (_NO_ROWS, rows, _NO_ROWS)
        waits = d[sample_reqs]
        if not waits.any():
            return _NO_ROWS, rows, _NO_ROWS
        if waits.all():
            return rows, _NO_ROWS, rows
        if self.sampler is None:
            return rows, _NO_ROWS, rows[waits]  # the model's own sample takes every row at once
        return rows[waits], rows[~waits], rows[waits]

    def delayed(self, batch: Batch) -> bool:
        d = batch.delayed
        if isinstance(d, np.ndarray):
            return bool(d[batch.sample].any())
        return bool(d)

    def prepare(self, rec: InFlight, inputs: Sequence[torch.Tensor]) -> None:
        fmap, state = self.fmap, rec.state
        assert fmap is not None
        tokens, seg, prefix, rids, lens, sreq = inputs[:6]
        out = None
        if self.buckets is not None:
            key = (state.n_rows, prefix.numel())
            out = self._outs.get(key)
            if out is None:
                dev = fmap.device
                out = self._outs[key] = PreparedInputs(
                    torch.zeros(key[0], dtype=tokens.dtype, device=dev),
                    torch.zeros(key[0], dtype=torch.int64, device=dev),
                    torch.zeros(key[1], dtype=torch.int64, device=dev),
                )
        # The tensors come from a checked Batch (seg_lens >= 1, prefix_lens >= 0): no second check.
        prepared = fmap.launch_prepare(tokens, seg, prefix, state.n_rows, out)
        sample_rows = prepared.last_rows.index_select(0, sreq)
        state.fwd = ForwardBatch(rec.step, *prepared, rids, lens, sreq, sample_rows, seg, state.host)
        if self.sampler is not None:
            assert state.splan is not None
            if len(inputs) == 9:
                state.late_dev, state.now_dev = inputs[6], inputs[7]
            state.sstate = self.sampler.prepare(state.splan, inputs[-1])
            self.sampler.observe(state.sstate, prepared.input_ids)

    def forward_ops(self, rec: InFlight) -> list[Op]:
        state, model = rec.state, self.model
        ops: list[Op] = []
        release = getattr(model, "release", None)
        if state.ended.size and release is not None:
            ended = state.ended
            ops.append(("release", lambda: release(ended)))

        def forward() -> None:
            logits = model.forward(state.fwd)
            if logits is None:
                raise ValueError("forward must return logits (or what sample takes), got None")
            state.logits = logits

        ops.append(("forward", forward))
        if self.sampler is not None and state.late.size and state.now.size:
            # Only the waiting rows wait: the others sample now, while the host builds the mask.
            ops.append(("sample_now", lambda: self._sample_rows(rec, state.now_dev, None)))
        return ops

    def _sample_rows(self, rec: InFlight, rows: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """On the stream: sample ``rows`` (all when None) of the step with tfuture's sampler,
        into ``state.sampled``; ``mask`` bool or packed int32 for those rows."""
        state, sampler, n = rec.state, self.sampler, len(rec.out)
        assert sampler is not None and state.logits is not None
        logits = check_logits(state.logits, n, rec.step)
        self._vocab = int(logits.shape[1])
        if mask is not None:
            check_width(mask, self._vocab, rec.step)  # the host checks it once the vocab is known
        if rows is not None:
            logits = logits.index_select(0, rows)
        bitmask = None
        if mask is not None and mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            bitmask = mask
        tokens = sampler.sample(state.sstate, logits, rows, bitmask)
        if rows is None:
            state.sampled = tokens
            return
        if state.sampled is None:
            state.sampled = torch.empty(n, dtype=torch.int64, device=logits.device)
        state.sampled.index_copy_(0, rows, tokens)

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        fmap, model, state, n = self.fmap, self.model, rec.state, len(rec.out)
        assert fmap is not None
        dev = fmap.device
        mask_ready = None
        unchecked: tuple[torch.Tensor, np.ndarray] | None = None
        if mask is not None:
            reqs = state.host.req_ids[state.sample_reqs[state.mask_rows]]
            vocab = self._vocab if self._vocab is not None else getattr(self.sampler, "vocab", None)
            state.mask = check_mask(mask, reqs, rec.step, vocab)
            if vocab is None and not state.mask.is_cuda:
                # Not known before the first sample: rows that allow only padding bits (tokens
                # past the vocab) are found on the stream, from this host tensor (no sync).
                unchecked = (state.mask, reqs)
            if state.mask_rows.size < state.late.size:
                state.mask = widen(state.mask, state.mask_rows, state.late.size)
            if dev.type == "cuda":
                if state.mask.is_cuda:
                    # Built on the caller's stream: the forward stream must wait for it.
                    mask_ready = torch.cuda.Event()
                    mask_ready.record()
                else:
                    # Pinned (torch's caching host allocator keeps it until the copy ran): a truly
                    # async H2D copy, where pageable memory may make the host wait.
                    state.mask = state.mask.pin_memory()

        def sample() -> None:
            if unchecked is not None:
                host_mask, reqs = unchecked
                vocab = int(check_logits(state.logits, n, rec.step).shape[1])
                check_width(host_mask, vocab, rec.step)
                check_rows(host_mask, reqs, rec.step, vocab)
            if mask_ready is not None:
                torch.cuda.current_stream(dev).wait_event(mask_ready)
            mask_dev = None if state.mask is None else state.mask.to(dev, non_blocking=True)
            if self.sampler is not None:
                self._sample_rows(rec, state.late_dev if state.now.size else None, mask_dev)
                return
            if mask_dev is not None:
                vocab = self._vocab = int(check_logits(state.logits, n, rec.step).shape[1])
                check_width(mask_dev, vocab, rec.step)
                if mask_dev.dtype != torch.bool:
                    mask_dev = unpack_bitmask(mask_dev, vocab)
            tokens = model.sample(state.logits, state.fwd, mask_dev)
            if not isinstance(tokens, torch.Tensor) or tokens.shape != (n,):
                got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
                raise ValueError(f"sample must return [{n}] token ids, got {got}")
            state.sampled = tokens.contiguous()

        def store() -> None:
            if self.sampler is not None:
                self.sampler.record(state.sstate, state.sampled)
            fmap.store(rec.out, state.sampled)

        return [("sample", sample), ("store", store)]

    def n_result(self, rec: InFlight) -> int:
        return len(rec.out)

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        dst.copy_(rec.state.sampled, non_blocking=True)

    def result(self, rec: InFlight, words: np.ndarray) -> StepResult:
        return StepResult(rec.step, rec.batch, words)

    def n_tokens(self, result: StepResult) -> int:
        return int(result.tokens.size)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.unclaim(self)  # frees the history rows this run's requests held
        close = getattr(self.model, "close", None)
        if close is not None:
            close()
