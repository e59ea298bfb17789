"""Speculative decoding on futures: the prepare kernel, greedy acceptance, and equivalence.

Equivalence: with greedy acceptance, overlapped speculative decoding (step N+1 launched before
the host knows step N's accepted lengths, which it reads only from step N's slot fields on the
device) commits exactly the tokens of plain greedy decoding of the target, for every request,
with random delays on the forward stream, and hands every slot back.
"""

import threading
import time

import numpy as np
import pytest
import torch

from tfuture import FutureMap
from tfuture.kernels.spec import SpecInputs, prepare_spec_inputs, prepare_spec_inputs_ref
from tfuture.runtime import OverlapRuntime
from tfuture.speculative import SpecBatch, SpecResult, SpecStep, greedy_accept
from tfuture.testing.batcher import random_workload
from tfuture.testing.equivalence import run_workload
from tfuture.testing.toy_spec import (
    SpecBatcher,
    ToySpecModel,
    check_spec_equivalence,
    random_delay,
    reference_outputs,
    run_spec,
)
from tfuture.testing.toy import ToyModel

N_SLOTS = 41
POISON = -999


def _fields(k: int, g: torch.Generator, device: str) -> tuple[torch.Tensor, ...]:
    tokens = torch.randint(0, 1000, (N_SLOTS, k + 1), generator=g)
    # Out-of-range accepted lengths on purpose: the kernel clamps them into the row.
    accept = torch.randint(-1, k + 3, (N_SLOTS,), generator=g).to(torch.int32)
    seq = torch.randint(0, 500, (N_SLOTS,), generator=g)
    drafts = torch.randint(0, 1000, (N_SLOTS, k), generator=g)
    return tuple(t.to(device) for t in (tokens, accept, seq, drafts))


@pytest.mark.parametrize("k", [0, 1, 3, 8])
@pytest.mark.parametrize("n", [0, 1, 2, 17, 65], ids=lambda n: f"n{n}")
def test_prepare_spec_inputs_matches_reference(k: int, n: int, device: str) -> None:
    g = torch.Generator().manual_seed(100 * k + n)
    fields = _fields(k, g, device)
    slots = torch.randint(1, N_SLOTS, (n,), generator=g)
    concrete = torch.randint(0, 1000, (n,), generator=g)
    last = torch.where(torch.rand(n, generator=g) < 0.7, -slots, concrete)
    dtype = torch.int32 if n % 2 else torch.int64
    worst = -(2**31) if dtype == torch.int32 else -(2**40)
    if n > 2:
        last[:2] = torch.tensor([-N_SLOTS, worst])  # past the map: flagged, never read
    lens = torch.randint(1, 300, (n,), generator=g)
    last, lens = last.to(device=device, dtype=dtype), lens.to(device=device, dtype=dtype)
    n_rows = n + 3
    out = SpecInputs(
        torch.full((n_rows, k + 1), POISON, device=device),
        torch.full((n_rows, k + 1), POISON, device=device),
        torch.full((n_rows,), POISON, device=device),
    )
    err, err_ref = (torch.zeros(2, dtype=torch.int64, device=device) for _ in range(2))
    got = prepare_spec_inputs(last, lens, *fields, n_rows=n_rows, out=out, err=err)
    want = prepare_spec_inputs_ref(last, lens, *fields, n_rows=n_rows, err=err_ref)
    assert got is out
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(err, err_ref)
    # Plain-Python contract for the continuing rows.
    tokens, accept, seq, drafts = (t.cpu() for t in fields)
    for i, x in enumerate(last.tolist()):
        if x < 0 and -x < N_SLOTS:
            a = min(max(int(accept[-x]), 1), k + 1)
            assert got.input_ids[i].tolist() == [int(tokens[-x, a - 1]), *drafts[-x].tolist()]
            assert got.positions[i, 0] == max(int(seq[-x]) - 1, 0) and got.n_draft[i] == k
        elif x >= 0:
            assert got.input_ids[i].tolist() == [x] + [0] * k and got.n_draft[i] == 0
    assert (got.input_ids[n:] == 0).all() and (got.positions[n:] == 0).all()
    assert err.tolist() == ([2, worst] if n > 2 else [0, 0])


def test_prepare_spec_inputs_validation(device: str) -> None:
    g = torch.Generator().manual_seed(1)
    tokens, accept, seq, drafts = _fields(3, g, device)
    last = torch.tensor([-1, 5], device=device)
    lens = torch.tensor([1, 7], device=device)
    with pytest.raises(ValueError, match="one entry per request"):
        prepare_spec_inputs(last, lens[:1], tokens, accept, seq, drafts)
    with pytest.raises(ValueError, match="one row per slot"):
        prepare_spec_inputs(last, lens, tokens[:5], accept, seq, drafts)
    with pytest.raises(ValueError, match=r"int32 or torch.int64, got torch.float32"):
        prepare_spec_inputs(last, lens, tokens, accept, seq.float(), drafts)
    with pytest.raises(ValueError, match="n_rows must be >= len"):
        prepare_spec_inputs(last, lens, tokens, accept, seq, drafts, n_rows=1)
    with pytest.raises(ValueError, match=r"out.input_ids must have shape \(2, 4\)"):
        bad = SpecInputs(
            torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2)
        )
        prepare_spec_inputs(last, lens, tokens, accept, seq, drafts, out=bad)


def test_greedy_accept() -> None:
    ids = torch.tensor([[9, 1, 2, 3], [9, 1, 2, 3], [9, 7, 2, 3], [9, 1, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    n_draft = torch.tensor([3, 3, 3, 0])
    acc = greedy_accept(SpecInputs(ids, ids, n_draft), target)
    assert acc.tolist() == [4, 3, 1, 1] and acc.dtype == torch.int32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_spec_equals_plain_greedy_with_delays(seed: int) -> None:
    rng = np.random.default_rng(seed)
    specs = random_workload(seed, 8, max_prompt=10, max_new=20, arrival_span=6)
    k, err = int(rng.integers(1, 5)), float(rng.uniform(0.1, 0.6))
    diff = check_spec_equivalence(
        specs, delay=random_delay(seed), k=k, error_rate=err, seed=seed, max_running=int(rng.integers(2, 7))
    )
    assert diff is None, diff


@pytest.mark.parametrize(("error_rate", "k"), [(0.0, 3), (1.0, 3), (0.3, 0)])
def test_spec_extremes(error_rate: float, k: int) -> None:
    specs = random_workload(7, 5, max_prompt=6, max_new=16, arrival_span=2)
    run = run_spec(specs, overlap=True, k=k, error_rate=error_rate, delay=random_delay(7), eos=-1)
    assert run.outputs == reference_outputs(specs, eos=-1)
    assert run.fmap.in_use == 0
    firsts = [a for acc in run.accepts.values() for a in acc[:1]]
    later = [a for acc in run.accepts.values() for a in acc[1:-1]]  # the last step may be cut short
    assert set(firsts) == {1}  # a fresh request has no drafts yet
    if error_rate == 0.0:
        assert set(later) == {k + 1}
    if error_rate == 1.0 or k == 0:
        assert set(later) <= {1}


def test_spec_equals_core_runtime_sync_decoding() -> None:
    """Against plain non-speculative decoding through the core OverlapRuntime in sync mode."""
    specs = random_workload(3, 6, max_prompt=8, max_new=12, arrival_span=4)
    plain, *_ = run_workload(ToyModel(), specs, overlap=False, capacity=32)
    run = run_spec(specs, overlap=True, k=2, error_rate=0.25, delay=random_delay(3))
    assert run.outputs == plain


class _Recorder(SpecBatcher):
    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.events: list[tuple[str, int]] = []
        self.batches: list[SpecBatch] = []

    def schedule(self) -> SpecBatch | None:
        batch = super().schedule()
        if batch is not None:
            self.batches.append(batch)
            self.events.append(("schedule", len(self.batches) - 1))
        return batch

    def process(self, result: SpecResult) -> None:
        self.events.append(("process", result.step))
        super().process(result)


def test_overlap_launches_next_step_before_accept_lengths_reach_host() -> None:
    specs = random_workload(4, 4, max_prompt=6, max_new=10, arrival_span=0)
    fmap = FutureMap(32, device="cpu")
    sched = _Recorder(specs, fmap, eos=-1)
    OverlapRuntime(SpecStep(ToySpecModel(k=2, error_rate=0.2)), fmap, overlap=True, delay=random_delay(4)).run(sched)
    assert sched.events[:3] == [("schedule", 0), ("schedule", 1), ("process", 0)]
    for i, (kind, step) in enumerate(sched.events[2:-1]):
        # Every processed step N comes after step N+1 was scheduled (or after the last schedule).
        if kind == "process":
            assert ("schedule", step + 1) in sched.events[: i + 2] or step == len(sched.batches) - 1
    # After the first step every row names its previous step's slot: accept_len stays on the device.
    assert all((b.last < 0).all() for b in sched.batches[1:])
    assert sched.extra_rows > 0 and fmap.in_use == 0
    assert sched.outputs == reference_outputs(specs, eos=-1)


def test_failure_in_verify_surfaces_and_releases_slots() -> None:
    specs = random_workload(5, 4, max_prompt=6, max_new=12, arrival_span=0)
    fmap = FutureMap(32, device="cpu")
    threads = threading.active_count()
    model = ToySpecModel(ToyModel(fail_at=2), k=2)
    with pytest.raises(RuntimeError, match="planted failure in verify of step 2") as info:
        OverlapRuntime(SpecStep(model), fmap, overlap=True, delay=random_delay(5)).run(SpecBatcher(specs, fmap))
    assert any("step 2" in note for note in getattr(info.value, "__notes__", []))
    assert fmap.in_use == 0 and threading.active_count() == threads


@pytest.mark.parametrize("seed", range(4))
def test_failed_spec_run_leaks_no_slot_when_the_host_is_slow(seed):
    # Regression: the step's handle was allocated before its staging buffer; waiting for that
    # buffer re-raised the stream's failure and the fresh handle was never released.
    from tfuture.testing.batcher import random_workload
    from tfuture.testing.toy_spec import SpecBatcher, ToySpecModel
    from tfuture.testing.toy import ToyModel

    specs = random_workload(seed, 4, max_prompt=6, max_new=30, arrival_span=0)
    fmap = FutureMap(64, device="cpu")
    sched = SpecBatcher(specs, fmap)
    process = sched.process

    def slow_process(result):
        time.sleep(0.02)  # host work longer than a device step: the failure lands mid-launch
        return process(result)

    sched.process = slow_process
    with pytest.raises(RuntimeError, match="planted failure"):
        OverlapRuntime(SpecStep(ToySpecModel(ToyModel(fail_at=5), k=2)), fmap, overlap=True).run(sched)
    assert fmap.in_use == 0


def test_fields_accept_a_map_made_with_an_unindexed_device():
    # Regression: FutureMap kept the device as given ("cuda", here "cpu:0") while tensors report
    # their own form, so every FutureFields.store was refused as "on another device".
    from tfuture.fields import FutureFields

    fmap = FutureMap(4, device="cpu:0")
    assert fmap.device == fmap.token_map.device
    fields = FutureFields(fmap, {"x": ((), torch.int64)})
    fi = fmap.alloc(2)
    fields.store(fi, {"x": torch.tensor([1, 2])})
    assert fields.gather(fi, ["x"])["x"].tolist() == [1, 2]
