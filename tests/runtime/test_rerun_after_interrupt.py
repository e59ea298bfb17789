"""Ctrl-C while a run's error path drains the CPU worker stream, then the same runtime (same
Sampler, same request ids) runs again (issue 30 item 4): the step the worker was running when
the drain was abandoned still finishes its ops (sample, record, store) after the run returned;
the next run waits for them and frees what they wrote, so it gives the tokens of a clean run."""

from __future__ import annotations

import threading
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from support import WORKER_NAME, worker_threads

from tfuture import FutureMap
from tfuture.core.batch import ForwardBatch
from tfuture.core.params import SamplingParams
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.scheduler import RequestSpec
from tfuture.streams.backends import CpuStream
from tfuture.testing import ContinuousBatcher, ToyModel

VOCAB = 64


def specs() -> list[RequestSpec]:
    """Seeded sampling with penalties: tokens depend on the Sampler's history rows."""
    rng = np.random.default_rng(0)
    params = [
        SamplingParams(temperature=0.8, seed=rid + 1, repetition_penalty=1.5, frequency_penalty=0.5)
        for rid in range(4)
    ]
    return [RequestSpec(rid, 0, rng.integers(1, VOCAB, 5), 12, params=params[rid]) for rid in range(4)]


def clean_run() -> dict[int, list[int]]:
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(specs(), fmap, eos=-1, max_running=4)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap, sampler=Sampler(history_rows=8)).run(sched)
    return {rid: list(out) for rid, out in sched.outputs.items()}


class Blocking(ToyModel):
    """Step ``block_at``'s forward waits on ``gate``; ``on_forward(batch)`` hears every forward."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB)
        self.gate, self.blocked = threading.Event(), threading.Event()
        self.block_at: int | None = None
        self.on_forward: Any = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.on_forward is not None:
            self.on_forward(batch)
        if batch.step == self.block_at:
            self.block_at = None
            self.blocked.set()
            self.gate.wait(30)
        return super().forward(batch)


def test_a_rerun_after_an_interrupted_drain_gives_the_tokens_of_a_clean_run():
    ref = clean_run()
    model = Blocking()
    model.block_at = 3
    fmap = FutureMap(64, device="cpu")
    runtime = OverlapRuntime(model, fmap, overlap=True, stream="worker", sampler=Sampler(history_rows=8))
    sched = ContinuousBatcher(specs(), fmap, eos=-1, max_running=4)
    armed, raised = threading.Event(), []
    real_wait, real_join = CpuStream.wait, threading.Thread.join
    process = sched.process

    def process_then_ctrl_c(result: Any) -> None:
        process(result)
        if result.step == 2:  # step 3's forward is running and blocks: the first Ctrl-C
            assert model.blocked.wait(10)
            armed.set()
            raise KeyboardInterrupt

    def wait(stream: CpuStream, marker: Any) -> None:
        if armed.is_set() and "wait" not in raised:
            raised.append("wait")  # the second Ctrl-C: in the drain
            raise KeyboardInterrupt
        real_wait(stream, marker)

    def join(thread: threading.Thread, timeout: float | None = None) -> None:
        if armed.is_set() and thread.name == WORKER_NAME and "join" not in raised:
            raised.append("join")  # the third: in the close
            raise KeyboardInterrupt
        real_join(thread, timeout)

    sched.process = process_then_ctrl_c
    with mock.patch.object(CpuStream, "wait", wait), mock.patch.object(threading.Thread, "join", join):
        with pytest.raises(KeyboardInterrupt):
            runtime.run(sched)
    assert raised == ["wait", "join"]
    (old,) = worker_threads()  # still in step 3's forward

    # The old step resumes at the latest possible moment: when the rerun waits for it (fixed),
    # or else in the rerun's second forward, whose step then races the old step's late ops.
    def release_old(thread: threading.Thread, timeout: float | None = None) -> None:
        if thread is old:
            model.gate.set()
        real_join(thread, timeout)

    def on_forward(batch: ForwardBatch) -> None:
        if batch.step == 1 and not model.gate.is_set():
            model.gate.set()
            real_join(old, 10)

    model.on_forward = on_forward
    rerun = ContinuousBatcher(specs(), fmap, eos=-1, max_running=4)
    with mock.patch.object(threading.Thread, "join", release_old):
        runtime.run(rerun)
    assert {rid: list(out) for rid, out in rerun.outputs.items()} == ref
    assert fmap.in_use == 0 and not old.is_alive() and not worker_threads()


def test_another_runtime_on_the_sampler_is_refused_until_the_interrupted_step_ended():
    model = Blocking()
    model.block_at = 1
    fmap = FutureMap(64, device="cpu")
    sampler = Sampler(history_rows=8)
    runtime = OverlapRuntime(model, fmap, overlap=True, stream="worker", sampler=sampler)
    sched = ContinuousBatcher(specs(), fmap, eos=-1, max_running=4)
    process = sched.process

    def process_then_ctrl_c(result: Any) -> None:
        process(result)
        if result.step == 0:
            assert model.blocked.wait(10)
            raise KeyboardInterrupt

    sched.process = process_then_ctrl_c
    real_join = threading.Thread.join

    raised: list[str] = []

    def join(thread: threading.Thread, timeout: float | None = None) -> None:
        if thread.name == WORKER_NAME and "join" not in raised:
            raised.append("join")
            raise KeyboardInterrupt  # Ctrl-C while the close waits for the blocked step
        real_join(thread, timeout)

    real_wait = CpuStream.wait

    def wait(stream: CpuStream, marker: Any) -> None:
        if model.blocked.is_set() and "wait" not in raised:
            raised.append("wait")
            raise KeyboardInterrupt  # Ctrl-C in the drain, while step 1's forward is blocked
        real_wait(stream, marker)

    with mock.patch.object(threading.Thread, "join", join):
        with mock.patch.object(CpuStream, "wait", wait), pytest.raises(KeyboardInterrupt):
            runtime.run(sched)
        other_fmap = FutureMap(64, device="cpu")
        other = OverlapRuntime(ToyModel(vocab=VOCAB), other_fmap, sampler=sampler)
        with pytest.raises(RuntimeError, match="Sampler is in use by another running runtime"):
            other.run(ContinuousBatcher(specs(), other_fmap, eos=-1, max_running=4))
    assert raised == ["wait", "join"]
    model.gate.set()
    runtime.close()  # waits for the step, then gives the Sampler back
    assert not worker_threads()
    other.run(ContinuousBatcher(specs(), other_fmap, eos=-1, max_running=4))
