"""What each rank runs in the multi-process tests (module level, so spawned workers import it).

Every scenario joins a fresh ``tp x pp`` group on the port the parent chose, returns plain data
(outputs, slots in use, what it raised) and leaves the process group destroyed. Planted
failures and divergences live here, as test-side wrappers: the package has no test switches.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tfuture import FutureMap
from tfuture.core.batch import Batch, StepResult
from tfuture.distributed import ParallelContext, ParallelRuntime, init_parallel
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams
from tfuture.steps.token import Buckets
from tfuture.testing import ContinuousBatcher, ToyGrammar, random_workload
from tfuture.testing.faults import random_delay
from tfuture.testing.tp import ParallelTransformer, split_round_robin

TIMEOUT_S = 20.0  # the process groups' timeout; the parent's join timeout is larger
N_REQ, VOCAB, EOS = 10, 64, 33  # 33 ends requests 1, 4 and 5 early (the extra step runs)
MODEL = dict(vocab=VOCAB, d_model=32, n_heads=4, n_layers=2, max_requests=N_REQ, max_len=32)


def join(rank: int, world: int, port: int, tp: int, pp: int, timeout_s: float = TIMEOUT_S) -> ParallelContext:
    """This rank's ``tp x pp`` groups over gloo (CPU tensors, also on a machine with GPUs)."""
    return init_parallel(
        tp, pp, rank=rank, world_size=world, master_port=port, backend="gloo", timeout_s=timeout_s
    )


def workload(seed: int = 0) -> list[Any]:
    return random_workload(seed, N_REQ, vocab=VOCAB, max_prompt=10, max_new=8, arrival_span=6)


def reference() -> dict[int, list[int]]:
    """The single-rank run: the whole model, one scheduler, the plain runtime."""
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(workload(), fmap, eos=EOS, max_running=4)
    OverlapRuntime(ParallelTransformer(**MODEL), fmap).run(sched)
    assert fmap.in_use == 0
    return sched.outputs


def grammar_workload() -> tuple[list[Any], ToyGrammar]:
    specs = random_workload(5, 8, vocab=VOCAB, max_prompt=8, max_new=8, arrival_span=4, grammar_share=0.6)
    return specs, ToyGrammar(VOCAB, seed=2)


def grammar_reference() -> dict[int, list[int]]:
    specs, grammar = grammar_workload()
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=EOS, max_running=4, grammar=grammar)
    OverlapRuntime(ParallelTransformer(**MODEL), fmap).run(sched)
    return sched.outputs


def grammar_run(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """Overlap under stream delays with grammar requests: only their rows wait for the masks."""
    ctx = join(rank, world, port, tp, pp)
    try:
        specs, grammar = grammar_workload()
        fmap = FutureMap(64, device="cpu")
        groups = [
            ContinuousBatcher(part, fmap, eos=EOS, max_running=2, grammar=grammar)
            for part in split_round_robin(specs, pp)
        ]
        delay = random_delay(7 + rank, p=0.3, max_s=2e-3)
        ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx, delay=delay).run(groups)
        outputs: dict[int, list[int]] = {}
        for g in groups:
            outputs.update(g.outputs)
        return {"outputs": outputs, "in_use": fmap.in_use}
    finally:
        ctx.close()


def sampled_workload() -> tuple[list[Any], ToyGrammar]:
    """Per-request SamplingParams (temperature, top-p, top-k, min-p, seeds, penalties) mixed
    with greedy requests, and grammar requests (their rows wait for packed bitmask rows)."""
    specs = random_workload(
        11, N_REQ, vocab=VOCAB, max_prompt=8, max_new=8, arrival_span=5, grammar_share=0.4
    )
    kinds = [
        SamplingParams(temperature=0.9, top_p=0.8, seed=7),
        SamplingParams(temperature=1.3, top_k=12, min_p=0.05, seed=21, frequency_penalty=0.4),
        None,
        SamplingParams(temperature=0.7, seed=3, presence_penalty=0.6, repetition_penalty=1.2),
        SamplingParams(repetition_penalty=1.5),  # greedy with a penalty
    ]
    specs = [replace(s, params=kinds[i % len(kinds)]) for i, s in enumerate(specs)]
    return specs, ToyGrammar(VOCAB, seed=4)


def sampled_reference() -> dict[int, list[int]]:
    """The single-rank run of :func:`sampled_workload`: one scheduler, the plain runtime."""
    specs, grammar = sampled_workload()
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=EOS, max_running=4, grammar=grammar, delay="rows")
    OverlapRuntime(ParallelTransformer(**MODEL), fmap, sampler=Sampler(history_rows=N_REQ)).run(sched)
    assert fmap.in_use == 0
    return sched.outputs


def sampled_run(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """:func:`sampled_workload` in sync and overlapped under stream delays, with every rank's own
    Sampler (the last stage's tensor rank 0 samples, then broadcasts and sends the tokens)."""
    ctx = join(rank, world, port, tp, pp)
    runs: dict[str, Any] = {}
    try:
        for name, overlap in (("sync", False), ("overlap", True)):
            specs, grammar = sampled_workload()
            fmap = FutureMap(64, device="cpu")
            groups = [
                ContinuousBatcher(part, fmap, eos=EOS, max_running=2, grammar=grammar, delay="rows")
                for part in split_round_robin(specs, pp)
            ]
            delay = random_delay(40 + rank, p=0.3, max_s=2e-3) if overlap else None
            sampler = Sampler(history_rows=N_REQ)
            model = ParallelTransformer(ctx=ctx, **MODEL)
            ParallelRuntime(model, fmap, ctx, overlap=overlap, delay=delay, sampler=sampler).run(groups)
            outputs: dict[int, list[int]] = {}
            for g in groups:
                outputs.update(g.outputs)
            runs[name] = {"outputs": outputs, "in_use": fmap.in_use, "live_rows": sampler.live_rows}
    finally:
        ctx.close()
    return runs


def _map_digest(fmap: FutureMap) -> str:
    return hashlib.sha1(fmap.token_map.numpy().tobytes()).hexdigest()


def equivalence(rank: int, world: int, port: int, tp: int, pp: int, debug_run: bool = True) -> dict[str, Any]:
    """Sync, overlap under random stream delays, and (``debug_run``) overlap in debug mode and
    overlap in debug mode with every step padded to ``Buckets``."""
    ctx = join(rank, world, port, tp, pp)
    runs: dict[str, Any] = {}
    variants = [
        ("sync", False, None, False, None),
        ("overlap_delayed", True, random_delay(100 + rank, p=0.3, max_s=2e-3), False, None),
        ("overlap_debug", True, None, True, None),
        ("overlap_padded", True, None, True, Buckets(rows=(4, 8, 16), reqs=(2, 4))),
    ]
    try:
        for name, overlap, delay, debug, buckets in variants if debug_run else variants[:2]:
            fmap = FutureMap(64, device="cpu", debug=debug)
            groups = [
                ContinuousBatcher(part, fmap, eos=EOS, max_running=2)
                for part in split_round_robin(workload(), pp)
            ]
            runtime = ParallelRuntime(
                ParallelTransformer(ctx=ctx, **MODEL),
                fmap,
                ctx,
                overlap=overlap,
                delay=delay,
                buckets=buckets,
            )
            stats = runtime.run(groups)
            outputs: dict[int, list[int]] = {}
            for g in groups:
                outputs.update(g.outputs)
            assert runtime.scheduler is not None
            runs[name] = {
                "outputs": outputs,
                "in_use": fmap.in_use,
                "steps": stats.steps,
                "bubbles": runtime.scheduler.bubbles,
                "extra": sum(g.extra_tokens for g in groups),
                "map": _map_digest(fmap),
            }
    finally:
        ctx.close()
    runs["initialized_after"] = dist.is_initialized()
    runs["interpret"] = os.environ.get("TRITON_INTERPRET")  # inherited from the parent (conftest)
    return runs


def cut_then_full(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """A run cut at 5 micro-batches, then a full run on the same groups: nothing of the first
    run (a token still in flight) may leak into the second."""
    ctx = join(rank, world, port, tp, pp)
    try:
        out: dict[str, Any] = {}
        for name, max_steps in (("cut", 5), ("full", None)):
            fmap = FutureMap(64, device="cpu")
            groups = [
                ContinuousBatcher(part, fmap, eos=EOS, max_running=2)
                for part in split_round_robin(workload(), pp)
            ]
            runtime = ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx)
            stats = runtime.run(groups, max_steps=max_steps)
            assert runtime.scheduler is not None
            outputs = {rid: toks for g in groups for rid, toks in g.outputs.items()}
            out[name] = {"outputs": outputs, "in_use": fmap.in_use, "steps": stats.steps}
            out[name].update(micro=runtime.scheduler.micro_batches, bubbles=runtime.scheduler.bubbles)
        return out
    finally:
        ctx.close()


class ReusedBuffer:
    """Test-side wrapper: ``sample`` returns one buffer it rewrites every step (as a model that
    hands back a CUDA graph's static output does)."""

    def __init__(self, model: ParallelTransformer) -> None:
        self.model = model
        self.hidden_size, self.hidden_dtype = model.hidden_size, model.hidden_dtype
        self.buf = torch.full((64,), -7, dtype=torch.int64)

    def forward(self, batch: Any, hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.forward(batch, hidden)

    def sample(self, logits: torch.Tensor, batch: Any, mask: torch.Tensor | None) -> torch.Tensor:
        tokens = self.model.sample(logits, batch, mask)
        out = self.buf[: tokens.numel()]
        out.copy_(tokens)
        return out


def reused_sample_buffer(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """An overlapped run whose model's ``sample`` returns one reused buffer: the parallel step
    copies the tokens it stores ``lag`` micro-batches later and sends asynchronously."""
    ctx = join(rank, world, port, tp, pp)
    try:
        fmap = FutureMap(64, device="cpu")
        groups = [
            ContinuousBatcher(part, fmap, eos=EOS, max_running=2)
            for part in split_round_robin(workload(), pp)
        ]
        model = ReusedBuffer(ParallelTransformer(ctx=ctx, **MODEL))
        ParallelRuntime(model, fmap, ctx, overlap=True).run(groups)
        outputs = {rid: toks for g in groups for rid, toks in g.outputs.items()}
        return {"outputs": outputs, "in_use": fmap.in_use}
    finally:
        ctx.close()


class FailingModel:
    """Test-side wrapper: ``forward`` (or ``sample``) raises at step ``at`` on this rank.

    ``hold``: an object to keep a reference to (a process group), as a model that caches its
    group does: the group then stays open after the failure and peers wait for the timeout.
    """

    def __init__(self, model: ParallelTransformer, at: int, where: str, hold: Any = None) -> None:
        self.model, self.at, self.where, self.hold = model, at, where, hold
        self.hidden_size, self.hidden_dtype = model.hidden_size, model.hidden_dtype

    def forward(self, batch: Any, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self.where == "forward" and batch.step == self.at:
            raise RuntimeError(f"planted failure in forward of step {batch.step}")
        return self.model.forward(batch, hidden)

    def sample(self, logits: torch.Tensor, batch: Any, mask: torch.Tensor | None) -> torch.Tensor:
        if self.where == "sample" and batch.step == self.at:
            raise RuntimeError(f"planted failure in sample of step {batch.step}")
        return self.model.sample(logits, batch, mask)


def _outcome(fn: Any, fmap: FutureMap) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        raised: dict[str, Any] = {"type": None, "message": ""}
    except Exception as exc:  # the scenario reports what it raised
        raised = {
            "type": type(exc).__name__,
            "message": str(exc),
            "origin": getattr(exc, "origin_rank", None),
        }
    raised.update(seconds=time.monotonic() - t0, in_use=fmap.in_use, initialized_after=dist.is_initialized())
    return raised


def planted_failure(
    rank: int,
    world: int,
    port: int,
    tp: int,
    pp: int,
    fail_rank: int,
    at: int,
    where: str = "forward",
    hold_group: bool = False,
    timeout_s: float = TIMEOUT_S,
) -> dict[str, Any]:
    """Rank ``fail_rank``'s ``where`` raises at step ``at``: what each rank raises, its slots."""
    ctx = join(rank, world, port, tp, pp, timeout_s)
    fmap = FutureMap(64, device="cpu")
    model: Any = ParallelTransformer(ctx=ctx, **MODEL)
    if rank == fail_rank:
        model = FailingModel(model, at, where, ctx.tp_group if hold_group else None)
    groups = [
        ContinuousBatcher(part, fmap, eos=EOS, max_running=2) for part in split_round_robin(workload(), pp)
    ]
    runtime = ParallelRuntime(model, fmap, ctx, delay=random_delay(rank, p=0.3, max_s=1e-3))
    out = _outcome(lambda: runtime.run(groups), fmap)
    ctx.close()
    return out


class Shuffled(ContinuousBatcher):
    """Test-side divergence: from its ``at``-th batch on, the request order is reversed."""

    def __init__(self, *args: Any, at: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.at, self.n = at, 0

    def schedule(self) -> Batch | None:
        self.n += 1
        if self.n == self.at:
            self.running.reverse()
        return super().schedule()


def divergence(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """Rank 1's scheduler reorders its requests at its 4th batch; debug mode must catch it."""
    ctx = join(rank, world, port, tp, pp)
    fmap = FutureMap(64, device="cpu", debug=True)
    kind = Shuffled if rank == 1 else ContinuousBatcher
    groups = [
        kind(part, fmap, eos=EOS, max_running=3, **({"at": 4} if rank == 1 else {}))
        for part in split_round_robin(workload(), pp)
    ]
    runtime = ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx)
    out = _outcome(lambda: runtime.run(groups), fmap)
    ctx.close()
    return out


def token_divergence(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """Rank 1 stores other tokens from its 4th broadcast on (a patched ``ParallelStep._broadcast``,
    as a bad sampler or broadcast would): the debug digest of the stored tokens must catch it."""
    ctx = join(rank, world, port, tp, pp)
    fmap = FutureMap(64, device="cpu", debug=True)
    runtime = ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx)
    if rank == 1:
        original, calls = runtime.kind._broadcast, [0]

        def skewed(state: Any) -> None:
            original(state)
            calls[0] += 1
            if calls[0] >= 4:
                state.sampled = (state.sampled + 1) % VOCAB

        runtime.kind._broadcast = skewed  # type: ignore[method-assign]
    groups = [
        ContinuousBatcher(part, fmap, eos=EOS, max_running=2) for part in split_round_robin(workload(), pp)
    ]
    out = _outcome(lambda: runtime.run(groups), fmap)
    ctx.close()
    return out


def capacity_mismatch(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """Rank 1's map has half the capacity: every rank must refuse to run."""
    ctx = join(rank, world, port, tp, pp)
    fmap = FutureMap(64 if rank == 0 else 32, device="cpu")
    groups = [
        ContinuousBatcher(part, fmap, eos=EOS, max_running=2) for part in split_round_robin(workload(), pp)
    ]
    runtime = ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx)
    out = _outcome(lambda: runtime.run(groups), fmap)
    ctx.close()
    return out


def layout_mismatch(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 0 asks for tp=2, rank 1 for pp=2: both must raise before any group exists."""
    tp, pp = (2, 1) if rank == 0 else (1, 2)
    try:
        join(rank, world, port, tp, pp).close()
        return {"type": None, "message": ""}
    except ValueError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "initialized_after": dist.is_initialized()}


def world_mismatch(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 1 believes in 3 ranks (tp=3): both must raise a ValueError, bounded by the 3 s timeout."""
    claimed = world if rank == 0 else world + 1
    t0 = time.monotonic()
    try:
        init_parallel(
            claimed, 1, rank=rank, world_size=claimed, master_port=port, backend="gloo", timeout_s=3.0
        )
        return {"type": None, "message": ""}
    except ValueError as exc:
        return {"type": "ValueError", "message": str(exc), "seconds": time.monotonic() - t0}


class Decoder:
    """Test-side scheduler that ignores back-pressure: ``n`` requests decode every step."""

    def __init__(self, n: int, steps: int) -> None:
        self.n, self.steps, self.made = n, steps, 0
        self.last: Batch | None = None

    def schedule(self) -> Batch | None:
        if self.made == self.steps:
            return None
        self.made += 1
        ones = np.ones(self.n, dtype=np.int64)
        tokens, consumes = np.arange(1, self.n + 1, dtype=np.int64), []
        if self.last is not None and self.last.out is not None:
            keep = self.last.out.filter(np.ones(self.n, dtype=bool))
            tokens, consumes = keep.host_placeholders(), [keep]
        prefix = np.full(self.n, self.made, dtype=np.int64)
        rids = np.arange(self.n, dtype=np.int64)
        self.last = Batch(tokens, ones, prefix, rids, np.ones(self.n, dtype=bool), consumes=consumes)
        return self.last

    def process(self, result: StepResult) -> None:
        if result.batch is self.last:
            self.last = None

    def build_mask(self, batch: Batch) -> None:
        return None


def exhaustion(rank: int, world: int, port: int, tp: int, pp: int) -> dict[str, Any]:
    """Two groups of 6 decoding requests on a 10-slot map: the runtime runs out of slots."""
    ctx = join(rank, world, port, tp, pp)
    fmap = FutureMap(10, device="cpu")
    runtime = ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx)
    out = _outcome(lambda: runtime.run([Decoder(6, 8), Decoder(6, 8)]), fmap)
    ctx.close()
    return out
