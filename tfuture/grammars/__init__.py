"""Structured output: the grammar protocol (:mod:`tfuture.grammars.base`) and, with the
``grammar`` extra, the xgrammar adapter (:mod:`tfuture.grammars.xgrammar`, imported on use)."""

from tfuture.grammars.base import (
    MASK_KINDS,
    Grammar,
    Matcher,
    build_bitmask,
    check_grammar,
    full_bitmask,
    mask_requests,
    shared_vocab,
)

__all__ = [
    "MASK_KINDS",
    "Grammar",
    "Matcher",
    "build_bitmask",
    "check_grammar",
    "full_bitmask",
    "mask_requests",
    "shared_vocab",
]
