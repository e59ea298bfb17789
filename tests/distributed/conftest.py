"""The worker pools of the multi-process tests: 2 and 4 ranks, one pair per test module
(importing torch costs seconds per process; a module's tests share its pools)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tfuture.testing.spawn import RankPool


@pytest.fixture(scope="module")
def pool2() -> Iterator[RankPool]:
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4() -> Iterator[RankPool]:
    with RankPool(4) as pool:
        yield pool
