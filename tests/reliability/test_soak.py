"""The soak (``soak.py``): a 5,000-step run in ``make test``, the 100,000-step run marked slow,
and in process (the interpreter) the soak's own checks catching planted defects.

A soak of thousands of steps runs in a subprocess without ``TRITON_INTERPRET``: the kernels
take their CPU path (the interpreter, which conftest switches on for this process, is far too
slow for that, and it is chosen once, when tfuture is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from defects import plant
from episodes import Abort, Episode, compare, make_episode
from soak import main, run_soak

SOAK = str(Path(__file__).with_name("soak.py"))


def soak(*args: str, interpret: bool, timeout: float) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, SOAK, "--quiet", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("SOAK_SUMMARY ")), None)
    assert line is not None, proc.stdout + proc.stderr
    return proc, json.loads(line.removeprefix("SOAK_SUMMARY "))


def check_summary(proc: subprocess.CompletedProcess[str], s: dict, steps: int) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "soak: OK" in proc.stdout
    assert s["ok"] and not s["failures"]
    assert s["steps"] == steps
    assert s["slots_in_use_end"] == 0 and s["leaked_threads"] == 0
    assert s["rss_growth_mib"] < 64
    assert s["requests"] > 0 and s["tokens"] > 0 and s["aborted"] > 0
    assert s["equivalence_checked"] > 0
    assert s["faults"].get("stream_delay", 0) > 0 and s["faults"].get("host_delay", 0) > 0
    assert s["raised_episodes"] > 0
    assert s["spec_episodes"] > 0, "no speculative episode ran"
    assert s["graph_episodes"] > 0, "no episode ran with step graphs"
    for key in ("steps:", "requests:", "tokens:", "faults injected:", "slots in use at end: 0", "peak RSS:"):
        assert key in proc.stdout


def test_soak_5000_steps_restarts_without_the_interpreter():
    # Started with TRITON_INTERPRET=1 as make test would: it re-executes itself without it.
    proc, s = soak("--steps", "5000", "--seed", "0", interpret=True, timeout=240)
    check_summary(proc, s, 5000)
    assert "interpreter" not in proc.stdout  # no slow-path warning: it restarted without it


@pytest.mark.slow
def test_soak_100000_steps():
    proc, s = soak("--steps", "100000", "--seed", "1", interpret=False, timeout=1800)
    check_summary(proc, s, 100_000)
    assert s["debug_episodes"] > 0


def test_soak_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--steps", "0"])
    assert info.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err


def test_episodes_are_reproducible():
    a, b, c = make_episode(3, 7), make_episode(3, 7), make_episode(3, 8)
    assert [s.prompt.tolist() for s in a.specs] == [s.prompt.tolist() for s in b.specs]
    assert (a.aborts, a.batcher_kw, a.plan_kw) == (b.aborts, b.batcher_kw, b.plan_kw)
    assert [s.prompt.tolist() for s in a.specs] != [s.prompt.tolist() for s in c.specs]


def test_compare_rules():
    ep = make_episode(0, 0)
    ep = Episode(
        0, 0, ep.specs[:3], ep.vocab, None, {1: Abort("hard", 2), 2: Abort("soft", 2)}, {}, {}, False
    )
    sync = {0: [1, 2, 3], 1: [4, 5], 2: [6, 7]}
    assert compare(ep, sync, dict(sync)) is None
    assert compare(ep, sync, {**sync, 1: [4]}) is None  # a hard abort lands one step later
    assert "hard abort" in (compare(ep, sync, {**sync, 1: []}) or "")
    assert "hard abort" in (compare(ep, sync, {**sync, 1: [5]}) or "")
    assert "request 2" in (compare(ep, sync, {**sync, 2: [6]}) or "")  # soft: exact
    assert "request 0" in (compare(ep, sync, {**sync, 0: [1, 2, 4]}) or "")
    assert "no output" in (compare(ep, sync, {0: [1, 2, 3], 1: [4, 5]}) or "")


@pytest.mark.parametrize("defect", ["skip_resolve", "late_delayed_sample"])
def test_soak_catches_a_planted_defect(defect):
    # Episode 0 (checked against sync) has grammar requests, so delayed samples too.
    assert make_episode(0, 0).grammar is not None
    clean = run_soak(100_000, seed=0, only_episode=0, progress=False)
    assert clean.ok, clean.failures
    with plant(defect):
        report = run_soak(100_000, seed=0, only_episode=0, progress=False)
    assert not report.ok
    assert any("overlap differs from sync" in f for f in report.failures), report.failures


def test_soak_one_episode_in_process():
    report = run_soak(100_000, seed=0, only_episode=2, progress=False)
    assert report.ok, report.failures
    assert report.episodes == 1 and report.equivalence_checked == 1 and report.slots_in_use_end == 0
