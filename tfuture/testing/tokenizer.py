"""A small byte-level BPE tokenizer, trained locally (no download) on a corpus shipped here.

    from tfuture.testing.tokenizer import END_TOKEN, tiny_tokenizer
    tok = tiny_tokenizer()                       # a tokenizers.Tokenizer, trained once per process
    eos = tok.token_to_id(END_TOKEN)             # the last id: tok.get_vocab_size() - 1

The corpus (``data/corpus.txt``: English prose and JSON snippets) is read through a path
relative to this module. Training is deterministic (a fixed corpus and merge count; the
same vocabulary with 1 or 16 threads): every process gets the same ids. Byte-level:
the 256 byte tokens come first, so every string can be encoded; the merges follow; the end
token is added last, as a special token (never produced by encoding text).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

END_TOKEN = "<|endoftext|>"
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
DEFAULT_MERGES = 320


@functools.cache
def tiny_tokenizer(merges: int = DEFAULT_MERGES) -> Tokenizer:
    """The byte-level BPE with ``256 + merges`` tokens and :data:`END_TOKEN` (``257 + merges`` ids).

    Cached: trained once per process and argument (well under a second). Raises ``ImportError``
    without the ``tokenizers`` package (``pip install tfuture[grammar]``), ``ValueError`` for a
    bad ``merges`` or when the corpus holds fewer distinct merges than asked for.
    """
    if type(merges) is not int or not 0 <= merges <= 4096:
        raise ValueError(f"merges must be an int in [0, 4096], got {merges!r}")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "tfuture.testing.tokenizer needs the tokenizers package: pip install tfuture[grammar]"
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
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    if tok.get_vocab_size() != 256 + merges:
        raise ValueError(
            f"the corpus {CORPUS} holds {tok.get_vocab_size() - 256} merges of frequency >= 2, "
            f"asked for {merges}"
        )
    tok.add_special_tokens([END_TOKEN])
    return tok
