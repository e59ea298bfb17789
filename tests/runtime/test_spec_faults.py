"""Speculative steps get the loop's fault injection and tracing like token steps."""

from __future__ import annotations

import pytest
import torch

from tfuture import FutureMap
from tfuture.core.errors import FutureError
from tfuture.runtime import OverlapRuntime
from tfuture.steps.speculative import SpecStep
from tfuture.testing.faults import SPEC_POINTS, FaultPlan, InjectedFault
from tfuture.testing.toy_spec import SpecBatcher, ToySpecModel, reference_outputs
from tfuture.testing.workload import random_workload


def new_map() -> FutureMap:
    return FutureMap(64, device="cuda" if torch.cuda.is_available() else "cpu")


def run(seed: int, plan: FaultPlan, fmap: FutureMap, overlap: bool = True) -> tuple[SpecBatcher, object]:
    specs = random_workload(seed, 6, max_prompt=6, max_new=12, arrival_span=3)
    sched = SpecBatcher(specs, fmap, eos=-1, max_running=4)
    model = ToySpecModel(k=2, error_rate=0.3, seed=seed)
    stats = OverlapRuntime(SpecStep(model), fmap, overlap=overlap, faults=plan, trace=True).run(sched)
    return sched, stats


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_spec_steps_under_delays_and_gc_equal_plain_decoding(overlap):
    plan = FaultPlan(seed=3, max_delay_s=1e-3, delay_ops=SPEC_POINTS, host_delay_s=5e-4, gc_every_step=True)
    fmap = new_map()
    sched, stats = run(3, plan, fmap, overlap)
    specs = random_workload(3, 6, max_prompt=6, max_new=12, arrival_span=3)
    assert sched.outputs == reference_outputs(specs, eos=-1)
    assert fmap.in_use == 0
    assert (
        plan.injected["stream_delay"] >= len(SPEC_POINTS) * stats.steps and plan.injected["gc"] == stats.steps
    )
    names = {s.name for s in stats.device_spans}
    assert {"prepare", "verify", "draft", "store", "copy"} <= names
    # Committed tokens of every step, the extra steps' discarded ones included.
    assert stats.tokens >= sum(len(v) for v in sched.outputs.values())


@pytest.mark.parametrize("point", [*SPEC_POINTS, "schedule", "process"])
def test_spec_fault_surfaces_and_releases_every_slot(point):
    fmap = new_map()
    with pytest.raises(InjectedFault, match=f"at {point} of step 2"):
        run(1, FaultPlan(raise_at={point: 2}), fmap)
    assert fmap.in_use == 0


class _BadVerify(ToySpecModel):
    """``verify`` returns ``bad(target)`` at ``step`` (the toy target's ids otherwise)."""

    def __init__(self, step: int, bad, vocab: int | None = None) -> None:
        super().__init__(k=2, error_rate=0.3, seed=1)
        self.at, self.bad = step, bad
        if vocab is not None:
            self.vocab = vocab

    def verify(self, step, inputs, req_ids):
        target = super().verify(step, inputs, req_ids)
        return self.bad(target) if step == self.at else target


def _run_bad(model: ToySpecModel, match: str) -> SpecBatcher:
    fmap = new_map()
    specs = random_workload(1, 4, max_prompt=6, max_new=12, arrival_span=0)
    sched = SpecBatcher(specs, fmap, eos=-1, max_running=4)
    seen: list[int] = []
    process = sched.process

    def spy(result):
        seen.extend(result.tokens.ravel().tolist())
        process(result)

    sched.process = spy
    if fmap.device.type != "cpu" and "integer token ids" not in match:
        # On a device the range is flagged in fmap.err (no host sync) and raised at the step's check.
        err, match = FutureError, "placeholder"
    else:
        err = ValueError
    with pytest.raises(err, match=match):
        OverlapRuntime(SpecStep(model), fmap).run(sched)
    assert fmap.in_use == 0
    assert seen and min(seen) >= 0 and max(seen) < 64, "a bad id reached the scheduler"
    return sched


def test_float_verify_scores_are_refused_not_cast_to_ids():
    _run_bad(
        _BadVerify(2, lambda t: t.to(torch.float32) + 0.5),
        r"verify of step 2 must return integer token ids \(int64, int32, \.\.\.\), got torch.float32",
    )
    _run_bad(_BadVerify(2, lambda t: t > 3), "must return integer token ids .* got torch.bool")


def test_negative_verify_ids_are_refused_before_they_are_committed():
    _run_bad(
        _BadVerify(2, lambda t: t - 1000), r"verify of step 2 returned token id -\d+: token ids must be >= 0"
    )


def test_verify_ids_past_a_declared_vocab_are_refused():
    model = _BadVerify(2, lambda t: t.clone().fill_(64), vocab=64)
    assert SpecStep(model).vocab == 64
    _run_bad(model, r"verify of step 2 returned token id 64: token ids must be in \[0, vocab=64\)")
    with pytest.raises(TypeError, match="vocab must be an int >= 1 or absent, got 'big'"):
        SpecStep(_BadVerify(2, lambda t: t, vocab="big"))  # type: ignore[arg-type]


def test_bad_ids_on_a_device_are_flagged_in_the_error_flag_without_a_sync():
    """The path of a GPU stream: zeroed and counted in ``fmap.err``, raised at the next check."""
    from tfuture.core.errors import raise_if_flagged
    from tfuture.steps.speculative import flag_bad_tokens

    err = torch.zeros(2, dtype=torch.int64)
    out = flag_bad_tokens(torch.tensor([[3, -5, 70], [1, 2, 63]]), 64, err)
    assert out.tolist() == [[3, 0, 0], [1, 2, 63]] and err.tolist() == [2, -5]
    clean = torch.zeros(2, dtype=torch.int64)
    assert flag_bad_tokens(torch.tensor([[1, 2]]), None, clean).tolist() == [[1, 2]]
    assert clean.tolist() == [0, 0]
    with pytest.raises(FutureError, match="2 placeholder"):
        raise_if_flagged(err.numpy())
