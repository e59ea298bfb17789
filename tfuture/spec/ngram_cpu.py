"""The numpy twin of :meth:`tfuture.spec.NGramDrafter.draft` for a history on the CPU.

Same drafts as the torch path (a test compares them), with numpy ops on small arrays (about a
microsecond each, against several for a torch op): the drafter runs on the CPU worker every
step. The match is incremental: ``hit`` marks positions ``p`` where the ``n`` tokens ending at
``p`` equal the request's last ``n``, built from ``n - 1`` with one comparison per ``n``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["draft_numpy"]


def draft_numpy(
    hist: np.ndarray,
    rows: np.ndarray,
    committed: np.ndarray,
    n_commit: np.ndarray,
    seq_lens: np.ndarray,
    bound: int,
    k: int,
    max_ngram: int,
    min_ngram: int,
) -> np.ndarray:
    """Write each request's committed tokens into ``hist`` (``[rows, max_len]`` int64, in place)
    and return ``[n, k]`` int64 drafts (see :class:`tfuture.spec.NGramDrafter`)."""
    n, width = committed.shape
    max_len = hist.shape[1]
    lens = np.clip(seq_lens, 1, max_len)
    take = np.minimum(np.arange(width), (n_commit - 1)[:, None])
    pos = np.clip((lens - n_commit)[:, None] + take, 0, max_len - 1)
    hist[rows[:, None], pos] = np.take_along_axis(committed, take, 1)
    h = hist[rows, :bound]
    lens = np.minimum(lens, bound)
    ends = np.arange(bound)
    # A match must end before the last token: its continuation starts at p + 1 <= len - 1.
    hit = ends <= (lens - 2)[:, None]
    at = np.arange(n)
    cont = np.full(n, -1, dtype=np.int64)
    for size in range(1, max_ngram + 1):
        if size > bound:
            break
        tail = h[at, np.maximum(lens - size, 0)]
        hit[:, size - 1 :] &= h[:, : bound - size + 1] == tail[:, None]
        hit[:, : size - 1] = False
        hit &= (lens > size)[:, None]
        if size >= min_ngram:
            latest = np.where(hit, ends, -1).max(axis=1)
            cont = np.where(latest >= 0, latest + 1, cont)  # a longer match wins
    picks = np.minimum(cont[:, None] + np.arange(k), (lens - 1)[:, None])
    last = h[at, lens - 1]
    return np.where((cont >= 0)[:, None], np.take_along_axis(h, np.maximum(picks, 0), 1), last[:, None])
