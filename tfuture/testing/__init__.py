"""Tools to test an overlap integration: toy models, a grammar, a scheduler, an equivalence check."""

from tfuture.testing.batcher import ContinuousBatcher, RequestSpec, random_workload
from tfuture.testing.equivalence import (
    EquivalenceReport,
    assert_equivalent,
    check_equivalence,
    first_difference,
    run_workload,
)
from tfuture.testing.toy import ToyGrammar, ToyModel, device_work, greedy_sample
from tfuture.testing.transformer import TinyTransformer

__all__ = [
    "ContinuousBatcher",
    "EquivalenceReport",
    "RequestSpec",
    "TinyTransformer",
    "ToyGrammar",
    "ToyModel",
    "assert_equivalent",
    "check_equivalence",
    "device_work",
    "first_difference",
    "greedy_sample",
    "random_workload",
    "run_workload",
]
