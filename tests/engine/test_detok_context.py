"""Issue 30 item 16: incremental detokenization keeps context across updates for tokenizers
whose decoder depends on it. A Metaspace (SentencePiece-style) decoder drops the leading space
of the first token only: ``▁Hello`` then ``▁world`` must give "Hello world", not "Helloworld"."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

import torch

from tfuture import GenerationParams
from tfuture.core.batch import ForwardBatch
from tfuture.engine import Engine, IncrementalDecoder

WORDS = ["\u2581Hello", "\u2581world", "\u2581again", "[UNK]"]


def metaspace_tokenizer():
    """A word-level tokenizer with a Metaspace pre-tokenizer and decoder (built locally)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def test_the_decoder_needs_context():
    tok = metaspace_tokenizer()
    assert tok.decode([1]) == "world" and tok.decode([0, 1]) == "Hello world"  # why it matters


@pytest.mark.parametrize("pushes", [[[0], [1], [2]], [[0, 1], [2]], [[0], [1, 2]]])
def test_incremental_decoding_keeps_the_space_between_updates(pushes):
    dec = IncrementalDecoder(metaspace_tokenizer())
    deltas = [dec.push(ids) for ids in pushes] + [dec.flush()]
    assert "".join(deltas) == dec.text == "Hello world again"
    assert deltas[0].startswith("Hello")


class Scripted:
    """Writes tokens 0, 1, 2 whatever the prompt (the only nonzero logit at each position)."""

    vocab = len(WORDS)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        seq = batch.seq_lens.index_select(0, batch.sample_reqs)
        at = (seq - 1).clamp(0, 2)  # a one-token prompt
        logits = torch.zeros(at.numel(), self.vocab)
        logits[torch.arange(at.numel()), at] = 1.0
        return logits


def test_the_engine_stream_gives_hello_world():
    params = GenerationParams(max_tokens=3, temperature=0)
    with Engine(Scripted(), tokenizer=metaspace_tokenizer(), max_running=1) as eng:
        text = "".join(u.text for u in eng.stream([[3]], params))
        out = eng.generate([[3]], params)[0]
    assert out.token_ids == [0, 1, 2]
    assert text == out.text == "Hello world again"
