"""A runtime runs again after a run: its staging rings forget the last stream's markers."""

from __future__ import annotations

import pytest

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, ToyModel, random_workload


@pytest.mark.parametrize("stream", ["worker", "inline"])
def test_a_runtime_runs_three_times_with_the_same_results(stream):
    fmap = FutureMap(64, device="cpu")
    rt = OverlapRuntime(ToyModel(), fmap, stream=stream)
    outputs = []
    for _ in range(3):
        sched = ContinuousBatcher(random_workload(1, 6), fmap)
        rt.run(sched)
        outputs.append(sched.outputs)
    assert outputs[0] == outputs[1] == outputs[2] and fmap.in_use == 0
