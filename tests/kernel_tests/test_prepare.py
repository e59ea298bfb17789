"""prepare_inputs (resolve fused with positions and sampler rows) against prepare_inputs_ref.

Both implementations write into poisoned outputs inside sentinel-fenced buffers: every row must
be written, none past the end.
"""

import pytest
import torch

from tfuture.kernels import cpu
from tfuture.kernels.resolve import PreparedInputs, launch_prepare, prepare_inputs, prepare_inputs_ref

from ._helpers import DTYPES, IMPLS, SENTINEL, assert_fence, fenced, gen, impl_device, new_err

N_SLOTS = 301
VOCAB = 2**31 - 1


def make_batch(seg_lens, extra, dtype, device, seed, n_bad=0):
    """(tokens, seg_starts, prefix_lens, token_map): decodes are placeholders, prefill chunks mostly
    concrete.

    ``extra > 0`` junk tokens (placeholders out of range included) follow ``seg_starts[-1]``: they
    are padding and must be neither read nor flagged. ``extra < 0`` cuts that many tokens off the
    end, so ``seg_starts[-1]`` overshoots ``len(tokens)``. ``n_bad`` live rows get an
    out-of-range placeholder.
    """
    g = gen(seed)
    parts = []
    for n in seg_lens:
        chunk = torch.randint(0, VOCAB, (n,), generator=g)
        chunk[torch.rand(n, generator=g) < 0.2] = 0
        future = torch.rand(n, generator=g) < (1.0 if n == 1 else 0.1)
        chunk[future] = -torch.randint(1, N_SLOTS, (int(future.sum()),), generator=g)
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
    map_dtype = torch.int64 if dtype == torch.int32 else torch.int32
    token_map = torch.randint(0, VOCAB, (N_SLOTS,), generator=g).to(map_dtype)
    batch = (t.to(dtype=dtype) for t in (tokens, seg_starts, prefix_lens))
    return tuple(t.to(device) for t in (*batch, token_map))


_rng = gen(99)
MANY_MIXED = torch.tensor([0, 1, 1, 1, 2, 7, 16, 33])[torch.randint(0, 8, (300,), generator=_rng)].tolist()
MANY_EMPTY = [1 if i % 15 == 0 else 0 for i in range(1500)]
LARGE = torch.tensor([1, 1, 3, 40])[torch.randint(0, 4, (360,), generator=_rng)].tolist()

# (seg_lens, junk tokens past seg_starts[-1] (or, negative, tokens cut off), padding rows)
CASES = {
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
    "nreq8": ([1] * 8, 0, 0),
    "nreq9": ([2] * 9, 0, 1),
    "decode-127": ([1] * 127, 0, 0),
    "decode-128": ([1] * 128, 0, 0),
    "decode-129": ([1] * 129, 0, 0),
    "mixed-300": (MANY_MIXED, 0, 0),
    "reqs-exceed-rows-1500": (MANY_EMPTY, 0, 0),
    "block-edge": ([1023, 1], 0, 1),
    "tail-past-segments": ([4, 1], 5, 3),
    "tail-past-block": ([1020], 10, 1),
    "segments-past-tokens": ([3, 4, 2], -3, 2),
    "large-mixed": (LARGE, 7, 13),
}


def cases():
    for name, (segs, extra, pad) in CASES.items():
        for dname, dtype in DTYPES.items():
            yield pytest.param(segs, extra, pad, dtype, id=f"{name}-{dname}")


def poisoned_out(n_rows, n_reqs, dtype, device):
    """Outputs full of sentinels, each fenced: ``(PreparedInputs, backings)``."""
    views = [
        fenced(torch.full((n,), SENTINEL, dtype=dt, device=device))
        for n, dt in ((n_rows, dtype), (n_rows, torch.int64), (n_reqs, torch.int64))
    ]
    return PreparedInputs(*(v for v, _ in views)), [b for _, b in views]


def prepare(impl, batch, n_rows, out, err):
    if impl == "cpu":
        cpu.prepare(*batch, out, err)
        return out
    return prepare_inputs(*batch, n_rows=n_rows, out=out, err=err)


@pytest.mark.parametrize("with_err", [False, True], ids=["no_err", "err"])
@pytest.mark.parametrize(("seg_lens", "extra", "pad", "dtype"), list(cases()))
@pytest.mark.parametrize("impl", IMPLS)
def test_prepare_matches_reference(impl, seg_lens, extra, pad, dtype, with_err, device):
    device = impl_device(impl, device)
    seed = len(seg_lens) * 31 + extra + pad
    batch = make_batch(seg_lens, extra, dtype, device, seed, n_bad=4 if with_err else 0)
    n_rows, n_reqs = batch[0].numel() + pad, len(seg_lens)
    out, backings = poisoned_out(n_rows, n_reqs, dtype, device)
    err, err_ref = (new_err(device) if with_err else None for _ in range(2))

    assert prepare(impl, batch, n_rows, out, err) is out
    want = prepare_inputs_ref(*batch, n_rows=n_rows, err=err_ref)

    for got, exp, backing, n in zip(out, want, backings, (n_rows, n_rows, n_reqs), strict=True):
        assert got.dtype == exp.dtype and torch.equal(got, exp)
        assert_fence(backing, n)
    if with_err:
        # The junk past seg_starts[-1] is out of range too, but it is padding: never counted.
        assert torch.equal(err, err_ref) and err[0] == min(4, sum(seg_lens), batch[0].numel())
        assert not bool((out.input_ids < 0).any())


@pytest.mark.parametrize("name", ["two", "padded-requests", "tail-past-segments", "segments-past-tokens"])
def test_reference_follows_the_contract(name):
    """The oracle itself, against the contract written out in plain Python."""
    seg_lens, extra, pad = CASES[name]
    batch = make_batch(seg_lens, extra, torch.int64, "cpu", seed=3, n_bad=1)
    tokens, seg_starts, prefix_lens, token_map = (t.tolist() for t in batch)
    n_rows, err = len(tokens) + pad, new_err("cpu")
    got = prepare_inputs_ref(*batch, n_rows=n_rows, err=err)

    total = min(seg_starts[-1], len(tokens))
    ids, positions, bad = [], [], []
    for r, x in enumerate(tokens[:total]):
        ok = x >= 0 or 1 <= -x < len(token_map)
        ids.append(x if x >= 0 else token_map[-x] if ok else 0)
        bad += [] if ok else [x]
        q = max(q for q in range(len(prefix_lens)) if seg_starts[q] <= r)
        positions.append(prefix_lens[q] + r - seg_starts[q])
    assert got.input_ids.tolist() == ids + [0] * (n_rows - total)
    assert got.positions.tolist() == positions + [0] * (n_rows - total)
    assert got.last_rows.tolist() == [max(min(end, total) - 1, 0) for end in seg_starts[1:]]
    assert err.tolist() == ([len(bad), min(bad)] if bad else [0, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_prepare_out_dtype_wins(impl, device):
    device = impl_device(impl, device)
    batch = [
        torch.tensor(v, dtype=torch.int64, device=device) for v in ([5, -1, 0], [0, 2, 3], [10, 0], [0, 42])
    ]
    out = PreparedInputs(
        torch.full((4,), SENTINEL, dtype=torch.int32, device=device),
        torch.full((4,), SENTINEL, dtype=torch.int64, device=device),
        torch.full((2,), SENTINEL, dtype=torch.int64, device=device),
    )
    prepare(impl, batch, 4, out, None)
    assert out.input_ids.dtype == torch.int32
    assert out.input_ids.tolist() == [5, 42, 0, 0]
    assert out.positions.tolist() == [10, 11, 0, 0]
    assert out.last_rows.tolist() == [1, 2]


def test_launch_prepare_allocates_without_out(device):
    batch = make_batch([3, 1, 2], 2, torch.int32, device, seed=8)
    got = launch_prepare(*batch, 9, None, None)
    for a, b in zip(got, prepare_inputs_ref(*batch, n_rows=9), strict=True):
        assert torch.equal(a, b)


def _i64(*shape, device="cpu"):
    return torch.zeros(shape, dtype=torch.int64, device=device)


BAD_CALLS = [
    pytest.param(
        lambda d: prepare_inputs(_i64(3, device=d), _i64(3, device=d), _i64(1, device=d), _i64(4, device=d)),
        ValueError,
        r"seg_starts must have len\(prefix_lens\) \+ 1 = 2 entries, got 3",
        id="seg-len",
    ),
    pytest.param(
        lambda d: prepare_inputs(
            _i64(3, device=d), _i64(2, device=d), _i64(1, device=d), _i64(4, device=d), n_rows=2
        ),
        ValueError,
        r"n_rows must be >= len\(tokens\) = 3, got 2",
        id="n-rows-short",
    ),
    pytest.param(
        lambda d: prepare_inputs(
            _i64(3, device=d), _i64(2, device=d), _i64(1, device=d), _i64(4, device=d), n_rows=3.0
        ),
        TypeError,
        r"n_rows must be an int, got float",
        id="n-rows-float",
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
        id="out-size",
    ),
    pytest.param(
        lambda d: prepare_inputs(
            _i64(3, device=d), _i64(2, device="meta"), _i64(1, device=d), _i64(4, device=d)
        ),
        ValueError,
        r"seg_starts is on meta but token_map is on",
        id="foreign-device",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), BAD_CALLS)
def test_prepare_rejects_bad_arguments(call, exc, match, device):
    with pytest.raises(exc, match=match):
        call(device)


def test_numpy_prepare_segments_seen_again_with_other_rows():
    """The numpy path keeps the rows of segments it saw (a speculative step's recur every
    step): the same segments again over fewer live tokens (``tokens`` shorter than
    ``seg_starts[-1]``), and with other prefixes, give the reference's rows, never the kept ones."""
    tokens, seg, prefix, token_map = make_batch([5, 5, 5], 0, torch.int64, "cpu", seed=4)
    for n_tok, shift in ((15, 0), (11, 7), (15, 3), (4, 0)):
        out, backings = poisoned_out(15, 3, torch.int64, "cpu")
        cpu.prepare(tokens[:n_tok], seg, prefix + shift, token_map, out, None)
        want = prepare_inputs_ref(tokens[:n_tok], seg, prefix + shift, token_map, n_rows=15)
        for name, a, b in zip(PreparedInputs._fields, out, want, strict=True):
            assert torch.equal(a, b), (n_tok, shift, name, a.tolist(), b.tolist())
        for b, n in zip(backings, (15, 15, 3), strict=True):
            assert_fence(b, n)
