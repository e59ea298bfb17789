"""DraftBatch's checks: each misuse raises a clear error naming the request, on the path where
every request verifies (whole-array checks) and where only some do (index arrays)."""

import numpy as np
import pytest

from tfuture.spec import DraftBatch


def _batch(seg, tokens, n_verify, n_draft, sample=None) -> DraftBatch:
    seg = np.asarray(seg, dtype=np.int64)
    n = seg.size
    return DraftBatch(
        np.asarray(tokens, dtype=np.int64),
        seg,
        np.arange(n, dtype=np.int64) + 40,
        np.arange(n, dtype=np.int64) + 100,
        np.ones(n, dtype=bool) if sample is None else np.asarray(sample, dtype=bool),
        n_verify=np.asarray(n_verify, dtype=np.int64),
        n_draft=np.asarray(n_draft, dtype=np.int64),
    )


def test_well_formed_batches_pass() -> None:
    b = _batch([3, 3], [-1, -2, -3, -4, -5, -6], [2, 2], [2, 2])
    assert b.n_verify.tolist() == [2, 2] and b.n_draft.tolist() == [2, 2]
    b = _batch([3, 1, 2], [-1, -2, -3, 7, -4, -5], [2, 0, 1], [2, 2, 0])
    assert b.n_verify.tolist() == [2, 0, 1]
    b = _batch([1, 1], [5, 6], [0, 0], [0, 0])  # no request verifies
    assert b.n_verify.tolist() == [0, 0]


@pytest.mark.parametrize(
    ("seg", "tokens", "n_verify", "n_draft", "sample", "match"),
    [
        # every request verifies
        (
            [3, 2],
            [-1, -2, -3, -4, -5],
            [2, 2],
            [2, 2],
            None,
            r"request 101 verifies 2 drafts, so its segment must be 1 \+ 2 tokens, got seg_lens=2",
        ),
        (
            [3, 3],
            [-1, -2, -3, 9, -5, -6],
            [2, 2],
            [2, 2],
            None,
            r"request 101 verifies drafts, so its first token must be a placeholder.*concrete id 9",
        ),
        # some verify
        (
            [1, 4, 3],
            [8, -2, -3, -4, -5, -6, -7, -8],
            [0, 2, 2],
            [0, 2, 2],
            None,
            r"request 101 verifies 2 drafts, so its segment must be 1 \+ 2 tokens, got seg_lens=4",
        ),
        (
            [1, 3, 3],
            [8, -2, -3, -4, 11, -6, -7],
            [0, 2, 2],
            [0, 2, 2],
            None,
            r"request 102 verifies drafts.*concrete id 11",
        ),
        # a request that does not sample may neither verify nor make drafts
        (
            [1, 1],
            [5, 6],
            [0, 0],
            [0, 3],
            [True, False],
            r"request 101 verifies or makes drafts \(n_verify=0, n_draft=3\) but does not sample",
        ),
        (
            [3, 3],
            [-1, -2, -3, -4, -5, -6],
            [2, 2],
            [2, 2],
            [False, True],
            r"request 100 verifies or makes drafts \(n_verify=2, n_draft=2\)",
        ),
        # counts
        ([1, 1], [5, 6], [0, -1], [0, 0], None, r"DraftBatch.n_verify must be >= 0, got -1"),
        ([1, 1], [5, 6], [0, 0], [0, 0, 0], None, r"DraftBatch.n_draft must have 2 entries"),
    ],
    ids=[
        "all-segment",
        "all-concrete",
        "some-segment",
        "some-concrete",
        "no-sample-drafts",
        "no-sample-verifies",
        "negative",
        "length",
    ],
)
def test_misuse_raises_naming_the_request(seg, tokens, n_verify, n_draft, sample, match) -> None:
    with pytest.raises(ValueError, match=match):
        _batch(seg, tokens, n_verify, n_draft, sample)


def test_counts_of_another_type_raise_type_error() -> None:
    with pytest.raises(
        TypeError, match=r"DraftBatch.n_verify must be a 1-D integer numpy array, got float64"
    ):
        DraftBatch(
            np.array([5], dtype=np.int64),
            np.array([1], dtype=np.int64),
            np.array([3], dtype=np.int64),
            np.array([0], dtype=np.int64),
            np.ones(1, dtype=bool),
            n_verify=np.zeros(1),
            n_draft=np.zeros(1, dtype=np.int64),
        )
