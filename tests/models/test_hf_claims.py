"""One ``HFCausalLM`` serves one run at a time: a second runtime that runs it while the first one
runs is refused (``RuntimeError``) and its ``close()`` leaves the first run's KV rows alone; the
claim is given back when a run ends, cleanly or not."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tfuture import FutureMap
from tfuture.examples.hf import build_llama
from tfuture.models import HFCausalLM
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, RequestSpec, random_workload

VOCAB = 96
SPECS = random_workload(2, 4, vocab=VOCAB, max_prompt=8, max_new=8, arrival_span=0)


def generate(model: Any, specs: list[RequestSpec]) -> dict[int, list[int]]:
    out = {}
    with torch.inference_mode():
        for s in specs:
            ids = model.generate(
                torch.as_tensor(s.prompt)[None], max_new_tokens=s.max_new, do_sample=False, pad_token_id=0
            )
            out[s.rid] = ids[0, s.prompt.size :].tolist()
    return out


class Pausing(ContinuousBatcher):
    """Stops in ``process`` of step ``at`` until ``go`` is set (``paused`` says it got there);
    raises there instead with ``fail``."""

    def __init__(self, *args: Any, at: int, fail: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.at, self.fail = at, fail
        self.paused, self.go = threading.Event(), threading.Event()

    def process(self, result: Any) -> None:
        super().process(result)
        if result.step == self.at:
            self.paused.set()
            assert self.go.wait(30)
            if self.fail:
                raise KeyError("planted failure in process")


def run(adapter: HFCausalLM, specs: list[RequestSpec], sched: ContinuousBatcher | None = None) -> dict:
    fmap = FutureMap(32, device="cpu") if sched is None else sched.fmap
    sched = sched or ContinuousBatcher(specs, fmap, eos=-1, max_running=4)
    with torch.inference_mode():
        OverlapRuntime(adapter, fmap).run(sched)
    assert fmap.in_use == 0
    return sched.outputs


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:
            box["err"] = e

    t = threading.Thread(target=target)
    t.start()
    return t, box


@pytest.mark.parametrize("stream", ["worker", "inline"])
def test_a_second_runtime_is_refused_while_the_first_runs(stream):
    model = build_llama(vocab=VOCAB, hidden=32, layers=2)
    ref = generate(model, SPECS)
    adapter = HFCausalLM(model, max_requests=4, max_len=24)
    fmap = FutureMap(32, device="cpu")
    first = Pausing(SPECS, fmap, eos=-1, max_running=4, at=2)

    def run_first() -> dict:
        # Sync mode: its stream is idle while the other runtime runs (the Triton interpreter
        # that runs the kernels on CPU in the tests is not thread-safe).
        with torch.inference_mode():
            OverlapRuntime(adapter, fmap, overlap=False, stream=stream).run(first)
        return first.outputs

    t, box = in_thread(run_first)
    try:
        assert first.paused.wait(60), box
        other_map = FutureMap(32, device="cpu")
        other = ContinuousBatcher(SPECS, other_map, eos=-1, max_running=4)
        with torch.inference_mode(), pytest.raises(RuntimeError, match="in use by another running runtime"):
            OverlapRuntime(adapter, other_map, stream=stream).run(other)
        assert other_map.in_use == 0
        assert adapter.pool.n_free < 4, "the refused run's close() freed the running one's rows"
    finally:
        first.go.set()
        t.join(60)
    assert "err" not in box, box.get("err")
    assert box["out"] == ref  # its KV rows were never freed or shared under it
    assert adapter.pool.n_free == 4
    # Its clean end gave the adapter back: another thread runs it now.
    t, box = in_thread(lambda: run(adapter, SPECS))
    t.join(60)
    assert box.get("out") == ref, box.get("err")


def test_a_failed_run_gives_the_adapter_back():
    model = build_llama(vocab=VOCAB, hidden=32, layers=2)
    adapter = HFCausalLM(model, max_requests=4, max_len=24)
    fmap = FutureMap(32, device="cpu")
    failing = Pausing(SPECS, fmap, eos=-1, max_running=4, at=1, fail=True)
    failing.go.set()

    def run_failing() -> None:
        with torch.inference_mode():
            OverlapRuntime(adapter, fmap).run(failing)

    t, box = in_thread(run_failing)
    t.join(60)
    assert isinstance(box.get("err"), KeyError) and fmap.in_use == 0
    assert adapter.pool.n_free == 4
    assert run(adapter, SPECS) == generate(model, SPECS)  # on another thread: not refused


def test_a_run_that_never_forwarded_does_not_clear_the_running_ones_rows():
    """close() of a run that never claimed the adapter (an empty scheduler) is a no-op for it."""
    model = build_llama(vocab=VOCAB, hidden=32, layers=2)
    ref = generate(model, SPECS)
    adapter = HFCausalLM(model, max_requests=4, max_len=24)
    fmap = FutureMap(32, device="cpu")
    first = Pausing(SPECS, fmap, eos=-1, max_running=4, at=1)

    def run_first() -> dict:
        with torch.inference_mode():
            OverlapRuntime(adapter, fmap).run(first)
        return first.outputs

    t, box = in_thread(run_first)
    try:
        assert first.paused.wait(60), box
        held = dict(adapter.pool.rows)
        assert run(adapter, []) == {}  # no step: its close() is not the running run's
        assert adapter.pool.rows == held
    finally:
        first.go.set()
        t.join(60)
    assert box.get("out") == ref, box.get("err")
    assert np.all(adapter.pool.n_free == 4)
