"""The grammar protocol on the host: ToyGrammar's matcher, packed masks, and what the
ContinuousBatcher puts in a Batch (delayed rows, masks, sampling rows) without a runtime."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tfuture import FutureMap
from tfuture.core.batch import StepResult
from tfuture.grammars import Grammar, Matcher, build_bitmask, check_grammar, full_bitmask, mask_requests
from tfuture.kernels.bitmask import unpack_bitmask
from tfuture.sampling import SamplingParams
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyGrammar

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def specs(grammar: list[bool | Grammar], **kw) -> list[RequestSpec]:
    return [
        RequestSpec(i, 0, np.array([i + 1, 2], dtype=np.int64), 6, g, **kw) for i, g in enumerate(grammar)
    ]


def test_toy_grammar_is_a_grammar_and_its_matcher_follows_the_automaton():
    g = ToyGrammar(VOCAB, seed=3)
    assert isinstance(g, Grammar) and check_grammar("g", g) == VOCAB
    m = g.matcher()
    assert isinstance(m, Matcher) and not m.is_terminated()
    rng = np.random.default_rng(0)
    seq: list[int] = []
    state = 0
    for _ in range(20):
        row = build_bitmask([m], VOCAB)
        allowed = unpack_bitmask(row, VOCAB)[0]
        assert (allowed == g.allowed[state]).all()
        banned = int(np.flatnonzero(~allowed)[0])
        assert not m.accept(banned) and not m.accept(VOCAB) and not m.accept(-1)  # state unchanged
        tok = int(rng.choice(np.flatnonzero(allowed)))
        assert m.accept(tok)
        state = g.advance(state, tok)
        seq.append(tok)
    assert g.accepts(seq)


def test_build_bitmask_rows_and_kinds():
    g = ToyGrammar(VOCAB, seed=1)
    a, b = g.matcher(), g.matcher()
    b.accept(int(np.flatnonzero(g.allowed[0])[0]))
    packed = build_bitmask([a, None, b], VOCAB)
    assert packed.dtype == np.int32 and packed.shape == (3, 3)
    as_bool = build_bitmask([a, None, b], VOCAB, "bool")
    assert as_bool.dtype == np.bool_ and as_bool.shape == (3, VOCAB)
    assert (unpack_bitmask(packed, VOCAB) == as_bool).all()
    assert (
        (as_bool[0] == g.allowed[0]).all() and as_bool[1].all() and (as_bool[2] == g.allowed[b.state]).all()
    )
    assert (full_bitmask(2, VOCAB) == -1).all() and build_bitmask([], VOCAB).shape == (0, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        build_bitmask([a], VOCAB, "dense")


def test_check_grammar_names_what_came():
    with pytest.raises(TypeError, match=r"grammar must be a grammar .* got int"):
        check_grammar("grammar", 3)

    class NoVocab:
        vocab = 0

        def matcher(self):
            return None

    with pytest.raises(ValueError, match=r"grammar.vocab must be an int >= 1, got 0"):
        check_grammar("grammar", NoVocab())


def test_batcher_rejects_bad_options():
    fmap = FutureMap(16, device="cpu")
    with pytest.raises(ValueError, match="mask must be one of"):
        ContinuousBatcher([], fmap, mask="dense")
    with pytest.raises(ValueError, match="delay must be one of"):
        ContinuousBatcher([], fmap, delay="step")
    with pytest.raises(ValueError, match="request 0 asks for a grammar but no grammar was given"):
        ContinuousBatcher(specs([True]), fmap)
    with pytest.raises(ValueError, match="same vocab"):
        ContinuousBatcher(specs([True, ToyGrammar(VOCAB + 1)]), fmap, grammar=ToyGrammar(VOCAB))
    with pytest.raises(TypeError, match="request 0: params must be a SamplingParams or None, got dict"):
        ContinuousBatcher(specs([False], params={"temperature": 1.0}), fmap)


@pytest.mark.parametrize("delay", ["rows", "batch"])
@pytest.mark.parametrize("mask", ["bitmask", "bool"])
def test_delayed_rows_and_their_masks(delay, mask):
    g, own = ToyGrammar(VOCAB, seed=4), ToyGrammar(VOCAB, seed=5)
    fmap = FutureMap(16, device="cpu")
    sched = ContinuousBatcher(specs([False, True, False, own]), fmap, grammar=g, mask=mask, delay=delay)
    batch = sched.schedule()
    assert batch is not None and batch.sample.all()
    if delay == "rows":
        assert batch.delayed.tolist() == [False, True, False, True]
        assert mask_requests(batch).tolist() == [1, 3]
        want = np.stack([g.allowed[0], own.allowed[0]])
    else:
        assert batch.delayed.all() and mask_requests(batch).tolist() == [0, 1, 2, 3]
        free = np.ones(VOCAB, dtype=bool)
        want = np.stack([free, g.allowed[0], free, own.allowed[0]])
    got = sched.build_mask(batch)
    if mask == "bitmask":
        assert got.dtype == np.int32
        got = unpack_bitmask(got, VOCAB)
    assert (got == want).all()


def test_all_grammar_or_no_grammar_steps():
    fmap = FutureMap(16, device="cpu")
    assert ContinuousBatcher(specs([True, True]), fmap, grammar=ToyGrammar(VOCAB)).schedule().delayed.all()
    assert (
        not ContinuousBatcher(specs([False, False]), fmap, grammar=ToyGrammar(VOCAB)).schedule().delayed.any()
    )


def test_a_prefill_chunk_that_does_not_sample_is_not_a_mask_row():
    fmap = FutureMap(16, device="cpu")
    long = RequestSpec(9, 0, np.arange(1, 20, dtype=np.int64), 4, True)
    sched = ContinuousBatcher(
        [*specs([True, False]), long], fmap, grammar=ToyGrammar(VOCAB), chunk=4, delay="rows"
    )
    batch = sched.schedule()
    assert batch.sample.tolist() == [True, True, False]
    assert batch.delayed.tolist() == [True, False, True] and mask_requests(batch).tolist() == [0]
    assert sched.build_mask(batch).shape == (1, 3)


def test_sampling_params_go_out_once_with_the_first_step():
    fmap = FutureMap(16, device="cpu")
    hot = SamplingParams(temperature=0.7, top_k=5, seed=11)
    plain = specs([False, False, False])
    plain[1] = dataclasses.replace(plain[1], params=hot)
    batch = ContinuousBatcher(plain, fmap).schedule()
    # The others sample greedily: nothing to send. (A second admission of a live id raises in
    # the Sampler, so every runtime test with params checks that they go out once.)
    assert batch.params == {plain[1].rid: hot}
    assert ContinuousBatcher(specs([False]), fmap).schedule().params is None


def test_a_token_the_grammar_rejects_is_a_loud_error():
    g = ToyGrammar(VOCAB, seed=6)
    fmap = FutureMap(16, device="cpu")
    sched = ContinuousBatcher(specs([True]), fmap, grammar=g)
    batch = sched.schedule()
    banned = int(np.flatnonzero(~g.allowed[0])[0])
    with pytest.raises(
        RuntimeError, match=rf"request 0: its grammar rejects token {banned} sampled at step 7"
    ):
        sched.process(StepResult(7, batch, np.array([banned], dtype=np.int64)))


class _Ends:
    """A grammar whose matcher terminates after ``n`` accepted tokens (any token allowed)."""

    vocab = VOCAB

    def __init__(self, n: int) -> None:
        self.n = n

    def matcher(self) -> _EndsMatcher:
        return _EndsMatcher(self.n)


class _EndsMatcher:
    def __init__(self, n: int) -> None:
        self.left = n

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def accept(self, token):
        self.left -= 1
        return self.left >= 0

    def is_terminated(self):
        return self.left <= 0


def test_a_terminated_matcher_finishes_its_request_and_its_mask_row_allows_all():
    fmap = FutureMap(16, device="cpu")
    sched = ContinuousBatcher(specs([_Ends(1), False]), fmap, eos=-1)
    batch = sched.schedule()
    sched.process(StepResult(0, batch, np.array([5, 6], dtype=np.int64)))
    assert sched.outputs == {0: [5]} and sched.running[0].finished
    # The extra step of a finished request: its row allows every token, its matcher is not asked.
    assert (sched.build_mask(batch) == -1).all()
