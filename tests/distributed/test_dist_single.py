"""tfuture.distributed in this process: world size 1 through the same code path, the model split,
the micro-batch scheduler, and the errors bad input gets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tfuture import FutureMap
from tfuture.core.batch import Batch, ForwardBatch, HostMeta
from tfuture.distributed import (
    MicroBatch,
    MicroBatchScheduler,
    ParallelContext,
    ParallelRuntime,
    ParallelSpecStep,
    ParallelStep,
    init_parallel,
)
from tfuture.distributed.checks import batch_digest, tokens_digest
from tfuture.distributed.failure import FailureWatcher, RankFailure, fail_run, finish_run, is_comm_error
from tfuture.runtime import OverlapRuntime
from tfuture.spec import NGramDrafter
from tfuture.steps.token import Buckets
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyGrammar, random_workload
from tfuture.testing.faults import FaultPlan, InjectedFault, random_delay
from tfuture.testing.tp import ParallelTransformer, split_round_robin

MODEL: dict[str, Any] = dict(vocab=32, d_model=16, n_heads=2, n_layers=2, max_requests=8, max_len=32)


@pytest.fixture(scope="module")
def ctx() -> Iterator[ParallelContext]:
    with init_parallel(1, 1, backend="gloo", timeout_s=20) as c:
        yield c


def _specs(grammar: float = 0.0) -> list[Any]:
    return random_workload(3, 8, vocab=32, max_prompt=9, max_new=7, arrival_span=4, grammar_share=grammar)


def _single(specs: list[Any], grammar: ToyGrammar | None = None, **kw: Any) -> dict[int, list[int]]:
    fmap = FutureMap(32, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=5, max_running=3, grammar=grammar, **kw)
    OverlapRuntime(ParallelTransformer(**MODEL), fmap).run(sched)
    return sched.outputs


@pytest.mark.parametrize(("overlap", "debug"), [(False, False), (True, False), (True, True)])
def test_world_1_equals_the_plain_runtime(ctx: ParallelContext, overlap: bool, debug: bool) -> None:
    specs = _specs()
    fmap = FutureMap(32, device="cpu", debug=debug)
    sched = ContinuousBatcher(specs, fmap, eos=5, max_running=3)
    delay = random_delay(1, p=0.3, max_s=1e-3) if overlap else None
    runtime = ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx, overlap=overlap, delay=delay)
    stats = runtime.run(sched)
    assert sched.outputs == _single(specs)
    assert fmap.in_use == 0 and stats.steps > 0 and not ctx.closed


@pytest.mark.parametrize(("mask", "delay"), [("bitmask", "rows"), ("bool", "batch")])
def test_world_1_delayed_sampling_with_a_grammar(ctx: ParallelContext, mask: str, delay: str) -> None:
    """Grammar requests sample after their masks (packed bitmask rows of the waiting requests, or
    bool masks of the whole step), as on the plain runtime."""
    specs, grammar = _specs(grammar=0.5), ToyGrammar(32, seed=1)
    fmap = FutureMap(32, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=5, max_running=3, grammar=grammar, mask=mask, delay=delay)
    ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx).run(sched)
    assert sched.outputs == _single(specs, grammar, mask=mask, delay=delay)
    assert fmap.in_use == 0
    for s in specs:
        if s.grammar:
            assert grammar.accepts(sched.outputs[s.rid])


def test_context_layout(ctx: ParallelContext) -> None:
    assert (ctx.rank, ctx.world, ctx.tp_rank, ctx.pp_rank) == (0, 1, 0, 0)
    assert ctx.is_first_stage and ctx.is_last_stage and ctx.backend == "gloo"
    assert ctx.rank_of(0, 0) == 0
    with pytest.raises(ValueError, match="no rank at stage 1"):
        ctx.rank_of(1, 0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tp": 2}, "tp x pp must equal the world size: tp=2 x pp=1 = 2, world size 1"),
        ({"tp": 1, "pp": 2, "world_size": 3, "rank": 0}, "tp x pp must equal the world size"),
        ({"tp": 0}, "tp and pp must be >= 1"),
        ({"world_size": 2, "rank": 2}, r"rank must lie in \[0, world_size=2\)"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"backend": "mpi"}, "backend must be 'nccl' or 'gloo'"),
    ],
)
def test_bad_layouts_raise_before_any_group(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        init_parallel(**kw)


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 1e20, -1.0])
def test_a_timeout_that_no_process_group_takes_raises_naming_it(timeout_s: float) -> None:
    # inf and 1e20 used to raise an OverflowError from datetime.timedelta, naming nothing.
    with pytest.raises(ValueError, match=r"timeout_s must be > 0 and at most 1000000000 seconds"):
        init_parallel(timeout_s=timeout_s)
    for bad in ("60", True, None):
        with pytest.raises(TypeError, match="timeout_s must be a number of seconds, got"):
            init_parallel(timeout_s=bad)  # type: ignore[arg-type]


def test_runtime_argument_errors(ctx: ParallelContext) -> None:
    model, fmap = ParallelTransformer(ctx=ctx, **MODEL), FutureMap(16, device="cpu")
    with pytest.raises(TypeError, match="ctx must be a ParallelContext, got dict"):
        ParallelRuntime(model, fmap, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fmap must be a FutureMap, got int"):
        ParallelRuntime(model, 3, ctx)  # type: ignore[arg-type]
    runtime = ParallelRuntime(model, fmap, ctx)
    with pytest.raises(ValueError, match="at least one scheduler"):
        runtime.run([])
    with pytest.raises(TypeError, match="scheduler 0 \\(object\\) lacks schedule, process, build_mask"):
        runtime.run(object())
    with pytest.raises(TypeError, match="launches MicroBatch objects, got Batch"):
        runtime.kind.plan(Batch(*(np.zeros(0, dtype=np.int64),) * 4, np.zeros(0, dtype=bool)))
    assert not ctx.closed and fmap.in_use == 0


def test_pipeline_stage_model_needs_its_hidden_shape() -> None:
    two_stages = SimpleNamespace(tp=1, pp=2, tp_rank=0, pp_rank=0)
    with pytest.raises(TypeError, match="needs a hidden_size attribute"):
        ParallelStep(object(), ParallelContext(1, 2, 0, 2, "gloo", torch.device("cpu"), 1.0, None))  # type: ignore[arg-type]
    assert ParallelTransformer(ctx=two_stages, **MODEL).hidden_size == 16


def _batch(rid: int) -> Batch:
    one = np.ones(1, dtype=np.int64)
    return Batch(one, one, np.zeros(1, dtype=np.int64), np.array([rid]), np.ones(1, dtype=bool))


class _Pipe:
    def __init__(self) -> None:
        self.busy: set[int] = set()

    def undelivered_groups(self) -> set[int]:
        return self.busy

    def real_undelivered(self) -> bool:
        return bool(self.busy)


class _Group:
    def __init__(self, rid: int, n: int) -> None:
        self.rid, self.left, self.polls = rid, n, 0

    def schedule(self) -> Batch | None:
        self.polls += 1
        if not self.left:
            return None
        self.left -= 1
        return _batch(self.rid)

    def process(self, result: Any) -> None: ...

    def build_mask(self, batch: Batch) -> None: ...


def test_micro_batch_scheduler_round_robin_bubbles_and_end() -> None:
    pipe, groups = _Pipe(), [_Group(0, 2), _Group(1, 1)]
    sched = MicroBatchScheduler(groups, pipe)
    first = sched.schedule()
    assert first is not None and first.group == 0 and first.consumes is first.micro.consumes  # type: ignore[union-attr]
    pipe.busy = {0}  # group 0's micro-batch is in the pipe: group 1 goes next
    nxt = sched.schedule()
    assert nxt is not None and nxt.group == 1
    pipe.busy = {0, 1}  # nobody may schedule: a bubble pushes the pipe on
    bubble = sched.schedule()
    assert bubble is not None and bubble.micro is None and sched.bubbles == 1
    pipe.busy = {1}
    again = sched.schedule()
    assert again is not None and again.group == 0
    pipe.busy = set()
    assert sched.schedule() is None  # every group is done and the pipe is empty
    assert groups[1].polls == 2


def test_micro_batch_scheduler_stops_asking_after_max_micro() -> None:
    pipe, groups = _Pipe(), [_Group(0, 5)]
    sched = MicroBatchScheduler(groups, pipe, max_micro=2)
    assert sched.schedule() is not None and sched.schedule() is not None
    pipe.busy = {0}
    third = sched.schedule()
    assert third is not None and third.micro is None  # only a bubble: the pipe still delivers
    pipe.busy = set()
    assert sched.schedule() is None and groups[0].polls == 2 and sched.micro_batches == 2


def test_micro_batch_scheduler_rejects_a_non_batch() -> None:
    class Bad(_Group):
        def schedule(self) -> Any:
            return "batch"

    with pytest.raises(TypeError, match="group 0's schedule\\(\\) must return a Batch or None, got str"):
        MicroBatchScheduler([Bad(0, 1)], _Pipe()).schedule()


def test_pipeline_split_computes_the_whole_model() -> None:
    """Two stages (a stand-in context, no process group) equal the one-rank model, chunked prefill
    then decode, and the KV caches carry the state between calls."""
    whole = ParallelTransformer(**MODEL)
    stages = [
        ParallelTransformer(ctx=SimpleNamespace(tp=1, pp=2, tp_rank=0, pp_rank=s), **MODEL) for s in (0, 1)
    ]
    for ids, pos, lens in (([3, 4, 5, 9, 8], [0, 1, 2, 0, 1], [3, 2]), ([7, 6], [3, 2], [1, 1])):
        n = len(ids)
        last = torch.tensor(np.cumsum(lens) - 1)
        host = HostMeta(
            np.array(lens), np.zeros(2, dtype=np.int64), np.array([0, 1]), np.arange(2), n, max(lens)
        )
        fb = ForwardBatch(0, torch.tensor(ids), torch.tensor(pos), last, torch.tensor([0, 1]),
                          torch.tensor(pos)[last] + 1, torch.arange(2), last, None, host)  # fmt: skip
        want = whole.forward(fb)
        hidden = stages[0].forward(fb)
        assert hidden.shape == (n, 16) and hidden.dtype == torch.float64
        torch.testing.assert_close(stages[1].forward(fb, hidden), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n_heads": 3}, "n_heads must be a multiple of 2, got 3"),
        ({"d_model": 18}, "d_model must be a multiple of 4, got 18"),
        ({"vocab": 33}, "vocab must be a multiple of 2"),
        ({"n_layers": 1}, "n_layers must be >= the number of stages \\(2\\)"),
    ],
)
def test_parallel_transformer_bad_shapes(kw: dict[str, Any], match: str) -> None:
    ctx = SimpleNamespace(tp=2, pp=2, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match=match):
        ParallelTransformer(ctx=ctx, **(MODEL | {"n_heads": 4} | kw))


def test_digests_and_split() -> None:
    a, b = tokens_digest(torch.tensor([1, 2, 3])), tokens_digest(torch.tensor([2, 1, 3]))
    assert a.shape == (1,) and a.dtype == torch.int64 and int(a) != int(b)
    assert int(tokens_digest(torch.tensor([1, 2, 3]))) == int(a)
    d1, _ = batch_digest(3, _batch(1), np.array([4]), 1)
    d2, summary = batch_digest(3, _batch(2), np.array([4]), 1)
    assert d1 != d2 and "requests [2]" in summary
    assert split_round_robin(list(range(5)), 2) == [[0, 2, 4], [1, 3]]
    with pytest.raises(ValueError, match="n must be >= 1"):
        split_round_robin([1], 0)


def test_plan_rejects_a_relaunched_batch(ctx: ParallelContext) -> None:
    kind = ParallelStep(ParallelTransformer(ctx=ctx, **MODEL), ctx)
    kind.bind(FutureMap(8, device="cpu"))
    b = _batch(0)
    b.step = 4
    with pytest.raises(
        ValueError, match="group 2's schedule\\(\\) returned a batch that was already launched"
    ):
        kind.plan(MicroBatch(b, 2))


def test_closed_context_refuses_to_run() -> None:
    c = ParallelContext(1, 1, 0, 1, "gloo", torch.device("cpu"), 1.0, None, _own_pg=False)
    runtime = ParallelRuntime(ParallelTransformer(ctx=c, **MODEL), FutureMap(16, device="cpu"), c)
    c.close()
    c.close()  # idempotent
    assert c.closed and c.tp_group is None
    with pytest.raises(RuntimeError, match="is closed"):
        runtime.run(ContinuousBatcher(_specs(), runtime.fmap))


def test_already_initialized_is_refused(ctx: ParallelContext) -> None:
    with pytest.raises(RuntimeError, match="already initialized"):
        init_parallel(1, 1)


class _FakeGroup:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def _fake_ctx(rank: int, store: Any) -> Any:
    ctx = ParallelContext(1, 2, rank, 2, "nccl", torch.device("cpu"), 2.0, store, _own_pg=False)
    ctx.tp_group, ctx.token_group = _FakeGroup(), _FakeGroup()
    return ctx


def test_fail_run_first_rank_reraises_and_peers_get_rank_failure() -> None:
    store = dist.HashStore()
    first, second = _fake_ctx(0, store), _fake_ctx(1, store)
    store.set("k/status/1", "error: later")  # rank 1 reported and read: rank 0's waits end at once
    store.set("k/read/1", "1")
    err = RuntimeError("boom in forward")
    got = fail_run(first, "k", err)
    assert got is err and first.closed and "first failure: rank 0 (stage 0, tp rank 0)" in err.__notes__[-1]
    peer_err = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    got2 = fail_run(second, "k", peer_err)
    assert isinstance(got2, RankFailure) and got2.origin_rank == 0 and got2.__cause__ is peer_err
    assert "rank 1 stopped because another rank failed first: rank 0" in str(got2) and "boom" in str(got2)
    # A rank with an error of its own (not a communication error) keeps it.
    own = ValueError("bad batch")
    third = _fake_ctx(1, store)
    assert fail_run(third, "k", own) is own and "first failure: rank 0" in own.__notes__[-1]


def test_finish_run_raises_when_another_rank_failed() -> None:
    store = dist.HashStore()
    ok = _fake_ctx(0, store)
    store.set("r/first", "rank 1 (stage 1, tp rank 0): RuntimeError: x")
    store.set("r/status/1", "error: rank 1 (stage 1, tp rank 0): RuntimeError: x")
    store.set("r/read/1", "1")
    with pytest.raises(RankFailure, match="rank 0 finished its run, but rank\\(s\\) \\[1\\] did not") as info:
        finish_run(ok, "r")
    assert info.value.origin_rank == 1 and ok.closed
    fine = _fake_ctx(0, dist.HashStore())
    fine.store.set("q/status/1", "ok")
    fine.store.set("q/read/1", "1")
    finish_run(fine, "q")
    assert not fine.closed


def test_is_comm_error() -> None:
    assert is_comm_error(RuntimeError("Connection closed by peer [127.0.0.1]:1"))
    assert is_comm_error(ValueError("x").with_traceback(None)) is False
    wrapped = ValueError("outer")
    wrapped.__cause__ = RuntimeError("NCCL error: unhandled system error")
    assert is_comm_error(wrapped)


def test_failure_watcher_aborts_the_groups_once_a_peer_failed() -> None:
    store = dist.HashStore()
    ctx = _fake_ctx(0, store)
    with FailureWatcher(ctx, "w", poll_s=0.01):
        time.sleep(0.05)
        assert ctx.tp_group.aborted == 0
        store.set("w/first", "rank 1: boom")
        deadline = time.monotonic() + 5
        while ctx.tp_group.aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert ctx.tp_group.aborted == 1 and ctx.token_group.aborted == 1


def test_nccl_needs_a_gpu_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU, two local ranks (the H200 machine under torchrun --nproc-per-node 2): the default
    is gloo on the CPU, and an explicit NCCL is refused before any rendezvous."""
    import tfuture.distributed.context as context

    monkeypatch.setattr(context.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(context.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="needs a GPU per local rank: 2 local rank"):
        init_parallel(2, 1, rank=0, world_size=2, master_port=1, backend="nccl")


def test_a_mask_row_that_allows_only_padding_bits_is_refused_once_the_vocab_is_known(
    ctx: ParallelContext,
) -> None:
    """The token step's own mask checks run on a parallel rank: a packed row that allows only
    token 42 of a vocab of 40 (a padding bit) is refused on the stream, naming the request."""

    class PaddingOnly(ContinuousBatcher):
        def build_mask(self, batch: Batch) -> np.ndarray:
            rows = super().build_mask(batch)
            assert rows is not None
            bad = np.zeros_like(rows)
            bad[:, 1] = 1 << 10  # token 32 + 10 = 42
            return bad

    specs = random_workload(3, 4, vocab=40, max_prompt=5, max_new=4, grammar_share=1.0)
    fmap = FutureMap(32, device="cpu")
    sched = PaddingOnly(specs, fmap, eos=5, max_running=3, grammar=ToyGrammar(40, seed=1), mask="bitmask")
    model = ParallelTransformer(ctx=ctx, **{**MODEL, "vocab": 40})
    with pytest.raises(ValueError, match=r"the mask row of request id \d+ .*allows no token"):
        ParallelRuntime(model, fmap, ctx).run(sched)
    assert fmap.in_use == 0


# --- speculative decoding through the parallel runtime (world 1) ---------------------------


@pytest.fixture
def spec_ctx() -> Iterator[ParallelContext]:
    """A fresh world of 1 (a failed run closes its context)."""
    with init_parallel(1, 1, backend="gloo", timeout_s=20) as c:
        yield c


def _spec_specs() -> list[Any]:
    """Self-quoting prompts, so prompt lookup finds matches."""
    rng = np.random.default_rng(0)
    specs = []
    for i in range(5):
        base = rng.integers(1, 32, size=4 + i)
        specs.append(RequestSpec(i, i, np.concatenate([base, base, base[:2]]), 6 + i))
    return specs


def _spec_runtime(ctx: ParallelContext, fmap: FutureMap, **kw: Any) -> ParallelRuntime:
    drafter = NGramDrafter(k=3)
    drafter.bind(8, 32, torch.device("cpu"))
    return ParallelRuntime(ParallelTransformer(ctx=ctx, **MODEL), fmap, ctx, speculative=drafter, **kw)


@pytest.mark.parametrize("overlap", [False, True])
def test_world_1_speculative_equals_plain_decoding(spec_ctx: ParallelContext, overlap: bool) -> None:
    fmap = FutureMap(64, device="cpu", debug=True)
    sched = ContinuousBatcher(_spec_specs(), fmap, eos=5, max_running=3, speculative=3)
    runtime = _spec_runtime(spec_ctx, fmap, overlap=overlap, delay=random_delay(2, p=0.3, max_s=1e-3))
    assert isinstance(runtime.kind, ParallelSpecStep)
    runtime.run(sched)
    assert sched.outputs == _single(_spec_specs())
    assert fmap.in_use == 0 and sched.drafted_tokens > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_world_1_padded_speculative_steps_equal_plain_decoding(
    spec_ctx: ParallelContext, overlap: bool
) -> None:
    fmap = FutureMap(64, device="cpu", debug=True)
    sched = ContinuousBatcher(_spec_specs(), fmap, eos=5, max_running=3, speculative=3)
    shapes: list[tuple[int, int]] = []
    runtime = _spec_runtime(spec_ctx, fmap, overlap=overlap, buckets=Buckets((16, 32), (2, 4)))
    forward = runtime.model.forward

    def recording(batch: Any, hidden: Any = None) -> Any:
        shapes.append((batch.input_ids.numel(), batch.seg_starts.numel() - 1))
        return forward(batch, hidden)

    runtime.model.forward = recording  # type: ignore[method-assign]
    runtime.run(sched)
    assert sched.outputs == _single(_spec_specs())
    assert fmap.in_use == 0 and sched.drafted_tokens > 0
    assert {r for r, _ in shapes} <= {16, 32} and {q for _, q in shapes} <= {2, 4}


def test_world_1_speculative_a_fault_in_pack_leaks_nothing(spec_ctx: ParallelContext) -> None:
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(_spec_specs(), fmap, eos=5, max_running=3, speculative=3)
    with pytest.raises(InjectedFault):
        _spec_runtime(spec_ctx, fmap, faults=FaultPlan(raise_at={"pack": 3})).run(sched)
    assert fmap.in_use == 0
