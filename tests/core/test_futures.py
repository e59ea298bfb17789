"""The FutureMap (``tfuture.core.future_map``): store, resolve and prepare through the map, the error
flag, and bad input (a clear error, and the map exactly as it was)."""

from typing import NamedTuple

import numpy as np
import pytest
import torch

from tfuture import FutureError, FutureIndices, FutureMap
from tfuture.core.future_fields import FutureFields

CAP = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"int32": torch.int32, "int64": torch.int64}


def _tokens(fi: FutureIndices, fmap: FutureMap, base: int = 1000) -> torch.Tensor:
    return torch.arange(base, base + len(fi), dtype=fmap.dtype, device=fmap.device)


@pytest.fixture(params=DTYPES.values(), ids=DTYPES.keys())
def fmap(request, device):
    return FutureMap(CAP, device=device, dtype=request.param)


def test_store_resolve_round_trip_in_mixed_stream(fmap):
    a, b = fmap.alloc(3), fmap.alloc(2)
    fmap.store(a, torch.tensor([7, 0, 2**31 - 1], dtype=fmap.dtype, device=fmap.device))
    fmap.store(b, torch.tensor([11, 12], dtype=torch.int64, device=fmap.device))
    ids = np.concatenate([[0, 5], b.host_placeholders(), [0], a.host_placeholders(), [9]])
    out = fmap.resolve(torch.tensor(ids, dtype=fmap.dtype, device=fmap.device))
    assert out.tolist() == [0, 5, 11, 12, 0, 7, 0, 2**31 - 1, 9]
    fmap.check()


def test_resolve_returns_its_argument_in_place(fmap):
    fi = fmap.alloc(2)
    fmap.store(fi, _tokens(fi, fmap))
    ids = fi.placeholders().clone()
    assert fmap.resolve(ids) is ids and ids.tolist() == [1000, 1001]


def test_prepare_inputs_through_the_map(fmap):
    decode = fmap.alloc(2)
    fmap.store(decode, _tokens(decode, fmap, base=500))
    # Request 0 decodes, request 1 is a 3-token prefill chunk, request 2 decodes; 2 padding rows.
    tokens = torch.tensor(
        [decode.host_placeholders()[0], 4, 0, 6, decode.host_placeholders()[1]],
        dtype=fmap.dtype,
        device=fmap.device,
    )
    seg_starts = torch.tensor([0, 1, 4, 5], device=fmap.device)
    prefix_lens = torch.tensor([9, 0, 20], device=fmap.device)
    res = fmap.prepare_inputs(tokens, seg_starts, prefix_lens, n_rows=7)
    assert res.input_ids.tolist() == [500, 4, 0, 6, 501, 0, 0]
    assert res.positions.tolist() == [9, 0, 1, 2, 20, 0, 0]
    assert res.last_rows.tolist() == [0, 3, 4]
    fmap.check()


def test_map_device_is_normalized():
    # Regression: FutureMap kept the device as given ("cuda", here "cpu:0") while tensors report
    # their own form, so every FutureFields.store was refused as "on another device".
    fmap = FutureMap(4, device="cpu:0")
    assert fmap.device == fmap.token_map.device
    fields = FutureFields(fmap, {"x": ((), torch.int64)})
    fi = fmap.alloc(2)
    fields.store(fi, {"x": torch.tensor([1, 2])})
    assert fields.gather(fi, ["x"])["x"].tolist() == [1, 2]


@pytest.mark.parametrize("where", ["past-end", "far", "dtype-min"])
def test_check_raises_after_out_of_range_placeholder(fmap, where):
    bad = {"past-end": -(CAP + 1), "far": -(2**31 - 1), "dtype-min": torch.iinfo(fmap.dtype).min}[where]
    fi = fmap.alloc(1)
    fmap.store(fi, _tokens(fi, fmap))
    fmap.check()
    out = fmap.resolve(torch.tensor([bad, -1, 0], dtype=fmap.dtype, device=fmap.device))
    assert out.tolist() == [0, 1000, 0]
    with pytest.raises(FutureError, match=rf"1 placeholder\(s\) .*outside .*most negative: {bad}\)"):
        fmap.check()


def test_check_resets_after_raising(fmap):
    fmap.resolve(torch.tensor([-(CAP + 1)], dtype=fmap.dtype, device=fmap.device))
    with pytest.raises(FutureError):
        fmap.check()
    # The flag is cleared even though check raised: the next clean step passes.
    assert fmap.err.tolist() == [0, 0]
    fmap.check()
    fmap.resolve(torch.tensor([-(CAP + 2), -(CAP + 9)], dtype=fmap.dtype, device=fmap.device))
    with pytest.raises(FutureError, match=r"2 placeholder\(s\) .*most negative: -25\)"):
        fmap.check()


def test_negative_token_store_is_flagged_not_leaked():
    fmap = FutureMap(4, device=DEVICE)
    fi = fmap.alloc(2)
    fmap.store(fi, torch.tensor([3, -1], device=DEVICE))
    ids = fmap.resolve(fi.placeholders())
    assert ids.tolist() == [3, 0]  # no negative id leaks into the next step
    with pytest.raises(FutureError, match=r"negative token\(s\) were stored \(most negative: -1\)"):
        fmap.check()
    dmap = FutureMap(4, device=DEVICE, debug=True)
    di = dmap.alloc(2)
    with pytest.raises(FutureError, match="negative token"):
        dmap.store(di, torch.tensor([3, -1], device=DEVICE))


class Scene(NamedTuple):
    fmap: FutureMap
    stored: FutureIndices  # 5 slots, written
    live: FutureIndices  # 3 slots after a released run, so the head is mid-ring
    dead: FutureIndices  # released
    dup: FutureIndices  # names one of live's slots twice
    other: FutureMap
    foreign: FutureIndices  # from the other map


def _scene(device: str) -> Scene:
    fmap = FutureMap(CAP, device=device)
    stored = fmap.alloc(5)
    fmap.store(stored, torch.arange(1, 6, device=device))
    dead = fmap.alloc(3)
    fmap.release(dead)
    live = fmap.alloc(3)
    dup = live.filter([0, 0, 2])
    other = FutureMap(CAP, device=device)
    return Scene(fmap, stored, live, dead, dup, other, other.alloc(3))


def _f32(n=3):
    return torch.ones(n, dtype=torch.float32, device=DEVICE)


def _i64(*shape, device=DEVICE):
    return torch.ones(shape, dtype=torch.int64, device=device)


BAD = [
    ("store-float", lambda s: s.fmap.store(s.live, _f32()), ValueError, r"int64, got torch\.float32"),
    ("store-meta", lambda s: s.fmap.store(s.live, _i64(3, device="meta")), ValueError, r"on meta but"),
    ("store-short", lambda s: s.fmap.store(s.live, _i64(2)), ValueError, r"expects 3 tokens.*got 2"),
    ("store-long", lambda s: s.fmap.store(s.live, _i64(4)), ValueError, r"expects 3 tokens.*got 4"),
    ("store-2d", lambda s: s.fmap.store(s.live, _i64(3, 1)), ValueError, r"1-D, got a 2-D .*\(3, 1\)"),
    ("store-list", lambda s: s.fmap.store(s.live, [1, 2, 3]), TypeError, r"torch\.Tensor, got list"),
    ("store-not-handle", lambda s: s.fmap.store([1], _i64(1)), TypeError, r"FutureIndices, got list"),
    (
        "store-foreign",
        lambda s: s.fmap.store(s.foreign, _i64(3)),
        ValueError,
        r"this FutureMap, got a foreign",
    ),
    ("store-released", lambda s: s.fmap.store(s.dead, _i64(3)), ValueError, r"store: expected a live"),
    ("store-dup-slot", lambda s: s.fmap.store(s.dup, _i64(3)), ValueError, r"distinct slots, got one nam"),
    ("resolve-float", lambda s: s.fmap.resolve(_f32()), ValueError, r"int64, got torch\.float32"),
    ("resolve-meta", lambda s: s.fmap.resolve(_i64(3, device="meta")), ValueError, r"on meta but"),
    ("resolve-2d", lambda s: s.fmap.resolve(-_i64(2, 2)), ValueError, r"1-D, got a 2-D .*\(2, 2\)"),
    ("resolve-list", lambda s: s.fmap.resolve([-1, -2]), TypeError, r"torch\.Tensor, got list"),
    ("alloc-negative", lambda s: s.fmap.alloc(-1), ValueError, r"n >= 0, got -1"),
    ("alloc-bool", lambda s: s.fmap.alloc(True), TypeError, r"int slot count, got bool"),
    ("alloc-float", lambda s: s.fmap.alloc(2.0), TypeError, r"int slot count, got float"),
    ("alloc-str", lambda s: s.fmap.alloc("2"), TypeError, r"int slot count, got str"),
    ("release-foreign", lambda s: s.fmap.release(s.foreign), ValueError, r"of this FutureMap, got a foreign"),
    ("release-twice", lambda s: s.fmap.release(s.dead), ValueError, r"expected a live .*got a released"),
    ("release-not-handle", lambda s: s.fmap.release(3), TypeError, r"expects a FutureIndices, got int"),
    ("filter-released", lambda s: s.dead.filter([0]), ValueError, r"filter: expected a live"),
    ("ph-released", lambda s: s.dead.placeholders(), ValueError, r"placeholders: expected a live"),
    ("host-ph-released", lambda s: s.dead.host_placeholders(), ValueError, r"expected a live"),
    ("keep-short-mask", lambda s: s.live.filter([True, False]), ValueError, r"3 entries, got 2"),
    ("keep-long-mask", lambda s: s.live.filter(torch.ones(4, dtype=torch.bool)), ValueError, r"3 entries"),
    ("keep-index-high", lambda s: s.live.filter([0, 3]), ValueError, r"\[-3, 3\), got 0\.\.3"),
    ("keep-index-low", lambda s: s.live.filter(torch.tensor([-4])), ValueError, r"\[-3, 3\), got -4"),
    ("keep-float", lambda s: s.live.filter(_f32()), TypeError, r"bool or integer, got dtype float32"),
    ("keep-float-list", lambda s: s.live.filter([0.0, 1.0]), TypeError, r"got dtype float64"),
    ("keep-2d", lambda s: s.live.filter(torch.ones(1, 3, dtype=torch.bool)), ValueError, r"1-D, got shape"),
    ("keep-2d-list", lambda s: s.live.filter([[0, 1]]), ValueError, r"1-D, got shape \(1, 2\)"),
    ("keep-scalar", lambda s: s.live.filter(1), TypeError, r"int index tensor, got int"),
    ("cat-released", lambda s: FutureIndices.cat([s.live, s.dead]), ValueError, r"cat: expected a live"),
    ("cat-empty", lambda s: FutureIndices.cat([]), ValueError, r"at least one .*got an empty"),
    ("cat-one-handle", lambda s: FutureIndices.cat(s.live), TypeError, r"sequence .*got FutureIndices"),
    (
        "cat-not-handle",
        lambda s: FutureIndices.cat([s.live, 3]),
        TypeError,
        r"expects FutureIndices, got int",
    ),
    (
        "cat-two-maps",
        lambda s: FutureIndices.cat([s.live, s.foreign]),
        ValueError,
        r"one FutureMap, got .*two",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_input_raises_and_leaves_map_unchanged(call, exc, match, device):
    scene, twin = _scene(device), _scene(device)
    with pytest.raises(exc, match=match):
        call(scene)
    for m, t in ((scene.fmap, twin.fmap), (scene.other, twin.other)):
        assert torch.equal(m.token_map, t.token_map)
        assert (m.in_use, m.free) == (t.in_use, t.free)
        assert m.alloc(3).slots.tolist() == t.alloc(3).slots.tolist()
    # No reference was taken or dropped: releasing the scene's handles empties both maps alike.
    for s in (scene, twin):
        for h in (s.stored, s.live, s.dup):
            s.fmap.release(h)
        s.other.release(s.foreign)
    assert scene.fmap.in_use == twin.fmap.in_use == 3
    assert scene.other.in_use == twin.other.in_use == 3
