"""The sync outputs of the shared scenario, computed once for every reliability test."""

import pytest
from scenario import GRAMMAR, GRAMMAR_SPECS, SPECS, run


@pytest.fixture(scope="session")
def sync_ref() -> dict[int, list[int]]:
    out = run(SPECS, overlap=False)
    assert out.error is None and out.outputs is not None
    return out.outputs


@pytest.fixture(scope="session")
def grammar_ref() -> dict[int, list[int]]:
    out = run(GRAMMAR_SPECS, overlap=False, grammar=GRAMMAR)
    assert out.error is None and out.outputs is not None
    return out.outputs
