"""Step time against ranks, sync vs overlap, tensor and pipeline parallel on the CPU backend (gloo).

    python -m perf bench_distributed          # CI=1: fewer rounds, 1 and 2 ranks

``batch`` requests decode together. A *round* advances every request by one token: one step
under tensor parallel, ``pp`` micro-batch steps under pipeline parallel (``pp`` groups of
``batch / pp`` requests). The device work is fixed per round, ``T_DEV``, and split over the
ranks: each forward sleeps ``T_DEV x (its requests / batch) / world`` on the forward stream
(worker thread), next to the real compute of a small
:class:`tfuture.testing.tp.ParallelTransformer` and its gloo all-reduces, sends and receives.
The host sleeps ``T_CPU`` per round, spread over the round's steps (host work that releases
the GIL, as C extensions do; a spinning host in every process would oversubscribe a 2-core
machine). Lines: ms per round for ``tp = world`` and ``pp = world``, overlap and sync; at one
rank both are the single-rank run through the same code path. Nominal ideal:
``max(T_DEV / world, T_CPU)``. Each point runs in freshly joined process groups on ``world``
spawned processes (one torch thread each), so a point also pays the interprocess latency of
a shared machine (a gloo all-reduce of a few KB costs about 2 ms on the 2-core CI machine).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import triton

from perf import harness
from perf.harness import DEVICE
from tfuture.testing.spawn import RankPool

T_DEV_MS, T_CPU_MS, BATCH = 8.0, 2.0, 16
WORLDS = harness.sweep([1, 2, 4], [1, 2])
ROUNDS = harness.sweep([40], [12])[0]
LINES = [(layout, mode) for layout in ("tp", "pp") for mode in ("overlap", "sync")]
NAMES = [f"{layout.upper()}, {mode}" for layout, mode in LINES]
STYLES = [("blue" if m == "overlap" else "red", "-" if lay == "tp" else "--") for lay, m in LINES]


class _ScaledWork:
    """Bench-side wrapper: sleep ``t_round x (requests / batch) / world`` per forward, then run
    the model (whose own stand-in work is off)."""

    def __init__(self, model: Any, t_round: float, batch: int, world: int) -> None:
        self.model, self.per_req = model, t_round / batch / world
        self.hidden_size, self.hidden_dtype = model.hidden_size, model.hidden_dtype

    def forward(self, fb: Any, hidden: Any = None) -> Any:
        time.sleep(self.per_req * int(fb.req_ids.numel()))
        return self.model.forward(fb, hidden)

    def sample(self, logits: Any, fb: Any, mask: Any) -> Any:
        return self.model.sample(logits, fb, mask)


def measure(rank: int, world: int, port: int, tp: int, pp: int, overlap: bool, rounds: int) -> float:
    """On every rank: one run; returns ms per round (rank 0's wall time / rounds)."""
    import numpy as np
    import torch

    from tfuture import FutureMap
    from tfuture.distributed import ParallelRuntime, init_parallel
    from tfuture.testing import ContinuousBatcher, RequestSpec
    from tfuture.testing.tp import ParallelTransformer, split_round_robin

    torch.set_num_threads(1)
    ctx = init_parallel(tp, pp, rank=rank, world_size=world, master_port=port, timeout_s=60)
    try:
        specs = [RequestSpec(i, 0, np.array([i + 1, 2, 3], dtype=np.int64), rounds) for i in range(BATCH)]
        fmap = FutureMap(4 * BATCH + 8, device="cpu")
        groups = [
            ContinuousBatcher(part, fmap, eos=-1, max_running=BATCH, token_budget=4 * BATCH,
                              host_work_s=T_CPU_MS / 1e3 / pp)
            for part in split_round_robin(specs, pp)
        ]  # fmt: skip
        model = ParallelTransformer(
            64, d_model=32, n_heads=4, n_layers=4, max_requests=BATCH, max_len=rounds + 8, ctx=ctx
        )
        runtime = ParallelRuntime(
            _ScaledWork(model, T_DEV_MS / 1e3, BATCH, world), fmap, ctx, overlap=overlap
        )
        stats = runtime.run(groups, max_steps=None)
        assert fmap.in_use == 0
        # Rounds: every request decoded `rounds` tokens, one per round (the prefill is round 1).
        return stats.wall / rounds * 1e3
    finally:
        ctx.close()


@functools.cache
def point(world: int, layout: str, mode: str) -> float:
    """ms per round, rank 0's measurement (one pool of workers per world size at a time)."""
    if world not in _POOLS:
        _close_pools()
        _POOLS[world] = RankPool(world, interpret=False)
    tp, pp = (world, 1) if layout == "tp" else (1, world)
    return float(_POOLS[world].run(measure, tp, pp, mode == "overlap", ROUNDS, timeout_s=300)[0])


_POOLS: dict[int, RankPool] = {}


def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["world"],
        x_vals=WORLDS,
        x_log=False,
        y_log=False,
        line_arg="line",
        line_vals=LINES,
        line_names=NAMES,
        styles=STYLES,
        xlabel=f"ranks ({DEVICE}, gloo; T_dev {T_DEV_MS:g} ms per round over ranks, T_cpu {T_CPU_MS:g} ms)",
        ylabel="ms per round",
        plot_name="distributed_round_ms",
        args={},
    )
)
def distributed_round(world: int, line: tuple[str, str]) -> float:
    """ms per decode round (every request one token) against ranks: tensor and pipeline parallel,
    overlapped and sync, on the CPU backend with gloo."""
    return point(world, *line)


LOOK = harness.Look(
    what="decode round time against ranks: TP and PP, overlap vs sync (gloo)",
    ylabel="ms per round (every request one token)",
    xlabel=f"ranks ({DEVICE}, gloo; T_dev {T_DEV_MS:g} ms per round split over ranks, T_cpu {T_CPU_MS:g} ms)",
    refs=(
        harness.Ref(
            "nominal ideal max(T_dev / ranks, T_cpu)", [max(T_DEV_MS / w, T_CPU_MS) for w in WORLDS], ls=":"
        ),
    ),
)


def main() -> None:
    if harness.HAS_CUDA:
        harness.skip("bench_distributed", "CPU backend sweep; on a GPU run perf/nccl_smoke.py (NCCL)")
        return
    try:
        harness.save(distributed_round, lambda _: LOOK)
    finally:
        _close_pools()
    values = {f"{lay}_{mode}": {str(w): round(point(w, lay, mode), 3) for w in WORLDS} for lay, mode in LINES}
    ideal = {str(w): round(max(T_DEV_MS / w, T_CPU_MS), 3) for w in WORLDS}
    harness.record(
        "distributed",
        {
            "rounds": ROUNDS,
            "batch": BATCH,
            "cores": os.cpu_count(),
            "ms_per_round": values,
            "nominal_ideal_ms": ideal,
        },
    )
    for name, vals in values.items():
        print(f"{name}: ms per round by ranks {vals} (nominal ideal {ideal})")
    if (os.cpu_count() or 1) < max(WORLDS):
        print(f"note: {max(WORLDS)} ranks on {os.cpu_count()} cores are oversubscribed")
