"""Ctrl-C on the CPU worker stream: a run interrupted from a host hook, then interrupted again
while its error path drains the stream (the wait) and stops it (the join), returns with the GIL
switch interval restored and no queued op left to run after the run reset its state."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any
from unittest import mock

import pytest
import torch
from support import WORKER_NAME, worker_threads

from tfuture import FutureMap
from tfuture.core.batch import ForwardBatch
from tfuture.runtime import OverlapRuntime
from tfuture.streams.backends import CpuStream, drain_and_close
from tfuture.testing import ContinuousBatcher, ToyModel, random_workload


def _wait_for_no_worker(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while worker_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker_threads(), "the abandoned worker never exited"


class _Interrupts:
    """Once armed, the next ``CpuStream.wait`` and the next join of a worker thread each raise
    ``KeyboardInterrupt`` (the second and third Ctrl-C of an abort)."""

    def __init__(self) -> None:
        self.armed = False
        self.raised: list[str] = []

    def patches(self) -> Any:
        real_wait, real_join = CpuStream.wait, threading.Thread.join

        def wait(stream: CpuStream, marker: Any) -> None:
            if self.armed and "wait" not in self.raised:
                self.raised.append("wait")
                raise KeyboardInterrupt
            real_wait(stream, marker)

        def join(thread: threading.Thread, timeout: float | None = None) -> None:
            if self.armed and thread.name == WORKER_NAME and "join" not in self.raised:
                self.raised.append("join")
                raise KeyboardInterrupt
            real_join(thread, timeout)

        return mock.patch.object(CpuStream, "wait", wait), mock.patch.object(threading.Thread, "join", join)


def test_an_interrupted_drain_and_close_abandon_the_queue_and_restore_the_switch_interval():
    before = sys.getswitchinterval()
    stream = CpuStream(switch_s=1e-5)
    gate, ran = threading.Event(), []
    stream.submit("forward", 0, lambda: gate.wait(10))  # running while the host drains
    stream.submit("store", 0, lambda: ran.append("store"))  # queued: must never run after
    intr = _Interrupts()
    intr.armed = True
    wait_patch, join_patch = intr.patches()
    with wait_patch, join_patch:
        drain_and_close(stream)  # Ctrl-C in the wait, and again in the join: both swallowed
    assert intr.raised == ["wait", "join"]
    assert sys.getswitchinterval() == before, "the switch interval stayed lowered"
    assert stream.failed  # abandoned
    gate.set()
    _wait_for_no_worker()
    assert ran == [], "a queued op ran after the drain was abandoned"


def test_close_interrupted_in_the_join_restores_the_switch_interval_and_reraises():
    before = sys.getswitchinterval()
    stream = CpuStream(switch_s=1e-5)
    gate, ran = threading.Event(), []
    stream.submit("forward", 0, lambda: gate.wait(10))
    stream.submit("store", 0, lambda: ran.append("store"))
    intr = _Interrupts()
    intr.armed = True
    intr.raised.append("wait")  # only the join is interrupted
    _, join_patch = intr.patches()
    with join_patch, pytest.raises(KeyboardInterrupt):
        stream.close()
    assert sys.getswitchinterval() == before
    stream.close()  # idempotent: the interval is not given back twice
    assert sys.getswitchinterval() == before
    gate.set()
    _wait_for_no_worker()
    assert ran == []


class _Blocking(ToyModel):
    """Blocks the forward of step ``block_at`` on ``gate``; records every forward's step."""

    def __init__(self, block_at: int, gate: threading.Event) -> None:
        super().__init__(vocab=64)
        self.block_at, self.gate, self.steps = block_at, gate, []
        self.blocked = threading.Event()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.steps.append(batch.step)
        if batch.step == self.block_at:
            self.blocked.set()
            self.gate.wait(10)
        return super().forward(batch)


def test_three_ctrl_c_leave_no_queued_op_and_restore_the_switch_interval():
    before = sys.getswitchinterval()
    gate = threading.Event()
    model = _Blocking(block_at=3, gate=gate)
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(random_workload(0, 6, vocab=64, max_new=12), fmap, eos=-1, max_running=4)
    intr = _Interrupts()
    process = sched.process

    def process_then_ctrl_c(result: Any) -> None:
        process(result)
        if result.step == 2:  # step 3 is launched and its forward blocks: the first Ctrl-C
            assert model.blocked.wait(10)
            intr.armed = True
            raise KeyboardInterrupt

    sched.process = process_then_ctrl_c
    wait_patch, join_patch = intr.patches()
    with wait_patch, join_patch, pytest.raises(KeyboardInterrupt):
        OverlapRuntime(model, fmap, overlap=True, stream="worker").run(sched)
    assert intr.raised == ["wait", "join"]
    assert sys.getswitchinterval() == before, "the switch interval stayed lowered"
    assert fmap.in_use == 0
    token_map, err = fmap.token_map.clone(), fmap.err.clone()
    gate.set()  # the running forward finishes; nothing queued behind it may run
    _wait_for_no_worker()
    assert model.steps == [0, 1, 2, 3]
    assert torch.equal(fmap.token_map, token_map) and torch.equal(fmap.err, err), (
        "the worker wrote into the map after the run returned"
    )


def test_an_abandoned_fault_wrapper_abandons_the_stream_it_wraps() -> None:
    """A drain interrupted under a FaultPlan gives up the real stream's queued ops too."""
    from tfuture.streams.backends import InlineStream
    from tfuture.testing.faults import FaultPlan

    inner = InlineStream()
    FaultPlan().wrap_stream(inner).abandon()
    assert inner.failed
