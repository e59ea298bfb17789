"""The overlap runtime on the CPU backend: equivalence with sync, ordering, failures, idle state."""

from __future__ import annotations

import json
import random
import threading
import traceback

import numpy as np
import pytest
import torch

from tfuture import FutureError, FutureMap, FutureMapFull
from tfuture.batch import Batch, StepResult
from tfuture.runtime import OverlapRuntime
from tfuture.testing import (
    ContinuousBatcher,
    RequestSpec,
    TinyTransformer,
    ToyGrammar,
    ToyModel,
    assert_equivalent,
    check_equivalence,
    first_difference,
    random_workload,
    run_workload,
)

VOCAB = 64


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tfuture-forward"]


def random_delay(seed: int, scale: float = 5e-4, ops: tuple[str, ...] = ("prepare", "sample")):
    rng = random.Random(seed)
    return lambda name: rng.random() * scale if name in ops else 0.0


WORKLOADS = [
    pytest.param(dict(seed=1, n=10), dict(max_running=4), id="mixed"),
    pytest.param(
        dict(seed=2, n=6, max_prompt=40), dict(max_running=3, chunk=4, token_budget=6), id="chunked"
    ),
    pytest.param(dict(seed=3, n=8), dict(max_running=1), id="max-running-1"),
    pytest.param(dict(seed=4, n=10, arrival_span=30), dict(max_running=4), id="arrivals"),
    pytest.param(dict(seed=5, n=8, grammar_share=0.5), dict(max_running=4), id="grammar"),
]


@pytest.mark.parametrize("delay_ops", [("prepare",), ("sample",), ("prepare", "forward", "sample", "copy")])
@pytest.mark.parametrize("wl,kw", WORKLOADS)
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
    specs = random_workload(81, 8, vocab=VOCAB, max_new=10, max_prompt=20, grammar_share=0.3)
    report = assert_equivalent(
        lambda: TinyTransformer(VOCAB, max_requests=8, max_len=40),
        specs,
        grammar=ToyGrammar(VOCAB, seed=81),
        delay=random_delay(81, 1e-3, ("prepare", "forward", "sample")),
        capacity=32,
        max_running=3,
        chunk=5,
    )
    assert sum(len(t) for t in report.sync.values()) > 2 * len(specs)


def test_transformer_reads_the_whole_sequence():
    # Same last token and position, different earlier prompt: a context-free model would agree.
    a = RequestSpec(0, 0, np.array([5, 9, 9, 7]), 6)
    b = RequestSpec(0, 0, np.array([6, 9, 9, 7]), 6)
    outs = [
        run_workload(TinyTransformer(VOCAB, max_requests=2, max_len=16), [s], overlap=True, eos=-1)[0]
        for s in (a, b)
    ]
    assert outs[0][0] != outs[1][0]


def test_outputs_match_plain_generation():
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


def test_first_difference_is_readable():
    msg = first_difference({1: [4, 5, 6]}, {1: [4, 5, 7]}, ("sync", "overlap"))
    assert msg is not None and "request 1: token 2 differs: sync 6, overlap 7" in msg
    assert first_difference({1: [4]}, {}, ("a", "b")) == "request 1: missing from the b run"
    assert first_difference({1: [4]}, {1: [4]}, ("a", "b")) is None


def test_bubble_accounting_and_trace(tmp_path):
    specs = [RequestSpec(i, 0, np.array([i + 1, 2]), 6) for i in range(4)]
    _, stats, _, _ = run_workload(
        ToyModel(vocab=VOCAB, work_s=1e-3), specs, overlap=True, capacity=16, eos=-1
    )
    names = {s.name for s in stats.device_spans}
    assert {"prepare", "forward", "sample", "copy"} <= names
    assert stats.steps == 6 and stats.device_busy > 6e-3
    assert 0.0 <= stats.idle_fraction < 1.0
    assert all(s.end >= s.start for s in stats.device_spans)
    path = tmp_path / "trace.json"
    stats.write_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}


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


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize(
    "where,exc_type,text",
    [
        ("forward", RuntimeError, "planted failure in forward"),
        ("sample", RuntimeError, "planted failure in sample"),
        ("schedule", KeyError, "planted failure in schedule"),
        ("process", KeyError, "planted failure in process"),
        ("build_mask", KeyError, "planted failure in build_mask"),
    ],
)
def test_failure_surfaces_and_loop_stops_cleanly(overlap, where, exc_type, text):
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
    with pytest.raises(exc_type, match=text) as info:
        runtime.run(sched)
    frames = "".join(traceback.format_tb(info.value.__traceback__))
    origin = {"forward": "forward", "sample": "sample"}.get(where, where)
    assert f"in {origin}" in frames  # the original frame where it was raised
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


def test_bad_placeholder_raises_at_next_sync():
    class Planted:
        def __init__(self):
            self.n = 0

        def schedule(self):
            self.n += 1
            if self.n > 3:
                return None
            ids = np.array([5, -9999 if self.n == 2 else 6])
            return Batch(ids, np.array([1, 1]), np.array([0, 0]), np.array([0, 1]), np.array([True, True]))

        def process(self, result: StepResult) -> None:
            pass

        def build_mask(self, batch):
            return None

    fmap = FutureMap(8, device="cpu")
    with pytest.raises(FutureError, match="-9999"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(Planted())
    assert fmap.in_use == 0 and not worker_threads()


def test_empty_batch_is_a_noop_step():
    class Idle:
        def __init__(self):
            self.n = 0
            self.results = []

        def schedule(self):
            self.n += 1
            if self.n > 3:
                return None
            e = np.zeros(0, dtype=np.int64)
            return Batch(e, e, e, e, np.zeros(0, dtype=bool))

        def process(self, result):
            self.results.append(result.tokens.size)

        def build_mask(self, batch):
            return None

    fmap = FutureMap(4, device="cpu")
    sched = Idle()
    stats = OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    assert stats.steps == 3 and sched.results == [0, 0, 0] and fmap.in_use == 0


@pytest.mark.parametrize(
    "field,value,err",
    [
        ("tokens", [1, 2], TypeError),
        ("seg_lens", np.array([1.0]), TypeError),
        ("prefix_lens", np.array([0, 0]), ValueError),
        ("sample", np.array([1]), TypeError),
        ("seg_lens", np.array([0]), ValueError),
        ("tokens", np.array([1, 2]), ValueError),
    ],
)
def test_batch_validation(field, value, err):
    kw = dict(
        tokens=np.array([1]),
        seg_lens=np.array([1]),
        prefix_lens=np.array([0]),
        req_ids=np.array([0]),
        sample=np.array([True]),
    )
    kw[field] = value
    with pytest.raises(err, match=f"Batch.{field}"):
        Batch(**kw)


def test_runtime_rejects_bad_arguments():
    with pytest.raises(TypeError, match="FutureMap"):
        OverlapRuntime(ToyModel(), "not a map")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_staging"):
        OverlapRuntime(ToyModel(), FutureMap(4, device="cpu"), n_staging=1)


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
