"""Input that used to give wrong tokens silently is refused where it enters (issue 20)."""

from __future__ import annotations

import numpy as np
import pytest

from tfuture import FutureMap
from tfuture.core.batch import Batch
from tfuture.runtime import OverlapRuntime
from tfuture.steps.token import Buckets
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyModel, random_workload

VOCAB = 64


class OneBatch:
    def __init__(self, batch: Batch) -> None:
        self.batch: Batch | None = batch

    def schedule(self) -> Batch | None:
        batch, self.batch = self.batch, None
        return batch

    def process(self, result) -> None:
        pass

    def build_mask(self, batch: Batch) -> None:
        return None


def test_duplicate_request_ids_in_a_batch_are_refused() -> None:
    with pytest.raises(ValueError, match="req_ids must be unique, got request 5 twice"):
        Batch(np.array([1, 2]), np.array([1, 1]), np.array([0, 0]), np.array([5, 5]), np.array([True, True]))


def test_duplicate_request_ids_in_a_batcher_are_refused() -> None:
    specs = [RequestSpec(3, 0, np.array([1]), 2), RequestSpec(3, 1, np.array([2]), 2)]
    with pytest.raises(ValueError, match="request id 3 appears twice"):
        ContinuousBatcher(specs, FutureMap(8, device="cpu"))


@pytest.mark.parametrize("prompt", [np.array([5, -1, 7]), np.array([-9])])
def test_a_negative_id_no_consumed_handle_names_is_refused(prompt: np.ndarray) -> None:
    """A prompt's -1 used to resolve to slot 1: another request's token."""
    fmap = FutureMap(8, device="cpu")
    other = fmap.alloc(2)  # slots 1 and 2 are live: a bad resolve would read them
    n = prompt.size
    batch = Batch(prompt, np.array([n]), np.array([0]), np.array([0]), np.array([True]))
    with pytest.raises(ValueError, match=r"negative id -\d+, which no handle of batch.consumes names"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(OneBatch(batch))
    fmap.release(other)
    assert fmap.in_use == 0


def test_placeholders_of_consumed_handles_in_any_order_are_accepted() -> None:
    fmap = FutureMap(8, device="cpu")
    h = fmap.alloc(2)
    import torch

    fmap.store(h, torch.tensor([11, 12]))
    ph = h.host_placeholders()[::-1].copy()
    batch = Batch(
        ph, np.array([1, 1]), np.array([3, 3]), np.array([0, 1]), np.array([True, True]), consumes=[h]
    )
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(OneBatch(batch))
    assert fmap.in_use == 0


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"max_running": 0}, ValueError, "max_running must be an int >= 1, got 0"),
        ({"chunk": 0}, ValueError, "chunk must be an int >= 1"),
        ({"token_budget": -1}, ValueError, "token_budget must be an int >= 1"),
    ],
)
def test_batcher_limits_are_checked(kw: dict, err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        ContinuousBatcher(random_workload(0, 2), FutureMap(8, device="cpu"), **kw)


def test_request_specs_are_checked() -> None:
    assert RequestSpec(0, 0, [3, 4], 2).prompt.tolist() == [3, 4]  # a list prompt is taken
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):
        RequestSpec(1, 0, np.array([], dtype=np.int64), 2)
    with pytest.raises(ValueError, match="request 2: max_new must be >= 1"):
        RequestSpec(2, 0, np.array([1]), 0)
    with pytest.raises(ValueError, match="request 3: prompt token ids must be >= 0"):
        RequestSpec(3, 0, np.array([1, -1]), 2)
    with pytest.raises(TypeError, match="request 4: prompt must be a 1-D integer array"):
        RequestSpec(4, 0, np.array([[1, 2]]), 2)


def test_steps_past_the_largest_bucket_are_not_cached() -> None:
    """Every oversized step used to cache a buffer set for its exact shape: memory grew."""
    fmap = FutureMap(64, device="cpu")
    runtime = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, buckets=Buckets(rows=(2,), reqs=(2,)))
    for seed in range(3):
        sched = ContinuousBatcher(random_workload(seed, 8, vocab=VOCAB), fmap, max_running=6, chunk=8)
        runtime.run(sched)
    cached = runtime.kind._outs  # type: ignore[attr-defined]
    assert set(cached) <= {(2, 2)}, sorted(cached)
