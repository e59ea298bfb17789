"""xgrammar end to end: a random-weight transformer, the device Sampler (greedy and seeded
sampled requests) and a finite JSON schema, through the ContinuousBatcher in sync and overlap
mode. Every grammar request ends in a document that parses and validates; sync and overlap
agree token for token, also under stream delays and with free requests in the same steps."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("xgrammar")

from support import worker_threads
from tiny_bpe import END_TOKEN, tiny_tokenizer

from tfuture import FutureMap
from tfuture.grammars.xgrammar import XGrammarCompiler
from tfuture.kernels import _common
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams
from tfuture.testing import ContinuousBatcher, RequestSpec, TinyTransformer, first_difference
from tfuture.testing.faults import FaultPlan, InjectedFault

COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": COLORS}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
N_REQ = 6
MAX_LEN = 48


@pytest.fixture(autouse=True)
def numpy_kernels(request, monkeypatch):
    """The kernels' numpy path (as the soak runs): the interpreter costs ~0.15 s a step. One test
    keeps the Triton kernels and checks that they give the same tokens."""
    if request.function is not test_triton_kernels_give_the_numpy_paths_tokens:
        monkeypatch.setattr(_common, "INTERPRET", False)


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    vocab = 32 * -(-tok.get_vocab_size() // 32) + 32  # padded lm_head: ids past the tokenizer's
    compiler = XGrammarCompiler(tok, vocab_size=vocab)
    assert compiler.stop_token_ids == [tok.token_to_id(END_TOKEN)]
    return tok, compiler, compiler.json_schema(SCHEMA)


def workload(tok, *, free: int = 0, free_new: int = 12) -> list[RequestSpec]:
    """``N_REQ`` grammar requests (even rids greedy, odd ones seeded at temperature 1.5; room
    for any document) and ``free`` unconstrained requests of ``free_new`` tokens, arriving over
    a few ticks."""
    prompt = np.array(tok.encode("Answer in JSON: is the lamp lit?").ids, dtype=np.int64)
    specs = []
    for rid in range(N_REQ + free):
        params = None if rid % 2 == 0 else SamplingParams(temperature=1.5, top_p=0.95, seed=100 + rid)
        grammar = rid < N_REQ
        specs.append(
            RequestSpec(rid, rid // 3, prompt[: 4 + rid % 5], 40 if grammar else free_new, grammar, params)
        )
    return specs


class Recording(ContinuousBatcher):
    """Keeps each step's ``Batch.delayed`` restricted to its sampling requests."""

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.waits: list[object] = []

    def schedule(self):  # type: ignore[no-untyped-def]
        batch = super().schedule()
        if batch is not None:
            self.waits.append(batch.delayed[batch.sample].tolist())
        return batch


def run(compiler, grammar, specs, *, overlap: bool, stream_delay=None, faults=None, fmap=None, **kw):
    fmap = fmap or FutureMap(32, device="cpu")
    model = TinyTransformer(
        compiler.vocab, d_model=16, n_layers=1, max_requests=len(specs), max_len=MAX_LEN, seed=1
    )
    sched = Recording(specs, fmap, grammar=grammar, eos=compiler.stop_token_ids, max_running=4, **kw)
    runtime = OverlapRuntime(
        model, fmap, overlap=overlap, delay=stream_delay, faults=faults, sampler=Sampler()
    )
    stats = runtime.run(sched)
    return sched, stats, fmap


def check_documents(tok, outputs: dict[int, list[int]], eos: int) -> list[dict]:
    """Every grammar request ended on the end token with a document valid under SCHEMA."""
    return check_documents_of(tok, outputs, eos, range(N_REQ))


def check_documents_of(tok, outputs: dict[int, list[int]], eos: int, rids: range) -> list[dict]:
    docs = []
    for rid in rids:
        out = outputs[rid]
        assert out[-1] == eos and eos not in out[:-1], (rid, out)
        text = tok.decode(out[:-1])
        doc = json.loads(text)
        assert list(doc) == ["ok", "color"], text
        assert isinstance(doc["ok"], bool) and doc["color"] in COLORS, text
        docs.append(doc)
    return docs


def random_delay(seed: int, scale: float = 1e-3):
    rng = random.Random(seed)
    return lambda op: rng.random() * scale if op in ("prepare", "forward", "sample") else 0.0


def test_json_documents_sync_equals_overlap(setup):
    tok, compiler, grammar = setup
    specs = workload(tok)
    ref, _, s_map = run(compiler, grammar, specs, overlap=False)
    got, stats, o_map = run(compiler, grammar, specs, overlap=True, stream_delay=random_delay(1))
    diff = first_difference(ref.outputs, got.outputs, ("sync", "overlap"))
    assert diff is None, diff
    docs = check_documents(tok, got.outputs, compiler.stop_token_ids[0])
    # Not vacuous: the sampled requests take other paths than the greedy ones somewhere.
    assert len({json.dumps(d) for d in docs}) > 1 or len({len(v) for v in got.outputs.values()}) > 1
    assert s_map.in_use == 0 and o_map.in_use == 0 and not worker_threads()
    assert stats.steps > 0


def test_grammar_and_free_requests_share_steps(setup):
    tok, compiler, grammar = setup
    specs = workload(tok, free=4)
    ref, _, _ = run(compiler, grammar, specs, overlap=False, delay="rows")
    # Steps that mix grammar and free sampling rows, where only the grammar rows wait.
    assert any(any(w) and not all(w) for w in ref.waits)
    for delay in ("rows", "batch"):
        got, _, fmap = run(compiler, grammar, specs, overlap=True, stream_delay=random_delay(2), delay=delay)
        assert got.outputs == ref.outputs, first_difference(ref.outputs, got.outputs, ("sync", delay))
        assert fmap.in_use == 0
        # "batch": a step with a grammar row waits whole.
        assert delay == "rows" or not any(any(w) and not all(w) for w in got.waits)
    check_documents(tok, ref.outputs, compiler.stop_token_ids[0])
    free = [ref.outputs[rid] for rid in range(N_REQ, N_REQ + 4)]
    assert all(len(t) == 12 for t in free), "the free requests run to their limit"


def test_bool_masks_give_the_same_tokens(setup):
    tok, compiler, grammar = setup
    specs = workload(tok)[:3]
    packed, _, _ = run(compiler, grammar, specs, overlap=True)
    as_bool, _, fmap = run(compiler, grammar, specs, overlap=True, mask="bool")
    assert as_bool.outputs == packed.outputs and fmap.in_use == 0


@pytest.fixture(scope="module")
def numpy_reference(setup):
    tok, compiler, grammar = setup
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_common, "INTERPRET", False)
        return run(compiler, grammar, workload(tok)[:2], overlap=False)[0].outputs


def test_triton_kernels_give_the_numpy_paths_tokens(setup, numpy_reference):
    tok, compiler, grammar = setup
    if not _common.INTERPRET:
        pytest.skip("TRITON_INTERPRET is not set: the Triton path runs in the other tests")
    got, _, fmap = run(compiler, grammar, workload(tok)[:2], overlap=True, stream_delay=random_delay(5))
    assert fmap.in_use == 0
    assert got.outputs == numpy_reference, first_difference(numpy_reference, got.outputs, ("numpy", "triton"))
    check_documents_of(tok, got.outputs, compiler.stop_token_ids[0], range(2))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_failing_build_mask_leaves_nothing_allocated(setup, overlap):
    tok, compiler, grammar = setup
    specs = workload(tok)
    fmap = FutureMap(32, device="cpu")
    plan = FaultPlan(seed=3, max_delay_s=5e-4, raise_at={"build_mask": 4})
    with pytest.raises(InjectedFault, match="build_mask of step 4"):
        run(compiler, grammar, specs, overlap=overlap, faults=plan, fmap=fmap)
    assert fmap.in_use == 0 and fmap.free == fmap.capacity and not worker_threads()
    # The map is intact: the workload now runs to completion on it.
    sched, _, _ = run(compiler, grammar, specs, overlap=overlap, fmap=fmap)
    check_documents(tok, sched.outputs, compiler.stop_token_ids[0])
    assert fmap.in_use == 0


def test_requests_with_their_own_schema(setup):
    tok, compiler, grammar = setup
    flag = compiler.json_schema(
        {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"],
         "additionalProperties": False}
    )  # fmt: skip
    specs = workload(tok)[:4]
    specs[1] = dataclasses.replace(specs[1], grammar=flag)
    sched, _, fmap = run(compiler, grammar, specs, overlap=True, stream_delay=random_delay(4))
    doc = json.loads(tok.decode(sched.outputs[1][:-1]))
    assert list(doc) == ["done"] and isinstance(doc["done"], bool)
    assert fmap.in_use == 0
