"""Multi-step decode windows under tensor and pipeline parallelism (gloo, spawned ranks): greedy
output equal to plain single-rank decoding token for token for windows of 2 and 4 at TP=2 and
PP=2 (K = 4 at TP=2 x PP=2), with requests ending by eos and ``max_tokens`` inside a window, in
sync and overlapped under stream delays, debug checks on (every step's batch, stored tokens and
window tokens compared across ranks); seeded sampling with penalties (and a grammar request,
whose windows run one step) equal to a single-rank multi-step run, itself equal to plain
decoding; and the configurations a run cannot take refused on every rank before any step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import dist_scenarios as ds
import dist_window_scenarios as dws
import pytest
import torch

from tfuture import FutureMap
from tfuture.distributed import ParallelContext, ParallelRuntime, init_parallel
from tfuture.distributed.window_step import ParallelWindowStep
from tfuture.spec import NGramDrafter
from tfuture.steps.token import Buckets
from tfuture.testing import ContinuousBatcher
from tfuture.testing.faults import FaultPlan, InjectedFault, random_delay
from tfuture.testing.spawn import RankPool
from tfuture.testing.tp import ParallelTransformer

JOIN_S = 180.0


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    return ds.reference()


def _check_windows(results: list[dict[str, Any]], reference: dict[int, list[int]], names: set[str]) -> None:
    for rank, runs in enumerate(results):
        assert runs.pop("initialized_after") is False, f"rank {rank} left its process group"
        assert runs.pop("interpret") == os.environ.get("TRITON_INTERPRET")
        assert set(runs) == names
        for name, run in runs.items():
            assert run["outputs"] == reference, f"rank {rank}, {name}: outputs differ from plain decoding"
            assert run["in_use"] == 0 and run["live_rows"] == 0, f"rank {rank}, {name}: state left"
    for name in names:
        # Every rank stored the same tokens, in as many steps.
        assert len({runs[name]["map"] for runs in results}) == 1, f"{name}: the ranks' maps differ"
        assert len({runs[name]["steps"] for runs in results}) == 1, f"{name}: step counts differ"
        # Windows ran (fewer launches than tokens), and a finish inside a window dropped tokens.
        assert results[0][name]["extra"] > 0, name
        assert results[0][name]["steps"] < sum(len(t) for t in reference.values()), name


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_windows_equal_plain_single_rank(
    pool2: RankPool, reference: dict[int, list[int]], tp: int, pp: int
) -> None:
    results = pool2.run(dws.window_run, tp, pp, timeout_s=JOIN_S)
    _check_windows(results, reference, {f"k{k}_{m}" for k in dws.WINDOWS for m in ("sync", "overlap")})
    runs = results[0]
    assert runs["k4_sync"]["steps"] < runs["k2_sync"]["steps"]
    # Finishes land inside windows: not every output length is a multiple of K; some by eos.
    assert any(len(t) % 4 for t in reference.values())
    limits = {s.rid: s.max_new for s in ds.workload()}
    assert any(len(t) < limits[rid] for rid, t in reference.items()), "an eos finish"


def test_windows_tensor_2_x_pipeline_2_equal_plain_single_rank(
    pool4: RankPool, reference: dict[int, list[int]]
) -> None:
    # K = 4 overlapped only, debug checks on (4 processes share 2 cores).
    _check_windows(pool4.run(dws.window_run, 2, 2, True, timeout_s=JOIN_S), reference, {"k4_overlap"})


@pytest.fixture(scope="module")
def sampled_plain() -> dict[int, list[int]]:
    return dws.sampled_window_reference(1)[0]


@pytest.mark.parametrize(("tp", "pp", "k"), [(2, 1, 4), (1, 2, 4)])
def test_sampled_windows_equal_single_rank(
    pool2: RankPool, sampled_plain: dict[int, list[int]], tp: int, pp: int, k: int
) -> None:
    want, launches = dws.sampled_window_reference(k)
    # Windows keep every request's tokens (the single-rank window run is plain decoding's), and
    # most steps of the workload are windows.
    assert want == sampled_plain
    assert launches < sum(len(t) for t in want.values()) // 2
    for rank, run in enumerate(pool2.run(dws.sampled_window_run, tp, pp, k, timeout_s=JOIN_S)):
        assert run["outputs"] == want, f"rank {rank}: outputs differ from the single-rank window run"
        assert run["in_use"] == 0 and run["live_rows"] == 0, f"rank {rank}"


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_refusals_come_before_any_step_on_every_rank(
    pool2: RankPool, reference: dict[int, list[int]], tp: int, pp: int
) -> None:
    for out in pool2.run(dws.refusals, tp, pp, timeout_s=JOIN_S):
        for name, kind, phrase in (
            ("no_windows", "ValueError", "multi_step=2"),
            ("k_mismatch", "RankDivergence", "multi-step window (K): rank 0 has 2, rank 1 has 4"),
        ):
            assert out[name]["type"] == kind, out[name]
            assert phrase in out[name]["message"], out[name]["message"]
            assert out[name]["in_use"] == 0 and out[name]["initialized_after"] is True
        assert "windows=True" in out["no_windows"]["message"]
        assert out["after"] == reference


# -- world 1, in this process: the same code path, fast ----------------------------------------


@pytest.fixture
def ctx1() -> Iterator[ParallelContext]:
    """A fresh world of 1 (a failed run closes its context)."""
    with init_parallel(1, 1, backend="gloo", timeout_s=20) as c:
        yield c


def _window_groups(fmap: FutureMap, k: int) -> list[ContinuousBatcher]:
    return [ContinuousBatcher(ds.workload(), fmap, eos=ds.EOS, max_running=3, multi_step=k)]


@pytest.mark.parametrize("overlap", [False, True])
def test_world_1_windows_equal_plain_decoding(
    ctx1: ParallelContext, reference: dict[int, list[int]], overlap: bool
) -> None:
    fmap = FutureMap(64, device="cpu", debug=True)
    groups = _window_groups(fmap, 3)
    model = ParallelTransformer(ctx=ctx1, **ds.MODEL)
    runtime = ParallelRuntime(
        model, fmap, ctx1, overlap=overlap, delay=random_delay(3, p=0.3, max_s=1e-3), windows=True
    )
    assert isinstance(runtime.kind, ParallelWindowStep)
    stats = runtime.run(groups)
    assert groups[0].outputs == reference
    assert fmap.in_use == 0 and stats.steps < sum(len(t) for t in reference.values()) // 2


def test_world_1_bad_window_configurations_are_refused(ctx1: ParallelContext) -> None:
    fmap = FutureMap(64, device="cpu")
    model = ParallelTransformer(ctx=ctx1, **ds.MODEL)
    with pytest.raises(TypeError, match="windows must be a bool"):
        ParallelRuntime(model, fmap, ctx1, windows=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="take no buckets="):
        ParallelRuntime(model, fmap, ctx1, windows=True, buckets=Buckets((8,), (4,)))
    drafter = NGramDrafter(k=2)
    with pytest.raises(ValueError, match="take no speculative="):
        ParallelRuntime(model, fmap, ctx1, windows=True, speculative=drafter)
    with pytest.raises(TypeError, match=r"sampler must be a tfuture\.sampling\.Sampler"):
        ParallelWindowStep(model, ctx1, sampler=object())  # type: ignore[arg-type]
    drafter.bind(ds.N_REQ, ds.MODEL["max_len"], torch.device("cpu"))
    spec = ContinuousBatcher(ds.workload(), fmap, eos=ds.EOS, max_running=3, speculative=2, multi_step=2)
    with pytest.raises(ValueError, match=r"multi_step=2.* speculative steps and windows together are not"):
        ParallelRuntime(model, fmap, ctx1, speculative=drafter).run(spec)
    group = SimpleNamespace(
        schedule=lambda: None, process=lambda r: None, build_mask=lambda b: None, multi_step=0
    )
    with pytest.raises(TypeError, match="scheduler 0's multi_step must be an int >= 1, got 0"):
        ParallelRuntime(model, fmap, ctx1, windows=True).run(group)
    assert not ctx1.closed and fmap.in_use == 0


@pytest.mark.parametrize("op", ["decode", "store"])
def test_world_1_a_fault_in_a_window_leaks_nothing(ctx1: ParallelContext, op: str) -> None:
    fmap = FutureMap(64, device="cpu")
    groups = _window_groups(fmap, 4)
    model = ParallelTransformer(ctx=ctx1, **ds.MODEL)
    runtime = ParallelRuntime(model, fmap, ctx1, windows=True, faults=FaultPlan(raise_at={op: 4}))
    with pytest.raises(InjectedFault):
        runtime.run(groups)
    assert fmap.in_use == 0 and ctx1.closed


def test_world_1_a_stage_that_returns_the_wrong_logits_in_a_later_step_is_refused_by_name(
    ctx1: ParallelContext,
) -> None:
    class Short(ParallelTransformer):
        """Drops a row of the logits of a window's later steps (a step's second forward on)."""

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.seen: set[int] = set()

        def forward(self, batch: Any, hidden: Any = None) -> Any:
            out = super().forward(batch, hidden)
            later = batch.step in self.seen
            self.seen.add(batch.step)
            return out[:-1] if later else out

    fmap = FutureMap(64, device="cpu")
    runtime = ParallelRuntime(Short(ctx=ctx1, **ds.MODEL), fmap, ctx1, windows=True)
    with pytest.raises(ValueError, match=r"\(decode 2 of 4\) must return \[\d+, vocab\] logits"):
        runtime.run(_window_groups(fmap, 4))
    assert fmap.in_use == 0
