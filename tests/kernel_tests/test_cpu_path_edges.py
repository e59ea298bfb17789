"""Bounds edges of the numpy path (``tfuture.kernels.cpu``) next to the Triton kernel's.

The numpy path checks bounds with two reductions and skips the per-row mask when they pass; each
case here sits exactly on the edge of such a shortcut: a placeholder or slot of exactly
``n_slots`` (one past the map) among good ones, and an unchecked range that starts at the padding
slot 0. Every case runs through the launchers on both paths (``_paths``) and, where the numpy
function is called directly elsewhere, through that too.
"""

from __future__ import annotations

import pytest
import torch

from tfuture import FutureMap
from tfuture.kernels import cpu
from tfuture.kernels.fields import gather_fields, gather_fields_ref, store_fields, store_fields_ref
from tfuture.kernels.resolve import launch_prepare, launch_resolve_, resolve_futures_ref
from tfuture.kernels.store import launch_store, store_futures_ref

from ._helpers import SENTINEL, new_err
from ._paths import PATHS, path_device

CAPACITY = 7
N_SLOTS = CAPACITY + 1  # token_map rows: padding row 0 and slots 1..7


def token_map_on(device: str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    token_map = torch.full((N_SLOTS,), SENTINEL, dtype=dtype, device=device)
    token_map[1] = 30
    token_map[2] = 31
    return token_map


# ---- resolve: a placeholder of exactly -n_slots next to in-range ones --------------------------


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["ids_int64", "ids_int32"])
def test_numpy_resolve_of_minus_capacity_minus_1_next_to_good_placeholders(ids_dtype):
    # The fast path's bounds check is max < n_slots: -(capacity + 1) names row n_slots, past the map.
    token_map, err = token_map_on("cpu"), new_err("cpu")
    ids = torch.tensor([-1, -CAPACITY - 1], dtype=ids_dtype)
    cpu.resolve_(ids, token_map, err)
    assert ids.tolist() == [30, 0]
    assert err.tolist() == [1, -CAPACITY - 1]


@pytest.mark.parametrize("path", PATHS)
def test_resolve_of_minus_n_slots_is_flagged_on_both_paths(path, device, monkeypatch):
    device = path_device(path, device, monkeypatch)
    token_map, err, err_ref = token_map_on(device), new_err(device), new_err(device)
    ids = torch.tensor([-2, -N_SLOTS, 5, -1], device=device)
    want = resolve_futures_ref(ids.clone(), token_map, err=err_ref)
    launch_resolve_(ids, token_map, err)
    assert ids.tolist() == want.tolist() == [31, 0, 5, 30]
    assert err.tolist() == err_ref.tolist() == [1, -N_SLOTS]


@pytest.mark.parametrize("path", PATHS)
def test_future_map_resolve_and_prepare_flag_minus_capacity_minus_1(path, device, monkeypatch):
    device = path_device(path, device, monkeypatch)
    fmap = FutureMap(CAPACITY, device=device)
    fi = fmap.alloc(2)
    fmap.store(fi, torch.tensor([30, 31], device=device))
    first = int(fi.slots[0])
    ids = torch.tensor([-first, -CAPACITY - 1], device=device)
    fmap.resolve(ids)
    assert ids.tolist() == [30, 0]
    assert fmap.err.tolist() == [1, -CAPACITY - 1]
    fmap.err.zero_()
    # The fused prepare resolves through the same path.
    tokens = torch.tensor([-CAPACITY - 1, -first - 1], device=device)
    seg = torch.tensor([0, 2], device=device)
    out = launch_prepare(tokens, seg, torch.tensor([0], device=device), fmap.token_map, 2, None, fmap.err)
    assert out.input_ids.tolist() == [0, 31]
    assert fmap.err.tolist() == [1, -CAPACITY - 1]
    fmap.err.zero_()
    fmap.release(fi)


# ---- store: the padding slot 0 at an unchecked range's low end ----------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_unchecked_range_from_slot_0_leaves_the_padding_slot_and_flags_it(path, device, monkeypatch):
    # The low-end twin of test_store_unchecked_range_past_the_map_is_masked.
    device = path_device(path, device, monkeypatch)
    token_map, ref_map = token_map_on(device), token_map_on(device)
    values = torch.tensor([10, 11, 12], device=device)
    err, err_ref = new_err(device), new_err(device)
    launch_store(token_map, range(0, 3), values, err)
    store_futures_ref(ref_map, range(0, 3), values, err=err_ref)
    assert token_map[0] == SENTINEL and token_map[1:3].tolist() == [11, 12]
    assert torch.equal(token_map, ref_map)
    assert err.tolist() == err_ref.tolist() == [1, 0]


@pytest.mark.parametrize("path", PATHS)
def test_unchecked_range_from_slot_0_without_err_still_skips_it(path, device, monkeypatch):
    device = path_device(path, device, monkeypatch)
    token_map = token_map_on(device)
    launch_store(token_map, range(0, 2), torch.tensor([10, 11], device=device), None)
    assert token_map[0] == SENTINEL and token_map[1] == 11


# ---- store, fields: an index naming slot n_slots next to good ones -------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_store_index_of_exactly_n_slots_is_flagged_not_written(path, device, monkeypatch):
    device = path_device(path, device, monkeypatch)
    token_map, ref_map = token_map_on(device), token_map_on(device)
    slots = torch.tensor([3, N_SLOTS, 4], device=device)
    values = torch.tensor([40, 41, 42], device=device)
    err, err_ref = new_err(device), new_err(device)
    launch_store(token_map, slots, values, err)
    store_futures_ref(ref_map, slots, values, err=err_ref)
    assert torch.equal(token_map, ref_map) and token_map[3:5].tolist() == [40, 42]
    assert err.tolist() == err_ref.tolist() == [1, -N_SLOTS]


def test_numpy_store_index_of_exactly_n_slots():
    token_map, err = token_map_on("cpu"), new_err("cpu")
    cpu.store(token_map, torch.tensor([N_SLOTS, 1]), torch.tensor([7, 8]), err)
    assert token_map[1] == 8 and err.tolist() == [1, -N_SLOTS]


def fields_on(device: str) -> list[torch.Tensor]:
    a = torch.arange(N_SLOTS * 2, dtype=torch.int32, device=device).view(N_SLOTS, 2) + 100
    b = torch.arange(N_SLOTS, dtype=torch.float32, device=device) + 0.5
    return [a, b]


@pytest.mark.parametrize("negated", [False, True], ids=["slots", "placeholders"])
@pytest.mark.parametrize("path", PATHS)
def test_fields_index_of_exactly_n_slots_is_flagged(path, negated, device, monkeypatch):
    device = path_device(path, device, monkeypatch)
    sign = -1 if negated else 1
    slots = torch.tensor([2, N_SLOTS, 5], device=device) * sign
    bufs, ref = fields_on(device), fields_on(device)
    vals = [torch.full((3, 2), -9, dtype=torch.int32, device=device), torch.full((3,), -9.5, device=device)]
    err, err_ref = new_err(device), new_err(device)
    store_fields(bufs, slots, vals, negated=negated, err=err)
    store_fields_ref(ref, slots, vals, negated=negated, err=err_ref)
    assert all(torch.equal(x, y) for x, y in zip(bufs, ref, strict=True))
    assert err.tolist() == err_ref.tolist() == [1, -N_SLOTS]
    err, err_ref = new_err(device), new_err(device)
    got = gather_fields(bufs, slots, negated=negated, err=err)
    want = gather_fields_ref(bufs, slots, negated=negated, err=err_ref)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert got[0][1].tolist() == [0, 0] and err.tolist() == err_ref.tolist() == [1, -N_SLOTS]


@pytest.mark.parametrize("bad", [[1, 0, N_SLOTS, 3], [1, -1, 3, 0]], ids=["past_the_map", "negative"])
@pytest.mark.parametrize("path", PATHS)
def test_checked_store_fields_never_writes_a_bad_slot(path, bad, device, monkeypatch):
    # store_fields checks nothing itself on the host: the numpy path must keep its bounds check
    # (a -1 would otherwise land in the last row through numpy's negative indexing).
    device = path_device(path, device, monkeypatch)
    slots = torch.tensor(bad, device=device)
    bufs, before = fields_on(device), fields_on(device)
    vals = [torch.full((4, 2), -9, dtype=torch.int32, device=device), torch.full((4,), -9.5, device=device)]
    err = new_err(device)
    store_fields(bufs, slots, vals, err=err)
    good = [s for s in bad if 1 <= s < N_SLOTS]
    untouched = [r for r in range(N_SLOTS) if r not in good]
    for buf, old in zip(bufs, before, strict=True):
        assert torch.equal(buf[untouched], old[untouched])
        assert bool((buf[good] < 0).all())
    assert err[0] == 2 and err[1] == min(-s for s in bad if not 1 <= s < N_SLOTS)
