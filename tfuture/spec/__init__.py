"""Speculative decoding in the token step: drafters, verification, the step and its batch.

A request in a token step carries ``k >= 0`` drafts (``k = 0`` is plain decoding). A
:class:`Drafter` proposes them on the forward stream (:class:`NGramDrafter`: prompt lookup on a
device history), :class:`SpecTokenStep` verifies them (greedy acceptance, or rejection sampling
over the request's parameters: :mod:`tfuture.spec.verify`) and stores each request's last
committed token, its next drafts and its sequence length in its future slots, so the next
step, scheduled before the host saw this one, reads them there. :class:`MultiStepTokenStep`
runs several decode steps per launch on the same machinery (``DraftBatch.n_steps``), and
:class:`SpecWindowStep` runs both in one run (windows where no request drafts).
"""

from tfuture.spec.batch import DraftBatch, DraftResult
from tfuture.spec.drafter import DraftContext, Drafter
from tfuture.spec.model_drafter import ModelDrafter
from tfuture.spec.multistep import MultiStepTokenStep
from tfuture.spec.ngram import NGramDrafter
from tfuture.spec.spec_windows import SpecWindowStep
from tfuture.spec.step import SpecTokenStep

__all__ = [
    "DraftBatch",
    "DraftContext",
    "DraftResult",
    "Drafter",
    "ModelDrafter",
    "MultiStepTokenStep",
    "NGramDrafter",
    "SpecTokenStep",
    "SpecWindowStep",
]
