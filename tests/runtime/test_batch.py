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


class _MaskedBatch(_OneBatch):
    """:class:`_OneBatch` whose ``build_mask`` allows one token per waiting row (token 5) and
    counts the rows it was asked for."""

    def __init__(self, batch: Batch) -> None:
        super().__init__(batch)
        self.mask_rows: list[int] = []
        self.tokens: list[int] = []

    def build_mask(self, batch):
        rows = int(np.count_nonzero(batch.delayed[batch.sample]))
        self.mask_rows.append(rows)
        mask = np.zeros((rows, 16), dtype=bool)
        mask[:, 5] = True
        return mask

    def process(self, result) -> None:
        self.tokens.extend(result.tokens.tolist())


def _two_requests(**kw) -> Batch:
    return Batch(
        np.array([1, 2]), np.ones(2, np.int64), np.zeros(2, np.int64), np.arange(2), np.ones(2, bool), **kw
    )


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(
    "later", [True, np.bool_(True), np.array([False, True])], ids=["bool", "numpy-bool", "array"]
)
def test_delayed_assigned_after_construction_is_taken_as_the_constructor_takes_it(later, overlap):
    # Issue 30 item 8: batch.delayed = True after construction died inside the runtime with
    # "'bool' object has no attribute 'base'". It waits for its mask as Batch(delayed=True) does.
    tokens = {}
    for how in ("constructor", "assigned"):
        batch = _two_requests(delayed=later) if how == "constructor" else _two_requests()
        if how == "assigned":
            batch.delayed = later
        sched = _MaskedBatch(batch)
        fmap = FutureMap(8, device="cpu")
        OverlapRuntime(ToyModel(vocab=16), fmap, overlap=overlap).run(sched)
        assert sched.mask_rows == [1 if isinstance(later, np.ndarray) else 2]
        assert fmap.in_use == 0 and not worker_threads()
        tokens[how] = sched.tokens
    assert tokens["assigned"] == tokens["constructor"]
    assert tokens["assigned"][1] == 5  # the waiting row took its mask


@pytest.mark.parametrize(
    "bad",
    ["yes", 1, np.array([1, 0]), np.array([True]), [True, False]],
    ids=["str", "int", "int-array", "short-array", "list"],
)
def test_a_bad_delayed_assigned_after_construction_is_refused_naming_the_field(bad):
    batch = _two_requests()
    batch.delayed = bad
    fmap = FutureMap(8, device="cpu")
    with pytest.raises(TypeError, match=r"Batch\.delayed must be a bool or a bool numpy array of 2 entries"):
        OverlapRuntime(ToyModel(vocab=16), fmap).run(_MaskedBatch(batch))
    assert fmap.in_use == 0 and not worker_threads()
