"""Plain data of speculative decoding: the per-step batch and result, the model protocol.

The scheduler (policy, on the host) builds a :class:`SpecBatch` per step and gets a
:class:`SpecResult` back; :class:`tfuture.spec_runtime.SpecRuntime` (the executor) runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from tfuture import FutureIndices
from tfuture.fields import Shape
from tfuture.kernels.spec import SpecInputs

# What the host reads back per step; the other fields stay on the device for the next step.
HOST_FIELDS = ("tokens", "accept_len")


def spec_fields(k: int) -> dict[str, tuple[Shape, torch.dtype]]:
    """The fields every speculative step stores: accepted tokens, counts and next drafts."""
    return {
        "tokens": ((k + 1,), torch.int64),  # target tokens; the first accept_len are committed
        "accept_len": ((), torch.int32),  # committed tokens this step, in [1, k + 1]
        "new_seq_len": ((), torch.int64),  # sequence length after the step
        "draft_tokens": ((k,), torch.int64),  # drafts for the next step
    }


class SpecModel(Protocol):
    """Target and draft. Both methods run on the forward stream."""

    k: int

    @property
    def extra_fields(self) -> Mapping[str, tuple[Shape, torch.dtype]]:
        """Draft-side fields stored per step beside the required ones (may be empty)."""
        ...

    def verify(self, step: int, inputs: SpecInputs, req_ids: torch.Tensor) -> torch.Tensor:
        """``[n, k+1]`` int64: the target's greedy token after each input row."""
        ...

    def draft(
        self, last: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``{"draft_tokens": [n, k] int64, **extra_fields}`` continuing ``last`` at ``positions``."""
        ...


@dataclass(slots=True, eq=False)
class SpecBatch:
    """One step, built by the scheduler on the host.

    ``last [n]``: ``-slot`` of the request's previous step (from ``host_placeholders()``) or a
    concrete last token of a fresh request, whose length is ``seq_lens [n]``. ``consumes``: the
    handles those placeholders came from; the runtime releases them once prepare is enqueued.
    """

    last: np.ndarray
    seq_lens: np.ndarray
    req_ids: np.ndarray
    consumes: list[FutureIndices] = field(default_factory=list)
    tag: Any = None
    out: FutureIndices | None = None

    def __post_init__(self) -> None:
        n = np.asarray(self.last).size
        for name in ("last", "seq_lens", "req_ids"):
            a = np.asarray(getattr(self, name))
            if a.ndim != 1 or a.size != n or not np.issubdtype(a.dtype, np.integer):
                raise TypeError(
                    f"SpecBatch.{name} must be a 1-D int array of {n} entries, got {a.dtype} {a.shape}"
                )
            setattr(self, name, a.astype(np.int64, copy=False))


@dataclass(slots=True, eq=False)
class SpecResult:
    """A processed step: ``tokens [n, k+1]`` int64, of which row ``i`` commits ``accept_len[i]``."""

    step: int
    batch: SpecBatch
    tokens: np.ndarray
    accept_len: np.ndarray


class SpecScheduler(Protocol):
    def schedule(self) -> SpecBatch | None: ...

    def process(self, result: SpecResult) -> None: ...


@dataclass(slots=True)
class SpecStats:
    mode: str
    steps: int = 0
    rows: int = 0
    accepted: int = 0
    wall: float = 0.0

    @property
    def mean_accept(self) -> float:
        """Tokens committed per request-step (1 = no draft ever accepted)."""
        return self.accepted / self.rows if self.rows else 0.0


def greedy_accept(inputs: SpecInputs, target: torch.Tensor) -> torch.Tensor:
    """``[n]`` int32: 1 + the longest prefix of valid drafts equal to the target's greedy tokens."""
    drafts = inputs.input_ids[:, 1:]
    k = drafts.shape[1]
    valid = torch.arange(k, device=drafts.device)[None, :] < inputs.n_draft[:, None]
    match = (drafts == target[:, :k]) & valid
    return (match.to(torch.int32).cumprod(dim=1).sum(dim=1) + 1).to(torch.int32)
