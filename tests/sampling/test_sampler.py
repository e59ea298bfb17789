"""Sampler on the device: greedy == argmax, draws independent of the batch, filters, stage
skipping, the bitmask, and its errors."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from sampling_reference import filtered_probs, reference_token, run_step

from tfuture.sampling import Sampler, SamplerPlan, SamplingParams, pack_params

EMPTY = np.empty(0, dtype=np.int64)


def plan_decode(
    sampler: Sampler,
    params: list[SamplingParams] | None,
    positions: list[int] | np.ndarray,
    req_ids: np.ndarray | None = None,
    ended: np.ndarray = EMPTY,
    step: int = 0,
) -> SamplerPlan:
    """A decode step: one token per request, every request samples at ``positions``."""
    n = len(positions)
    rids = np.arange(n, dtype=np.int64) if req_ids is None else req_ids
    table = None if params is None else pack_params(params)
    ones = np.ones(n, dtype=np.int64)
    prefix = np.asarray(positions, dtype=np.int64) - 1
    return sampler.plan(table, rids, ones, prefix, np.arange(n, dtype=np.int64), ended, step)


def sample_once(sampler: Sampler, plan: SamplerPlan, logits: torch.Tensor, **kw: object) -> torch.Tensor:
    state = sampler.prepare(plan, torch.from_numpy(plan.words.copy()))
    return sampler.sample(state, logits, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 50).to(dtype)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # a tie: the lowest index wins
    want = logits.argmax(dim=1)
    assert want[2] == 7
    for params in (None, [SamplingParams()] * 6, [SamplingParams(temperature=0.9, top_k=1, seed=3)] * 6):
        s = Sampler()
        plan = plan_decode(s, params, [4] * 6)
        assert not plan.sampled and plan.words.size == 0
        assert torch.equal(sample_once(s, plan, logits), want)
    # Greedy rows inside a step that samples other rows: still exactly the argmax.
    mixed = [SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams() for i in range(6)]
    s = Sampler()
    plan = plan_decode(s, mixed, [4] * 6)
    assert plan.sampled
    got = sample_once(s, plan, logits)
    assert torch.equal(got[::2], want[::2])


def test_same_seed_and_position_same_token_in_any_batch() -> None:
    g = torch.Generator().manual_seed(5)
    target = torch.randn(1, 200, generator=g, dtype=torch.float64)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=77)
    others = [
        SamplingParams(),
        SamplingParams(temperature=1.5, seed=1),
        SamplingParams(temperature=0.3, min_p=0.2, seed=2),
        SamplingParams(temperature=1.0, top_k=3, seed=3),
    ]
    tokens = set()
    for trial in range(6):
        rng = np.random.default_rng(trial)
        n_other = int(rng.integers(0, 4))
        batch = [others[i] for i in rng.permutation(4)[:n_other]]
        at = int(rng.integers(0, n_other + 1))
        batch.insert(at, p)
        positions = rng.integers(1, 50, size=len(batch))
        positions[at] = 12
        logits = torch.randn(len(batch), 200, generator=g, dtype=torch.float64)
        logits[at] = target[0]
        s = Sampler()
        plan = plan_decode(s, batch, positions)
        tokens.add(int(sample_once(s, plan, logits)[at]))
        # Sampling only some rows (rows=): the same token again.
        rows = torch.tensor([at])
        tokens.add(int(sample_once(s, plan, logits[rows], rows=rows)[0]))
    assert len(tokens) == 1
    assert tokens == {reference_token(target[0].numpy(), p, 12)}
    # Another position draws again: over a few positions the tokens are not all the same.
    s = Sampler()
    seq = {int(sample_once(s, plan_decode(s, [p], [pos]), target)[0]) for pos in range(12, 24)}
    assert len(seq) > 1


def test_same_token_in_float32_for_any_batch() -> None:
    p = SamplingParams(temperature=1.1, top_p=0.8, seed=9)
    row = torch.randn(1, 1000)
    want = None
    for n in (1, 5, 33):
        logits = torch.randn(n, 1000)
        logits[n // 2] = row[0]
        params = [SamplingParams(temperature=0.5 + i / n, seed=i + 100) for i in range(n)]
        params[n // 2] = p
        s = Sampler()
        tok = int(sample_once(s, plan_decode(s, params, [7] * n), logits)[n // 2])
        want = tok if want is None else want
        assert tok == want


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-9, seed=2),
        SamplingParams(temperature=1.0, min_p=1.0, seed=3),
        SamplingParams(temperature=5.0, top_k=20, top_p=1e-6, seed=4),
    ],
)
def test_degenerate_filters_are_greedy(params: SamplingParams) -> None:
    logits = torch.randn(40, 300)
    s = Sampler()
    # Mixed with a truly sampled row so the filter stages really run.
    batch = [params] * 39 + [SamplingParams(temperature=1.0, seed=99)]
    got = sample_once(s, plan_decode(s, batch, list(range(1, 41))), logits)
    assert torch.equal(got[:39], logits[:39].argmax(dim=1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, seed=0),
        SamplingParams(temperature=1.0, top_k=4, seed=0),
        SamplingParams(temperature=1.3, top_p=0.7, seed=0),
        SamplingParams(temperature=1.0, min_p=0.15, seed=0),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, seed=0),
    ],
)
def test_distribution_matches_filtered_softmax(params: SamplingParams) -> None:
    vocab, n = 10, 20000
    base = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0], dtype=torch.float64)
    perm = torch.tensor([3, 7, 0, 9, 1, 5, 2, 8, 4, 6])
    row = base[perm]  # the order of the vocab does not matter
    logits = row.expand(n, vocab).contiguous()
    table = np.tile(params.pack(), (n, 1))
    table[:, 7] = np.arange(n)  # the seed word: one seed per row
    s = Sampler()
    ones, rows = np.ones(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    plan = s.plan(table, rows, ones, 4 * ones, rows, EMPTY, 0)
    tokens = sample_once(s, plan, logits).numpy()
    counts = np.bincount(tokens, minlength=vocab)
    order, probs = filtered_probs(row.numpy(), params)
    expected = np.zeros(vocab)
    expected[order] = probs / probs.sum() * n
    assert (counts[expected == 0] == 0).all(), (counts, expected)
    live = expected > 0
    chi2 = ((counts[live] - expected[live]) ** 2 / expected[live]).sum()
    assert chi2 < 30 + 3 * live.sum(), (chi2, counts, expected)


def test_stages_are_skipped_on_the_host() -> None:
    s = Sampler(history_rows=2)
    plan = plan_decode(s, [SamplingParams(temperature=1.0, seed=1)] * 2, [3, 3])
    assert plan.sampled and not (plan.top_k or plan.top_p or plan.min_p or plan.penalized)
    assert plan.sizes[1:] == (0, 0, 0, 0, 0)
    plan = plan_decode(s, [SamplingParams(temperature=1.0, seed=1), SamplingParams()], [3, 3])
    assert plan.top_k and not (plan.top_p or plan.min_p)  # the greedy row is top_k 1
    plan = plan_decode(s, [SamplingParams(top_p=0.5), SamplingParams(temperature=1.0, top_k=3)], [3, 3])
    assert plan.top_k and not plan.top_p  # a greedy row is top_k 1; its top_p is no stage
    plan = plan_decode(s, [SamplingParams(presence_penalty=0.5)], [3])
    assert plan.penalized and plan.counts and not plan.repetition and not plan.sampled


def test_logits_are_not_modified() -> None:
    s = Sampler(history_rows=4)
    params = [SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.3, frequency_penalty=0.5)] * 3
    logits = torch.randn(3, 64)
    before = logits.clone()
    run_step(s, plan_decode(s, params, [2, 2, 2]), torch.tensor([5, 6, 7]), logits)
    run_step(s, plan_decode(s, params, [3, 3, 3]), torch.tensor([1, 2, 3]), logits)
    assert torch.equal(logits, before)


def test_empty_steps() -> None:
    s = Sampler(history_rows=2)
    plan = s.plan(None, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY, 0)
    assert sample_once(s, plan, torch.zeros(0, 8)).shape == (0,)
    plan = plan_decode(s, [SamplingParams(temperature=1.0, frequency_penalty=1.0)], [3])
    state = s.prepare(plan, torch.from_numpy(plan.words.copy()))
    none = torch.zeros(0, dtype=torch.int64)
    assert s.sample(state, torch.zeros(0, 8), rows=none).shape == (0,)


def test_errors() -> None:
    s = Sampler()
    with pytest.raises(ValueError, match="history_rows=0") as info:
        plan_decode(s, [SamplingParams(), SamplingParams(repetition_penalty=1.2)], [1, 1])
    assert "request 1" in str(info.value) and "repetition_penalty=1.2" in str(info.value)
    with pytest.raises(TypeError, match="history_rows"):
        Sampler(history_rows=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="history_rows"):
        Sampler(history_rows=-1)
    plan = plan_decode(s, [SamplingParams(temperature=1.0)] * 2, [1, 1])
    state = s.prepare(plan, torch.from_numpy(plan.words.copy()))
    with pytest.raises(ValueError, match="n_sample = 2 rows"):
        s.sample(state, torch.zeros(3, 16))
    with pytest.raises(ValueError, match="2-D float tensor"):
        s.sample(state, torch.zeros(2, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"rows must be an int64 \[1\]"):
        s.sample(state, torch.zeros(1, 16), rows=torch.tensor([0], dtype=torch.int32))
    s.sample(state, torch.zeros(2, 16))
    with pytest.raises(ValueError, match=r"vocab 17 but .* made for 16"):
        s.sample(state, torch.zeros(2, 17))
    with pytest.raises(ValueError, match="words must hold"):
        s.prepare(plan, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        s.prepare(plan, torch.from_numpy(plan.words.astype(np.int32)))
    with pytest.raises(ValueError, match="params must be int64 of shape"):
        s.plan(np.zeros((2, 3), np.int64), np.arange(2), np.ones(2, np.int64), np.zeros(2, np.int64),
               np.arange(2), EMPTY, 0)  # fmt: skip
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[2, 1\]"):
        s.sample(state, torch.zeros(2, 16), bitmask=torch.zeros(2, 2, dtype=torch.int32))


def _torch_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    n, vocab = allowed.shape
    padded = torch.zeros(n, -(-vocab // 32) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.reshape(n, -1, 32) << torch.arange(32)).sum(-1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _check_bitmask_path(many: bool) -> None:
    vocab = 70
    logits = torch.randn(4, vocab)
    allowed = torch.rand(4, vocab) < 0.3
    allowed[:, 69] = True
    bitmask = _bitmask(allowed)
    masked = logits.masked_fill(~allowed, float("-inf"))
    for params in ([SamplingParams()] * 4, [SamplingParams(temperature=2.0, seed=i) for i in range(4)]):
        s = Sampler()
        plan = plan_decode(s, params, [9] * 4)
        before = logits.clone()
        got = sample_once(s, plan, logits, bitmask=bitmask)
        assert torch.equal(logits, before)
        assert allowed[torch.arange(4), got].all()
        if not plan.sampled:
            assert torch.equal(got, masked.argmax(dim=1))
        # Two rows only (rows=): their bitmask rows.
        rows = torch.tensor([3, 1])
        part = sample_once(s, plan, logits[rows], rows=rows, bitmask=bitmask[rows])
        assert torch.equal(part, got[rows])
    if not many:
        return
    # Many draws of one row never pick a disallowed token.
    n = 3000
    s = Sampler()
    params = [SamplingParams(temperature=50.0, seed=i) for i in range(n)]
    got = sample_once(
        s, plan_decode(s, params, [1] * n), logits[:1].expand(n, vocab), bitmask=bitmask[:1].expand(n, 3)
    )
    assert allowed[0, got].all() and len(set(got.tolist())) == int(allowed[0].sum())


def test_bitmask_with_the_real_kernel() -> None:
    pytest.importorskip("tfuture.kernels.bitmask")
    _check_bitmask_path(many=False)  # small: the kernel runs in the Triton interpreter on CPU


def test_bitmask_path_with_a_torch_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tfuture.kernels.bitmask")
    fake.apply_token_bitmask_ = _torch_bitmask_  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tfuture.kernels.bitmask", fake)
    _check_bitmask_path(many=True)


@pytest.mark.gpu
def test_no_host_sync_on_cuda() -> None:
    """prepare, observe, sample (every stage, bitmask included) and record never sync."""
    from tfuture.kernels.bitmask import pack_bool_mask

    n, vocab = 8, 1000
    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=i, frequency_penalty=0.5,
                       presence_penalty=0.2, repetition_penalty=1.2) if i % 2 else SamplingParams(
                       repetition_penalty=1.3)
        for i in range(n)
    ]  # fmt: skip
    s = Sampler(history_rows=n)
    plans = [plan_decode(s, params, [3 + i] * n, step=i) for i in range(2)]
    words = [torch.from_numpy(p.words.copy()).cuda() for p in plans]
    logits = torch.randn(n, vocab, device="cuda")
    ids = torch.randint(0, vocab, (n,), device="cuda")
    bitmask = pack_bool_mask(torch.rand(n, vocab, device="cuda") < 0.5)
    rows = torch.arange(n // 2, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for plan, w in zip(plans, words, strict=True):
            state = s.prepare(plan, w)
            s.observe(state, ids)
            tokens = s.sample(state, logits, bitmask=bitmask)
            s.sample(state, logits[rows], rows=rows, bitmask=bitmask[rows])
            s.record(state, tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_a_bitmask_applies_to_logits_with_strided_rows() -> None:
    """A transposed logits tensor (stride(1) != 1) gets the same tokens as a contiguous one."""
    s = Sampler()
    plan = s.plan(
        None,
        np.array([1, 2]),
        np.ones(2, np.int64),
        np.zeros(2, np.int64),
        np.arange(2),
        np.empty(0, np.int64),
        0,
    )
    state = s.prepare(plan, torch.from_numpy(plan.words))
    logits = torch.randn(40, 2).t()
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[:, 0] = 1 << 3  # token 3 only
    assert s.sample(state, logits, bitmask=bitmask).tolist() == [3, 3]
