"""The FaultPlan through the runtime on the CPU backend.

* Random delays on the forward stream, random host delays and a forced ``gc.collect()`` after
  every step keep overlap and sync token-for-token equivalent.
* An :class:`InjectedFault` raised at any stream op or host hook, overlapped or in sync,
  surfaces from ``run()`` with its original traceback, and the loop stops cleanly: no slot
  left in use, no forward-stream thread left alive, and the map works for the next run.
* Bad plans are refused with ``ValueError``.
"""

from __future__ import annotations

import gc
import traceback

import pytest
from support import worker_threads

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, ToyGrammar, ToyModel, first_difference, random_workload
from tfuture.testing.faults import HOST_POINTS, TOKEN_POINTS, FaultPlan, InjectedFault

VOCAB = 64


def run(
    specs, grammar, *, overlap: bool, faults: FaultPlan | None = None, fmap: FutureMap | None = None, **kw
):
    capacity = kw.pop("capacity", 32)
    fmap = fmap if fmap is not None else FutureMap(capacity, device="cpu")
    sched = ContinuousBatcher(specs, fmap, grammar=grammar, **kw)
    stats = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap, faults=faults).run(sched)
    return sched, stats, fmap


@pytest.fixture
def frozen_gc():
    """Move the objects alive now out of the collector's sight, so that a gc each step costs
    microseconds, not 0.1 s; everything the run creates and drops is still collected."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("seed", [11, 12, 13], ids=lambda s: f"workload{s}")
def test_delays_and_gc_keep_overlap_equal_to_sync(seed, frozen_gc):
    specs = random_workload(seed, 10, vocab=VOCAB, max_new=10, max_prompt=20, grammar_share=0.5)
    grammar = ToyGrammar(VOCAB, seed=seed)
    kw = dict(max_running=4, chunk=6, token_budget=16, capacity=16)
    ref, _, _ = run(specs, grammar, overlap=False, **kw)
    for overlap in (True, False):
        plan = FaultPlan(seed=seed, max_delay_s=1e-3, host_delay_s=1e-3, gc_every_step=True)
        sched, stats, fmap = run(specs, grammar, overlap=overlap, faults=plan, **kw)
        assert sched.outputs == ref.outputs, first_difference(ref.outputs, sched.outputs, ("sync", "faulty"))
        assert fmap.in_use == 0 and not worker_threads()
        # Every wait (at least one per step) came after a host delay, every stream op was delayed.
        assert plan.injected["host_delay"] >= stats.steps
        assert plan.injected["stream_delay"] >= len(TOKEN_POINTS) * stats.steps
        assert not any(k.startswith("raise_") for k in plan.injected)
    assert sum(len(v) for v in ref.outputs.values()) > 0


def test_delays_on_selected_ops_only():
    specs = random_workload(14, 6, vocab=VOCAB, max_new=6)
    ref, _, _ = run(specs, None, overlap=False)
    plan = FaultPlan(seed=14, max_delay_s=1e-3, delay_ops=("forward",))
    sched, stats, _ = run(specs, None, overlap=True, faults=plan)
    assert sched.outputs == ref.outputs
    assert plan.injected["stream_delay"] == stats.steps  # one forward per step, nothing else
    assert "host_delay" not in plan.injected


def test_delays_are_reproducible_per_seed():
    a, b, c = (FaultPlan(seed=s, max_delay_s=1.0, host_delay_s=1.0) for s in (5, 5, 6))
    seq = [[p.delay("forward"), p.delay("copy"), p.host_delay()] for p in (a, b, c)]
    assert seq[0] == seq[1] != seq[2]
    assert all(0.0 <= x < 1.0 for x in seq[0])
    assert FaultPlan(seed=5).delay("forward") == 0.0 and FaultPlan(seed=5).host_delay() == 0.0


AT = 3  # the step whose point raises
FAULT_GRAMMAR = ToyGrammar(VOCAB, seed=21)
FAULT_SPECS = {share: random_workload(21, 8, vocab=VOCAB, max_new=8, grammar_share=share) for share in (0, 1)}


@pytest.fixture(scope="module")
def fault_refs() -> dict[int, dict[int, list[int]]]:
    """The sync outputs of each fault workload, computed once for every point and mode."""
    return {
        share: run(specs, FAULT_GRAMMAR, overlap=False, max_running=4)[0].outputs
        for share, specs in FAULT_SPECS.items()
    }


# Every point on a workload without and with grammar requests; build_mask runs only for the
# delayed steps of grammar requests.
FAULT_CASES = [
    pytest.param(point, share, id=f"{point}-{'grammar' if share else 'plain'}")
    for point in TOKEN_POINTS + HOST_POINTS
    for share in (0, 1)
    if share or point != "build_mask"
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize(("point", "grammar_share"), FAULT_CASES)
def test_injected_fault_surfaces_and_loop_stops_cleanly(point, grammar_share, overlap, fault_refs):
    specs, grammar = FAULT_SPECS[grammar_share], FAULT_GRAMMAR
    plan = FaultPlan(seed=21, max_delay_s=5e-4, raise_at={point: AT})
    fmap = FutureMap(32, device="cpu")
    with pytest.raises(InjectedFault, match=rf"injected fault at {point} of step {AT}") as info:
        run(specs, grammar, overlap=overlap, faults=plan, fmap=fmap, max_running=4)
    assert plan.injected[f"raise_{point}"] == 1
    assert plan.injected["stream_delay"] > 0
    # The original traceback: it ends in the plan's check, called from the runtime.
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "check" and frames[-1].filename.endswith("faults.py")
    notes = getattr(info.value, "__notes__", [])
    if point in TOKEN_POINTS:
        assert any(f"on the forward stream in '{point}' of step {AT}" in n for n in notes), notes
    # The loop stopped cleanly.
    assert fmap.in_use == 0 and fmap.free == fmap.capacity
    assert not worker_threads()
    fmap.check()
    # And the map is intact: the same workload now runs to the sync result on it.
    again, _, _ = run(specs, grammar, overlap=overlap, fmap=fmap, max_running=4)
    assert again.outputs == fault_refs[grammar_share] and fmap.in_use == 0


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_injected_fault_with_a_debug_map(debug):
    specs = random_workload(22, 8, vocab=VOCAB, max_new=8, grammar_share=0.5)
    fmap = FutureMap(16, device="cpu", debug=debug)
    plan = FaultPlan(seed=22, max_delay_s=5e-4, gc_every_step=True, raise_at={"store": 2})
    with pytest.raises(InjectedFault):
        run(specs, ToyGrammar(VOCAB, seed=22), overlap=True, faults=plan, fmap=fmap, max_running=4)
    assert fmap.in_use == 0 and not worker_threads()


def test_fault_past_the_last_step_never_fires():
    specs = random_workload(23, 3, vocab=VOCAB, max_new=3)
    plan = FaultPlan(seed=23, raise_at={"forward": 10_000, "process": 10_000})
    sched, stats, _ = run(specs, None, overlap=True, faults=plan)
    assert stats.steps < 10_000 and set(sched.outputs) == {0, 1, 2}
    assert not any(k.startswith("raise_") for k in plan.injected)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(raise_at={"forwrd": 1}), r"raise_at points must be among .*'forwrd'"),
        (dict(raise_at={"wait": 1, "prepare": 2}), r"\['wait'\]"),
        (dict(raise_at={"verify": 1}), r"\['verify'\]"),  # a speculative op: not a token step's
        (dict(max_delay_s=1e-3, delay_ops=("forwrd",)), r"delay_ops .*forwrd"),
    ],
    ids=["unknown-point", "one-unknown", "other-kind", "unknown-delay-op"],
)
def test_plan_naming_an_op_the_runtime_never_runs_is_refused(kw, match):
    """Op names are checked against the step kind's own ops when a runtime binds the plan."""
    plan = FaultPlan(**kw)
    with pytest.raises(ValueError, match=match):
        OverlapRuntime(ToyModel(vocab=VOCAB), FutureMap(8), faults=plan)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_delay_s=-1e-3), r"max_delay_s must be a finite number >= 0"),
        (dict(host_delay_s=-1.0), r"host_delay_s must be a finite number >= 0"),
    ],
    ids=["negative-stream-delay", "negative-host-delay"],
)
def test_bad_plan_raises_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        FaultPlan(**kw)


def test_plan_targets_every_kind_of_op():
    """A plan may name any op of its runtime's step kind: the parallel step's included."""
    from tfuture.distributed import ParallelStep
    from tfuture.runtime import HOST_HOOKS

    FaultPlan(raise_at={"recv_tokens": 3, "send_hidden": 1}).bind(ParallelStep.stream_ops, HOST_HOOKS)
    with pytest.raises(ValueError, match="recv_tokens"):
        FaultPlan(raise_at={"recv_tokens": 3}).bind(
            OverlapRuntime(ToyModel(), FutureMap(8)).kind.stream_ops, HOST_HOOKS
        )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-3])
def test_non_finite_or_negative_delay_is_refused(bad):
    with pytest.raises(ValueError, match="finite number >= 0"):
        FaultPlan(max_delay_s=bad)
    with pytest.raises(ValueError, match="finite number >= 0"):
        FaultPlan(host_delay_s=bad)


@pytest.mark.parametrize("step", [-1, 1.5, "3", True])
def test_bad_raise_at_step_is_refused(step):
    with pytest.raises(ValueError, match="step number >= 0"):
        FaultPlan(raise_at={"forward": step})
