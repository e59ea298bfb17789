"""The ``--tp``/``--pp`` modes of ``python -m tfuture.testing.demo``, launched by ``torchrun``.

    torchrun --nproc-per-node 2 -m tfuture.testing.demo --tp 2
    torchrun --nproc-per-node 2 -m tfuture.testing.demo --pp 2

Every rank runs :class:`tfuture.testing.tp.ParallelTransformer` (its share of ``--t-dev`` ms of
stand-in device work per step: ``t_dev / (tp * pp)`` per rank), and the same decode workload
with ``ratio x T_dev`` of host work per step, in sync and overlap mode. Rank 0 prints the step
times and writes the overlapped run's Chrome trace; every rank checks that both modes produced
the same tokens and released every slot.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from tfuture.core.future_map import FutureMap
from tfuture.distributed.context import init_parallel
from tfuture.distributed.runtime import ParallelRuntime
from tfuture.scheduler import ContinuousBatcher, RequestSpec
from tfuture.streams.stats import RunStats
from tfuture.testing.tp import ParallelTransformer, split_round_robin

__all__ = ["run_distributed_demo"]


def _launcher() -> str:
    """torchrun as this interpreter runs it (works without the virtualenv active)."""
    return f"{sys.executable} -m torch.distributed.run"


def run_distributed_demo(args: argparse.Namespace) -> int:
    """Run the demo on this rank (``args``: the demo's parsed flags); the exit status."""
    world = args.tp * args.pp
    if world > 1 and "RANK" not in os.environ:
        launch = f"--nproc-per-node {world} -m tfuture.testing.demo --tp {args.tp} --pp {args.pp}"
        print(
            f"--tp {args.tp} --pp {args.pp} needs {world} processes: launch with\n  torchrun {launch}\n"
            f"or, without the virtualenv active,\n  {_launcher()} {launch}",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    ctx = init_parallel(args.tp, args.pp, timeout_s=args.timeout)
    try:
        dev = ctx.device
        specs = [
            RequestSpec(i, 0, np.array([i % 60 + 1, 2, 3], dtype=np.int64), args.steps)
            for i in range(args.batch)
        ]
        t_dev = args.t_dev / 1e3
        if ctx.rank == 0:
            print(
                f"tp={ctx.tp} pp={ctx.pp} backend={ctx.backend} device={dev} batch={args.batch} "
                f"steps={args.steps}; device work {args.t_dev:.1f} ms per step "
                f"({1e3 * t_dev / world:.2f} ms per rank)"
            )
            cols = ["T_cpu/T_dev", "sync ms", "overlap ms", "speedup", "bubbles"]
            print(" ".join(f"{c:>11}" for c in cols))
        for i, ratio in enumerate(float(r) for r in args.ratios.split(",")):
            runs: list[tuple[RunStats, dict[int, list[int]], int]] = []
            for overlap in (False, True):
                fmap = FutureMap(4 * args.batch + 8, device=dev)
                groups = [
                    ContinuousBatcher(part, fmap, eos=-1, max_running=args.batch, token_budget=4 * args.batch,
                                      host_work_s=ratio * t_dev, host_work_holds_gil=args.gil)
                    for part in split_round_robin(specs, ctx.pp)
                ]  # fmt: skip
                model = ParallelTransformer(
                    64, d_model=64, n_heads=4 * ctx.tp, n_layers=2 * ctx.pp, max_requests=args.batch,
                    max_len=args.steps + 8, device=dev, ctx=ctx, work_s=t_dev / world,
                )  # fmt: skip
                runtime = ParallelRuntime(model, fmap, ctx, overlap=overlap, trace=bool(args.trace))
                stats = runtime.run(groups)
                outputs = {rid: out for g in groups for rid, out in g.outputs.items()}
                if fmap.in_use:
                    raise RuntimeError(f"rank {ctx.rank}: {fmap.in_use} slots left in use")
                assert runtime.scheduler is not None
                runs.append((stats, outputs, runtime.scheduler.bubbles))
            (sync, sync_out, _), (over, over_out, bubbles) = runs
            if sync_out != over_out:
                raise RuntimeError(f"rank {ctx.rank}: overlap and sync produced different tokens")
            if ctx.rank == 0:
                row = [
                    f"{ratio:.2f}",
                    f"{sync.step_time * 1e3:.3f}",
                    f"{over.step_time * 1e3:.3f}",
                    f"{sync.step_time / over.step_time:.2f}x",
                    f"{bubbles}",
                ]
                print(" ".join(f"{c:>11}" for c in row))
                if i == 0 and args.trace:
                    over.write_chrome_trace(args.trace)
        if ctx.rank == 0:
            print("sync and overlap produced the same tokens on every rank")
            if args.trace:
                print(f"rank 0's timeline: {args.trace} (open in https://ui.perfetto.dev)")
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":  # not an entry point of its own: say which one it is
    parser = argparse.ArgumentParser(
        prog="python -m tfuture.testing.demo_parallel",
        usage="torchrun --nproc-per-node N -m tfuture.testing.demo --tp N | --pp N [options]",
        description=__doc__
        + "\nThis module is not run directly: its flags are those of python -m tfuture.testing.demo\n"
        "(python -m tfuture.testing.demo --help lists them).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_known_args()
    parser.error(f"run the parallel demo as: {_launcher()} --nproc-per-node 2 -m tfuture.testing.demo --tp 2")
