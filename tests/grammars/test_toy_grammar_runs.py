"""The toy grammar through the ContinuousBatcher and the runtime with packed bitmasks: overlap
equals sync token for token under stream delays, every grammar request obeys its automaton,
and the mask options (packed or bool, only grammar rows wait or the whole step) agree."""

from __future__ import annotations

import random

import pytest
from support import worker_threads

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, ToyGrammar, ToyModel, first_difference, random_workload

VOCAB = 80  # 3 bitmask words, the last one half padding


def run(specs, grammar, *, overlap: bool, seed: int = 0, **kw):
    rng = random.Random(seed)
    delay = (lambda op: rng.random() * 1e-3 if op in ("prepare", "sample") else 0.0) if overlap else None
    fmap = FutureMap(32, device="cpu")
    sched = ContinuousBatcher(specs, fmap, grammar=grammar, max_running=4, eos=-1, **kw)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap, delay=delay).run(sched)
    assert fmap.in_use == 0
    return sched.outputs


@pytest.fixture(scope="module")
def case():
    specs = random_workload(7, 8, vocab=VOCAB, max_new=8, max_prompt=10, grammar_share=0.5)
    grammar = ToyGrammar(VOCAB, seed=7, density=0.1)
    assert 0 < sum(s.grammar for s in specs) < len(specs)
    return specs, grammar, run(specs, grammar, overlap=False)


OPTIONS = {
    "bitmask-rows": dict(mask="bitmask", delay="rows"),
    "bitmask-batch": dict(mask="bitmask", delay="batch"),
    "bool-rows": dict(mask="bool", delay="rows"),
}


@pytest.mark.parametrize("kw", OPTIONS.values(), ids=OPTIONS.keys())
def test_overlap_equals_sync_and_the_grammar_holds(case, kw):
    specs, grammar, ref = case
    got = run(specs, grammar, overlap=True, seed=len(kw["mask"]), **kw)
    assert got == ref, first_difference(ref, got, ("sync", "overlap"))
    for s in specs:
        assert len(got[s.rid]) == s.max_new
        if s.grammar:
            assert grammar.accepts(got[s.rid]), s.rid
    assert not worker_threads()


def test_the_mask_changes_grammar_requests_only(case):
    specs, _, ref = case
    free = ToyModel(vocab=VOCAB)
    for s in specs:
        plain = free.reference(s.prompt, s.rid, s.max_new)
        if not s.grammar:
            assert ref[s.rid] == plain, s.rid
    assert any(ref[s.rid] != free.reference(s.prompt, s.rid, s.max_new) for s in specs if s.grammar)


class _Broken(ToyGrammar):
    """A toy grammar whose matchers misbehave once they accepted ``after`` tokens: ``"reject"``
    allows every token but accepts none (a mask that was not applied); ``"empty"`` allows none."""

    def __init__(self, how: str, after: int = 2) -> None:
        super().__init__(VOCAB, seed=9)
        self.how, self.after = how, after

    def matcher(self):
        return _BrokenMatcher(self)


class _BrokenMatcher:
    def __init__(self, g: _Broken) -> None:
        self.g, self.n = g, 0

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0 if self.g.how == "empty" and self.n >= self.g.after else -1

    def accept(self, token):
        self.n += 1
        return not (self.g.how == "reject" and self.n > self.g.after)

    def is_terminated(self):
        return False


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize(
    ("how", "err", "match"),
    [
        ("reject", RuntimeError, r"request \d+: its grammar rejects token \d+ sampled at step \d+"),
        ("empty", ValueError, r"build_mask of step \d+: the mask row of request id \d+ .* allows no token"),
    ],
)
def test_a_broken_grammar_stops_the_run_loudly_and_cleanly(overlap, how, err, match):
    specs = random_workload(8, 4, vocab=VOCAB, max_new=6, max_prompt=4, grammar_share=1.0)
    fmap = FutureMap(32, device="cpu")
    sched = ContinuousBatcher(specs, fmap, grammar=_Broken(how), max_running=4, eos=-1)
    with pytest.raises(err, match=match):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap).run(sched)
    assert fmap.in_use == 0 and not worker_threads()
