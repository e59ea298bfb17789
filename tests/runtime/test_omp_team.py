"""The host thread's OpenMP team is parked while a CPU worker stream is open
(``tfuture.streams.omp``): the host's helper threads are released and its team size is 1, the
worker keeps torch's intra-op thread count, and the last stream to close restores the host's
size. Without this, libgomp throttles the worker's parallel regions (each ``linear`` of a small
model 4-6x slower with two threads on two cores)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tfuture.streams.backends import CpuStream
from tfuture.streams.omp import HostTeamParked, libgomp

pytestmark = pytest.mark.skipif(libgomp() is None, reason="GNU OpenMP (libgomp) is not loaded by torch here")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(want: int, timeout: float = 5.0) -> int:
    end = time.monotonic() + timeout
    while _threads() != want and time.monotonic() < end:
        time.sleep(0.01)
    return _threads()


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _parallel_op() -> None:
    """Large enough for torch to open a parallel region with every intra-op thread."""
    (torch.ones(512, 512) @ torch.ones(512, 512)).sum()


def test_the_host_team_is_released_and_serial_while_the_worker_keeps_its_threads(two_threads):
    _parallel_op()  # the host thread now owns a pool with one helper thread
    base = _settles_at(_threads())
    stream = CpuStream()
    try:
        # The worker thread came, the host's helper went.
        assert _settles_at(base) == base, "the host thread's OpenMP helper thread was not released"
        assert torch.get_num_threads() == 1
        seen: list[int] = []
        stream.submit("forward", 0, lambda: seen.append(torch.get_num_threads()))
        stream.wait(stream.record())
        assert seen == [2], "the worker must keep torch's intra-op thread count"
    finally:
        stream.close()
    assert torch.get_num_threads() == 2


def test_overlapping_streams_restore_the_host_team_size_once_the_last_closes(two_threads):
    a = CpuStream()
    b = CpuStream()
    a.close()
    assert torch.get_num_threads() == 1, "the first close restored the size while a stream still runs"
    b.close()
    assert torch.get_num_threads() == 2
    b.close()  # idempotent
    assert torch.get_num_threads() == 2


def test_a_release_on_another_thread_leaves_both_threads_alone(two_threads):
    team = HostTeamParked()
    owner = team.acquire()
    assert torch.get_num_threads() == 1
    other: list[int] = []

    def elsewhere() -> None:
        team.release(owner)  # not the owner's thread: ignored
        other.append(torch.get_num_threads())

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert torch.get_num_threads() == 1 and other == [2]
    team.release(owner)
    assert torch.get_num_threads() == 2
    team.release(owner)  # unmatched: nothing to undo
    assert torch.get_num_threads() == 2


def test_the_park_holds_on_a_fresh_thread_whose_torch_init_comes_later(two_threads):
    # An Engine drives its runtime from a background thread: torch's lazy per-thread init of the
    # team size, at that thread's first parallel op, must not undo the park.
    seen: list[int] = []

    def host() -> None:
        team = HostTeamParked()
        owner = team.acquire()
        _parallel_op()
        (torch.ones(1_000_000) * 2).sum()
        seen.append(torch.get_num_threads())
        team.release(owner)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=host)
    t.start()
    t.join()
    assert seen == [1, 2]


def test_a_run_gives_the_same_tokens_and_restores_the_size(two_threads):
    from tfuture import FutureMap
    from tfuture.runtime import OverlapRuntime
    from tfuture.testing import ContinuousBatcher, ToyModel, random_workload

    specs = random_workload(3, 6, vocab=64, max_new=8)
    outs = []
    for stream in ("inline", "worker"):
        fmap = FutureMap(32, device="cpu")
        sched = ContinuousBatcher(specs, fmap, max_running=4)
        OverlapRuntime(ToyModel(vocab=64), fmap, stream=stream).run(sched)
        outs.append(sched.outputs)
        assert torch.get_num_threads() == 2
    assert outs[0] == outs[1]


def test_an_interrupt_while_parking_gives_the_size_and_the_switch_interval_back(two_threads, monkeypatch):
    import sys

    from tfuture.streams import omp

    before = sys.getswitchinterval()
    real = omp.HOST_TEAM._lib

    class Interrupted:
        """libgomp whose pause is interrupted (a Ctrl-C between the two calls)."""

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def omp_pause_resource_all(self, kind: int) -> int:
            raise KeyboardInterrupt

    monkeypatch.setattr(omp.HOST_TEAM, "_lib", Interrupted())
    with pytest.raises(KeyboardInterrupt):
        CpuStream()
    assert torch.get_num_threads() == 2 and sys.getswitchinterval() == before
    monkeypatch.setattr(omp.HOST_TEAM, "_lib", real)
    stream = CpuStream()  # parks again: the failed acquire left no user behind
    assert torch.get_num_threads() == 1
    stream.close()
    assert torch.get_num_threads() == 2
