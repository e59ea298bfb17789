"""The grammar protocol a scheduler drives for structured output, one matcher per request.

A :class:`Grammar` (a compiled JSON schema, a toy automaton) knows the model's vocabulary size
``vocab`` and makes a fresh :class:`Matcher` per request. Per step the scheduler asks each
grammar request's matcher to fill its row of a packed host bitmask, then feeds it the token
the request sampled. The bitmask layout is xgrammar's: ``int32 [n, ceil(vocab / 32)]``, bit
``j % 32`` of word ``j // 32`` set where token ``j`` is allowed (see
:mod:`tfuture.kernels.bitmask`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from tfuture.core.batch import Batch
from tfuture.kernels.bitmask import bitmask_words, unpack_bitmask

MASK_KINDS = ("bitmask", "bool")


@runtime_checkable
class Matcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write row ``row`` of ``bitmask`` (int32 ``[n, ceil(vocab / 32)]`` on the host): the
        tokens allowed next. Changes no state; every other row is left as it is."""
        ...

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """True once the request's output is complete (e.g. its stop token was accepted)."""
        ...

    # Optional: ``rollback(n)``, undo the last ``n`` accepted tokens. A speculative scheduler
    # walks a matcher through a request's drafts to build a mask row per draft, then rolls it
    # back; a request whose matcher lacks it makes no drafts (it decodes plainly).
    #
    # Optional, called when present once the request ends on a stop token or its grammar's end:
    # ``invalid() -> str | None``, why the accepted output is not in the grammar's language after
    # all (a matcher that knows a bug of its own), or None. A scheduler then finishes the request
    # with reason "invalid" and warns, instead of returning the output as valid.


def invalid_output(matcher: Matcher) -> str | None:
    """The matcher's optional ``invalid()``: why its accepted output is not valid, or None."""
    check = getattr(matcher, "invalid", None)
    return check() if callable(check) else None


@runtime_checkable
class Grammar(Protocol):
    """A compiled grammar: ``vocab`` (the model's logits width) and a matcher per request."""

    @property
    def vocab(self) -> int: ...

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""
        ...


def check_grammar(name: str, grammar: object) -> int:
    """Raise ``TypeError``/``ValueError`` unless ``grammar`` is a :class:`Grammar`; its ``vocab``."""
    if not isinstance(grammar, Grammar):
        raise TypeError(
            f"{name} must be a grammar (a vocab attribute and a matcher() method, "
            f"tfuture.grammars.Grammar), got {type(grammar).__name__}"
        )
    vocab = grammar.vocab
    if type(vocab) is not int or vocab < 1:
        raise ValueError(f"{name}.vocab must be an int >= 1, got {vocab!r}")
    return vocab


def shared_vocab(grammars: Mapping[str, object]) -> int | None:
    """The ``vocab`` all of ``grammars`` (``{name: grammar}``) share, None for none; each is
    checked with :func:`check_grammar`, and a mismatch raises ``ValueError`` naming them."""
    vocabs = {name: check_grammar(name, g) for name, g in grammars.items()}
    if len(set(vocabs.values())) > 1:
        raise ValueError(f"every grammar must have the same vocab, got {vocabs}")
    return next(iter(vocabs.values()), None)


def full_bitmask(n: int, vocab: int) -> np.ndarray:
    """A host bitmask ``int32 [n, ceil(vocab / 32)]`` that allows every token (all bits set)."""
    return np.full((n, bitmask_words(vocab)), -1, dtype=np.int32)


def build_bitmask(matchers: Sequence[Matcher | None], vocab: int, kind: str = "bitmask") -> np.ndarray:
    """One mask row per entry of ``matchers``: the matcher's allowed tokens, or every token for None.

    ``kind="bitmask"`` returns the packed ``int32 [n, ceil(vocab / 32)]`` host bitmask;
    ``"bool"`` the same unpacked to ``bool [n, vocab]`` (the convenience, 8x the bytes).
    """
    if kind not in MASK_KINDS:
        raise ValueError(f"kind must be one of {MASK_KINDS}, got {kind!r}")
    bitmask = full_bitmask(len(matchers), vocab)
    for row, m in enumerate(matchers):
        if m is not None:
            m.fill_bitmask(bitmask, row)
    return bitmask if kind == "bitmask" else unpack_bitmask(bitmask, vocab)


def mask_requests(batch: Batch) -> np.ndarray:
    """Indices into the batch's sampling requests (``np.flatnonzero(batch.sample)``) whose sample
    waits for a mask (``batch.delayed`` True), in batch order. ``[m]`` int64."""
    return np.flatnonzero(batch.delayed[batch.sample]).astype(np.int64)
