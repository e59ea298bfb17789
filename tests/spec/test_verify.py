"""Verification rules (``tfuture.spec.verify``) against the exact target distribution, the
prompt-lookup drafter's matches, and the speculative batch's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfuture.core.batch import ForwardBatch, HostMeta
from tfuture.core.params import SamplingParams, pack_params
from tfuture.sampling.draws import device_draws, uniform_draws
from tfuture.sampling.filters import sorted_probs
from tfuture.spec import DraftBatch, DraftContext, NGramDrafter
from tfuture.spec.verify import row_params, verify_greedy_host, verify_rows

V = 6


def test_device_draws_equal_the_host_draws() -> None:
    rng = np.random.default_rng(1)
    seeds = rng.integers(0, 2**63, size=5000, dtype=np.int64)
    pos = rng.integers(0, 2**40, size=5000, dtype=np.int64)
    got = device_draws(torch.from_numpy(seeds), torch.from_numpy(pos)).numpy()
    assert np.array_equal(got, uniform_draws(seeds, pos))


def _target(params: SamplingParams, logits: torch.Tensor) -> np.ndarray:
    """The exact distribution the Sampler draws from: its filters, normalised, in vocab order."""
    rp = row_params(pack_params([params]))
    x = logits[None].double() / rp.floats[0, 0]
    tk = torch.from_numpy(rp.top_k) if rp.use_top_k else None
    tp = torch.from_numpy(rp.floats[1]) if rp.use_top_p else None
    mp = torch.from_numpy(rp.floats[2]) if rp.use_min_p else None
    p, order = sorted_probs(x, tk, tp, mp, torch.arange(V))
    full = torch.zeros(V, dtype=torch.float64).index_put_((order[0],), p[0])
    return (full / full.sum()).numpy()


def _run(params: SamplingParams, logits: torch.Tensor, draft: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` requests (seeds 0..n-1), each verifying one draft ``draft`` against the same two
    rows ``logits``: their committed tokens ``[n, 2]`` and counts."""
    rows = torch.stack([logits, logits.roll(2)]).repeat(n, 1)
    packed = pack_params([params]).repeat(2 * n, axis=0)
    packed[:, -1] = np.repeat(np.arange(n), 2)  # the seed column: one stream per request
    rp = row_params(packed)
    dev = (torch.from_numpy(rp.floats), torch.from_numpy(rp.top_k), torch.from_numpy(rp.seeds))
    drafts = torch.full((2 * n,), draft, dtype=torch.int64)
    is_draft = torch.tensor([True, False]).repeat(n)
    pad = torch.arange(2 * n)
    positions = torch.tensor([10, 11]).repeat(n)
    v = verify_rows(rows.double(), drafts, is_draft, pad, n, 2, rp, dev if rp.sampled else None, positions)
    return v.committed.numpy(), v.n_commit.numpy()


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    keep = p > 0
    assert counts[~keep].sum() == 0, "a filtered-out token was committed"
    exp = p[keep] * counts.sum()
    return float(((counts[keep] - exp) ** 2 / exp).sum())


# Chi-square 99.9% quantiles by degrees of freedom (up to 5 here).
_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=0),
        SamplingParams(temperature=0.7, top_k=4, seed=0),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=0),
    ],
    ids=["plain", "top_k", "top_p_min_p"],
)
@pytest.mark.parametrize("draft", [0, 3])
def test_rejection_sampling_follows_the_target_distribution(params: SamplingParams, draft: int) -> None:
    logits = torch.tensor([1.5, 0.2, -0.4, 1.0, 0.7, -1.2])
    p0, p1 = _target(params, logits), _target(params, logits.roll(2))
    committed, n_commit = _run(params, logits, draft, 20000)
    first = np.bincount(committed[:, 0], minlength=V)
    assert _chi2(first, p0) < _CRIT[int((p0 > 0).sum()) - 1]
    # The acceptance rate of a point-mass draft is the target's probability of it.
    accepted = n_commit == 2
    assert abs(accepted.mean() - p0[draft]) < 4 * np.sqrt(p0[draft] * (1 - p0[draft]) / 20000) + 1e-9
    # After an accepted draft, the bonus token follows the next row's distribution.
    if accepted.sum() > 2000:
        second = np.bincount(committed[accepted, 1], minlength=V)
        assert _chi2(second, p1) < _CRIT[int((p1 > 0).sum()) - 1]
    assert (committed[~accepted, 1] == -1).all()


def test_plain_sampling_control_passes_the_same_test() -> None:
    # The control: the first row's token alone (no draft) is the Sampler's distribution.
    params = SamplingParams(temperature=1.0, seed=0)
    logits = torch.tensor([1.5, 0.2, -0.4, 1.0, 0.7, -1.2])
    n = 20000
    packed = pack_params([params]).repeat(n, axis=0)
    packed[:, -1] = np.arange(n)
    rp = row_params(packed)
    dev = (torch.from_numpy(rp.floats), torch.from_numpy(rp.top_k), torch.from_numpy(rp.seeds))
    v = verify_rows(
        logits.repeat(n, 1).double(),
        torch.zeros(n, dtype=torch.int64),
        torch.zeros(n, dtype=torch.bool),
        torch.arange(n),
        n,
        1,
        rp,
        dev,
        torch.full((n,), 4),
    )
    assert (v.n_commit.numpy() == 1).all()
    assert _chi2(np.bincount(v.committed[:, 0].numpy(), minlength=V), _target(params, logits)) < _CRIT[5]


def test_greedy_rows_accept_while_the_draft_is_the_argmax() -> None:
    logits = torch.tensor([[0.0, 5, 1], [3, 0, 1], [0, 0, 9], [1, 2, 3]])  # argmax 1, 0, 2, 2
    rp = row_params(pack_params([SamplingParams(temperature=0)] * 4))
    drafts = torch.tensor([1, 2, 2, 0])  # row 0 checks 1 (ok), row 1 checks 2 (argmax 0: reject)
    is_draft = torch.tensor([True, True, True, False])
    v = verify_rows(logits, drafts, is_draft, torch.arange(4), 1, 4, rp, None, torch.arange(4))
    assert v.n_commit.tolist() == [2] and v.committed.tolist() == [[1, 0, -1, -1]] and v.last.tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_greedy_host_verification_equals_the_device_rule(dtype: torch.dtype) -> None:
    """verify_greedy_host (the CPU's loop; numpy's argmax, torch's for bfloat16) against
    verify_rows' greedy rule: random drafts that often equal the argmax, requests of 0 to 4
    drafts, rows with no real logit (-inf, NaN), and rows with one NaN among real logits."""
    rng = np.random.default_rng(7)
    rp = row_params(pack_params([SamplingParams(temperature=0)]))
    for trial in range(40):
        nv = rng.integers(0, 5, size=int(rng.integers(1, 7)))
        n, width, rows = nv.size, int(nv.max()) + 1, int((nv + 1).sum())
        logits = torch.from_numpy(rng.normal(size=(rows, 5))).to(dtype)
        bad = rng.random(rows) < 0.1
        logits[torch.from_numpy(bad)] = float("nan") if trial % 2 else float("-inf")
        one_nan = torch.from_numpy(rng.random(rows) < 0.1)
        logits[one_nan, int(rng.integers(0, 5))] = float("nan")
        target = logits.argmax(dim=1).numpy()
        drafts = np.where(rng.random(rows) < 0.7, target, rng.integers(0, 5, rows))
        owner = np.repeat(np.arange(n), nv + 1)
        j = np.arange(rows) - np.repeat(np.cumsum(nv + 1) - nv - 1, nv + 1)
        want = verify_rows(
            logits,
            torch.from_numpy(drafts),
            torch.from_numpy(j < nv[owner]),
            torch.from_numpy(owner * width + j),
            n,
            width,
            rp,
            None,
            torch.arange(rows),
        )
        got = verify_greedy_host(logits, drafts, nv, n, width)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), trial


def test_true_positions_numpy_equals_the_torch_path() -> None:
    """A verifying request's positions and seq_len move from the host's bound to its previous
    step's seq_len field (minus its last token), on the CPU (numpy) as on the device (torch);
    the other requests' rows and the inputs themselves are untouched."""
    from types import SimpleNamespace

    from tfuture.spec.step_rows import true_positions_numpy, true_positions_torch

    seg = np.array([3, 1, 5, 2])  # requests 0 and 2 verify (2 and 4 drafts), 1 and 3 do not
    prefix = np.array([20, 7, 40, 11])
    positions = np.concatenate([p + np.arange(n) for p, n in zip(prefix, seg, strict=True)])
    seq_lens = prefix + seg
    field = torch.arange(100, dtype=torch.int64) * 3  # slot s holds seq_len 3 * s
    starts = np.cumsum(seg) - seg
    spec = np.array([0, 2])
    tok = np.concatenate([starts[q] + np.arange(seg[q]) for q in spec])
    of = np.repeat(np.arange(spec.size), seg[spec])
    inputs = SimpleNamespace(
        spec_slots=torch.tensor([5, 12]),
        spec_prefix=torch.from_numpy(prefix[spec]),
        spec_tok=torch.from_numpy(tok),
        spec_tok_of=torch.from_numpy(of),
        spec_reqs=torch.from_numpy(spec),
    )
    fwd = SimpleNamespace(
        positions=torch.from_numpy(positions.copy()), seq_lens=torch.from_numpy(seq_lens.copy())
    )
    got, want = true_positions_numpy(fwd, inputs, field), true_positions_torch(fwd, inputs, field)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    true_prefix = np.array([3 * 5 - 1, 7, 3 * 12 - 1, 11])
    assert got[1].tolist() == (true_prefix + seg).tolist()
    assert (
        got[0].tolist()
        == np.concatenate([p + np.arange(n) for p, n in zip(true_prefix, seg, strict=True)]).tolist()
    )
    assert fwd.positions.tolist() == positions.tolist() and fwd.seq_lens.tolist() == seq_lens.tolist()


def test_new_lengths_and_store_tokens_numpy_equal_the_torch_path() -> None:
    """Each sampling request's new length (its step's length less the drafts it verified, plus
    what it committed), each fresh slot's copy of it, and the tokens its fresh slots take (its
    last committed token, 0 where none, then its drafts clamped into the vocab), on the CPU
    (numpy) as on the device (torch)."""
    from types import SimpleNamespace

    from tfuture.spec.step_rows import (
        new_lengths_numpy,
        new_lengths_torch,
        out_lengths_numpy,
        out_lengths_torch,
        store_tokens_numpy,
        store_tokens_torch,
    )

    rng = np.random.default_rng(3)
    for trial in range(20):
        n, k = int(rng.integers(1, 6)), int(rng.integers(0, 4))
        n_reqs = n + int(rng.integers(0, 3))  # requests that do not sample too
        sample_idx = np.sort(rng.choice(n_reqs, n, replace=False))
        n_verify = rng.integers(0, 5, n)
        n_commit = torch.from_numpy(rng.integers(1, 6, n))
        seq_lens = torch.from_numpy(rng.integers(10, 90, n_reqs))
        kd = rng.integers(0, k + 1, n)  # drafts each request makes (at most k)
        first = np.cumsum(1 + kd) - 1 - kd
        out_draft = np.concatenate([first[i] + 1 + np.arange(kd[i]) for i in range(n)]).astype(np.int64)
        draft_at = np.concatenate([i * k + np.arange(kd[i]) for i in range(n)]).astype(np.int64)
        inputs = SimpleNamespace(
            sample_idx=torch.from_numpy(sample_idx),
            n_verify=torch.from_numpy(n_verify),
            out_first=torch.from_numpy(first),
            out_draft=torch.from_numpy(out_draft),
            draft_at=torch.from_numpy(draft_at),
            out_req=torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), 1 + kd)),
        )
        want = new_lengths_torch(seq_lens, inputs, n_commit)
        assert torch.equal(new_lengths_numpy(seq_lens, inputs, n_commit), want), trial
        assert want.tolist() == (seq_lens.numpy()[sample_idx] - n_verify + n_commit.numpy()).tolist()
        per_slot = out_lengths_torch(want, inputs)
        assert torch.equal(out_lengths_numpy(want, inputs), per_slot), trial
        assert per_slot.tolist() == np.repeat(want.numpy(), 1 + kd).tolist()
        last = torch.from_numpy(rng.integers(-1, 50, n))
        drafts = torch.from_numpy(rng.integers(-3, 60, (n, k)))  # some out of [0, 49]
        n_out = int((1 + kd).sum())
        want = store_tokens_torch(last, drafts, inputs, n_out, 49)
        assert torch.equal(store_tokens_numpy(last, drafts, inputs, n_out, 49), want), trial
        assert want[torch.from_numpy(first)].tolist() == last.clamp_min(0).tolist()
        assert int(want.min()) >= 0 and int(want.max()) <= 49


def _history(tokens: list[int]) -> tuple[NGramDrafter, DraftContext]:
    d = NGramDrafter(k=3, max_ngram=3, min_ngram=1)
    d.bind(2, 32, torch.device("cpu"))
    t = torch.tensor([tokens])
    ctx = DraftContext(np.array([5]), t, torch.tensor([len(tokens)]), torch.tensor([len(tokens)]), 32)
    return d, ctx


def test_ngram_drafts_continue_the_latest_earlier_match() -> None:
    d, ctx = _history([7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2])  # suffix [1, 2]: latest earlier match at 5
    assert d.draft(ctx).tolist() == [[4, 8, 1]]


def test_ngram_drafts_repeat_a_continuation_shorter_than_k() -> None:
    # Suffix [5, 9] last occurred ending at position 2: only [5, 9] follow it before the end, so
    # the drafts repeat them (the loop goes on); the torch path (a device history) agrees.
    for tokens, want in (
        ([3, 5, 9, 5, 9], [5, 9, 5]),
        ([4, 4], [4, 4, 4]),
        ([6, 1, 2, 1, 2, 1, 2], [1, 2, 1]),
    ):
        d, ctx = _history(tokens)
        assert d.draft(ctx).tolist() == [want], tokens
        d, ctx = _history(tokens)
        assert d._draft_torch(ctx, 32).tolist() == [want], tokens


def test_ngram_prefers_the_longest_match_and_proposes_the_last_token_without_one() -> None:
    d, ctx = _history([5, 6, 7, 1, 6, 7, 2, 5, 6, 7])  # [5,6,7] matches at 0 (longer than [6,7] at 4)
    assert d.draft(ctx).tolist() == [[1, 6, 7]]
    d, ctx = _history([1, 2, 3, 4])
    assert d.draft(ctx).tolist() == [[4, 4, 4]]


def test_draft_batch_checks() -> None:
    ok = dict(
        tokens=np.array([-1, -2, -3]),
        seg_lens=np.array([3]),
        prefix_lens=np.array([4]),
        req_ids=np.array([0]),
    )
    with pytest.raises(ValueError, match="does not sample"):
        DraftBatch(**ok, sample=np.array([False]), n_verify=np.array([2]))
    with pytest.raises(ValueError, match="segment must be 1 \\+ 1 tokens"):
        DraftBatch(**ok, sample=np.array([True]), n_verify=np.array([1]))
    with pytest.raises(ValueError, match="must be a placeholder"):
        DraftBatch(**{**ok, "tokens": np.array([4, -2, -3])}, sample=np.array([True]), n_verify=np.array([2]))
    with pytest.raises(TypeError, match="n_draft must be a 1-D integer"):
        DraftBatch(**ok, sample=np.array([True]), n_draft=[1])


def test_a_verification_row_counts_the_drafts_before_it() -> None:
    from tfuture.core.params import pack_params as pack
    from tfuture.sampling.history import TokenHistory, apply_penalties
    from tfuture.spec.penalties import penalise_rows, plan_penalties

    hist = TokenHistory(2)
    hist.ensure(V, torch.device("cpu"))
    assert hist.counts is not None and hist.seen is not None
    hist.counts[1, 4], hist.seen[1, 4] = 2, True  # request's history: token 4 twice
    params = SamplingParams(
        temperature=0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5
    )
    packed = pack([params]).repeat(3, axis=0)
    # One request, rows 0..2 verify drafts d1 = 3 and d2 = 4 (token rows 1 and 2 of the step).
    plan = plan_penalties(packed, np.array([1, 1, 1]), np.array([0, 0, 0]), np.array([0, 1, 2]))
    assert plan is not None and plan.n_pairs == 3
    input_ids = torch.tensor([9 % V, 3, 4])
    logits = torch.linspace(-1, 1, 3 * V).view(3, V)
    got = penalise_rows(logits, hist, plan, torch.from_numpy(plan.words), input_ids)
    for j, before in enumerate([[], [3], [3, 4]]):
        counts = hist.counts[1].clone()
        seen = hist.seen[1].clone()
        for t in before:
            counts[t] += 1
            seen[t] = True
        one = torch.ones(1, dtype=torch.float32)
        want = apply_penalties(logits[j : j + 1], seen[None], counts[None], 1.5 * one, 0.5 * one, 0.25 * one)
        assert torch.equal(got[j], want[0]), j


def test_ngram_cpu_index_equals_the_torch_path() -> None:
    rng = np.random.default_rng(3)
    for trial in range(30):
        n, vocab = 4, int(rng.integers(2, 6))  # small vocabularies: many matches
        tokens = rng.integers(0, vocab, size=(n, 40))
        lens = rng.integers(1, 36, size=n)
        n_commit = rng.integers(1, 4, size=n)
        committed = rng.integers(0, vocab, size=(n, 3))
        drafts = []
        max_ngram = int(rng.integers(1, 4))
        for path in ("index", "torch"):
            d = NGramDrafter(k=3, max_ngram=max_ngram)
            d.bind(n, 48, torch.device("cpu"))
            assert d.history is not None
            d.history[:, :40] = torch.from_numpy(tokens)
            ctx = DraftContext(
                np.arange(n),
                torch.from_numpy(committed),
                torch.from_numpy(n_commit),
                torch.from_numpy(lens + 3),
                44,
            )
            drafts.append(d.draft(ctx) if path == "index" else d._draft_torch(ctx, 44))
        assert torch.equal(drafts[0], drafts[1]), trial


def test_ngram_observe_numpy_equals_the_torch_path() -> None:
    """The CPU history's observe (numpy) writes what the device path writes: each request's
    inputs at their positions, positions past the history clamped to its last column."""
    rng = np.random.default_rng(11)
    seg = np.array([3, 1, 4, 1])
    # The last request's one token is past the 32 columns (clamped to the last; one write there:
    # torch keeps no order among duplicate indices).
    prefix = np.array([0, 5, 20, 40])
    positions = torch.from_numpy(np.concatenate([p + np.arange(s) for p, s in zip(prefix, seg, strict=True)]))
    ids = torch.from_numpy(rng.integers(0, 50, int(seg.sum())))
    host = HostMeta(seg, prefix, np.array([4, 9, 2, 7]), np.arange(4), int(seg.sum()), int(seg.max()))
    fwd = ForwardBatch(0, ids, positions, positions, positions, positions, positions, positions, None, host)
    histories = []
    for path in ("numpy", "torch"):
        d = NGramDrafter(k=2)
        d.bind(4, 32, torch.device("cpu"))
        d.observe(fwd) if path == "numpy" else d._observe_torch(fwd, host.n_tokens)
        assert d.history is not None
        histories.append(d.history)
    assert histories[0].any() and torch.equal(histories[0], histories[1])
    assert histories[0][3, 31] == ids[-1]


def test_ngram_cpu_history_holds_only_what_the_index_reads() -> None:
    """On the CPU, observe skips a step whose requests have all drafted before (the index keeps
    their committed tokens): the history keeps the prompts only. The drafts, a replayed draft's
    too (the same positions again), equal the torch path's over a full history."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 4, 9), rng.integers(0, 4, 6)]
    k, width = 3, 48
    cpu, dev = NGramDrafter(k=k), NGramDrafter(k=k)
    for d in (cpu, dev):
        d.bind(2, width, torch.device("cpu"))
    req_ids = np.array([3, 8])

    def fwd_of(segments: list[np.ndarray], starts: list[int]) -> ForwardBatch:
        seg = np.array([len(t) for t in segments])
        pos = torch.from_numpy(np.concatenate([p + np.arange(n) for p, n in zip(starts, seg, strict=True)]))
        ids = torch.from_numpy(np.concatenate(segments))
        host = HostMeta(seg, np.array(starts), req_ids, np.arange(2), int(seg.sum()), int(seg.max()))
        return ForwardBatch(0, ids, pos, pos, pos, pos, pos, pos, None, host)

    def both(
        fwd: ForwardBatch, committed: np.ndarray, n_commit: np.ndarray, lens: np.ndarray
    ) -> torch.Tensor:
        cpu.observe(fwd)
        dev._observe_torch(fwd, fwd.host.n_tokens)
        ctx = DraftContext(
            req_ids, torch.from_numpy(committed), torch.from_numpy(n_commit), torch.from_numpy(lens), width
        )
        got, want = cpu.draft(ctx), dev._draft_torch(ctx, width)
        assert torch.equal(got, want)
        assert torch.equal(cpu.draft(ctx), want)  # replayed
        return got

    lens = np.array([len(p) for p in prompts]) + 1
    last = rng.integers(0, 4, 2)
    drafts = both(fwd_of(prompts, [0, 0]), last[:, None].copy(), np.ones(2, dtype=np.int64), lens)
    assert cpu.history is not None
    prompt_rows = cpu.history.clone()
    for _ in range(6):  # decode steps: the last token, then the k drafts
        segs = [np.concatenate([[last[i]], drafts[i].numpy()]) for i in range(2)]
        n_commit = rng.integers(1, k + 2, 2)
        committed = np.full((2, k + 1), -1)
        for i in range(2):
            committed[i, : n_commit[i]] = np.concatenate([segs[i][1 : n_commit[i]], rng.integers(0, 4, 1)])
        starts = [int(x) - 1 for x in lens]
        lens = lens + n_commit
        drafts = both(fwd_of(segs, starts), committed, n_commit, lens)
        last = committed[np.arange(2), n_commit - 1]
        assert torch.equal(cpu.history, prompt_rows)  # nothing written past the first step


def test_ngram_cpu_index_follows_growing_requests_step_after_step() -> None:
    """The incremental index against the torch path's full scan at every step of a run: prompts
    and each step's inputs written as observe writes them (the verified drafts past each
    request's length), requests that end and new ones (new ids) on their rows, replayed ops."""
    rng = np.random.default_rng(5)
    for trial in range(6):
        n, k, vocab, width = 3, 3, int(rng.integers(2, 5)), 96
        max_ngram, min_ngram = int(rng.integers(1, 4)), 1
        paths = [NGramDrafter(k=k, max_ngram=max_ngram, min_ngram=min_ngram) for _ in range(2)]
        for d in paths:
            d.bind(n, width, torch.device("cpu"))
        ids = np.arange(n)
        lens = np.zeros(n, dtype=np.int64)
        next_id = n
        last = np.zeros(n, dtype=np.int64)
        for step in range(30):
            fresh = set()
            for i in range(n):
                if lens[i] == 0 or lens[i] > width - k - 3:  # a new request on this row: its prompt
                    fresh.add(i)
                    if lens[i]:
                        for d in paths:
                            d.release(ids[i : i + 1])
                        ids[i], next_id = next_id, next_id + 1
                    lens[i] = int(rng.integers(1, 20))
                    prompt = torch.from_numpy(rng.integers(0, vocab, lens[i]))
                    for d in paths:
                        assert d.history is not None
                        d.history[d._host_rows(ids[i : i + 1])[0], : lens[i]] = prompt
            nc = rng.integers(1, k + 2, size=n)
            committed = np.full((n, k + 1), -1)
            for i in range(n):
                committed[i, : nc[i]] = rng.integers(0, vocab, nc[i])
                # What observe wrote: the last committed token at its position, then the k
                # verified drafts (the accepted ones are the committed tokens before the last).
                drafts = np.concatenate([committed[i, : nc[i] - 1], rng.integers(0, vocab, k + 1 - nc[i])])
                for d in paths:
                    assert d.history is not None
                    row = d._host_rows(ids[i : i + 1])[0]
                    if step and i not in fresh:
                        d.history[row, lens[i] - 1] = int(last[i])
                    d.history[row, lens[i] : lens[i] + k] = torch.from_numpy(drafts)
            last = committed[np.arange(n), nc - 1]
            lens += nc
            ctx = DraftContext(
                ids.copy(),
                torch.from_numpy(committed),
                torch.from_numpy(nc),
                torch.from_numpy(lens.copy()),
                width,
            )
            got, want = paths[0].draft(ctx), paths[1]._draft_torch(ctx, width)
            assert torch.equal(got, want), (trial, step)
            if step % 7 == 3:  # a replayed draft op rebuilds from the history: the same drafts
                assert torch.equal(paths[0].draft(ctx), want), (trial, step)
