"""Hypothesis fuzzing of the public FutureMap / FutureIndices API, misuse included.

A rule-based state machine drives random call sequences (alloc, store, resolve, filter, cat,
release, placeholders, check) against a pure-Python model of the map: per-slot reference
counts, the token map's contents, the error flag and, in debug mode, the per-slot state
machine. Every call either works or raises a documented exception (``ValueError``,
``TypeError``, ``FutureMapFull``, ``FutureError``), and the model predicts which one. After every
step the map must agree with the model: ``in_use``, ``free``, ``refcounts`` per slot, the token
map, the error flag, the debug states; no live slot is ever handed out twice, and resolved
values equal the model's.

Misuse covered: wrong dtypes, wrong devices ('meta' tensors), 2-D and non-contiguous tensors,
non-tensors, foreign handles from a second map, double release, use after release, stale
placeholders of released handles, resolve of an empty stream, bad keep masks and indices,
negative, non-int and huge allocs, handles naming a slot twice, out-of-range and negative ids.
"""

from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from fuzz_inputs import BAD_KEEPS, BAD_VECTORS, bad_vector, expect
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tfuture import FutureError, FutureIndices, FutureMap, FutureMapFull
from tfuture.core.debug import ALLOCATED, FREE, READ, WRITTEN

KEEP_OK = ["mask", "mask-np", "mask-torch", "index", "index-torch", "range"]
INDEX = st.integers(0, 1 << 16)


@dataclass
class H:
    """A handle the machine made, and what the model knows of it."""

    fi: FutureIndices
    slots: list[int]
    live: bool = True


class Ph:
    """A placeholder tensor taken from a handle while it was live (it may be stale later)."""

    def __init__(self, ids: torch.Tensor, slots: list[int]) -> None:
        self.ids, self.slots = ids, slots


class FutureMapMachine(RuleBasedStateMachine):
    @initialize(
        cap=st.integers(1, 10),
        dtype=st.sampled_from([torch.int32, torch.int64]),
        debug=st.booleans(),
    )
    def setup(self, cap: int, dtype: torch.dtype, debug: bool) -> None:
        self.cap, self.dtype, self.debug = cap, dtype, debug
        self.fmap = FutureMap(cap, device="cpu", dtype=dtype, debug=debug)
        self.other = FutureMap(4, device="cpu")
        self.foreign = self.other.alloc(2)
        self.refs = [0] * (cap + 1)
        self.tm = [0] * (cap + 1)
        self.state = [FREE] * (cap + 1)
        self.err = [0, 0]
        self.handles: list[H] = []
        self.phs: list[Ph] = []
        self.poison = torch.iinfo(dtype).min

    def pick(self, i: int) -> H:
        return self.handles[i % len(self.handles)]

    def take(self, h: H) -> None:
        for s in h.slots:
            self.refs[s] += 1
        self.handles.append(h)

    def handle_rule(self, h: object) -> type[BaseException] | None:
        if not isinstance(h, FutureIndices):
            return TypeError
        if h is self.foreign:
            return ValueError
        rec = next(r for r in self.handles if r.fi is h)
        return None if rec.live else ValueError

    @rule(
        n=st.one_of(
            st.integers(0, 12),
            st.integers(-3, -1),
            st.sampled_from([2**31, 2**63, 2**70, np.int64(1), np.int32(2), np.uint8(0)]),
            st.sampled_from([True, False, 2.0, "2", None, [1]]),
        )
    )
    def alloc(self, n: object) -> None:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            want: type[BaseException] | None = TypeError
        elif int(n) < 0:
            want = ValueError
        elif int(n) > self.fmap.free:
            want = FutureMapFull
        else:
            want = None
        fi = expect(lambda: self.fmap.alloc(n), want, "alloc")  # type: ignore[arg-type]
        if fi is None:
            return
        assert isinstance(fi, FutureIndices)
        slots = fi.slots.tolist()
        assert len(fi) == len(slots) == int(n)  # type: ignore[arg-type]
        assert len(set(slots)) == len(slots), "a slot handed out twice in one alloc"
        for s in slots:
            assert 1 <= s <= self.cap, f"slot {s} outside the map"
            assert self.refs[s] == 0, f"live slot {s} handed out again"
            self.state[s] = ALLOCATED
        self.take(H(fi, slots))

    @rule(n=st.integers(1, 4), base=st.integers(0, 900))
    def alloc_and_store(self, n: int, base: int) -> None:
        """The common path: fresh slots, stored at once."""
        if n > self.fmap.free:
            expect(lambda: self.fmap.alloc(n), FutureMapFull, "alloc")
            return
        self.alloc(n)
        h = self.handles[-1]
        tokens = torch.arange(base, base + n, dtype=self.dtype)
        expect(lambda: self.fmap.store(h.fi, tokens), None, "store")
        for s, v in zip(h.slots, tokens.tolist(), strict=True):
            self.tm[s] = v
            self.state[s] = WRITTEN

    @precondition(lambda self: self.handles)
    @rule(
        i=INDEX,
        values=st.lists(st.integers(-3, 999), max_size=12),
        kind=st.sampled_from(["ok", "ok", "ok", "other-dtype", "short", "long", "foreign", "not-handle"]),
    )
    def store(self, i: int, values: list[int], kind: str) -> None:
        h = self.pick(i)
        target: object = h.fi
        n = len(h.slots)
        vals = (values * (n // max(len(values), 1) + 1))[:n] if values else list(range(n))
        tdtype = self.dtype
        if kind == "other-dtype":
            tdtype = torch.int32 if self.dtype == torch.int64 else torch.int64
        if kind == "short":
            vals = vals[:-1] if vals else [1]
        if kind == "long":
            vals = [*vals, 7]
        if kind == "foreign":
            target = self.foreign
            vals = [1, 2]
        if kind == "not-handle":
            target = h.slots
        tokens = torch.tensor(vals, dtype=tdtype)
        want = self.handle_rule(target)
        if want is None and len(vals) != n:
            want = ValueError
        if want is None and len(set(h.slots)) != n:
            want = ValueError  # a handle naming a slot twice is never stored through
        if want is None and n and self.debug and any(v < 0 for v in vals):
            want = FutureError  # debug refuses a negative token before anything changes
        if want is None and n and self.debug and any(self.state[s] != ALLOCATED for s in h.slots):
            want = FutureError  # write-twice, write after read
        expect(lambda: self.fmap.store(target, tokens), want, "store")  # type: ignore[arg-type]
        if want is None:
            for s, v in zip(h.slots, vals, strict=True):
                # A negative token is stored as 0 and flagged: it would look like a placeholder.
                self.tm[s] = max(v, 0)
                self.state[s] = WRITTEN
                if v < 0:
                    self.err = [self.err[0] + 1, min(self.err[1], v)]

    @precondition(lambda self: self.handles)
    @rule(i=INDEX, kind=st.sampled_from(list(BAD_VECTORS)))
    def store_bad_tensor(self, i: int, kind: str) -> None:
        h = self.pick(i)
        tokens, want = bad_vector(kind, len(h.slots), self.dtype)
        if not h.live:
            want = ValueError  # the handle is checked first
        expect(lambda: self.fmap.store(h.fi, tokens), want, "store-bad")  # type: ignore[arg-type]

    @rule(
        parts=st.lists(
            st.one_of(
                st.tuples(st.just("token"), st.integers(0, 500)),
                st.tuples(st.just("live"), INDEX),
                st.tuples(st.just("stale"), INDEX),
                st.tuples(st.just("oor"), st.sampled_from(["past-end", "far", "min"])),
            ),
            max_size=8,
        ),
        ids_dtype=st.sampled_from([torch.int32, torch.int64]),
    )
    def resolve(self, parts: list[tuple[str, object]], ids_dtype: torch.dtype) -> None:
        ids: list[int] = []
        for what, arg in parts:
            if what == "token":
                ids.append(int(arg))  # type: ignore[call-overload]
            elif what == "live" and any(h.live for h in self.handles):
                live = [h for h in self.handles if h.live]
                h = live[int(arg) % len(live)]  # type: ignore[call-overload]
                ph = h.fi.placeholders(ids_dtype)
                assert ph.tolist() == [-s for s in h.slots]
                ids += ph.tolist()
            elif what == "stale" and self.phs:
                ids += self.phs[int(arg) % len(self.phs)].ids.tolist()  # type: ignore[call-overload]
            elif what == "oor":
                oor = {"past-end": -(self.cap + 1), "far": -(2**30), "min": torch.iinfo(ids_dtype).min}
                ids.append(oor[arg])  # type: ignore[index]
        t = torch.tensor(ids, dtype=ids_dtype)
        slots = [-x for x in ids if -self.cap <= x <= -1]
        want: type[BaseException] | None = None
        if self.debug and any(self.state[s] not in (WRITTEN, READ) for s in slots):
            want = FutureError  # read before write, read after release
        expected = list(ids)
        err = list(self.err)
        if want is None:
            for k, x in enumerate(ids):
                if -self.cap <= x <= -1:
                    # Stored values fit both dtypes; a poisoned (released) slot is never read
                    # here: debug refuses the read first, and only debug poisons.
                    expected[k] = self.tm[-x]
                elif x < 0:
                    expected[k] = 0
                    err = [err[0] + 1, min(err[1], x)]
            if self.debug and err[0]:
                # An out-of-range id (or negative token) flagged now or earlier: debug mode
                # raises after the resolve and clears the flag it reported.
                want = FutureError
        res = expect(lambda: self.fmap.resolve(t), want, "resolve")
        if want is None:
            assert res is t
        if want is None or (self.debug and not any(self.state[s] not in (WRITTEN, READ) for s in slots)):
            # The in-place resolve happened (debug may still raise after it).
            assert t.tolist() == expected, (ids, t.tolist(), expected)
            self.err = [0, 0] if want is FutureError else err
            for s in slots:
                if self.debug:
                    self.state[s] = READ
        else:
            assert t.tolist() == ids  # a refused read changes nothing

    @rule(kind=st.sampled_from(["empty-int64", "empty-int32", *BAD_VECTORS]))
    def resolve_misuse(self, kind: str) -> None:
        if kind.startswith("empty"):
            empty = torch.zeros(0, dtype=torch.int64 if kind == "empty-int64" else torch.int32)
            want = FutureError if self.debug and self.err[0] else None
            res = expect(lambda: self.fmap.resolve(empty), want, "resolve-empty")
            assert want is not None or res is empty
            if want is not None:
                self.err = [0, 0]  # reported, so cleared
            assert empty.numel() == 0
            return
        ids, want = bad_vector(kind, 3, self.dtype)
        expect(lambda: self.fmap.resolve(ids), want, "resolve-bad")  # type: ignore[arg-type]

    @precondition(lambda self: self.handles)
    @rule(i=INDEX, data=st.data())
    def filter(self, i: int, data: st.DataObject) -> None:
        h = self.pick(i)
        n = len(h.slots)
        kind = data.draw(st.sampled_from([*KEEP_OK, "oor-index", *BAD_KEEPS]), label="keep kind")
        want: type[BaseException] | None = None
        idx: list[int] = []
        keep: object
        if kind.startswith("mask"):
            mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="mask")
            idx = [k for k, b in enumerate(mask) if b]
            keep = {"mask": mask, "mask-np": np.array(mask, dtype=bool)}.get(
                kind, torch.tensor(mask, dtype=torch.bool)
            )
            if kind == "mask" and not mask:
                keep = np.zeros(0, dtype=bool)
        elif kind.startswith("index"):
            idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=6), label="index") if n else []
            keep = idx if kind == "index" else torch.tensor(idx, dtype=torch.int64)
            idx = [k % n for k in idx]
        elif kind == "range":
            keep = range(n)
            idx = list(range(n))
        elif kind == "oor-index":
            keep = [data.draw(st.sampled_from([n, n + 5, -n - 1, 2**40]), label="oor")]
            want = ValueError
        else:
            make, want = BAD_KEEPS[kind]
            keep = make(n)
        if not h.live:
            want = ValueError
        sub = expect(lambda: h.fi.filter(keep), want, "filter")  # type: ignore[arg-type]
        if sub is None:
            return
        assert isinstance(sub, FutureIndices)
        slots = [h.slots[k] for k in idx]
        assert sub.slots.tolist() == slots
        self.take(H(sub, slots))

    @rule(
        picks=st.lists(st.tuples(st.sampled_from(["h", "h", "h", "foreign", "int"]), INDEX), max_size=4),
        as_tuple=st.booleans(),
        bare=st.booleans(),
    )
    def cat(self, picks: list[tuple[str, int]], as_tuple: bool, bare: bool) -> None:
        items: list[object] = []
        recs: list[H | None] = []
        for what, i in picks:
            if what == "h" and self.handles:
                rec = self.pick(i)
                items.append(rec.fi)
                recs.append(rec)
            elif what == "foreign":
                items.append(self.foreign)
                recs.append(None)
            else:
                items.append(i)
                recs.append(None)
        arg: object = tuple(items) if as_tuple else items
        want: type[BaseException] | None = None
        if items and all(item is self.foreign for item in items) and not bare:
            # All of one (the other) map: a valid handle there, with its own references.
            joined = expect(lambda: FutureIndices.cat(arg), None)  # type: ignore[arg-type]
            assert isinstance(joined, FutureIndices)
            assert joined.slots.tolist() == self.foreign.slots.tolist() * len(items)
            self.other.release(joined)
            return
        if bare and items and isinstance(items[0], FutureIndices):
            arg, want = items[0], TypeError  # a handle is not a sequence of handles
        elif not items:
            want = ValueError
        else:
            for item, rec in zip(items, recs, strict=True):
                if not isinstance(item, FutureIndices):
                    want = TypeError
                    break
                if rec is not None and not rec.live:
                    want = ValueError
                    break
            if want is None and any(rec is None for rec in recs):
                want = ValueError  # handles of two maps
        joined = expect(lambda: FutureIndices.cat(arg), want, "cat")  # type: ignore[arg-type]
        if joined is None:
            return
        assert isinstance(joined, FutureIndices)
        slots = [s for rec in recs if rec is not None for s in rec.slots]
        assert joined.slots.tolist() == slots
        self.take(H(joined, slots))

    @precondition(lambda self: self.handles)
    @rule(i=INDEX, kind=st.sampled_from(["own", "own", "own", "foreign", "not-handle"]))
    def release(self, i: int, kind: str) -> None:
        h = self.pick(i)
        target: object = {"own": h.fi, "foreign": self.foreign, "not-handle": h.slots}[kind]
        want = self.handle_rule(target)
        expect(lambda: self.fmap.release(target), want, "release")  # type: ignore[arg-type]
        if want is not None:
            return
        h.live = False
        assert h.fi.released
        for s, c in Counter(h.slots).items():
            self.refs[s] -= c
            assert self.refs[s] >= 0
            if self.refs[s] == 0 and self.debug:
                self.state[s] = FREE
                self.tm[s] = self.poison

    @precondition(lambda self: self.handles)
    @rule(i=INDEX, dtype=st.sampled_from([None, torch.int32, torch.int64, torch.float32]))
    def placeholders(self, i: int, dtype: torch.dtype | None) -> None:
        h = self.pick(i)
        want: type[BaseException] | None = None
        if not h.live or dtype == torch.float32:
            want = ValueError
        ph = expect(lambda: h.fi.placeholders(dtype), want, "placeholders")
        host = expect(h.fi.host_placeholders, None if h.live else ValueError)
        if ph is None:
            return
        assert isinstance(ph, torch.Tensor) and isinstance(host, np.ndarray)
        assert ph.dtype == (dtype or self.dtype) and ph.device == self.fmap.device
        assert ph.tolist() == host.tolist() == [-s for s in h.slots]
        self.phs.append(Ph(ph, h.slots))
        self.phs = self.phs[-8:]

    @rule()
    def check(self) -> None:
        expect(self.fmap.check, FutureError if self.err[0] else None, "check")
        self.err = [0, 0]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "fmap"):
            return
        fmap = self.fmap
        in_use = sum(1 for r in self.refs[1:] if r > 0)
        assert fmap.in_use == in_use and fmap.free == self.cap - in_use
        assert fmap.refcounts[0] == 1 and fmap.refcounts[1:].tolist() == self.refs[1:]
        assert fmap.token_map[1:].tolist() == self.tm[1:]
        assert fmap.token_map[0].item() == 0
        assert fmap.err.tolist() == self.err
        if self.debug:
            assert fmap.slot_states is not None and fmap.slot_states.state[1:].tolist() == self.state[1:]
        for h in self.handles:
            assert h.fi.released == (not h.live)
            if h.live:
                assert all(self.refs[s] > 0 for s in h.slots)
        # The second map only ever saw its own handle.
        assert self.other.in_use == 2 and not self.foreign.released

    def teardown(self) -> None:
        if not hasattr(self, "fmap"):
            return
        for h in self.handles:
            if h.live:
                self.fmap.release(h.fi)
        assert self.fmap.in_use == 0 and self.fmap.free == self.cap


FutureMapMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestFutureMapFuzz = FutureMapMachine.TestCase
