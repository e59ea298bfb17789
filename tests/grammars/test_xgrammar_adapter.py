"""The xgrammar adapter on the host: tokenizer info, padded vocabularies, stop tokens, errors."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("xgrammar")

import xgrammar as xgr
from tiny_bpe import END_TOKEN, tiny_tokenizer

from tfuture.grammars import Grammar, Matcher, build_bitmask
from tfuture.grammars.xgrammar import XGrammarCompiler, tokenizer_info
from tfuture.kernels.bitmask import unpack_bitmask

FLAG = {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"]}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def allowed(grammar_matcher: Matcher, vocab: int) -> np.ndarray:
    return np.flatnonzero(unpack_bitmask(build_bitmask([grammar_matcher], vocab), vocab)[0])


def test_a_padded_vocab_never_allows_the_padding_ids(tok):
    compiler = XGrammarCompiler(tok, vocab_size=700)
    grammar = compiler.json_schema(FLAG)
    assert isinstance(grammar, Grammar) and grammar.vocab == 700
    m = grammar.matcher()
    assert isinstance(m, Matcher)
    for t in tok.encode('{"done": false}').ids:
        assert allowed(m, 700).max() < tok.get_vocab_size()
        assert m.accept(t)
    eos = tok.token_to_id(END_TOKEN)
    assert allowed(m, 700).tolist() == [eos] and not m.is_terminated()
    assert not m.accept(650)  # a padding id
    assert m.accept(eos) and m.is_terminated()


def test_the_end_token_is_never_text(tok):
    m = XGrammarCompiler(tok).builtin_json().matcher()
    for t in tok.encode('{"a": "').ids:  # inside a JSON string: almost any text goes
        assert m.accept(t)
    ids = allowed(m, tok.get_vocab_size())
    assert ids.size > 200 and tok.token_to_id(END_TOKEN) not in ids


def test_stop_tokens_and_ebnf(tok):
    (newline,) = tok.encode("\n").ids
    compiler = XGrammarCompiler(tok, stop_token_ids=[newline])
    assert compiler.stop_token_ids == [newline]
    m = compiler.ebnf('root ::= "yes" | "no"').matcher()
    assert all(m.accept(t) for t in tok.encode("no").ids) and not m.is_terminated()
    assert not m.accept(tok.token_to_id(END_TOKEN))  # not a stop token here
    assert m.accept(newline) and m.is_terminated()


def test_a_tokenizer_info_passes_through(tok):
    info = tokenizer_info(tok, vocab_size=600)
    assert isinstance(info, xgr.TokenizerInfo) and info.vocab_size == 600
    assert XGrammarCompiler(info).vocab == 600
    with pytest.raises(ValueError, match="vocab_size 640 does not match the TokenizerInfo's 600"):
        tokenizer_info(info, vocab_size=640)


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        (dict(vocab_size=0), ValueError, "vocab_size must be an int >= 1"),
        (dict(vocab_size=1.5), ValueError, "vocab_size must be an int >= 1"),
        (dict(stop_token_ids=[]), ValueError, "stop_token_ids must be a token id >= 0"),
        (dict(stop_token_ids=-1), ValueError, "stop_token_ids must be a token id >= 0"),
    ],
)
def test_bad_compiler_arguments(tok, kw, err, match):
    with pytest.raises(err, match=match):
        XGrammarCompiler(tok, **kw)


def test_bad_grammars_raise_value_errors(tok):
    compiler = XGrammarCompiler(tok)
    with pytest.raises(TypeError, match="schema must be a dict or a JSON string, got list"):
        compiler.json_schema([1])
    with pytest.raises(ValueError, match="could not compile the JSON schema"):
        compiler.json_schema("{not json")
    with pytest.raises(ValueError, match="could not compile the EBNF grammar"):
        compiler.ebnf("root ::= undefined_rule")


def test_something_that_is_no_tokenizer_is_a_type_error():
    with pytest.raises(TypeError, match=r"tokenizer must be a transformers tokenizer, .* got str"):
        XGrammarCompiler("gpt2")


def test_a_tokenizer_that_is_not_byte_level_is_refused():
    from tokenizers import Tokenizer, models

    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="must be byte-level"):
        tokenizer_info(plain, stop_token_ids=2)


def test_without_xgrammar_the_error_says_how_to_install(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[grammar\]'"):
        XGrammarCompiler(tok)


def _hf_tokenizer(tok):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_TOKEN)


@pytest.mark.parametrize("kind", ["tokenizers", "transformers"])
def test_a_vocab_size_below_the_tokenizers_or_a_stop_id_outside_it_is_refused(tok, kind):
    # Both used to be dropped silently: the grammar could never stop, and a row allowed no
    # token several steps later.
    t = tok if kind == "tokenizers" else _hf_tokenizer(tok)
    n = tok.get_vocab_size()
    with pytest.raises(
        ValueError, match=rf"vocab_size=100 is smaller than the tokenizer's vocabulary \({n} ids\)"
    ):
        XGrammarCompiler(t, vocab_size=100)
    with pytest.raises(ValueError, match=rf"stop_token_ids \[5000\] lie outside the vocabulary: .* < {n}"):
        XGrammarCompiler(t, stop_token_ids=[5000])
    with pytest.raises(ValueError, match=r"stop_token_ids \[700\] lie outside .* < 700 \(vocab_size\)"):
        XGrammarCompiler(t, vocab_size=700, stop_token_ids=[1, 700])
    # A stop id in the padding of a wider lm_head is fine (the model may emit it).
    assert XGrammarCompiler(t, vocab_size=700, stop_token_ids=[699]).stop_token_ids == [699]
