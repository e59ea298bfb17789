"""Issue 30 item 14: ``make demo-hf``'s speedup rests on its host work per step (a sleep), so
the example prints the speedup with it and without it (the model alone)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tfuture.examples.hf import main as example_main

SMALL = ["--requests", "3", "--max-new", "3", "--max-prompt", "6", "--hidden", "32"]


def test_the_example_prints_the_speedup_with_and_without_host_work(tmp_path, capsys):
    stats = example_main([*SMALL, "--host-ms", "1", "--trace", str(tmp_path / "t.json")])
    text = capsys.readouterr().out
    assert "overlap speedup with 1 ms host work per step (a sleep):" in text
    assert "overlap speedup with no host work (the model alone):" in text
    assert set(stats) == {"sync", "overlap", "sync_no_host", "overlap_no_host"}
    assert stats["overlap_no_host"].tokens == stats["sync_no_host"].tokens == stats["sync"].tokens > 0


def test_without_host_work_the_example_runs_one_pair(tmp_path, capsys):
    stats = example_main([*SMALL, "--host-ms", "0", "--trace", str(tmp_path / "t.json")])
    assert set(stats) == {"sync", "overlap"}
    assert "overlap speedup with no host work (the model alone):" in capsys.readouterr().out
