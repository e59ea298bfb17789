"""Speculative decoding in the runtime loop, fast: :class:`tfuture.spec.SpecTokenStep` over the toy
target (:class:`tfuture.testing.ToyModel`, no Hugging Face model) with the seeded fallible
:class:`tfuture.testing.toy_drafter.ToyDrafter`.

Equivalence: with greedy acceptance, overlapped speculative decoding (step N+1 launched before
the host knows step N's accepted counts, which stay in step N's ``seq_len`` slot field on the
device) commits exactly plain greedy decoding's tokens for every request, under random stream
delays, host delays and a ``gc.collect()`` per step, and hands every slot back. A fault planted at
each of the step's points surfaces by name and leaks nothing. The Hugging Face versions of these
checks, with the real drafters, are in ``tests/spec/``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec import DraftResult, SpecTokenStep
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyModel, random_workload
from tfuture.testing.faults import SPEC_POINTS, FaultPlan, InjectedFault, random_delay
from tfuture.testing.toy_drafter import ToyDrafter

VOCAB = 64


def plain(specs: list[RequestSpec], eos: int = -1) -> dict[int, list[int]]:
    """Plain greedy decoding of the toy target, request by request on the host."""
    return ToyModel(vocab=VOCAB).references(specs, eos)


def spec_run(
    specs: list[RequestSpec],
    *,
    k: int = 2,
    error_rate: float = 0.3,
    seed: int = 0,
    overlap: bool = True,
    max_running: int = 4,
    capacity: int = 64,
    model: ToyModel | None = None,
    sched_type: type[ContinuousBatcher] = ContinuousBatcher,
    **runtime_kw: Any,
) -> tuple[ContinuousBatcher, FutureMap, Any]:
    fmap = FutureMap(capacity, device="cpu")
    target = ToyModel(vocab=VOCAB) if model is None else model
    drafter = ToyDrafter(ToyModel(vocab=VOCAB), k=k, error_rate=error_rate, seed=seed)
    drafter.bind(max_running, 128, fmap.device)
    sched = sched_type(specs, fmap, eos=-1, max_running=max_running, speculative=k)
    step = SpecTokenStep(target, drafter, Sampler())
    stats = OverlapRuntime(step, fmap, overlap=overlap, **runtime_kw).run(sched)
    return sched, fmap, stats


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"workload{s}")
def test_speculative_decoding_equals_plain_greedy_under_delays(seed: int, overlap: bool) -> None:
    rng = np.random.default_rng(seed)
    specs = random_workload(seed, 8, vocab=VOCAB, max_prompt=10, max_new=20, arrival_span=6)
    k, err = int(rng.integers(1, 5)), float(rng.uniform(0.1, 0.6))
    sched, fmap, _ = spec_run(
        specs,
        k=k,
        error_rate=err,
        seed=seed,
        overlap=overlap,
        max_running=int(rng.integers(2, 7)),
        delay=random_delay(seed),
    )
    assert sched.outputs == plain(specs)
    assert fmap.in_use == 0
    assert 0 < sched.accepted_tokens < sched.drafted_tokens


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_all_right_are_all_accepted_and_all_wrong_none(k: int) -> None:
    specs = random_workload(7, 5, vocab=VOCAB, max_prompt=6, max_new=16, arrival_span=2)
    right, fmap, stats_right = spec_run(specs, k=k, error_rate=0.0, delay=random_delay(7))
    wrong, _, stats_wrong = spec_run(specs, k=k, error_rate=1.0, delay=random_delay(7))
    assert right.outputs == wrong.outputs == plain(specs)
    assert right.drafted_tokens > 0 and right.accepted_tokens == right.drafted_tokens
    assert wrong.drafted_tokens > 0 and wrong.accepted_tokens == 0
    assert stats_right.steps < stats_wrong.steps and fmap.in_use == 0


class _Recorder(ContinuousBatcher):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.events: list[tuple[str, int]] = []
        self.batches: list[Any] = []

    def schedule(self) -> Any:
        batch = super().schedule()
        if batch is not None:
            self.batches.append(batch)
            self.events.append(("schedule", len(self.batches) - 1))
        elif any(r.n_pending for r in self.running):
            live = [r for r in self.running if not r.finished and not r.done_by_length]
            if live:
                # A wait for the step in flight: only when every request that would step may end
                # in it (its drafts all accepted would reach its length limit).
                assert all(len(r.out) + r.n_pending + r.pending_extra >= r.spec.max_new for r in live)
                self.events.append(("wait", len(self.batches) - 1))
        return batch

    def process(self, result: DraftResult) -> None:
        self.events.append(("process", result.step))
        super().process(result)


def test_overlap_launches_the_next_step_before_the_accepted_counts_reach_the_host() -> None:
    specs = random_workload(4, 4, vocab=VOCAB, max_prompt=6, max_new=10, arrival_span=0)
    sched, fmap, _ = spec_run(specs, sched_type=_Recorder, delay=random_delay(4))
    assert isinstance(sched, _Recorder)
    assert sched.events[:3] == [("schedule", 0), ("schedule", 1), ("process", 0)]
    for i, (kind, step) in enumerate(sched.events):
        # Every processed step N comes after step N+1 was scheduled (or after the last schedule,
        # or after a wait at the end of a request: see the next test).
        if kind == "process":
            assert (
                ("schedule", step + 1) in sched.events[:i]
                or step == len(sched.batches) - 1
                or sched.events[i - 1] == ("wait", step)
            )
    # A verifying request names its previous step's slot: its inputs and positions come from the
    # device (the drafts and the seq_len field), never from a host copy of the accepted count.
    verifying = [b for b in sched.batches if b.n_verify.size and (b.n_verify > 0).any()]
    assert verifying
    for b in verifying:
        firsts = b.tokens[np.concatenate([[0], np.cumsum(b.seg_lens)[:-1]])]
        assert (firsts[b.n_verify > 0] < 0).all()
    assert fmap.in_use == 0 and sched.outputs == plain(specs)


@pytest.mark.parametrize("err", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_takes_no_more_steps_than_sync_at_the_end_of_a_run(seed: int, n: int, err: float) -> None:
    # Requests of one length, arriving together: each ends by its length limit, in a step whose
    # accepted count the overlapped host learns only after it scheduled the next one. The
    # batcher waits for that step when every request may end in it (it returns None with a step
    # in flight): no step runs for finished requests only, so overlap takes sync's steps.
    rng = np.random.default_rng(seed)
    max_new = int(rng.integers(6, 20))
    specs = [RequestSpec(i, 0, rng.integers(1, VOCAB, 5), max_new) for i in range(n)]
    k = int(rng.integers(2, 5))
    runs = {
        ov: spec_run(
            specs, k=k, error_rate=err, seed=seed, overlap=ov, sched_type=_Recorder, delay=random_delay(seed)
        )
        for ov in (True, False)
    }
    (over, fmap, over_stats), (sync, _, sync_stats) = runs[True], runs[False]
    assert over.outputs == sync.outputs == plain(specs) and fmap.in_use == 0
    assert over_stats.steps == sync_stats.steps


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_delays_on_every_speculative_op_and_gc_keep_plain_tokens(overlap: bool) -> None:
    specs = random_workload(3, 6, vocab=VOCAB, max_prompt=6, max_new=12, arrival_span=3)
    plan = FaultPlan(seed=3, max_delay_s=1e-3, delay_ops=SPEC_POINTS, host_delay_s=5e-4, gc_every_step=True)
    sched, fmap, stats = spec_run(specs, overlap=overlap, faults=plan, trace=True)
    assert sched.outputs == plain(specs) and fmap.in_use == 0
    assert plan.injected["stream_delay"] >= len(SPEC_POINTS) * stats.steps
    assert plan.injected["gc"] == stats.steps
    assert {"prepare", "forward", "verify", "draft", "store", "copy"} <= {s.name for s in stats.device_spans}


@pytest.mark.parametrize("point", [*SPEC_POINTS, "forward", "schedule", "process"])
def test_a_fault_at_each_point_surfaces_and_releases_every_slot(point: str) -> None:
    specs = random_workload(1, 6, vocab=VOCAB, max_prompt=6, max_new=12, arrival_span=3)
    threads = threading.active_count()
    fmap = FutureMap(64, device="cpu")
    with pytest.raises(InjectedFault, match=f"at {point} of step 2"):
        drafter = ToyDrafter(ToyModel(vocab=VOCAB), k=2)
        drafter.bind(4, 128, fmap.device)
        sched = ContinuousBatcher(specs, fmap, eos=-1, max_running=4, speculative=2)
        step = SpecTokenStep(ToyModel(vocab=VOCAB), drafter, Sampler())
        OverlapRuntime(step, fmap, faults=FaultPlan(raise_at={point: 2})).run(sched)
    assert fmap.in_use == 0 and threading.active_count() == threads


def test_a_model_failure_surfaces_with_its_step_and_releases_slots() -> None:
    specs = random_workload(5, 4, vocab=VOCAB, max_prompt=6, max_new=12, arrival_span=0)
    threads = threading.active_count()
    fmap = FutureMap(64, device="cpu")
    drafter = ToyDrafter(ToyModel(vocab=VOCAB), k=2)
    drafter.bind(4, 128, fmap.device)
    sched = ContinuousBatcher(specs, fmap, eos=-1, max_running=4, speculative=2)
    step = SpecTokenStep(ToyModel(vocab=VOCAB, fail_at=2), drafter, Sampler())
    with pytest.raises(RuntimeError, match="planted failure in forward of step 2") as info:
        OverlapRuntime(step, fmap, delay=random_delay(5)).run(sched)
    assert any("step 2" in note for note in getattr(info.value, "__notes__", []))
    assert fmap.in_use == 0 and threading.active_count() == threads


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"workload{s}")
def test_a_failed_run_leaks_no_slot_when_the_host_is_slow(seed: int) -> None:
    # Regression (found on the retired toy step): the step's handle was allocated before its
    # staging buffer; waiting for that buffer re-raised the stream's failure and the fresh
    # handle was never released.
    specs = random_workload(seed, 4, vocab=VOCAB, max_prompt=6, max_new=30, arrival_span=0)

    class Slow(ContinuousBatcher):
        def process(self, result: Any) -> None:
            time.sleep(0.02)  # host work longer than a device step: the failure lands mid-launch
            super().process(result)

    fmap = FutureMap(64, device="cpu")
    drafter = ToyDrafter(ToyModel(vocab=VOCAB), k=2)
    drafter.bind(4, 128, fmap.device)
    sched = Slow(specs, fmap, eos=-1, max_running=4, speculative=2)
    step = SpecTokenStep(ToyModel(vocab=VOCAB, fail_at=5), drafter, Sampler())
    with pytest.raises(RuntimeError, match="planted failure"):
        OverlapRuntime(step, fmap, overlap=True).run(sched)
    assert fmap.in_use == 0


def test_the_toy_drafter_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        ToyDrafter(ToyModel(), k=0)
    with pytest.raises(ValueError, match=r"error_rate must be in \[0, 1\]"):
        ToyDrafter(ToyModel(), error_rate=1.5)


def test_a_speculative_step_kind_takes_no_runtime_buckets_sampler_or_graphs() -> None:
    from tfuture.steps.token import Buckets

    def kind() -> SpecTokenStep:
        return SpecTokenStep(ToyModel(), ToyDrafter(ToyModel(), k=2), Sampler())

    fmap = FutureMap(8, device="cpu")
    with pytest.raises(ValueError, match="plain model"):
        OverlapRuntime(kind(), fmap, buckets=Buckets((8,), (2,)))
    with pytest.raises(ValueError, match="plain model"):
        OverlapRuntime(kind(), fmap, graphs=True)
    with pytest.raises(ValueError, match="sampler are for token steps"):
        OverlapRuntime(kind(), fmap, sampler=Sampler())
