"""A step's batch (``tfuture.core.batch``): validated on construction, and its consumed handles are
taken over by the runtime, released even when the batch is refused."""

import numpy as np
import pytest
from support import worker_threads

from tfuture import FutureMap
from tfuture.core.batch import Batch
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ToyModel

BAD_FIELDS = [
    pytest.param("tokens", [1, 2], TypeError, id="tokens-list"),
    pytest.param("seg_lens", np.array([1.0]), TypeError, id="seg-lens-float"),
    pytest.param("prefix_lens", np.array([0, 0]), ValueError, id="prefix-lens-long"),
    pytest.param("sample", np.array([1]), TypeError, id="sample-int"),
    pytest.param("seg_lens", np.array([0]), ValueError, id="seg-lens-zero"),
    pytest.param("tokens", np.array([1, 2]), ValueError, id="tokens-not-sum-of-seg-lens"),
    pytest.param("consumes", [np.array([1])], TypeError, id="consumes-not-handles"),
]


@pytest.mark.parametrize(("field", "value", "err"), BAD_FIELDS)
def test_batch_validation(field, value, err):
    kw = dict(
        tokens=np.array([1]),
        seg_lens=np.array([1]),
        prefix_lens=np.array([0]),
        req_ids=np.array([0]),
        sample=np.array([True]),
    )
    kw[field] = value
    with pytest.raises(err, match=f"Batch.{field}"):
        Batch(**kw)


class _OneBatch:
    """Schedules ``batch`` once, then nothing."""

    def __init__(self, batch: Batch) -> None:
        self.batch: Batch | None = batch

    def schedule(self) -> Batch | None:
        batch, self.batch = self.batch, None
        return batch

    def process(self, result) -> None:
        pass

    def build_mask(self, batch):
        return None


@pytest.mark.parametrize("bad", ["released", "foreign", "not-a-handle"])
def test_a_refused_batch_still_releases_its_consumed_handles(bad):
    fmap, other = FutureMap(8, device="cpu"), FutureMap(8, device="cpu")
    good = fmap.alloc(2)
    fmap.store(good, good.placeholders().neg())
    wrong = None
    if bad == "released":
        wrong = fmap.alloc(1)
        fmap.release(wrong)
    elif bad == "foreign":
        wrong = other.alloc(1)
    batch = Batch(
        good.host_placeholders(), np.array([1, 1]), np.array([0, 0]), np.array([0, 1]), np.ones(2, bool)
    )
    # Set after construction, as a scheduler bug would: the runtime checks the list again.
    batch.consumes = [good, wrong]
    with pytest.raises((TypeError, ValueError), match=r"batch\.consumes\[1\]"):
        OverlapRuntime(ToyModel(vocab=16), fmap).run(_OneBatch(batch))
    # The runtime took the batch's handles over: the valid one is released, nothing leaks.
    assert good.released and fmap.in_use == 0 and not worker_threads()
    assert other.in_use == (1 if bad == "foreign" else 0)
