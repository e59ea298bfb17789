"""The demo's distributed modes: world size 1 in this process, and a real torchrun launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tfuture
from tfuture.distributed import free_port
from tfuture.testing import demo

SMALL = ["--steps", "4", "--batch", "4", "--ratios", "0.5", "--t-dev", "1"]


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a child that starts in another directory: the folder this process
    imported tfuture from first, then this process's entries made absolute (a relative entry,
    ``PYTHONPATH=.`` say, would name the child's working directory instead)."""
    root = str(Path(tfuture.__file__).resolve().parent.parent)
    ours = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([root, *ours]))


def test_demo_world_1_through_the_distributed_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    assert demo.main(["--tp", "1", "--pp", "1", *SMALL, "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "tp=1 pp=1 backend=" in out and "sync and overlap produced the same tokens on every rank" in out
    assert json.loads(trace.read_text())["traceEvents"]


def test_demo_needs_torchrun_for_several_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    if "RANK" in os.environ:
        pytest.skip("running under a launcher")
    assert demo.main(["--tp", "2", *SMALL]) == 2
    assert "torchrun --nproc-per-node 2 -m tfuture.testing.demo --tp 2 --pp 1" in capsys.readouterr().err


def test_torchrun_pipeline_demo(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m tfuture.testing.demo --pp 2`` (env:// rendezvous)."""
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", port]
    cmd += ["-m", "tfuture.testing.demo", "--pp", "2", *SMALL, "--trace", "", "--timeout", "30"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath())
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "tp=1 pp=2 backend=gloo" in res.stdout
    assert "sync and overlap produced the same tokens on every rank" in res.stdout
