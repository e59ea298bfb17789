"""Issue 30 item 16: ``Engine.stream`` flushes the text it held back on a request's last update.
A request that ends on a lone lead byte of a multi-byte character (byte-level BPE): the text
deltas of its stream add up to ``RequestOutput.text``, the incomplete character as U+FFFD."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

import torch
from tiny_bpe import tiny_tokenizer

from tfuture import GenerationParams
from tfuture.core.batch import ForwardBatch
from tfuture.engine import Engine

PROMPT = [5, 6, 7]


class Scripted:
    """Writes ``script`` (token ids) whatever the prompt: token ``i`` of it has the only
    nonzero logit at output position ``i``."""

    def __init__(self, script: list[int], vocab: int) -> None:
        self.vocab, self.script = vocab, torch.tensor(script)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        seq = batch.seq_lens.index_select(0, batch.sample_reqs)
        at = (seq - len(PROMPT)).clamp(0, self.script.numel() - 1)
        logits = torch.zeros(at.numel(), self.vocab)
        logits[torch.arange(at.numel()), self.script[at]] = 1.0
        return logits


@pytest.mark.parametrize("overlap", [True, False])
def test_the_stream_flushes_a_lone_lead_byte_on_the_last_update(overlap):
    tok = tiny_tokenizer()
    lead = tok.token_to_id("\u00c3")  # the byte 0xC3: the first of a 2-byte character
    script = [tok.token_to_id("a"), tok.token_to_id("b"), lead]
    params = GenerationParams(max_tokens=len(script), temperature=0)
    model = Scripted(script, tok.get_vocab_size())
    with Engine(model, tokenizer=tok, overlap=overlap, max_running=2) as eng:
        deltas, finished = [], []
        for update in eng.stream([PROMPT], params):
            deltas.append(update.text)
            finished.append(update.finished)
        out = eng.generate([PROMPT], params)[0]
    assert out.token_ids == script and out.finish_reason == "length"
    assert out.text == "ab\ufffd"
    assert finished[-1] and "".join(deltas) == out.text
    assert deltas[-1].endswith("\ufffd")  # the held-back byte came with the last update
