"""Faults in a speculative run (``SpecTokenStep`` on a tiny Hugging Face Llama): an exception
planted in each of its stream ops (``verify``, ``draft``, ``store``, and the token step's
``prepare``, ``release`` and ``copy``) surfaces at the next sync with its own traceback, leaves
no slot held and no thread alive, and a fresh run works; random delays on the speculative ops
alone keep plain decoding's tokens; a drafter that returns the wrong thing is refused by name;
ops the step never runs are refused as fault points; a small map makes a run wait for slots."""

from __future__ import annotations

import threading
import traceback
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from support import worker_threads

from tfuture import FutureMap
from tfuture.examples.hf import build_llama
from tfuture.models import HFCausalLM
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec import DraftContext, NGramDrafter, SpecTokenStep
from tfuture.testing import ContinuousBatcher, RequestSpec
from tfuture.testing.faults import FaultPlan, InjectedFault

VOCAB, ROWS, MAX_LEN, K = 96, 4, 160, 3
NO_STOP = 10**9


@pytest.fixture(scope="module")
def model() -> Any:
    return build_llama(vocab=VOCAB, hidden=48, layers=2, seed=0)


def workload() -> list[RequestSpec]:
    """Four self-quoting prompts over several ticks, of staggered lengths: requests end at
    different steps, so later steps release their rows (``release``)."""
    rng = np.random.default_rng(0)
    specs = []
    for i in range(ROWS):
        base = rng.integers(3, VOCAB, size=5 + i)
        specs.append(RequestSpec(i, 2 * i, np.concatenate([base, base, base[:3]]), 4 + 3 * i))
    return specs


class RecordingPlan(FaultPlan):
    """A fault plan that also records every ``(op, step)`` it was asked about."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seen: list[tuple[str, int]] = []

    def check(self, point: str, step: int) -> None:
        self.seen.append((point, step))
        super().check(point, step)


def run(
    model: Any,
    drafter: Any = None,
    *,
    overlap: bool = True,
    faults: FaultPlan | None = None,
    capacity: int = 256,
    specs: list[RequestSpec] | None = None,
) -> tuple[ContinuousBatcher, FutureMap]:
    """The workload through the token step (plain) or the speculative step (``drafter``), on a
    map of ``capacity`` slots."""
    fmap = FutureMap(capacity, device="cpu")
    specs = workload() if specs is None else specs
    hf = HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN)
    if drafter is None:
        sched = ContinuousBatcher(specs, fmap, eos=NO_STOP, max_running=ROWS, chunk=4)
        OverlapRuntime(hf, fmap, overlap=overlap, trace=False, sampler=Sampler(), faults=faults).run(sched)
        return sched, fmap
    drafter.bind(ROWS, MAX_LEN, torch.device("cpu"))
    step = SpecTokenStep(hf, drafter, Sampler())
    sched = ContinuousBatcher(specs, fmap, eos=NO_STOP, max_running=ROWS, chunk=4, speculative=K)
    try:
        OverlapRuntime(step, fmap, overlap=overlap, trace=False, faults=faults).run(sched)
    finally:
        # Whatever happened, the run gave every slot back.
        assert fmap.in_use == 0 and fmap.free == fmap.capacity
    return sched, fmap


@pytest.fixture(scope="module")
def plain(model: Any) -> dict[int, list[int]]:
    sched, _ = run(model)
    return sched.outputs


@pytest.fixture(scope="module")
def op_steps(model: Any) -> dict[bool, dict[str, list[int]]]:
    """By overlap: the steps at which each stream op of a clean speculative run ran."""
    out: dict[bool, dict[str, list[int]]] = {}
    for overlap in (True, False):
        plan = RecordingPlan()
        run(model, NGramDrafter(k=K), overlap=overlap, faults=plan)
        steps = out[overlap] = {}
        for op, step in plan.seen:
            steps.setdefault(op, []).append(step)
    return out


POINTS = ("verify", "draft", "store", "release", "prepare", "copy")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("point", POINTS)
def test_a_fault_in_a_speculative_op_surfaces_and_leaks_nothing(
    model: Any,
    plain: dict[int, list[int]],
    op_steps: dict[bool, dict[str, list[int]]],
    point: str,
    overlap: bool,
) -> None:
    ran = op_steps[overlap].get(point)
    assert ran, f"a clean run never ran {point!r}: the workload does not exercise it"
    at = next((s for s in ran if s >= 3), ran[-1])
    threads = threading.active_count()
    plan = FaultPlan(seed=3, max_delay_s=5e-4, raise_at={point: at})
    with pytest.raises(InjectedFault, match=rf"injected fault at {point} of step {at}") as info:
        run(model, NGramDrafter(k=K), overlap=overlap, faults=plan)  # checks the map is empty
    assert plan.injected[f"raise_{point}"] == 1
    # The original traceback, from the forward stream's op, and a note naming the op and step.
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "check" and frames[-1].filename.endswith("faults.py")
    notes = getattr(info.value, "__notes__", [])
    assert any(f"on the forward stream in '{point}' of step {at}" in n for n in notes), notes
    assert not worker_threads() and threading.active_count() == threads
    # Fresh objects run the workload to plain decoding's tokens.
    again, _ = run(model, NGramDrafter(k=K), overlap=overlap)
    assert again.outputs == plain


def test_delays_on_the_speculative_ops_alone_keep_plains_tokens(
    model: Any, plain: dict[int, list[int]]
) -> None:
    plan = FaultPlan(seed=7, max_delay_s=0.004, delay_ops=("verify", "draft", "store"))
    sched, _ = run(model, NGramDrafter(k=K), faults=plan)
    assert sched.outputs == plain
    assert plan.injected["stream_delay"] > 0
    assert sched.drafted_tokens > 0


def test_host_delays_keep_plains_tokens(model: Any, plain: dict[int, list[int]]) -> None:
    plan = FaultPlan(seed=8, max_delay_s=0.002, host_delay_s=0.002)
    sched, _ = run(model, NGramDrafter(k=K), faults=plan)
    assert sched.outputs == plain
    assert plan.injected["host_delay"] > 0 and plan.injected["stream_delay"] > 0


def test_an_unknown_fault_point_is_refused(model: Any) -> None:
    with pytest.raises(ValueError, match="raise_at points must be among"):
        run(model, NGramDrafter(k=K), faults=FaultPlan(raise_at={"verfiy": 2}))


@pytest.mark.parametrize("op", ["sample", "sample_now", "replay"])
def test_a_fault_point_the_speculative_step_never_runs_is_refused(model: Any, op: str) -> None:
    # A regression: these token-step ops were accepted and silently injected nothing.
    with pytest.raises(ValueError, match="raise_at points must be among"):
        run(model, NGramDrafter(k=K), faults=FaultPlan(raise_at={op: 2}))
    with pytest.raises(ValueError, match="delay_ops must be among"):
        run(model, NGramDrafter(k=K), faults=FaultPlan(max_delay_s=1e-3, delay_ops=(op,)))


# ------------------------------------------------------------------ misbehaving drafters
class ShapedDrafter(NGramDrafter):
    """Prompt lookup whose ``draft`` result goes through ``bend`` first."""

    def __init__(self, bend: Any) -> None:
        super().__init__(k=K)
        self.bend = bend

    def draft(self, ctx: DraftContext) -> Any:
        return self.bend(super().draft(ctx))


@pytest.mark.parametrize(
    ("bend", "got"),
    [
        (lambda d: d[:, :-1], rf"\(\d+, {K - 1}\)"),
        (lambda d: d.reshape(-1), r"\(\d+,\)"),
        (lambda d: d.T, rf"\({K}, \d+\)"),
        (lambda d: d.tolist(), "list"),
        (lambda d: d.numpy(), "ndarray"),
    ],
    ids=["short", "flat", "transposed", "list", "numpy"],
)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_drafter_returning_the_wrong_thing_is_refused(
    model: Any, bend: Any, got: str, overlap: bool
) -> None:
    threads = threading.active_count()
    with pytest.raises(
        ValueError, match=rf"the drafter's draft must return \[\d+, {K}\] token ids, got {got}"
    ):
        run(model, ShapedDrafter(bend), overlap=overlap)
    assert not worker_threads() and threading.active_count() == threads


@pytest.mark.parametrize(
    "bend",
    [lambda d: d + 10 * VOCAB, lambda d: -1 - d, lambda d: d.to(torch.float32)],
    ids=["past_vocab", "negative", "float"],
)
def test_odd_draft_ids_cost_acceptance_only(model: Any, plain: dict[int, list[int]], bend: Any) -> None:
    # Verification is exact for any proposal: ids outside the vocabulary are clamped into it.
    sched, _ = run(model, ShapedDrafter(bend))
    assert sched.outputs == plain


# ------------------------------------------------------------------ a map under pressure
# Four requests at once, each 1 + 3 slots a step: 16 slots a step, 32 for two steps in flight.
TOGETHER = [RequestSpec(i, 0, np.arange(3 + i, 9 + i), 8) for i in range(ROWS)]


@pytest.fixture(scope="module")
def together(model: Any) -> dict[int, list[int]]:
    sched, _ = run(model, specs=TOGETHER)
    return sched.outputs


def test_plain_decoding_waits_for_slots_on_a_small_map(model: Any, together: dict[int, list[int]]) -> None:
    # The control for the xfail below: back-pressure serves every request on 4 slots.
    sched, _ = run(model, capacity=4, specs=TOGETHER)
    assert sched.outputs == together


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("capacity", [20, 24])
def test_a_speculative_run_waits_for_slots_on_a_small_map(
    model: Any, together: dict[int, list[int]], capacity: int, overlap: bool
) -> None:
    # A regression: a decode that waited for slots lost its drafts' slots under it.
    sched, _ = run(model, NGramDrafter(k=K), overlap=overlap, capacity=capacity, specs=TOGETHER)
    assert sched.outputs == together


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("capacity", [8, 16])
def test_a_speculative_run_on_a_map_of_one_step_serves_or_leaks_nothing(
    model: Any, together: dict[int, list[int]], capacity: int, overlap: bool
) -> None:
    # Plain decoding serves these on 4 slots; a speculative request starts holding slots only
    # while one more can still step (back-pressure), so a map of one step's slots serves too.
    sched, _ = run(model, NGramDrafter(k=K), overlap=overlap, capacity=capacity, specs=TOGETHER)
    assert sched.outputs == together


def test_a_map_smaller_than_two_steps_of_one_request_is_refused(model: Any) -> None:
    with pytest.raises(ValueError, match="cannot run speculative decoding with 3 drafts"):
        ContinuousBatcher(TOGETHER, FutureMap(7, device="cpu"), max_running=4, speculative=3)
