"""The CPU path of the packed grammar bitmask (:mod:`tfuture.kernels.bitmask`), in numpy on the
tensors' own memory: unpack the words, write ``-inf`` where a bit is 0 (see
:mod:`tfuture.kernels.cpu` for the other families)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from tfuture.kernels._field_layout import as_words


def unpack_bits(words: np.ndarray, vocab: int) -> np.ndarray:
    """``bool [n, vocab]``: bit ``j % 32`` of ``words[:, j // 32]`` (int32 ``[n, W]``, 32 * W >= vocab).

    The packed grammar layout (xgrammar's, llguidance's): little-endian within each word.
    """
    little = np.ascontiguousarray(words, dtype="<i4")
    bits = np.unpackbits(little.view(np.uint8), axis=1, count=vocab, bitorder="little")
    return bits.view(np.bool_)


@functools.cache
def _neg_inf_bits(dtype: torch.dtype) -> np.ndarray:
    """The bits of ``-inf`` in float ``dtype``, as the integer word that :func:`as_words` views."""
    word = as_words(torch.tensor(float("-inf"), dtype=dtype))
    return word.numpy()


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor | None) -> None:
    """In place: ``logits[r, j] = -inf`` where bit ``j`` of ``bitmask[i]`` is 0, ``r = rows[i]``
    (``i`` without ``rows``); rows outside ``[0, n)`` are skipped, as the kernel skips them.

    Written as words (bf16 has no numpy dtype): an allowed logit keeps its bits exactly. With
    ``rows``, one ``putmask`` per bitmask row: duplicate rows then mask the union, as the kernel.
    (``putmask`` is about 2x faster than ``copyto(where=)``, as fast as torch's ``masked_fill_``.)
    """
    n, vocab = logits.shape
    if vocab == 0 or bitmask.shape[0] == 0:
        return
    dst = as_words(logits).numpy()
    banned = unpack_bits(np.invert(bitmask.numpy()), vocab)
    neg_inf = _neg_inf_bits(logits.dtype)
    if rows is None:
        np.putmask(dst, banned, neg_inf)
        return
    idx = rows.numpy()
    for i in np.flatnonzero((idx >= 0) & (idx < n)).tolist():
        np.putmask(dst[idx[i]], banned[i], neg_inf)
