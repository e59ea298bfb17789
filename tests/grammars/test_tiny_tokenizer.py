"""The test tokenizer: trained locally, fast, deterministic, byte-level, with an end token."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("tokenizers")

from tiny_bpe import CORPUS, DEFAULT_MERGES, END_TOKEN, tiny_tokenizer

import tfuture.testing.tokenizer as module
from tfuture.testing.tokenizer import train_bpe

# The module alone (no torch import): a fresh process trains in well under a second.
SNIPPET = (
    f"import importlib.util as u, json; s = u.spec_from_file_location('tok', {module.__file__!r}); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); "
    f"t = lambda: m.train_bpe(open({str(CORPUS)!r}, encoding='utf-8').read().splitlines()); "
)


def vocab_digest(tok) -> str:
    items = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def test_vocab_layout_and_round_trip():
    tok = tiny_tokenizer()
    assert tok.get_vocab_size() == 256 + DEFAULT_MERGES + 1
    assert tok.token_to_id(END_TOKEN) == tok.get_vocab_size() - 1
    for text in ['{"ok": true, "color": "green"}', "naïve café ☕ 42\n\ttabs", ""]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        assert tok.token_to_id(END_TOKEN) not in ids
    assert len(tok.encode('{"ok": true, "color": "green"}').ids) < 15  # merges learnt JSON
    assert tiny_tokenizer() is tok  # cached


def test_training_is_deterministic_across_processes_and_quick():
    t0 = time.perf_counter()
    small = tiny_tokenizer(64)
    assert time.perf_counter() - t0 < 2.0
    assert small.get_vocab_size() == 256 + 64 + 1
    code = (
        SNIPPET
        + "import hashlib; v = sorted(t().get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]); "
    )
    code += "print(hashlib.sha256(json.dumps(v).encode()).hexdigest())"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert other.stdout.strip() == vocab_digest(tiny_tokenizer())


@pytest.mark.parametrize("merges", [-1, 1.5, 10_000])
def test_bad_merge_counts_raise(merges):
    with pytest.raises(ValueError, match="merges must be an int in"):
        tiny_tokenizer(merges)


def test_more_merges_than_the_corpus_holds_raise():
    with pytest.raises(ValueError, match="merges of frequency >= 2, asked for 4000"):
        tiny_tokenizer(4000)


def test_the_corpus_is_given_as_lines():
    with pytest.raises(TypeError, match="iterable of strings"):
        train_bpe("one string")
    tok = train_bpe(["the cat sat", "the cat sat", "on the mat"], merges=2)
    assert tok.get_vocab_size() == 256 + 2 + 1 and tok.decode(tok.encode("the mat").ids) == "the mat"
