"""The runtime benchmarks' baselines do what they claim: the hand-written loop decodes the same
tokens as the runtime, the minimal loop scatters into its buffer, the step clock's arithmetic,
and the contract judges the rows the benchmarks write. Nothing here times anything."""

import os
import sys
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perf import contract
from perf.decode import DecodeScheduler, HandLoop, MinimalLoop, StepClock, ZeroModel
from tfuture import FutureMap
from tfuture.core.batch import StepResult
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ToyModel


class Recording(DecodeScheduler):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.seen: list[np.ndarray] = []

    def process(self, result: StepResult) -> None:
        self.seen.append(result.tokens.copy())
        super().process(result)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stream", ["inline", "worker"])
def test_hand_loop_decodes_what_the_runtime_decodes(stream: str, overlap: bool) -> None:
    n, steps = 4, 6
    sched = Recording(n)
    OverlapRuntime(ToyModel(), FutureMap(64, device="cpu"), overlap=overlap, stream=stream, trace=False).run(
        sched, max_steps=steps
    )
    clock = StepClock()
    hand = HandLoop(ToyModel(), n, overlap, stream, time_model=True, clock=clock)
    seen: list[np.ndarray] = []
    read = hand._read

    def recording_read(*args: Any) -> np.ndarray:
        seen.append(read(*args))
        return seen[-1]

    hand._read = recording_read  # type: ignore[method-assign,assignment]
    hand.run(steps)
    assert len(seen) == len(sched.seen) == steps
    for got, want in zip(seen, sched.seen, strict=True):
        np.testing.assert_array_equal(got, want)
    assert hand.fmap.in_use == 0 and len(hand.model_s) == steps and len(clock.wall) == steps


@pytest.mark.parametrize("overlap", [False, True])
def test_minimal_loop_scatters_the_sampled_tokens(overlap: bool) -> None:
    loop = MinimalLoop(8, overlap)
    before = loop.buf.clone()
    loop.run(3)
    rows = torch.from_numpy(loop.rows)
    assert torch.equal(loop.buf[rows], torch.zeros(8, dtype=torch.int64))  # ZeroModel samples token 0
    others = torch.ones_like(before, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(loop.buf[others], before[others])
    assert ZeroModel(3).logits.shape == (3, 2)


def test_step_clock_leaves_out_fill_and_host_work() -> None:
    clock = StepClock()
    clock.wall, clock.cpu, clock.work = [0.0, 1.0, 3.0, 5.0, 7.0], [0.0, 0.5, 1.5, 2.5, 3.5], [0.2] * 5
    wall, cpu = clock.per_step(skip=1)
    assert wall == pytest.approx(2.0) and cpu == pytest.approx((3.0 - 0.6) / 3)
    with pytest.raises(ValueError):
        clock.per_step(skip=4)


def test_contract_judges_the_rows_the_runtime_benchmarks_write() -> None:
    summary = {
        "runtime_overhead": {
            "thread_cpu_over_floor": {"runtime_sync_inline": {"16": 1.1, "64": 1.3}},
            "thread_cpu_over_minimal": {"runtime_sync_inline": {"16": 2.0, "64": 2.5}},
            "trace_cost": {"16": 1.08, "64": 1.09},
        },
        "host_cycle": {"tfuture_over_pool_indexed": [1.4, 1.45], "tfuture_over_seed_ring": [0.7, 0.81]},
        "overlap": {"step_over_nominal": {"overlap_batch16": {"0.5": 3.0, "1": 1.4, "4": 1.2, "10": 1.05}}},
    }
    rows = {t[3]: contract.judge("", summary, False, t) for t in contract.TARGETS}
    floor = rows["runtime_overhead.thread_cpu_over_floor.runtime_sync_inline"]
    assert floor["status"] == "MISS" and floor["measured"] == 1.3
    assert rows["runtime_overhead.thread_cpu_over_minimal.runtime_sync_inline"]["status"] == "pass"
    assert rows["runtime_overhead.thread_cpu_over_floor.runtime_overlap_auto"]["status"] == "needs GPU"
    # The re-based limits: tracing <= 1.10x, host cycle <= 1.5x pool-indexed and <= 0.8x seed ring.
    assert rows["runtime_overhead.trace_cost"]["status"] == "pass"
    assert rows["host_cycle.tfuture_over_pool_indexed"]["status"] == "pass"
    assert rows["host_cycle.tfuture_over_seed_ring"]["status"] == "MISS"
    assert rows["overlap.step_over_nominal.overlap_batch16.1"]["status"] == "pass"
    assert rows["overlap.step_over_nominal.overlap_batch16.4"]["status"] == "MISS"
    assert rows["overlap.step_over_nominal.overlap_batch64.4"]["status"] == "no data"


def test_contract_judges_every_cell_of_bench_generate() -> None:
    """One row per (model, threads, batch) cell: overlap >= 1.0x HF generate and >= 0.98x sync."""
    from perf import bench_generate

    key = bench_generate.cell("3M", 1, 8)
    summary = {"generate": {"overlap_over_hf": {key: 0.9}, "overlap_over_sync": {key: 0.99}}}
    rows = {t[3]: contract.judge("", summary, False, t) for t in contract.TARGETS}
    assert rows[f"generate.overlap_over_hf.{key}"]["status"] == "MISS"
    assert rows[f"generate.overlap_over_sync.{key}"]["status"] == "pass"
    cells = [f"{s}_t{t}_b{b}" for s in ("3M", "80M") for t in (1, 2) for b in (1, 8, 32)]
    for ratio in ("overlap_over_hf", "overlap_over_sync"):
        assert {w for w in rows if w.startswith(f"generate.{ratio}.")} == {
            f"generate.{ratio}.{c}" for c in cells
        }
    assert rows["generate.overlap_over_hf.80M_t2_b32"]["status"] == "no data"


@pytest.mark.parametrize("n", [1, 5, 64])
def test_the_checked_floor_keeps_the_bookkeeping_rules(n: int) -> None:
    """``bench_host_cycle``'s checked_floor line: the same ids as the other lines, every slot
    back after each cycle, a released or foreign handle and a bad tensor refused."""
    from perf.bench_host_cycle import Inputs, checked_floor_cycle
    from perf.floor_cycle import FloorMap

    x = Inputs(n, device="cpu")  # the floor prototype is a CPU map's (numpy)
    cycle = checked_floor_cycle(x)
    for i in range(7):  # around the ring more than once
        assert torch.equal(cycle(), x.expected(i))
    fmap = FloorMap(2 * n)
    fi = fmap.alloc(n)
    keep = fmap.filter(fi, np.ones(n, dtype=bool))
    assert fmap.refs[fi.start : fi.start + n].tolist() == [2] * n
    with pytest.raises(RuntimeError, match="full"):
        fmap.alloc(n + 1)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        fmap.store(fi, -torch.ones(n, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        fmap.store(fi, torch.zeros(n, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="entries"):
        fmap.store(fi, torch.zeros(n + 1, dtype=torch.int64))
    with pytest.raises(IndexError):
        fmap.resolve(torch.tensor([-(2 * n + 1)]))  # past the map: never read
    fmap.release(fi)
    with pytest.raises(ValueError, match="live handle"):
        fmap.release(fi)
    with pytest.raises(ValueError, match="live handle"):
        FloorMap(n).release(keep)
    fmap.release(keep)
    assert fmap.in_use == 0 and fmap.refs[1:].sum() == 0


def test_profile_spec_phases_wraps_every_phase_and_puts_it_back() -> None:
    """Each phase of ``perf.profile_spec_phases`` resolves, is timed while wrapped (a speculative
    run through the wrappers gives plain decoding's tokens), and is the original again after."""
    pytest.importorskip("transformers")
    from collections import defaultdict

    import tfuture
    from perf import profile_spec_phases as ps
    from tfuture.examples.hf import build_llama
    from tfuture.scheduler import GenerationParams

    def current() -> list[Any]:
        return [ps.phase(modname, path)[2] for modname, path in ps.PHASES]

    before = current()
    model = build_llama()
    params = GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12]]
    want = [r.token_ids for r in tfuture.generate(model, prompts, params, progress=False)]
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    with ps.timed_phases(totals, calls):
        assert all(a is not b for a, b in zip(current(), before, strict=True))
        got = tfuture.generate(model, prompts, params, speculative=tfuture.NGramDrafter(k=2), progress=False)
    assert [r.token_ids for r in got] == want
    assert calls["SpecTokenStep._verify"] >= 1 and calls["HFCausalLM.forward"] >= 1
    assert totals["StepLauncher._launch"] >= totals["HFCausalLM.forward"] > 0
    assert all(a is b for a, b in zip(current(), before, strict=True))
