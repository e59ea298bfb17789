"""FutureFields: named per-slot fields stored and gathered through future handles.

The kernels underneath (store_fields / gather_fields) are tested in tests/kernel_tests/test_fields.py.
Payloads are random bit patterns viewed as each dtype, so floats carry NaNs with payloads,
-0.0, infinities and subnormals; every comparison is on the raw words.
"""

import numpy as np
import pytest
import torch

from tfuture import FutureError, FutureIndices, FutureMap
from tfuture.core.future_fields import FieldSpec, FutureFields
from tfuture.kernels.fields import as_words

POISON = 0x5A


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: str) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: any bit pattern, NaN payloads and -0.0 included."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size) if shape else (size,), generator=g)
    t = raw.to(torch.uint8)
    if dtype == torch.bool:
        t = t & 1
    t = t.view(dtype) if shape else t.view(dtype)[0]
    if dtype.is_floating_point and t.numel() >= 2:
        flat = t.view(-1)
        flat[0], flat[1] = -0.0, float("nan")
    return t.to(device)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(-1).view(torch.uint8).fill_(POISON)
    return t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_words(a), as_words(b))


# FutureFields --------------------------------------------------------------------------------


def _fields(device: str, capacity: int = 40, **kw) -> FutureFields:
    fmap = FutureMap(capacity, device=device)
    spec = {
        "tokens": ((4,), torch.int64),
        "accept_len": ((), torch.int32),
        "probs": (3, torch.float32),
        "hidden": ((5,), torch.bfloat16),
    }
    return FutureFields(fmap, spec, **kw)


def _step_payload(ff: FutureFields, n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        k: _bits((n, *s.shape) if s.shape else (n,), s.dtype, g, str(ff.fmap.device))
        for k, s in ff.specs.items()
    }


def _snapshot(ff: FutureFields) -> dict[str, torch.Tensor]:
    return {k: ff.buffer(k).clone() for k in ff.names}


def _unchanged(ff: FutureFields, snap: dict[str, torch.Tensor]) -> bool:
    return list(snap) == ff.names and all(_same_bits(ff.buffer(k), v) for k, v in snap.items())


def test_future_fields_handles_roundtrip(device: str) -> None:
    ff = _fields(device)
    fmap, g = ff.fmap, _gen(11)
    assert ff.specs["probs"] == FieldSpec((3,), torch.float32)
    a, b = fmap.alloc(5), fmap.alloc(3)
    pa, pb = _step_payload(ff, 5, g), _step_payload(ff, 3, g)
    ff.store(a, pa)  # fresh contiguous handle: no index tensor
    sub = b.filter(np.array([2, 0]))
    ff.store(sub, {k: v[[2, 0]] for k, v in pb.items()})  # filtered handle: placeholders
    odd = a.filter(np.array([True, False, True, False, True]))
    mixed = FutureIndices.cat([odd, sub])
    got = ff.gather(mixed, ["hidden", "tokens", "accept_len"])
    assert list(got) == ["hidden", "tokens", "accept_len"]
    for k, v in got.items():
        assert _same_bits(v, torch.cat([pa[k][[0, 2, 4]], pb[k][[2, 0]]]))
    by_slot = ff.gather(torch.tensor(a.slots, device=device))
    assert all(_same_bits(by_slot[k], pa[k]) for k in ff.names)
    out = {k: _poisoned(tuple(v.shape), v.dtype, device) for k, v in pa.items()}
    res = ff.gather(a, out=out)
    assert all(res[k] is out[k] and _same_bits(out[k], pa[k]) for k in ff.names)
    empty = fmap.alloc(0)
    ff.store(empty, _step_payload(ff, 0, g))
    assert ff.gather(empty, ["tokens"])["tokens"].shape == (0, 4)
    for h in (a, b, sub, odd, mixed, empty):
        fmap.release(h)
    assert fmap.in_use == 0
    fmap.check()


def test_future_fields_launch_store_equals_store(device: str) -> None:
    """The unchecked one-field store a step uses for its own slots writes what store writes:
    a fresh run, a filtered handle (placeholders), an empty handle; other fields and slots
    untouched."""
    g = _gen(5)
    pa, pb = None, None
    got = []
    for unchecked in (True, False):
        ff = _fields(device)
        a, b, empty = ff.fmap.alloc(6), ff.fmap.alloc(4), ff.fmap.alloc(0)
        assert (a.slots.tolist(), b.slots.tolist()) == ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10])
        if pa is None:
            pa, pb = _step_payload(ff, 6, g), _step_payload(ff, 2, g)
        snap = _snapshot(ff)
        sub = b.filter(np.array([3, 1]))
        for name in ("tokens", "hidden"):
            if unchecked:
                ff.launch_store(a, name, pa[name])
                ff.launch_store(sub, name, pb[name])
                ff.launch_store(empty, name, pb[name][:0])
            else:
                ff.store(a, {name: pa[name]})
                ff.store(sub, {name: pb[name]})
        for name in ("accept_len", "probs"):
            assert _same_bits(ff.buffer(name), snap[name]), name
        untouched = torch.tensor([0, 7, 9, *range(11, 40)], device=device)
        assert _same_bits(ff.buffer("tokens")[untouched], snap["tokens"][untouched])
        got.append(ff)
    for name in got[0].names:
        assert _same_bits(got[0].buffer(name), got[1].buffer(name)), name
    assert _same_bits(got[0].buffer("tokens")[1:7], pa["tokens"])
    assert _same_bits(got[0].buffer("hidden")[[10, 8]], pb["hidden"])


def test_future_fields_declared_from_first_payload(device: str) -> None:
    fmap = FutureMap(8, device=device)
    ff = FutureFields(fmap)
    assert ff.allow_new and ff.names == []
    fi = fmap.alloc(0)
    ff.store(fi, {"hidden": torch.empty(0, device=device)})  # an empty payload declares nothing
    assert ff.names == []
    fi2 = fmap.alloc(2)
    val = torch.tensor([[1.5, -0.0], [float("nan"), 2.0]], dtype=torch.float16, device=device)
    ff.store(fi2, {"hidden": val, "n": torch.tensor([3, 4], dtype=torch.int32, device=device)})
    assert ff.specs == {"hidden": FieldSpec((2,), torch.float16), "n": FieldSpec((), torch.int32)}
    assert _same_bits(ff.gather(fi2)["hidden"], val)
    with pytest.raises(ValueError, match="already declared"):
        ff.declare("n", ((), torch.int32))
    snap = _snapshot(ff)
    with pytest.raises(TypeError, match=r"must have dtype torch.int32, got torch.int64"):
        ff.store(fi2, {"new": torch.ones(2, device=device), "n": torch.tensor([1, 2], device=device)})
    assert _unchanged(ff, snap) and "new" not in ff
    for h in (fi, fi2):
        fmap.release(h)


def test_future_fields_bad_input_leaves_map_unchanged(device: str) -> None:
    ff = _fields(device)
    fmap, g = ff.fmap, _gen(13)
    fi = fmap.alloc(3)
    ff.store(fi, _step_payload(ff, 3, g))
    snap, in_use = _snapshot(ff), fmap.in_use
    ok = _step_payload(ff, 3, g)
    other = FutureMap(40, device=device)
    foreign = other.alloc(3)
    first = fi.filter(np.array([0]))
    dup = FutureIndices.cat([fi, first])
    released = fmap.alloc(2)
    fmap.release(released)
    bad = [
        (TypeError, "dtype torch.int32, got torch.int64", fi, {**ok, "accept_len": ok["accept_len"].long()}),
        (ValueError, r"shape \(3, 4\)", fi, {**ok, "tokens": ok["tokens"][:, :3]}),
        (ValueError, r"shape \(3, 5\)", fi, {**ok, "hidden": ok["hidden"][:2]}),
        (ValueError, "unknown field 'topk'", fi, {**ok, "topk": ok["tokens"]}),
        (ValueError, "meta", fi, {**ok, "probs": torch.zeros((3, 3), device="meta")}),
        (TypeError, "must be a torch.Tensor", fi, {**ok, "probs": [1.0, 2.0]}),
        (ValueError, "foreign", foreign, ok),
        (ValueError, "released", released, {}),
        (ValueError, "naming a slot twice", dup, {k: torch.cat([v, v[:1]]) for k, v in ok.items()}),
        (TypeError, "FutureIndices", fi.slots, ok),
        (TypeError, "mapping", fi, list(ok.values())),
    ]
    for exc, msg, handle, payload in bad:
        with pytest.raises(exc, match=msg):
            ff.store(handle, payload)
        assert _unchanged(ff, snap) and fmap.in_use == in_use
    with pytest.raises(ValueError, match="unknown field 'nope'"):
        ff.gather(fi, ["tokens", "nope"])
    with pytest.raises(KeyError):  # UnknownFieldError is both, for mapping-style callers
        ff.buffer("nope")
    with pytest.raises(TypeError, match="got the str 'tokens'"):
        ff.gather(fi, "tokens")
    with pytest.raises(ValueError, match="foreign"):
        ff.gather(foreign)
    got = ff.gather(dup, ["accept_len"])["accept_len"]  # duplicates are fine to read
    assert got[3] == got[0]
    ff.gather(torch.tensor([1, 0, 99], device=device), ["tokens"])
    with pytest.raises(FutureError):
        fmap.check()
    for h in (fi, first, dup):
        fmap.release(h)
    other.release(foreign)
    assert fmap.in_use == 0 and _unchanged(ff, snap)
