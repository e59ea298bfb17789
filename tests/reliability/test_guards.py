"""Bug classes of overlap schedulers (README.md, "Fault injection and the soak") that need no
planted defect: the map and the runtime guard against them by design.

==============================  ======================================  ============================
bug class                       tests                                   guarded by
==============================  ======================================  ============================
out-of-range placeholder (1)    test_out_of_range_placeholder_in_a_     the error flag: FutureError
                                batch, test_debug_flag_does_not_stick,  at the next host sync
                                test_out_of_range_is_never_read         (debug: at once)
empty batches                   test_empty_handles_are_noops,           every op is a no-op, no
                                test_runtime_runs_empty_batches         error
consume-twice / write-twice     test_write_twice_is_caught_by_debug,    debug's slot states; the
                                test_relaunching_a_batch_is_refused     runtime refuses a relaunch
==============================  ======================================  ============================

1. An unchecked read could crash the process. A scheduler plants the bad id; the bad row is
   never read, the map is intact afterwards, and a reported flag does not stick.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scenario import CAPACITY, GRAMMAR, GRAMMAR_SPECS, SPECS, VOCAB
from support import worker_threads

from tfuture import FutureError, FutureIndices, FutureMap
from tfuture.core.batch import Batch, ForwardBatch
from tfuture.kernels.resolve import resolve_futures_
from tfuture.kernels.store import store_futures
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, ToyModel, first_difference


class _Recording(ToyModel):
    """A toy model that keeps every step's resolved input ids."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB)
        self.inputs: dict[int, list[int]] = {}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.inputs[batch.step] = batch.input_ids.tolist()
        return super().forward(batch)


class _BadPlaceholder(ContinuousBatcher):
    """Plants ``bad`` as the first token of the ``at``-th batch; records processed steps."""

    def __init__(self, *args, at: int, bad: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.at, self.bad, self.built, self.processed = at, bad, 0, []

    def _build(self, rows):
        batch = super()._build(rows)
        if self.built == self.at:
            batch.tokens[0] = self.bad
        self.built += 1
        return batch

    def process(self, result) -> None:
        self.processed.append(result.step)
        super().process(result)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("bad", [-(CAPACITY + 1), -(2**62), -(2**63)], ids=["past-end", "far", "int64-min"])
def test_out_of_range_placeholder_in_a_batch(sync_ref, overlap, debug, bad):
    """A placeholder no consumed handle names (here: outside the map) is refused on the host
    when its step launches: the step never runs. (The kernels' own guard, the error flag for a
    placeholder outside the map, is tested on the map and the kernels.)"""
    at = 3
    fmap = FutureMap(CAPACITY, device="cpu", debug=debug)
    model = _Recording()
    sched = _BadPlaceholder(SPECS, fmap, max_running=4, at=at, bad=bad)
    with pytest.raises(ValueError, match=rf"negative id {bad}, which no handle of batch.consumes names"):
        OverlapRuntime(model, fmap, overlap=overlap).run(sched)
    # No negative id ever reached the model, and the bad step never ran.
    assert all(min(ids) >= 0 for ids in model.inputs.values())
    assert at not in model.inputs
    assert all(step < at for step in sched.processed)
    assert fmap.in_use == 0 and not worker_threads()
    # The map is not corrupted (and a reported flag does not stick): the next run on it is exact.
    sched = ContinuousBatcher(SPECS, fmap, max_running=4)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(sched)
    assert sched.outputs == sync_ref and fmap.in_use == 0


def test_debug_flag_does_not_stick(sync_ref):
    fmap = FutureMap(CAPACITY, device="cpu", debug=True)
    with pytest.raises(FutureError, match=r"pointed outside"):
        fmap.resolve(torch.tensor([-(CAPACITY + 1)]))
    assert fmap.resolve(torch.tensor([5, 6])).tolist() == [5, 6]
    sched = ContinuousBatcher(SPECS, fmap, max_running=4)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    assert sched.outputs == sync_ref and fmap.in_use == 0


def test_out_of_range_is_never_read():
    # token_map is a view into a larger buffer whose tail holds a sentinel: an unchecked read or
    # write past the map would see or change it.
    cap, sentinel = 8, 777
    buf = torch.full((cap + 1 + 8,), sentinel, dtype=torch.int64)
    token_map = buf[: cap + 1]
    token_map.copy_(torch.arange(cap + 1) * 10)
    err = torch.zeros(2, dtype=torch.int64)
    ids = torch.tensor([-(cap + 1), -3, -(cap + 5), 5, -(2**63), -(2**40)])
    resolve_futures_(ids, token_map, err=err)
    assert ids.tolist() == [0, 30, 0, 5, 0, 0]
    assert err.tolist() == [4, -(2**63)]
    store_futures(token_map, torch.tensor([cap + 1, 2, cap + 7, 0]), torch.tensor([1, 2, 3, 4]), err=err)
    assert buf[cap + 1 :].eq(sentinel).all()
    assert token_map.tolist() == [0, 10, 2, 30, 40, 50, 60, 70, 80]  # slot 0 is never a target
    assert err[0].item() == 7


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_empty_handles_are_noops(debug, dtype):
    fmap = FutureMap(4, device="cpu", dtype=dtype, debug=debug)
    live = fmap.alloc(2)
    fmap.store(live, torch.tensor([7, 8], dtype=dtype))
    before = fmap.token_map.clone()
    e = fmap.alloc(0)
    assert len(e) == 0 and fmap.in_use == 2
    assert e.placeholders().numel() == 0 and e.host_placeholders().size == 0
    fmap.store(e, torch.zeros(0, dtype=dtype))
    fmap.store(e, torch.zeros(0, dtype=torch.int64 if dtype == torch.int32 else torch.int32))
    empties = [
        e.filter([]),
        e.filter(np.zeros(0, dtype=bool)),
        e.filter(torch.zeros(0, dtype=torch.int64)),
        live.filter([False, False]),
        FutureIndices.cat([e, e]),
    ]
    assert all(len(h) == 0 for h in empties)
    both = FutureIndices.cat([e, live, e])
    assert both.slots.tolist() == live.slots.tolist()
    empty_ids = torch.zeros(0, dtype=dtype)
    assert fmap.resolve(empty_ids) is empty_ids and empty_ids.numel() == 0
    res = fmap.prepare_inputs(empty_ids, torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert all(t.numel() == 0 for t in res)
    for h in [e, *empties]:
        fmap.store(h, torch.zeros(0, dtype=dtype))
        fmap.release(h)
    assert fmap.in_use == 2 and torch.equal(fmap.token_map, before)
    fmap.check()
    fmap.release(both)
    fmap.release(live)
    assert fmap.in_use == 0


def _empty_batch() -> Batch:
    e = np.zeros(0, dtype=np.int64)
    return Batch(e, e, e, e, np.zeros(0, dtype=bool), tag=[])


class _Idle:
    """An idle rank: schedules ``n`` empty batches, then stops."""

    def __init__(self, n: int) -> None:
        self.left, self.results = n, []

    def schedule(self):
        if self.left == 0:
            return None
        self.left -= 1
        return _empty_batch()

    def process(self, result) -> None:
        self.results.append(result.tokens.size)

    def build_mask(self, batch):
        return None


class _WithIdleSteps(ContinuousBatcher):
    """Every third step is an empty batch (nothing to run on this rank this time)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls = self.empty = 0

    def schedule(self):
        self.calls += 1
        if self.calls % 3 == 0 and not self.idle:
            self.empty += 1
            return _empty_batch()
        return super().schedule()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_runtime_runs_empty_batches(sync_ref, grammar_ref, overlap, debug):
    fmap = FutureMap(4, device="cpu", debug=debug)
    idle = _Idle(5)
    stats = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(idle)
    assert stats.steps == 5 and idle.results == [0] * 5 and fmap.in_use == 0

    for specs, grammar, ref in ((SPECS, None, sync_ref), (GRAMMAR_SPECS, GRAMMAR, grammar_ref)):
        fmap = FutureMap(CAPACITY, device="cpu", debug=debug)
        sched = _WithIdleSteps(specs, fmap, max_running=4, grammar=grammar)
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(sched)
        assert sched.empty > 0
        assert sched.outputs == ref, first_difference(ref, sched.outputs, ("sync", "with idle steps"))
        assert fmap.in_use == 0 and not worker_threads()


def test_write_twice_is_caught_by_debug():
    # Without the bug: write once, read twice (two consumers of one value), release.
    for debug in (False, True):
        fmap = FutureMap(8, device="cpu", debug=debug)
        a = fmap.alloc(3)
        fmap.store(a, torch.tensor([5, 6, 7]))
        assert fmap.resolve(a.placeholders()).tolist() == [5, 6, 7]
        assert fmap.resolve(a.filter([2, 0]).placeholders()).tolist() == [7, 5]
        fmap.release(a)

    # The bug without debug: a second store silently replaces a value before it was read.
    fmap = FutureMap(8, device="cpu")
    a = fmap.alloc(3)
    fmap.store(a, torch.tensor([5, 6, 7]))
    fmap.store(a.filter([1]), torch.tensor([66]))
    assert fmap.resolve(a.placeholders()).tolist() == [5, 66, 7]

    # Debug mode: the second store is refused before it writes (W W), also after a read (W R W).
    dmap = FutureMap(8, device="cpu", debug=True)
    a = dmap.alloc(3)
    dmap.store(a, torch.tensor([5, 6, 7]))
    with pytest.raises(FutureError, match=r"store of slot 2 which is written"):
        dmap.store(a.filter([1]), torch.tensor([66]))
    assert dmap.resolve(a.placeholders()).tolist() == [5, 6, 7]
    with pytest.raises(FutureError, match=r"store of slot 1 which is read"):
        dmap.store(a, torch.tensor([8, 9, 10]))
    assert dmap.resolve(a.placeholders()).tolist() == [5, 6, 7]
    # A handle naming one slot twice can never write it twice, debug or not.
    for m in (fmap, dmap):
        dup = m.alloc(1)
        with pytest.raises(ValueError, match=r"distinct slots"):
            m.store(FutureIndices.cat([dup, dup]), torch.tensor([1, 2]))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_relaunching_a_batch_is_refused(overlap):
    """A batch launched twice would store twice into its ``out`` slots: the runtime refuses it."""

    class Again(ContinuousBatcher):
        again: Batch | None = None

        def schedule(self):
            if self.again is not None:
                batch, self.again = self.again, None
                return batch
            batch = super().schedule()
            if batch is not None and self.tick == 3:
                self.again = batch
            return batch

    fmap = FutureMap(CAPACITY, device="cpu", debug=True)
    sched = Again(SPECS, fmap, max_running=4)
    with pytest.raises(ValueError, match=r"already launched"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(sched)
    assert fmap.in_use == 0 and not worker_threads()
