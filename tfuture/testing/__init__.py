"""Tools to test an overlap integration: toy models, a grammar, a scheduler, an equivalence check,
and a tokenizer trained locally (``tiny_tokenizer``; needs the ``grammar`` extra when called)."""

from tfuture.testing.batcher import ContinuousBatcher, RequestSpec, random_workload
from tfuture.testing.equivalence import (
    EquivalenceReport,
    assert_equivalent,
    check_equivalence,
    first_difference,
    run_workload,
)
from tfuture.testing.tokenizer import END_TOKEN, tiny_tokenizer
from tfuture.testing.toy import ToyGrammar, ToyMatcher, ToyModel, device_work, greedy_sample
from tfuture.testing.transformer import TinyTransformer

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
    "tiny_tokenizer",
]
