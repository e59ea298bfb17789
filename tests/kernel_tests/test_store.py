"""store_futures: the Triton kernel and the CPU path against store_futures_ref.

The map starts poisoned with a sentinel inside a fenced buffer: a slot written by mistake, a
slot left unwritten, or a write past the map shows up.
"""

import pytest
import torch

from tfuture.kernels import cpu
from tfuture.kernels.store import launch_store, store_futures, store_futures_ref

from ._helpers import DTYPES, IMPLS, SENTINEL, assert_fence, fenced, gen, impl_device, new_err

SIZES = [0, 1, 2, 127, 128, 129, 1023, 1024, 1025, 4099, 6000]
VOCAB = 2**31 - 1


def store(impl: str, token_map, slots, values, err, *, checked: bool = True) -> None:
    if impl == "cpu":
        cpu.store(token_map, slots, values, err)
    elif checked:
        store_futures(token_map, slots, values, err=err)
    else:
        launch_store(token_map, slots, values, err)


def cases():
    for n in SIZES:
        for slot_name, slot_dtype in DTYPES.items():
            for map_name, map_dtype in DTYPES.items():
                yield pytest.param(n, slot_dtype, map_dtype, id=f"n{n}-slots_{slot_name}-map_{map_name}")


def slots_and_values(n, n_slots, kind, dtype, device, g):
    """Distinct slots in random order (a range for ``kind="range"``), values with some negatives.

    ``kind="bad"`` swaps a few slots for ones outside ``[1, n_slots)``: 0, n_slots, negatives and
    the dtype's minimum (whose negation wraps).
    """
    values = torch.randint(0, VOCAB, (n,), generator=g)
    values[torch.rand(n, generator=g) < 0.1] *= -1
    if kind == "range":
        start = int(torch.randint(1, n_slots - n + 1, (), generator=g))
        return range(start, start + n), values.to(dtype=dtype, device=device)
    slots = torch.randperm(n_slots - 1, generator=g)[:n] + 1
    if kind == "bad" and n > 2:
        bad = torch.tensor([0, n_slots, -1, torch.iinfo(dtype).min, n_slots + 7] * n, dtype=torch.int64)
        rows = torch.randperm(n, generator=g)[: n // 40 + 3]
        slots[rows] = bad[: rows.numel()]
    return slots.to(dtype=dtype, device=device), values.to(dtype=dtype, device=device)


@pytest.mark.parametrize("with_err", [False, True], ids=["no_err", "err"])
@pytest.mark.parametrize("kind", ["slots", "range", "bad"])
@pytest.mark.parametrize(("n", "slot_dtype", "map_dtype"), list(cases()))
@pytest.mark.parametrize("impl", IMPLS)
def test_store_matches_reference(impl, n, slot_dtype, map_dtype, kind, with_err, device):
    device = impl_device(impl, device)
    g = gen(n * 5 + len(kind) + with_err)
    n_slots = n + 9
    token_map, backing = fenced(torch.full((n_slots,), SENTINEL, dtype=map_dtype, device=device))
    slots, values = slots_and_values(n, n_slots, kind, slot_dtype, device, g)
    ref_map = token_map.clone()
    err, err_ref = (new_err(device) if with_err else None for _ in range(2))

    store(impl, token_map, slots, values, err)
    store_futures_ref(ref_map, slots, values, err=err_ref)

    assert torch.equal(token_map, ref_map)
    assert token_map[0] == SENTINEL
    assert_fence(backing, n_slots)
    if with_err:
        assert torch.equal(err, err_ref)
        # Negative values are stored as 0 and flagged: nothing negative but the poison remains.
        assert not bool(((token_map < 0) & (token_map != SENTINEL)).any())


@pytest.mark.parametrize("impl", IMPLS)
def test_store_unchecked_range_past_the_map_is_masked(impl, device):
    # launch_store trusts its caller; a range that runs past the map still never writes past it.
    device = impl_device(impl, device)
    token_map, backing = fenced(torch.full((8,), SENTINEL, dtype=torch.int64, device=device))
    values = torch.arange(10, 16, device=device)
    err, err_ref, ref_map = new_err(device), new_err(device), token_map.clone()
    store(impl, token_map, range(5, 11), values, err, checked=False)
    store_futures_ref(ref_map, range(5, 11), values, err=err_ref)
    assert torch.equal(token_map, ref_map) and token_map[5:].tolist() == [10, 11, 12]
    assert torch.equal(err, err_ref) and err.tolist() == [3, -10]
    assert_fence(backing, 8)


@pytest.mark.parametrize("contiguous", [True, False], ids=["range", "slots"])
@pytest.mark.parametrize("impl", IMPLS)
def test_store_negative_values_become_zero_and_are_flagged(impl, contiguous, device):
    # A stored -1 would resolve into a negative id next step: the store refuses to write it.
    device = impl_device(impl, device)
    token_map = torch.full((8,), 55, dtype=torch.int64, device=device)
    values = torch.tensor([4, -1, 6, -9], dtype=torch.int64, device=device)
    slots = range(2, 6) if contiguous else torch.tensor([2, 3, 4, 5], device=device)
    err = new_err(device)
    store(impl, token_map, slots, values, err)
    assert token_map.tolist() == [55, 55, 4, 0, 6, 0, 55, 55]
    assert err.tolist() == [2, -9]
    # Without an error channel the value is stored as given (the caller owns the check).
    token_map2 = torch.zeros(8, dtype=torch.int64, device=device)
    store(impl, token_map2, slots, values, None)
    assert token_map2[2:6].tolist() == [4, -1, 6, -9]


@pytest.mark.parametrize("impl", IMPLS)
def test_store_int64_values_into_int32_map_cast(impl, device):
    device = impl_device(impl, device)
    token_map = torch.zeros(6, dtype=torch.int32, device=device)
    store(impl, token_map, range(2, 5), torch.tensor([VOCAB - 1, 0, 9], device=device), None)
    assert token_map.tolist() == [0, 0, VOCAB - 1, 0, 9, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_store_empty_is_noop(impl, device):
    device = impl_device(impl, device)
    token_map, err = torch.arange(8, device=device), new_err(device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    store(impl, token_map, empty, empty, err)
    store(impl, token_map, range(3, 3), empty, err)
    # An empty range is not checked against the map: there is nothing to write.
    store(impl, token_map, range(50, 50), empty, None)
    assert torch.equal(token_map, torch.arange(8, device=device)) and err.tolist() == [0, 0]


def test_reference_follows_the_contract():
    """The oracle itself, against the contract written out by hand."""
    token_map = torch.full((6,), 7)
    err = new_err("cpu")
    store_futures_ref(
        token_map, torch.tensor([0, 2, 9, 4, -3, 5]), torch.tensor([1, 2, 3, -4, 5, 6]), err=err
    )
    assert token_map.tolist() == [7, 7, 2, 7, 0, 6]
    assert err.tolist() == [4, -9]


def _i64(*shape, device="cpu"):
    return torch.zeros(shape, dtype=torch.int64, device=device)


BAD_CALLS = [
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), _i64(3, device=d), _i64(2, device=d)),
        ValueError,
        r"values must have one entry per slot \(3\), got 2",
        id="length-mismatch",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), _i64(3, device=d), _i64(3, device="meta")),
        ValueError,
        r"values is on meta but token_map is on",
        id="foreign-device",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), _i64(1, 3, device=d), _i64(3, device=d)),
        ValueError,
        r"slots must be 1-D, got a 2-D tensor",
        id="2d-slots",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), [1, 2], _i64(2, device=d)),
        TypeError,
        r"slots must be a torch\.Tensor, got list",
        id="list-slots",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), range(0, 3), _i64(3, device=d)),
        ValueError,
        r"\[1, 7\], got 0\.\.2",
        id="range-starts-at-0",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), range(6, 9), _i64(3, device=d)),
        ValueError,
        r"\[1, 7\], got 6\.\.8",
        id="range-past-end",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), range(1, 7, 2), _i64(3, device=d)),
        ValueError,
        r"step 1, got step 2",
        id="range-step-2",
    ),
    pytest.param(
        lambda d: store_futures(
            _i64(8, device=d), _i64(2, device=d), _i64(2, device=d), err=_i64(3, device=d)
        ),
        ValueError,
        r"err must have 2 elements, got 3",
        id="err-len",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), BAD_CALLS)
def test_store_rejects_bad_arguments(call, exc, match, device):
    with pytest.raises(exc, match=match):
        call(device)
