"""Tensor and pipeline parallel on CPU with gloo, in spawned processes (tfuture.distributed).

Two worker pools (2 and 4 ranks) live for the module: importing torch costs seconds per
process. Every call is bounded twice: the process groups' timeout inside the ranks, and the
pool's join timeout here (it kills the workers on expiry). Each scenario joins a fresh group
on a free loopback port. The outputs must equal a single-rank run of the same model, token
for token, in sync mode, in overlap mode under random stream delays, and in debug mode.
"""

from __future__ import annotations

import os
from typing import Any

import dist_scenarios as ds
import pytest

from tfuture.testing.spawn import RankPool

JOIN_S = 120.0  # the parent's bound on one call (the ranks' own timeout is ds.TIMEOUT_S)


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    ref = ds.reference()
    specs = {s.rid: s for s in ds.workload()}
    early = [rid for rid, out in ref.items() if out[-1] == ds.EOS and len(out) < specs[rid].max_new]
    assert early, "the workload must end some requests by the end token (the extra step)"
    return ref


def _check_equivalent(results: list[dict[str, Any]], reference: dict[int, list[int]]) -> None:
    for rank, runs in enumerate(results):
        assert runs.pop("initialized_after") is False, f"rank {rank} left its process group"
        # The workers run the kernels as this process does (the Triton interpreter without CUDA).
        assert runs.pop("interpret") == os.environ.get("TRITON_INTERPRET")
        for name, run in runs.items():
            assert run["outputs"] == reference, (
                f"rank {rank}, {name}: outputs differ from the single-rank run"
            )
            assert run["in_use"] == 0, f"rank {rank}, {name}: {run['in_use']} slots left in use"
    for name in results[0]:
        digests = {runs[name]["map"] for runs in results}
        assert len(digests) == 1, f"{name}: the ranks' FutureMaps hold different values"
        assert len({runs[name]["steps"] for runs in results}) == 1


def test_tensor_parallel_2_equals_single_rank(pool2: RankPool, reference: dict[int, list[int]]) -> None:
    results = pool2.run(ds.equivalence, 2, 1, timeout_s=JOIN_S)
    _check_equivalent(results, reference)
    assert results[0]["sync"]["bubbles"] == 0  # one stage: nothing to push out of a pipe


def test_pipeline_parallel_2_equals_single_rank(pool2: RankPool, reference: dict[int, list[int]]) -> None:
    results = pool2.run(ds.equivalence, 1, 2, timeout_s=JOIN_S)
    _check_equivalent(results, reference)
    # The overlapped run ended requests by the end token: their extra step ran and was discarded.
    assert results[0]["overlap_delayed"]["extra"] > 0


def test_tensor_2_x_pipeline_2_equals_single_rank(pool4: RankPool, reference: dict[int, list[int]]) -> None:
    # Sync and overlap under delays (debug mode runs on 2 ranks above; 4 processes share 2 cores).
    results = pool4.run(ds.equivalence, 2, 2, False, timeout_s=JOIN_S)
    _check_equivalent(results, reference)


def test_a_cut_run_leaves_nothing_in_flight(pool2: RankPool, reference: dict[int, list[int]]) -> None:
    for rank, out in enumerate(pool2.run(ds.cut_then_full, 1, 2, timeout_s=JOIN_S)):
        cut, full = out["cut"], out["full"]
        # 5 micro-batches, then bubbles: the last one delivers the 5th micro-batch's tokens.
        assert cut["micro"] == 5 and cut["steps"] == 5 + cut["bubbles"], f"rank {rank}: {cut}"
        assert cut["bubbles"] >= 1 and cut["in_use"] == 0
        assert full["outputs"] == reference and full["in_use"] == 0, f"rank {rank}"


def test_pipeline_copies_the_tokens_of_a_model_that_reuses_its_sample_buffer(
    pool2: RankPool, reference: dict[int, list[int]]
) -> None:
    # Issue 30 item 16: the last stage's tokens are stored a micro-batch later and sent
    # asynchronously; the next sample rewrites the model's buffer meanwhile.
    for rank, out in enumerate(pool2.run(ds.reused_sample_buffer, 1, 2, timeout_s=JOIN_S)):
        assert out["outputs"] == reference, f"rank {rank}: outputs differ from the single-rank run"
        assert out["in_use"] == 0


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_grammar_rows_wait_for_their_masks_across_ranks(pool2: RankPool, tp: int, pp: int) -> None:
    want = ds.grammar_reference()
    for rank, out in enumerate(pool2.run(ds.grammar_run, tp, pp, timeout_s=JOIN_S)):
        assert out["outputs"] == want, f"rank {rank}: outputs differ from the single-rank run"
        assert out["in_use"] == 0


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_sampling_params_penalties_and_grammar_equal_single_rank(pool2: RankPool, tp: int, pp: int) -> None:
    """The parallel step is the token step: tfuture's Sampler with per-request parameters and
    penalties, and grammar rows that wait (delay="rows"), token for token as on one rank."""
    want = ds.sampled_reference()
    specs, _ = ds.sampled_workload()
    sampled = {s.rid for s in specs if s.params is not None and s.params.temperature > 0}
    assert any(want[rid] for rid in sampled) and any(s.grammar for s in specs)
    for rank, runs in enumerate(pool2.run(ds.sampled_run, tp, pp, timeout_s=JOIN_S)):
        for name, run in runs.items():
            assert run["outputs"] == want, f"rank {rank}, {name}: outputs differ from the single-rank run"
            assert run["in_use"] == 0 and run["live_rows"] == 0, f"rank {rank}, {name}"


def _check_failure(results: list[dict[str, Any]], fail_rank: int, where: str, bound_s: float) -> None:
    for rank, out in enumerate(results):
        assert out["in_use"] == 0, f"rank {rank} kept {out['in_use']} slots"
        assert out["initialized_after"] is False, f"rank {rank} did not tear its process group down"
        assert out["seconds"] < bound_s, f"rank {rank} took {out['seconds']:.1f} s to fail"
        if rank == fail_rank:
            assert out["type"] == "RuntimeError" and f"planted failure in {where}" in out["message"]
        else:
            assert out["type"] == "RankFailure", f"rank {rank} raised {out['type']}: {out['message']}"
            assert out["origin"] == fail_rank and f"rank {fail_rank}" in out["message"]
            assert f"planted failure in {where}" in out["message"]


@pytest.mark.parametrize(
    ("tp", "pp", "fail_rank", "at", "where"),
    [(2, 1, 1, 5, "forward"), (2, 1, 0, 4, "sample"), (1, 2, 0, 6, "forward"), (1, 2, 1, 3, "sample")],
)
def test_failure_on_one_rank_raises_on_every_rank(
    pool2: RankPool, tp: int, pp: int, fail_rank: int, at: int, where: str
) -> None:
    results = pool2.run(ds.planted_failure, tp, pp, fail_rank, at, where, timeout_s=JOIN_S)
    # Peers fail at once (the failing rank's groups close), not after the 20 s timeout.
    _check_failure(results, fail_rank, where, bound_s=ds.TIMEOUT_S / 2)


def test_failure_on_tensor_x_pipeline(pool4: RankPool) -> None:
    results = pool4.run(ds.planted_failure, 2, 2, 3, 4, timeout_s=JOIN_S)
    _check_failure(results, 3, "forward", bound_s=ds.TIMEOUT_S / 2)


def test_failure_with_a_group_held_open_ends_at_the_timeout(pool2: RankPool) -> None:
    # The failing model keeps its tensor group alive: its peer learns through the 3 s timeout.
    results = pool2.run(ds.planted_failure, 2, 1, 1, 3, "forward", True, 3.0, timeout_s=JOIN_S)
    _check_failure(results, 1, "forward", bound_s=15.0)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_diverging_scheduler_is_caught_in_debug_mode(pool2: RankPool, tp: int, pp: int) -> None:
    results = pool2.run(ds.divergence, tp, pp, timeout_s=JOIN_S)
    for rank, out in enumerate(results):
        assert out["type"] == "RankDivergence", f"rank {rank}: {out}"
        assert "schedulers diverged at step" in out["message"] and "rank 1 launches" in out["message"]
        assert out["in_use"] == 0 and out["initialized_after"] is False


def test_diverging_tokens_are_caught_in_debug_mode(pool2: RankPool) -> None:
    results = pool2.run(ds.token_divergence, 2, 1, timeout_s=JOIN_S)
    for rank, out in enumerate(results):
        assert out["type"] == "RankDivergence", f"rank {rank}: {out}"
        assert "the FutureMaps diverged at step" in out["message"] and "rank(s) [1]" in out["message"]
        assert out["in_use"] == 0 and out["initialized_after"] is False


def test_capacity_mismatch_is_refused_on_every_rank(pool2: RankPool) -> None:
    results = pool2.run(ds.capacity_mismatch, 1, 2, timeout_s=JOIN_S)
    for out in results:
        assert out["type"] == "RankDivergence"
        assert "map capacity: rank 0 has 64, rank 1 has 32" in out["message"]


def test_layout_mismatch_is_refused_on_every_rank(pool2: RankPool) -> None:
    results = pool2.run(ds.layout_mismatch, timeout_s=JOIN_S)
    for out in results:
        assert out["type"] == "ValueError" and "ranks disagree on the layout" in out["message"]
        assert out["initialized_after"] is False


def test_mismatched_world_sizes_are_refused(pool2: RankPool) -> None:
    first, second = pool2.run(ds.world_mismatch, timeout_s=JOIN_S)
    assert first["type"] == "ValueError" and "rank 1 has world size 3" in first["message"]
    assert second["type"] == "ValueError" and "mismatched world sizes" in second["message"]
    assert second["seconds"] < 15


def test_pipeline_exhaustion_raises_future_map_full_on_every_rank(pool2: RankPool) -> None:
    results = pool2.run(ds.exhaustion, 1, 2, timeout_s=JOIN_S)
    for out in results:
        assert out["type"] == "FutureMapFull" and "10" in out["message"]
        assert out["in_use"] == 0 and out["initialized_after"] is False
