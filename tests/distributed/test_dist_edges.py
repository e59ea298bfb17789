"""The parallel step on steps that sample nothing (world size 1, in this process).

A prefill split into chunks samples only with its last chunk: with one request running at a time
and chunks of two tokens, most steps sample nothing, deliver nothing and store nothing. The
parallel step must skip its take/store ops and its result copy for them, as the plain runtime
does, and produce the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tfuture import FutureMap
from tfuture.distributed import ParallelContext, ParallelRuntime, init_parallel
from tfuture.runtime import OverlapRuntime
from tfuture.scheduler import ContinuousBatcher, RequestSpec
from tfuture.testing.tp import ParallelTransformer

MODEL: dict[str, Any] = dict(vocab=32, d_model=16, n_heads=2, n_layers=2, max_requests=4, max_len=32)


@pytest.fixture(scope="module")
def ctx() -> Iterator[ParallelContext]:
    with init_parallel(1, 1, backend="gloo", timeout_s=20) as c:
        yield c


def specs() -> list[RequestSpec]:
    prompts = ([3, 9, 14, 2, 7], [8, 1, 30], [4, 4, 6, 11, 12, 13, 1])
    return [RequestSpec(rid, rid, np.array(p, dtype=np.int64), 3) for rid, p in enumerate(prompts)]


def batcher(fmap: FutureMap) -> ContinuousBatcher:
    return ContinuousBatcher(specs(), fmap, eos=5, max_running=1, chunk=2)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_world_1_with_steps_that_sample_nothing_equals_the_plain_runtime(ctx, overlap):
    plain_map = FutureMap(16, device="cpu")
    plain = batcher(plain_map)
    OverlapRuntime(ParallelTransformer(**MODEL), plain_map, overlap=overlap).run(plain)
    fmap = FutureMap(16, device="cpu")
    sched = batcher(fmap)
    stats = ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx, overlap=overlap).run(sched)
    assert sched.outputs == plain.outputs and all(sched.outputs.values())
    assert stats.steps > sum(len(o) for o in sched.outputs.values())  # some steps sampled nothing
    assert fmap.in_use == 0
