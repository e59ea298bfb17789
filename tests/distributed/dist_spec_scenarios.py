"""What each rank runs in the speculative multi-process tests (module level: spawned workers
import it). Every rank builds the same speculative schedulers and its own drafter; only the
last stage's tensor rank 0 verifies and drafts, and every rank stores what it sends."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from dist_scenarios import EOS, MODEL, N_REQ, _map_digest, _outcome, join, sampled_workload, workload

from tfuture import FutureMap
from tfuture.distributed import ParallelRuntime
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec import DraftContext, NGramDrafter, SpecTokenStep
from tfuture.steps.token import Buckets
from tfuture.testing import ContinuousBatcher
from tfuture.testing.faults import random_delay
from tfuture.testing.tp import ParallelTransformer, split_round_robin

K = 3


class OracleDrafter(NGramDrafter):
    """Drafts the reference run's next ``k`` tokens (so most drafts are accepted), with the
    second draft of every third request and step made wrong (so some runs are cut short).
    Reads device values on the host: a test drafter on the CPU backend only."""

    def __init__(self, k: int, reference: dict[int, list[int]], prompt_lens: dict[int, int]) -> None:
        super().__init__(k=k)
        self.reference, self.prompt_lens, self.calls = reference, prompt_lens, 0

    def draft(self, ctx: DraftContext) -> torch.Tensor:
        out = torch.zeros(len(ctx.req_ids), self.k, dtype=torch.int64)
        for i, (rid, seq_len) in enumerate(zip(ctx.req_ids.tolist(), ctx.seq_lens.tolist(), strict=True)):
            ref = self.reference[rid]
            done = seq_len - self.prompt_lens[rid]  # tokens generated: the drafts continue them
            nxt = ref[done : done + self.k]
            out[i, : len(nxt)] = torch.tensor(nxt, dtype=torch.int64)
            self.calls += 1
            if self.calls % 3 == 0:
                out[i, 1] = (out[i, 1] + 1) % MODEL["vocab"]
        return out


def oracle(reference: dict[int, list[int]]) -> OracleDrafter:
    drafter = OracleDrafter(K, reference, {s.rid: s.prompt.size for s in workload()})
    drafter.bind(N_REQ, MODEL["max_len"], torch.device("cpu"))
    return drafter


def ngram() -> NGramDrafter:
    drafter = NGramDrafter(k=K, max_ngram=2)
    drafter.bind(N_REQ, MODEL["max_len"], torch.device("cpu"))
    return drafter


def spec_run(
    rank: int, world: int, port: int, tp: int, pp: int, reference: dict[int, list[int]], light: bool = False
) -> dict[str, Any]:
    """The greedy workload, speculative: the oracle drafter in sync and overlapped under stream
    delays (debug checks on: every step's batch and stored tokens compared across ranks), and
    the n-gram drafter overlapped, unpadded and padded to ``Buckets`` (debug checks on)
    (``light``: the overlapped oracle run only)."""
    ctx = join(rank, world, port, tp, pp)
    runs: dict[str, Any] = {}
    padded = Buckets(rows=(8, 16, 32), reqs=(2, 4))
    variants = [
        ("oracle_sync", False, oracle, False, None),
        ("oracle_overlap", True, oracle, True, None),
        ("ngram_overlap", True, lambda _ref: ngram(), False, None),
        ("ngram_overlap_padded", True, lambda _ref: ngram(), True, padded),
    ]
    try:
        for name, overlap, make, debug, buckets in variants[1:2] if light else variants:
            fmap = FutureMap(96, device="cpu", debug=debug)
            groups = [
                ContinuousBatcher(part, fmap, eos=EOS, max_running=2, speculative=K)
                for part in split_round_robin(workload(), pp)
            ]
            delay = random_delay(300 + rank, p=0.3, max_s=2e-3) if overlap else None
            model = ParallelTransformer(ctx=ctx, **MODEL)
            runtime = ParallelRuntime(
                model, fmap, ctx, overlap=overlap, delay=delay, speculative=make(reference), buckets=buckets
            )
            stats = runtime.run(groups)
            runs[name] = {
                "outputs": {rid: out for g in groups for rid, out in g.outputs.items()},
                "in_use": fmap.in_use,
                "steps": stats.steps,
                "map": _map_digest(fmap),
                "drafted": sum(g.drafted_tokens for g in groups),
                "accepted": sum(g.accepted_tokens for g in groups),
            }
    finally:
        ctx.close()
    runs["initialized_after"] = dist.is_initialized()
    runs["interpret"] = os.environ.get("TRITON_INTERPRET")
    return runs


def sampled_spec_reference() -> dict[int, list[int]]:
    """:func:`dist_scenarios.sampled_workload` (sampling parameters, penalties, grammar rows)
    speculative with the n-gram drafter on one rank."""
    specs, grammar = sampled_workload()
    fmap = FutureMap(96, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=EOS, max_running=4, grammar=grammar, speculative=K)
    step = SpecTokenStep(ParallelTransformer(**MODEL), ngram(), Sampler(history_rows=N_REQ))
    OverlapRuntime(step, fmap).run(sched)
    assert fmap.in_use == 0
    return sched.outputs


def sampled_spec_run(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """:func:`sampled_spec_reference` on ``tp x pp`` ranks, overlapped under stream delays."""
    ctx = join(rank, world, port, tp, pp)
    try:
        specs, grammar = sampled_workload()
        fmap = FutureMap(96, device="cpu")
        groups = [
            ContinuousBatcher(part, fmap, eos=EOS, max_running=2, grammar=grammar, speculative=K)
            for part in split_round_robin(specs, pp)
        ]
        sampler = Sampler(history_rows=N_REQ)
        delay = random_delay(500 + rank, p=0.3, max_s=2e-3)
        model = ParallelTransformer(ctx=ctx, **MODEL)
        ParallelRuntime(model, fmap, ctx, delay=delay, sampler=sampler, speculative=ngram()).run(groups)
        outputs = {rid: out for g in groups for rid, out in g.outputs.items()}
        return {"outputs": outputs, "in_use": fmap.in_use, "live_rows": sampler.live_rows}
    finally:
        ctx.close()


def k_mismatch(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """Rank 1 drafts 2 tokens a step where rank 0 drafts 3: every rank must refuse to run."""
    ctx = join(rank, world, port, tp, pp)
    k = K if rank == 0 else K - 1
    fmap = FutureMap(96, device="cpu")
    groups = [
        ContinuousBatcher(part, fmap, eos=EOS, max_running=2, speculative=k)
        for part in split_round_robin(workload(), pp)
    ]
    drafter = NGramDrafter(k=k)
    drafter.bind(N_REQ, MODEL["max_len"], torch.device("cpu"))
    runtime = ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx, speculative=drafter)
    out = _outcome(lambda: runtime.run(groups), fmap)
    ctx.close()
    return out
