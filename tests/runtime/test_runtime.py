"""The overlap runtime (``tfuture.runtime``) on the CPU backend: equivalence with sync under
delays, grammar masks, back pressure, failures and bad arguments."""

from __future__ import annotations

import random
import traceback

import numpy as np
import pytest
import torch
from support import worker_threads

from tfuture import FutureMap, FutureMapFull
from tfuture.core.batch import Batch
from tfuture.kernels import _common
from tfuture.runtime import OverlapRuntime
from tfuture.testing import (
    ContinuousBatcher,
    TinyTransformer,
    ToyGrammar,
    ToyModel,
    assert_equivalent,
    check_equivalence,
    random_workload,
    run_workload,
)
from tfuture.testing.faults import FaultPlan

VOCAB = 64


def random_delay(seed: int, scale: float = 5e-4, ops: tuple[str, ...] = ("prepare", "sample")):
    """A ``delay`` hook that sleeps up to ``scale`` seconds before the forward-stream ops ``ops``."""
    rng = random.Random(seed)
    return lambda name: rng.random() * scale if name in ops else 0.0


WORKLOADS = [
    pytest.param(dict(seed=1, n=10), dict(max_running=4), id="mixed"),
    pytest.param(
        dict(seed=2, n=6, max_prompt=40), dict(max_running=3, chunk=4, token_budget=6), id="chunked"
    ),
    # One request at a time runs its requests back to back: 5 of them show the hand-over.
    pytest.param(dict(seed=3, n=5), dict(max_running=1), id="max-running-1"),
    pytest.param(dict(seed=4, n=10, arrival_span=30), dict(max_running=4), id="arrivals"),
    pytest.param(dict(seed=5, n=8, grammar_share=0.5), dict(max_running=4), id="grammar"),
]
DELAYS = {
    "delay-prepare": ("prepare",),
    "delay-sample": ("sample",),
    "delay-all": ("prepare", "forward", "sample", "copy"),
}


@pytest.mark.parametrize("delay_ops", DELAYS.values(), ids=DELAYS.keys())
@pytest.mark.parametrize(("wl", "kw"), WORKLOADS)
def test_overlap_equals_sync(wl, kw, delay_ops):
    wl = dict(wl)
    seed = wl.pop("seed")
    specs = random_workload(seed, wl.pop("n"), vocab=VOCAB, max_new=10, **wl)
    grammar = ToyGrammar(VOCAB, seed=seed)
    report = assert_equivalent(
        lambda: ToyModel(vocab=VOCAB),
        specs,
        delay=random_delay(seed, ops=delay_ops),
        grammar=grammar,
        capacity=32,
        **kw,
    )
    assert set(report.sync) == {s.rid for s in specs}
    for s in specs:
        assert len(report.sync[s.rid]) <= s.max_new
    assert not worker_threads()


def test_transformer_overlap_equals_sync_under_delays():
    specs = random_workload(81, 6, vocab=VOCAB, max_new=10, max_prompt=20, grammar_share=0.3)
    report = assert_equivalent(
        lambda: TinyTransformer(VOCAB, max_requests=6, max_len=40),
        specs,
        grammar=ToyGrammar(VOCAB, seed=81),
        delay=random_delay(81, 1e-3, ("prepare", "forward", "sample")),
        capacity=32,
        max_running=3,
        chunk=5,
    )
    assert sum(len(t) for t in report.sync.values()) > 2 * len(specs)


@pytest.fixture(params=["kernels", "numpy"])
def kernel_path(request, monkeypatch):
    """A CPU map's two paths: the Triton kernels (the interpreter on a CPU machine, as the rest of
    this file runs them) and the numpy path a CPU map takes outside the interpreter."""
    if request.param == "numpy":
        monkeypatch.setattr(_common, "INTERPRET", False)
    return request.param


@pytest.mark.parametrize(("wl", "kw"), [WORKLOADS[0], WORKLOADS[1], WORKLOADS[4]])
def test_overlap_equals_sync_on_the_numpy_path(wl, kw, monkeypatch):
    # test_overlap_equals_sync runs the kernels (the interpreter); this is a CPU map's own path.
    monkeypatch.setattr(_common, "INTERPRET", False)
    wl = dict(wl)
    seed = wl.pop("seed")
    specs = random_workload(seed, wl.pop("n"), vocab=VOCAB, max_new=10, **wl)
    report = assert_equivalent(
        lambda: ToyModel(vocab=VOCAB),
        specs,
        delay=random_delay(seed, ops=DELAYS["delay-all"]),
        grammar=ToyGrammar(VOCAB, seed=seed),
        capacity=32,
        **kw,
    )
    assert set(report.sync) == {s.rid for s in specs}


def test_outputs_match_plain_generation(kernel_path):
    specs = random_workload(11, 8, vocab=VOCAB, max_new=12)
    model = ToyModel(vocab=VOCAB)
    outputs, *_ = run_workload(model, specs, overlap=True, capacity=32, max_running=4, eos=0)
    for s in specs:
        assert outputs[s.rid] == model.reference(s.prompt, s.rid, s.max_new, eos=0), s.rid


def test_grammar_obeyed_under_overlap_with_delays():
    specs = random_workload(21, 10, vocab=VOCAB, max_new=12, grammar_share=1.0)
    grammar = ToyGrammar(VOCAB, seed=21, density=0.1)
    outputs, _, _, fmap = run_workload(
        ToyModel(vocab=VOCAB),
        specs,
        overlap=True,
        grammar=grammar,
        delay=random_delay(21, 1e-3, ("forward", "sample")),
        capacity=32,
        max_running=4,
        eos=-1,
    )
    for s in specs:
        assert grammar.accepts(outputs[s.rid]), s.rid
    free = ToyModel(vocab=VOCAB)
    unconstrained = [free.reference(s.prompt, s.rid, s.max_new) for s in specs]
    # The mask really changed the outcome somewhere, so the check above is not vacuous.
    assert any(outputs[s.rid] != u for s, u in zip(specs, unconstrained, strict=True))
    assert fmap.in_use == 0


def test_extra_step_tokens_are_discarded():
    # eos=1 with vocab 8 ends requests early and often, so overlap runs extra steps.
    specs = random_workload(31, 12, vocab=8, max_new=30)
    report = check_equivalence(lambda: ToyModel(vocab=8), specs, capacity=32, max_running=6, eos=1)
    assert report.ok, report.message
    assert report.extra_tokens > 0
    assert any(toks[-1] == 1 and len(toks) < s.max_new for s in specs for toks in [report.sync[s.rid]])


def test_tiny_map_back_pressure():
    specs = random_workload(41, 8, vocab=VOCAB, max_new=8)
    report = assert_equivalent(lambda: ToyModel(vocab=VOCAB), specs, capacity=3, max_running=4)
    assert report.overlap_stats.steps > 0


def test_debug_map_no_false_positive_under_delays():
    specs = random_workload(51, 6, vocab=VOCAB, max_new=6, grammar_share=0.5)
    assert_equivalent(
        lambda: ToyModel(vocab=VOCAB),
        specs,
        grammar=ToyGrammar(VOCAB, seed=51),
        delay=random_delay(51, 1e-3, ("prepare", "forward", "sample", "debug")),
        debug=True,
        capacity=16,
        max_running=3,
    )


class _FailingScheduler(ContinuousBatcher):
    def __init__(self, *args, fail: str, at: int, **kw):
        super().__init__(*args, **kw)
        self.fail, self.at, self.calls = fail, at, {"schedule": 0, "process": 0, "build_mask": 0}

    def _maybe_fail(self, hook: str) -> None:
        self.calls[hook] += 1
        if hook == self.fail and self.calls[hook] == self.at:
            raise KeyError(f"planted failure in {hook}")

    def schedule(self):
        self._maybe_fail("schedule")
        return super().schedule()

    def process(self, result):
        self._maybe_fail("process")
        super().process(result)

    def build_mask(self, batch):
        self._maybe_fail("build_mask")
        return super().build_mask(batch)


FAILURES = {
    "forward": RuntimeError,
    "sample": RuntimeError,
    "schedule": KeyError,
    "process": KeyError,
    "build_mask": KeyError,
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("where", FAILURES)
def test_failure_surfaces_and_loop_stops_cleanly(overlap, where):
    specs = random_workload(61, 6, vocab=VOCAB, max_new=8, grammar_share=0.5)
    model = ToyModel(vocab=VOCAB)
    if where == "forward":
        model.fail_at = 3
    if where == "sample":
        model.fail_sample_at = 3
    fmap = FutureMap(32, device="cpu")
    sched = _FailingScheduler(
        specs, fmap, grammar=ToyGrammar(VOCAB, seed=61), max_running=4, fail=where, at=3
    )
    runtime = OverlapRuntime(model, fmap, overlap=overlap, delay=random_delay(61, 1e-3))
    with pytest.raises(FAILURES[where], match=f"planted failure in {where}") as info:
        runtime.run(sched)
    frames = "".join(traceback.format_tb(info.value.__traceback__))
    assert f"in {where}" in frames  # the original frame where it was raised
    if where in ("forward", "sample"):
        assert any("forward stream" in n for n in getattr(info.value, "__notes__", []))
    assert fmap.in_use == 0
    assert not worker_threads()


def test_map_full_raises_and_releases():
    class Greedy:
        """Allocates a placeholder handle per step and never lets any go: overruns the map."""

        def __init__(self, fmap):
            self.fmap, self.steps = fmap, 0

        def schedule(self):
            self.steps += 1
            n = 3
            return Batch(
                np.arange(1, n + 1),
                np.ones(n, dtype=np.int64),
                np.zeros(n, dtype=np.int64),
                np.arange(n),
                np.ones(n, dtype=bool),
            )

        def process(self, result):
            self.held = [*getattr(self, "held", []), result.batch.out.filter(np.arange(3))]

        def build_mask(self, batch):
            return None

    fmap = FutureMap(8, device="cpu")
    sched = Greedy(fmap)
    with pytest.raises(FutureMapFull, match=r"of 8 in use"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    held = sum(len(h) for h in sched.held)
    assert fmap.in_use == held  # only what the scheduler itself still holds
    for h in sched.held:
        fmap.release(h)
    assert fmap.in_use == 0 and not worker_threads()


def test_a_map_is_driven_by_one_runtime_at_a_time():
    specs = random_workload(62, 3, vocab=VOCAB, max_new=4)
    fmap = FutureMap(16, device="cpu")
    second = OverlapRuntime(ToyModel(vocab=VOCAB), fmap)
    refused: list[Exception] = []

    class Intruder(ContinuousBatcher):
        """Tries to start a second runtime on the map from inside the first one's loop."""

        def schedule(self):
            if not refused:
                with pytest.raises(RuntimeError, match="already driven by a running OverlapRuntime") as e:
                    second.run(ContinuousBatcher(specs, fmap))
                refused.append(e.value)
            return super().schedule()

    first = Intruder(specs, fmap, max_running=2)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(first)
    assert refused and fmap.in_use == 0
    # Once the first run is over, the map is free for the other runtime.
    again = ContinuousBatcher(specs, fmap, max_running=2)
    second.run(again)
    assert again.outputs == first.outputs and fmap.in_use == 0 and not worker_threads()


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        pytest.param(dict(fmap="not a map"), TypeError, "fmap must be a FutureMap", id="not-a-map"),
        pytest.param(dict(n_staging=1), ValueError, "n_staging must be >= 3", id="n-staging"),
        pytest.param(dict(stream="gpu"), ValueError, "stream must be one of", id="stream"),
        pytest.param(dict(faults={"seed": 1}), TypeError, "faults must be a RunWrapper", id="faults"),
    ],
)
def test_runtime_rejects_bad_arguments(kw, exc, match):
    kw = {"fmap": FutureMap(4, device="cpu"), **kw}
    with pytest.raises(exc, match=match):
        OverlapRuntime(ToyModel(), **kw)


def test_run_rejects_a_bad_step_limit():
    fmap = FutureMap(4, device="cpu")
    runtime = OverlapRuntime(ToyModel(), fmap, faults=FaultPlan())
    with pytest.raises(ValueError, match="max_steps"):
        runtime.run(ContinuousBatcher([], fmap), max_steps=-1)
    assert not worker_threads()


@pytest.mark.gpu
def test_overlap_equals_sync_on_cuda():
    specs = random_workload(71, 16, vocab=VOCAB, max_new=16, grammar_share=0.3)
    assert_equivalent(
        lambda: ToyModel(vocab=VOCAB, work_s=2e-4),
        specs,
        grammar=ToyGrammar(VOCAB, seed=71),
        delay=random_delay(71, 5e-4),
        capacity=64,
        device="cuda",
        max_running=8,
    )
    assert torch.cuda.is_available()
