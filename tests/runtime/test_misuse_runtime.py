"""Regression tests for the misuse holes of issue 13 in the runtime, its batches and its batcher.

One test per row, named after it. Each run ends with the map empty (nothing leaked) and no
forward-stream worker left behind.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from support import worker_threads

from tfuture import FutureMap
from tfuture.core.batch import Batch
from tfuture.runtime import OverlapRuntime
from tfuture.streams.backends import CpuStream
from tfuture.testing import ContinuousBatcher, ToyModel, greedy_sample, random_workload, run_workload
from tfuture.testing.faults import FaultPlan

VOCAB = 64


def one_batch(tokens=(1, 2), consumes=None, **kw) -> Batch:
    """Two requests of one token each, both sampling."""
    n = len(tokens)
    return Batch(
        tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64),
        np.ones(n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.arange(n, dtype=np.int64),
        np.ones(n, dtype=bool),
        consumes=[] if consumes is None else consumes,
        **kw,
    )


class Scripted:
    """Hands out ``batches`` in order, then None; records the tokens it was given."""

    def __init__(self, batches, mask=None, on_process=None):
        self.batches, self.mask, self.on_process = list(batches), mask, on_process
        self.results: list[list[int]] = []

    def schedule(self):
        return self.batches.pop(0) if self.batches else None

    def process(self, result):
        self.results.append(result.tokens.tolist())
        if self.on_process is not None:
            self.on_process(result)

    def build_mask(self, batch):
        return self.mask


def assert_clean(fmap: FutureMap, held: int = 0) -> None:
    assert fmap.in_use == held
    assert not worker_threads()


# D3: consumes is validated at construction, and the runtime checks every entry before it
# takes any over; the valid ones are released on a bad entry (nothing leaks).


@pytest.mark.parametrize("bad", ["abc", ("x",), {}, [1]], ids=["str", "tuple", "dict", "int-entry"])
def test_d3_batch_refuses_a_consumes_that_is_not_a_list_of_handles(bad):
    with pytest.raises(TypeError, match=r"Batch\.consumes must be a list of FutureIndices, got"):
        one_batch(consumes=bad)


def test_d3_a_foreign_handle_in_consumes_leaks_nothing():
    fmap, other = FutureMap(8, device="cpu"), FutureMap(4, device="cpu")
    own, foreign = fmap.alloc(2), other.alloc(1)
    batch = one_batch(consumes=[foreign, own])
    with pytest.raises(ValueError, match="foreign"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(Scripted([batch]))
    assert own.released and not foreign.released and other.in_use == 1
    assert_clean(fmap)


def test_d3_junk_appended_after_construction_leaks_nothing():
    fmap = FutureMap(8, device="cpu")
    own = fmap.alloc(2)
    batch = one_batch(consumes=[own])
    batch.consumes.append("junk")
    with pytest.raises(TypeError, match="got str"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(Scripted([batch]))
    assert own.released
    assert_clean(fmap)


def test_d3_a_consumed_handle_released_after_construction_is_refused_and_nothing_leaks():
    fmap = FutureMap(8, device="cpu")
    gone, own = fmap.alloc(1), fmap.alloc(2)
    batch = one_batch(consumes=[own, gone])
    fmap.release(gone)  # a live handle when the batch was built, released before its launch
    with pytest.raises(ValueError, match="released"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(Scripted([batch]))
    assert own.released
    assert_clean(fmap)


class _FlaggingModel(ToyModel):
    """Flags the map's error words on the stream at step ``at``, as a device kernel does."""

    def __init__(self, fmap: FutureMap, at: int) -> None:
        super().__init__(vocab=VOCAB)
        self.fmap, self.at = fmap, at

    def forward(self, batch):  # type: ignore[no-untyped-def]
        if batch.step == self.at:
            self.fmap.err[0] += 1
            self.fmap.err[1] = -9
        return super().forward(batch)


@pytest.mark.parametrize("stream", ["worker", "inline"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_flag_set_on_the_stream_raises_at_that_steps_sync(stream, overlap):
    from tfuture.core.errors import FutureError

    fmap = FutureMap(16, device="cpu")
    seen: list[int] = []
    batches = [one_batch() for _ in range(4)]
    rt = OverlapRuntime(_FlaggingModel(fmap, at=2), fmap, overlap=overlap, stream=stream)
    with pytest.raises(FutureError, match=r"1 placeholder\(s\) .*most negative: -9"):
        rt.run(Scripted(batches, on_process=lambda r: seen.append(r.step)))
    assert seen == [0, 1]  # step 2's results never reach process
    assert fmap.err.tolist() == [0, 0]  # the abort cleared the flag for the next run
    assert_clean(fmap)


# D4: the GIL switch interval is reference-counted across streams whose lifetimes overlap.


def test_d4_overlapping_streams_restore_the_switch_interval_exactly():
    original = sys.getswitchinterval()
    a = CpuStream(switch_s=1e-4)
    b = CpuStream(switch_s=2e-4)
    a.close()
    assert sys.getswitchinterval() < original  # b still runs
    c = CpuStream(switch_s=1e-4)
    b.close()
    c.close()
    assert sys.getswitchinterval() == original
    assert not worker_threads()


def test_d4_two_runtimes_in_threads_restore_the_switch_interval(monkeypatch):
    # The numpy kernels: the Triton interpreter cannot run kernels on two threads at once.
    for mod in ("resolve", "store"):
        monkeypatch.setattr(f"tfuture.kernels.{mod}.use_triton", lambda t: False)
    original = sys.getswitchinterval()
    errors: list[BaseException] = []

    def drive(seed: int) -> None:
        try:
            run_workload(
                ToyModel(vocab=VOCAB, work_s=1e-3),
                random_workload(seed, 4, vocab=VOCAB, max_new=6),
                overlap=True,
                capacity=16,
            )
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sys.getswitchinterval() == original


# D5: one map, one driver: a second concurrent run() on a map in use raises at once.


def test_d5_a_second_concurrent_run_on_the_same_map_is_refused():
    fmap = FutureMap(8, device="cpu")
    second = OverlapRuntime(ToyModel(vocab=VOCAB), fmap)
    refused: list[BaseException] = []

    class Nested(Scripted):
        def schedule(self):
            if not refused:
                try:
                    second.run(Scripted([one_batch()]))
                except RuntimeError as exc:
                    refused.append(exc)
            return super().schedule()

    sched = Nested([one_batch(), one_batch()])
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    assert len(refused) == 1
    msg = str(refused[0])
    assert "FutureMap(capacity=8" in msg and "already driven" in msg
    assert len(sched.results) == 2  # the first run went on untouched
    assert_clean(fmap)
    # Once the first run ended, the map can be driven again.
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(Scripted([one_batch()]))
    assert_clean(fmap)


def test_d5_two_threads_on_one_map_one_is_refused():
    fmap = FutureMap(32, device="cpu")
    started, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    class Slow(Scripted):
        def schedule(self):
            started.set()
            release.wait(5)
            return super().schedule()

    def first() -> None:
        outcome["first"] = OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(Slow([one_batch()]))

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(5)
    try:
        with pytest.raises(RuntimeError, match=r"FutureMap\(capacity=32.*already driven"):
            OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(Scripted([one_batch()]))
    finally:
        release.set()
        t.join()
    assert outcome["first"].steps == 1
    assert_clean(fmap)


# D6: a batcher that can never schedule its unfinished requests says so, instead of ending.


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_d6_batcher_on_a_map_held_elsewhere_raises(overlap):
    fmap = FutureMap(8, device="cpu")
    held = fmap.alloc(8)
    specs = random_workload(3, 12, vocab=VOCAB, max_new=5)
    sched = ContinuousBatcher(specs, fmap, max_running=4)
    runtime = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap)
    with pytest.raises(
        RuntimeError, match=r"stuck with 12 of 12 requests unfinished: the FutureMap has 0 free slots of 8"
    ):
        runtime.run(sched)
    assert_clean(fmap, held=8)
    fmap.release(held)
    # Released, the same workload runs to the end.
    outputs, *_ = run_workload(ToyModel(vocab=VOCAB), specs, overlap=overlap, capacity=8, max_running=4)
    assert set(outputs) == {s.rid for s in specs}


def test_d6_a_tiny_map_is_back_pressure_not_a_stall():
    # One slot: every step waits for the previous one's slot; never "stuck".
    specs = random_workload(4, 5, vocab=VOCAB, max_new=4)
    outputs, _, _, fmap = run_workload(ToyModel(vocab=VOCAB), specs, overlap=True, capacity=1, max_running=3)
    assert set(outputs) == {s.rid for s in specs} and fmap.in_use == 0


def test_d6_a_zero_token_budget_is_named():
    fmap = FutureMap(8, device="cpu")
    with pytest.raises(ValueError, match="token_budget must be an int >= 1, got 0"):
        ContinuousBatcher(random_workload(5, 2, vocab=VOCAB), fmap, token_budget=0)
    assert_clean(fmap)


# D7: uint64 tokens past int64 would wrap into placeholders.


def test_d7_uint64_tokens_past_int64_are_refused():
    with pytest.raises(
        ValueError, match=r"Batch\.tokens must fit in int64, got a uint64 value 18446744073709551615"
    ):
        one_batch(tokens=np.array([5, 2**64 - 1], dtype=np.uint64))
    batch = one_batch(tokens=np.array([5, 2**63 - 1], dtype=np.uint64))
    assert batch.tokens.dtype == np.int64 and batch.tokens.tolist() == [5, 2**63 - 1]


# U1: forward returning None names what was expected.


class NoLogits(ToyModel):
    def forward(self, batch):
        return None


def test_u1_forward_returning_none_is_a_clear_value_error():
    fmap = FutureMap(8, device="cpu")
    with pytest.raises(ValueError, match=r"forward must return logits .*got None") as info:
        OverlapRuntime(NoLogits(vocab=VOCAB), fmap).run(Scripted([one_batch(), one_batch()]))
    assert any("'forward'" in n for n in getattr(info.value, "__notes__", []))
    assert_clean(fmap)


# U2: the runtime owns batch.out; releasing it in process() says so.


def test_u2_process_releasing_batch_out_names_the_owner():
    fmap = FutureMap(8, device="cpu")
    sched = Scripted([one_batch(), one_batch()], on_process=lambda r: fmap.release(r.batch.out))
    with pytest.raises(ValueError, match=r"runtime owns batch\.out"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    assert_clean(fmap)


# U3: a sample that returns a valid strided view is accepted.


class StridedSample(ToyModel):
    def sample(self, logits, batch, mask):
        tokens = greedy_sample(logits, batch, mask)
        return torch.stack([tokens, tokens], dim=1)[:, 0]  # stride 2


def test_u3_strided_sample_output_is_accepted():
    specs = random_workload(7, 5, vocab=VOCAB, max_new=6)
    want, *_ = run_workload(ToyModel(vocab=VOCAB), specs, overlap=True, capacity=16)
    got, _, _, fmap = run_workload(StridedSample(vocab=VOCAB), specs, overlap=True, capacity=16)
    assert got == want and fmap.in_use == 0


# U4: numpy integers are ints for the runtime's arguments too; a float is a TypeError.


def test_u4_runtime_integer_arguments():
    fmap = FutureMap(np.int64(8), device="cpu")
    rt = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, n_staging=np.int64(3))
    assert rt.run(Scripted([one_batch()] * 1), max_steps=np.int32(5)).steps == 1
    with pytest.raises(TypeError, match=r"n_staging expects an int .*got float"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap, n_staging=3.5)
    plan = FaultPlan(raise_at={"forward": np.int64(0)})
    with pytest.raises(RuntimeError, match="injected fault at forward of step 0"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap, faults=plan).run(Scripted([one_batch()]))
    assert_clean(fmap)


# U8: max_steps is a count.


@pytest.mark.parametrize(
    ("bad", "exc"),
    [(-1, ValueError), (2.5, TypeError), (True, TypeError), ("3", TypeError)],
    ids=["neg", "float", "bool", "str"],
)
def test_u8_bad_max_steps_is_refused_before_any_step(bad, exc):
    fmap = FutureMap(8, device="cpu")
    sched = Scripted([one_batch()])
    with pytest.raises(exc, match="max_steps"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched, max_steps=bad)
    assert sched.batches and not sched.results  # nothing ran
    assert_clean(fmap)


# U10: a host mask row that allows nothing names the request and the step.


def test_u10_mask_row_that_allows_nothing_is_refused():
    fmap = FutureMap(8, device="cpu")
    mask = np.ones((2, VOCAB), dtype=bool)
    mask[1] = False
    sched = Scripted([one_batch(delayed=True)], mask=mask)
    with pytest.raises(ValueError, match=r"step 0.*request id 1.*allows no token"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap).run(sched)
    assert_clean(fmap)
