"""Slot bookkeeping (``tfuture.core.slots``): allocation round the ring, the filter/cat algebra, and
the ownership rule (every slot ever allocated is returned exactly once)."""

import copy
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tfuture import FutureIndices, FutureMap, FutureMapFull

CAP = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"int32": torch.int32, "int64": torch.int64}


def _tokens(fi: FutureIndices, fmap: FutureMap, base: int = 1000) -> torch.Tensor:
    return torch.arange(base, base + len(fi), dtype=fmap.dtype, device=fmap.device)


def _read(fmap: FutureMap, fi: FutureIndices) -> list[int]:
    """Resolve a copy of ``fi``'s placeholders (resolve works in place)."""
    return fmap.resolve(fi.placeholders().clone()).tolist()


@pytest.fixture(params=DTYPES.values(), ids=DTYPES.keys())
def fmap(request, device):
    return FutureMap(CAP, device=device, dtype=request.param)


def test_alloc_len_and_placeholders(fmap):
    fi = fmap.alloc(5)
    assert len(fi) == 5 and fi.is_contiguous and not fi.released
    assert fi.slots.tolist() == [1, 2, 3, 4, 5]
    ph = fi.placeholders()
    assert ph.device == fmap.device and ph.dtype == fmap.dtype
    assert ph.tolist() == [-1, -2, -3, -4, -5]
    assert fi.placeholders(dtype=torch.int32).dtype == torch.int32
    assert fi.placeholders(dtype=torch.int32).tolist() == ph.tolist()
    host = fi.host_placeholders()
    assert isinstance(host, np.ndarray) and host.dtype == np.int64
    assert host.tolist() == [-1, -2, -3, -4, -5]
    with pytest.raises(ValueError, match="read-only"):
        fi.slots[0] = 7
    assert fmap.in_use == 5 and fmap.free == CAP - 5


def test_alloc_zero_is_a_working_empty_handle(fmap):
    fi = fmap.alloc(0)
    assert len(fi) == 0 and fmap.in_use == 0
    assert fi.placeholders().numel() == 0 and fi.placeholders().dtype == fmap.dtype
    assert fi.host_placeholders().size == 0
    fmap.store(fi, torch.empty(0, dtype=fmap.dtype, device=fmap.device))
    assert fmap.resolve(fi.placeholders().clone()).numel() == 0
    empties = [fi.filter([]), fi.filter(torch.zeros(0, dtype=torch.bool)), FutureIndices.cat([fi, fi])]
    assert [len(h) for h in empties] == [0, 0, 0]
    for h in [fi, *empties]:
        fmap.release(h)
    assert fmap.in_use == 0 and torch.equal(fmap.token_map, torch.zeros_like(fmap.token_map))
    full = fmap.alloc(CAP)
    assert len(fmap.alloc(0)) == 0 and fmap.in_use == CAP
    fmap.release(full)


def test_placeholders_survive_an_in_place_resolve(fmap):
    # Regression: placeholders() once returned a cached tensor that resolve then overwrote.
    fi = fmap.alloc(3)
    fmap.store(fi, _tokens(fi, fmap))
    fmap.resolve(fi.placeholders())
    assert fi.placeholders().tolist() == [-1, -2, -3]


def test_placeholders_rejects_a_float_dtype(fmap):
    fi = fmap.alloc(2)
    with pytest.raises(ValueError, match=r"int32 or torch.int64, got torch.float32"):
        fi.placeholders(torch.float32)


KEEPS = {
    "bool-tensor": torch.tensor([True, False, True, True, False, True]),
    "bool-numpy": np.array([False, True, False, False, True, True]),
    "bool-list": [True, True, False, False, False, True],
    "int-tensor": torch.tensor([5, 0, 2]),
    "int32-tensor": torch.tensor([1, 3], dtype=torch.int32),
    "int-list": [4, 1],
    "negative": [-1, -6, 2],
    "tuple": (3,),
    "range": range(2, 5),
    "repeats": [2, 2, 0],
    "empty": [],
}


@pytest.mark.parametrize("keep", KEEPS.values(), ids=KEEPS.keys())
def test_filter(fmap, keep):
    fi = fmap.alloc(6)
    fmap.store(fi, _tokens(fi, fmap))
    idx = np.asarray(keep.numpy() if isinstance(keep, torch.Tensor) else keep)
    idx = idx if idx.dtype == np.bool_ else idx.astype(np.int64)
    sub = fi.filter(keep)
    assert sub.slots.tolist() == fi.slots[idx].tolist()
    assert len(sub) == len(fi.slots[idx]) and not sub.is_contiguous
    assert sub.placeholders().tolist() == (-fi.slots[idx]).tolist()
    assert _read(fmap, sub) == np.asarray(_read(fmap, fi))[idx].tolist()
    assert fmap.in_use == 6


def test_filter_with_a_meta_keep_raises_a_documented_error():
    fmap = FutureMap(4, device="cpu")
    fi = fmap.alloc(2)
    with pytest.raises(ValueError, match="meta device"):
        fi.filter(torch.ones(2, dtype=torch.bool, device="meta"))
    assert fmap.in_use == 2


def test_cat_keeps_order(fmap):
    a, b, c = fmap.alloc(3), fmap.alloc(0), fmap.alloc(4)
    for i, h in enumerate((a, c)):
        fmap.store(h, _tokens(h, fmap, base=100 * (i + 1)))
    d = c.filter([3, 1])
    joined = FutureIndices.cat([d, a, b, c])
    assert joined.slots.tolist() == [*d.slots, *a.slots, *c.slots]
    assert _read(fmap, joined) == [203, 201, 100, 101, 102, 200, 201, 202, 203]
    assert FutureIndices.cat([a]).slots.tolist() == a.slots.tolist()
    assert FutureIndices.cat((c, c)).slots.tolist() == [*c.slots, *c.slots]


def test_in_use_and_free_accounting(fmap):
    a = fmap.alloc(4)
    b = fmap.alloc(3)
    assert (fmap.in_use, fmap.free) == (7, CAP - 7)
    f = a.filter([0, 0, 1])
    j = FutureIndices.cat([f, b])
    assert fmap.in_use == 7  # extra references, no new slots
    fmap.release(a)
    assert fmap.in_use == 5  # a's slots 0 and 1 live on in f
    fmap.release(b)
    assert fmap.in_use == 5  # b lives on in j
    fmap.release(j)
    assert fmap.in_use == 2
    fmap.release(f)
    assert (fmap.in_use, fmap.free) == (0, CAP)


def test_full_map_raises_and_is_unchanged(device):
    fmap, twin = FutureMap(CAP, device=device), FutureMap(CAP, device=device)
    for m in (fmap, twin):
        m.store(m.alloc(12), torch.arange(12, device=device))
        m.release(m.alloc(1))
    with pytest.raises(FutureMapFull, match=r"asked for 5 slots, 12 of 16 in use \(4 free\)"):
        fmap.alloc(5)
    assert torch.equal(fmap.token_map, twin.token_map)
    assert (fmap.in_use, fmap.free) == (twin.in_use, twin.free) == (12, 4)
    assert fmap.alloc(4).slots.tolist() == twin.alloc(4).slots.tolist() == [14, 15, 16, 13]


def test_map_exactly_at_capacity(fmap):
    fi = fmap.alloc(CAP)
    assert fi.slots.tolist() == list(range(1, CAP + 1)) and fi.is_contiguous
    assert (fmap.in_use, fmap.free) == (CAP, 0)
    with pytest.raises(FutureMapFull, match=r"asked for 1 slots, 16 of 16 in use"):
        fmap.alloc(1)
    fmap.store(fi, _tokens(fi, fmap))
    assert _read(fmap, fi) == list(range(1000, 1000 + CAP))
    fmap.release(fi)
    assert sorted(fmap.alloc(CAP).slots.tolist()) == list(range(1, CAP + 1))


def test_wrap_around_goes_round_the_ring(fmap):
    fmap.release(fmap.alloc(10))
    tail = fmap.alloc(6)
    assert tail.slots.tolist() == list(range(11, 17))
    # The head is past the end: the next run starts again at slot 1.
    head = fmap.alloc(3)
    assert head.slots.tolist() == [1, 2, 3] and head.is_contiguous
    fmap.store(tail, _tokens(tail, fmap, base=60))
    fmap.store(head, _tokens(head, fmap, base=30))
    assert _read(fmap, FutureIndices.cat([tail, head])) == [60, 61, 62, 63, 64, 65, 30, 31, 32]


def test_fragmented_allocation_is_correct(fmap):
    a, b, c, d = fmap.alloc(3), fmap.alloc(4), fmap.alloc(5), fmap.alloc(2)
    fmap.release(a)
    fmap.release(c)
    # Free: 1-3, 8-12, 15-16. The head is at 15, so allocation continues there and wraps.
    frag = fmap.alloc(7)
    assert frag.slots.tolist() == [15, 16, 1, 2, 3, 8, 9]
    assert not frag.is_contiguous
    fmap.store(b, _tokens(b, fmap, base=10))
    fmap.store(frag, _tokens(frag, fmap, base=70))
    fmap.store(d, _tokens(d, fmap, base=40))
    assert _read(fmap, frag) == list(range(70, 77))
    assert _read(fmap, b) == [10, 11, 12, 13] and _read(fmap, d) == [40, 41]
    stored = {s: 70 + i for i, s in enumerate(frag.slots)}
    untouched = [s for s in range(1, CAP + 1) if s not in {*stored, *b.slots, *d.slots}]
    assert fmap.token_map[untouched].tolist() == [0] * len(untouched)


def test_slot_zero_is_never_handed_out(fmap):
    live: list[FutureIndices] = []
    for _ in range(60):
        if live and (fmap.free == 0 or np.random.random() < 0.4):
            fmap.release(live.pop(int(np.random.randint(len(live)))))
            continue
        fi = fmap.alloc(int(np.random.randint(0, fmap.free + 1)))
        assert fi.slots.size == 0 or (fi.slots.min() >= 1 and fi.slots.max() <= CAP)
        live.append(fi)
    assert fmap.token_map[0] == 0


def test_filter_and_cat_handles_keep_their_slots(fmap):
    a = fmap.alloc(4)
    fmap.store(a, _tokens(a, fmap))
    kept = a.filter([True, False, True, False])
    joined = FutureIndices.cat([a.filter([3]), kept])
    fmap.release(a)
    assert fmap.in_use == 3  # slots 1, 3 (kept, joined) and 4 (joined)
    rest = fmap.alloc(fmap.free)
    assert not set(rest.slots.tolist()) & {1, 3, 4}
    fmap.store(rest, _tokens(rest, fmap, base=5000))
    assert _read(fmap, kept) == [1000, 1002]
    assert _read(fmap, joined) == [1003, 1000, 1002]


def test_releasing_every_handle_returns_every_slot_once(fmap):
    a, b = fmap.alloc(5), fmap.alloc(6)
    derived = [a.filter([4, 4, 0]), FutureIndices.cat([a, b, a]), b.filter(np.ones(6, bool))]
    derived.append(FutureIndices.cat(derived[:2]))
    # Originals first: every slot stays owned until the last handle naming it goes.
    for h in [a, b, *derived]:
        assert fmap.in_use == 11
        fmap.release(h)
    assert (fmap.in_use, fmap.free) == (0, CAP)
    everything = fmap.alloc(CAP)
    assert sorted(everything.slots.tolist()) == list(range(1, CAP + 1))


def test_copied_handle_is_refused(fmap):
    # Regression: copy.copy(handle) once made a twin holding no reference; releasing both
    # drove refcounts negative and let alloc hand out short handles.
    fi = fmap.alloc(CAP)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.copy(fi)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(fi)
    fmap.release(fi)
    assert fmap.in_use == 0
    assert len(fmap.alloc(CAP)) == CAP


def _fragmented_map(prefix: list[int]) -> FutureMap:
    """A map whose free slots are scattered: allocate ``prefix`` runs, release every other one."""
    fmap = FutureMap(CAP, device=DEVICE)
    runs = [fmap.alloc(n) for n in prefix]
    for h in runs[::2]:
        fmap.release(h)
    return fmap


def _keep(n: int):
    masks = st.lists(st.booleans(), min_size=n, max_size=n)
    indices = st.lists(st.integers(-n, n - 1), max_size=2 * n) if n else st.just([])
    return st.one_of(masks, indices)


@settings(max_examples=40, deadline=None)
@given(prefix=st.lists(st.integers(0, 5), max_size=3), n=st.integers(0, 6), data=st.data())
def test_resolve_commutes_with_filter(prefix, n, data):
    fmap = _fragmented_map(prefix)
    fi = fmap.alloc(n)
    fmap.store(fi, _tokens(fi, fmap))
    keep = data.draw(_keep(n))
    sub = fi.filter(keep)
    idx = np.asarray(keep, dtype=bool if keep and isinstance(keep[0], bool) else np.int64)
    assert _read(fmap, sub) == np.asarray(_read(fmap, fi), dtype=np.int64)[idx].tolist()


@settings(max_examples=40, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 4), max_size=3), sizes=st.lists(st.integers(0, 3), min_size=1, max_size=4)
)
def test_resolve_commutes_with_cat(prefix, sizes):
    fmap = _fragmented_map(prefix)
    handles = [fmap.alloc(n) for n in sizes]
    for i, h in enumerate(handles):
        fmap.store(h, _tokens(h, fmap, base=100 * i))
    # Repeat a handle and mix in a filtered one: cat takes handles of any provenance.
    handles += [handles[0], handles[-1].filter(list(range(len(handles[-1])))[::-1])]
    joined = FutureIndices.cat(handles)
    assert _read(fmap, joined) == [t for h in handles for t in _read(fmap, h)]


class SlotOwnership(RuleBasedStateMachine):
    """Random alloc / filter / cat / release against a refcount model of every slot."""

    def __init__(self) -> None:
        super().__init__()
        self.fmap = FutureMap(12, device=DEVICE)
        self.handles: list[FutureIndices] = []
        self.refs: Counter[int] = Counter()
        self.value: dict[int, int] = {}
        self.allocated: Counter[int] = Counter()
        self.returned: Counter[int] = Counter()
        self.next_token = 100

    def _take(self, fi: FutureIndices) -> None:
        self.refs.update(fi.slots.tolist())
        self.handles.append(fi)

    @rule(n=st.integers(0, 7))
    def alloc(self, n: int) -> None:
        free = 12 - sum(1 for c in self.refs.values() if c > 0)
        if n > free:
            with pytest.raises(FutureMapFull):
                self.fmap.alloc(n)
            return
        fi = self.fmap.alloc(n)
        slots = fi.slots.tolist()
        assert len(set(slots)) == n and all(1 <= s <= 12 and self.refs[s] == 0 for s in slots)
        self.allocated.update(slots)
        tokens = torch.arange(self.next_token, self.next_token + n, device=DEVICE)
        self.fmap.store(fi, tokens)
        self.value.update(zip(slots, tokens.tolist(), strict=True))
        self.next_token += n
        self._take(fi)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def filter(self, data) -> None:
        h = data.draw(st.sampled_from(self.handles))
        keep = data.draw(_keep(len(h)))
        sub = h.filter(keep)
        assert len(sub) == (sum(keep) if keep and isinstance(keep[0], bool) else len(keep))
        self._take(sub)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def cat(self, data) -> None:
        parts = data.draw(st.lists(st.sampled_from(self.handles), min_size=1, max_size=3))
        joined = FutureIndices.cat(parts)
        assert joined.slots.tolist() == [s for p in parts for s in p.slots.tolist()]
        self._take(joined)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def release(self, data) -> None:
        h = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.fmap.release(h)
        self.refs.subtract(h.slots.tolist())
        for s in set(h.slots.tolist()):
            assert self.refs[s] >= 0
            if self.refs[s] == 0:
                self.returned[s] += 1

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def resolve(self, data) -> None:
        h = data.draw(st.sampled_from(self.handles))
        assert _read(self.fmap, h) == [self.value[s] for s in h.slots.tolist()]

    @invariant()
    def refcounts_agree(self) -> None:
        model = np.zeros(13, dtype=np.int64)
        model[0] = 1  # the pinned padding slot
        for s, c in self.refs.items():
            model[s] = c
        np.testing.assert_array_equal(self.fmap.refcounts, model)
        assert self.fmap.in_use == int((model[1:] > 0).sum())

    def teardown(self) -> None:
        for h in self.handles:
            self.fmap.release(h)
        for s in {s for h in self.handles for s in h.slots.tolist()}:
            self.returned[s] += 1
        assert self.fmap.in_use == 0
        assert self.allocated == self.returned
        assert sorted(self.fmap.alloc(12).slots.tolist()) == list(range(1, 13))


SlotOwnership.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSlotOwnership = SlotOwnership.TestCase
