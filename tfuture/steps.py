"""Step kinds: what one step does on the forward stream, as a part the runtime's loop calls.

The loop (:mod:`tfuture.runtime`) owns everything every step shares: scheduling, staging
(one H2D copy of the step's index data, one D2H copy of its results, both through rings
reused only after their markers), slot allocation, releasing consumed handles, the delayed
sample, tracing, faults and the error path. A :class:`StepKind` says what is specific:

* :meth:`StepKind.plan` (host): check the scheduler's batch, say how many future slots the
  step fills and which host arrays it stages;
* :meth:`StepKind.prepare` (stream, op ``prepare``): build the device inputs from the staged
  arrays (placeholders resolved here);
* :meth:`StepKind.forward_ops` / :meth:`StepKind.sample_ops` (stream): the named ops before and
  after the (possibly delayed) sample; the last one stores into the step's slots;
* :meth:`StepKind.copy_result` (stream, op ``copy``) and :meth:`StepKind.result` (host): what the
  host reads back and what the scheduler's ``process`` gets.

:class:`TokenStep` is the plain step (prepare, forward, sample, store, copy);
:class:`tfuture.speculative.SpecStep` the speculative one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from tfuture.batch import Batch, ForwardBatch, Model, StepResult
from tfuture.futures import FutureMap
from tfuture.slots import FutureIndices
from tfuture.staging import Staging
from tfuture.streams import Marker

Op = tuple[str, Callable[[], None]]


class StepPlan(NamedTuple):
    """A step's host side: ``n_out`` fresh slots, ``inputs`` staged back to back (int64), and
    ``state``, the kind's per-step record (device tensors land there on the stream)."""

    n_out: int
    inputs: Sequence[np.ndarray]
    state: Any


@dataclass(slots=True, eq=False)
class InFlight:
    """Everything a launched step keeps alive until its results were processed."""

    step: int
    batch: Any
    out: FutureIndices
    inputs: Staging
    state: Any
    staging: Staging | None = None
    copy_done: Marker | None = None
    n_result: int = 0


class StepKind(ABC):
    """What a step does on the forward stream (see the module docstring).

    ``keeps_out``: a step's ``out`` handle stays live until the step was processed *and* a
    later step was launched, so the scheduler can name its latest step's slots in sync mode too
    (a speculative step's drafts live only in its slots).
    """

    keeps_out = False

    def bind(self, fmap: FutureMap) -> None:  # noqa: B027 - most kinds need no per-map state
        """Called once by the runtime with its map, before any step."""

    @abstractmethod
    def plan(self, batch: Any) -> StepPlan:
        """Check ``batch`` (``TypeError``/``ValueError``) and plan its host side."""

    def delayed(self, batch: Any) -> bool:
        """Sample only after the previous step's results were processed (grammar masks)."""
        return False

    @abstractmethod
    def prepare(self, rec: InFlight, inputs: Sequence[torch.Tensor]) -> None:
        """On the stream: build the device inputs from the staged arrays (``inputs``, in order)."""

    @abstractmethod
    def forward_ops(self, rec: InFlight) -> list[Op]:
        """The named stream ops after ``prepare`` and before the sample."""

    @abstractmethod
    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        """The named stream ops that sample and store into ``rec.out``; ``mask`` from
        ``scheduler.build_mask`` for a delayed step, else None. Check ``mask`` on the host here."""

    @abstractmethod
    def n_result(self, rec: InFlight) -> int:
        """int64 words the host reads back for the step."""

    @abstractmethod
    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        """On the stream: copy the step's results into host ``dst [n_result]`` (non-blocking)."""

    @abstractmethod
    def result(self, rec: InFlight, words: np.ndarray) -> Any:
        """On the host, after ``copy_done``: what ``scheduler.process`` gets."""

    @abstractmethod
    def n_tokens(self, result: Any) -> int:
        """Tokens the step produced (for tokens/s)."""


@dataclass(slots=True, eq=False)
class TokenState:
    sample_reqs: np.ndarray
    fwd: ForwardBatch | None = None
    logits: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class TokenStep(StepKind):
    """The plain step of a :class:`tfuture.batch.Model`: prepare (the fused resolve), forward,
    sample, store into one slot per sampling request, copy the tokens to the host."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.fmap: FutureMap | None = None

    def bind(self, fmap: FutureMap) -> None:
        self.fmap = fmap

    def plan(self, batch: Any) -> StepPlan:
        if not isinstance(batch, Batch):
            raise TypeError(f"schedule() must return a Batch or None, got {type(batch).__name__}")
        sample_reqs = np.flatnonzero(batch.sample)
        seg_starts = np.zeros(batch.n_reqs + 1, dtype=np.int64)
        np.cumsum(batch.seg_lens, out=seg_starts[1:])
        inputs = (
            batch.tokens,
            seg_starts,
            batch.prefix_lens,
            batch.req_ids,
            batch.prefix_lens + batch.seg_lens,
            sample_reqs,
        )
        return StepPlan(int(sample_reqs.size), inputs, TokenState(sample_reqs))

    def delayed(self, batch: Batch) -> bool:
        return batch.delayed

    def prepare(self, rec: InFlight, inputs: Sequence[torch.Tensor]) -> None:
        assert self.fmap is not None
        tokens, seg, prefix, rids, lens, sreq = inputs
        prepared = self.fmap.prepare_inputs(tokens, seg, prefix)
        rec.state.fwd = ForwardBatch(rec.step, *prepared, rids, lens, sreq)

    def forward_ops(self, rec: InFlight) -> list[Op]:
        state, model = rec.state, self.model

        def forward() -> None:
            logits = model.forward(state.fwd)
            if logits is None:
                raise ValueError("forward must return logits (or what sample takes), got None")
            state.logits = logits

        return [("forward", forward)]

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        fmap, model, state, n = self.fmap, self.model, rec.state, len(rec.out)
        assert fmap is not None
        dev = fmap.device
        mask_ready = None
        if mask is not None:
            state.mask = _check_mask(mask, n)
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


def _check_mask(mask: object, n: int) -> torch.Tensor:
    t = torch.as_tensor(mask)
    if t.dim() != 2 or t.shape[0] != n or t.dtype != torch.bool:
        raise ValueError(
            f"build_mask must return a bool [n_sample={n}, vocab] mask, "
            f"got {t.dtype} of shape {tuple(t.shape)}"
        )
    return t
