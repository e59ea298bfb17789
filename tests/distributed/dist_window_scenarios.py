"""What each rank runs in the multi-step (window) multi-process tests (module level: spawned
workers import it). Every rank builds the same ``ContinuousBatcher(multi_step=K)`` schedulers
and its own Sampler; only tensor rank 0 samples each step of a window, and every rank stores
each request's last token of the window."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from dist_scenarios import (
    EOS,
    MODEL,
    N_REQ,
    VOCAB,
    _map_digest,
    _outcome,
    join,
    sampled_workload,
    workload,
)

from tfuture import FutureMap
from tfuture.distributed import ParallelRuntime
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec import MultiStepTokenStep
from tfuture.testing import ContinuousBatcher, ToyGrammar, random_workload
from tfuture.testing.faults import random_delay
from tfuture.testing.tp import ParallelTransformer, split_round_robin

WINDOWS = (2, 4)


def window_run(rank: int, world: int, port: int, tp: int, pp: int, light: bool = False) -> dict[str, Any]:
    """The greedy workload with windows of ``K`` in :data:`WINDOWS`, in sync and overlapped
    under stream delays, debug checks on (every step's batch, stored tokens and window tokens
    compared across ranks); ``light``: ``K = 4`` overlapped only."""
    ctx = join(rank, world, port, tp, pp)
    runs: dict[str, Any] = {}
    modes = (("overlap", True),) if light else (("sync", False), ("overlap", True))
    try:
        for k in WINDOWS[-1:] if light else WINDOWS:
            for name, overlap in modes:
                fmap = FutureMap(64, device="cpu", debug=True)
                groups = [
                    ContinuousBatcher(part, fmap, eos=EOS, max_running=2, multi_step=k)
                    for part in split_round_robin(workload(), pp)
                ]
                delay = random_delay(700 + 10 * k + rank, p=0.3, max_s=2e-3) if overlap else None
                sampler = Sampler(history_rows=N_REQ)
                model = ParallelTransformer(ctx=ctx, **MODEL)
                runtime = ParallelRuntime(
                    model, fmap, ctx, overlap=overlap, delay=delay, check=True, sampler=sampler, windows=True
                )
                stats = runtime.run(groups)
                runs[f"k{k}_{name}"] = {
                    "outputs": {rid: out for g in groups for rid, out in g.outputs.items()},
                    "in_use": fmap.in_use,
                    "live_rows": sampler.live_rows,
                    "steps": stats.steps,
                    "extra": sum(g.extra_tokens for g in groups),
                    "map": _map_digest(fmap),
                }
    finally:
        ctx.close()
    runs["initialized_after"] = dist.is_initialized()
    runs["interpret"] = os.environ.get("TRITON_INTERPRET")
    return runs


def sampled_window_workload() -> tuple[list[Any], ToyGrammar]:
    """Seeded sampling (temperature, top-p, top-k, min-p), penalties and greedy requests, as
    :func:`dist_scenarios.sampled_workload` gives them, with longer outputs (up to 12 tokens)
    and one grammar request (the windows it joins run one step), so that most steps are windows."""
    specs, grammar = sampled_workload()
    kinds = [s.params for s in specs[:5]]
    base = random_workload(13, N_REQ, vocab=VOCAB, max_prompt=8, max_new=12, arrival_span=5)
    return [replace(s, params=kinds[i % len(kinds)], grammar=i == 7) for i, s in enumerate(base)], grammar


def sampled_window_reference(k: int) -> tuple[dict[int, list[int]], int]:
    """:func:`sampled_window_workload` with windows of ``k`` on one rank: the whole model
    through :class:`MultiStepTokenStep` (``k = 1``: the plain token step with the Sampler);
    the outputs and the run's launches."""
    specs, grammar = sampled_window_workload()
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(
        specs, fmap, eos=EOS, max_running=2, grammar=grammar, delay="rows", multi_step=k
    )
    model, sampler = ParallelTransformer(**MODEL), Sampler(history_rows=N_REQ)
    if k == 1:
        stats = OverlapRuntime(model, fmap, sampler=sampler).run(sched)
    else:
        stats = OverlapRuntime(MultiStepTokenStep(model, sampler), fmap).run(sched)
    assert fmap.in_use == 0 and sampler.live_rows == 0
    return sched.outputs, stats.steps


def sampled_window_run(rank: int, world: int, port: int, tp: int, pp: int, k: int) -> dict[str, Any]:
    """:func:`sampled_window_reference` on ``tp x pp`` ranks, overlapped under stream delays."""
    ctx = join(rank, world, port, tp, pp)
    try:
        specs, grammar = sampled_window_workload()
        fmap = FutureMap(64, device="cpu")
        groups = [
            ContinuousBatcher(part, fmap, eos=EOS, max_running=2, grammar=grammar, delay="rows", multi_step=k)
            for part in split_round_robin(specs, pp)
        ]
        sampler = Sampler(history_rows=N_REQ)
        delay = random_delay(900 + rank, p=0.3, max_s=2e-3)
        model = ParallelTransformer(ctx=ctx, **MODEL)
        stats = ParallelRuntime(model, fmap, ctx, delay=delay, sampler=sampler, windows=True).run(groups)
        outputs = {rid: out for g in groups for rid, out in g.outputs.items()}
        return {
            "outputs": outputs,
            "in_use": fmap.in_use,
            "live_rows": sampler.live_rows,
            "steps": stats.steps,
        }
    finally:
        ctx.close()


def refusals(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """Multi-step schedulers the run cannot take, each refused before any step: without
    ``windows=True``; a window length that differs across ranks."""
    ctx = join(rank, world, port, tp, pp)
    out: dict[str, Any] = {}
    try:
        model = ParallelTransformer(ctx=ctx, **MODEL)

        def attempt(name: str, k: int, windows: bool) -> None:
            fmap = FutureMap(64, device="cpu")
            groups = [
                ContinuousBatcher(part, fmap, eos=EOS, max_running=2, multi_step=k)
                for part in split_round_robin(workload(), pp)
            ]
            runtime = ParallelRuntime(model, fmap, ctx, windows=windows)
            out[name] = _outcome(lambda: runtime.run(groups), fmap)

        attempt("no_windows", 2, False)
        attempt("k_mismatch", 2 if rank == 0 else 4, True)
        # The refusals left the context open: a plain run still goes.
        fmap = FutureMap(64, device="cpu")
        groups = [
            ContinuousBatcher(part, fmap, eos=EOS, max_running=2)
            for part in split_round_robin(workload(), pp)
        ]
        ParallelRuntime(model, fmap, ctx).run(groups)
        out["after"] = {rid: toks for g in groups for rid, toks in g.outputs.items()}
    finally:
        ctx.close()
    return out
