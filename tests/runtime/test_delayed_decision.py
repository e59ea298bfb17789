"""Which requests make a token step wait for the scheduler's mask (TokenStep.delayed and the row
split), and the bucket a step is padded to.

``Batch.delayed`` entries of requests that do not sample are ignored (the Batch docstring): a
prefill chunk marked delayed must not make the step wait, nor call ``build_mask``. In a step that
samples some rows at once and others after the mask, the mask's rows are the waiting ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from tfuture import FutureMap
from tfuture.core.batch import Batch, StepResult
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.steps.token import Buckets
from tfuture.testing.toy import ToyModel

VOCAB = 64


class OneBatch:
    """Launches ``batch`` once; ``build_mask`` returns ``mask``, or fails the run when None."""

    def __init__(self, batch: Batch, mask: np.ndarray | None = None) -> None:
        self.batch, self.mask = batch, mask
        self.masks_built: list[int] = []
        self.tokens: list[list[int]] = []
        self._sent = False

    def schedule(self) -> Batch | None:
        if self._sent:
            return None
        self._sent = True
        return self.batch

    def process(self, result: StepResult) -> None:
        self.tokens.append(result.tokens.tolist())

    def build_mask(self, batch: Batch) -> np.ndarray:
        self.masks_built.append(batch.step)
        if self.mask is None:
            raise AssertionError(f"build_mask called for step {batch.step}, which has no waiting row")
        return self.mask


def prefill_and_decode(delayed: np.ndarray, sample: list[bool]) -> Batch:
    """Request 0: a two-token prefill chunk; request 1: a decode."""
    return Batch(
        np.array([5, 6, 7]),
        np.array([2, 1]),
        np.array([0, 3]),
        np.array([0, 1]),
        np.array(sample),
        delayed=delayed,
    )


def run(batch: Batch, overlap: bool, mask: np.ndarray | None = None, sampler: Sampler | None = None):
    sched = OneBatch(batch, mask)
    OverlapRuntime(ToyModel(vocab=VOCAB), FutureMap(8, device="cpu"), overlap=overlap, sampler=sampler).run(
        sched
    )
    return sched


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_delayed_prefill_chunk_does_not_wait_for_a_mask(overlap):
    # Request 0 does not sample: its delayed entry is ignored, build_mask is never called.
    sched = run(prefill_and_decode(np.array([True, False]), [False, True]), overlap)
    plain = run(prefill_and_decode(np.array([False, False]), [False, True]), overlap)
    assert sched.masks_built == []
    assert sched.tokens == plain.tokens and len(sched.tokens[0]) == 1


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_delayed_sampling_request_waits_for_its_mask(overlap):
    # The control: the same batch with the sampling request delayed waits, and takes the mask.
    mask = np.zeros((1, VOCAB), dtype=np.bool_)
    mask[0, 17] = True
    sched = run(prefill_and_decode(np.array([False, True]), [False, True]), overlap, mask)
    assert sched.masks_built == [0] and sched.tokens == [[17]]


def decodes(delayed: list[bool]) -> Batch:
    n = len(delayed)
    return Batch(
        np.array([11, 12, 13][:n]),
        np.ones(n, dtype=np.int64),
        np.array([4, 6, 8][:n]),
        np.arange(n),
        np.ones(n, dtype=np.bool_),
        delayed=np.array(delayed),
    )


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_only_the_waiting_rows_take_the_mask(overlap):
    # Rows 0 and 2 wait (their mask allows one token each), row 1 samples at once, unmasked.
    mask = np.zeros((2, VOCAB), dtype=np.bool_)
    mask[0, 3] = mask[1, 9] = True
    sched = run(decodes([True, False, True]), overlap, mask, Sampler())
    free = run(decodes([False, False, False]), overlap, None, Sampler())
    assert sched.masks_built == [0]
    assert sched.tokens[0][0] == 3 and sched.tokens[0][2] == 9
    assert sched.tokens[0][1] == free.tokens[0][1]


def test_a_step_that_fills_a_bucket_exactly_keeps_it():
    rows = (4, 8)
    assert [Buckets.fit(rows, n) for n in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 9]
