"""Speculative steps and multi-step windows in one run: :class:`SpecWindowStep`.

``ContinuousBatcher(speculative=k, multi_step=K)`` (``Engine(speculative=..., multi_step=K)``)
gives every request that drafts its own speculative steps, and runs a window of up to ``K``
decode steps when no request of the step drafts or verifies drafts (those that opted out with
``GenerationParams(speculative=False)``, or whose grammar matcher cannot roll back): a step
with a drafting request is a speculative step, where the others decode one token as plain rows.

The step kind is the speculative step, holding a :class:`tfuture.spec.MultiStepTokenStep` over
the same model, Sampler and map that runs the windows (``DraftBatch.n_steps > 1``). Both claim
the Sampler as one owner, so penalties and seeded draws follow each request across both kinds of
step. A window's requests never draft; the drafter still sees each window's first step (a draft
model keeps a KV row for every request a speculative step may hold, so a request whose prefill
ran in a window has one) and hears of the requests that ended (its rows go back), in stream
order. It does not see a window's later steps: the draft model's cache of a request that never
drafts has gaps there, which only its unused drafts read. Slots are kept as the
speculative step keeps them (a request's next step names its last one's).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tfuture.core.batch import Model
from tfuture.core.future_map import FutureMap
from tfuture.sampling import Sampler
from tfuture.spec.drafter import Drafter
from tfuture.spec.multistep import MultiStepTokenStep, WindowState
from tfuture.spec.step import SpecTokenStep
from tfuture.steps.base import InFlight, Op, StepPlan

__all__ = ["SpecWindowStep"]


class SpecWindowStep(SpecTokenStep):
    """:class:`SpecTokenStep` whose ``DraftBatch.n_steps > 1`` batches run as windows (see the
    module docstring). ``model``, ``drafter`` (bound by the caller), ``sampler``: as for the
    speculative step."""

    windows = True
    stream_ops = tuple(dict.fromkeys((*SpecTokenStep.stream_ops, *MultiStepTokenStep.stream_ops)))

    def __init__(self, model: Model, drafter: Drafter, sampler: Sampler | None = None) -> None:
        super().__init__(model, drafter, sampler)
        #: The window step: same model and Sampler, this step as the Sampler's owner.
        self.window = MultiStepTokenStep(model, self.sampler)
        self.window.owner = self

    def bind(self, fmap: FutureMap) -> None:
        super().bind(fmap)
        self.window.bind(fmap)

    @staticmethod
    def _windowed(rec: InFlight) -> bool:
        return isinstance(rec.state, WindowState)

    # -- host, at launch ---------------------------------------------------------------------

    def plan(self, batch: Any) -> StepPlan:
        if int(getattr(batch, "n_steps", 1)) > 1:
            return self.window.plan(batch)
        return super().plan(batch)

    # -- forward stream ----------------------------------------------------------------------

    def prepare(self, rec: InFlight, inputs: Any) -> None:
        if not self._windowed(rec):
            super().prepare(rec, inputs)
            return
        self.window.prepare(rec, inputs)
        if not self.drafts:
            return
        # As a speculative step's prepare does, in stream order: the ended requests' rows back
        # first, then the window's first step shown (a draft model takes the KV rows of requests
        # whose prefill runs here; a later speculative step may hold them beside drafting ones).
        state = rec.state
        if state.ended.size:
            self.drafter.release(state.ended)
        self.drafter.observe(state.fwd)

    def forward_ops(self, rec: InFlight) -> list[Op]:
        return self.window.forward_ops(rec) if self._windowed(rec) else super().forward_ops(rec)

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        return self.window.sample_ops(rec, mask) if self._windowed(rec) else super().sample_ops(rec, mask)

    # -- host, after copy_done ---------------------------------------------------------------

    def n_result(self, rec: InFlight) -> int:
        return self.window.n_result(rec) if self._windowed(rec) else super().n_result(rec)

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        if self._windowed(rec):
            self.window.copy_result(rec, dst)
        else:
            super().copy_result(rec, dst)

    def result_array(self, rec: InFlight) -> np.ndarray | None:
        return self.window.result_array(rec) if self._windowed(rec) else super().result_array(rec)

    def result(self, rec: InFlight, words: np.ndarray) -> Any:
        return self.window.result(rec, words) if self._windowed(rec) else super().result(rec, words)
