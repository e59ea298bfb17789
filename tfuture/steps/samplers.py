"""The token step's two ways to sample, behind one interface: :class:`SamplePath`.

* :class:`SamplerPath`: tfuture's :class:`tfuture.sampling.Sampler` (per-request parameters,
  penalties from a device history, packed bitmasks applied on the device). It samples any
  subset of a step's rows, so a delayed step's free rows sample before the mask is built.
* :class:`ModelSamplePath`: a model's own ``sample(logits, batch, mask)``, wrapped. It takes
  every row of a step at once and a bool mask (a packed bitmask is unpacked for it).

The token step calls the path and never asks which one it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from tfuture.core.batch import Batch, ForwardBatch
from tfuture.kernels.bitmask import unpack_bitmask
from tfuture.sampling import Sampler, SamplerPlan
from tfuture.sampling.plan import greedy_plan

__all__ = ["ModelSamplePath", "SamplePath", "SamplerPath", "sample_path"]

_TOKEN_DTYPES = (torch.int32, torch.int64)


class SamplePath(ABC):
    """How a token step samples. Host: :meth:`plan` per step; forward stream: :meth:`prepare`
    (after the fused input preparation), :meth:`sample` (once, or once per row subset when
    ``splits_rows``), :meth:`record` (after the last sample of the step)."""

    #: Whether :meth:`sample` takes a subset of the step's rows.
    splits_rows: bool = False
    #: Whether :meth:`record` reads the tokens (then a row without a valid token, -1, is read
    #: as 0 first; else the map's store flags it and stores 0 itself).
    records: bool = False

    @property
    def vocab(self) -> int | None:
        """The vocab size, when known before the first sample (for host mask checks)."""
        return None

    @abstractmethod
    def plan(self, owner: object, batch: Batch, sample_reqs: np.ndarray) -> SamplerPlan:
        """HOST: the step's sampling plan; its ``words`` travel in the step's one H2D copy."""

    def prepare(self, plan: SamplerPlan, words: torch.Tensor, input_ids: torch.Tensor) -> Any:
        """FORWARD STREAM: the step's sampling state, from the device copy of ``plan.words``."""
        return plan

    @abstractmethod
    def sample(
        self,
        state: Any,
        fwd: ForwardBatch,
        logits: torch.Tensor,
        rows: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """FORWARD STREAM: ``[m]`` integer tokens for ``rows`` (None: every sampling row) of
        ``logits [m, vocab]``; ``mask`` bool ``[m, vocab]`` or packed int32 ``[m, ceil(vocab/32)]``."""

    def record(self, state: Any, tokens: torch.Tensor) -> None:  # noqa: B027 - nothing to record
        """FORWARD STREAM: the step's ``[n_sample]`` tokens, after its last sample."""

    def close(self, owner: object) -> None:  # noqa: B027 - nothing held past a run
        """HOST, after a run (the stream drained)."""


class SamplerPath(SamplePath):
    """tfuture's :class:`Sampler`: parameters admitted with :attr:`Batch.params`, any row subset."""

    splits_rows = True
    records = True

    def __init__(self, sampler: Sampler, model_vocab: int | None = None) -> None:
        self.sampler = sampler
        self.model_vocab = model_vocab  # the model's own word, until the sampler knows its vocab

    @property
    def vocab(self) -> int | None:
        return self.sampler.vocab

    def plan(self, owner: object, batch: Batch, sample_reqs: np.ndarray) -> SamplerPlan:
        sampler = self.sampler
        sampler.claim(owner)
        plan = sampler.plan_step(
            batch.params,
            batch.req_ids,
            batch.seg_lens,
            batch.prefix_lens,
            sample_reqs,
            batch.ended,
            batch.step,
        )
        if plan.sizes[3]:  # a request with penalties marks its inputs: refuse an id past the vocab
            sampler.check_inputs(plan, batch.tokens, batch.req_ids, batch.seg_lens, self.model_vocab)
        return plan

    def prepare(self, plan: SamplerPlan, words: torch.Tensor, input_ids: torch.Tensor) -> Any:
        state = self.sampler.prepare(plan, words)
        self.sampler.observe(state, input_ids)
        return state

    def sample(
        self,
        state: Any,
        fwd: ForwardBatch,
        logits: torch.Tensor,
        rows: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if mask is not None and mask.dtype == torch.bool:
            logits, mask = logits.masked_fill(~mask, float("-inf")), None
        return self.sampler.sample(state, logits, rows, mask)

    def record(self, state: Any, tokens: torch.Tensor) -> None:
        self.sampler.record(state, tokens)

    def close(self, owner: object) -> None:
        self.sampler.unclaim(owner)  # frees the history rows this run's requests held


class ModelSamplePath(SamplePath):
    """A model's own ``sample(logits, batch, mask)``: every row at once, a bool mask."""

    def __init__(self, sample: Any) -> None:
        self.model_sample = sample

    def plan(self, owner: object, batch: Batch, sample_reqs: np.ndarray) -> SamplerPlan:
        if batch.params:
            raise ValueError(
                "Batch.params needs tfuture's sampler, but the model samples itself: pass "
                "OverlapRuntime(..., sampler=Sampler()) (or give the model no sample method)"
            )
        return greedy_plan(int(sample_reqs.size), batch.step)

    def sample(
        self,
        state: Any,
        fwd: ForwardBatch,
        logits: torch.Tensor,
        rows: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        assert rows is None, "a model's own sample takes every row at once"
        n = logits.shape[0]
        if mask is not None and mask.dtype != torch.bool:
            mask = unpack_bitmask(mask, int(logits.shape[1]))
        tokens = self.model_sample(logits, fwd, mask)
        if not isinstance(tokens, torch.Tensor) or tokens.shape != (n,) or tokens.dtype not in _TOKEN_DTYPES:
            got = (
                f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens)
            )
            raise ValueError(f"sample must return [{n}] int32 or int64 token ids, got {got}")
        return tokens.contiguous()


def sample_path(model: Any, sampler: Sampler | None) -> SamplePath:
    """``sampler`` if given, else the model's own ``sample``, else a default :class:`Sampler`."""
    if sampler is not None and not isinstance(sampler, Sampler):
        raise TypeError(f"sampler must be a tfuture.sampling.Sampler or None, got {type(sampler).__name__}")
    sample = getattr(model, "sample", None)
    if sampler is None and callable(sample):
        return ModelSamplePath(sample)
    return SamplerPath(sampler if sampler is not None else Sampler(), _declared_vocab(model))


def _declared_vocab(model: Any) -> int | None:
    """The model's ``vocab`` (or ``vocab_size``) int attribute, if it has one."""
    for name in ("vocab", "vocab_size"):
        v = getattr(model, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None
