"""Planted defects (mutation tests): one test per bug class of overlap schedulers (README.md,
"Fault injection and the soak").

Each test plants a deliberate defect (``tests/defects.py``, patched in for one run) and shows
that debug mode and/or the sync-vs-overlap equivalence check catches it, and that the same
scenario passes without the defect (so the test could fail).

======================  ===================  =====================================  ==================
bug class               planted defect       test                                   caught by
======================  ===================  =====================================  ==================
tensor lifetime across  no_input_keepalive   test_tensor_lifetime_across_streams    equivalence or a
streams                                                                             raise (1); debug
pinned staging reuse    staging_no_wait      test_pinned_staging_reuse              equivalence or the
                                                                                    error flag (2)
placeholder leakage     skip_resolve         test_placeholder_leakage               equivalence; debug
delayed-sample order    late_delayed_sample  test_delayed_sample_ordering           equivalence; debug
ring overrun / early    ignore_refcount      test_ring_overrun                      debug (3)
release
handle confusion        store_as_interval    test_handle_confusion                  equivalence; debug
                                                                                    (4)
======================  ===================  =====================================  ==================

1. Plain: the model reads another step's index data (IndexError) or the tokens differ from
   sync. Debug: FutureError "read of slot ... allocated, never written".
2. Another step's tokens overwrite the copy's error words: FutureError at the host sync; or
   the tokens differ from sync. Debug mode adds nothing here: the host buffer is not a slot.
3. Plain: silent corruption (the test asserts the other owner's tokens). Debug: the handle's
   generation check, FutureError "handed out again ... ring overrun".
4. Plain: wrong tokens and a slot the handle does not own written. Debug: the store's
   read-back, FutureError "store did not land".

``ignore_refcount`` is exercised at the FutureMap level: the runtime's own handles never outlive
their consuming launch, so its flow cannot show an early release. ``store_as_interval`` shows
both at the FutureMap level and through the runtime, once a small map wraps and hands out
fragmented fresh handles. Bug classes with nothing to plant are in ``test_guards.py``.
"""

from __future__ import annotations

import pytest
import torch
from defects import plant
from scenario import GRAMMAR, GRAMMAR_SPECS, SPECS, VOCAB, assert_clean, run, verdict
from support import worker_threads

from tfuture import FutureError, FutureIndices, FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, ToyModel, first_difference
from tfuture.testing.faults import FaultPlan

# Races depend on timing: a defect gets a few tries with growing delays to show itself (a loaded
# machine slows both sides); the defect-free run must pass under the same faults.
RACE_TRIES = ((1, 1.0), (2, 2.5), (3, 6.0))


def _race(defect: str, plan, debug: bool, ref: dict[int, list[int]]):
    """Run the scenario with ``defect`` under ``plan(seed, scale)`` until it shows; the last
    outcome and every verdict so far."""
    seen = []
    for seed, scale in RACE_TRIES:
        out = run(SPECS, faults=plan(seed, scale), debug=debug, defect=defect)
        seen.append(verdict(out, ref))
        if seen[-1]:
            break
    assert seen[-1], f"{defect} not caught in {len(RACE_TRIES)} tries"
    return out, seen


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_tensor_lifetime_across_streams(sync_ref, debug):
    def plan(seed: int, scale: float) -> FaultPlan:
        # Delays before the forward stream's copy of the step's index data: the host races ahead.
        return FaultPlan(seed=seed, max_delay_s=2e-3 * scale, delay_ops=("prepare",))

    assert_clean(run(SPECS, faults=plan(*RACE_TRIES[0]), debug=debug), sync_ref)
    out, seen = _race("no_input_keepalive", plan, debug, sync_ref)
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
    out, seen = _race("staging_no_wait", plan, debug, sync_ref)
    if out.error is not None:
        # Another step's tokens landed on the copy's error words: read as a flagged placeholder.
        assert isinstance(out.error, FutureError), seen
        assert "pointed outside the FutureMap" in str(out.error)
    else:
        assert seen[-1].startswith("differs: request"), seen
    assert not worker_threads()


def test_placeholder_leakage(sync_ref):
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


def _overrun_scene(debug: bool, defect: bool) -> tuple[FutureMap, FutureIndices, FutureIndices]:
    """A 6-slot map: ``keep`` (rows 1 and 3 of ``a``) must outlive ``a``'s release."""
    fmap = FutureMap(6, device="cpu", debug=debug)
    a = fmap.alloc(4)
    fmap.store(a, torch.tensor([10, 11, 12, 13]))
    keep = a.filter([1, 3])  # slots 2 and 4: a pending read of the next step
    with plant(*(["ignore_refcount"] if defect else [])):
        fmap.release(a)
    b = fmap.alloc(4)  # wraps round the ring
    fmap.store(b, torch.tensor([20, 21, 22, 23]))
    return fmap, keep, b


def test_ring_overrun():
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


def _confused_handle(kind: str, fmap: FutureMap) -> FutureIndices:
    """A non-contiguous handle over fresh slots of ``fmap``."""
    if kind == "filter":
        fresh = fmap.alloc(4)  # slots 1..4
        return fresh.filter([0, 2])  # slots 1 and 3
    a, b = fmap.alloc(2), fmap.alloc(2)  # slots 1, 2 and 3, 4
    return FutureIndices.cat([b, a.filter([0])])  # slots 3, 4, 1


def _confusion_at_the_map(kind: str, debug: bool, defect: bool) -> str:
    """Store through a filtered or joined handle; '' if it wrote exactly its own slots."""
    fmap = FutureMap(8, device="cpu", debug=debug)
    sub = _confused_handle(kind, fmap)
    others = sorted(set(range(1, fmap.capacity + 1)) - set(sub.slots.tolist()))
    tokens = torch.arange(100, 100 + len(sub))
    try:
        with plant(*(["store_as_interval"] if defect else [])):
            fmap.store(sub, tokens)
    except FutureError as exc:
        return f"raised FutureError: {exc}"
    wrong = []
    if fmap.resolve(sub.placeholders()).tolist() != tokens.tolist():
        wrong.append("wrong tokens in its own slots")
    if fmap.token_map[others].ne(0).any():
        wrong.append("a slot it does not own written")
    return "differs: " + ", ".join(wrong) if wrong else ""


def _confusion_through_the_runtime(debug: bool, defect: bool, ref: dict[int, list[int]]) -> str:
    """An 8-slot map wraps while steps are in flight: the runtime's fresh ``out`` handles are then
    fragmented (no single interval); '' if the run gave ``ref``'s tokens."""
    fmap = FutureMap(8, device="cpu", debug=debug)
    sched = ContinuousBatcher(SPECS, fmap, max_running=4)
    try:
        with plant(*(["store_as_interval"] if defect else [])):
            OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    except FutureError as exc:
        return f"raised FutureError: {exc}"
    assert fmap.in_use == 0 and not worker_threads()
    diff = first_difference(ref, sched.outputs, ("sync", "overlap"))
    return f"differs: {diff}" if diff else ""


@pytest.mark.parametrize("where", ["filter", "cat", "runtime"], ids=["map-filter", "map-cat", "runtime"])
def test_handle_confusion(sync_ref, where):
    def scenario(debug: bool, defect: bool) -> str:
        if where == "runtime":
            return _confusion_through_the_runtime(debug, defect, sync_ref)
        return _confusion_at_the_map(where, debug, defect)

    assert scenario(debug=False, defect=False) == ""
    assert scenario(debug=True, defect=False) == ""  # the read-back passes
    plain = scenario(debug=False, defect=True)
    if where == "runtime":
        assert plain.startswith("differs: request"), plain
    else:
        # Silently wrong tokens for the handle's own slots, and a slot it does not own written.
        assert plain == "differs: wrong tokens in its own slots, a slot it does not own written"
    debug = scenario(debug=True, defect=True)
    assert debug.startswith("raised FutureError") and "store did not land in slot" in debug, debug
    assert not worker_threads()
