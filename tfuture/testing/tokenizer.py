"""A small byte-level BPE tokenizer, trained locally (no download) on a corpus the caller gives.

    from tfuture.testing.tokenizer import END_TOKEN, train_bpe
    tok = train_bpe(["some text", '{"json": true}', ...])     # a tokenizers.Tokenizer
    eos = tok.token_to_id(END_TOKEN)             # the last id: tok.get_vocab_size() - 1

Training is deterministic (a fixed corpus and merge count; the same vocabulary with 1 or 16
threads): every process gets the same ids. Byte-level: the 256 byte tokens come first, so every
string can be encoded; the merges follow; the end token is added last, as a special token (never
produced by encoding text). The tests train it on ``tests/data/corpus.txt`` (English prose and
JSON snippets; ``tests/tiny_bpe.py``). This module imports nothing of tfuture or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["DEFAULT_MERGES", "END_TOKEN", "train_bpe"]

END_TOKEN = "<|endoftext|>"
DEFAULT_MERGES = 320


def train_bpe(corpus: Iterable[str], merges: int = DEFAULT_MERGES) -> Tokenizer:
    """The byte-level BPE with ``256 + merges`` tokens and :data:`END_TOKEN` (``257 + merges``
    ids), trained on the strings of ``corpus`` (e.g. a text file's lines).

    Raises ``ImportError`` without the ``tokenizers`` package (``pip install -e '.[grammar]'``),
    ``ValueError`` for a bad ``merges`` or when the corpus holds fewer distinct merges than asked
    for.
    """
    if type(merges) is not int or not 0 <= merges <= 4096:
        raise ValueError(f"merges must be an int in [0, 4096], got {merges!r}")
    if isinstance(corpus, str):
        raise TypeError("corpus must be an iterable of strings (e.g. text.splitlines()), got one str")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "tfuture.testing.tokenizer needs the tokenizers package: from a clone of tfuture, "
            "pip install -e '.[grammar]'"
        ) from exc
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    if tok.get_vocab_size() != 256 + merges:
        raise ValueError(
            f"the corpus holds {tok.get_vocab_size() - 256} merges of frequency >= 2, asked for {merges}"
        )
    tok.add_special_tokens([END_TOKEN])
    return tok
