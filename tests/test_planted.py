"""Planted-bug (mutation) tests: one per bug class of DESIGN.md section 2.

Each test switches a deliberate defect on with the private ``plant(...)`` switch and
shows that debug mode and/or the sync-vs-overlap equivalence check catches it, then runs the
same scenario without the defect and shows that it passes (so the test could fail).

======================  ===================  =========================================  ==================
bug class               defect switch        test                                       caught by
======================  ===================  =========================================  ==================
tensor lifetime across  no_input_keepalive   test_tensor_lifetime_no_input_keepalive    equivalence or a
streams                                                                                 raise (1); debug
pinned staging reuse    staging_no_wait      test_pinned_staging_reuse                  equivalence or the
                                                                                        error flag (2)
placeholder leakage     skip_resolve         test_placeholder_leakage_skip_resolve      equivalence; debug
delayed-sample order    late_delayed_sample  test_delayed_sample_ordering               equivalence; debug
ring overrun / early    ignore_refcount      test_ring_overrun_ignore_refcount          debug (3)
release
handle confusion        store_as_interval    test_handle_confusion_store_as_interval,   equivalence; debug
                                             test_handle_confusion_through_the_runtime  (4)
out-of-range            (none) (5)           test_out_of_range_placeholder_in_a_batch,  the error flag at
placeholder                                  test_out_of_range_is_never_read            the next sync
empty batches           (none)               test_empty_handles_are_noops,              no-ops, no error
                                             test_runtime_runs_empty_batches
consume-twice /         (none): a second     test_write_twice_is_caught_by_debug,       debug; the runtime
write-twice             store                test_relaunching_a_batch_is_refused        refuses a relaunch
======================  ===================  =========================================  ==================

1. Plain: the model reads another step's index data (IndexError) or the tokens differ from
   sync. Debug: FutureError "read of slot ... allocated, never written".
2. Another step's tokens overwrite the copy's error words: FutureError at the host sync; or
   the tokens differ from sync. Debug mode adds nothing here: the host buffer is not a slot.
3. Plain: silent corruption (the test asserts the other owner's tokens). Debug: the handle's
   generation check, FutureError "handed out again ... ring overrun".
4. Plain: wrong tokens and a slot the handle does not own written. Debug: the store's
   read-back, FutureError "store did not land".
5. No planted defect: an unchecked read could crash the process. A scheduler plants the bad id;
   FutureError at the next host sync (debug: at once), the bad row is never read, and the map
   is intact afterwards, and a reported flag does not stick (test_debug_flag_does_not_stick).

``ignore_refcount`` is exercised at the FutureMap level: the runtime's own handles never outlive
their consuming launch, so its flow cannot show an early release. ``store_as_interval`` shows
both at the FutureMap level and through the runtime, once a small map wraps and hands out
fragmented fresh handles.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tfuture import FutureError, FutureIndices, FutureMap
from defects import plant
from tfuture.batch import Batch, ForwardBatch
from tfuture.faults import FaultPlan
from tfuture.kernels.resolve import resolve_futures_
from tfuture.kernels.store import store_futures
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, ToyGrammar, ToyModel, first_difference, random_workload

VOCAB = 64
CAPACITY = 32
# The scenario: 10 requests, at most 4 running, a 32-slot map.
SPECS = random_workload(5, 10, vocab=VOCAB, max_new=10)
GRAMMAR_SPECS = random_workload(5, 10, vocab=VOCAB, max_new=10, grammar_share=1.0)
GRAMMAR = ToyGrammar(VOCAB, seed=5)
# Races depend on timing: a defect gets a few tries with growing delays to show itself (a loaded
# machine slows both sides); the defect-free run must pass under the same faults.
RACE_TRIES = ((1, 1.0), (2, 2.5), (3, 6.0))


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tfuture-forward" and t.is_alive()]


@dataclass
class Outcome:
    outputs: dict[int, list[int]] | None
    error: BaseException | None
    in_use: int


def run(
    specs,
    *,
    overlap: bool = True,
    faults: FaultPlan | None = None,
    debug: bool = False,
    grammar: ToyGrammar | None = None,
    defect: str | None = None,
) -> Outcome:
    """One run of ``specs``; an exception is part of the outcome, not a test failure."""
    fmap = FutureMap(CAPACITY, device="cpu", debug=debug)
    sched = ContinuousBatcher(specs, fmap, max_running=4, grammar=grammar)
    runtime = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap, faults=faults)
    try:
        if defect is None:
            runtime.run(sched)
        else:
            with plant(defect):
                runtime.run(sched)
    except Exception as exc:
        return Outcome(None, exc, fmap.in_use)
    return Outcome(sched.outputs, None, fmap.in_use)


def verdict(out: Outcome, ref: dict[int, list[int]]) -> str:
    """How the defect showed: 'raised <type>: ...', 'differs: ...', or '' (not caught)."""
    if out.error is not None:
        return f"raised {type(out.error).__name__}: {out.error}"
    diff = first_difference(ref, out.outputs or {}, ("sync", "overlap"))
    return f"differs: {diff}" if diff else ""


@pytest.fixture(scope="module")
def sync_ref() -> dict[int, list[int]]:
    out = run(SPECS, overlap=False)
    assert out.error is None and out.outputs is not None
    return out.outputs


@pytest.fixture(scope="module")
def grammar_ref() -> dict[int, list[int]]:
    out = run(GRAMMAR_SPECS, overlap=False, grammar=GRAMMAR)
    assert out.error is None and out.outputs is not None
    return out.outputs


def assert_clean(out: Outcome, ref: dict[int, list[int]]) -> None:
    assert out.error is None, f"the defect-free run raised {out.error!r}"
    assert out.outputs == ref, first_difference(ref, out.outputs or {}, ("sync", "overlap"))
    assert out.in_use == 0
    assert not worker_threads()


# ---------------------------------------------------------------------------------------------
# Runtime-level defects


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_tensor_lifetime_no_input_keepalive(sync_ref, debug):
    def plan(seed: int, scale: float) -> FaultPlan:
        # Delays before the forward stream's copy of the step's index data: the host races ahead.
        return FaultPlan(seed=seed, max_delay_s=2e-3 * scale, delay_ops=("prepare",))

    assert_clean(run(SPECS, faults=plan(*RACE_TRIES[0]), debug=debug), sync_ref)
    seen = []
    for seed, scale in RACE_TRIES:
        out = run(SPECS, faults=plan(seed, scale), debug=debug, defect="no_input_keepalive")
        seen.append(verdict(out, sync_ref))
        if seen[-1]:
            break
    assert seen[-1], f"defect not caught in {len(RACE_TRIES)} tries"
    if debug:
        # Debug mode names the slot read before its store landed.
        assert isinstance(out.error, FutureError), seen
        assert "debug: read of slot" in str(out.error)
    else:
        # The model read another step's indices: an index error, a flagged placeholder, or wrong tokens.
        assert out.error is None or isinstance(out.error, IndexError | FutureError | ValueError), seen
    assert not worker_threads()


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_pinned_staging_reuse(sync_ref, debug):
    def plan(seed: int, scale: float) -> FaultPlan:
        # Host delays before each wait let the next copy land in the one shared buffer first.
        return FaultPlan(seed=seed, host_delay_s=40e-3 * scale)

    assert_clean(run(SPECS, faults=plan(*RACE_TRIES[0]), debug=debug), sync_ref)
    seen = []
    for seed, scale in RACE_TRIES:
        out = run(SPECS, faults=plan(seed, scale), debug=debug, defect="staging_no_wait")
        seen.append(verdict(out, sync_ref))
        if seen[-1]:
            break
    assert seen[-1], f"defect not caught in {len(RACE_TRIES)} tries"
    if out.error is not None:
        # Another step's tokens landed on the copy's error words: read as a flagged placeholder.
        assert isinstance(out.error, FutureError), seen
        assert "pointed outside the FutureMap" in str(out.error)
    else:
        assert seen[-1].startswith("differs: request"), seen
    assert not worker_threads()


def test_placeholder_leakage_skip_resolve(sync_ref):
    assert_clean(run(SPECS), sync_ref)
    assert_clean(run(SPECS, debug=True), sync_ref)

    plain = run(SPECS, defect="skip_resolve")
    assert plain.error is None, plain.error
    assert verdict(plain, sync_ref).startswith("differs: request")
    # Leaked placeholders do not break the slot accounting: the failure is in the values only.
    assert plain.in_use == 0

    debug = run(SPECS, debug=True, defect="skip_resolve")
    assert isinstance(debug.error, FutureError)
    assert "negative id(s) survived resolve" in str(debug.error)
    assert debug.in_use == 0 and not worker_threads()


def test_delayed_sample_ordering(grammar_ref):
    assert_clean(run(GRAMMAR_SPECS, grammar=GRAMMAR), grammar_ref)
    assert_clean(run(GRAMMAR_SPECS, grammar=GRAMMAR, debug=True), grammar_ref)

    plain = run(GRAMMAR_SPECS, grammar=GRAMMAR, defect="late_delayed_sample")
    assert plain.error is None, plain.error
    assert verdict(plain, grammar_ref).startswith("differs: request")

    debug = run(GRAMMAR_SPECS, grammar=GRAMMAR, debug=True, defect="late_delayed_sample")
    assert isinstance(debug.error, FutureError)
    # The next step's resolve read a slot whose (late) store had not run yet.
    assert "debug: read of slot" in str(debug.error) and "allocated, never written" in str(debug.error)
    assert debug.in_use == 0 and not worker_threads()


# ---------------------------------------------------------------------------------------------
# Ring overrun / early release: FutureMap level


def _overrun_scene(debug: bool, defect: bool) -> tuple[FutureMap, FutureIndices, FutureIndices]:
    """A 6-slot map: ``keep`` (rows 1 and 3 of ``a``) must outlive ``a``'s release."""
    fmap = FutureMap(6, device="cpu", debug=debug)
    a = fmap.alloc(4)
    fmap.store(a, torch.tensor([10, 11, 12, 13]))
    keep = a.filter([1, 3])  # slots 2 and 4: a pending read of the next step
    if defect:
        with plant("ignore_refcount"):
            fmap.release(a)
    else:
        fmap.release(a)
    b = fmap.alloc(4)  # wraps round the ring
    fmap.store(b, torch.tensor([20, 21, 22, 23]))
    return fmap, keep, b


def test_ring_overrun_ignore_refcount():
    # Without the defect the kept slots stay owned: the wrapping alloc goes round them.
    fmap, keep, b = _overrun_scene(debug=False, defect=False)
    assert set(b.slots.tolist()).isdisjoint(keep.slots.tolist())
    assert fmap.resolve(keep.placeholders()).tolist() == [11, 13]
    dmap, dkeep, _ = _overrun_scene(debug=True, defect=False)
    assert dmap.resolve(dkeep.placeholders()).tolist() == [11, 13]

    # With it the kept slots are handed out again and overwritten: silent corruption.
    fmap, keep, b = _overrun_scene(debug=False, defect=True)
    assert set(keep.slots.tolist()) <= set(b.slots.tolist())
    assert fmap.resolve(keep.placeholders()).tolist() == [21, 23]  # another owner's tokens, no error
    fmap.check()  # nothing flagged either: only debug mode can see this

    dmap, dkeep, _ = _overrun_scene(debug=True, defect=True)
    with pytest.raises(FutureError, match=r"handed out again while the handle still names it.*ring overrun"):
        dkeep.placeholders()
    with pytest.raises(FutureError, match=r"handed out again"):
        dmap.release(dkeep)


# ---------------------------------------------------------------------------------------------
# Handle confusion: FutureMap level


def _confused(kind: str, fmap: FutureMap) -> tuple[FutureIndices, list[int]]:
    """A non-contiguous handle over fresh slots, and the slots it does not name."""
    if kind == "filter":
        fresh = fmap.alloc(4)  # slots 1..4
        sub = fresh.filter([0, 2])  # slots 1 and 3
    else:
        a, b = fmap.alloc(2), fmap.alloc(2)  # slots 1, 2 and 3, 4
        sub = FutureIndices.cat([b, a.filter([0])])  # slots 3, 4, 1
    others = sorted(set(range(1, fmap.capacity + 1)) - set(sub.slots.tolist()))
    return sub, others


@pytest.mark.parametrize("kind", ["filter", "cat"])
def test_handle_confusion_store_as_interval(kind):
    def scene(debug: bool, defect: bool):
        fmap = FutureMap(8, device="cpu", debug=debug)
        sub, others = _confused(kind, fmap)
        tokens = torch.arange(100, 100 + len(sub))
        if defect:
            with plant("store_as_interval"):
                fmap.store(sub, tokens)
        else:
            fmap.store(sub, tokens)
        return fmap, sub, others, tokens.tolist()

    fmap, sub, others, want = scene(debug=False, defect=False)
    assert fmap.resolve(sub.placeholders()).tolist() == want
    assert fmap.token_map[others].eq(0).all()  # no other slot was touched
    scene(debug=True, defect=False)  # the read-back passes

    fmap, sub, others, want = scene(debug=False, defect=True)
    got = fmap.resolve(sub.placeholders()).tolist()
    assert got != want  # silently wrong tokens for the handle's own slots...
    assert fmap.token_map[others].ne(0).any()  # ...and a slot it does not own was written
    with pytest.raises(FutureError, match=r"store did not land in slot"):
        scene(debug=True, defect=True)


def test_handle_confusion_through_the_runtime(sync_ref):
    """An 8-slot map wraps while steps are in flight: the runtime's fresh ``out`` handles are then
    fragmented (no single interval), and the defect's interval store writes the wrong slots."""

    def go(debug: bool, defect: bool):
        fmap = FutureMap(8, device="cpu", debug=debug)
        sched = ContinuousBatcher(SPECS, fmap, max_running=4)
        runtime = OverlapRuntime(ToyModel(vocab=VOCAB), fmap)
        try:
            if defect:
                with plant("store_as_interval"):
                    runtime.run(sched)
            else:
                runtime.run(sched)
        except FutureError as exc:
            return exc
        assert fmap.in_use == 0
        return sched.outputs

    assert go(debug=False, defect=False) == sync_ref
    assert go(debug=True, defect=False) == sync_ref
    plain = go(debug=False, defect=True)
    assert isinstance(plain, dict) and first_difference(sync_ref, plain, ("sync", "overlap"))
    debug = go(debug=True, defect=True)
    assert isinstance(debug, FutureError) and "store did not land" in str(debug)
    assert not worker_threads()


# ---------------------------------------------------------------------------------------------
# Out-of-range placeholder: no planted defect (an unchecked read could crash the process)


class _Recording(ToyModel):
    """A toy model that keeps every step's resolved input ids."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB)
        self.inputs: dict[int, list[int]] = {}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.inputs[batch.step] = batch.input_ids.tolist()
        return super().forward(batch)


class _BadPlaceholder(ContinuousBatcher):
    """Plants ``bad`` as the first token of the ``at``-th batch; records processed steps."""

    def __init__(self, *args, at: int, bad: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.at, self.bad, self.built, self.processed = at, bad, 0, []

    def _build(self, rows):
        batch = super()._build(rows)
        if self.built == self.at:
            batch.tokens[0] = self.bad
        self.built += 1
        return batch

    def process(self, result) -> None:
        self.processed.append(result.step)
        super().process(result)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("bad", [-(CAPACITY + 1), -(2**62), -(2**63)], ids=["past-end", "far", "int64-min"])
def test_out_of_range_placeholder_in_a_batch(sync_ref, overlap, debug, bad):
    at = 3
    fmap = FutureMap(CAPACITY, device="cpu", debug=debug)
    model = _Recording()
    sched = _BadPlaceholder(SPECS, fmap, max_running=4, at=at, bad=bad)
    with pytest.raises(FutureError, match=rf"1 placeholder\(s\) pointed outside .*most negative: {bad}\)"):
        OverlapRuntime(model, fmap, overlap=overlap).run(sched)
    # No negative id ever reached the model: the bad row was never read (it is 0 if it ran).
    assert all(min(ids) >= 0 for ids in model.inputs.values())
    if debug:
        assert at not in model.inputs  # raised at once in the step's resolve, before its forward
    else:
        assert model.inputs[at][0] == 0  # flagged, read as token 0, raised at the step's sync
    assert all(step < at for step in sched.processed)
    if not debug:
        assert max(sched.processed) == at - 1  # it surfaced at the sync of the bad step itself
    assert fmap.in_use == 0 and not worker_threads()
    # The map is not corrupted (and a reported flag does not stick): the next run on it is exact.
    sched = ContinuousBatcher(SPECS, fmap, max_running=4)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(sched)
    assert sched.outputs == sync_ref and fmap.in_use == 0


def test_debug_flag_does_not_stick(sync_ref):
    fmap = FutureMap(CAPACITY, device="cpu", debug=True)
    with pytest.raises(FutureError, match=r"pointed outside"):
        fmap.resolve(torch.tensor([-(CAPACITY + 1)]))
    assert fmap.resolve(torch.tensor([5, 6])).tolist() == [5, 6]
    sched = ContinuousBatcher(SPECS, fmap, max_running=4)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    assert sched.outputs == sync_ref and fmap.in_use == 0


def test_out_of_range_is_never_read():
    # token_map is a view into a larger buffer whose tail holds a sentinel: an unchecked read or
    # write past the map would see or change it.
    cap, sentinel = 8, 777
    buf = torch.full((cap + 1 + 8,), sentinel, dtype=torch.int64)
    token_map = buf[: cap + 1]
    token_map.copy_(torch.arange(cap + 1) * 10)
    err = torch.zeros(2, dtype=torch.int64)
    ids = torch.tensor([-(cap + 1), -3, -(cap + 5), 5, -(2**63), -(2**40)])
    resolve_futures_(ids, token_map, err=err)
    assert ids.tolist() == [0, 30, 0, 5, 0, 0]
    assert err.tolist() == [4, -(2**63)]
    store_futures(token_map, torch.tensor([cap + 1, 2, cap + 7, 0]), torch.tensor([1, 2, 3, 4]), err=err)
    assert buf[cap + 1 :].eq(sentinel).all()
    assert token_map.tolist() == [0, 10, 2, 30, 40, 50, 60, 70, 80]  # slot 0 is never a target
    assert err[0].item() == 7


# ---------------------------------------------------------------------------------------------
# Empty batches: an idle rank with zero requests


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_empty_handles_are_noops(debug, dtype):
    fmap = FutureMap(4, device="cpu", dtype=dtype, debug=debug)
    live = fmap.alloc(2)
    fmap.store(live, torch.tensor([7, 8], dtype=dtype))
    before = fmap.token_map.clone()
    e = fmap.alloc(0)
    assert len(e) == 0 and fmap.in_use == 2
    assert e.placeholders().numel() == 0 and e.host_placeholders().size == 0
    fmap.store(e, torch.zeros(0, dtype=dtype))
    fmap.store(e, torch.zeros(0, dtype=torch.int64 if dtype == torch.int32 else torch.int32))
    empties = [
        e.filter([]),
        e.filter(np.zeros(0, dtype=bool)),
        e.filter(torch.zeros(0, dtype=torch.int64)),
        live.filter([False, False]),
        FutureIndices.cat([e, e]),
    ]
    assert all(len(h) == 0 for h in empties)
    both = FutureIndices.cat([e, live, e])
    assert both.slots.tolist() == live.slots.tolist()
    empty_ids = torch.zeros(0, dtype=dtype)
    assert fmap.resolve(empty_ids) is empty_ids and empty_ids.numel() == 0
    res = fmap.prepare_inputs(empty_ids, torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert all(t.numel() == 0 for t in res)
    for h in [e, *empties]:
        fmap.store(h, torch.zeros(0, dtype=dtype))
        fmap.release(h)
    assert fmap.in_use == 2 and torch.equal(fmap.token_map, before)
    fmap.check()
    fmap.release(both)
    fmap.release(live)
    assert fmap.in_use == 0


class _Idle:
    """An idle rank: schedules ``n`` empty batches, then stops."""

    def __init__(self, n: int) -> None:
        self.left, self.results = n, []

    def schedule(self):
        if self.left == 0:
            return None
        self.left -= 1
        e = np.zeros(0, dtype=np.int64)
        return Batch(e, e, e, e, np.zeros(0, dtype=bool))

    def process(self, result) -> None:
        self.results.append(result.tokens.size)

    def build_mask(self, batch):
        return None


class _WithIdleSteps(ContinuousBatcher):
    """Every third step is an empty batch (nothing to run on this rank this time)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls = self.empty = 0

    def schedule(self):
        self.calls += 1
        if self.calls % 3 == 0 and not self.idle:
            self.empty += 1
            e = np.zeros(0, dtype=np.int64)
            return Batch(e, e, e, e, np.zeros(0, dtype=bool), tag=[])
        return super().schedule()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_runtime_runs_empty_batches(sync_ref, grammar_ref, overlap, debug):
    fmap = FutureMap(4, device="cpu", debug=debug)
    idle = _Idle(5)
    stats = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(idle)
    assert stats.steps == 5 and idle.results == [0] * 5 and fmap.in_use == 0

    for specs, grammar, ref in ((SPECS, None, sync_ref), (GRAMMAR_SPECS, GRAMMAR, grammar_ref)):
        fmap = FutureMap(CAPACITY, device="cpu", debug=debug)
        sched = _WithIdleSteps(specs, fmap, max_running=4, grammar=grammar)
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(sched)
        assert sched.empty > 0
        assert sched.outputs == ref, first_difference(ref, sched.outputs, ("sync", "with idle steps"))
        assert fmap.in_use == 0 and not worker_threads()


# ---------------------------------------------------------------------------------------------
# Consume-twice / write-twice


def test_write_twice_is_caught_by_debug():
    # Without the bug: write once, read twice (two consumers of one value), release.
    for debug in (False, True):
        fmap = FutureMap(8, device="cpu", debug=debug)
        a = fmap.alloc(3)
        fmap.store(a, torch.tensor([5, 6, 7]))
        assert fmap.resolve(a.placeholders()).tolist() == [5, 6, 7]
        assert fmap.resolve(a.filter([2, 0]).placeholders()).tolist() == [7, 5]
        fmap.release(a)

    # The bug without debug: a second store silently replaces a value before it was read.
    fmap = FutureMap(8, device="cpu")
    a = fmap.alloc(3)
    fmap.store(a, torch.tensor([5, 6, 7]))
    fmap.store(a.filter([1]), torch.tensor([66]))
    assert fmap.resolve(a.placeholders()).tolist() == [5, 66, 7]

    # Debug mode: the second store is refused before it writes (W W), also after a read (W R W).
    dmap = FutureMap(8, device="cpu", debug=True)
    a = dmap.alloc(3)
    dmap.store(a, torch.tensor([5, 6, 7]))
    with pytest.raises(FutureError, match=r"store of slot 2 which is written"):
        dmap.store(a.filter([1]), torch.tensor([66]))
    assert dmap.resolve(a.placeholders()).tolist() == [5, 6, 7]
    with pytest.raises(FutureError, match=r"store of slot 1 which is read"):
        dmap.store(a, torch.tensor([8, 9, 10]))
    assert dmap.resolve(a.placeholders()).tolist() == [5, 6, 7]
    # A handle naming one slot twice can never write it twice, debug or not.
    for m in (fmap, dmap):
        dup = m.alloc(1)
        with pytest.raises(ValueError, match=r"distinct slots"):
            m.store(FutureIndices.cat([dup, dup]), torch.tensor([1, 2]))


def test_relaunching_a_batch_is_refused():
    """A batch launched twice would store twice into its ``out`` slots: the runtime refuses it."""

    class Again(ContinuousBatcher):
        again: Batch | None = None

        def schedule(self):
            if self.again is not None:
                batch, self.again = self.again, None
                return batch
            batch = super().schedule()
            if batch is not None and self.tick == 3:
                self.again = batch
            return batch

    for overlap in (True, False):
        fmap = FutureMap(CAPACITY, device="cpu", debug=True)
        sched = Again(SPECS, fmap, max_running=4)
        with pytest.raises(ValueError, match=r"already launched"):
            OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(sched)
        assert fmap.in_use == 0 and not worker_threads()
