"""Test set-up: the Triton interpreter on CPU-only machines, set before tfuture is imported;
a seeded start for every test."""

import os
import random
import sys

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    # Import triton's lazily imported gluon package now, under the interpreter: its import asserts
    # that the interpreter is on when it meets interpreted functions, and two full runs (perf's
    # tests collected) failed every kernel test from the one that first triggered that import.
    assert triton.knobs.runtime.interpret == (os.environ["TRITON_INTERPRET"] == "1")
    try:
        import triton.experimental.gluon
    except ImportError:  # an older triton without gluon
        pass

import pytest

# Test-only helpers (planted defects) import as plain modules from any test folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SEED = 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """torch, numpy's global generator and ``random`` start from the same seed in every test."""
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)


@pytest.fixture
def device() -> str:
    return DEVICE
