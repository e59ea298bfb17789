"""The lean host paths of the bookkeeping and of the numpy kernels keep every rule.

``FutureMap`` on CPU tensors takes the numpy path of ``tfuture/kernels/cpu.py`` when the Triton
interpreter is off (the benchmarks, a CPU deployment); the rest of the suite runs the Triton
kernels under ``TRITON_INTERPRET=1``. Here the numpy path is forced, and the fuzzed state machine
of ``test_properties.py`` runs again on it, next to direct checks of each fast path's edge:
a run's mask filter, release counting, the resolve's gather guard, a run's store.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from test_properties import FutureMapMachine

import tfuture.kernels.cpu as cpu
from tfuture import FutureError, FutureIndices, FutureMap, FutureMapFull


def _numpy_path(patch: pytest.MonkeyPatch) -> None:
    """Every CPU launch on the numpy path, ``FutureMap``'s own host fast path included."""
    patch.setattr("tfuture.kernels._common.INTERPRET", False)
    for mod in ("resolve", "store"):
        patch.setattr(f"tfuture.kernels.{mod}.use_triton", lambda t: False)


@pytest.fixture
def numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _numpy_path(monkeypatch)


class NumpyPathMachine(FutureMapMachine):
    """The fuzzed API against its model, every CPU launch on the numpy path."""

    def __init__(self) -> None:
        super().__init__()
        self._patch = pytest.MonkeyPatch()
        _numpy_path(self._patch)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self._patch.undo()


NumpyPathMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestNumpyPathFuzz = NumpyPathMachine.TestCase


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_cycle_on_the_numpy_path(numpy_path, dtype):
    fmap = FutureMap(12, device="cpu", dtype=dtype)
    prefill = torch.tensor([7, 8], dtype=dtype)
    for step in range(20):  # round the ring several times
        fi = fmap.alloc(5)
        assert fi.is_contiguous
        tokens = torch.arange(100 * step, 100 * step + 5, dtype=dtype)
        fmap.store(fi, tokens)
        mask = np.array([True, False, True, True, False])
        keep = fi.filter(mask)
        assert fmap.refcounts[fi.slots].tolist() == [2, 1, 2, 2, 1]
        ids = fmap.resolve(torch.cat([prefill, keep.placeholders()]))
        assert ids.tolist() == [7, 8, *tokens[torch.from_numpy(mask)].tolist()]
        fmap.release(fi)
        assert fmap.in_use == 3 and fmap.refcounts[keep.slots].tolist() == [1, 1, 1]
        fmap.release(keep)
        assert fmap.in_use == 0 and fmap.refcounts[1:].sum() == 0
    fmap.check()


def test_a_mask_filter_of_a_run_takes_one_reference_per_kept_slot():
    fmap = FutureMap(8, device="cpu")
    fi = fmap.alloc(4)
    a = fi.filter(np.array([True, True, False, True]))
    b = fi.filter(np.array([False, True, False, True]))
    c = b.filter(np.array([True, False]))  # a mask of a filtered handle
    assert a.slots.tolist() == [1, 2, 4] and b.slots.tolist() == [2, 4] and c.slots.tolist() == [2]
    assert fmap.refcounts[1:5].tolist() == [2, 4, 1, 3]
    for h, in_use in ((fi, 3), (a, 2), (c, 2), (b, 0)):
        fmap.release(h)
        assert fmap.in_use == in_use
    assert fmap.alloc(8).slots.tolist() == list(range(1, 9))  # a full run from slot 1


@pytest.mark.parametrize("debug", [False, True])
def test_an_index_filter_of_every_row_in_order_is_the_run_again(debug):
    fmap = FutureMap(12, device="cpu", debug=debug)
    for n in (1, 2, 5):
        fi = fmap.alloc(n)
        every = fi.filter(np.arange(n, dtype=np.int64))
        assert every.is_contiguous and every.span == fi.span
        assert fmap.refcounts[fi.slots].tolist() == [2] * n
        fmap.release(fi)
        assert fmap.in_use == n and every.host_placeholders().tolist() == (-fi.slots).tolist()
        fmap.release(every)
        assert fmap.in_use == 0
    # Anything but 0..n-1 in order takes the general path, with its own references.
    fi = fmap.alloc(4)
    for keep in ([0, 0, 2, 3], [1, 0, 2, 3], [0, 1, 3]):
        h = fi.filter(np.array(keep, dtype=np.int64))
        assert not h.is_contiguous and h.slots.tolist() == fi.slots[keep].tolist()
        fmap.release(h)
    with pytest.raises(ValueError, match=r"keep indices must lie in \[-4, 4\), got 0..4"):
        fi.filter(np.array([0, 1, 2, 4], dtype=np.int64))
    fmap.release(fi)
    assert fmap.in_use == 0 and fmap.refcounts[1:].sum() == 0
    fmap.check()


def test_release_of_a_handle_naming_a_slot_twice_counts_each_slot_once():
    fmap = FutureMap(6, device="cpu")
    fi = fmap.alloc(3)
    twice = fi.filter([0, 0, 2])
    joined = FutureIndices.cat([twice, fi])
    fmap.release(fi)
    assert fmap.in_use == 3  # every slot lives on in joined
    fmap.release(joined)
    assert fmap.in_use == 2 and fmap.refcounts[1:4].tolist() == [2, 0, 1]
    fmap.release(twice)
    assert fmap.in_use == 0 and fmap.refcounts[1:].tolist() == [0] * 6
    assert type(fmap.in_use) is int


def test_every_fast_path_refuses_a_released_or_foreign_handle():
    fmap, other = FutureMap(6, device="cpu"), FutureMap(6, device="cpu")
    fi, alien = fmap.alloc(2), other.alloc(2)
    fmap.release(fi)
    calls = {
        "release": lambda h: fmap.release(h),
        "store": lambda h: fmap.store(h, torch.tensor([1, 2])),
        "filter": lambda h: h.filter(np.array([True, False])),
        "placeholders": lambda h: h.placeholders(),
        "host_placeholders": lambda h: h.host_placeholders(),
        "cat": lambda h: FutureIndices.cat([h]),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=f"{what}: expected a live FutureIndices, got a released one"):
            call(fi)
    for what in ("release", "store"):
        with pytest.raises(ValueError, match=f"{what} expects a FutureIndices of this FutureMap"):
            calls[what](alien)
    with pytest.raises(TypeError, match="release expects a FutureIndices, got int"):
        fmap.release(3)  # type: ignore[arg-type]
    assert fmap.in_use == 0 and other.in_use == 2


def test_alloc_fast_path_keeps_its_checks_and_never_overwrites_a_live_slot():
    fmap = FutureMap(4, device="cpu")
    held = fmap.alloc(3)
    with pytest.raises(FutureMapFull, match=r"asked for 2 slots, 3 of 4 in use \(1 free\)"):
        fmap.alloc(2)
    with pytest.raises(TypeError, match="alloc expects an int slot count, got bool"):
        fmap.alloc(True)
    with pytest.raises(ValueError, match="alloc expects n >= 0, got -1"):
        fmap.alloc(-1)
    one = fmap.alloc(np.int64(1))
    assert one.slots.tolist() == [4] and fmap.in_use == 4
    fmap.release(held)
    # The head wrapped to slot 1; a run of 3 there is free again.
    again = fmap.alloc(3)
    assert again.is_contiguous and again.slots.tolist() == [1, 2, 3]


def test_debug_generations_are_checked_on_every_fast_path():
    fmap = FutureMap(4, device="cpu", debug=True)
    fi = fmap.alloc(2)
    fmap.store(fi, torch.tensor([5, 6]))
    keep = fi.filter(np.array([True, False]))
    ids = fmap.resolve(torch.cat([torch.tensor([1]), keep.placeholders()]))
    assert ids.tolist() == [1, 5]
    fmap.release(fi)
    fmap.release(keep)
    with pytest.raises(ValueError, match="released one"):
        fmap.release(keep)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
def test_resolve_fast_path_never_reads_a_bad_placeholder(ids_dtype, map_dtype):
    token_map = torch.arange(100, 106, dtype=map_dtype)  # slots 1..5
    lo = torch.iinfo(ids_dtype).min
    err = torch.zeros(2, dtype=torch.int64)
    ids = torch.tensor([-1, 3, -5, -6, lo, -2, 0], dtype=ids_dtype)
    cpu.resolve_(ids, token_map, err)
    assert ids.tolist() == [101, 3, 105, 0, 0, 102, 0]
    assert err.tolist() == [2, lo]
    clean = torch.tensor([-4, 9, -1], dtype=ids_dtype)
    cpu.resolve_(clean, token_map, None)
    assert clean.tolist() == [104, 9, 101]
    left = torch.tensor([-9, -1], dtype=ids_dtype)
    cpu.resolve_(left, token_map, None)  # no error flag: a bad id is left as it is
    assert left.tolist() == [-9, 101]


def test_store_fast_path_flags_negative_tokens_and_bad_runs():
    token_map = torch.zeros(6, dtype=torch.int64)
    err = torch.zeros(2, dtype=torch.int64)
    cpu.store(token_map, range(1, 4), torch.tensor([4, 5, 6]), err)
    assert token_map.tolist() == [0, 4, 5, 6, 0, 0] and err.tolist() == [0, 0]
    cpu.store(token_map, range(3, 6), torch.tensor([7, -8, 9]), err)
    assert token_map.tolist() == [0, 4, 5, 7, 0, 9] and err.tolist() == [1, -8]
    cpu.store(token_map, range(4, 7), torch.tensor([1, 2, 3]), None)  # slot 6 does not exist
    assert token_map.tolist() == [0, 4, 5, 7, 1, 2]
    small = torch.zeros(4, dtype=torch.int32)
    cpu.store(small, range(1, 3), torch.tensor([2**31, 3]), err)  # past int32: 0 and flagged
    assert small.tolist() == [0, 0, 3, 0] and err.tolist() == [2, -8]


@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
def test_the_maps_host_fast_path_keeps_every_rule(numpy_path, map_dtype):
    """``FutureMap.store`` / ``resolve`` on a CPU map take numpy on the map's own view; a
    negative token, a token past an int32 map and a placeholder outside the map still take the
    checked path: 0 and flagged, a ``ValueError``, never read."""
    fmap = FutureMap(4, device="cpu", dtype=map_dtype)
    fi = fmap.alloc(3)
    fmap.store(fi, torch.tensor([5, -7, 6]))
    assert fmap.token_map.tolist() == [0, 5, 0, 6, 0]
    with pytest.raises(FutureError):
        fmap.check()
    fmap.store(fi, torch.tensor([5, 4, 6], dtype=torch.int32))
    ids = fmap.resolve(torch.tensor([-2, 9, -1, -3]))
    assert ids.tolist() == [4, 9, 5, 6]
    bad = fmap.resolve(torch.tensor([-1, -5, -9]))  # slots 5 and 9 are past the map
    assert bad.tolist() == [5, 0, 0]
    with pytest.raises(FutureError):
        fmap.check()
    if map_dtype == torch.int32:
        with pytest.raises(ValueError, match="must fit"):
            fmap.store(fi, torch.tensor([1, 2**31, 3]))
        assert fmap.token_map.tolist() == [0, 5, 4, 6, 0]  # nothing written
    fmap.release(fi)
    fmap.check()


def test_placeholders_are_fresh_tensors_of_the_right_dtype():
    fmap = FutureMap(6, device="cpu", dtype=torch.int32)
    fi = fmap.alloc(3)
    a, b = fi.placeholders(), fi.placeholders(torch.int64)
    assert a.dtype == torch.int32 and b.dtype == torch.int64 and a.tolist() == b.tolist() == [-1, -2, -3]
    a[0] = 99
    assert fi.placeholders().tolist() == [-1, -2, -3] and fi.host_placeholders().tolist() == [-1, -2, -3]
    sub = fi.filter(np.array([False, True, True]))
    assert sub.placeholders().tolist() == [-2, -3]
    with pytest.raises(ValueError, match=r"placeholders dtype must be torch\.int32 or torch\.int64"):
        sub.placeholders(torch.int16)


def test_a_pinned_host_view_dies_with_its_tensor():
    fmap = FutureMap(4, device="cpu")
    entries = [cpu._VIEWS[id(fmap.token_map)], cpu._VIEWS[id(fmap.err)]]
    assert cpu.host_view(fmap.token_map) is cpu.host_view(fmap.token_map)
    other = torch.zeros(3, dtype=torch.int64)
    assert cpu.host_view(other) is not cpu.host_view(other)  # not pinned: a fresh view
    gone = weakref.ref(fmap.token_map)
    del fmap
    gc.collect()
    assert gone() is None
    assert not any(e is entry for e in cpu._VIEWS.values() for entry in entries)


def test_debug_mode_still_raises_at_once_on_the_numpy_path(numpy_path):
    fmap = FutureMap(4, device="cpu", debug=True)
    fi = fmap.alloc(2)
    with pytest.raises(FutureError, match="read of slot 1"):
        fmap.resolve(fi.placeholders())


@pytest.mark.parametrize("kept", [True, False])
def test_one_slot_runs_count_their_references(kept):
    # One-slot runs take scalar arithmetic on the counts: same counts, same freed slots.
    fmap = FutureMap(3, device="cpu")
    for _ in range(5):  # round the ring
        fi = fmap.alloc(1)
        keep = fi.filter(np.array([kept]))
        assert fmap.refcounts[fi.slots].tolist() == [1 + kept] and fmap.in_use == 1
        fmap.release(fi)
        assert fmap.in_use == int(kept) and fmap.refcounts[fi.slots].tolist() == [int(kept)]
        fmap.release(keep)
        assert fmap.in_use == 0 and fmap.refcounts[1:].tolist() == [0, 0, 0]
    other = fmap.alloc(1)
    held = other.filter(np.array([True]))
    fmap.release(held)  # the filtered handle first: the run's own reference remains
    assert fmap.in_use == 1 and fmap.refcounts[other.slots].tolist() == [1]
    fmap.release(other)
    assert fmap.in_use == 0 and type(fmap.in_use) is int
