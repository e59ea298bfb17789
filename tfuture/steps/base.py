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

:class:`tfuture.steps.token.TokenStep` is the plain step (prepare, forward, sample, store,
copy); :class:`tfuture.spec.SpecTokenStep` (drafts) and :class:`tfuture.spec.MultiStepTokenStep`
(windows) are token steps with ops changed, as :class:`tfuture.distributed.step.ParallelStep` is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from tfuture.core.future_map import FutureMap
from tfuture.core.slots import FutureIndices
from tfuture.streams.backends import Marker
from tfuture.streams.staging import Staging

Op = tuple[str, Callable[[], None]]


class StepPlan(NamedTuple):
    """A step's host side: ``n_out`` fresh slots, ``inputs`` (a NamedTuple of int64 host arrays,
    staged back to back in one H2D copy; ``prepare`` gets the same NamedTuple of device views), and
    ``state``, the kind's per-step record (device tensors land there on the stream)."""

    n_out: int
    inputs: Any
    state: Any
    delayed: bool = False  # sample only after the previous step was processed (a mask)
    #: A device buffer the staged data is copied into (a graphed step's static inputs) instead of
    #: fresh device memory; ``inputs`` then fill it exactly.
    target: Any = None
    #: Called with the step's fresh ``out`` handle before its inputs are staged (a graphed step
    #: stages the slots to store into).
    with_out: Callable[[FutureIndices], None] | None = None


@dataclass(slots=True, eq=False)
class InFlight:
    """Everything a launched step keeps alive until its results were processed."""

    step: int
    batch: Any
    out: FutureIndices
    inputs: Staging | None  # the input staging buffer (None on a CPU map: it stages none)
    state: Any
    staging: Staging | None = None  # the output staging buffer (None on a CPU map)
    words: tuple[np.ndarray, list[int]] | None = None  # a CPU map's results and error flag (copy op)
    #: A CPU map: the step's staged parts (the plan's NamedTuple) as the step's own fresh numpy
    #: arrays, the memory of the device views ``prepare`` gets; else None.
    host_inputs: Any = None
    copy_done: Marker | None = None
    n_result: int = 0
    delayed: bool = False  # decided once at launch: a scheduler may edit its batch later


class StepKind(ABC):
    """What a step does on the forward stream (see the module docstring).

    ``keeps_out``: a step's ``out`` handle stays live until the step was processed *and* a
    later step was launched, so the scheduler can name its latest step's slots in sync mode too
    (a speculative step's drafts live only in its slots).
    ``stream_ops``: every op name the kind's steps may submit, with the runtime's own.
    """

    keeps_out = False
    #: Names of the stream ops the kind submits (the runtime adds ``prepare`` and ``copy``);
    #: a :class:`tfuture.streams.base.RunWrapper` may target them.
    stream_ops: tuple[str, ...] = ("prepare", "copy", "debug")

    def bind(self, fmap: FutureMap) -> None:  # noqa: B027 - most kinds need no per-map state
        """Called once by the runtime with its map, before any step."""

    @abstractmethod
    def plan(self, batch: Any) -> StepPlan:
        """Check ``batch`` (``TypeError``/``ValueError``) and plan its host side."""

    @abstractmethod
    def prepare(self, rec: InFlight, inputs: Any) -> None:
        """On the stream: build the device inputs from the staged arrays (``inputs``: the plan's
        NamedTuple, with device views of its arrays)."""

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

    def result_array(self, rec: InFlight) -> np.ndarray | None:
        """On the stream of a CPU map: the ``[n_result]`` integer results that :meth:`copy_result`
        would copy, as a numpy array (a view of their tensor), when they are one tensor; the
        runtime then copies them straight into fresh memory the step owns. None (the default):
        the runtime calls :meth:`copy_result`."""
        return None

    @abstractmethod
    def result(self, rec: InFlight, words: np.ndarray) -> Any:
        """On the host, after ``copy_done``: what ``scheduler.process`` gets."""

    @abstractmethod
    def n_tokens(self, result: Any) -> int:
        """Tokens the step produced (for tokens/s)."""

    def drained(self) -> None:  # noqa: B027 - most kinds hold nothing only a running step needs
        """On the host, after every run (one cut by ``max_steps`` too) once the stream was
        drained: give back what only steps in flight need; per-request state stays."""

    def close(self) -> None:  # noqa: B027 - most kinds hold nothing past a run
        """On the host, once a run ended or failed and the stream was drained."""
