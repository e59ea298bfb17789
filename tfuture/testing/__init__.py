"""Tools to test an overlap integration: toy models, a grammar, seeded workloads, an equivalence
check, and a byte-level BPE trained locally on a corpus you give (``train_bpe``; needs the
``grammar`` extra when called). ``ContinuousBatcher`` and ``RequestSpec`` are product code
(:mod:`tfuture.scheduler`), re-exported here for older imports."""

from tfuture.scheduler import ContinuousBatcher, RequestSpec
from tfuture.testing.equivalence import (
    EquivalenceReport,
    assert_equivalent,
    check_equivalence,
    first_difference,
    run_workload,
)
from tfuture.testing.tokenizer import END_TOKEN, train_bpe
from tfuture.testing.toy import ToyGrammar, ToyMatcher, ToyModel, device_work, greedy_sample
from tfuture.testing.transformer import TinyTransformer
from tfuture.testing.workload import random_workload

__all__ = [
    "END_TOKEN",
    "ContinuousBatcher",
    "EquivalenceReport",
    "RequestSpec",
    "TinyTransformer",
    "ToyGrammar",
    "ToyMatcher",
    "ToyModel",
    "assert_equivalent",
    "check_equivalence",
    "device_work",
    "first_difference",
    "greedy_sample",
    "random_workload",
    "run_workload",
    "train_bpe",
]
