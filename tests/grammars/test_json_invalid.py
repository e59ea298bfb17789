"""Issue 30 item 15: xgrammar's ``maxLength`` string rule lets raw control characters through
(upstream, xgrammar #800), so an output a JSON-schema grammar accepted may not parse. Its
matcher says so (``invalid()``), and the schedulers finish the request with reason
``"invalid"`` and a ``RuntimeWarning`` instead of returning it as valid."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("xgrammar")

from support import worker_threads
from tiny_bpe import tiny_tokenizer

import tfuture
from tfuture import FutureMap
from tfuture.core.batch import ForwardBatch
from tfuture.grammars.xgrammar import XGrammarCompiler
from tfuture.runtime import OverlapRuntime
from tfuture.scheduler import GenerationParams
from tfuture.testing import ContinuousBatcher, RequestSpec

SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 5}},
    "required": ["s"],
    "additionalProperties": False,
}
BAD, GOOD = '{"s": "a\x01b"}', '{"s": "ab"}'
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def compiler():
    return XGrammarCompiler(tiny_tokenizer())


def _ids(text: str) -> list[int]:
    return tiny_tokenizer().encode(text).ids


def _accepts_all(matcher, ids) -> bool:
    return all(matcher.accept(t) for t in ids)


def _skip_unless_upstream_bug(compiler) -> None:
    if not _accepts_all(compiler.json_schema(SCHEMA).matcher(), _ids(BAD)):
        pytest.skip("this xgrammar refuses raw control characters under maxLength (#800 fixed)")


def test_the_matcher_of_a_json_schema_says_why_an_accepted_output_is_not_json(compiler):
    _skip_unless_upstream_bug(compiler)
    grammar, stop = compiler.json_schema(SCHEMA), compiler.stop_token_ids[0]
    bad = grammar.matcher()
    assert _accepts_all(bad, [*_ids(BAD), stop])
    assert bad.is_terminated()
    with pytest.raises(json.JSONDecodeError):
        json.loads(BAD)
    assert "0x01" in bad.invalid() and "xgrammar #800" in bad.invalid()
    good = grammar.matcher()
    assert _accepts_all(good, [*_ids(GOOD), stop]) and good.is_terminated()
    assert good.invalid() is None
    # Not a JSON grammar: nothing to check.
    ebnf = compiler.ebnf('root ::= "a" [\\x00-\\x7f]')
    m = ebnf.matcher()
    assert _accepts_all(m, [*_ids("a\x01"), stop]) and m.invalid() is None


class Scripted:
    """Writes ``text`` (then the tokenizer's end token) whatever the prompt: token ``i`` of the
    script gets the only nonzero logit at output position ``i``. Says its vocab."""

    def __init__(self, text: str, vocab: int, stop: int) -> None:
        self.vocab = vocab
        self.script = torch.tensor([*_ids(text), stop, stop])

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        at = (batch.seq_lens.index_select(0, batch.sample_reqs) - len(PROMPT)).clamp(
            0, self.script.numel() - 1
        )
        logits = torch.zeros(at.numel(), self.vocab)
        logits[torch.arange(at.numel()), self.script[at]] = 1.0
        return logits


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(("text", "reason"), [(BAD, "invalid"), (GOOD, "stop")], ids=["bad", "good"])
def test_the_batcher_finishes_an_invalid_json_output_with_reason_invalid(compiler, text, reason, overlap):
    if reason == "invalid":
        _skip_unless_upstream_bug(compiler)
    stop = compiler.stop_token_ids[0]
    fmap = FutureMap(16, device="cpu")
    specs = [RequestSpec(3, 0, np.array(PROMPT), 32, grammar=True)]
    sched = ContinuousBatcher(specs, fmap, eos=stop, grammar=compiler.json_schema(SCHEMA))
    model = Scripted(text, compiler.vocab, stop)
    if reason == "invalid":
        with pytest.warns(
            RuntimeWarning, match=r"request 3: .*not valid JSON.*0x01.*finish reason 'invalid'"
        ):
            OverlapRuntime(model, fmap, overlap=overlap).run(sched)
    else:
        OverlapRuntime(model, fmap, overlap=overlap).run(sched)
    assert sched.finish_reasons == {3: reason}
    assert sched.outputs[3] == [*_ids(text), stop]
    assert fmap.in_use == 0 and not worker_threads()


def test_the_front_door_returns_an_invalid_json_output_with_reason_invalid(compiler):
    _skip_unless_upstream_bug(compiler)
    tok = tiny_tokenizer()
    stop = compiler.stop_token_ids[0]
    params = GenerationParams(json_schema=SCHEMA, max_tokens=32, temperature=0)
    with pytest.warns(RuntimeWarning, match="finish reason 'invalid'"):
        out = tfuture.generate(Scripted(BAD, compiler.vocab, stop), [PROMPT, PROMPT], params, tokenizer=tok)
    assert [o.finish_reason for o in out] == ["invalid", "invalid"]
    assert out[0].text == BAD
    good = tfuture.generate(Scripted(GOOD, compiler.vocab, stop), PROMPT, params, tokenizer=tok)
    assert good[0].finish_reason in ("stop", "grammar") and json.loads(good[0].text) == {"s": "ab"}
