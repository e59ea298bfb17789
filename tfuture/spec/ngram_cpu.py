"""Prompt lookup for a history on the CPU: an incremental n-gram index per request.

Same drafts as :meth:`tfuture.spec.NGramDrafter._draft_torch` (a test compares them step after
step) while no position below a request's length changes, which holds for a request's own steps
(ids are not reused before ``release``), with a cost per step that grows with the tokens a
request committed, not with its length:
each request keeps its final tokens (every position before its ``seq_len``) and, per ``n``, a
dict from each ``n``-gram to the latest position where one ends that has a continuation
(``p <= len - 2``). A step adds the n-grams its new positions complete and looks up the request's
last ``n`` tokens, ``n`` from ``max_ngram`` down to ``min_ngram``: a few dict operations per
request where the vectorised match scanned every position (tens of numpy calls of several
microseconds each, every step, on the CPU worker's critical path).
"""

from __future__ import annotations

import numpy as np

__all__ = ["NGramIndex"]

_BULK = 16  # new positions above which a step indexes them in bulk


class _Lookup:
    """One request's final tokens and its n-gram index (``ends[n - 1]``: n-gram -> latest end)."""

    __slots__ = ("ends", "indexed", "tokens")

    def __init__(self, max_ngram: int) -> None:
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram)]
        self.indexed = 0  # the n-grams ending at positions < indexed are in ``ends``


class NGramIndex:
    """The per-request indexes of an :class:`tfuture.spec.NGramDrafter` on the CPU."""

    def __init__(self, k: int, max_ngram: int, min_ngram: int) -> None:
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self._by_req: dict[int, _Lookup] = {}

    def draft(
        self,
        hist: np.ndarray,
        req_ids: np.ndarray,
        rows: np.ndarray,
        committed: np.ndarray,
        n_commit: np.ndarray,
        seq_lens: np.ndarray,
    ) -> np.ndarray:
        """``[n, k]`` int64 drafts: request ``i`` committed the first ``n_commit[i]`` of
        ``committed [n, W]``, ending at ``seq_lens[i] - 1``. ``hist`` (``[rows, max_len]`` int64)
        holds each new request's earlier positions (its prompt, from the drafter's ``observe``),
        read at its first draft; committed tokens are kept here, not written there. A replayed
        draft (positions seen before) keeps the request's tokens before them."""
        width = hist.shape[1]
        out: list[list[int]] = []
        for rid, row, got, nc, length in zip(
            req_ids.tolist(),
            rows.tolist(),
            committed.tolist(),
            n_commit.tolist(),
            seq_lens.tolist(),
            strict=True,
        ):
            length = min(max(length, 1), width)
            nc = min(max(nc, 1), length)
            look = self._by_req.get(rid)
            if look is None:
                look = self._by_req[rid] = _Lookup(self.max_ngram)
            elif len(look.tokens) > length - nc:
                # These positions again (a replayed op): its tokens before them, indexed anew.
                kept = look.tokens[: length - nc]
                look = self._by_req[rid] = _Lookup(self.max_ngram)
                look.tokens = kept
            tokens = look.tokens
            if len(tokens) < length - nc:  # the prompt (the first draft), as observe wrote it
                tokens.extend(hist[row, len(tokens) : length - nc].tolist())
            tokens.extend(got[:nc])
            out.append(self._one(look, length))
        return np.array(out, dtype=np.int64).reshape(len(out), self.k)

    def _one(self, look: _Lookup, length: int) -> list[int]:
        tokens = look.tokens
        # The n-grams ending at p <= length - 2 have a continuation (at p + 1 <= length - 1);
        # a later end overwrites an earlier one: the latest wins.
        lo, hi = look.indexed, length - 1
        if hi - lo <= _BULK:  # a step's few new positions
            for p in range(lo, hi):
                for size, ends in enumerate(look.ends, start=1):
                    if size > p + 1:
                        break
                    ends[tuple(tokens[p + 1 - size : p + 1])] = p
        else:  # a prompt: per n, one dict.update over zips (the loop runs in C)
            for size, ends in enumerate(look.ends, start=1):
                first = max(lo, size - 1)
                if first >= hi:
                    break
                columns = [tokens[first - size + 1 + o : hi - size + 1 + o] for o in range(size)]
                ends.update(zip(zip(*columns, strict=True), range(first, hi), strict=True))
        look.indexed = max(lo, hi)
        for size in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = look.ends[size - 1].get(tuple(tokens[length - size : length]))
            if end is not None:  # its continuation's tokens, repeated (NGramDrafter's docstring)
                period = length - 1 - end
                return [tokens[end + 1 + j % period] for j in range(self.k)]
        return [tokens[length - 1]] * self.k

    def indexed(self, req_ids: np.ndarray) -> bool:
        """Whether every request of ``req_ids`` has drafted here before: then a step of theirs
        brings no position the index reads from the history (its committed tokens come with
        its draft)."""
        by_req = self._by_req
        return all(rid in by_req for rid in req_ids.tolist())

    def release(self, req_ids: np.ndarray) -> None:
        for rid in req_ids.tolist():
            self._by_req.pop(rid, None)

    def clear(self) -> None:
        self._by_req.clear()
