"""Every committed mutant still applies to the code (``make mutants`` skips a stale one with a
note only, so an edit near a mutant's snippet silently drops what it guarded: the
``spec-tokens-past-finish-kept`` mutant went stale for a session that way)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_mutant_applies_to_the_working_tree() -> None:
    spec = importlib.util.spec_from_file_location("_mutant_runner", REPO / "tests" / "mutants" / "run.py")
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    sys.modules["_mutant_runner"] = runner  # dataclasses look their module up while it loads
    path = list(sys.path)  # the runner puts its own folder first, to import its mutant set
    try:
        spec.loader.exec_module(runner)
        stale = {m.id: why for m in runner.MUTANTS if (why := runner.check_mutant(REPO, m)) is not None}
    finally:
        sys.modules.pop("_mutant_runner", None)
        sys.modules.pop("mutants", None)
        sys.path[:] = path
    assert not stale, stale
    assert len({m.id for m in runner.MUTANTS}) == len(runner.MUTANTS), "mutant ids must be unique"
