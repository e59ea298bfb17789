"""FutureMap edges the other core tests leave open: a store through a non-contiguous handle
flags what it refuses, and debug mode sees a fresh (contiguous) handle's slots handed out again."""

from __future__ import annotations

import pytest
import torch
from defects import plant

from tfuture import FutureError, FutureMap
from tfuture.kernels import _common

CAP = 8


@pytest.fixture(params=["triton", "numpy"])
def map_device(request, device, monkeypatch):
    """The map's device on each kernel path (the numpy path: CPU tensors, dispatch switched over)."""
    if request.param == "numpy":
        monkeypatch.setattr(_common, "INTERPRET", False)
        return "cpu"
    if not _common.use_triton(torch.empty(0, device=device)):
        pytest.skip("the Triton path needs CUDA or TRITON_INTERPRET=1")
    return device


def test_a_negative_token_through_a_filtered_handle_is_flagged(map_device):
    fmap = FutureMap(CAP, device=map_device)
    out = fmap.alloc(3)
    keep = out.filter(torch.tensor([True, False, True]))
    assert not keep.is_contiguous  # the store takes the index-tensor path
    fmap.store(keep, torch.tensor([-4, 7], device=map_device))
    slots = keep.slots.tolist()
    assert fmap.token_map[slots].tolist() == [0, 7]
    with pytest.raises(FutureError):
        fmap.check()
    fmap.release(out)
    fmap.release(keep)


def test_a_store_through_a_cat_handle_flags_a_negative_token(map_device):
    fmap = FutureMap(CAP, device=map_device)
    a, b = fmap.alloc(1), fmap.alloc(1)
    both = type(a).cat([b, a])
    fmap.store(both, torch.tensor([5, -1], device=map_device))
    assert fmap.token_map[int(b.slots[0])] == 5 and fmap.token_map[int(a.slots[0])] == 0
    with pytest.raises(FutureError):
        fmap.check()
    for h in (a, b, both):
        fmap.release(h)


def test_a_fresh_handle_sees_its_slots_handed_out_again():
    # Like test_stale_handle_after_its_slot_was_reused, but the stale handle is the fresh run
    # itself: its generations must be its own copy, not a view of the pool's counters.
    dmap = FutureMap(CAP, device="cpu", debug=True)
    fresh = dmap.alloc(2)
    assert fresh.is_contiguous
    alias = fresh.filter([0, 1])
    with plant("ignore_refcount"):
        dmap.release(alias)  # a refcount bug frees both slots although `fresh` still names them
    again = dmap.alloc(CAP)
    assert set(fresh.slots.tolist()) <= set(again.slots.tolist())
    with pytest.raises(FutureError, match="handed out again while the handle still names it"):
        fresh.placeholders()
