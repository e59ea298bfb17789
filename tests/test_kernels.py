"""resolve_futures_, store_futures and prepare_inputs against their torch references and plain Python.

Every case runs three ways: the launcher (the Triton kernel, through the interpreter on CPU), the
torch reference, and a pure-Python expectation written from the contract alone. Outputs live
inside larger buffers filled with a sentinel, so a write past the end of a block shows up.
"""

import pytest
import torch

from tfuture.kernels.resolve import (
    PreparedInputs,
    prepare_inputs,
    prepare_inputs_ref,
    resolve_futures_,
    resolve_futures_ref,
)
from tfuture.kernels.store import store_futures, store_futures_ref

SIZES = [0, 1, 2, 15, 16, 17, 1023, 1024, 1025, 4099]
DTYPES = {"int32": torch.int32, "int64": torch.int64}
# Concrete tokens and stored values span the whole int32 range, so both dtypes carry them exactly.
VOCAB = 2**31 - 1
SENTINEL = -777
N_SLOTS = 301  # token_map rows: slot 0 (padding) and slots 1..300


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _in_buffer(values: torch.Tensor, pad: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, backing): ``values`` copied into the middle of a sentinel-filled buffer."""
    backing = torch.full((values.numel() + 2 * pad,), SENTINEL, dtype=values.dtype, device=values.device)
    view = backing[pad : pad + values.numel()]
    view.copy_(values)
    return view, backing


def _assert_margins(backing: torch.Tensor, n: int, pad: int = 40) -> None:
    assert torch.equal(backing[:pad], torch.full_like(backing[:pad], SENTINEL))
    assert torch.equal(backing[pad + n :], torch.full_like(backing[pad + n :], SENTINEL))


def _token_map(dtype: torch.dtype, device: str, g: torch.Generator, n_slots: int = N_SLOTS) -> torch.Tensor:
    token_map = torch.randint(0, VOCAB, (n_slots,), generator=g).to(dtype=dtype, device=device)
    # Row 0 holds garbage on purpose: token id 0 is a real token, never a read of slot 0.
    token_map[0] = 12345
    return token_map


def _stream(n: int, kind: str, dtype: torch.dtype, device: str, g: torch.Generator) -> torch.Tensor:
    """A token stream: concrete ids (with plenty of 0s) and in-range placeholders, mixed by ``kind``."""
    tokens = torch.randint(0, VOCAB, (n,), generator=g)
    tokens[torch.rand(n, generator=g) < 0.2] = 0
    placeholders = -torch.randint(1, N_SLOTS, (n,), generator=g)
    if kind == "all-future":
        ids = placeholders
    elif kind == "no-future":
        ids = tokens
    else:
        ids = torch.where(torch.rand(n, generator=g) < 0.5, placeholders, tokens)
    return ids.to(dtype=dtype, device=device)


def py_resolve(ids: list[int], token_map: list[int], with_err: bool) -> tuple[list[int], list[int]]:
    """Contract of resolve in plain Python: (resolved ids, the bad placeholders in order)."""
    out, bad = [], []
    for x in ids:
        if x >= 0:
            out.append(x)
        elif 1 <= -x < len(token_map):
            out.append(token_map[-x])
        else:
            bad.append(x)
            out.append(0 if with_err else x)
    return out, bad


# ---------------------------------------------------------------------------------------------
# resolve_futures_


def _resolve_cases():
    for n in SIZES:
        for id_name, id_dtype in DTYPES.items():
            for map_name, map_dtype in DTYPES.items():
                yield pytest.param(n, id_dtype, map_dtype, id=f"n{n}-ids_{id_name}-map_{map_name}")


@pytest.mark.parametrize("kind", ["mixed", "all-future", "no-future"])
@pytest.mark.parametrize(("n", "id_dtype", "map_dtype"), list(_resolve_cases()))
def test_resolve_matches_reference_and_python(n, id_dtype, map_dtype, kind, device):
    g = _gen(n * 7 + len(kind))
    token_map = _token_map(map_dtype, device, g)
    ids0 = _stream(n, kind, id_dtype, device, g)
    map_before = token_map.clone()

    ids, backing = _in_buffer(ids0)
    ret = resolve_futures_(ids, token_map)
    ref = resolve_futures_ref(ids0.clone(), token_map)
    want, bad = py_resolve(ids0.tolist(), token_map.tolist(), with_err=False)

    assert ret is ids
    assert not bad
    assert torch.equal(ids, ref)
    assert ids.tolist() == want
    assert ids.dtype == id_dtype
    assert not bool((ids < 0).any())
    # Concrete tokens, 0 included, are untouched; the map is only read.
    concrete = ids0 >= 0
    assert torch.equal(ids[concrete], ids0[concrete])
    assert torch.equal(token_map, map_before)
    _assert_margins(backing, n)


def _bad_ids(dtype: torch.dtype) -> list[int]:
    """Placeholders just inside, at and far past the end of the map, and the dtype's minimum."""
    lo = torch.iinfo(dtype).min
    far = -(N_SLOTS + 30)  # still inside the sentinel margin of the backing buffer
    return [-1, -(N_SLOTS - 1), -N_SLOTS, far, lo, 0, 7, -(2**31 - 1), lo, -N_SLOTS - 1]


@pytest.mark.parametrize("with_err", [False, True], ids=["no_err", "err"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_resolve_out_of_range_never_read(dtype, with_err, device):
    g = _gen(1)
    values = _token_map(dtype, device, g)
    # The map sits in a buffer of sentinels: a read past its end would bring a sentinel in.
    token_map, map_backing = _in_buffer(values)
    ids0 = torch.tensor(_bad_ids(dtype), dtype=dtype, device=device)
    ids = ids0.clone()
    err = torch.zeros(2, dtype=torch.int64, device=device) if with_err else None
    err_ref = torch.zeros(2, dtype=torch.int64, device=device) if with_err else None

    resolve_futures_(ids, token_map, err=err)
    ref = resolve_futures_ref(ids0.clone(), token_map, err=err_ref)
    want, bad = py_resolve(ids0.tolist(), token_map.tolist(), with_err)

    assert ids.tolist() == want
    assert torch.equal(ids, ref)
    assert SENTINEL not in ids.tolist()
    assert ids[0] == token_map[1] and ids[1] == token_map[N_SLOTS - 1]
    _assert_margins(map_backing, N_SLOTS)
    if with_err:
        assert err.tolist() == [len(bad), min(bad)] == err_ref.tolist()
        assert min(bad) == torch.iinfo(dtype).min


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_resolve_err_accumulates_across_calls(dtype, device):
    token_map = torch.arange(10, dtype=dtype, device=device)
    err = torch.tensor([3, -50], dtype=torch.int64, device=device)
    resolve_futures_(torch.tensor([-10, -2, -11], dtype=dtype, device=device), token_map, err=err)
    assert err.tolist() == [5, -50]
    resolve_futures_(torch.tensor([-60, 0], dtype=dtype, device=device), token_map, err=err)
    assert err.tolist() == [6, -60]
    resolve_futures_(torch.tensor([-1, -9], dtype=dtype, device=device), token_map, err=err)
    assert err.tolist() == [6, -60]


@pytest.mark.parametrize("n", [17, 4099], ids=lambda n: f"n{n}")
def test_resolve_scattered_bad_placeholders(n, device):
    g = _gen(n)
    token_map = _token_map(torch.int64, device, g)
    ids0 = _stream(n, "mixed", torch.int64, device, g)
    bad_rows = torch.randperm(n, generator=g)[: max(n // 50, 3)]
    ids0[bad_rows] = -torch.randint(N_SLOTS, 10 * N_SLOTS, (bad_rows.numel(),), generator=g)
    err = torch.zeros(2, dtype=torch.int64, device=device)
    err_ref = err.clone()

    ids = resolve_futures_(ids0.clone(), token_map, err=err)
    ref = resolve_futures_ref(ids0.clone(), token_map, err=err_ref)
    want, bad = py_resolve(ids0.tolist(), token_map.tolist(), with_err=True)

    assert ids.tolist() == want
    assert torch.equal(ids, ref)
    assert err.tolist() == err_ref.tolist() == [len(bad), min(bad)]


def test_resolve_empty_is_noop(device):
    token_map = torch.arange(5, device=device)
    err = torch.zeros(2, dtype=torch.int64, device=device)
    ids = torch.empty(0, dtype=torch.int64, device=device)
    assert resolve_futures_(ids, token_map, err=err) is ids
    assert ids.numel() == 0 and err.tolist() == [0, 0]
    assert torch.equal(token_map, torch.arange(5, device=device))


# ---------------------------------------------------------------------------------------------
# store_futures


def _store_cases():
    for n in SIZES:
        for slot_name, slot_dtype in DTYPES.items():
            for map_name, map_dtype in DTYPES.items():
                yield pytest.param(n, slot_dtype, map_dtype, id=f"n{n}-slots_{slot_name}-map_{map_name}")


def py_store(token_map: list[int], slots: list[int], values: list[int]) -> tuple[list[int], list[int]]:
    """Contract of store in plain Python: (the new map, the bad slots in order)."""
    out, bad = list(token_map), []
    for s, v in zip(slots, values, strict=True):
        if 1 <= s < len(out):
            out[s] = v
        else:
            bad.append(s)
    return out, bad


@pytest.mark.parametrize("contiguous", [False, True], ids=["slot_tensor", "range"])
@pytest.mark.parametrize(("n", "slot_dtype", "map_dtype"), list(_store_cases()))
def test_store_matches_reference_and_python(n, slot_dtype, map_dtype, contiguous, device):
    g = _gen(n + 3)
    n_slots = max(N_SLOTS, n + 9)
    # Poison: every slot starts as the sentinel, so an unwritten or stray write is visible.
    token_map, backing = _in_buffer(torch.full((n_slots,), SENTINEL, dtype=map_dtype, device=device))
    values = torch.randint(0, VOCAB, (n,), generator=g).to(dtype=slot_dtype, device=device)
    if contiguous:
        start = int(torch.randint(1, n_slots - n + 1, (), generator=g))
        slots = range(start, start + n)
        slot_list = list(slots)
    else:
        # Distinct slots in random order: no contiguous interval to lean on.
        slot_list = (torch.randperm(n_slots - 1, generator=g)[:n] + 1).tolist()
        slots = torch.tensor(slot_list, dtype=slot_dtype, device=device)
    ref_map = token_map.clone()

    store_futures(token_map, slots, values)
    store_futures_ref(ref_map, slots, values)
    want, bad = py_store([SENTINEL] * n_slots, slot_list, values.tolist())

    assert not bad
    assert torch.equal(token_map, ref_map)
    assert token_map.tolist() == want
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[slot_list] = False
    assert bool((token_map.cpu()[untouched] == SENTINEL).all())
    assert token_map[0] == SENTINEL
    _assert_margins(backing, n_slots)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_store_out_of_range_slots_never_written(dtype, device):
    lo = torch.iinfo(dtype).min
    slot_list = [0, 1, N_SLOTS - 1, N_SLOTS, N_SLOTS + 30, -1, lo, 5]
    slots = torch.tensor(slot_list, dtype=dtype, device=device)
    values = torch.arange(100, 100 + len(slot_list), dtype=dtype, device=device)
    token_map, backing = _in_buffer(torch.full((N_SLOTS,), SENTINEL, dtype=dtype, device=device))
    err = torch.zeros(2, dtype=torch.int64, device=device)
    ref_map, err_ref = token_map.clone(), err.clone()

    store_futures(token_map, slots, values, err=err)
    store_futures_ref(ref_map, slots, values, err=err_ref)
    want, bad = py_store([SENTINEL] * N_SLOTS, slot_list, values.tolist())

    assert token_map.tolist() == want
    assert torch.equal(token_map, ref_map)
    _assert_margins(backing, N_SLOTS)
    # err[1] keeps min(-slot); -min(int64) wraps to itself, so it is the most negative there.
    neg = [-s if -s < 2**63 else -(2**63) for s in bad]
    assert err.tolist() == err_ref.tolist() == [len(bad), min([0, *neg])]

    # Without err the same slots are dropped silently.
    quiet = torch.full((N_SLOTS,), SENTINEL, dtype=dtype, device=device)
    store_futures(quiet, slots, values)
    assert quiet.tolist() == want


@pytest.mark.parametrize("contiguous", [True, False], ids=["range", "slots"])
@pytest.mark.parametrize("ref", [False, True], ids=["kernel", "ref"])
def test_store_negative_values_become_zero_and_are_flagged(contiguous, ref, device):
    # A stored -1 would resolve into a negative id next step: the store refuses to write it.
    token_map = torch.full((8,), 55, dtype=torch.int64, device=device)
    values = torch.tensor([4, -1, 6, -9], dtype=torch.int64, device=device)
    slots = range(2, 6) if contiguous else torch.tensor([2, 3, 4, 5], device=device)
    err = torch.zeros(2, dtype=torch.int64, device=device)
    (store_futures_ref if ref else store_futures)(token_map, slots, values, err=err)
    assert token_map.tolist() == [55, 55, 4, 0, 6, 0, 55, 55]
    assert err.tolist() == [2, -9]
    # Without an error channel the value is stored as given (the caller owns the check).
    token_map2 = torch.zeros(8, dtype=torch.int64, device=device)
    (store_futures_ref if ref else store_futures)(token_map2, slots, values)
    assert token_map2[2:6].tolist() == [4, -1, 6, -9]


def test_store_int64_values_into_int32_map_cast(device):
    token_map = torch.zeros(6, dtype=torch.int32, device=device)
    store_futures(token_map, range(2, 5), torch.tensor([VOCAB - 1, 0, 9], device=device))
    assert token_map.tolist() == [0, 0, VOCAB - 1, 0, 9, 0]


def test_store_empty_is_noop(device):
    token_map = torch.arange(8, device=device)
    err = torch.zeros(2, dtype=torch.int64, device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    store_futures(token_map, empty, empty, err=err)
    store_futures(token_map, range(3, 3), empty, err=err)
    # An empty range is not checked against the map: there is nothing to write.
    store_futures(token_map, range(50, 50), empty)
    assert torch.equal(token_map, torch.arange(8, device=device))
    assert err.tolist() == [0, 0]


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        pytest.param(range(0, 3), r"\[1, 7\], got 0\.\.2", id="starts-at-0"),
        pytest.param(range(6, 9), r"\[1, 7\], got 6\.\.8", id="past-end"),
        pytest.param(range(1, 7, 2), r"step 1, got step 2", id="step-2"),
    ],
)
def test_store_bad_range_raises(slots, match, device):
    token_map = torch.zeros(8, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=match):
        store_futures(token_map, slots, torch.ones(len(slots), dtype=torch.int64, device=device))
    assert token_map.tolist() == [0] * 8


# ---------------------------------------------------------------------------------------------
# Argument checks shared by the launchers


def _i64(*shape, device="cpu"):
    return torch.zeros(shape, dtype=torch.int64, device=device)


BAD_CALLS = [
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device=d).float(), _i64(4, device=d)),
        ValueError,
        r"ids must have dtype torch\.int32 or torch\.int64, got torch\.float32",
        id="resolve-float-ids",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device=d), _i64(4, device=d).to(torch.int16)),
        ValueError,
        r"token_map must have dtype .*got torch\.int16",
        id="resolve-int16-map",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(2, 3, device=d), _i64(4, device=d)),
        ValueError,
        r"ids must be 1-D, got a 2-D tensor of shape \(2, 3\)",
        id="resolve-2d-ids",
    ),
    pytest.param(
        lambda d: resolve_futures_([-1, 2], _i64(4, device=d)),
        TypeError,
        r"ids must be a torch\.Tensor, got list",
        id="resolve-list-ids",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device="meta"), _i64(4, device=d)),
        ValueError,
        r"ids is on meta but token_map is on",
        id="resolve-foreign-device",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(6, device=d)[::2], _i64(4, device=d)),
        ValueError,
        r"ids must be contiguous, got strides \(2,\)",
        id="resolve-strided-ids",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device=d), _i64(4, device=d), err=_i64(3, device=d)),
        ValueError,
        r"err must have 2 elements, got 3",
        id="resolve-err-len",
    ),
    pytest.param(
        lambda d: resolve_futures_(_i64(3, device=d), _i64(4, device=d), err=_i64(2, device=d).int()),
        ValueError,
        r"err must have dtype torch\.int64, got torch\.int32",
        id="resolve-err-dtype",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), _i64(3, device=d), _i64(2, device=d)),
        ValueError,
        r"values must have one entry per slot \(3\), got 2",
        id="store-length-mismatch",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), _i64(3, device=d), _i64(3, device="meta")),
        ValueError,
        r"values is on meta but token_map is on",
        id="store-foreign-device",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), _i64(1, 3, device=d), _i64(3, device=d)),
        ValueError,
        r"slots must be 1-D, got a 2-D tensor",
        id="store-2d-slots",
    ),
    pytest.param(
        lambda d: store_futures(_i64(8, device=d), [1, 2], _i64(2, device=d)),
        TypeError,
        r"slots must be a torch\.Tensor, got list",
        id="store-list-slots",
    ),
    pytest.param(
        lambda d: prepare_inputs(_i64(3, device=d), _i64(3, device=d), _i64(1, device=d), _i64(4, device=d)),
        ValueError,
        r"seg_starts must have len\(prefix_lens\) \+ 1 = 2 entries, got 3",
        id="prepare-seg-len",
    ),
    pytest.param(
        lambda d: prepare_inputs(
            _i64(3, device=d), _i64(2, device=d), _i64(1, device=d), _i64(4, device=d), n_rows=2
        ),
        ValueError,
        r"n_rows must be >= len\(tokens\) = 3, got 2",
        id="prepare-n-rows-short",
    ),
    pytest.param(
        lambda d: prepare_inputs(
            _i64(3, device=d),
            _i64(2, device=d),
            _i64(1, device=d),
            _i64(4, device=d),
            out=PreparedInputs(_i64(3, device=d), _i64(3, device=d), _i64(2, device=d)),
        ),
        ValueError,
        r"out\.last_rows must have 1 entries, got 2",
        id="prepare-out-size",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), BAD_CALLS)
def test_launchers_reject_bad_arguments(call, exc, match, device):
    with pytest.raises(exc, match=match):
        call(device)


# ---------------------------------------------------------------------------------------------
# prepare_inputs


def _make_batch(seg_lens, extra, dtype, device, seed, n_bad=0):
    """(tokens, seg_starts, prefix_lens): decodes are placeholders, prefill chunks mostly concrete.

    ``extra > 0`` junk tokens (placeholders out of range included) follow ``seg_starts[-1]``: they
    are padding and must be neither read nor flagged. ``extra < 0`` cuts that many tokens off the end,
    so ``seg_starts[-1]`` overshoots ``len(tokens)``. ``n_bad`` live rows get an out-of-range placeholder.
    """
    g = _gen(seed)
    parts = []
    for n in seg_lens:
        if n == 1:
            parts.append(-torch.randint(1, N_SLOTS, (1,), generator=g))
        else:
            chunk = torch.randint(0, VOCAB, (n,), generator=g)
            chunk[torch.rand(n, generator=g) < 0.2] = 0
            mixed = torch.rand(n, generator=g) < 0.1
            chunk[mixed] = -torch.randint(1, N_SLOTS, (int(mixed.sum()),), generator=g)
            parts.append(chunk)
    parts.append(-torch.randint(N_SLOTS, 2 * N_SLOTS, (max(extra, 0),), generator=g))
    tokens = torch.cat(parts)
    tokens = tokens[: tokens.numel() + min(extra, 0)]
    live = min(sum(seg_lens), tokens.numel())
    if n_bad and live:
        rows = torch.randperm(live, generator=g)[:n_bad]
        tokens[rows] = -torch.randint(N_SLOTS, 4 * N_SLOTS, (rows.numel(),), generator=g)
    seg_starts = torch.tensor([0, *torch.tensor(seg_lens, dtype=torch.int64).cumsum(0).tolist()])
    prefix_lens = torch.randint(0, 5000, (len(seg_lens),), generator=g)
    return tuple(t.to(dtype=dtype, device=device) for t in (tokens, seg_starts, prefix_lens))


def py_prepare(tokens, seg_starts, prefix_lens, token_map, n_rows, with_err):
    """Contract of prepare_inputs in plain Python: (input_ids, positions, last_rows, bad)."""
    total = min(seg_starts[-1], len(tokens))
    ids, bad = py_resolve(tokens[:total], token_map, with_err)
    positions = []
    for r in range(total):
        q = max(q for q in range(len(prefix_lens)) if seg_starts[q] <= r)
        positions.append(prefix_lens[q] + r - seg_starts[q])
    pad = [0] * (n_rows - total)
    last_rows = [max(min(end, total) - 1, 0) for end in seg_starts[1:]]
    return ids + pad, positions + pad, last_rows, bad


_rng = torch.Generator().manual_seed(99)
MANY_MIXED = torch.tensor([0, 1, 1, 1, 2, 7, 16, 33])[torch.randint(0, 8, (300,), generator=_rng)].tolist()
MANY_EMPTY = [1 if i % 15 == 0 else 0 for i in range(1500)]
LARGE = torch.tensor([1, 1, 3, 40])[torch.randint(0, 4, (360,), generator=_rng)].tolist()

# (seg_lens, junk tokens past seg_starts[-1] (or, negative, tokens cut off), padding rows)
PREPARE_CASES = {
    "nreq0": ([], 0, 0),
    "nreq0-padded": ([], 0, 5),
    "nreq0-tokens-ignored": ([], 3, 2),
    "one-decode": ([1], 0, 0),
    "one-prefill-1025": ([1025], 0, 0),
    "two": ([3, 1], 0, 0),
    "three-with-empty": ([1, 0, 4], 0, 2),
    "padded-requests": ([2, 0, 0, 1, 0], 0, 3),
    "leading-empty": ([0, 0, 5], 0, 0),
    "all-empty": ([0, 0, 0], 0, 4),
    "nreq4": ([1, 2, 1, 5], 0, 0),
    "nreq5": ([3, 1, 1, 0, 2], 0, 0),
    "nreq8": ([1] * 8, 0, 0),
    "nreq9": ([2] * 9, 0, 1),
    "decode-37": ([1] * 37, 0, 11),
    "mixed-300": (MANY_MIXED, 0, 0),
    "reqs-exceed-rows-1500": (MANY_EMPTY, 0, 0),
    "block-edge": ([1023, 1], 0, 1),
    "tail-past-segments": ([4, 1], 5, 3),
    "tail-past-block": ([1020], 10, 1),
    "segments-past-tokens": ([3, 4, 2], -3, 2),
    "large-mixed": (LARGE, 7, 13),
}


def _prepare_cases():
    for name, (segs, extra, pad) in PREPARE_CASES.items():
        for dname, dtype in DTYPES.items():
            yield pytest.param(segs, extra, pad, dtype, id=f"{name}-{dname}")


def _check_prepared(res, ref, want, n_rows, n_reqs, dtype):
    ids, positions, last_rows, _ = want
    assert res.input_ids.tolist() == ids
    assert res.positions.tolist() == positions
    assert res.last_rows.tolist() == last_rows
    assert (res.input_ids.numel(), res.positions.numel(), res.last_rows.numel()) == (n_rows, n_rows, n_reqs)
    assert res.input_ids.dtype == dtype
    assert res.positions.dtype == torch.int64 and res.last_rows.dtype == torch.int64
    for got, exp in zip(res, ref, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize(("seg_lens", "extra", "pad", "dtype"), list(_prepare_cases()))
def test_prepare_inputs_matches_reference_and_python(seg_lens, extra, pad, dtype, device):
    seed = len(seg_lens) * 31 + extra + pad
    tokens, seg_starts, prefix_lens = _make_batch(seg_lens, extra, dtype, device, seed)
    map_dtype = torch.int64 if dtype == torch.int32 else torch.int32
    token_map = _token_map(map_dtype, device, _gen(seed))
    n_rows, n_reqs = tokens.numel() + pad, len(seg_lens)
    want = py_prepare(
        tokens.tolist(), seg_starts.tolist(), prefix_lens.tolist(), token_map.tolist(), n_rows, False
    )
    ref = prepare_inputs_ref(tokens, seg_starts, prefix_lens, token_map, n_rows=n_rows)

    res = prepare_inputs(tokens, seg_starts, prefix_lens, token_map, n_rows=n_rows)
    _check_prepared(res, ref, want, n_rows, n_reqs, dtype)

    # Preallocated outputs, poisoned and fenced by sentinels: every row is written, none past it.
    views = [
        _in_buffer(torch.full((n,), SENTINEL, dtype=dt, device=device))
        for n, dt in ((n_rows, dtype), (n_rows, torch.int64), (n_reqs, torch.int64))
    ]
    out = PreparedInputs(*(v for v, _ in views))
    assert prepare_inputs(tokens, seg_starts, prefix_lens, token_map, n_rows=n_rows, out=out) is out
    _check_prepared(out, ref, want, n_rows, n_reqs, dtype)
    for (_, backing), n in zip(views, (n_rows, n_rows, n_reqs), strict=True):
        _assert_margins(backing, n)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", ["mixed-300", "tail-past-segments", "segments-past-tokens", "large-mixed"])
def test_prepare_inputs_flags_bad_placeholders_in_live_rows_only(case, dtype, device):
    seg_lens, extra, pad = PREPARE_CASES[case]
    tokens, seg_starts, prefix_lens = _make_batch(seg_lens, extra, dtype, device, seed=5, n_bad=4)
    token_map = _token_map(torch.int64, device, _gen(5))
    n_rows = tokens.numel() + pad
    err = torch.zeros(2, dtype=torch.int64, device=device)
    err_ref = err.clone()
    want = py_prepare(
        tokens.tolist(), seg_starts.tolist(), prefix_lens.tolist(), token_map.tolist(), n_rows, True
    )

    res = prepare_inputs(tokens, seg_starts, prefix_lens, token_map, n_rows=n_rows, err=err)
    ref = prepare_inputs_ref(tokens, seg_starts, prefix_lens, token_map, n_rows=n_rows, err=err_ref)

    _check_prepared(res, ref, want, n_rows, len(seg_lens), dtype)
    bad = want[3]
    # The junk past seg_starts[-1] is out of range too, but it is padding: never counted.
    assert len(bad) == 4
    assert err.tolist() == err_ref.tolist() == [len(bad), min(bad)]
    assert not bool((res.input_ids < 0).any())


def test_prepare_inputs_out_dtype_wins(device):
    tokens = torch.tensor([5, -1, 0], dtype=torch.int64, device=device)
    token_map = torch.tensor([0, 42], dtype=torch.int64, device=device)
    seg_starts = torch.tensor([0, 2, 3], device=device)
    prefix_lens = torch.tensor([10, 0], device=device)
    out = PreparedInputs(
        torch.full((4,), SENTINEL, dtype=torch.int32, device=device),
        torch.full((4,), SENTINEL, dtype=torch.int64, device=device),
        torch.full((2,), SENTINEL, dtype=torch.int64, device=device),
    )
    prepare_inputs(tokens, seg_starts, prefix_lens, token_map, n_rows=4, out=out)
    assert out.input_ids.dtype == torch.int32
    assert out.input_ids.tolist() == [5, 42, 0, 0]
    assert out.positions.tolist() == [10, 11, 0, 0]
    assert out.last_rows.tolist() == [1, 2]
