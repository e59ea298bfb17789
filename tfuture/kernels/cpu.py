"""The fast CPU path of every kernel family, in numpy on the tensors' own memory.

CPU tensors run these functions unless ``TRITON_INTERPRET=1`` (see ``_common.use_triton``). A
torch op costs a few microseconds of dispatch on the host; numpy on a ``t.numpy()`` view of the
same memory costs far less, and on the host reading a count (to skip work) costs no device sync.
Results, the error flag included, equal the kernels'; the launchers check arguments first.
Outputs are passed in explicitly, so this module imports no kernel family (no cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch
from torch import Tensor

from tfuture.kernels._common import Slots
from tfuture.kernels._field_layout import as_words

Tensors: TypeAlias = Sequence[Tensor]
Err: TypeAlias = Tensor | None


def _flag(err: Err, bad: np.ndarray, values: np.ndarray) -> None:
    """The kernels' error flag: ``err[0] += count(bad)``, ``err[1] = min(err[1], values[bad])``."""
    if err is not None and bad.any():
        e = err.numpy()
        e[0] += int(bad.sum())
        e[1] = min(int(e[1]), int(values[bad].min()))


def _resolve_np(ids: np.ndarray, token_map: np.ndarray, err: Err) -> None:
    neg = ids < 0
    if not neg.any():
        return
    # -id in the ids' dtype: the dtype minimum wraps to itself and stays negative, so it fails
    # the bounds check below like any slot past the map (never read).
    slots = -ids[neg]
    if slots.min() >= 1 and slots.max() < token_map.size:
        ids[neg] = token_map[slots]
        return
    where = np.flatnonzero(neg)
    slots = slots.astype(np.int64)
    ok = (slots >= 1) & (slots < token_map.size)
    ids[where[ok]] = token_map[slots[ok]]
    if err is not None:
        _flag(err, ~ok, ids[where])
        ids[where[~ok]] = 0


def resolve_(ids: Tensor, token_map: Tensor, err: Err) -> Tensor:
    """In place: every placeholder ``-s`` in ``ids`` with ``1 <= s < n_slots`` -> ``token_map[s]``."""
    _resolve_np(ids.numpy(), token_map.numpy(), err)
    return ids


def prepare(
    tokens: Tensor, seg_starts: Tensor, prefix_lens: Tensor, token_map: Tensor, out: Tensors, err: Err
) -> None:
    """Fused input preparation into ``out = (input_ids, positions, last_rows)``."""
    seg = seg_starts.numpy().astype(np.int64, copy=False)
    total = max(min(int(seg[-1]), tokens.numel()), 0)
    # Resolve in the stream's dtype, then cast into the output, as the kernel does.
    live = tokens.numpy()[:total].copy()
    _resolve_np(live, token_map.numpy(), err)
    ids, pos, last = (t.numpy() for t in out)
    ids[:total] = live
    ids[total:] = 0
    pos[total:] = 0
    if seg.size == 1:
        # No request owns a row: seg_starts == [0] leaves none live (a bad seg_starts[0] too).
        pos[:] = 0
    else:
        rows = np.arange(total)
        # The request of row r is the largest q with seg_starts[q] <= r (0 if none), as the
        # kernel's binary search: one searchsorted, about 2x cheaper than repeat+diff at 256.
        req = np.searchsorted(seg[1:-1], rows, side="right")
        pos[:total] = prefix_lens.numpy()[req] + rows - seg[req]
        last[:] = np.maximum(np.minimum(seg[1:], total) - 1, 0)


def _slot_rows(
    slots: Slots, n_slots: int, negated: bool, err: Err, in_range: bool = False
) -> tuple[np.ndarray | slice, np.ndarray | None]:
    """``(rows, ok)``: the buffer rows named, and which are in range (None: all). Flags the rest.

    ``in_range``: the caller guarantees every slot lies in ``[1, n_slots)``; no check then.
    """
    if isinstance(slots, range):
        if not slots or (slots.start >= 1 and slots.stop <= n_slots):
            return slice(slots.start, slots.stop), None
        idx = np.arange(slots.start, slots.stop)
    else:
        idx = slots.numpy()
        if in_range or not idx.size:
            return -idx if negated else idx, None
        # Negate in int64: the int32 minimum then lands out of range instead of wrapping.
        idx = -idx.astype(np.int64) if negated else idx
    # On the host a bounds check is two reductions, and the common all-good case needs no mask.
    if idx.min() >= 1 and idx.max() < n_slots:
        return idx, None
    idx = idx.astype(np.int64, copy=False)
    ok = (idx >= 1) & (idx < n_slots)
    _flag(err, ~ok, -idx)
    return idx, ok


def store(token_map: Tensor, slots: Slots, values: Tensor, err: Err) -> None:
    """``token_map[slots[i]] = values[i]`` where ``1 <= slots[i] < n_slots``; the rest is flagged."""
    dst, vals = token_map.numpy(), values.numpy()
    rows, ok = _slot_rows(slots, dst.size, False, err)
    if err is not None:
        # A negative token would resolve into a placeholder-like id: store 0 and flag it.
        negative = vals < 0 if ok is None else ok & (vals < 0)
        if negative.any():
            _flag(err, negative, vals)
            vals = np.where(negative, 0, vals)
    if ok is None:
        dst[rows] = vals
    else:
        assert isinstance(rows, np.ndarray)
        dst[rows[ok]] = vals[ok]


def store_fields(
    buffers: Tensors, slots: Slots, values: Tensors, negated: bool, err: Err, in_range: bool = False
) -> None:
    """``buffers[f][slots[i]] = values[f][i]`` bit for bit; slots out of range are flagged, not written.

    ``in_range``: the caller guarantees every slot lies in ``[1, n_slots)`` (no bounds check).
    """
    rows, ok = _slot_rows(slots, buffers[0].shape[0], negated, err, in_range)
    for buf, val in zip(buffers, values, strict=True):
        words = as_words(val).numpy()
        if ok is None:
            as_words(buf).numpy()[rows] = words
        else:
            assert isinstance(rows, np.ndarray)
            as_words(buf).numpy()[rows[ok]] = words[ok]


def gather_fields(
    buffers: Tensors, slots: Slots, out: Tensors | None, negated: bool, err: Err, in_range: bool = False
) -> list[Tensor]:
    """``out[f][i] = buffers[f][slots[i]]`` bit for bit; rows of slots out of range are zero bits.

    ``out=None`` returns fresh tensors made by numpy's gather (no separate allocation).
    ``in_range``: as in :func:`store_fields`.
    """
    rows, ok = _slot_rows(slots, buffers[0].shape[0], negated, err, in_range)
    if ok is not None:
        # Rare (a bad slot): gather row 0 in their place, then zero those rows.
        assert isinstance(rows, np.ndarray)
        rows = np.where(ok, rows, 0)
    res = []
    for i, buf in enumerate(buffers):
        src = as_words(buf).numpy()
        if out is None:
            words = src[rows].copy() if isinstance(rows, slice) else np.take(src, rows, axis=0)
            t = torch.from_numpy(words)
            res.append(t if t.dtype == buf.dtype else t.view(buf.dtype))
        else:
            words = as_words(out[i]).numpy()
            if isinstance(rows, slice):
                words[...] = src[rows]
            else:
                np.take(src, rows, axis=0, out=words)
            res.append(out[i])
        if ok is not None:
            words[~ok] = 0
    return res


def prepare_spec(last: Tensor, seq_lens: Tensor, fields: Tensors, out: Tensors, err: Err) -> None:
    """Speculative verify rows into ``out = (input_ids, positions, n_draft)``; ``fields`` are the
    slot fields ``(tokens, accept_len, new_seq_len, draft_tokens)``."""
    tokens, accept_len, new_seq_len, draft_tokens = fields
    n, n_tok, k = last.numel(), tokens.shape[1], draft_tokens.shape[1]
    src = last.numpy().astype(np.int64)
    future = src < 0
    slots = -src
    ok = future & (slots >= 1) & (slots < accept_len.shape[0])
    _flag(err, future & ~ok, src)
    safe = np.where(ok, slots, 0)
    acc = np.clip(accept_len.numpy()[safe], 1, n_tok)
    tok = np.where(ok, tokens.numpy()[safe, acc - 1], np.where(future, 0, src))
    seq = np.where(ok, new_seq_len.numpy()[safe], np.where(future, 1, seq_lens.numpy()))
    ids, pos, n_draft = (t.numpy() for t in out)
    ids[:n, 0] = tok
    ids[:n, 1:] = np.where(ok[:, None], draft_tokens.numpy()[safe], 0)
    pos[:n] = np.maximum(seq - 1, 0)[:, None] + np.arange(k + 1)
    n_draft[:n] = np.where(ok, k, 0)
    for t in (ids, pos, n_draft):
        t[n:] = 0
