"""Step graphs (``OverlapRuntime(..., buckets=, graphs=True)``, tfuture.steps.graphs): a greedy step
that fits a bucket runs as the bucket's captured step, everything else eagerly, and the tokens
equal a run without graphs bit for bit. On CPU the capture is emulated (the first step's ops
re-run on the same static buffers), which tests the bookkeeping: bucket choice, static buffers,
the staged slots and the scratch slot, the fallbacks. The CUDA capture is tested on a GPU."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tfuture import FutureMap
from tfuture.core.batch import ForwardBatch
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams
from tfuture.steps.graphs import GraphCaptureError, layout
from tfuture.steps.token import Buckets, TokenStep
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyGrammar, ToyModel, random_workload

BUCKETS = Buckets(rows=(4, 8, 32, 64), reqs=(2, 4))


def run(
    graphs: bool,
    *,
    overlap: bool = True,
    stream: str = "worker",
    buckets: Buckets = BUCKETS,
    specs: list[RequestSpec] | None = None,
    model: object | None = None,
    device: str = "cpu",
    **kw: object,
) -> tuple[ContinuousBatcher, FutureMap, OverlapRuntime]:
    fmap = FutureMap(64, device=device)
    specs = random_workload(3, 12, max_new=9) if specs is None else specs
    sched = ContinuousBatcher(specs, fmap, max_running=4, **kw)  # type: ignore[arg-type]
    model = ToyModel() if model is None else model
    rt = OverlapRuntime(model, fmap, overlap=overlap, buckets=buckets, graphs=graphs, stream=stream)
    rt.run(sched)
    return sched, fmap, rt


def graphs_of(rt: OverlapRuntime):  # type: ignore[no-untyped-def]
    assert isinstance(rt.kind, TokenStep) and rt.kind.graphs is not None
    return rt.kind.graphs


@pytest.mark.parametrize("stream", ["worker", "inline"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_graphed_steps_equal_eager_steps(overlap: bool, stream: str) -> None:
    ref, _, _ = run(False, overlap=overlap, stream=stream)
    got, fmap, rt = run(True, overlap=overlap, stream=stream)
    assert got.outputs == ref.outputs
    assert fmap.in_use == 0  # the scratch slot too is given back when the run ends
    g = graphs_of(rt)
    # One capture per bucket used, every later step of a bucket replayed; nothing here ran eagerly.
    assert g.captures == len(g.buckets) >= 2
    assert sum(b.replays for b in g.buckets.values()) > g.captures and g.eager_steps == 0
    assert set(g.buckets) <= {(r, q) for r in BUCKETS.rows for q in BUCKETS.reqs}
    for (rows, reqs), b in g.buckets.items():
        assert b.static_in.numel() == sum(layout(rows, reqs)) and b.replay is not None


def test_a_second_run_replays_the_graphs_of_the_first() -> None:
    fmap = FutureMap(64, device="cpu")
    rt = OverlapRuntime(ToyModel(), fmap, buckets=BUCKETS, graphs=True)
    outs = []
    for _ in range(2):
        sched = ContinuousBatcher(random_workload(3, 12, max_new=9), fmap, max_running=4)
        rt.run(sched)
        outs.append(sched.outputs)
    g = graphs_of(rt)
    assert outs[0] == outs[1] and fmap.in_use == 0
    assert g.captures == len(g.buckets)  # nothing captured twice


def test_a_run_cut_by_max_steps_gives_the_scratch_slot_back_and_continues() -> None:
    """A cut run keeps per-request state for its continuation, but not the scratch slot: once
    it returns, the map holds exactly what it holds without graphs (the soak caught a cut graph
    episode holding one slot more), and the continuation takes a fresh scratch slot."""
    held, outs = [], []
    for graphs in (False, True):
        fmap = FutureMap(64, device="cpu")
        sched = ContinuousBatcher(random_workload(3, 12, max_new=9), fmap, max_running=4)
        rt = OverlapRuntime(ToyModel(), fmap, buckets=BUCKETS, graphs=graphs)
        assert rt.run(sched, max_steps=5).steps == 5 and not sched.idle
        held.append(fmap.in_use)
        if graphs:
            assert graphs_of(rt).scratch is None
        rt.run(sched)
        outs.append(sched.outputs)
        assert fmap.in_use == 0
    assert held[0] == held[1] and outs[0] == outs[1]


def test_steps_larger_than_every_bucket_run_eagerly_with_the_same_tokens() -> None:
    small = Buckets(rows=(4,), reqs=(2, 4))  # every prefill chunk of more than 4 tokens is larger
    ref, _, _ = run(False, buckets=small)
    got, fmap, rt = run(True, buckets=small)
    g = graphs_of(rt)
    assert got.outputs == ref.outputs and fmap.in_use == 0
    assert g.eager_steps > 0 and sum(b.replays for b in g.buckets.values()) > 0


def test_steps_with_sampling_parameters_run_eagerly_the_greedy_ones_graphed() -> None:
    # The first three requests sample with a temperature (their parameters travel as plan
    # words) and end early; the greedy ones after them decode alone.
    specs = [
        replace(s, params=SamplingParams(temperature=0.8, seed=i), max_new=2) if i < 3 else s
        for i, s in enumerate(random_workload(5, 10, max_new=8))
    ]

    def go(graphs: bool):  # type: ignore[no-untyped-def]
        fmap = FutureMap(64, device="cpu")
        sched = ContinuousBatcher([replace(s) for s in specs], fmap, max_running=4)
        rt = OverlapRuntime(ToyModel(), fmap, buckets=BUCKETS, graphs=graphs, sampler=Sampler())
        rt.run(sched)
        return sched.outputs, fmap, rt

    ref, _, _ = go(False)
    got, fmap, rt = go(True)
    g = graphs_of(rt)
    assert got == ref and fmap.in_use == 0
    assert g.eager_steps > 0  # the steps with a sampling request
    assert g.captures > 0 and sum(b.replays for b in g.buckets.values()) > 0  # the greedy-only steps


def test_delayed_grammar_steps_run_eagerly() -> None:
    grammar = ToyGrammar(64, seed=2)
    specs = random_workload(7, 8, max_new=8, grammar_share=1.0)
    ref, _, _ = run(False, specs=specs, grammar=grammar)
    got, fmap, rt = run(True, specs=random_workload(7, 8, max_new=8, grammar_share=1.0), grammar=grammar)
    g = graphs_of(rt)
    assert got.outputs == ref.outputs and fmap.in_use == 0
    assert g.eager_steps > 0


class OwnMinusOne(ToyModel):
    """A model whose own sample marks request 1's row as having no valid token from step 2 on."""

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        tokens = super().sample(logits, batch, mask)
        rids = batch.req_ids.index_select(0, batch.sample_reqs)
        return torch.where((rids == 1) & (batch.seq_lens.index_select(0, batch.sample_reqs) > 12), -1, tokens)


def test_a_row_without_a_valid_token_raises_and_is_never_stored() -> None:
    specs = [RequestSpec(rid=r, arrival=0, prompt=np.arange(1, 9), max_new=8) for r in range(2)]
    with pytest.raises(ValueError, match=r"no valid token for request id 1"):
        run(True, specs=specs, model=OwnMinusOne())


def test_bad_graph_options_are_refused() -> None:
    with pytest.raises(ValueError, match="buckets="):
        OverlapRuntime(ToyModel(), FutureMap(8, device="cpu"), graphs=True)
    with pytest.raises(ValueError, match="debug"):
        OverlapRuntime(ToyModel(), FutureMap(8, device="cpu", debug=True), buckets=BUCKETS, graphs=True)
    with pytest.raises(ValueError, match="graph-safe model, and object does not say"):
        OverlapRuntime(object(), FutureMap(8, device="cpu"), buckets=BUCKETS, graphs=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="graphs must be a bool"):
        OverlapRuntime(ToyModel(), FutureMap(8, device="cpu"), buckets=BUCKETS, graphs="yes")  # type: ignore[arg-type]
    # A step kind (the speculative one) takes no graphs: tests/runtime/test_speculative.py.


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_cuda_step_graphs_equal_eager_steps(overlap: bool) -> None:
    ref, _, _ = run(False, overlap=overlap, stream="auto", device="cuda")
    got, fmap, rt = run(True, overlap=overlap, stream="auto", device="cuda")
    g = graphs_of(rt)
    assert got.outputs == ref.outputs and fmap.in_use == 0
    assert g.captures == len(g.buckets) and sum(b.replays for b in g.buckets.values()) > 0


class Syncs(ToyModel):
    """Not graph-safe: reads a device value on the host in every forward."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if int(batch.input_ids.sum()) < 0:
            raise AssertionError("unreachable")
        return super().forward(batch)


@pytest.mark.gpu
def test_a_model_that_syncs_is_refused_at_capture_naming_the_bucket() -> None:
    with pytest.raises(GraphCaptureError, match=r"(?s)bucket \(rows=\d+, reqs=\d+\).*graph-safe"):
        run(True, stream="auto", device="cuda", model=Syncs())
    # The failed capture leaves the process's CUDA random numbers working (torch alone would
    # leave the default generator marked as capturing).
    assert torch.randn(4, device="cuda").isfinite().all()


def test_a_launch_whose_slots_cannot_be_staged_leaks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The scratch slot is taken at a graphed step's launch, after its out handle: when that fails
    # (a full map), the step's out and its consumed handles go back before the error surfaces.
    from tfuture.core.errors import FutureMapFull
    from tfuture.steps.graphs import StepGraphs

    calls = {"n": 0}
    real = StepGraphs.scratch_slot

    def full_on_the_third(self: StepGraphs, fmap: FutureMap) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise FutureMapFull("planted: no slot left for the scratch slot")
        return real(self, fmap)

    monkeypatch.setattr(StepGraphs, "scratch_slot", full_on_the_third)
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(random_workload(3, 12, max_new=9), fmap, max_running=4)
    rt = OverlapRuntime(ToyModel(), fmap, buckets=BUCKETS, graphs=True)
    with pytest.raises(FutureMapFull, match="planted"):
        rt.run(sched)
    assert fmap.in_use == 0
