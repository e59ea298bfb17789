"""The sync-vs-overlap check (``tfuture.testing.equivalence``) that most runtime tests rely on:
it names the first difference, and it does fail when the two runs differ."""

import pytest

from tfuture.testing import ToyModel, assert_equivalent, check_equivalence, first_difference, random_workload


def test_first_difference_is_readable():
    msg = first_difference({1: [4, 5, 6]}, {1: [4, 5, 7]}, ("sync", "overlap"))
    assert msg is not None and "request 1: token 2 differs: sync 6, overlap 7" in msg
    assert first_difference({1: [4, 5]}, {1: [4, 5, 6]}, ("a", "b")).startswith(
        "request 1: token 2 differs: a <end>"
    )
    assert first_difference({1: [4]}, {}, ("a", "b")) == "request 1: missing from the b run"
    assert first_difference({1: [4]}, {1: [4]}, ("a", "b")) is None


def test_a_difference_between_the_runs_is_reported():
    # The overlap run gets another model: a check that could not fail would still say "equivalent".
    specs = random_workload(9, 4, max_new=6)
    models = iter([ToyModel(vocab=64), ToyModel(vocab=32), ToyModel(vocab=64), ToyModel(vocab=32)])
    report = check_equivalence(lambda: next(models), specs, capacity=16)
    assert not report.ok and report.message.startswith("request ")
    assert report.sync != report.overlap
    with pytest.raises(AssertionError, match="sync and overlap runs differ: request "):
        assert_equivalent(lambda: next(models), specs, capacity=16)
