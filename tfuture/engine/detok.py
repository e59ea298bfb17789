"""Tokenizers at the front door: encode a prompt, decode an output, and decode a stream.

Two kinds of tokenizer work: a ``transformers`` tokenizer (``encode(text) -> list[int]``) and a
``tokenizers.Tokenizer`` (``encode(text).ids``); both decode with ``decode(ids,
skip_special_tokens=True)``. Nothing here imports either package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDecoder", "decode", "encode", "tokenizer_eos"]

_REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of an incomplete character


def encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids (a transformers tokenizer adds its special tokens, e.g. BOS)."""
    enc = tokenizer.encode(text)
    ids = getattr(enc, "ids", enc)  # tokenizers.Encoding, or a list of ids
    return [int(t) for t in ids]


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of ``ids``, special tokens left out."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))


def tokenizer_eos(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's end token ids (a transformers tokenizer's ``eos_token_id``), or ``()``."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, list | tuple) else [eos]))


class IncrementalDecoder:
    """Text deltas of a growing token sequence whose concatenation is the sequence's text.

    A token may end inside a multi-byte character (byte-level BPE), and a SentencePiece token's
    leading space depends on what comes before it, so a token's text is not the decode of the
    token alone. :meth:`push` decodes a short window (the tokens since the last emitted text,
    plus the ones before them) twice, with and without the new tokens, and emits the difference
    only when it does not end in an incomplete character (U+FFFD); those bytes wait for the
    next token. :meth:`flush` emits what is left at the end (an incomplete character as
    U+FFFD, as a full decode writes it). Each push decodes a few tokens, not the whole
    sequence (the window scheme of vLLM's incremental detokenizer).
    """

    __slots__ = ("_ids", "_prefix", "_read", "text", "tokenizer")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # text was emitted for the tokens before this
        self.text = ""  # everything emitted so far

    def push(self, ids: Sequence[int]) -> str:
        """Add ``ids``; the new text that is complete now ("" when none is)."""
        self._ids.extend(int(t) for t in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (at the end of the sequence)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = decode(self.tokenizer, self._ids[self._prefix : self._read])
        after = decode(self.tokenizer, self._ids[self._prefix :])
        if len(after) <= len(before) and not final:
            return ""  # e.g. special tokens only, or bytes of a character still incomplete
        if after.endswith(_REPLACEMENT) and not final:
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
