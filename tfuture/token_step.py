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

from tfuture.batch import Batch, ForwardBatch, HostMeta, Model, StepResult
from tfuture.futures import FutureMap
from tfuture.kernels.resolve import PreparedInputs
from tfuture.steps import InFlight, Op, StepKind, StepPlan


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
    sample_reqs: np.ndarray
    host: HostMeta
    ended: np.ndarray
    n_rows: int
    fwd: ForwardBatch | None = None
    logits: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class TokenStep(StepKind):
    """The step of a :class:`tfuture.batch.Model`, padded to ``buckets`` if given."""

    def __init__(self, model: Model, buckets: Buckets | None = None) -> None:
        if buckets is not None and not isinstance(buckets, Buckets):
            raise TypeError(f"buckets must be a Buckets or None, got {type(buckets).__name__}")
        self.model, self.buckets = model, buckets
        self.fmap: FutureMap | None = None
        self._outs: dict[tuple[int, int], PreparedInputs] = {}

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
        inputs = (batch.tokens, seg_starts, prefix, rids, lens, sample_reqs)
        return StepPlan(int(sample_reqs.size), inputs, TokenState(sample_reqs, host, batch.ended, n_rows))

    def delayed(self, batch: Batch) -> bool:
        return batch.delayed

    def prepare(self, rec: InFlight, inputs: Sequence[torch.Tensor]) -> None:
        fmap, state = self.fmap, rec.state
        assert fmap is not None
        tokens, seg, prefix, rids, lens, sreq = inputs
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
        return ops

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        fmap, model, state, n = self.fmap, self.model, rec.state, len(rec.out)
        assert fmap is not None
        dev = fmap.device
        mask_ready = None
        if mask is not None:
            state.mask = _check_mask(mask, state.sample_reqs, rec.step)
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
            if mask_ready is not None:
                torch.cuda.current_stream(dev).wait_event(mask_ready)
            mask_dev = None if state.mask is None else state.mask.to(dev, non_blocking=True)
            tokens = model.sample(state.logits, state.fwd, mask_dev)
            if not isinstance(tokens, torch.Tensor) or tokens.shape != (n,):
                got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
                raise ValueError(f"sample must return [{n}] token ids, got {got}")
            state.sampled = tokens.contiguous()

        def store() -> None:
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
        close = getattr(self.model, "close", None)
        if close is not None:
            close()


def _check_mask(mask: object, sample_reqs: np.ndarray, step: int) -> torch.Tensor:
    """``mask`` as a bool ``[n_sample, vocab]`` tensor; on the host, every row allows a token."""
    n = sample_reqs.size
    t = torch.as_tensor(mask)
    if t.dim() != 2 or t.shape[0] != n or t.dtype != torch.bool:
        raise ValueError(
            f"build_mask must return a bool [n_sample={n}, vocab] mask, "
            f"got {t.dtype} of shape {tuple(t.shape)}"
        )
    if not t.is_cuda and n:
        # A row that allows nothing would sample token 0 silently; on the host this costs no sync.
        empty = np.flatnonzero(~t.any(dim=1).numpy())
        if empty.size:
            raise ValueError(
                f"build_mask of step {step}: the mask row of request {int(sample_reqs[empty[0]])} in the "
                f"batch (sampling row {int(empty[0])}) allows no token ({empty.size} such row(s))"
            )
    return t
