"""Speculative steps get the loop's fault injection and tracing like token steps."""

from __future__ import annotations

import pytest
import torch

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.steps.speculative import SpecStep
from tfuture.testing.faults import SPEC_POINTS, FaultPlan, InjectedFault
from tfuture.testing.toy_spec import SpecBatcher, ToySpecModel, reference_outputs
from tfuture.testing.workload import random_workload


def new_map() -> FutureMap:
    return FutureMap(64, device="cuda" if torch.cuda.is_available() else "cpu")


def run(seed: int, plan: FaultPlan, fmap: FutureMap, overlap: bool = True) -> tuple[SpecBatcher, object]:
    specs = random_workload(seed, 6, max_prompt=6, max_new=12, arrival_span=3)
    sched = SpecBatcher(specs, fmap, eos=-1, max_running=4)
    model = ToySpecModel(k=2, error_rate=0.3, seed=seed)
    stats = OverlapRuntime(SpecStep(model), fmap, overlap=overlap, faults=plan, trace=True).run(sched)
    return sched, stats


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_spec_steps_under_delays_and_gc_equal_plain_decoding(overlap):
    plan = FaultPlan(seed=3, max_delay_s=1e-3, delay_ops=SPEC_POINTS, host_delay_s=5e-4, gc_every_step=True)
    fmap = new_map()
    sched, stats = run(3, plan, fmap, overlap)
    specs = random_workload(3, 6, max_prompt=6, max_new=12, arrival_span=3)
    assert sched.outputs == reference_outputs(specs, eos=-1)
    assert fmap.in_use == 0
    assert (
        plan.injected["stream_delay"] >= len(SPEC_POINTS) * stats.steps and plan.injected["gc"] == stats.steps
    )
    names = {s.name for s in stats.device_spans}
    assert {"prepare", "verify", "draft", "store", "copy"} <= names
    # Committed tokens of every step, the extra steps' discarded ones included.
    assert stats.tokens >= sum(len(v) for v in sched.outputs.values())


@pytest.mark.parametrize("point", [*SPEC_POINTS, "schedule", "process"])
def test_spec_fault_surfaces_and_releases_every_slot(point):
    fmap = new_map()
    with pytest.raises(InjectedFault, match=f"at {point} of step 2"):
        run(1, FaultPlan(raise_at={point: 2}), fmap)
    assert fmap.in_use == 0
