"""The forward-stream backends (``tfuture.streams.backends``) on CPU: the worker thread and the inline
stream keep FIFO order, markers wait for the work before them, a failing op poisons the stream,
and the worker runs in its creator's grad mode with the GIL switch interval restored after."""

from __future__ import annotations

import sys
import time
import traceback

import pytest
import torch
from support import worker_threads

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.streams.backends import CpuStream, InlineStream, drain_and_close, make_stream
from tfuture.testing import ContinuousBatcher, ToyGrammar, ToyModel, random_workload

CPU = torch.device("cpu")
BACKENDS = ["worker", "inline"]


def _planted_failure() -> None:
    raise KeyError("planted failure on the stream")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_run_in_order_and_a_marker_waits_for_them(backend):
    stream = make_stream(CPU, backend=backend)
    ran: list[int] = []
    # The first op is slow: a marker recorded after all five must still wait for every one.
    stream.submit("prepare", 0, lambda: (time.sleep(0.02), ran.append(0)))
    for i in range(1, 5):
        stream.submit("forward", i, lambda i=i: ran.append(i))
    stream.wait(stream.record())
    assert ran == [0, 1, 2, 3, 4]
    spans = stream.take_spans()
    assert [(s.name, s.step) for s in spans] == [("prepare", 0), *(("forward", i) for i in range(1, 5))]
    assert all(s.end >= s.start for s in spans) and spans[0].end - spans[0].start >= 0.02
    assert stream.take_spans() == []
    stream.close()
    stream.close()  # idempotent
    assert not worker_threads()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failing_op_poisons_the_stream(backend):
    stream = make_stream(CPU, backend=backend)
    ran: list[str] = []
    stream.submit("prepare", 2, lambda: ran.append("before"))
    stream.submit("forward", 3, _planted_failure)
    stream.submit("sample", 3, lambda: ran.append("after"))
    with pytest.raises(KeyError, match="planted failure on the stream") as info:
        stream.wait(stream.record())
    assert ran == ["before"]  # work after the failure is skipped
    assert stream.failed
    assert "tfuture: raised on the forward stream in 'forward' of step 3" in info.value.__notes__
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "_planted_failure"  # the original traceback
    # The failure sticks: every later wait raises it again, and later work is skipped.
    stream.submit("copy", 4, lambda: ran.append("later"))
    with pytest.raises(KeyError) as again:
        stream.wait(stream.record())
    assert again.value is info.value and ran == ["before"]
    drain_and_close(stream)  # swallows the stream's own failure
    assert not worker_threads()


@pytest.mark.parametrize("backend", BACKENDS)
def test_delay_hook_runs_before_each_op(backend):
    asked: list[str] = []

    def delay(name: str) -> float:
        asked.append(name)
        return 1e-3 if name == "forward" else 0.0

    stream = make_stream(CPU, delay=delay, trace=False, backend=backend)
    for name in ("prepare", "forward", "sample"):
        stream.submit(name, 0, lambda: None)
    stream.wait(stream.record())
    assert asked == ["prepare", "forward", "sample"]  # ops only: markers are not delayed
    assert stream.take_spans() == []  # trace=False records no span
    stream.close()


def test_make_stream_picks_the_backend():
    worker, inline = make_stream(CPU), make_stream(CPU, backend="inline")
    assert isinstance(worker, CpuStream) and isinstance(inline, InlineStream)
    worker.close()
    inline.close()
    with pytest.raises(ValueError, match="stream backend must be one of"):
        make_stream(CPU, backend="threads")
    with pytest.raises(ValueError, match="'inline' is for CPU maps"):
        make_stream(torch.device("cuda"), backend="inline")


def test_a_closed_worker_refuses_work():
    stream = CpuStream()
    stream.close()
    assert not stream.alive
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit("forward", 0, lambda: None)


MODES = {
    "default": (torch.enable_grad, (False, True)),
    "no-grad": (torch.no_grad, (False, False)),
    "inference-mode": (torch.inference_mode, (True, False)),
}


@pytest.mark.parametrize(("mode", "want"), MODES.values(), ids=MODES.keys())
def test_the_worker_runs_in_its_creators_grad_mode(mode, want):
    with mode():
        stream = CpuStream()
    seen: list[tuple[bool, bool]] = []
    stream.submit(
        "forward", 0, lambda: seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
    )
    stream.wait(stream.record())
    stream.close()
    assert seen == [want]


def test_switch_interval_is_lowered_while_workers_run_and_restored_exactly():
    before = sys.getswitchinterval()
    a = CpuStream(switch_s=1e-4)
    assert sys.getswitchinterval() <= 1e-4
    b = CpuStream(switch_s=1e-5)
    assert sys.getswitchinterval() <= 1e-5
    # Lifetimes overlap: the first to close must not restore it while the other still runs.
    a.close()
    assert sys.getswitchinterval() <= 1e-5
    b.close()
    assert sys.getswitchinterval() == before


def test_the_inline_backend_runs_the_runtime_on_the_calling_thread():
    specs = random_workload(3, 6, vocab=64, max_new=8, grammar_share=0.5)
    grammar = ToyGrammar(64, seed=3)
    outputs = {}
    for stream in ("inline", "worker"):
        fmap = FutureMap(32, device="cpu")
        sched = ContinuousBatcher(specs, fmap, grammar=grammar, max_running=4)
        process = sched.process
        threads: list[int] = []

        def spy(result, process=process, threads=threads):
            threads.append(len(worker_threads()))
            process(result)

        sched.process = spy
        OverlapRuntime(ToyModel(vocab=64), fmap, stream=stream).run(sched)
        assert fmap.in_use == 0 and not worker_threads()
        # No worker thread ever ran for the inline backend; one ran throughout for the worker.
        assert set(threads) == ({0} if stream == "inline" else {1})
        outputs[stream] = sched.outputs
    assert outputs["inline"] == outputs["worker"]
