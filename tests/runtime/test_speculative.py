"""Speculative decoding on futures (``tfuture.steps.speculative``): greedy acceptance, and overlapped
speculative steps equivalent to plain greedy decoding.

Equivalence: with greedy acceptance, overlapped speculative decoding (step N+1 launched before
the host knows step N's accepted lengths, which it reads only from step N's slot fields on the
device) commits exactly the tokens of plain greedy decoding of the target, for every request,
with random delays on the forward stream, and hands every slot back. The prepare kernel itself
is tested in ``tests/kernel_tests/test_spec.py``.
"""

import threading
import time

import numpy as np
import pytest
import torch

from tfuture import FutureMap
from tfuture.kernels.spec import SpecInputs
from tfuture.runtime import OverlapRuntime
from tfuture.steps.speculative import SpecBatch, SpecResult, SpecStep, greedy_accept
from tfuture.testing.equivalence import run_workload
from tfuture.testing.toy import ToyModel
from tfuture.testing.toy_spec import (
    SpecBatcher,
    ToySpecModel,
    check_spec_equivalence,
    random_delay,
    reference_outputs,
    run_spec,
)
from tfuture.testing.workload import random_workload


def test_greedy_accept() -> None:
    ids = torch.tensor([[9, 1, 2, 3], [9, 1, 2, 3], [9, 7, 2, 3], [9, 1, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    n_draft = torch.tensor([3, 3, 3, 0])
    acc = greedy_accept(SpecInputs(ids, ids, n_draft), target)
    assert acc.tolist() == [4, 3, 1, 1] and acc.dtype == torch.int32


@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"workload{s}")
def test_overlap_spec_equals_plain_greedy_with_delays(seed: int) -> None:
    rng = np.random.default_rng(seed)
    specs = random_workload(seed, 8, max_prompt=10, max_new=20, arrival_span=6)
    k, err = int(rng.integers(1, 5)), float(rng.uniform(0.1, 0.6))
    diff = check_spec_equivalence(
        specs, delay=random_delay(seed), k=k, error_rate=err, seed=seed, max_running=int(rng.integers(2, 7))
    )
    assert diff is None, diff


EXTREMES = [
    pytest.param(0.0, 3, id="every-draft-right"),
    pytest.param(1.0, 3, id="every-draft-wrong"),
    pytest.param(0.3, 0, id="no-drafts"),
]


@pytest.mark.parametrize(("error_rate", "k"), EXTREMES)
def test_spec_extremes(error_rate: float, k: int) -> None:
    specs = random_workload(7, 5, max_prompt=6, max_new=16, arrival_span=2)
    run = run_spec(specs, overlap=True, k=k, error_rate=error_rate, delay=random_delay(7), eos=-1)
    assert run.outputs == reference_outputs(specs, eos=-1)
    assert run.fmap.in_use == 0
    firsts = [a for acc in run.accepts.values() for a in acc[:1]]
    later = [a for acc in run.accepts.values() for a in acc[1:-1]]  # the last step may be cut short
    assert set(firsts) == {1}  # a fresh request has no drafts yet
    if error_rate == 0.0:
        assert set(later) == {k + 1}
    if error_rate == 1.0 or k == 0:
        assert set(later) <= {1}


def test_spec_equals_core_runtime_sync_decoding() -> None:
    """Against plain non-speculative decoding through the core OverlapRuntime in sync mode."""
    specs = random_workload(3, 6, max_prompt=8, max_new=12, arrival_span=4)
    plain, *_ = run_workload(ToyModel(), specs, overlap=False, capacity=32)
    run = run_spec(specs, overlap=True, k=2, error_rate=0.25, delay=random_delay(3))
    assert run.outputs == plain


class _Recorder(SpecBatcher):
    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.events: list[tuple[str, int]] = []
        self.batches: list[SpecBatch] = []

    def schedule(self) -> SpecBatch | None:
        batch = super().schedule()
        if batch is not None:
            self.batches.append(batch)
            self.events.append(("schedule", len(self.batches) - 1))
        return batch

    def process(self, result: SpecResult) -> None:
        self.events.append(("process", result.step))
        super().process(result)


def test_overlap_launches_next_step_before_accept_lengths_reach_host() -> None:
    specs = random_workload(4, 4, max_prompt=6, max_new=10, arrival_span=0)
    fmap = FutureMap(32, device="cpu")
    sched = _Recorder(specs, fmap, eos=-1)
    model = ToySpecModel(k=2, error_rate=0.2)
    OverlapRuntime(SpecStep(model), fmap, overlap=True, delay=random_delay(4)).run(sched)
    assert sched.events[:3] == [("schedule", 0), ("schedule", 1), ("process", 0)]
    for i, (kind, step) in enumerate(sched.events[2:-1]):
        # Every processed step N comes after step N+1 was scheduled (or after the last schedule).
        if kind == "process":
            assert ("schedule", step + 1) in sched.events[: i + 2] or step == len(sched.batches) - 1
    # After the first step every row names its previous step's slot: accept_len stays on the device.
    assert all((b.last < 0).all() for b in sched.batches[1:])
    assert sched.extra_rows > 0 and fmap.in_use == 0
    assert sched.outputs == reference_outputs(specs, eos=-1)


def test_failure_in_verify_surfaces_and_releases_slots() -> None:
    specs = random_workload(5, 4, max_prompt=6, max_new=12, arrival_span=0)
    fmap = FutureMap(32, device="cpu")
    threads = threading.active_count()
    runtime = OverlapRuntime(SpecStep(ToySpecModel(ToyModel(fail_at=2), k=2)), fmap, delay=random_delay(5))
    with pytest.raises(RuntimeError, match="planted failure in verify of step 2") as info:
        runtime.run(SpecBatcher(specs, fmap))
    assert any("step 2" in note for note in getattr(info.value, "__notes__", []))
    assert fmap.in_use == 0 and threading.active_count() == threads


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"workload{s}")
def test_failed_spec_run_leaks_no_slot_when_the_host_is_slow(seed):
    # Regression: the step's handle was allocated before its staging buffer; waiting for that
    # buffer re-raised the stream's failure and the fresh handle was never released.
    specs = random_workload(seed, 4, max_prompt=6, max_new=30, arrival_span=0)
    fmap = FutureMap(64, device="cpu")
    sched = SpecBatcher(specs, fmap)
    process = sched.process

    def slow_process(result):
        time.sleep(0.02)  # host work longer than a device step: the failure lands mid-launch
        return process(result)

    sched.process = slow_process
    with pytest.raises(RuntimeError, match="planted failure"):
        OverlapRuntime(SpecStep(ToySpecModel(ToyModel(fail_at=5), k=2)), fmap, overlap=True).run(sched)
    assert fmap.in_use == 0
