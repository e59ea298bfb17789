"""resolve_futures_: the Triton kernel and the CPU path against resolve_futures_ref.

Ids and the token map sit inside sentinel-fenced buffers, so a write past a block's end or a
read past the map (it would bring a sentinel in) shows up.
"""

import pytest
import torch

from tfuture.kernels import cpu
from tfuture.kernels.resolve import launch_resolve_, resolve_futures_, resolve_futures_ref

from ._helpers import DTYPES, IMPLS, SENTINEL, assert_fence, fenced, gen, impl_device, new_err

# Block edges of block_for (128 and 1024), a prime, and a large non-power-of-two.
SIZES = [0, 1, 2, 127, 128, 129, 1023, 1024, 1025, 4099, 6000]
N_SLOTS = 301  # token_map rows: slot 0 (padding) and slots 1..300
# Concrete tokens and stored values span the whole int32 range, so both dtypes carry them exactly.
VOCAB = 2**31 - 1


def resolve(impl: str, ids: torch.Tensor, token_map: torch.Tensor, err: torch.Tensor | None) -> torch.Tensor:
    if impl == "cpu":
        return cpu.resolve_(ids, token_map, err)
    return resolve_futures_(ids, token_map, err=err)


def token_map_for(dtype: torch.dtype, device: str, g: torch.Generator) -> torch.Tensor:
    token_map = torch.randint(0, VOCAB, (N_SLOTS,), generator=g).to(dtype=dtype, device=device)
    # Row 0 holds garbage on purpose: token id 0 is a real token, never a read of slot 0.
    token_map[0] = 12345
    return token_map


def mixed_ids(n: int, dtype: torch.dtype, g: torch.Generator, n_bad: int) -> torch.Tensor:
    """Concrete ids (plenty of 0s) and in-range placeholders, with ``n_bad`` bad placeholders:
    just past the map, far past it, and the dtype's minimum (whose negation wraps)."""
    tokens = torch.randint(0, VOCAB, (n,), generator=g)
    tokens[torch.rand(n, generator=g) < 0.2] = 0
    ids = torch.where(torch.rand(n, generator=g) < 0.5, -torch.randint(1, N_SLOTS, (n,), generator=g), tokens)
    bad = torch.tensor([-N_SLOTS, -(10 * N_SLOTS), torch.iinfo(dtype).min] * n_bad, dtype=torch.int64)[:n_bad]
    ids[torch.randperm(n, generator=g)[:n_bad]] = bad
    return ids.to(dtype)


def cases():
    for n in SIZES:
        for id_name, id_dtype in DTYPES.items():
            for map_name, map_dtype in DTYPES.items():
                yield pytest.param(n, id_dtype, map_dtype, id=f"n{n}-ids_{id_name}-map_{map_name}")


@pytest.mark.parametrize("with_err", [False, True], ids=["no_err", "err"])
@pytest.mark.parametrize(("n", "id_dtype", "map_dtype"), list(cases()))
@pytest.mark.parametrize("impl", IMPLS)
def test_resolve_matches_reference(impl, n, id_dtype, map_dtype, with_err, device):
    device = impl_device(impl, device)
    g = gen(n * 7 + with_err)
    token_map, map_backing = fenced(token_map_for(map_dtype, device, g))
    ids0 = mixed_ids(n, id_dtype, g, n_bad=min(n // 40 + 3, n) if n > 2 else 0).to(device)
    ids, backing = fenced(ids0)
    err, err_ref = (new_err(device) if with_err else None for _ in range(2))

    assert resolve(impl, ids, token_map, err) is ids
    want = resolve_futures_ref(ids0.clone(), token_map, err=err_ref)

    assert ids.dtype == id_dtype and torch.equal(ids, want)
    assert SENTINEL not in ids.tolist()
    assert_fence(backing, n)
    assert_fence(map_backing, N_SLOTS)
    if with_err:
        assert torch.equal(err, err_ref)
        assert not bool((ids < 0).any())


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_resolve_err_accumulates_across_calls(impl, dtype, device):
    device = impl_device(impl, device)
    token_map = torch.arange(10, dtype=dtype, device=device)
    err = torch.tensor([3, -50], dtype=torch.int64, device=device)
    resolve(impl, torch.tensor([-10, -2, -11], dtype=dtype, device=device), token_map, err)
    assert err.tolist() == [5, -50]
    resolve(impl, torch.tensor([-60, 0], dtype=dtype, device=device), token_map, err)
    assert err.tolist() == [6, -60]
    resolve(impl, torch.tensor([-1, -9], dtype=dtype, device=device), token_map, err)
    assert err.tolist() == [6, -60]


@pytest.mark.parametrize("impl", IMPLS)
def test_resolve_empty_is_noop(impl, device):
    device = impl_device(impl, device)
    token_map, err = torch.arange(5, device=device), new_err(device)
    ids = torch.empty(0, dtype=torch.int64, device=device)
    assert resolve(impl, ids, token_map, err) is ids
    assert launch_resolve_(ids, token_map, err) is ids
    assert err.tolist() == [0, 0] and torch.equal(token_map, torch.arange(5, device=device))


@pytest.mark.parametrize("with_err", [False, True], ids=["no_err", "err"])
def test_reference_follows_the_contract(with_err):
    """The oracle itself, against the contract written out by hand."""
    token_map = torch.tensor([9, 10, 11, 12])
    lo = torch.iinfo(torch.int64).min
    ids = torch.tensor([5, -1, 0, -3, -4, lo, -2])
    err = new_err("cpu") if with_err else None
    resolve_futures_ref(ids, token_map, err=err)
    if with_err:
        assert ids.tolist() == [5, 10, 0, 12, 0, 0, 11] and err.tolist() == [2, lo]
    else:
        assert ids.tolist() == [5, 10, 0, 12, -4, lo, 11]


def _i64(*shape, device="cpu"):
    return torch.zeros(shape, dtype=torch.int64, device=device)


BAD_CALLS = [
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device=d).float(), _i64(4, device=d)),
        ValueError,
        r"ids must have dtype torch\.int32 or torch\.int64, got torch\.float32",
        id="float-ids",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device=d), _i64(4, device=d).to(torch.int16)),
        ValueError,
        r"token_map must have dtype .*got torch\.int16",
        id="int16-map",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(2, 3, device=d), _i64(4, device=d)),
        ValueError,
        r"ids must be 1-D, got a 2-D tensor of shape \(2, 3\)",
        id="2d-ids",
    ),
    pytest.param(
        lambda d: resolve_futures_([-1, 2], _i64(4, device=d)),
        TypeError,
        r"ids must be a torch\.Tensor, got list",
        id="list-ids",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device="meta"), _i64(4, device=d)),
        ValueError,
        r"ids is on meta but token_map is on",
        id="foreign-device",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(6, device=d)[::2], _i64(4, device=d)),
        ValueError,
        r"ids must be contiguous, got strides \(2,\)",
        id="strided-ids",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device=d), _i64(4, device=d), err=_i64(3, device=d)),
        ValueError,
        r"err must have 2 elements, got 3",
        id="err-len",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device=d), _i64(4, device=d), err=_i64(2, device=d).int()),
        ValueError,
        r"err must have dtype torch\.int64, got torch\.int32",
        id="err-dtype",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), BAD_CALLS)
def test_resolve_rejects_bad_arguments(call, exc, match, device):
    with pytest.raises(exc, match=match):
        call(device)
