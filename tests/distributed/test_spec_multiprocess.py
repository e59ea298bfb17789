"""Speculative decoding under tensor and pipeline parallelism (gloo, spawned ranks): greedy
output equal to plain single-rank decoding token for token, with drafts accepted and rejected,
in sync and overlapped under stream delays, in debug mode (every step's batch and stored
tokens, drafts and accepted lengths included, compared across ranks); and sampling with
penalties and grammar rows equal to a speculative single-rank run."""

from __future__ import annotations

import os
from typing import Any

import dist_scenarios as ds
import dist_spec_scenarios as dss
import pytest

from tfuture.testing.spawn import RankPool

JOIN_S = 180.0


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    return ds.reference()


def _check(results: list[dict[str, Any]], reference: dict[int, list[int]]) -> None:
    for rank, runs in enumerate(results):
        assert runs.pop("initialized_after") is False, f"rank {rank} left its process group"
        assert runs.pop("interpret") == os.environ.get("TRITON_INTERPRET")
        for name, run in runs.items():
            assert run["outputs"] == reference, f"rank {rank}, {name}: outputs differ from plain decoding"
            assert run["in_use"] == 0, f"rank {rank}, {name}: {run['in_use']} slots left in use"
    for name in results[0]:
        # Every rank stored the same tokens, drafts and lengths, in as many steps.
        assert len({runs[name]["map"] for runs in results}) == 1, f"{name}: the ranks' maps differ"
        assert len({runs[name]["steps"] for runs in results}) == 1, f"{name}: step counts differ"
    oracle = results[0]["oracle_overlap"]
    # Drafts were accepted (fewer steps than tokens) and some rejected (the planted wrong ones).
    assert 0 < oracle["accepted"] < oracle["drafted"]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_speculative_greedy_equals_plain_single_rank(
    pool2: RankPool, reference: dict[int, list[int]], tp: int, pp: int
) -> None:
    _check(pool2.run(dss.spec_run, tp, pp, reference, timeout_s=JOIN_S), reference)


def test_speculative_tensor_2_x_pipeline_2_equals_plain_single_rank(
    pool4: RankPool, reference: dict[int, list[int]]
) -> None:
    # The overlapped oracle run only, debug checks on (4 processes share 2 cores).
    _check(pool4.run(dss.spec_run, 2, 2, reference, True, timeout_s=JOIN_S), reference)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_speculative_sampling_penalties_and_grammar_equal_single_rank(
    pool2: RankPool, tp: int, pp: int
) -> None:
    want = dss.sampled_spec_reference()
    for rank, run in enumerate(pool2.run(dss.sampled_spec_run, tp, pp, timeout_s=JOIN_S)):
        assert run["outputs"] == want, f"rank {rank}: outputs differ from the single-rank speculative run"
        assert run["in_use"] == 0 and run["live_rows"] == 0, f"rank {rank}"


def test_ranks_with_different_draft_counts_are_refused_on_every_rank(pool2: RankPool) -> None:
    for out in pool2.run(dss.k_mismatch, 2, 1, timeout_s=JOIN_S):
        assert out["type"] == "RankDivergence"
        assert "drafts per step (k): rank 0 has 3, rank 1 has 2" in out["message"]
        assert out["in_use"] == 0
