"""Drafts for grammar requests: each verification row of a request with a grammar gets its own
mask row (the matcher walked through the drafts, then rolled back), so no grammar-illegal draft
is ever accepted and the output equals plain grammar-constrained decoding, sync and overlap.

The tempting drafter proposes what the model would say *without* the grammar (the unconstrained
greedy run): exactly the drafts that an unmasked verification row would accept and the grammar
forbids (the batcher raises when its matcher rejects a committed token)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tfuture import FutureMap
from tfuture.examples.hf import build_llama
from tfuture.models import HFCausalLM
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.spec import DraftContext, NGramDrafter, SpecTokenStep
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyGrammar

VOCAB, ROWS, MAX_LEN, K = 96, 4, 96, 3
NO_STOP = 10**9


@pytest.fixture(scope="module")
def model() -> Any:
    return build_llama(vocab=VOCAB, hidden=48, layers=2, seed=0)


def workload(grammar: bool) -> list[RequestSpec]:
    rng = np.random.default_rng(3)
    return [
        RequestSpec(i, i, rng.integers(3, VOCAB, size=4 + 2 * i), 14, grammar=grammar and i != 2)
        for i in range(ROWS)
    ]


class Oracle(NGramDrafter):
    """Drafts the next ``k`` tokens of ``script`` (per request, from its generated count), with
    every third request-step's second draft bumped (a wrong draft, not only illegal ones)."""

    def __init__(self, script: dict[int, list[int]], prompt_lens: dict[int, int]) -> None:
        super().__init__(k=K)
        self.script, self.prompt_lens, self.calls = script, prompt_lens, 0

    def draft(self, ctx: DraftContext) -> torch.Tensor:
        out = torch.zeros(len(ctx.req_ids), self.k, dtype=torch.int64)
        for i, (rid, n) in enumerate(zip(ctx.req_ids.tolist(), ctx.seq_lens.tolist(), strict=True)):
            done = n - self.prompt_lens[rid]
            nxt = self.script[rid][done : done + self.k]
            out[i, : len(nxt)] = torch.tensor(nxt, dtype=torch.int64)
            self.calls += 1
            if self.calls % 3 == 0:
                out[i, 1] = (out[i, 1] + 1) % VOCAB
        return out


def run(model: Any, specs: list[RequestSpec], grammar: ToyGrammar | None, drafter: Any, overlap: bool = True):
    fmap = FutureMap(256, device="cpu")
    hf = HFCausalLM(model, max_requests=ROWS, max_len=MAX_LEN)
    kind: Any = hf
    kw: dict[str, Any] = {"sampler": Sampler()}
    if drafter is not None:
        drafter.bind(ROWS, MAX_LEN, torch.device("cpu"))
        kind, kw = SpecTokenStep(hf, drafter, Sampler()), {}
    sched = ContinuousBatcher(
        specs, fmap, eos=NO_STOP, max_running=ROWS, grammar=grammar, speculative=K if drafter else 0
    )
    OverlapRuntime(kind, fmap, overlap=overlap, trace=False, **kw).run(sched)
    assert fmap.in_use == 0
    return sched


@pytest.fixture(scope="module")
def grammar() -> ToyGrammar:
    return ToyGrammar(VOCAB, seed=5, density=0.2)


@pytest.fixture(scope="module")
def plain(model: Any, grammar: ToyGrammar) -> dict[int, list[int]]:
    return run(model, workload(True), grammar, None).outputs


@pytest.fixture(scope="module")
def free(model: Any) -> dict[int, list[int]]:
    """What the model says without a grammar: the tempting drafts."""
    return run(model, workload(False), None, None).outputs


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_tempting_drafts_are_masked_and_output_equals_plain_grammar_decoding(
    model: Any, grammar: ToyGrammar, plain: dict[int, list[int]], free: dict[int, list[int]], overlap: bool
) -> None:
    specs = workload(True)
    # The unconstrained run breaks the grammar: its drafts are illegal where it differs.
    assert any(not grammar.accepts(free[s.rid]) for s in specs if s.grammar)
    prompt_lens = {s.rid: s.prompt.size for s in specs}
    sched = run(model, specs, grammar, Oracle(free, prompt_lens), overlap)
    assert sched.outputs == plain
    for s in specs:
        if s.grammar:
            assert grammar.accepts(sched.outputs[s.rid])
    assert sched.drafted_tokens > 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_grammar_requests_accept_good_drafts(
    model: Any, grammar: ToyGrammar, plain: dict[int, list[int]], overlap: bool
) -> None:
    """Drafts from the constrained run itself: most are accepted, so grammar requests take
    fewer model steps than tokens, and the output is unchanged."""
    specs = workload(True)
    sched = run(model, specs, grammar, Oracle(plain, {s.rid: s.prompt.size for s in specs}), overlap)
    assert sched.outputs == plain
    assert 0 < sched.accepted_tokens < sched.drafted_tokens
    generated = sum(len(v) for v in plain.values())
    assert sched.accepted_tokens > generated // 3


def test_a_matcher_without_rollback_makes_no_drafts(model: Any, plain: dict[int, list[int]]) -> None:
    """A user's matcher that cannot roll back: its request decodes plainly beside the others."""

    class NoRollback:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
            self.inner.fill_bitmask(bitmask, row)

        def accept(self, token: int) -> bool:
            return bool(self.inner.accept(token))

        def is_terminated(self) -> bool:
            return False

    class Grammar(ToyGrammar):
        def matcher(self) -> Any:
            return NoRollback(super().matcher())

    specs = workload(True)
    sched = run(
        model,
        specs,
        Grammar(VOCAB, seed=5, density=0.2),
        Oracle(plain, {s.rid: s.prompt.size for s in specs}),
    )
    assert sched.outputs == plain
    # Only the request without a grammar drafted (rid 2): k drafts a step after its first.
    assert 0 < sched.drafted_tokens <= K * len(plain[2])
