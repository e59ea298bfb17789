"""The test tokenizer: :func:`tfuture.testing.tokenizer.train_bpe` on ``tests/data/corpus.txt``.

from tiny_bpe import END_TOKEN, tiny_tokenizer
tok = tiny_tokenizer()                       # trained once per process and merge count
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from tfuture.testing.tokenizer import DEFAULT_MERGES, END_TOKEN, train_bpe

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["CORPUS", "DEFAULT_MERGES", "END_TOKEN", "tiny_tokenizer"]

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


@functools.cache
def tiny_tokenizer(merges: int = DEFAULT_MERGES) -> Tokenizer:
    """The byte-level BPE trained on :data:`CORPUS` (English prose and JSON snippets), cached:
    trained once per process and argument (well under a second)."""
    return train_bpe(CORPUS.read_text(encoding="utf-8").splitlines(), merges)
