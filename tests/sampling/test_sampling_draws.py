"""uniform_draws: a pure function of (seed, position), uniform enough, checked arguments."""

from __future__ import annotations

import numpy as np
import pytest

from tfuture.sampling import uniform_draws


def test_depends_only_on_seed_and_position() -> None:
    seeds = np.array([0, 1, 7, 2**63 - 1, 123456789], dtype=np.int64)
    pos = np.array([0, 5, 5, 1000, 3], dtype=np.int64)
    u = uniform_draws(seeds, pos)
    one_by_one = [
        float(uniform_draws(np.array([s]), np.array([p]))[0]) for s, p in zip(seeds, pos, strict=True)
    ]
    assert u.tolist() == one_by_one
    perm = np.array([3, 0, 4, 2, 1])
    assert np.array_equal(uniform_draws(seeds[perm], pos[perm]), u[perm])
    assert float(uniform_draws(7, 5)) == u[2]  # scalars broadcast
    grid = uniform_draws(seeds[:, None], pos[None, :])
    assert grid.shape == (5, 5) and grid[2, 1] == u[2]
    assert uniform_draws(seeds.astype(np.uint64), pos.astype(np.int32)).tolist() == u.tolist()
    assert len(set(u.tolist())) == 5 and ((u >= 0) & (u < 1)).all()


def test_uniform_enough() -> None:
    seeds = np.arange(2000, dtype=np.int64)[:, None]
    pos = np.arange(100, dtype=np.int64)[None, :]
    u = uniform_draws(seeds, pos)  # 200k draws, fixed: the test is deterministic
    assert abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.002
    counts = np.bincount((u * 100).astype(int).ravel(), minlength=100)
    expected = u.size / 100
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 200, chi2  # 99 degrees of freedom: p ~ 1e-8 at 200
    # Neighbouring seeds and neighbouring positions are not correlated.
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.01
    # No repeats among the 200k draws' 53-bit values (a collision would be a broken hash).
    assert np.unique(u).size == u.size


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"seeds must be in \[0, 2\*\*63\)"):
        uniform_draws(np.array([-1]), np.array([0]))
    with pytest.raises(ValueError, match="seeds must be in"):
        uniform_draws(np.array([2**63], dtype=np.uint64), np.array([0]))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        uniform_draws(np.array([1]), np.array([-2]))
    with pytest.raises(TypeError, match="seeds must be integers, got dtype float64"):
        uniform_draws(np.array([1.0]), np.array([0]))
